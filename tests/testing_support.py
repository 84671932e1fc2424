"""What several test files share: the fake cluster under test (conftest.py has its fixture,
start_cluster), the ways to start the daemon, in this process or in one of its own, and the
helpers that talk to it and read what it says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from pytest_aiohttp import AiohttpClient, AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from fake_vllm import KEEPALIVE_SECONDS, FakeVllm, free_port

HERE = Path(__file__).resolve().parent  # tests/, with the fakes
ROOT = HERE.parent  # the repository: the daemon, deploy/, docs/
# Generous bounds: a proxy that fails fast answers in milliseconds, a broken one waits for the
# decode's KV timeout (KV_TIMEOUT) and fails these.
FAST = 3.0
KV_TIMEOUT = 20.0

CHAT = "/v1/chat/completions"
JSON_TYPE = {"Content-Type": "application/json"}  # for bodies not sent with json=
# Fakes refuse prompts past their max_model_len (4096 tokens of 4 bytes) as vLLM does.
LONG_CONTEXT = {"max_model_len": 1 << 26}
COMPLETIONS = "/v1/completions"
SPEC = mp.PrefillSpec(URL("http://p:1"), URL("http://p:8998"))


# --- the cluster under test


@dataclass
class Cluster:
    prefills: list[FakeVllm]
    decodes: list[FakeVllm]
    config: mp.ProxyConfig
    client: TestClient[web.Request, web.Application]
    aiohttp_server: AiohttpServer
    api_servers: dict[int, TestServer]  # by id() of the fake

    @property
    def port(self) -> int:
        """The proxy's port, for clients on plain sockets."""
        port = self.client.server.port
        assert port is not None
        return port

    def prefill_requests(self) -> list[tuple[int, Any]]:
        return [(i, r) for i, fake in enumerate(self.prefills) for r in fake.requests]

    async def kill(self, fake: FakeVllm) -> None:
        """The API server goes away: its port refuses connections (the bootstrap stays)."""
        await self.api_servers.pop(id(fake)).close()

    async def start_again(self, fake: FakeVllm, new_engine_ids: bool = True) -> None:
        if new_engine_ids:
            fake.restart()
        port = int(fake.api_url.rsplit(":", 1)[1])
        self.api_servers[id(fake)] = await serve(self.aiohttp_server, fake.api_app(), port=port)


StartCluster = Callable[..., Awaitable[Cluster]]


class DaemonTestServer(TestServer):
    """The app served as the daemon serves it: each connection a mooncake_proxy.ClientConnection
    (head deadline, connection cap, the proxy's own answer to malformed requests)."""

    listener: asyncio.Server | None = None

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        if self.runner:
            return
        self.runner = runner = web.AppRunner(self.app, handler_cancellation=True)
        await runner.setup()
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.listener = await mp.listen(runner, sock)
        self._root = URL(f"http://127.0.0.1:{self.port}")

    async def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        await super().close()


class UncancelledTestServer(TestServer):
    """A server that does not cancel the handler of a client that left, so the proxy finds out
    on its next write: what happens under load when the two events meet in one loop turn."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


async def serve(
    aiohttp_server: AiohttpServer, app: web.Application, port: int | None = None
) -> TestServer:
    """An app (a fake vLLM's, mostly) served as vLLM's uvicorn serves: idle connections are
    closed after KEEPALIVE_SECONDS."""
    server: TestServer = await aiohttp_server(app, port=port, keepalive_timeout=KEEPALIVE_SECONDS)
    return server


async def daemon_client(
    aiohttp_client: AiohttpClient, config: mp.ProxyConfig, cancel_handlers: bool = True
) -> TestClient[web.Request, web.Application]:
    """The daemon in this process, its app served as the daemon serves it, and a client of it.
    ``cancel_handlers``: as the daemon does; else UncancelledTestServer's way."""
    app = mp.create_app(config)
    server = DaemonTestServer(app) if cancel_handlers else UncancelledTestServer(app)
    # The client of a server (not of an app) is typed without the app: it is this one.
    return cast(TestClient[web.Request, web.Application], await aiohttp_client(server))


def subscribed(fake: FakeVllm, subscribers: int = 1) -> bool:
    """Each of the fake's engines has this many subscribers to its KV events."""
    return all(
        (events := fake.sim(rank).events) is not None and events.subscribers >= subscribers
        for rank in range(fake.dp_size)
    )


async def wait_ready_(client: TestClient[web.Request, web.Application]) -> None:
    """Until every configured instance is in the rotation (readiness needs only one each)."""
    fleet = client.app[mp.STATE_KEY].fleet
    async with asyncio.timeout(FAST):
        while (await client.get("/health")).status != 200 or not all(
            backend.usable for backend in (*fleet.prefills, *fleet.decodes)
        ):
            await asyncio.sleep(0.01)


async def eventually(check: Callable[[], bool], seconds: float = FAST) -> None:
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.01)


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: "):
            data = frame[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def assert_openai_error(payload: Any, status: int) -> None:
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"].endswith("Error")


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "Tell me about KV caches", "max_tokens": 8, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Tell me about KV caches"}]
    return {"model": "fake-model", "messages": messages, "max_tokens": 8, **extra}


async def scrape(
    cluster: Cluster, **headers: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await cluster.client.get("/metrics", headers=headers)
    assert response.status == 200
    samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of a series' samples whose labels include ``labels``: a counter by route is
    the sum over its models."""
    wanted = labels.items()
    return sum(
        value
        for (named, pairs), value in samples.items()
        if named == name and wanted <= dict(pairs).items()
    )


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access lines of requests other than probes (which are DEBUG)."""
    return [
        r.__dict__["access"]
        for r in caplog.records
        if r.name == "mooncake_proxy.access" and r.levelno >= logging.INFO
    ]


def fleet_of(cluster: Cluster) -> mp.Fleet:
    return cluster.client.app[mp.STATE_KEY].fleet


# --- routing: prompts and where they went


def long_prompt(tag: str, size: int = 2048) -> str:
    """A prompt of ``size`` bytes that starts with ``tag``: its first block is the tag's."""
    return (f"{tag}: " + "context " * size)[:size]


def engine_of(cluster: Cluster) -> dict[str, tuple[int, int]]:
    """Which prefill engine (instance, DP rank) served each prompt."""
    return {
        r.body["prompt"]: (index, int(r.headers["X-data-parallel-rank"]))
        for index, r in cluster.prefill_requests()
    }


# --- the daemon in a process of its own


class ProcessLog:
    """A daemon's stderr, line by line, read as it comes."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self.grew = asyncio.Event()
        self.task = asyncio.create_task(self.read(stream))

    async def read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.lines.append(line.decode().rstrip())
            self.grew.set()

    async def wait_for_processes(self, text: str, count: int, seconds: float = FAST) -> None:
        """Until ``count`` processes (the pid in each line) have logged ``text``."""
        async with asyncio.timeout(seconds):
            while True:
                self.grew.clear()
                pids = {re.search(r"\[(\d+)\]: ", line) for line in self.lines if text in line}
                if len({match[1] for match in pids if match}) >= count:
                    return
                await self.grew.wait()

    async def wait_for(self, text: str, seconds: float = FAST) -> str:
        async with asyncio.timeout(seconds):
            while True:
                self.grew.clear()
                if found := [line for line in self.lines if text in line]:
                    return found[-1]
                await self.grew.wait()


async def until_healthy(session: aiohttp.ClientSession, base: str, seconds: float = 15) -> None:
    """Wait for ``base``'s /health to answer 200 (a server starting in a process of its own)."""
    async with asyncio.timeout(seconds):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{base}/health") as health:
                    if health.status == 200:
                        return
            await asyncio.sleep(0.05)


class SystemdInbox:
    """A NOTIFY_SOCKET as systemd's: what the daemon tells it, read as it comes (a datagram
    left unread would, 512 later, block the daemon's sends)."""

    def __init__(self) -> None:
        self.address = f"@mooncake-proxy-test-{os.getpid()}-{free_port()}"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind("\0" + self.address[1:])
        self.socket.setblocking(False)
        self.heard: list[str] = []
        asyncio.get_running_loop().add_reader(self.socket, self.read)

    def read(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.heard += self.socket.recv(4096).decode().splitlines()

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.socket)
        self.socket.close()


class ProxyProcess:
    """The daemon in a process of its own (python mooncake_proxy.py), as users and systemd
    start it; what it says on stderr is read as it comes (``log``)."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process = process
        self.base = f"http://127.0.0.1:{port}"
        assert process.stderr is not None
        self.log = ProcessLog(process.stderr)
        self.systemd: SystemdInbox | None = None

    @classmethod
    async def launch(
        cls,
        *argv: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        ready: bool = True,
    ) -> ProxyProcess:
        """The daemon started with ``argv``, after a --port of a free port; or, given
        ``port``, where its --config file says it listens. ``env`` is added to the test's
        environment. ``ready``: returned once it answers /health 200; else at once, for a
        test that watches its log."""
        if port is None:
            port = free_port()
            argv = ("--port", str(port), *argv)
        # Tests count the requests each fake got: no self-test's among them.
        argv = ("--no-start-self-test", *argv)
        env = {**os.environ, **(env or {})}
        # Under --workers one worker's /health says nothing of the others: ready is when the
        # supervisor tells systemd so, once every worker serves.
        systemd = None
        if ready and "--workers" in argv and "NOTIFY_SOCKET" not in env:
            systemd = SystemdInbox()
            env["NOTIFY_SOCKET"] = systemd.address
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "mooncake_proxy.py"), *argv,
            stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        proxy = cls(process, port)
        proxy.systemd = systemd
        if not ready:
            return proxy
        try:
            async with aiohttp.ClientSession() as session:
                await until_healthy(session, proxy.base)
            if systemd is not None:
                await eventually(lambda: "READY=1" in systemd.heard, 15)
        except BaseException:
            await proxy.stop()  # a daemon that never got ready is not left running
            raise
        return proxy

    @classmethod
    async def start(
        cls,
        aiohttp_server: AiohttpServer,
        *flags: str,
        env: dict[str, str] | None = None,
        decode: dict[str, Any] | None = None,
        both: dict[str, Any] | None = None,
        ready: bool = True,
    ) -> tuple[ProxyProcess, FakeVllm]:
        """The daemon (launch(), with ``flags``, ``env`` and ``ready``) in front of a prefill
        and a decode fake served here. ``decode``: the decode fake's settings; ``both``: both
        fakes'."""
        prefill = FakeVllm("prefill", **(both or {}))
        api = await serve(aiohttp_server, prefill.api_app())
        bootstrap = await serve(aiohttp_server, prefill.bootstrap_app())
        prefill.api_url = f"http://127.0.0.1:{api.port}"
        fake_decode = FakeVllm("decode", kv_timeout=KV_TIMEOUT, **(both or {}) | (decode or {}))
        decode_server = await serve(aiohttp_server, fake_decode.api_app())
        proxy = await cls.launch(
            "--prefill", prefill.api_url, str(bootstrap.port),
            "--decode", f"http://127.0.0.1:{decode_server.port}", *flags,
            env=env, ready=ready,
        )  # fmt: skip
        return proxy, fake_decode

    async def stop(self) -> str:
        """SIGTERM, unless it exited already; once it did, all it said on stderr."""
        if self.process.returncode is None:
            self.process.terminate()
        await self.process.wait()
        await self.log.task
        if self.systemd is not None:
            self.systemd.close()
        return "\n".join(self.log.lines)
