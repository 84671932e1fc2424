"""Routing benchmark: prefix-cache hit rate, TTFT and balance, per policy and workload.

    python bench/bench_routing.py --quick            # a smoke run: two workloads, a minute
    python bench/bench_routing.py --plot routing.png # the full table (make bench-routing)
    python bench/bench_routing.py --scale            # 8 to 1,024 engines, in process, ~2 min
    python bench/bench_routing.py --scale-events     # following KV events, 8 to 512 engines

A simulated cluster on loopback: 4 prefill instances with 2 DP ranks each (8 engines) and 4
decodes, all ``fake_vllm.FakeVllm``: each engine keeps an LRU prefix cache of a fixed number
of 16-token blocks, computes only the tokens it has not cached (a fixed time per token), one
prompt at a time with the rest queued, and exposes vLLM-shaped ``/metrics`` (running, waiting,
KV usage, prefix cache queries and hits in tokens). Its tokenizer and blocks are not the
proxy's: the proxy only sees bytes.

Every workload is replayed open loop (requests leave at their scheduled times, whatever the
answers) against each target in the same invocation: round_robin, least_loaded, prefix_aware
(the default), two prefix_aware proxy replicas sharing the load, alone and telling each
other their sends with --peer (four of each when named with --target), --workers 2, and
vllm-router --policy cache_aware when it is installed (PyPI vllm-router); --precise adds
prefix_aware on KV events, alone and as 2 replicas with and without --peer (or 4).
``--fleet 8x8,8``: 64 engines and 8 decodes, the workloads as many times larger as the
engines (Shape.scale, workloads); several ``--proxy``: each mooncake_proxy.py's targets on
the same engines, an A/B. Per run: the
prefill hit rate from the engines' own counters, the oracle's hit rate (one LRU cache holding
the cluster's whole capacity, fed the same requests in order), client-side TTFT p50/p90,
max/mean requests per engine, and why the proxies chose their prefill engines (their
routing_decisions: affinity, spill, cold...).

Workloads: shared-prefix groups (vllm bench serve's prefix_repetition shape), multi-turn chats
that grow, one chat alone on the cluster (its turns should stay on one engine), a replay of
Mooncake's FAST'25 synthetic trace (each hash id a 512-token block in the trace, scaled down
here to a 128-byte block of text; ``--trace``, default
~/.cache/mooncake-proxy/traces/synthetic_trace.jsonl: left out with a note when missing), and
one hot prefix (sglang issue 21199's trap).

``--scale`` runs nothing of that: it simulates fleets of 8 to 1,024 prefill engines in process
(no sockets, no servers) and measures the current router there, per fleet size: the decision
time of each stage (p50, p99), the prompt's hashing apart, its prefix indexes' memory, and its
hit rate on shared-prefix groups against an oracle (scale_run says how each is counted); one
table, and a verdict against the targets at 512 engines (50 us p50, 150 us p99 per stage).

``--scale-events`` measures what following vLLM's KV cache events costs one process: a KvFeed
per prefill engine (8, 64, 512), each view holding 20,000 blocks of its own, fed vLLM 0.32's
msgpack batches through the proxy's own decode and take_kv_batch, with the router's holders
attached and without (events_run says what is timed); one table, a verdict against 512
engines at 1,500 block events a second each within a quarter of a core, and what --workers and
replicas multiply. About 30 s and 2.6 GB.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

# The daemon is at the repository's top and the fakes in tests/: run as a script, only bench/
# is on the path.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
sys.path.insert(2, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_mooncake_proxy import pyplot, wait_http
from fake_vllm import EngineSim, FakeVllm, PromptBlocks, build_tokenizer, free_port, prompt_blocks

if TYPE_CHECKING:
    import mooncake_proxy as mp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository: the daemon at its top, the fakes in tests/
INSTANCES, DP, DECODES = 4, 2, 4
CACHE_BLOCKS = 320  # per engine: 20 KiB of prompt at 64 bytes a block
TOKEN_TIME = 25e-6  # seconds of prefill per uncached token
DEFAULT_TRACE = Path.home() / ".cache/mooncake-proxy/traces/synthetic_trace.jsonl"
TRACE_URL = (
    "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/"
    "FAST25-release/traces/synthetic_trace.jsonl"
)


# --- the simulated cluster


def run_fake(role: str, dp: int, api_port: int, bootstrap_port: int, *precise: str) -> None:
    """One fake vLLM server (a process): a prefill with ``dp`` ranks and its bootstrap, or a
    decode. ``precise``: its tokenizer's directory and the ports of its KV event publisher and
    replay."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    fake = FakeVllm(
        role,
        dp_size=dp if role == "prefill" else 1,
        cache_blocks=CACHE_BLOCKS,
        token_time=TOKEN_TIME if role == "prefill" else 0.0,
        kv_timeout=30,
    )
    if precise:
        fake.tokenizer = load_tokenizer(Path(precise[0]))
        fake.kv_events_port, fake.kv_replay_port = int(precise[1]), int(precise[2])
    fake.api_url = f"http://127.0.0.1:{api_port}"

    async def serve() -> None:
        runners = []
        apps = [(fake.api_app(), api_port)]
        if role == "prefill":
            apps.append((fake.bootstrap_app(), bootstrap_port))
        for app, port in apps:
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
            runners.append(runner)
        await asyncio.Event().wait()

    asyncio.run(serve())


def load_tokenizer(path: Path) -> Any:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class Shape:
    """The simulated cluster's size: prefill instances, DP ranks each, decodes (--fleet)."""

    instances: int = INSTANCES
    dp: int = DP
    decodes: int = DECODES

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``INSTANCESxDP[,DECODES]``, e.g. ``8x8,8``; decodes default to one an instance."""
        prefill, _, decodes = text.partition(",")
        instances, _, dp = prefill.lower().partition("x")
        shape = cls(int(instances), int(dp or 1), int(decodes or instances))
        if min(shape.instances, shape.dp, shape.decodes) < 1:
            raise argparse.ArgumentTypeError(f"--fleet {text}: every count must be at least 1")
        return shape

    @property
    def engines(self) -> int:
        return self.instances * self.dp

    @property
    def scale(self) -> int:
        """How many times the default cluster's engines this one has (at least 1): what the
        workloads' groups and conversations are multiplied by, so that their prefixes fill
        every engine's cache as they fill the default cluster's."""
        return max(1, round(self.engines / (INSTANCES * DP)))

    def __str__(self) -> str:
        return f"{self.instances}x{self.dp},{self.decodes}"


@dataclass
class Cluster:
    prefills: list[tuple[str, int]]  # (api URL, bootstrap port)
    decodes: list[str]
    processes: list[subprocess.Popen[bytes]]
    # --precise: the tokenizer the engines use, and each instance's --kv-events entry.
    tokenizer_dir: Path | None = None
    kv_events: list[list[str]] = field(default_factory=list)
    shape: Shape = Shape()
    # --proxy: the routers measured (mooncake_proxy.py files), each on the same engines.
    proxies: tuple[Path, ...] = (ROOT / "mooncake_proxy.py",)

    @classmethod
    def start(
        cls,
        tokenizer_dir: Path | None = None,
        shape: Shape = Shape(),
        proxies: tuple[Path, ...] = (ROOT / "mooncake_proxy.py",),
    ) -> Cluster:
        prefills, decodes, processes, kv_events = [], [], [], []
        for role, count in (("prefill", shape.instances), ("decode", shape.decodes)):
            for _ in range(count):
                api, bootstrap = free_port(), free_port()
                argv = [sys.executable, __file__, "fake", role, str(shape.dp)]
                argv += [str(api), str(bootstrap)]
                url = f"http://127.0.0.1:{api}"
                if tokenizer_dir is not None:
                    ranks = shape.dp if role == "prefill" else 1
                    events, replay = free_port(ranks), free_port(ranks)
                    argv += [str(tokenizer_dir), str(events), str(replay)]
                    endpoints = [f"tcp://127.0.0.1:{port}" for port in (events, replay)]
                    kv_events += ["--kv-events", url, *endpoints]
                processes.append(subprocess.Popen(argv))
                (prefills.append((url, bootstrap)) if role == "prefill" else decodes.append(url))
        for url in [u for u, _ in prefills] + decodes:
            wait_http(url + "/health")
        return cls(prefills, decodes, processes, tokenizer_dir, [kv_events], shape, proxies)

    def prompts(self, requests: Sequence[Request]) -> list[PromptBlocks]:
        """Each request's prompt blocks, as the engines key their caches."""
        tokenizer = load_tokenizer(self.tokenizer_dir) if self.tokenizer_dir else None
        return [
            prompt_blocks(body["messages"] if path == CHAT else body["prompt"], tokenizer)
            for _, path, body in requests
        ]

    def precise_flags(self) -> list[str]:
        assert self.tokenizer_dir is not None
        return [*self.kv_events[0], "--tokenizer", str(self.tokenizer_dir)]

    def proxy_argv(self, port: int, *flags: str, proxy: Path | None = None) -> list[str]:
        argv = [sys.executable, str(proxy or self.proxies[0]), "--port", str(port)]
        for url, bootstrap in self.prefills:
            argv += ["--prefill", url, str(bootstrap)]
        for url in self.decodes:
            argv += ["--decode", url]
        return [*argv, "--log-level", "WARNING", *flags]

    def router_argv(self, port: int) -> list[str] | None:
        here = str(Path(sys.executable).parent)  # the venv's bin, when it is not on PATH
        binary = shutil.which("vllm-router") or shutil.which("vllm-router", path=here)
        if binary is None:
            return None
        argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
        argv += ["--kv-connector", "mooncake", "--policy", "cache_aware"]
        argv += ["--intra-node-data-parallel-size", str(self.shape.dp)]
        for url, bootstrap in self.prefills:
            argv += ["--prefill", url, str(bootstrap)]
        for url in self.decodes:
            argv += ["--decode", url]
        return argv

    def api_urls(self) -> list[str]:
        return [url for url, _ in self.prefills] + self.decodes

    async def warm(self, session: aiohttp.ClientSession, requests: Sequence[Request]) -> None:
        """Have every fake tokenize the workload's prompts before its first run, which would
        otherwise pay that alone (the fakes remember them; vLLM itself tokenizes each time)."""
        if self.tokenizer_dir is None:
            return

        async def warm_one(url: str, chunk: list[list[Any]]) -> None:
            async with session.post(f"{url}/_fake/warm", json={"requests": chunk}) as answer:
                answer.raise_for_status()

        for start in range(0, len(requests), 256):
            chunk = [[path, body] for _, path, body in requests[start : start + 256]]
            await asyncio.gather(*(warm_one(url, chunk) for url in self.api_urls()))

    async def reset(self, session: aiohttp.ClientSession) -> None:
        for url in self.api_urls():
            async with session.post(f"{url}/_fake/reset") as answer:
                answer.raise_for_status()

    async def engine_counts(
        self, session: aiohttp.ClientSession, decodes: bool = False
    ) -> list[dict[str, float]]:
        """Per prefill engine: its prefix cache queries and hits (tokens) and requests; per
        decode: its prompt tokens from its own cache and from transfers."""
        engines = []
        for url in self.decodes if decodes else [u for u, _ in self.prefills]:
            async with session.get(f"{url}/metrics") as answer:
                page = await answer.text()
            for rank in range(1 if decodes else self.shape.dp):
                counts = {"queries": 0.0, "hits": 0.0, "requests": 0.0, "local": 0.0, "sent": 0.0}
                for line in page.splitlines():
                    if f'engine="{rank}"' not in line:
                        continue
                    for name, key in (
                        ("vllm:prefix_cache_queries_total{", "queries"),
                        ("vllm:prefix_cache_hits_total{", "hits"),
                        ("vllm:request_success_total{", "requests"),
                        ('vllm:prompt_tokens_by_source_total{engine="0",model_name="fake-model",'
                         'source="local_cache_hit"}', "local"),
                        ('vllm:prompt_tokens_by_source_total{engine="0",model_name="fake-model",'
                         'source="external_kv_transfer"}', "sent"),
                    ):  # fmt: skip
                        if line.startswith(name):
                            counts[key] = float(line.rsplit(" ", 1)[1])
                engines.append(counts)
        return engines

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


# --- workloads: (seconds from the start, path, body)

Request = tuple[float, str, dict[str, Any]]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def filler(seed: str, size: int) -> str:
    words = random.Random(seed).choices(
        ["kv", "cache", "token", "prefill", "decode", "block"], k=size
    )
    return " ".join(words)[:size].ljust(size, ".")


def shared_prefix_groups(groups: int, per_group: int, rate: float) -> list[Request]:
    """vllm bench serve --dataset-name prefix_repetition: 4 KiB prefixes, 256-byte suffixes."""
    prefixes = [filler(f"group {g}", 4096) for g in range(groups)]
    order = [(g, i) for g in range(groups) for i in range(per_group)]
    random.Random(7).shuffle(order)
    return [
        (n / rate, COMPLETIONS, completion(prefixes[g] + filler(f"q {g} {i}", 256)))
        for n, (g, i) in enumerate(order)
    ]


def multi_turn(
    conversations: int, turns: int, gap: float, words: tuple[int, int, int] = (1024, 200, 600)
) -> list[Request]:
    """Chats whose every turn resends the whole conversation so far, plus one new question.
    ``words``: of the system prompt, each question and each answer."""
    requests = []
    shuffle = random.Random(11)
    # Each turn's conversations arrive in another order: in a fixed one, a rotation over as
    # many engines as divide the conversations would keep each on one engine by chance.
    starts = {(c, t): shuffle.random() * gap for c in range(conversations) for t in range(turns)}
    for c in range(conversations):
        messages: list[dict[str, str]] = [
            {"role": "system", "content": filler(f"system {c % 4}", words[0])}
        ]
        for t in range(turns):
            messages.append({"role": "user", "content": filler(f"user {c} {t}", words[1])})
            body = {"model": "fake-model", "messages": list(messages), "max_tokens": 4}
            requests.append((t * gap + starts[c, t], CHAT, body | {"stream": True}))
            messages.append({"role": "assistant", "content": filler(f"answer {c} {t}", words[2])})
    return sorted(requests, key=lambda r: r[0])


def mooncake_trace(path: Path, count: int, seconds: float, copies: int = 1) -> list[Request]:
    """Mooncake's FAST'25 trace: equal hash ids are equal 512-token blocks, 128 bytes here
    (32 of the fakes' tokens), replayed ``seconds`` long; its reuse is across minutes, so
    all of it is needed. ``copies``: that many replays at once, each with hash ids of its own
    (none shares a block with another), a larger cluster's users: its working set and its
    rate times ``copies``, each copy a fraction of a request's gap after the one before."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    span = max(rows[-1]["timestamp"], 1)
    stride = max(h for row in rows for h in row["hash_ids"]) + 1
    gap = seconds / len(rows) / copies
    requests = [
        (
            row["timestamp"] / span * seconds + copy * gap,
            COMPLETIONS,
            completion(
                "".join(
                    f"<{h + copy * stride:08d}>" + filler(str(h + copy * stride), 118)
                    for h in row["hash_ids"]
                )
            ),
        )
        for row in rows
        for copy in range(copies)
    ]
    return sorted(requests, key=lambda r: r[0])


def hot_prefix(count: int, rate: float) -> list[Request]:
    """One 8 KiB prefix for every request: affinity alone piles them onto one engine."""
    prefix = filler("the one prefix", 8192)
    return [
        (n / rate, COMPLETIONS, completion(prefix + filler(f"hot {n}", 256))) for n in range(count)
    ]


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 4, "stream": True}


def oracle_hit_rate(prompts: Sequence[PromptBlocks], engines: int = INSTANCES * DP) -> float:
    """One LRU prefix cache with the whole cluster's capacity (``engines`` engines' caches),
    fed the prompts in order."""
    cache = EngineSim(CACHE_BLOCKS * engines)
    for blocks in prompts:
        cache.lookup(blocks)
        cache.store(blocks)
    return cache.hits / cache.queries


def split_hit_rate(prompts: Sequence[PromptBlocks], count: int = INSTANCES * DP) -> float:
    """The cluster's own caches (one per engine), each prompt sent where most of its leading
    blocks are cached (ties: the engine that took the fewest requests), with no bound on
    load: what knowing every cache exactly buys without balancing anything. Far below the
    oracle, the workload itself defeats a split cache; near it, what routing loses is its own."""
    engines = [EngineSim(CACHE_BLOCKS) for _ in range(count)]
    for blocks in prompts:
        held = [engine.cached(blocks) for engine in engines]
        best = max(held)
        engine = min(
            (e for e, h in zip(engines, held, strict=True) if h == best), key=lambda e: e.requests
        )
        engine.lookup(blocks)
        engine.store(blocks)
    return sum(e.hits for e in engines) / sum(e.queries for e in engines)


# --- runs


@dataclass
class Result:
    workload: str
    target: str
    requests: int
    errors: int
    hit_rate: float
    oracle: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    max_over_mean: float
    decode_local: float  # share of the decodes' prompt tokens found in their own cache
    extra: dict[str, Any] = field(default_factory=dict)


async def replay(urls: Sequence[str], requests: Sequence[Request]) -> tuple[list[float], int]:
    """Send each request at its time (open loop), round robin over ``urls``; TTFTs in s."""
    ttfts: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic()

        async def one(n: int, at: float, path: str, body: dict[str, Any]) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            sent = time.monotonic()
            try:
                async with session.post(urls[n % len(urls)] + path, json=body) as answer:
                    first = await answer.content.readany()
                    ttft = time.monotonic() - sent
                    rest = await answer.read()
                if answer.status != 200 or b"[DONE]" not in first + rest:
                    errors += 1
                else:
                    ttfts.append(ttft)
            except (aiohttp.ClientError, TimeoutError):
                errors += 1

        await asyncio.gather(*(one(n, *r) for n, r in enumerate(requests)))
    return ttfts, errors


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(
    cluster: Cluster,
    name: str,
    target: str,
    argvs: list[list[str]],
    requests: Sequence[Request],
    oracle: float,
) -> Result | None:
    ports = [int(argv[argv.index("--port") + 1]) for argv in argvs]
    processes = spawn(argvs)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            try:
                wait_http(url + "/health", 30)
            except RuntimeError:
                print(f"  {target}: did not become ready; left out", flush=True)
                return None
        async with aiohttp.ClientSession() as session:
            await caught_up(session, urls)
            await cluster.reset(session)
            await asyncio.sleep(1.5)  # a scrape of the empty engines
            ttfts, errors = await replay(urls, requests)
            engines = await cluster.engine_counts(session)
            decodes = await cluster.engine_counts(session, decodes=True)
            reasons = await prefill_reasons(session, urls)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
    queries = sum(e["queries"] for e in engines)
    counts = [e["requests"] for e in engines]
    local, sent = (sum(d[key] for d in decodes) for key in ("local", "sent"))
    result = Result(
        workload=name,
        target=target,
        requests=len(requests),
        errors=errors,
        hit_rate=sum(e["hits"] for e in engines) / queries if queries else 0.0,
        oracle=oracle,
        ttft_p50_ms=1000 * percentile(ttfts, 0.5),
        ttft_p90_ms=1000 * percentile(ttfts, 0.9),
        max_over_mean=max(counts) / statistics.mean(counts) if sum(counts) else float("nan"),
        decode_local=local / (local + sent) if local + sent else 0.0,
        extra={"requests_per_engine": counts, "prefill_reasons": reasons},
    )
    print(format_row(result), flush=True)
    print(f"  {'':<42} prefill decisions: " + ", ".join(f"{k} {v}" for k, v in reasons.items()))
    return result


async def prefill_reasons(session: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, int]:
    """Why the proxies chose their prefill engines (routing_decisions by reason, all of them
    summed): where a target's hit rate falls short, affinity, spill or cold says why."""
    reasons: dict[str, int] = {}
    reason = re.compile(r'reason="(\w+)"')
    for url in urls:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("mooncake_proxy_routing_decisions_total{") and (
                'stage="prefill"' in line and (match := reason.search(line)) is not None
            ):
                reasons[match[1]] = reasons.get(match[1], 0) + int(float(line.split()[-1]))
    return dict(sorted(reasons.items()))


async def caught_up(session: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Wait while a proxy replays what the engines published before it started (the
    workloads before this one): a start's cost, measured on its own (precise_costs), not
    steady routing. Under --workers each answer is one worker's: several in a row must say so."""
    deadline = time.monotonic() + 120
    for url in urls:
        calm = 0
        while calm < 4 and time.monotonic() < deadline:
            async with session.get(url + "/healthcheck") as answer:
                calm = 0 if "catching up" in await answer.text() else calm + 1
            await asyncio.sleep(0.1)


def decision_costs() -> list[tuple[str, float]]:
    """What routing costs on the request path, in process (medians of repeated runs), and what
    the index costs in memory."""
    import tracemalloc

    import mooncake_proxy as mp

    rows = []
    for label, size in (("200 B prompt", 200), ("1 MiB prompt", 1 << 20)):
        fleet = costs_fleet()
        body = completion(filler("cost", size))
        times = []
        for _ in range(40 if size > 1000 else 2000):
            started = time.perf_counter()
            key = mp.route_key(COMPLETIONS, body, None)
            engine, decode = fleet.claim_prefill((), key), fleet.claim_decode((), key)
            times.append(time.perf_counter() - started)
            fleet.release_prefill(engine)
            fleet.release_decode(decode)
        rows.append((f"routing decision (both stages), {label}", statistics.median(times) * 1e6))
    tracemalloc.start()
    index = mp.PrefixIndex(1_000_000)
    before = tracemalloc.get_traced_memory()[0]
    for start in range(0, 1_000_000, 1000):
        index.add([hash(("prefix", n)) for n in range(start, start + 1000)])
    rows.append(
        (
            "index memory per block, 1,000,000 blocks (bytes)",
            (tracemalloc.get_traced_memory()[0] - before) / 1e6,
        )
    )
    tracemalloc.stop()
    return rows


def costs_fleet(instances: int = INSTANCES, dp: int = DP, decodes: int = DECODES) -> mp.Fleet:
    """The benchmark's cluster (or another size of it) as a proxy's fleet, every instance
    usable, no sockets."""
    from yarl import URL

    import mooncake_proxy as mp

    config = mp.ProxyConfig(
        prefills=tuple(
            mp.PrefillSpec(URL(f"http://10.0.0.{i}:8100"), URL(f"http://10.0.0.{i}:8998"))
            for i in range(1, instances + 1)
        ),
        decodes=tuple(URL(f"http://10.0.1.{i}:8200") for i in range(1, decodes + 1)),
    )
    fleet = mp.Fleet(config)
    # Every instance's /v1/models read, as a running proxy has it: decisions are the model's.
    served = mp.parse_served({"data": [{"id": "fake-model", "parent": None}]})
    for instance in fleet.prefills:
        fleet.set_engines(instance, [f"{instance.url}_dp{r}" for r in range(dp)])
        instance.usable, instance.served = True, served
    for decode in fleet.decodes:
        decode.usable, decode.served = True, served
    fleet.refresh()
    return fleet


def precise_costs(tokenizer_dir: Path) -> list[tuple[str, float]]:
    """What routing on KV events costs on the request path for a 32k-token chat: reading its
    tokens as far as routing needs them (the chat template and the tokenizer, as vLLM applies
    them) as engines hold none, half or all of it, and all of its tokens; then the decision
    for both stages with every engine's event view holding half of it; and the memory of an
    event view per block."""
    import tracemalloc

    import mooncake_proxy as mp

    tokenizer = mp.PromptTokenizer.load(str(tokenizer_dir))
    messages = [{"role": "system", "content": filler("system", 4096)}]
    body: dict[str, Any] = {"model": "fake-model", "messages": messages}
    while len(tokenizer.tokens(CHAT, body) or ()) < 32768:
        messages.append({"role": "user", "content": filler(f"turn {len(messages)}", 4096)})
    tokens = tokenizer.tokens(CHAT, body) or []
    for _ in range(2 * mp.PromptPieces.CHECKS):  # past the first requests, read whole to check
        tokenizer.tokens(CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    # Engines that hold another prompt, half of this one, or all of it.
    other, half_held, all_held = mp.HeldBlocks(), mp.HeldBlocks(), mp.HeldBlocks()
    other.stored(None, [b"other"], [3] * BLOCK, BLOCK)
    for view, share in ((half_held, 2), (all_held, 1)):
        ids = [b"%d" % n for n in range(len(tokens) // share // BLOCK)]
        view.stored(None, ids, tokens[: len(ids) * BLOCK], BLOCK)
    question = {"role": "user", "content": filler("question", 1024)}
    grown = body | {"messages": [*messages, question]}

    # What a busy proxy remembers: its piece cache near full (16 M characters).
    full = {f"piece {n} " + "x" * 1016: [1] * 250 for n in range(mp.PromptPieces.LIMIT // 1030)}

    def read(
        prompt: dict[str, Any], views: list[mp.HeldBlocks], seen: bool, busy: bool = False
    ) -> float:
        tokenizer.pieces.known = dict(full) if busy else {}  # a chat never seen
        tokenizer.pieces.size = sum(map(len, tokenizer.pieces.known))
        if seen:
            tokenizer.tokens(CHAT, body)
        started = time.perf_counter()
        mp.TokenReading(tokenizer, CHAT, prompt, views).read()
        return time.perf_counter() - started

    def whole(prompt: dict[str, Any]) -> float:
        tokenizer.pieces.known = {}
        started = time.perf_counter()
        tokenizer.tokens(CHAT, prompt)
        return time.perf_counter() - started

    measures: list[tuple[str, Callable[[], float]]] = [
        (f"read a {len(tokens):,}-token chat never seen, as routing needs it",
         lambda: read(body, [other], False)),
        ("the same, the piece cache full (16 M characters of other prompts)",
         lambda: read(body, [other], False, busy=True)),
        ("read it, its first half held by an engine (sent there by another proxy)",
         lambda: read(body, [half_held], False)),
        ("read its next turn (+1 KiB), every earlier turn held",
         lambda: read(grown, [all_held], True)),
        ("tokenize all of it (a never-seen chat's rest: after the decision, in a thread)",
         lambda: whole(body)),
    ]  # fmt: skip
    rows = []
    for label, measure in measures:
        rows.append((label, statistics.median(measure() for _ in range(20)) * 1e6))
    fleet = costs_fleet()
    held = mp.HeldBlocks()
    half = tokens[: len(tokens) // 2]
    ids = [b"%d" % n for n in range(len(half) // BLOCK)]
    held.stored(None, ids, half, BLOCK)
    engines = [engine for instance in fleet.prefills for engine in instance.engines]
    for target in (*engines, *fleet.decodes):
        target.feed = mp.KvFeed("tcp://bench:5557", None)
        target.feed.held, target.feed.batches = held, 1
    tokenizer.tokens(CHAT, body)  # its pieces seen
    times = []
    for _ in range(40):
        reading = mp.TokenReading(tokenizer, CHAT, body, [held])
        reading.read()  # measured above; what the decision is given
        started = time.perf_counter()
        key = reading.key(mp.route_key(CHAT, body, None))
        engine, decode = fleet.claim_prefill((), key), fleet.claim_decode((), key)
        times.append(time.perf_counter() - started)
        fleet.release_prefill(engine)
        fleet.release_decode(decode)
    rows.append(("routing decision on KV events (both stages), that chat, its tokens read",
                 statistics.median(times) * 1e6))  # fmt: skip
    tracemalloc.start()
    view = mp.HeldBlocks()
    before = tracemalloc.get_traced_memory()[0]
    parent = None  # one chain of a million blocks, 1,000 an event, as vLLM hashes them
    for start in range(0, 1_000_000, 1000):
        hashes = [n.to_bytes(32, "big") for n in range(start, start + 1000)]
        view.stored(parent, hashes, [7] * 1000 * BLOCK, BLOCK)
        parent = hashes[-1]
    memory = (tracemalloc.get_traced_memory()[0] - before) / 1e6
    tracemalloc.stop()
    rows.append(("KV event view memory per block, 1,000,000 blocks (bytes)", memory))
    rows.append(("join: one engine's full replay buffer, 10,000 batches of 8 blocks", join_cost()))
    return rows


def join_cost() -> float:
    """A proxy that starts next to a busy engine replays its buffer (vLLM keeps 10,000
    batches): decoding and applying them, in µs, as vLLM 0.32 sends them (8 new blocks and 8
    evicted a batch)."""
    import msgspec

    import mooncake_proxy as mp

    tokens = random.Random(3)
    batches = []
    for n in range(10_000):
        hashes = [n * 8 + i for i in range(8)]
        stored = {
            "type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": hashes[0] - 1 if n else None,
            "token_ids": [tokens.randrange(1000) for _ in range(8 * BLOCK)],
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * 8, "group_idx": 0,
        }  # fmt: skip
        removed = [
            {"type": "BlockRemoved", "block_hashes": [h - 800], "medium": "GPU", "group_idx": 0}
            for h in hashes
        ]  # one event per evicted block, as vLLM's block pool sends them
        batches.append(msgspec.msgpack.encode([time.time(), [*removed, stored], 0]))
    decode = msgspec.msgpack.Decoder().decode
    view = mp.HeldBlocks()
    started = time.perf_counter()
    for payload in batches:
        for event in decode(payload)[1]:
            view.apply(event)
    return (time.perf_counter() - started) * 1e6


# --- --scale: what one decision costs as the fleet grows (in process, the current router)

# Prefill instances x DP ranks: 8 to 1,024 engines; decodes one per 8 engines.
SCALE_SIZES = ((1, 8), (4, 8), (8, 16), (8, 64), (16, 64))
SCALE_PROMPT = 8192  # bytes a prompt: 16 of the router's 512-byte blocks
SCALE_SHARED = 7168  # of them, its group's prefix (14 blocks); the rest is its own
SCALE_PER_GROUP = 4  # requests per prefix group: the first a first sight, the rest hits
SCALE_GROUPS_PER_ENGINE = 2
SCALE_MIN_DECISIONS = 4000  # at the small sizes, more groups: a p99 of enough decisions
# The hit rates' passes: each engine an LRU cache of the router's blocks, the fleet's caches
# together this share of the workload's distinct blocks, so that placement decides what stays.
SCALE_CACHE_SHARE = 0.75
# The Mooncake trace scaled up: its first rows, one copy of them (its hash ids made distinct)
# per SCALE_TRACE_ENGINES engines, each hash id one 512-byte block.
SCALE_TRACE_ROWS, SCALE_TRACE_ENGINES = 4000, 32
# The targets, per stage, for an 8 KiB prompt at 512 engines: a decision that does not grow
# with the fleet.
TARGET_ENGINES, TARGET_P50_US, TARGET_P99_US = 512, 50.0, 150.0


@dataclass
class ScaleRow:
    instances: int
    dp: int
    engines: int  # prefill engines: instances x DP ranks
    decodes: int
    groups: int
    decisions: int
    hash_p50_us: float  # route_key: the prompt read and hashed into its block chain
    hash_p99_us: float
    prefill_p50_us: float  # fleet.claim_prefill
    prefill_p99_us: float
    decode_p50_us: float  # fleet.claim_decode
    decode_p99_us: float
    # Every prefill engine's and decode's PrefixIndex after the run, and the stages' reverse
    # indexes (Roster.held: block -> its holders).
    index_bytes: int
    index_blocks: int
    hit_rate: float  # blocks the chosen prefill engine's simulated cache held / blocks
    oracle: float  # one LRU cache as large as the fleet's, fed the same prompts in order
    trace_hit_rate: float  # the same on the Mooncake trace scaled up; nan without the trace
    trace_oracle: float
    trace_decisions: int
    seconds: float  # the decision loop's wall time


def scale_text(seed: str, size: int) -> str:
    """``size`` bytes of ASCII, the same for the same seed (filler's words are too slow for
    thousands of 8 KiB prompts)."""
    return random.Random(seed).randbytes(size // 2 + 1).hex()[:size]


def scale_workload(groups: int, per_group: int) -> list[tuple[int, dict[str, Any]]]:
    """Shared-prefix groups, shuffled: (group, completion body), each prompt SCALE_PROMPT
    bytes, the first SCALE_SHARED of them its group's."""
    prefixes = [scale_text(f"scale group {g}", SCALE_SHARED) for g in range(groups)]
    order = [(g, i) for g in range(groups) for i in range(per_group)]
    random.Random(35).shuffle(order)
    own = SCALE_PROMPT - SCALE_SHARED
    return [(g, completion(prefixes[g] + scale_text(f"scale {g} {i}", own))) for g, i in order]


def scale_trace(path: Path, copies: int) -> list[dict[str, Any]]:
    """The trace's first SCALE_TRACE_ROWS rows, ``copies`` times, each copy's hash ids its
    own, the copies of a row one after another; each hash id a 512-byte block of text."""
    rows = [json.loads(line) for line in path.read_text().splitlines()[:SCALE_TRACE_ROWS]]
    return [
        completion("".join(f"<{copy}:{h}>".ljust(512, ".") for h in row["hash_ids"]))
        for row in rows
        for copy in range(copies)
    ]


def lru_serve(cache: collections.OrderedDict[int, None], chain: list[int], capacity: int) -> int:
    """A prefix cache's answer to a prompt: its leading blocks found; then it holds them all,
    the least recently used evicted first, a chain's tail before its head (EngineSim.store),
    so that what it holds of a chain is a prefix of it, as the router's leading assumes."""
    from mooncake_proxy import leading

    found = leading(chain, cache)
    for block in reversed(chain):
        cache[block] = None
        cache.move_to_end(block)
    while len(cache) > capacity:
        cache.popitem(last=False)
    return found


def cached_hit_rates(
    instances: int, dp: int, bodies: Sequence[dict[str, Any]]
) -> tuple[float, float]:
    """The prefill's hit rate where each engine is an LRU cache (SCALE_CACHE_SHARE of the
    workload's distinct blocks over the fleet, its index as large), against one LRU cache as
    large as all of them; each claim released at once (no queues: placement alone)."""
    import mooncake_proxy as mp

    fleet = costs_fleet(instances, dp, 1)
    keys = [mp.route_key(COMPLETIONS, body, None) for body in bodies]
    engines = [e for i in fleet.prefills for e in i.engines]
    distinct = len({block for key in keys for block in key.chain})
    capacity = max(16, int(SCALE_CACHE_SHARE * distinct / len(engines)))
    for engine in engines:
        engine.index.capacity = capacity
    caches = {engine: collections.OrderedDict[int, None]() for engine in engines}
    whole: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = oracle = blocks = 0
    for key in keys:
        engine = fleet.claim_prefill((), key)
        fleet.release_prefill(engine)
        hits += lru_serve(caches[engine], key.chain, capacity)
        oracle += lru_serve(whole, key.chain, capacity * len(engines))
        blocks += len(key.chain)
    return hits / blocks, oracle / blocks


def scale_run(instances: int, dp: int, quick: bool, trace: Path | None) -> ScaleRow:
    """One fleet size: every request of the workload hashed, then routed by both stages of
    the current router (each claim timed on its own, then released, as decision_costs
    does); then the indexes' memory; then the hit rates, each workload routed again on a
    fleet of its own whose engines are LRU caches (cached_hit_rates): the shared-prefix
    groups, and the Mooncake trace scaled up where ``trace`` is given."""
    import gc
    import tracemalloc

    import mooncake_proxy as mp

    engines = instances * dp
    decodes = max(1, engines // 8)
    minimum = SCALE_MIN_DECISIONS // 4 if quick else SCALE_MIN_DECISIONS
    groups = max(SCALE_GROUPS_PER_ENGINE * engines, -(-minimum // SCALE_PER_GROUP))
    requests = scale_workload(groups, SCALE_PER_GROUP)
    fleet = costs_fleet(instances, dp, decodes)
    hashing, prefill, decode = [], [], []
    sent: list[tuple[dict[str, Any], mp.Target, mp.Target]] = []
    clock = time.perf_counter
    gc.collect()
    started = clock()
    for _, body in requests:
        t0 = clock()
        key = mp.route_key(COMPLETIONS, body, None)
        t1 = clock()
        engine = fleet.claim_prefill((), key)
        t2 = clock()
        target = fleet.claim_decode((), key)
        t3 = clock()
        fleet.release_prefill(engine)
        fleet.release_decode(target)
        hashing.append(t1 - t0)
        prefill.append(t2 - t1)
        decode.append(t3 - t2)
        sent.append((body, engine, target))
    seconds = clock() - started
    targets: list[mp.Target] = [e for i in fleet.prefills for e in i.engines]
    targets += fleet.decodes
    # The indexes again, under tracemalloc (it would slow the timed loop): the same chains
    # to the same targets, hashed anew so that the ints they keep are counted too.
    del fleet
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    indexes = {id(t): mp.PrefixIndex(t.index.capacity) for t in targets}
    reverse: list[dict[int, int]] = [{}, {}]  # the stages' Roster.held: prefill, decode
    for n, t in enumerate(targets):
        indexes[id(t)].attach(reverse[isinstance(t, mp.DecodeInstance)], 1 << n)
    for body, *chosen in sent:
        chain = mp.route_key(COMPLETIONS, body, None).chain
        for one in chosen:
            indexes[id(one)].add(chain)
    for index in indexes.values():
        index.forget_sends_before(math.inf)  # the last seconds' sends: not the index's size
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    index_blocks = sum(len(index.blocks) for index in indexes.values())
    assert index_blocks == sum(len(t.index.blocks) for t in targets)  # the run's, rebuilt
    hit_rate, oracle = cached_hit_rates(instances, dp, [body for _, body in requests])
    trace_hits = trace_oracle = math.nan
    traced = 0
    if trace is not None:
        bodies = scale_trace(trace, max(1, engines // SCALE_TRACE_ENGINES))
        trace_hits, trace_oracle = cached_hit_rates(instances, dp, bodies)
        traced = len(bodies)
    us = 1e6
    return ScaleRow(
        instances=instances,
        dp=dp,
        engines=engines,
        decodes=decodes,
        groups=groups,
        decisions=len(requests),
        hash_p50_us=percentile(hashing, 0.5) * us,
        hash_p99_us=percentile(hashing, 0.99) * us,
        prefill_p50_us=percentile(prefill, 0.5) * us,
        prefill_p99_us=percentile(prefill, 0.99) * us,
        decode_p50_us=percentile(decode, 0.5) * us,
        decode_p99_us=percentile(decode, 0.99) * us,
        index_bytes=index_bytes,
        index_blocks=index_blocks,
        hit_rate=hit_rate,
        oracle=oracle,
        trace_hit_rate=trace_hits,
        trace_oracle=trace_oracle,
        trace_decisions=traced,
        seconds=seconds,
    )


def scale_table(rows: Sequence[ScaleRow]) -> str:
    lines = [
        "| prefill engines (instances × DP) | decodes | decisions (groups) | hashing p50 / p99 "
        "| prefill p50 / p99 | decode p50 / p99 | index memory, all targets (per target) "
        "| hit rate: shared prefixes (oracle) | Mooncake trace scaled up (oracle, requests) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.engines:,} ({r.instances} × {r.dp}) | {r.decodes} "
            f"| {r.decisions:,} ({r.groups:,}) | {r.hash_p50_us:.0f} / {r.hash_p99_us:.0f} µs "
            f"| {r.prefill_p50_us:,.0f} / {r.prefill_p99_us:,.0f} µs "
            f"| {r.decode_p50_us:,.0f} / {r.decode_p99_us:,.0f} µs "
            f"| {r.index_bytes / 1e6:.1f} MB ({r.index_bytes / (r.engines + r.decodes) / 1e3:.0f} "
            f"kB) | {r.hit_rate:.3f} ({r.oracle:.3f}, {r.hit_rate / r.oracle:.2f}×) "
            f"| {r.trace_hit_rate:.3f} ({r.trace_oracle:.3f}, "
            f"{r.trace_hit_rate / r.trace_oracle:.2f}×, {r.trace_decisions:,}) |"
        )
    return "\n".join(lines)


def scale_verdict(rows: Sequence[ScaleRow]) -> str:
    at = [r for r in rows if r.engines == TARGET_ENGINES]
    if not at:
        return f"verdict: no run at {TARGET_ENGINES} engines, the targets' size"
    r = at[0]
    figures = [
        (f"{stage} p{q}", value, target)
        for stage, p50, p99 in (
            ("prefill", r.prefill_p50_us, r.prefill_p99_us),
            ("decode", r.decode_p50_us, r.decode_p99_us),
        )
        for q, value, target in ((50, p50, TARGET_P50_US), (99, p99, TARGET_P99_US))
    ]
    missed = [(name, value / target) for name, value, target in figures if value > target]
    said = ", ".join(f"{name} {value:,.0f} µs (≤ {target:.0f})" for name, value, target in figures)
    if not missed:
        return f"verdict at {TARGET_ENGINES} engines: targets met: {said}"
    over = ", ".join(f"{name} {times:.1f}×" for name, times in missed)
    return f"verdict at {TARGET_ENGINES} engines: targets NOT met: {said}; over by {over}"


def scale_plot(rows: Sequence[ScaleRow], path: str) -> None:
    if (plt := pyplot()) is None:
        return
    sizes = [r.engines for r in rows]
    figure, (times, hits) = plt.subplots(1, 2, figsize=(11, 4))
    for label, values, style in (
        ("prefill p50", [r.prefill_p50_us for r in rows], "C0o-"),
        ("prefill p99", [r.prefill_p99_us for r in rows], "C0o--"),
        ("decode p50", [r.decode_p50_us for r in rows], "C1s-"),
        ("decode p99", [r.decode_p99_us for r in rows], "C1s--"),
        ("hashing the prompt p50", [r.hash_p50_us for r in rows], "C2^:"),
    ):
        times.plot(sizes, values, style, label=label)
    for target, label in ((TARGET_P50_US, "target p50"), (TARGET_P99_US, "target p99")):
        times.axhline(target, color="grey", linestyle="-." if target < 100 else ":", lw=1)
        times.annotate(label, (sizes[0], target), fontsize=7, color="grey", va="bottom")
    times.set_title("decision time per stage (µs, in process)")
    for label, hit, oracle, style in (
        ("shared prefixes", [r.hit_rate for r in rows], [r.oracle for r in rows], "C0"),
        ("Mooncake trace", [r.trace_hit_rate for r in rows], [r.trace_oracle for r in rows], "C1"),
    ):
        hits.plot(sizes, hit, style + "o-", label=label)
        hits.plot(sizes, oracle, style + "_", markersize=20, label=f"{label}: oracle")
    hits.set_ylim(0, 1)
    hits.set_title("prefill hit rate, engines as LRU caches")
    for axis in (times, hits):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.set_xlabel("prefill engines")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    times.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    print(f"plot: {path}")


def scale(args: argparse.Namespace) -> int:
    """--scale: the table, the verdict, and --json / --plot."""
    sizes = SCALE_SIZES[:3] if args.quick else SCALE_SIZES
    trace: Path | None = Path(args.trace)
    if trace is not None and not trace.exists():
        print(f"no trace at {trace}: its hit rate is left out ({TRACE_URL})")
        trace = None
    print(
        "Simulated in process: no sockets, no servers, no health checks, no scrapes; the current "
        "router (Fleet.claim_prefill and claim_decode, prefix_aware) on 8 KiB prompts from "
        f"shared-prefix groups ({SCALE_SHARED // 1024} KiB prefix, {SCALE_PER_GROUP} requests a "
        f"group, {SCALE_GROUPS_PER_ENGINE} groups per engine or more, shuffled); each claim "
        "released before the next request. Hit rates: each workload routed again, every engine "
        f"an LRU cache, the fleet's caches {SCALE_CACHE_SHARE:.0%} of its distinct blocks; "
        f"the trace's first {SCALE_TRACE_ROWS:,} rows once per {SCALE_TRACE_ENGINES} engines.",
        flush=True,
    )
    rows = []
    for instances, dp in sizes:
        row = scale_run(instances, dp, args.quick, trace)
        print(
            f"{row.engines:>5} engines, {row.decodes:>3} decodes: {row.decisions:,} decisions in "
            f"{row.seconds:.1f} s; prefill p50 {row.prefill_p50_us:,.0f} µs, decode p50 "
            f"{row.decode_p50_us:,.0f} µs, hit rate {row.hit_rate:.3f} (oracle {row.oracle:.3f}), "
            f"on the trace {row.trace_hit_rate:.3f} (oracle {row.trace_oracle:.3f})",
            flush=True,
        )
        rows.append(row)
    print("\n" + scale_table(rows) + "\n")
    verdict = scale_verdict(rows)
    print(verdict)
    if args.json:
        document = {
            "simulated": "in process: no sockets, no servers",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(),
            "targets": {
                "engines": TARGET_ENGINES,
                "p50_us": TARGET_P50_US,
                "p99_us": TARGET_P99_US,
            },
            "rows": [asdict(r) for r in rows],
            "verdict": verdict,
        }
        Path(args.json).write_text(json.dumps(document, indent=2))
    if args.plot:
        scale_plot(rows, args.plot)
    return 0


# --- --scale-events: what following vLLM's KV cache events costs one process (in process)

EVENTS_SIZES = (8, 64, 512)  # prefill engines followed by one process
# Blocks each engine's view holds throughout a run: 320,000 tokens, 40 GiB of KV for an 8B model
# at 128 KiB a token (Llama 3 8B in bf16), which an 80 GB GPU holds beside its weights.
EVENTS_VIEW_BLOCKS = 20_000
EVENTS_CHAIN = 50  # blocks a prompt (800 tokens) in the views' first contents
# One batch as vLLM publishes a step's events (fake_vllm's EngineSim.kv_events): a BlockRemoved
# for each block evicted to make room, then a BlockStored for each request's run of new blocks.
EVENTS_RUN, EVENTS_RUNS = 16, 2  # two requests, 256 new tokens each
EVENTS_BATCH = EVENTS_RUN * EVENTS_RUNS  # blocks stored a batch, and as many evicted
EVENTS_TIMED = 1 << 18  # block events timed per pass and fleet size
EVENTS_VOCAB = 128_256  # token ids are drawn below it (Llama 3's vocabulary)
# A prefill engine storing 750 new 16-token blocks a second (12,000 prompt tokens) and evicting
# as many: the low side of an estimate of a GPU's pace (one to two thousand blocks stored and
# evicted a second), not measured. The cost is linear in it. With EVENTS_BATCH, 23 batches a
# second an engine.
EVENTS_RATE = 1_500  # block events a second per prefill engine
EVENTS_TARGET_ENGINES, EVENTS_TARGET_CORE = 512, 0.25


@dataclass
class EventsRow:
    engines: int
    view_blocks: int  # per engine, throughout
    view_bytes: int  # one engine's view (HeldBlocks) at view_blocks, its holders' share included
    # Per block event, with the router's holders attached (as the proxy runs):
    stored_us: float  # per BlockStored block: msgpack decode + take_kv_batch, stored-only batches
    removed_us: float  # per BlockRemoved block, removed-only batches
    mixed_us: float  # per block event in vLLM's batches (half evicted, half stored)
    decode_us: float  # of mixed_us, msgspec's decode
    apply_us: float  # of mixed_us, take_kv_batch
    alone_us: float  # mixed_us without holders attached (a view alone)
    attach_seconds: float  # attaching every view to the holders: each fills it with its chains
    gc_seconds: float  # a full garbage collection, and the young ones that then see every view
    gc_longest: float  # the longest collection during the timed passes (it stops the loop)
    batches: int  # timed, all passes
    seconds: float  # the timed passes' wall time

    @property
    def per_core(self) -> float:
        """Block events one core follows a second, in vLLM's batches."""
        return 1e6 / self.mixed_us

    @property
    def core_share(self) -> float:
        """The share of a core one process spends following its engines at EVENTS_RATE."""
        return self.engines * EVENTS_RATE * self.mixed_us / 1e6


def stored_event(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32 sends one: a map with its type, 64-bit int hashes (the default
    of VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), extra_keys None for each plain block."""
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
    }  # fmt: skip


def removed_event(block_hash: int) -> dict[str, Any]:
    """One evicted block, as vLLM's block pool reports each."""
    return {"type": "BlockRemoved", "block_hashes": [block_hash], "medium": "GPU", "group_idx": 0}


def events_payload(events: list[dict[str, Any]]) -> bytes:
    import msgspec

    return msgspec.msgpack.encode([time.time(), events, 0])  # [ts, events, dp_rank]


@dataclass
class EventsHistory:
    """One engine's events: the prompts that fill its view with EVENTS_VIEW_BLOCKS blocks
    (EVENTS_CHAIN each), then a msgpack batch for each of the passes' kinds: "stored"
    (EVENTS_RUNS runs of new blocks, children of the view's first block, never evicted),
    "removed" (as many evicted, the oldest first) or "step" (vLLM's: both). Every block
    removed is held, every new run's parent too, so no event takes a short way out."""

    prompts: list[dict[str, Any]]  # BlockStored events, one per prompt
    batches: list[bytes]

    def fill(self, engine: int) -> Iterator[bytes]:
        """The fill's batches for one engine: each prompt's first token is the engine's, so
        that no two engines hold the same chains (as prefix-aware routing keeps prompts apart),
        and every block after the fill descends from that engine's own."""
        for event in self.prompts:
            yield events_payload([event | {"token_ids": [engine, *event["token_ids"][1:]]}])


def events_history(rng: random.Random, kinds: Sequence[str]) -> EventsHistory:
    prompts, fifo = [], []
    for _ in range(0, EVENTS_VIEW_BLOCKS, EVENTS_CHAIN):
        hashes = [rng.getrandbits(64) for _ in range(EVENTS_CHAIN)]
        tokens = rng.choices(range(EVENTS_VOCAB), k=EVENTS_CHAIN * BLOCK)
        prompts.append(stored_event(hashes, None, tokens))
        fifo += hashes
    root = fifo[0]
    held = collections.deque(fifo[1:])
    batches = []
    for kind in kinds:
        events = []
        if kind != "stored":
            events += [removed_event(held.popleft()) for _ in range(EVENTS_BATCH)]
        if kind != "removed":
            for _ in range(EVENTS_RUNS):
                hashes = [rng.getrandbits(64) for _ in range(EVENTS_RUN)]
                tokens = rng.choices(range(EVENTS_VOCAB), k=EVENTS_RUN * BLOCK)
                events.append(stored_event(hashes, root, tokens))
                held += hashes
        batches.append(events_payload(events))
    return EventsHistory(prompts, batches)


def events_state() -> mp.ProxyState:
    """A process's state, for take_kv_batch to count batches in its metrics; no sockets."""
    from yarl import URL

    import mooncake_proxy as mp

    spec = mp.PrefillSpec(URL("http://10.0.0.1:8100"), URL("http://10.0.0.1:8998"))
    return mp.ProxyState(mp.ProxyConfig(prefills=(spec,), decodes=(URL("http://10.0.1.1:8200"),)))


def events_decoder() -> Callable[[bytes], object]:
    """The decode follow_kv_feed uses, as watch_kv_events makes it."""
    import mooncake_proxy as mp

    return mp.kv_batch_decoder()


def events_view_bytes(state: mp.ProxyState, history: EventsHistory) -> int:
    """One engine's view at EVENTS_VIEW_BLOCKS, filled through the proxy's path with holders
    attached, by tracemalloc: what it keeps, the decoded hashes and its share of the holders
    (an engine's chains are its own) included."""
    import gc
    import tracemalloc

    import mooncake_proxy as mp

    decode = events_decoder()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    feed = mp.KvFeed("tcp://10.0.0.1:5557", None)
    holders: dict[int, int] = {}
    feed.held.attach(holders, 1 << 511)  # the last of 512 engines: the widest bit
    for seq, payload in enumerate(history.fill(0)):
        mp.take_kv_batch(state, feed, seq, decode(payload))
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(feed.held) == EVENTS_VIEW_BLOCKS == len(holders)
    return kept


@contextlib.contextmanager
def gc_timed(spent: list[float]) -> Iterator[None]:
    """The time of each garbage collection meanwhile, appended to ``spent``."""
    import gc

    started: list[float] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spent.append(time.perf_counter() - started.pop())

    gc.callbacks.append(note)
    try:
        yield
    finally:
        gc.callbacks.remove(note)


@dataclass
class EventsPass:
    """One timed pass over every engine (events_pass)."""

    kinds: list[str]  # the batches' kinds, the first two a warm-up
    first_seq: int
    spent: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("stored", "removed", "decode", "apply"), 0.0)
    )
    seconds: float = 0.0
    collections: list[float] = field(default_factory=list)  # the garbage collector's, timed


def events_pass(
    state: mp.ProxyState, feeds: list[mp.KvFeed], batches: Sequence[bytes], timed: EventsPass
) -> None:
    """Its batches applied by every engine in turn, the first two (one stored, one removed)
    untimed: each view's dicts are then as they stay. "step" batches are timed in two parts,
    decoding and take_kv_batch; the others whole, per kind."""
    import mooncake_proxy as mp

    decode = events_decoder()
    clock = time.perf_counter
    spent = timed.spent
    for seq, payload in enumerate(batches[:2], timed.first_seq):
        for feed in feeds:
            mp.take_kv_batch(state, feed, seq, decode(payload))
    started = clock()
    timed_batches = zip(timed.kinds[2:], batches[2:], strict=True)
    with gc_timed(timed.collections):
        for seq, (kind, payload) in enumerate(timed_batches, timed.first_seq + 2):
            if kind == "step":
                for feed in feeds:
                    t0 = clock()
                    batch = decode(payload)
                    t1 = clock()
                    mp.take_kv_batch(state, feed, seq, batch)
                    t2 = clock()
                    spent["decode"] += t1 - t0
                    spent["apply"] += t2 - t1
            else:
                for feed in feeds:
                    t0 = clock()
                    mp.take_kv_batch(state, feed, seq, decode(payload))
                    spent[kind] += clock() - t0
    timed.seconds = clock() - started


def events_run(engines: int, state: mp.ProxyState, seed: int) -> EventsRow:
    """One fleet size: a KvFeed per engine, each view filled to EVENTS_VIEW_BLOCKS (no two
    engines' chains alike), then two timed passes, the engines taken in turn batch by batch as
    their streams interleave: stored and removed batches alternating (each kind timed apart),
    then vLLM's steps (decoding and applying timed apart). The first pass is of the views
    alone; then every view is attached to one holders dict, as the router attaches a stage's
    engines (each its bit, 1 << n), and the second pass is of them so. Each pass is
    EVENTS_TIMED block events over all engines; the views end as full as they started. What is
    timed is the proxy's path once a batch's bytes are in (follow_kv_feed's decode and
    take_kv_batch), not receiving them from ZMQ.

    Before them, untimed but for the garbage collector: a full collection (gc.collect) and the
    young ones after the first stored block of each view (gc_seconds; with views whose dicts
    hold only ints, which the collector never tracks, nothing to see). The collections the
    passes' own allocations bring about are in their times, the longest apart (gc_longest)."""
    import gc

    import mooncake_proxy as mp

    per_engine = max(2, EVENTS_TIMED // engines // EVENTS_BATCH)  # batches a pass, even
    per_engine -= per_engine % 2
    kinds = ["stored", "removed"] * (1 + per_engine // 2) + ["step"] * (per_engine // 2)
    history = events_history(random.Random(seed), ["step", *kinds, *kinds])
    decode = events_decoder()
    feeds = [mp.KvFeed(f"tcp://10.0.{n // 64}.{n % 64}:5557", None) for n in range(engines)]
    for n, feed in enumerate(feeds):
        for seq, payload in enumerate(history.fill(n)):
            mp.take_kv_batch(state, feed, seq, decode(payload))
    pauses: list[float] = []
    with gc_timed(pauses):
        gc.collect()
        for feed in feeds:  # stored blocks: a view whose dicts hold tuples is tracked again
            mp.take_kv_batch(state, feed, len(history.prompts), decode(history.batches[0]))
        gc.collect(1)
    alone = EventsPass(kinds, len(history.prompts) + 1)
    events_pass(state, feeds, history.batches[1 : 1 + len(kinds)], alone)
    holders: dict[int, int] = {}
    started = time.perf_counter()
    for n, feed in enumerate(feeds):
        feed.held.attach(holders, 1 << n)
    attach_seconds = time.perf_counter() - started
    attached = EventsPass(kinds, alone.first_seq + len(kinds))
    events_pass(state, feeds, history.batches[1 + len(kinds) :], attached)
    for feed in feeds:  # every event took the proxy's full path: none missed, none refused
        assert feed.gaps == 0 and feed.problem is None and feed.held.unplaced == 0
        assert len(feed.held) == EVENTS_VIEW_BLOCKS
    assert len(holders) == engines * EVENTS_VIEW_BLOCKS  # no two engines' chains alike
    per_kind = engines * per_engine // 2 * EVENTS_BATCH  # block events of each kind, a pass
    us, spent = 1e6, attached.spent
    return EventsRow(
        engines=engines,
        view_blocks=EVENTS_VIEW_BLOCKS,
        view_bytes=0,
        stored_us=spent["stored"] / per_kind * us,
        removed_us=spent["removed"] / per_kind * us,
        mixed_us=(spent["decode"] + spent["apply"]) / (2 * per_kind) * us,
        decode_us=spent["decode"] / (2 * per_kind) * us,
        apply_us=spent["apply"] / (2 * per_kind) * us,
        alone_us=(alone.spent["decode"] + alone.spent["apply"]) / (2 * per_kind) * us,
        attach_seconds=attach_seconds,
        gc_seconds=sum(pauses),
        gc_longest=max(alone.collections + attached.collections, default=0.0),
        batches=2 * engines * (len(kinds) - 2),
        seconds=alone.seconds + attached.seconds,
    )


def events_table(rows: Sequence[EventsRow]) -> str:
    lines = [
        "| prefill engines | views' memory (per engine) | stored | removed "
        "| vLLM's batches (decode + apply) | without holders | block events / s per core "
        f"| share of a core at {EVENTS_RATE:,} / s per engine "
        "| attaching every view | a full GC and the young ones after it "
        "| longest GC meanwhile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.engines:,} | {r.view_bytes * r.engines / 1e9:.2f} GB "
            f"({r.view_bytes / 1e6:.1f} MB) | {r.stored_us:.2f} µs | {r.removed_us:.2f} µs "
            f"| {r.mixed_us:.2f} µs ({r.decode_us:.2f} + {r.apply_us:.2f}) "
            f"| {r.alone_us:.2f} µs | {r.per_core:,.0f} | {r.core_share:.2f} "
            f"| {r.attach_seconds:.2f} s | {r.gc_seconds:.2f} s | {r.gc_longest * 1e3:.1f} ms |"
        )
    return "\n".join(lines)


def events_multiplied(r: EventsRow) -> str:
    """What --workers and replicas multiply: each process follows every engine."""
    return (
        f"every --workers process and every replica follows every engine: N workers and R "
        f"replicas spend N × R × {r.core_share:.2f} cores and N × R × "
        f"{r.view_bytes * r.engines / 1e9:.1f} GB at {r.engines} engines (4 workers and 2 "
        f"replicas: {8 * r.core_share:.1f} cores, {8 * r.view_bytes * r.engines / 1e9:.0f} GB)"
    )


def events_verdict(rows: Sequence[EventsRow]) -> str:
    at = [r for r in rows if r.engines == EVENTS_TARGET_ENGINES]
    if not at:
        return f"verdict: no run at {EVENTS_TARGET_ENGINES} engines, the target's size"
    r = at[0]
    said = (
        f"{r.engines} engines at {EVENTS_RATE:,} block events a second each take "
        f"{r.core_share:.2f} of a core per process with the router's holders attached "
        f"({r.engines * EVENTS_RATE * r.alone_us / 1e6:.2f} without; target ≤ "
        f"{EVENTS_TARGET_CORE})"
    )
    if r.core_share <= EVENTS_TARGET_CORE:
        return f"verdict: target met: {said}"
    needed = EVENTS_TARGET_CORE * 1e6 / (r.engines * EVENTS_RATE)
    apply_share = r.engines * EVENTS_RATE * r.apply_us / 1e6
    within = EVENTS_TARGET_CORE * 1e6 / (EVENTS_RATE * r.mixed_us)  # fewer engines cost less
    return (
        f"verdict: target NOT met, {r.core_share / EVENTS_TARGET_CORE:.1f}× over: {said}. It "
        f"needs {needed:.2f} µs a block event, not {r.mixed_us:.2f}; decoding is "
        f"{r.decode_us:.2f} µs of it, take_kv_batch {r.apply_us:.2f} (with decoding free: "
        f"{apply_share:.2f} of a core). At this cost a quarter of a core follows {within:.0f} "
        "engines"
    )


def scale_events(args: argparse.Namespace) -> int:
    """--scale-events: the table, the verdict, what workers and replicas multiply, --json."""
    sizes = EVENTS_SIZES[:2] if args.quick else EVENTS_SIZES
    print(
        f"Simulated in process, no sockets: one KvFeed per prefill engine, each view holding "
        f"{EVENTS_VIEW_BLOCKS:,} 16-token blocks throughout, no two engines' alike; vLLM 0.32's "
        f"msgpack batches ({EVENTS_BATCH} blocks evicted a step, one event each, and "
        f"{EVENTS_RUNS} runs of {EVENTS_RUN} new blocks) decoded and applied by take_kv_batch, "
        "the engines taken in turn, with the router's holders attached (and without); ZMQ's "
        "receiving is not counted.",
        flush=True,
    )
    state = events_state()
    rows = []
    for n, engines in enumerate(sizes):
        row = events_run(engines, state, seed=n)
        print(
            f"{engines:>4} engines: {row.batches:,} batches in {row.seconds:.1f} s; "
            f"{row.mixed_us:.2f} µs a block event ({row.alone_us:.2f} without holders), "
            f"{row.core_share:.2f} of a core at {EVENTS_RATE:,} a second each",
            flush=True,
        )
        rows.append(row)
    view_bytes = events_view_bytes(state, events_history(random.Random(99), ()))
    rows = [dataclasses.replace(r, view_bytes=view_bytes) for r in rows]
    print("\n" + events_table(rows) + "\n")
    verdict = events_verdict(rows)
    multiplied = events_multiplied(rows[-1])
    print(verdict)
    print(multiplied)
    if args.json:
        document = {
            "simulated": "in process: no sockets; decode + take_kv_batch per batch",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(),
            "rate_per_engine": EVENTS_RATE,
            "target": {"engines": EVENTS_TARGET_ENGINES, "core_share": EVENTS_TARGET_CORE},
            "rows": [
                asdict(r) | {"per_core": r.per_core, "core_share": r.core_share} for r in rows
            ],
            "verdict": verdict,
            "workers_and_replicas": multiplied,
        }
        Path(args.json).write_text(json.dumps(document, indent=2))
    return 0


BLOCK = 16  # the fakes' KV block, in tokens


def spawn(argvs: list[list[str]]) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for argv in argvs
    ]


def targets(
    cluster: Cluster, quick: bool, only: Sequence[str] | None = None
) -> list[tuple[str, list[list[str]]]]:
    """The targets measured (``only``: those of these names, --quick or not). With several
    --proxy, each proxy's, named after its directory ("prefix_aware [wt-old]": a name with
    its label picks that proxy's alone): an A/B on the same engines, as the hash seeds are
    the engines' URLs and another cluster places prefixes apart."""
    chosen = []
    for source in cluster.proxies:
        label = f" [{source.parent.name}]" if len(cluster.proxies) > 1 else ""
        for name, argvs in all_targets(cluster, quick and not only, source):
            if only and name not in only and name + label not in only:
                continue
            if not only and "x4" in name:
                continue  # four replicas only when named: they would lengthen every run
            chosen.append((name + label, argvs))
    return chosen


def all_targets(cluster: Cluster, quick: bool, source: Path) -> list[tuple[str, list[list[str]]]]:
    def proxy(*flags: str) -> list[str]:
        return cluster.proxy_argv(free_port(), *flags, proxy=source)

    def told(count: int, *flags: str) -> list[list[str]]:
        """``count`` replicas, each a --peer of the others."""
        ports = [free_port() for _ in range(count)]
        peers = [word for port in ports for word in ("--peer", f"127.0.0.1:{port}")]
        return [cluster.proxy_argv(port, *flags, *peers, proxy=source) for port in ports]

    if cluster.tokenizer_dir is not None:  # --precise: the estimate against the engines' events
        events = cluster.precise_flags()
        chosen = [
            ("round_robin", [proxy("--policy", "round_robin")]),
            ("prefix_aware (estimate)", [proxy()]),
            ("prefix_aware + KV events", [proxy(*events)]),
        ]
        if not quick:
            chosen += [
                ("estimate x2 replicas", [proxy(), proxy()]),
                ("KV events x2 replicas", [proxy(*events), proxy(*events)]),
                ("estimate x4 replicas", [proxy() for _ in range(4)]),
                ("KV events x4 replicas", [proxy(*events) for _ in range(4)]),
                ("KV events x2 replicas --peer", told(2, *events)),
                ("KV events x4 replicas --peer", told(4, *events)),
                ("KV events --workers 2", [proxy("--workers", "2", *events)]),
            ]
        return chosen
    chosen = [
        ("round_robin", [proxy("--policy", "round_robin")]),
        ("least_loaded", [proxy("--policy", "least_loaded")]),
        ("prefix_aware", [proxy()]),
    ]
    if not quick:
        chosen += [
            ("prefix_aware x2 replicas", [proxy(), proxy()]),
            ("prefix_aware x4 replicas", [proxy() for _ in range(4)]),
            ("prefix_aware x2 replicas --peer", told(2)),
            ("prefix_aware x4 replicas --peer", told(4)),
            ("prefix_aware --workers 2", [proxy("--workers", "2")]),
        ]
        if source == cluster.proxies[0] and (router := cluster.router_argv(free_port())):
            chosen.append(("vllm-router cache_aware", [router]))
    return chosen


def workloads(args: argparse.Namespace) -> list[tuple[str, list[Request]]]:
    """Sized for the cluster: at ``scale`` times the default's engines (--fleet), ``scale``
    times the prefix groups, conversations and trace copies (each engine's share of the
    working set, hence the oracle, as at 8 engines), at ``--rate`` times the default's
    request rate (the same rate by default: each engine ``scale`` times less loaded)."""
    quick, scale, rate = args.quick, args.fleet.scale, args.rate
    chosen = [
        ("shared prefixes", shared_prefix_groups(32 * scale, 4 if quick else 10, 120.0 * rate)),
        ("hot prefix", hot_prefix(80 if quick else 240, 100.0 * rate)),
    ]
    if not quick:
        chosen.insert(1, ("multi-turn", multi_turn(24 * scale, 8, 1.0 * scale / rate)))
        # One conversation alone, short turns that all fit one engine's cache: it should
        # stay there.
        chosen.insert(2, ("one chat", multi_turn(1, 12, 0.5, (1024, 50, 100))))
        trace = Path(args.trace)
        if trace.exists():
            rows = args.trace_rows
            replay = mooncake_trace(trace, rows, rows / 100.0 * scale / rate, copies=scale)
            chosen.insert(2, ("Mooncake trace", replay))
        else:
            print(f"no trace at {trace}: the Mooncake workload is left out ({TRACE_URL})")
    return chosen


def format_row(r: Result) -> str:
    return (
        f"{r.workload:<16} {r.target:<26} hit {r.hit_rate:5.3f} (oracle {r.oracle:5.3f}, "
        f"{r.hit_rate / r.oracle if r.oracle else float('nan'):4.2f}x)  ttft p50/p90 "
        f"{r.ttft_p50_ms:7.1f}/{r.ttft_p90_ms:7.1f} ms  max/mean {r.max_over_mean:4.2f}  "
        f"decode local {r.decode_local:4.2f}  err {r.errors}/{r.requests}"
    )


def table(results: list[Result]) -> str:
    lines = [
        "| workload | target | prefill hit rate | oracle | vs oracle | TTFT p50 / p90 (ms) | "
        "max/mean requests per engine | decode's own cache |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.workload} | {r.target} | {r.hit_rate:.3f} | {r.oracle:.3f} | "
            f"{r.hit_rate / r.oracle:.2f}x | {r.ttft_p50_ms:.1f} / {r.ttft_p90_ms:.1f} | "
            f"{r.max_over_mean:.2f} | {r.decode_local:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    if (plt := pyplot()) is None:
        return
    names = list(dict.fromkeys(r.workload for r in results))
    kinds = list(dict.fromkeys(r.target for r in results))
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        rows = {r.workload: r for r in results if r.target == kind}
        xs = [n + k * width for n in range(len(names))]
        hits.bar(xs, [rows[w].hit_rate if w in rows else 0 for w in names], width, label=kind)
        ttft.bar(xs, [rows[w].ttft_p90_ms if w in rows else 0 for w in names], width, label=kind)
    oracle = {r.workload: r.oracle for r in results}
    hits.plot([n + 0.4 - width / 2 for n in range(len(names))], [oracle[w] for w in names], "k_",
              markersize=40, label="oracle")  # fmt: skip
    for axis, title in ((hits, "prefill prefix-cache hit rate"), (ttft, "TTFT p90 (ms)")):
        axis.set_xticks([n + 0.4 - width / 2 for n in range(len(names))], names)
        axis.set_title(title)
        axis.grid(True, axis="y", alpha=0.3)
    ttft.set_yscale("log")
    hits.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"plot: {path}")


async def bench(args: argparse.Namespace, cluster: Cluster) -> list[Result]:
    """Every target on every workload; with --rounds, each again in rounds whose order turns
    (the machine's noise spread over all), and the median of each figure kept."""
    results: list[Result] = []
    for name, requests in workloads(args):
        if args.workload and name not in args.workload:
            continue
        runs: dict[str, list[Result]] = {}
        prompts = cluster.prompts(requests)
        engines = cluster.shape.engines
        oracle, split = oracle_hit_rate(prompts, engines), split_hit_rate(prompts, engines)
        print(f"{name}: oracle {oracle:.3f}; its engines' caches split perfectly, with no "
              f"load bound {split:.3f} ({split / oracle:.2f}x)", flush=True)  # fmt: skip
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await cluster.warm(session, requests)
        for round_ in range(args.rounds):
            chosen = targets(cluster, args.quick, args.target)
            turn = round_ % len(chosen)
            for target, argvs in chosen[turn:] + chosen[:turn]:
                result = await run(cluster, name, target, argvs, requests, oracle)
                if result is not None:
                    runs.setdefault(target, []).append(result)
        results += [median_of(rows) for rows in runs.values()]
    return results


def median_of(rows: list[Result]) -> Result:
    """One target's rounds on one workload as one row: each figure's median."""
    if len(rows) == 1:
        return rows[0]

    def median(figure: str) -> float:
        return float(statistics.median(float(getattr(r, figure)) for r in rows))

    return dataclasses.replace(
        rows[0],
        requests=sum(r.requests for r in rows),
        errors=sum(r.errors for r in rows),
        hit_rate=median("hit_rate"),
        ttft_p50_ms=median("ttft_p50_ms"),
        ttft_p90_ms=median("ttft_p90_ms"),
        max_over_mean=median("max_over_mean"),
        decode_local=median("decode_local"),
        extra={"rounds": [dataclasses.asdict(r) for r in rows]},
    )


def unit(label: str) -> str:
    return "" if "bytes" in label else " µs"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "fake":
        run_fake(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two workloads, three targets")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake synthetic trace")
    parser.add_argument(
        "--precise",
        action="store_true",
        help="engines with a real tokenizer that publish KV events: the estimate against them",
    )
    parser.add_argument("--workload", action="append", help="only these workloads (by name)")
    parser.add_argument(
        "--target", action="append", help="only these targets (by name, e.g. prefix_aware)"
    )
    parser.add_argument(
        "--fleet",
        type=Shape.parse,
        default=Shape(),
        metavar="INSTANCESxDP[,DECODES]",
        help=f"the simulated cluster (default {Shape()}); the workloads grow with its engines",
    )
    parser.add_argument(
        "--rate", type=float, default=1.0, help="the workloads' request rates times this"
    )
    parser.add_argument(
        "--trace-rows",
        type=int,
        default=4000,
        help="the Mooncake trace's first rows replayed (100 a second, times --rate)",
    )
    parser.add_argument(
        "--proxy",
        type=Path,
        action="append",
        help="the mooncake_proxy.py launched as the proxy targets (default this one's); "
        "several: each one's targets on the same engines, an A/B (the in-process costs are "
        "left out unless this one's is the first)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run every row this many times; medians kept"
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="instead: the decision's cost, index memory and hit rate from 8 to 1,024 engines, "
        "simulated in process (with --quick: up to 128)",
    )
    parser.add_argument(
        "--scale-events",
        action="store_true",
        help="instead: what following vLLM's KV cache events costs one process for 8, 64 and "
        "512 engines, in process (with --quick: up to 64)",
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args()
    if args.scale:
        return scale(args)
    if args.scale_events:
        return scale_events(args)
    os.environ.pop("NOTIFY_SOCKET", None)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = None
        proxies = tuple(p.resolve() for p in args.proxy or [ROOT / "mooncake_proxy.py"])
        ours = proxies[0] == ROOT / "mooncake_proxy.py"  # the costs are measured in process
        costs = decision_costs() if ours else []
        if args.precise:
            tokenizer_dir = Path(scratch)
            build_tokenizer(tokenizer_dir)
            costs += precise_costs(tokenizer_dir) if ours else []
        for label, value in costs:
            print(f"{label}: {value:.1f}{unit(label)}", flush=True)
        print(f"cluster {args.fleet} ({args.fleet.engines} prefill engines), proxies:",
              *map(str, proxies), flush=True)  # fmt: skip
        cluster = Cluster.start(tokenizer_dir, args.fleet, proxies)
        try:
            results = asyncio.run(bench(args, cluster))
        finally:
            cluster.stop()
    print("\n" + table(results))
    print("\n| cost | value |\n|---|---|")
    for label, value in costs:
        print(f"| {label} | {value:.1f}{unit(label)} |")
    if args.json:
        document = {"results": [asdict(r) for r in results], "costs": dict(costs)}
        Path(args.json).write_text(json.dumps(document, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 1 if any(r.errors for r in results if not r.target.startswith("vllm-router")) else 0


if __name__ == "__main__":
    sys.exit(main())
