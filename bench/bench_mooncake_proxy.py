"""Benchmark: the proxy against a direct-to-decode run, in the same invocation.

    python bench/bench_mooncake_proxy.py --quick  # a minute: the lean targets, 1 and 32 at once
    python bench/bench_mooncake_proxy.py          # the full sweep, every target (about 15 minutes)

It starts a fake cluster that is cheap enough not to be the bottleneck (a prefill with its
bootstrap server in one process, a decode in another: each answers from precomputed bytes), the
proxy as users start it (``python mooncake_proxy.py ...``), and a load generator in a process of
its own. Every scenario runs direct-to-decode and through each target back to back, so that the
ratios compare runs on the same noisy machine minutes apart at most. The targets: the proxy
twice (with --log-level WARNING, and with its default logging, an access line per request);
``vllm-router``, when its binary is installed, twice too (lean: --policy round_robin and
--log-level warning; and with its defaults: cache_aware, a line per request); and yardsticks:
the PD flow with both upstream legs on asyncio protocols and nothing else (the floor of this
design), and, in the full run, the same in plain aiohttp. Figures are medians of the
per-request samples; the report ends with the proxy against the lean router, figure by
figure, and against the floor.

Reports per scenario requests/s, streamed chunks/s, TTFT and end-to-end p50/p99, proxy CPU ms per
request (from /proc/<pid>/stat) and peak RSS, as a table, as JSON (``--json``) and as a PNG plot
(``--plot``, when matplotlib is installed).

The fake cluster's wire format follows ../../shared/PROTOCOL.md but checks nothing: correctness is
the test suite's job, this measures what the proxy costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, cast

import aiohttp
import httptools
from aiohttp import web

# The daemon is at the repository's top and the fakes in tests/: run as a script, only bench/
# is on the path.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
sys.path.insert(2, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_vllm import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository: the daemon at its top, the fakes in tests/
TOKENS = 16
LONG_TOKENS = 1000  # the long-answer scenario: the relay's cost per chunk dominates
# Seconds between its tokens, as a decode paces them (500 tokens/s): written back to back they
# would arrive at the proxy in a few large reads, and the cost per chunk would not show.
LONG_TOKEN_GAP = 0.002
PROMPT = "x" * 200  # the 200-byte prompt of the table
RAW_REF = "protocol legs (ref)"  # raw_proxy_app's target name
PROXY = "proxy"  # as deployed for throughput: --log-level WARNING, no line per request
PROXY_LOGGING = "proxy, default logging"  # its defaults: an access line per request
ROUTER = "vllm-router, lean"  # --policy round_robin --log-level warning
ROUTER_DEFAULTS = "vllm-router, defaults"  # cache_aware, a log line per request
# What each target is, for the report's legend.
LEGEND: Final = {
    "direct": "the client talks to the decode itself: what no proxy costs",
    PROXY: "this proxy, --log-level WARNING (no line per request)",
    PROXY_LOGGING: "this proxy with its defaults (an access line per request)",
    ROUTER: "vLLM's Rust router, --policy round_robin --log-level warning",
    ROUTER_DEFAULTS: "vLLM's Rust router with its defaults (cache_aware, a line per request)",
    "plain aiohttp (ref)": "a yardstick: the PD flow in plain aiohttp, nothing else",
    RAW_REF: "a yardstick: both legs on asyncio protocols, nothing else (this design's floor)",
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


# --- the fake cluster: precomputed answers, as cheap as aiohttp allows


def sse_chunks(chat: bool, tokens: int = TOKENS, ids: bool = False) -> list[bytes]:
    """A stream's chunks as vLLM 0.32 writes them (compact; ``ids``: with return_token_ids,
    which the proxy asks for on streams it could migrate)."""
    chunks = []
    for index in range(tokens):
        finish = "length" if index == tokens - 1 else None
        token_ids = [1000 + index] if ids else None
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "delta": {"content": " tok"}, "logprobs": None}
            choice |= {"finish_reason": finish, "token_ids": token_ids}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish}
            prompt_ids = list(range(50)) if ids and index == 0 else None
            choice |= {"stop_reason": None, "prompt_token_ids": prompt_ids, "token_ids": token_ids}
            kind = "text_completion"
        frame = {
            "id": "cmpl-bench",
            "object": kind,
            "created": 0,
            "model": "bench",
            "choices": [choice],
        }
        chunks.append(b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return chunks


COMPLETE = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "text": " tok" * TOKENS, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 50, "completion_tokens": TOKENS, "total_tokens": 50 + TOKENS},
    }
).encode()
PREFILLED = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "text": " tok", "finish_reason": "length"}],
        "kv_transfer_params": None,
    }
).encode()


def fake_app(role: str) -> web.Application:
    chunks = {
        (chat, tokens, ids): sse_chunks(chat, tokens, ids)
        for chat in (False, True)
        for tokens in (TOKENS, LONG_TOKENS)
        for ids in (False, True)
    }

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def query(request: web.Request) -> web.Response:
        return web.json_response({"0": {"engine_id": "bench-engine_dp0", "worker_addr": {}}})

    async def models(request: web.Request) -> web.Response:
        # As vLLM lists its model: the proxy routes each request to the instances that serve it.
        card = {"id": "bench", "object": "model", "owned_by": "vllm", "root": "bench"}
        return web.json_response({"object": "list", "data": [card | {"parent": None}]})

    async def completion(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if role == "prefill":
            return web.Response(body=PREFILLED, content_type="application/json")
        if not body.get("stream"):
            return web.Response(body=COMPLETE, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        tokens = LONG_TOKENS if body.get("max_tokens", 0) >= LONG_TOKENS else TOKENS
        ids = bool(body.get("return_token_ids"))
        frames = chunks[request.path.endswith("/chat/completions"), tokens, ids]
        if body.get("bench_idle"):
            # An open stream that sends one token and then waits: the idle-memory scenario.
            await response.write(frames[0])
            await asyncio.Event().wait()
        gap = LONG_TOKEN_GAP if tokens == LONG_TOKENS else 0.0
        for frame in frames:
            await response.write(frame)  # one write per token, as vLLM streams them
            if gap:
                await asyncio.sleep(gap)
        await response.write_eof()
        return response

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_get("/query", query)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    return app


def run_fake(role: str, port: int) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    web.run_app(fake_app(role), host="127.0.0.1", port=port, print=None, access_log=None)


# --- a yardstick: the plain, unoptimised aiohttp PD proxy of the table


def leg_bodies(
    body: dict[str, Any], prefill: str, engine: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two legs' bodies, as the yardsticks build them: the least the fakes need."""
    rid = os.urandom(8).hex()
    prefill_body = dict(body, stream=False, max_tokens=1)
    prefill_body.pop("stream_options", None)
    prefill_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": rid}
    decode_body = dict(body)
    decode_body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "remote_engine_id": engine,
        "remote_bootstrap_addr": prefill,
        "transfer_id": rid,
    }
    return prefill_body, decode_body


def yardstick_app(
    resources: Callable[[web.Application], Any],
    completion: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> web.Application:
    """A yardstick's application: its resources (a cleanup context), /health, completions."""

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(client_max_size=1 << 30)
    app.cleanup_ctx.append(resources)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completion)
    return app


def plain_proxy_app(prefill: str, decode: str) -> web.Application:
    """Both legs at once and the decode's bytes passed on; no health, metrics or failover.

    Run beside the real proxy, it tells how fast this machine is: the issue's table has such
    a proxy at 0.44 ms CPU per streamed request on its machine.
    """
    state: dict[str, Any] = {}

    async def session_ctx(app: web.Application) -> Any:
        state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with state["session"].get(prefill + "/query") as query:
            state["engine"] = (await query.json())["0"]["engine_id"]
        yield
        await state["session"].close()

    async def completion(request: web.Request) -> web.StreamResponse:
        session = state["session"]
        prefill_body, decode_body = leg_bodies(await request.json(), prefill, state["engine"])

        async def send_prefill() -> None:
            async with session.post(prefill + request.path, json=prefill_body) as answer:
                await answer.read()

        prefill_task = asyncio.create_task(send_prefill())
        async with session.post(decode + request.path, json=decode_body) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        await prefill_task
        return response

    return yardstick_app(session_ctx, completion)


def run_plain_proxy(prefill: str, decode: str, port: int) -> None:
    app = plain_proxy_app(prefill, decode)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- a second yardstick: the same PD proxy with both upstream legs below aiohttp's client


class RawLeg(asyncio.Protocol):
    """One keep-alive connection to an upstream, its answers parsed by httptools (llhttp, as
    uvicorn uses it): the body goes to ``sink`` in the callback that parsed it, with no task
    woken per chunk, or is kept until a sink is set."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sink: Callable[[bytes], None] | None = None
        self.kept: list[bytes] = []
        self.reusable = False
        self.content_type = b"application/json"
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[int] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()

    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.head, self.done = loop.create_future(), loop.create_future()
        self.sink, self.kept, self.reusable = None, [], False
        self.transport.writelines((head % len(body), body))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.sink is None:
            self.kept.append(body)
        else:
            self.sink(body)

    def on_message_complete(self) -> None:
        # Asked here: once the parser has moved on, it reads as a message without a length.
        self.reusable = self.parser.should_keep_alive()
        self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        for waiter in (self.head, self.done):
            if not waiter.done():
                waiter.set_exception(ConnectionError("upstream closed"))


def raw_proxy_app(prefill: str, decode: str) -> web.Application:
    """plain_proxy_app's flow on aiohttp's server, with both legs on RawLeg: a request head
    built once per upstream, a keep-alive pool, and the decode's body framed as chunks and
    written to the client's transport from the parser's callback.

    Not a product: no backpressure, timeouts, failover or accounting. The proxy's legs are
    built the same way (HttpLeg, UpstreamPool) with all of that: this is their floor on this
    machine, and the distance to it is what the proxy's own work costs."""
    state: dict[str, Any] = {}
    idle: dict[str, list[RawLeg]] = {prefill: [], decode: []}
    heads = {
        base: b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        % base.split("//")[1].encode()
        + b"Content-Length: %d\r\n\r\n"
        for base in (prefill, decode)
    }

    async def engine_ctx(app: web.Application) -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.get(prefill + "/query") as query,
        ):
            state["engine"] = (await query.json())["0"]["engine_id"]
        yield
        for legs in idle.values():
            for leg in legs:
                if leg.transport is not None:
                    leg.transport.close()

    async def leg(base: str, body: bytes) -> RawLeg:
        """A pooled connection that is still open, else a new one; the request sent on it."""
        chosen = None
        while idle[base] and chosen is None:
            kept = idle[base].pop()
            chosen = kept if kept.transport and not kept.transport.is_closing() else None
        if chosen is None:
            host, port = base.split("//")[1].split(":")
            loop = asyncio.get_running_loop()
            _, chosen = await loop.create_connection(RawLeg, host, int(port))
        chosen.send(heads[base], body)
        return chosen

    async def completion(request: web.Request) -> web.StreamResponse:
        prefill_body, decode_body = leg_bodies(await request.json(), prefill, state["engine"])
        legs: dict[str, RawLeg] = {}
        try:
            legs[prefill] = await leg(prefill, json.dumps(prefill_body).encode())
            upstream = legs[decode] = await leg(decode, json.dumps(decode_body).encode())
            response = web.StreamResponse(status=await upstream.head)
            response.headers["Content-Type"] = upstream.content_type.decode()
            response.enable_chunked_encoding()
            await response.prepare(request)
            client = request.transport
            assert client is not None

            def relay(chunk: bytes) -> None:
                client.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))

            upstream.sink = relay
            for chunk in upstream.kept:
                relay(chunk)
            await upstream.done
            await response.write_eof()
            await legs[prefill].done
            return response
        finally:  # back to the pool once answered whole, else closed
            for base, used in legs.items():
                if used.reusable and used.transport and not used.transport.is_closing():
                    idle[base].append(used)
                elif used.transport is not None:
                    used.transport.close()

    return yardstick_app(engine_ctx, completion)


def run_raw_proxy(prefill: str, decode: str, port: int) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()  # as the proxy runs
    app = raw_proxy_app(prefill, decode)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the load generator (runs in a process of its own)


@dataclass
class Sample:
    ttft: float
    total: float
    chunks: int
    ok: bool


async def load(
    url: str,
    concurrency: int,
    seconds: float,
    max_requests: int,
    stream: bool,
    prompt_bytes: int,
    both_legs: str | None,
    max_tokens: int = TOKENS,
) -> dict[str, Any]:
    """Keep `concurrency` requests in flight for `seconds` (bounded by `max_requests`)."""
    prompt = "x" * prompt_bytes
    body: dict[str, Any] = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
    }
    payload = json.dumps(body).encode()
    samples: list[Sample] = []
    deadline = time.monotonic() + seconds
    started_count = 0
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        # A client doing the proxy's job itself sends both legs at once, bodies made in
        # advance: what is left is the cost of moving the bytes, not of building them.
        prefill_payload = json.dumps(dict(body, stream=False, max_tokens=1)).encode()
        decode_payload = json.dumps(dict(body, kv_transfer_params={"transfer_id": "x"})).encode()

        async def one() -> None:
            started = time.monotonic()
            prefill_task = None
            data = payload
            if both_legs:
                prefill_task = asyncio.create_task(
                    session.post(both_legs, data=prefill_payload, headers=headers)
                )
                data = decode_payload
            async with session.post(url, data=data, headers=headers) as response:
                first = None
                chunks = 0
                async for _ in response.content.iter_any():
                    if first is None:
                        first = time.monotonic()
                    chunks += 1
                ok = response.status == 200
            if prefill_task is not None:
                (await prefill_task).release()
            end = time.monotonic()
            samples.append(Sample((first or end) - started, end - started, chunks, ok))

        async def worker() -> None:
            nonlocal started_count
            while time.monotonic() < deadline and started_count < max_requests:
                started_count += 1
                await one()

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - began
    return {
        "elapsed": elapsed,
        "samples": [asdict(s) for s in samples],
    }


async def idle_streams(url: str, count: int, hold: float) -> dict[str, Any]:
    """Open `count` streams that stay idle, hold them `hold` seconds, then close them all."""
    body = json.dumps(
        {
            "model": "bench",
            "prompt": PROMPT,
            "max_tokens": TOKENS,
            "stream": True,
            "bench_idle": True,
        }
    ).encode()
    connector = aiohttp.TCPConnector(limit=0)
    opened = 0
    async with aiohttp.ClientSession(connector=connector) as session:
        responses = []

        async def open_one() -> None:
            nonlocal opened
            response = await session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            )
            await response.content.readany()
            responses.append(response)
            opened += 1

        sem = asyncio.Semaphore(200)

        async def gated() -> None:
            async with sem:
                await open_one()

        await asyncio.gather(*(gated() for _ in range(count)))
        print(json.dumps({"opened": opened}), flush=True)
        await asyncio.sleep(hold)
        for response in responses:
            response.close()
    return {"opened": opened}


def loadgen_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--max-requests", type=int, default=10**9)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--prompt-bytes", type=int, default=len(PROMPT))
    parser.add_argument("--both-legs", default=None, help="prefill URL: send both legs")
    parser.add_argument("--max-tokens", type=int, default=TOKENS)
    parser.add_argument("--idle", type=int, default=0)
    parser.add_argument("--hold", type=float, default=3)
    parser.add_argument("--out", help="write the samples here (a pipe would fill up)")
    args = parser.parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    if args.idle:
        result = asyncio.run(idle_streams(args.url, args.idle, args.hold))
    else:
        result = asyncio.run(
            load(
                args.url,
                args.concurrency,
                args.seconds,
                args.max_requests,
                args.stream,
                args.prompt_bytes,
                args.both_legs,
                args.max_tokens,
            )
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result))


# --- process bookkeeping


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / CLOCK_TICKS


def rss_kib(pid: int) -> float:
    fields = Path(f"/proc/{pid}/statm").read_text().split()
    return int(fields[1]) * PAGE_SIZE / 1024


def tree_pids(pid: int) -> list[int]:
    """The process and its children (the --workers processes)."""
    pids = [pid]
    with contextlib.suppress(FileNotFoundError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            pids += tree_pids(int(child))
    return pids


def wait_http(url: str, seconds: float = 20) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as response:
            if response.status == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer 200 within {seconds} s")


@dataclass
class Target:
    name: str
    url: str  # base URL requests go to
    pid: int | None = None  # the process whose CPU and memory count as "the proxy"
    process: subprocess.Popen[bytes] | None = None


@dataclass
class Result:
    scenario: str
    target: str
    concurrency: int
    stream: bool
    requests: int
    errors: int
    rps: float
    chunks_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    cpu_ms_per_request: float | None
    peak_rss_mib: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def module_at(revision: str | None) -> Path:
    """A directory holding mooncake_proxy.py: this one's, or ``revision``'s (git show)."""
    if revision is None:
        return ROOT
    where = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:mooncake_proxy.py"],
        check=True, capture_output=True,
    )  # fmt: skip
    (where / "mooncake_proxy.py").write_bytes(shown.stdout)
    return where


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.processes: list[subprocess.Popen[bytes]] = []
        self.results: list[Result] = []

    def spawn(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(argv, **kwargs)
        self.processes.append(process)
        return process

    def start_cluster(self) -> None:
        self.prefill_port, self.decode_port = free_port(), free_port()
        self.bootstrap_port = self.prefill_port  # the prefill fake serves /query itself
        for role, port in (("prefill", self.prefill_port), ("decode", self.decode_port)):
            self.spawn([sys.executable, __file__, "fake", role, str(port)])
        self.prefill_url = f"http://127.0.0.1:{self.prefill_port}"
        self.decode_url = f"http://127.0.0.1:{self.decode_port}"
        wait_http(self.prefill_url + "/health")
        wait_http(self.decode_url + "/health")

    def start_proxy(
        self,
        workers: int = 1,
        env: dict[str, str] | None = None,
        revision: str | None = None,
        lean: bool = True,
    ) -> Target:
        """The proxy as users start it; with ``revision``, that commit's mooncake_proxy.py
        (for an A/B of two builds in one invocation, on one cluster, taking turns). ``lean``:
        with --log-level WARNING, else with its default logging (an access line a request)."""
        port = free_port()
        script = module_at(revision) / "mooncake_proxy.py"
        argv = [
            sys.executable, str(script), "--port", str(port),
            "--prefill", self.prefill_url, str(self.bootstrap_port),
            "--decode", self.decode_url,
        ]  # fmt: skip
        if lean:
            argv += ["--log-level", "WARNING"]
        if workers > 1:
            argv += ["--workers", str(workers)]
        # Its access lines go where a service's log goes; here, nowhere (not a pipe to fill).
        quiet = {} if lean else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        process = self.spawn(argv, env={**os.environ, **(env or {})}, **quiet)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        name = f"proxy (workers={workers})" if workers > 1 else PROXY if lean else PROXY_LOGGING
        if revision is not None:
            name = f"proxy at {revision}"
        return Target(name, url, process.pid, process)

    def start_yardstick(self, kind: str, name: str) -> Target:
        """One of this file's own proxies (``kind``: plain or raw), in a process of its own."""
        port = free_port()
        argv = [sys.executable, __file__, kind, self.prefill_url, self.decode_url, str(port)]
        process = self.spawn(argv)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return Target(name, url, process.pid, process)

    def start_vllm_router(self, lean: bool) -> Target | None:
        """vLLM's Rust router, if installed: with its defaults, or ``lean`` (round robin for
        both stages, no line per request)."""
        here = str(Path(sys.executable).parent)  # the venv's bin, when it is not on PATH
        binary = shutil.which("vllm-router") or shutil.which("vllm-router", path=here)
        if binary is None:
            return None
        port = free_port()
        argv = [
            binary, "--host", "127.0.0.1", "--port", str(port),
            "--vllm-pd-disaggregation", "--kv-connector", "mooncake",
            "--prefill", self.prefill_url, str(self.bootstrap_port), "--decode", self.decode_url,
        ]  # fmt: skip
        argv += ["--prometheus-port", str(free_port())]  # two routers run: not the default
        if lean:
            argv += ["--policy", "round_robin", "--log-level", "warning"]
        process = self.spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", 30)
        except RuntimeError:
            print("vllm-router did not start; left out", file=sys.stderr)
            return None
        return Target(ROUTER if lean else ROUTER_DEFAULTS, url, process.pid, process)

    def stop(self, target: Target) -> None:
        if target.process is not None and target.process.poll() is None:
            target.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                target.process.wait(10)
            if target.process.poll() is None:
                target.process.kill()

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()

    def run_load(
        self,
        target: Target,
        scenario: str,
        concurrency: int,
        stream: bool,
        seconds: float,
        prompt_bytes: int = len(PROMPT),
        both_legs: str | None = None,
        max_tokens: int = TOKENS,
    ) -> Result:
        argv = [
            sys.executable, __file__, "loadgen", "--url", f"{target.url}/v1/completions",
            "--concurrency", str(concurrency), "--seconds", str(seconds),
            "--prompt-bytes", str(prompt_bytes), "--max-tokens", str(max_tokens),
        ]  # fmt: skip
        if stream:
            argv.append("--stream")
        if both_legs:
            argv += ["--both-legs", both_legs]
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        argv += ["--out", str(out)]
        pids = tree_pids(target.pid) if target.pid else []
        cpu_before = sum(cpu_seconds(p) for p in pids)
        peak = 0.0
        loadgen = subprocess.Popen(argv)
        while loadgen.poll() is None:
            if pids:
                peak = max(peak, sum(rss_kib(p) for p in pids))
            time.sleep(0.05)
        cpu_after = sum(cpu_seconds(p) for p in pids) if pids else 0.0
        data = json.loads(out.read_text())
        out.unlink()
        samples = [s for s in data["samples"]]
        good = [s for s in samples if s["ok"]]
        count = len(samples)
        result = Result(
            scenario=scenario,
            target=target.name,
            concurrency=concurrency,
            stream=stream,
            requests=count,
            errors=count - len(good),
            rps=count / data["elapsed"],
            chunks_per_s=sum(s["chunks"] for s in good) / data["elapsed"],
            ttft_p50_ms=1000 * percentile([s["ttft"] for s in good], 0.5),
            ttft_p99_ms=1000 * percentile([s["ttft"] for s in good], 0.99),
            e2e_p50_ms=1000 * percentile([s["total"] for s in good], 0.5),
            e2e_p99_ms=1000 * percentile([s["total"] for s in good], 0.99),
            cpu_ms_per_request=1000 * (cpu_after - cpu_before) / count if pids and count else None,
            peak_rss_mib=peak / 1024 if pids else None,
        )
        self.results.append(result)
        print(format_row(result), flush=True)
        return result

    def idle_memory(self, target: Target, streams: int, hold: float) -> dict[str, float]:
        pids = tree_pids(target.pid) if target.pid else []
        base = sum(rss_kib(p) for p in pids)
        argv = [
            sys.executable, __file__, "loadgen", "--url", f"{target.url}/v1/completions",
            "--idle", str(streams), "--hold", str(hold),
        ]  # fmt: skip
        loadgen = subprocess.Popen(argv, stdout=subprocess.PIPE)
        assert loadgen.stdout is not None
        opened = json.loads(loadgen.stdout.readline())["opened"]
        time.sleep(min(1.0, hold / 2))
        held = sum(rss_kib(p) for p in pids)
        loadgen.wait()
        return {
            "streams": opened,
            "base_kib": base,
            "held_kib": held,
            "kib_per_stream": (held - base) / max(opened, 1),
        }

    def large_body_memory(self, mib: int, stdlib_json: bool = False) -> dict[str, Any]:
        """Peak memory one request with a ``mib`` MiB prompt costs a fresh proxy, as a
        multiple of its body (VmHWM after it, over VmRSS before it)."""
        env = None
        if stdlib_json:  # hide orjson from the proxy: the stdlib fallback
            hidden = Path(tempfile.mkdtemp())
            (hidden / "orjson.py").write_text("raise ImportError('hidden by the benchmark')\n")
            env = {"PYTHONPATH": str(hidden)}
        proxy = self.start_proxy(env=env)
        assert proxy.pid is not None
        url = f"{proxy.url}/v1/completions"
        post_json(url, b'{"prompt": "warm up", "max_tokens": 1}')
        time.sleep(0.3)
        before = proc_status_kib(proxy.pid, "VmRSS")
        body = json.dumps({"model": "bench", "prompt": "x" * (mib << 20), "max_tokens": 4})
        started = time.monotonic()
        post_json(url, body.encode())
        took = time.monotonic() - started
        peak = proc_status_kib(proxy.pid, "VmHWM")
        self.stop(proxy)
        size_kib = len(body) / 1024
        return {
            "mib": mib,
            "json": "stdlib" if stdlib_json else "orjson",
            "rss_before_mib": before / 1024,
            "peak_mib": peak / 1024,
            "peak_per_body": (peak - before) / size_kib,
            "seconds": took,
        }


def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def post_json(url: str, body: bytes) -> bytes:
    import urllib.request

    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: bytes = response.read()
        return answer


def format_row(r: Result) -> str:
    cpu = f"{r.cpu_ms_per_request:7.3f}" if r.cpu_ms_per_request is not None else "      -"
    rss = f"{r.peak_rss_mib:7.1f}" if r.peak_rss_mib is not None else "      -"
    kind = "stream" if r.stream else "plain"
    return (
        f"{r.scenario:<14} {r.target:<22} c={r.concurrency:<4} {kind:<6} "
        f"{r.rps:8.1f} req/s {r.chunks_per_s:8.0f} chunk/s  "
        f"ttft {r.ttft_p50_ms:6.2f}/{r.ttft_p99_ms:6.2f} ms  "
        f"e2e {r.e2e_p50_ms:6.2f}/{r.e2e_p99_ms:6.2f} ms  cpu {cpu} ms/req  rss {rss} MiB  "
        f"err {r.errors}"
    )


def bench_main(args: argparse.Namespace) -> int:
    bench = Bench(args)
    quick = args.quick
    seconds = 1.0 if quick else 5.0
    concurrencies = [1, 32] if quick else [1, 8, 32, 64, 128, 256]
    summary: dict[str, Any] = {}
    try:
        bench.start_cluster()
        direct = Target("direct", bench.decode_url)
        proxy = bench.start_proxy()
        # Each with its defaults beside (a log line per request), in the full run: the quick
        # one compares the lean ones only, to stay near a minute.
        both_ways = (True,) if quick else (True, False)
        proxy_logging = None if quick else bench.start_proxy(lean=False)
        routers = [] if args.no_router else [bench.start_vllm_router(lean) for lean in both_ways]
        router = routers[0] if routers else None
        yardsticks = [bench.start_yardstick("raw", RAW_REF)]
        if not quick:
            yardsticks.insert(0, bench.start_yardstick("plain", "plain aiohttp (ref)"))
        baseline = None if args.baseline is None else bench.start_proxy(revision=args.baseline)
        candidates = (direct, proxy, proxy_logging, baseline, *routers, *yardsticks)
        targets = [t for t in candidates if t is not None]
        for stream in (True, False):
            for concurrency in concurrencies:
                for target in targets:
                    bench.run_load(target, "sweep", concurrency, stream, seconds)
        for turn in range(1, args.rounds):  # the CPU figures again, taking turns: medians
            for stream in (True, False):
                for target in targets[:: -1 if turn % 2 else 1]:
                    bench.run_load(target, "sweep", 32, stream, seconds)
        if not quick:  # long answers: 1,000 one-token chunks each, the relay's cost per chunk
            for turn in range(args.rounds):
                for target in targets[:: -1 if turn % 2 else 1]:
                    bench.run_load(target, "long stream", 32, True, 3 * seconds,
                                   max_tokens=LONG_TOKENS)  # fmt: skip
        # The 1 MiB prompt: the proxy against a client that sends both legs itself.
        both = Target("client does both legs", bench.decode_url)
        for target in (both, proxy, *(t for t in (router, baseline) if t is not None)):
            bench.run_load(
                target, "1 MiB prompt", 1, True, max(seconds, 2.0), prompt_bytes=1 << 20,
                both_legs=f"{bench.prefill_url}/v1/completions" if target is both else None,
            )  # fmt: skip
        idle = (500 if quick else 2000, 2.0 if quick else 4.0)
        summary["idle"] = {PROXY: bench.idle_memory(proxy, *idle)}
        if router is not None:
            summary["idle"][ROUTER] = bench.idle_memory(router, *idle)
        bench.stop(proxy)
        # Peak memory of one large request, in multiples of its body.
        summary["large_body"] = [bench.large_body_memory(16)]
        if not quick:
            summary["large_body"].append(bench.large_body_memory(64))
            summary["large_body"].append(bench.large_body_memory(64, stdlib_json=True))
        if not quick or args.workers:
            for workers in (1, 2):
                target = bench.start_proxy(workers)
                bench.run_load(target, f"workers={workers}", 64, True, seconds)
                bench.stop(target)
    finally:
        bench.close()
    print("\n" + report(bench.results, summary, args.rounds, args.baseline))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": [asdict(r) for r in bench.results], **summary}, indent=2)
        )
    if args.plot:
        plot(bench.results, args.plot)
    # A figure from a run with errors measures something else: the run fails.
    if failed := [
        f"{r.target} ({r.scenario}, c={r.concurrency}): {r.errors}"
        for r in bench.results
        if r.errors
    ]:
        print(f"\nFAILED: requests with errors: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def median_of(results: list[Result], **match: Any) -> Result | None:
    """The results that match, as one: each figure the median of theirs (--rounds repeats the
    scenarios nearest the router's)."""
    found = [r for r in results if all(getattr(r, k) == v for k, v in match.items())]
    if len(found) <= 1:
        return found[0] if found else None
    medians: dict[str, Any] = {}
    for name in MEDIAN_FIELDS:
        values = [getattr(r, name) for r in found]
        medians[name] = None if None in values else statistics.median(values)
    return dataclasses.replace(found[0], **medians)


MEDIAN_FIELDS: Final = (
    "rps", "chunks_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
    "cpu_ms_per_request", "peak_rss_mib",
)  # fmt: skip


# Within this much of each other, two figures are level: runs minutes apart on a shared machine
# move by more than that.
LEVEL: Final = 0.05


def report(
    results: list[Result], summary: dict[str, Any], rounds: int, baseline: str | None
) -> str:
    """What ran, each figure for each target side by side, and what they say: the proxy
    against vllm-router at its leanest (where it is installed), and against the floor of its
    own design (the protocol-legs yardstick)."""
    names = [PROXY, PROXY_LOGGING, *([f"proxy at {baseline}"] if baseline else [])]
    names += [ROUTER, ROUTER_DEFAULTS, RAW_REF]
    ran = {r.target for r in results}
    shown = [name for name in names if name in ran]
    figures = figures_of(results, summary)
    lines = ["What ran, on one fake cluster with one load generator, in this invocation:"]
    for name in ("direct", *shown):
        lines.append(f"  {name:<24} {LEGEND.get(name, 'the proxy as it was at that commit')}")
    took = f"medians of {rounds} rounds" if rounds > 1 else "one round (--rounds 3: medians)"
    lines += ["", f"CPU and req/s at 32 concurrent: {took}. Lower is better but where marked.", ""]
    lines.append("| figure | " + " | ".join(shown) + " |")
    lines.append("|---|" + "---|" * len(shown))
    for figure, (fmt, values) in figures.items():
        cells = ["-" if values.get(n) is None else fmt.format(values[n]) for n in shown]
        lines.append(f"| {figure} | " + " | ".join(cells) + " |")
    lines += ["", *verdict(figures), *bounds(summary), *workers_scaling(results)]
    return "\n".join(lines)


def workers_scaling(results: list[Result]) -> list[str]:
    """--workers 1 and 2 under the same load: what a second worker adds here, and the CPU a
    request costs each, which predicts what more cores would give."""
    ones, twos = (median_of(results, scenario=f"workers={n}") for n in (1, 2))
    if ones is None or twos is None:
        return []
    costs = [r.cpu_ms_per_request for r in (ones, twos)]
    cost = " and ".join(f"{c:.3f}" for c in costs if c is not None)
    return [
        f"--workers 2 against 1, streamed at 64 concurrent: {twos.rps:.0f} against "
        f"{ones.rps:.0f} req/s ({twos.rps / ones.rps:.2f}x). On this machine the fakes and the "
        f"load generator share its cores with the workers; a request costs {cost} ms of CPU "
        "across the workers, so a serving node gives about 1000 / that many requests a second "
        "per core it leaves them."
    ]


FigureTable = dict[str, tuple[str, dict[str, float | None]]]


def figures_of(results: list[Result], summary: dict[str, Any]) -> FigureTable:
    """Each figure of the report, per target (None where it did not run)."""

    def find(target: str, **match: Any) -> Result | None:
        return median_of(results, target=target, **match)

    def cpu(target: str, stream: bool) -> float | None:
        r = find(target, scenario="sweep", stream=stream, concurrency=32)
        return r.cpu_ms_per_request if r else None

    def added_ttft(target: str) -> float | None:
        r, d = (find(t, scenario="sweep", stream=True, concurrency=1) for t in (target, "direct"))
        return r.ttft_p50_ms - d.ttft_p50_ms if r and d else None

    def ratio(target: str) -> float | None:
        r, d = (find(t, scenario="sweep", stream=True, concurrency=32) for t in (target, "direct"))
        return r.rps / d.rps if r and d else None

    def big(target: str) -> float | None:
        r, both = (find(t, scenario="1 MiB prompt") for t in (target, "client does both legs"))
        return r.e2e_p50_ms - both.e2e_p50_ms if r and both else None

    def per_token(target: str) -> float | None:
        r = find(target, scenario="long stream")
        cost = r.cpu_ms_per_request if r else None
        return 1000 * cost / LONG_TOKENS if cost is not None else None

    def idle_memory(target: str) -> float | None:
        measured = summary.get("idle", {}).get(target)
        return float(measured["kib_per_stream"]) if measured else None

    each: dict[str, tuple[str, Callable[[str], float | None]]] = {
        "CPU per streamed request (ms)": ("{:.3f}", functools.partial(cpu, stream=True)),
        "CPU per non-streamed request (ms)": ("{:.3f}", functools.partial(cpu, stream=False)),
        HIGHER_IS_BETTER: ("{:.2f}x", ratio),
        "TTFT added at concurrency 1, p50 (ms)": ("{:+.2f}", added_ttft),
        "a 1 MiB prompt, end to end added, p50 (ms)": ("{:+.1f}", big),
        "memory per idle open stream (KiB)": ("{:.1f}", idle_memory),
        f"CPU per relayed token, {LONG_TOKENS}-token streams (µs)": ("{:.2f}", per_token),
    }
    targets = {r.target for r in results}
    table = {figure: (fmt, {t: of(t) for t in targets}) for figure, (fmt, of) in each.items()}
    return {f: (fmt, v) for f, (fmt, v) in table.items() if any(x is not None for x in v.values())}


HIGHER_IS_BETTER: Final = "streamed req/s at 32, ratio to direct (higher is better)"


def verdict(figures: FigureTable) -> list[str]:
    """The proxy against vllm-router at its leanest, figure by figure, and against its own
    design's floor."""
    lines: list[str] = []
    ahead: list[str] = []
    level: list[str] = []
    behind: list[str] = []
    for figure, (fmt, values) in figures.items():
        ours, theirs = values.get(PROXY), values.get(ROUTER)
        if ours is None or theirs is None:
            continue
        better = ours > theirs if figure == HIGHER_IS_BETTER else ours < theirs
        if abs(ours - theirs) <= LEVEL * max(abs(theirs), 1e-9):
            level.append(figure)
        else:
            said = f"{figure}: {fmt.format(ours)} against {fmt.format(theirs)}"
            (ahead if better else behind).append(said)
    if not (ahead or level or behind):
        lines.append("vllm-router is not installed (or was left out): no comparison with it.")
    else:
        lines.append(f"Against vllm-router at its leanest (within {LEVEL:.0%} is level):")
        lines += [f"  ahead  {f}" for f in ahead] + [f"  level  {f}" for f in level]
        lines += [f"  behind {f}" for f in behind]
        if not behind:
            lines.append("  so: the proxy is at or ahead of the lean router on every figure.")
    for kind in ("streamed", "non-streamed"):
        values = figures.get(f"CPU per {kind} request (ms)", ("", {}))[1]
        ours, floor = values.get(PROXY), values.get(RAW_REF)
        if ours is not None and floor:
            lines.append(
                f"CPU per {kind} request: {ours / floor:.2f}x the protocol-legs floor "
                f"({ours:.3f} against {floor:.3f} ms)."
            )
    return lines


def bounds(summary: dict[str, Any]) -> list[str]:
    """What the proxy must keep whatever it gains: a large body's peak memory bounded."""
    lines = []
    for row in summary.get("large_body", []):
        if row["json"] != "orjson":
            continue
        kept = "kept" if row["peak_per_body"] <= 3 else "NOT KEPT"
        lines.append(
            f"Peak memory for one {row['mib']} MiB body: {row['peak_per_body']:.2f}x the body "
            f"(bound 3x): {kept}."
        )
    return lines


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files, or None (with a word) where it is not installed."""
    try:  # imported by name: it is optional, and mypy must not need it installed
        importlib.import_module("matplotlib").use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None


def plot(results: list[Result], path: str) -> None:
    if (plt := pyplot()) is None:
        return
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for target in sorted({r.target for r in results if r.scenario == "sweep"}):
        for stream in (True, False):
            match = {"scenario": "sweep", "target": target, "stream": stream}
            levels = sorted({r.concurrency for r in results if r.scenario == "sweep"})
            found = (median_of(results, **match, concurrency=level) for level in levels)
            rows = [r for r in found if r is not None]
            if not rows:
                continue
            label = f"{target} ({'streamed' if stream else 'plain'})"
            style = "-" if stream else "--"
            throughput.plot(
                [r.concurrency for r in rows], [r.rps for r in rows], style, marker="o", label=label
            )
            ttft.plot(
                [r.concurrency for r in rows],
                [r.ttft_p50_ms for r in rows],
                style,
                marker="o",
                label=label,
            )
    for axis, title, unit in (
        (throughput, "throughput", "requests/s"),
        (ttft, "time to first byte, p50", "ms"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
    throughput.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


def rounds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number, 1 or more")
    return int(text)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "fake":
        run_fake(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "raw":
        run_raw_proxy(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "plain":
        run_plain_proxy(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "loadgen":
        loadgen_main(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument(
        "--workers", action="store_true", help="also compare --workers 1/2 in quick mode"
    )
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run the proxy as it was at this git revision (an A/B of two builds: both in "
        "every round, on the same cluster, taking turns)",
    )
    parser.add_argument(
        "--rounds",
        type=rounds,
        default=1,
        help="run the CPU figures at 32 concurrent (streamed, non-streamed, long answers) this "
        "many times, the targets taking turns, and report medians: one run is one sample a "
        "target, minutes apart, and they move 10-20%% between runs",
    )
    return bench_main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
