"""The fleet behind the proxy: readiness and the discovery and health endpoints; a fleet that
changes (the config file, reloads, rolling upgrades, DNS discovery); a live fleet whose
instances fail, restart and get busy (health checks, re-discovery, failover, load)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from pytest_aiohttp import AiohttpClient, AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from fake_vllm import FakeVllm, free_port
from testing_support import (
    CHAT,
    COMPLETIONS,
    FAST,
    HERE,
    KV_TIMEOUT,
    ROOT,
    Cluster,
    ProxyProcess,
    StartCluster,
    access_lines,
    assert_openai_error,
    chat,
    completion,
    daemon_client,
    eventually,
    fleet_of,
    sample,
    scrape,
    serve,
    sse_events,
    until_healthy,
    wait_ready_,
)

# --- readiness, discovery, health endpoints


async def test_not_ready_until_a_prefill_and_a_decode_are_usable(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        prefill_dp=(1, 2), wait_ready=False, prefill={"bootstrap_not_ready": 30}
    )
    client = cluster.client
    health = await client.get("/healthcheck")
    assert health.status == 503
    payload = await health.json()
    assert payload["ready"] is False
    assert (payload["prefill_instances"], payload["decode_instances"]) == (2, 1)
    assert payload["id"] == mp.ID and payload["version"] == mp.VERSION
    assert (await client.get("/health")).status == 503
    for path in (COMPLETIONS, CHAT):
        refused = await client.post(path, json=completion())
        assert refused.status == 503
        assert_openai_error(await refused.json(), 503)
    models = await client.get("/v1/models")
    assert models.status == 503
    assert_openai_error(await models.json(), 503)

    await wait_ready_(client)
    payload = await (await client.get("/healthcheck")).json()
    assert payload["ready"] is True
    assert [p["engine_ids"] for p in payload["prefill"]] == [f.engine_ids for f in cluster.prefills]
    assert all(p["usable"] for p in payload["prefill"])
    (decode,) = payload["decode"]
    assert decode["url"] == cluster.decodes[0].api_url and decode["usable"] is True
    assert decode["in_flight"] == 0 and "since" in decode
    assert (await client.get("/health")).status == 200
    # "{}" and 503 were both answered "not yet", and retried.
    assert all(f.query_count >= 30 for f in cluster.prefills)


async def test_a_prefill_down_at_start_does_not_block_the_others(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="mooncake_proxy")
    cluster = await start_cluster(
        prefill_dp=(1, 1), wait_ready=False, each_prefill=({"health_status": 503},)
    )
    await eventually(lambda: cluster.client.app[mp.STATE_KEY].fleet.ready)
    payload = await (await cluster.client.get("/healthcheck")).json()
    stuck, found = payload["prefill"]
    assert not stuck["usable"] and "503" in stuck["last_error"]
    assert found["usable"] and found["engine_ids"] == cluster.prefills[1].engine_ids
    assert payload["ready"] is True
    for _ in range(3):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    assert not cluster.prefills[0].requests
    # Logged with the URL and the reason, once: not once per check.
    failures = [
        r
        for r in caplog.records
        if cluster.prefills[0].api_url in r.getMessage() and "503" in r.getMessage()
    ]
    assert len(failures) == 1
    cluster.prefills[0].health_status = 200
    await wait_ready_(cluster.client)


async def test_models_is_forwarded_to_a_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    response = await cluster.client.get("/v1/models")
    assert response.status == 200
    assert (await response.json())["data"][0]["id"] == "fake-model"


async def test_unknown_routes_and_methods_get_openai_errors(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    missing = await cluster.client.get("/v1/nothing")
    assert missing.status == 404
    assert_openai_error(await missing.json(), 404)
    wrong = await cluster.client.get(COMPLETIONS)
    assert wrong.status == 405
    assert_openai_error(await wrong.json(), 405)
    assert "POST" in wrong.headers["Allow"]


async def test_unmatched_requests_are_logged_with_an_id_and_their_path(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy.access")
    cluster = await start_cluster()
    missing = await cluster.client.get("/v1/nothing?x=1", headers={"X-Request-Id": "mine"})
    wrong = await cluster.client.get(COMPLETIONS)
    first, second = access_lines(caplog)
    assert first["route"] == "unmatched" and first["path"] == "/v1/nothing?x=1"
    assert first["request_id"].startswith("mine-") and first["status"] == 404
    assert missing.headers["X-Request-Id"] == first["request_id"]
    assert second["path"] == COMPLETIONS and second["status"] == 405
    assert second["request_id"] == wrong.headers["X-Request-Id"] != "-"
    assert "GET /v1/nothing?x=1 404" in caplog.records[-2].getMessage()


# --- a fleet that changes: the config file, reloads, rolling upgrades, DNS discovery


def write_config(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_the_config_file_holds_any_setting_and_flags_and_environment_win(tmp_path: Path) -> None:
    parser = mp.build_parser()
    path = write_config(
        tmp_path / "proxy.toml",
        """
        prefill = ["http://10.0.0.1:8100 8998", ["http://10.0.0.2:8100", "9000"]]
        decode = ["http://10.0.0.3:8200"]
        prefill-dns = ["vllm-prefill.ns.svc.cluster.local.:8100"]
        max-retries = 3
        max_in_flight = 64          # underscores too
        balance-factor = 2
        protect-metrics = true
        api-key = "from-file"
        """,
    )
    config = mp.load_config(parser, ["--config", str(path)], {})
    assert [(str(p.url), p.bootstrap_addr) for p in config.prefills] == [
        ("http://10.0.0.1:8100", "http://10.0.0.1:8998"),
        ("http://10.0.0.2:8100", "http://10.0.0.2:9000"),
    ]
    (name,) = config.prefill_dns
    assert (name.name, name.port, name.bootstrap_port) == (
        "vllm-prefill.ns.svc.cluster.local.",
        8100,
        8998,
    )
    assert (config.max_retries, config.max_in_flight, config.balance_factor) == (3, 64, 2.0)
    assert config.protect_metrics and config.api_key == "from-file"
    # A flag wins over the environment, which wins over the file; the file names itself too.
    env = {"MOONCAKE_PROXY_MAX_RETRIES": "4", "MOONCAKE_PROXY_DECODE": "http://d:1"}
    config = mp.load_config(
        parser, ["--max-retries", "5"], {**env, "MOONCAKE_PROXY_CONFIG": str(path)}
    )
    assert config.max_retries == 5 and [str(d) for d in config.decodes] == ["http://d:1"]
    assert config.max_in_flight == 64
    assert config.shadowed == ("decode", "max-retries")  # said at start and on each reload
    # The example that deploy/ installs is a valid file.
    example = ROOT / "deploy" / "mooncake-proxy.toml"
    assert mp.load_config(parser, ["--config", str(example)], {}).decodes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-retriez = 3", "'max-retriez' is not a setting (keys are the flags' names"),
        ("max-retries = 'many'", "proxy.toml: max-retries = 'many': expected a whole number"),
        ("protect-metrics = 'yes'", "proxy.toml: protect-metrics = 'yes': expected true or false"),
        ("port = [8000]", "proxy.toml: port = [8000]: expected a string or a number"),
        ("decode = [8200]", "proxy.toml: decode: expected a list of strings"),
        ("decode = ['http://d:1/v1']", "with no path, query or credentials"),
        ("config = 'other.toml'", "'config' is not a setting"),
        ("max-retries = ", "proxy.toml is not valid TOML: Invalid value (at line 3, column 15)"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    base = (
        "prefill = ['http://p:1']\ndecode = ['http://d:1']\n"
        if "decode" not in text
        else "prefill = ['http://p:1']\n"
    )
    path = write_config(tmp_path / "proxy.toml", base + text + "\n")
    with pytest.raises(mp.ConfigError) as refused:
        mp.load_config(mp.build_parser(), ["--config", str(path)], {})
    assert message in str(refused.value)


async def test_a_reload_swaps_a_decode_without_a_gap_and_lets_the_old_one_finish(
    start_cluster: StartCluster, aiohttp_server: AiohttpServer
) -> None:
    cluster = await start_cluster(decode={"token_delay": 0.05}, health_interval=0.05)
    state = cluster.client.app[mp.STATE_KEY]
    (old,) = cluster.decodes
    new = FakeVllm("decode", kv_timeout=KV_TIMEOUT)
    new.api_url = f"http://127.0.0.1:{free_port()}"  # not serving yet
    streaming = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=30))
    )
    await eventually(lambda: old.running == 1)
    state.reconfigure(dataclasses.replace(cluster.config, decodes=(URL(new.api_url),)))
    # The new decode is not usable yet: the old one keeps serving (no gap), also new requests.
    answer = await cluster.client.post(COMPLETIONS, json=completion(prompt="during"))
    assert answer.status == 200 and old.requests[-1].body["prompt"] == "during"
    health = await (await cluster.client.get("/healthcheck")).json()
    assert [(d["url"], d["leaving"], d["usable"]) for d in health["decode"]] == [
        (old.api_url, True, True),
        (new.api_url, False, False),
    ]
    await serve(aiohttp_server, new.api_app(), URL(new.api_url).port)
    # Once it is usable, new requests go there; the old one's stream is not cut.
    await eventually(
        lambda: any(d.usable for d in state.fleet.decodes if d.url == URL(new.api_url))
    )
    answer = await cluster.client.post(COMPLETIONS, json=completion(prompt="after"))
    assert answer.status == 200 and new.requests[-1].body["prompt"] == "after"
    assert old.running == 1  # still streaming, and so still listed until it ends
    health = await (await cluster.client.get("/healthcheck")).json()
    assert [(d["url"], d["leaving"], d["in_flight"]) for d in health["decode"]] == [
        (old.api_url, True, 1),
        (new.api_url, False, 0),
    ]
    response = await streaming
    raw = await response.read()
    assert raw == old.sent_without_token_ids(response.headers["X-Request-Id"])
    assert sse_events(raw)[-1] == "[DONE]"
    # ... and then it is let go: no longer checked, listed or counted.
    await eventually(lambda: [str(d.url) for d in state.fleet.decodes] == [new.api_url])
    await asyncio.sleep(0.1)  # a check cancelled on its way may still arrive
    checks = old.health_count
    await asyncio.sleep(0.3)
    assert old.health_count == checks
    samples = await scrape(cluster)
    assert (
        sample(samples, "mooncake_proxy_instance_usable", role="decode", backend=new.api_url) == 1
    )
    assert not [key for key in samples if ("backend", old.api_url) in key[1]]


async def test_a_reload_that_adds_instances_and_changes_limits_applies_them_at_once(
    start_cluster: StartCluster, aiohttp_server: AiohttpServer
) -> None:
    cluster = await start_cluster(
        max_in_flight=1, decode={"token_delay": 0.1}, policy=mp.Policy.ROUND_ROBIN
    )
    state = cluster.client.app[mp.STATE_KEY]
    (decode,) = cluster.decodes
    first = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=10))
    )
    await eventually(lambda: decode.running == 1)
    queued = asyncio.create_task(cluster.client.post(COMPLETIONS, json=completion(prompt="q")))
    await eventually(lambda: state.admission.queued == 1)
    extra = FakeVllm("prefill", dp_size=2)
    api = await serve(aiohttp_server, extra.api_app())
    bootstrap = await serve(aiohttp_server, extra.bootstrap_app())
    extra.api_url = f"http://127.0.0.1:{api.port}"
    spec = mp.PrefillSpec(URL(extra.api_url), URL(f"http://127.0.0.1:{bootstrap.port}"))
    state.reconfigure(
        dataclasses.replace(
            cluster.config,
            prefills=(*cluster.config.prefills, spec),
            max_in_flight=0,
            max_retries=7,
        )
    )
    # The waiting request goes in at once: the limit is lifted.
    assert (await asyncio.wait_for(queued, FAST)).status == 200
    assert decode.running == 1  # the first still streams: the wait did not end with it
    assert state.config.max_retries == 7
    await eventually(lambda: state.fleet.engine_count == 3)
    for _ in range(3):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    assert extra.requests  # the new instance's engines are in the rotation
    await (await first).read()


async def test_sighup_rereads_the_config_file_and_a_bad_one_changes_nothing(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    prefill = FakeVllm("prefill")
    api = await serve(aiohttp_server, prefill.api_app())
    bootstrap = await serve(aiohttp_server, prefill.bootstrap_app())
    prefill.api_url = f"http://127.0.0.1:{api.port}"
    old, new = (FakeVllm("decode", kv_timeout=KV_TIMEOUT) for _ in range(2))
    for fake in (old, new):
        fake.api_url = f"http://127.0.0.1:{(await serve(aiohttp_server, fake.api_app())).port}"
    port = free_port()
    file = tmp_path / "proxy.toml"

    def configure(decode: FakeVllm, *extra: str, listen: int = port) -> None:
        lines = [
            f"port = {listen}",
            f'prefill = ["{prefill.api_url} {bootstrap.port}"]',
            f'decode = ["{decode.api_url}"]',
            "discovery-interval = 0.05",
            *extra,
        ]
        file.write_text("\n".join(lines) + "\n")

    configure(old)
    proxy = await ProxyProcess.launch("--config", str(file), port=port, ready=False)
    process, log, base = proxy.process, proxy.log, proxy.base
    try:
        async with aiohttp.ClientSession() as session:
            await log.wait_for(f"decode {old.api_url} is usable", seconds=15)
            await log.wait_for(f"prefill {prefill.api_url} is usable", seconds=15)
            # A file that does not validate is refused whole: nothing of it applies.
            configure(new, "max-retries = 'many'")
            process.send_signal(signal.SIGHUP)
            line = await log.wait_for("SIGHUP: the configuration stays as it was")
            assert "max-retries = 'many': expected a whole number" in line
            async with session.post(f"{base}/v1/completions", json=completion()) as answer:
                assert answer.status == 200
            assert len(old.requests) == 1 and not new.requests
            # A good one applies; what only a restart can change is said and left alone.
            configure(new, "log-level = 'DEBUG'", listen=free_port())
            process.send_signal(signal.SIGHUP)
            await log.wait_for("reload: --port changed, but only a restart applies it")
            reloaded = await log.wait_for("configuration reloaded: ")
            assert reloaded.endswith("configuration reloaded: --decode, --log-level")
            await log.wait_for(f"decode {old.api_url} has left the fleet")
            async with session.post(f"{base}/v1/completions", json=completion()) as answer:
                assert answer.status == 200
            assert len(new.requests) == 1 and len(old.requests) == 1
            await log.wait_for("DEBUG")  # the new level took effect
    finally:
        await proxy.stop()
    assert "Traceback" not in "\n".join(log.lines)


async def test_under_workers_sighup_reaches_every_worker(tmp_path: Path) -> None:
    file, port = tmp_path / "proxy.toml", free_port()
    lines = [f"port = {port}", "workers = 2", 'prefill = ["http://127.0.0.1:9"]']
    file.write_text("\n".join([*lines, 'decode = ["http://127.0.0.1:10"]', ""]))
    proxy = await ProxyProcess.launch("--config", str(file), port=port, ready=False)
    process, log = proxy.process, proxy.log
    try:
        await log.wait_for_processes("decode http://127.0.0.1:10 check failed", 2, seconds=15)
        file.write_text("\n".join([*lines, 'decode = ["http://127.0.0.1:11"]', ""]))
        process.send_signal(signal.SIGHUP)  # to the parent, which passes it on
        await log.wait_for_processes("configuration reloaded: --decode", 2)
    finally:
        await proxy.stop()
        assert process.returncode == 0


@dataclass
class FakeProcess:
    """A fake vLLM server in a process of its own (fake_vllm.py --serve): SIGTERM drains it."""

    role: str
    port: int
    bootstrap_port: int = 0
    drain_delay: float = 0.0
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "fake_vllm.py"), "--serve", self.role,
            "--port", str(self.port), "--bootstrap-port", str(self.bootstrap_port),
            "--token-delay", "0.02", "--drain-delay", str(self.drain_delay),
        )  # fmt: skip
        await until_healthy(session, self.url)

    async def stop(self) -> None:
        """SIGTERM, and wait for the drain to end."""
        assert self.process is not None
        self.process.terminate()
        assert await self.process.wait() == 0

    async def requests(self, session: aiohttp.ClientSession) -> int:
        async with session.get(f"{self.url}/_fake/stats") as stats:
            count: int = (await stats.json())["requests"]
            return count


async def steady_load(
    base: str, session: aiohttp.ClientSession, done: asyncio.Event, failures: list[str]
) -> int:
    """Streamed requests one after another until ``done``; each must end whole. Returns how
    many were sent."""
    sent = 0
    while not done.is_set():
        sent += 1
        body = completion(prompt=f"rolling {random.random()}", stream=True, max_tokens=8)
        try:
            async with session.post(f"{base}/v1/completions", json=body) as answer:
                raw = await answer.read()
            events = sse_events(raw) if answer.status == 200 else []
            if not events or events[-1] != "[DONE]" or any("error" in e for e in events[:-1]):
                failures.append(f"{answer.status}: {raw[-300:]!r}")
        except (aiohttp.ClientError, TimeoutError) as error:
            failures.append(repr(error))
    return sent


@pytest.mark.parametrize(
    "drain_delay",
    [0.0, 0.5],
    ids=["stops-listening-at-once", "health-503-first"],
)
async def test_a_rolling_upgrade_under_load_fails_no_request_and_cuts_no_stream(
    tmp_path: Path, drain_delay: float
) -> None:
    """Every prefill and decode restarted one after another (each draining on SIGTERM: at once,
    as uvicorn does, or answering /health 503 a while first), then a decode swapped by a
    reload, all under steady streamed load through the proxy."""
    ports = iter(free_port() for _ in range(12))
    prefills = [FakeProcess("prefill", next(ports), next(ports), drain_delay) for _ in range(2)]
    decodes = [FakeProcess("decode", next(ports), 0, drain_delay) for _ in range(3)]
    port, file = next(ports), tmp_path / "proxy.toml"

    def configure(members: list[FakeProcess]) -> None:
        prefill = ", ".join(f'"{p.url} {p.bootstrap_port}"' for p in prefills)
        decode = ", ".join(f'"{d.url}"' for d in members)
        file.write_text(
            f"port = {port}\nprefill = [{prefill}]\ndecode = [{decode}]\n"
            "health-interval = 0.1\ndiscovery-interval = 0.05\n"
        )

    configure(decodes[:2])
    async with aiohttp.ClientSession() as session:
        for fake in (*prefills, *decodes):
            await fake.start(session)
        proxy = await ProxyProcess.launch("--config", str(file), port=port, ready=False)
        log, base = proxy.log, proxy.base
        done, failures = asyncio.Event(), list[str]()
        try:
            for fake in (*prefills, *decodes[:2]):
                await log.wait_for(f"{fake.role} {fake.url} is usable", seconds=15)
            load = [
                asyncio.create_task(steady_load(base, session, done, failures)) for _ in range(4)
            ]

            async def took_traffic(fake: FakeProcess) -> None:
                async with asyncio.timeout(10):
                    while not await fake.requests(session):
                        await asyncio.sleep(0.05)

            for fake in (*prefills, *decodes[:2]):
                await took_traffic(fake)
                await fake.stop()
                await fake.start(session)
                await took_traffic(fake)  # a new process: it counts from 0
            configure([decodes[0], decodes[2]])
            proxy.process.send_signal(signal.SIGHUP)
            await log.wait_for(f"decode {decodes[1].url} has left the fleet", seconds=15)
            await took_traffic(decodes[2])
            await asyncio.sleep(0.5)  # and a little more load on the swapped fleet
            done.set()
            sent = await asyncio.gather(*load)
        finally:
            done.set()
            await proxy.stop()
            for fake in (*prefills, *decodes):
                if fake.process is not None and fake.process.returncode is None:
                    fake.process.kill()
                    await fake.process.wait()
    assert not failures, failures
    assert min(sent) > 10, sent
    assert "Traceback" not in "\n".join(log.lines)


def test_a_connection_found_closing_as_its_body_is_written_is_tried_elsewhere() -> None:
    """A keep-alive connection that a stopping server closed just as a request was written:
    aiohttp says "Can not write request body" with no errno, its cause the reset. The rolling
    upgrade above met it when the legs still ran on aiohttp's client (one 502 in a few hundred
    requests, in CI); health checks still do. The server never read the request, so it is
    unreachable, not a broken answer; the same words without a reset behind them stay a
    failure. (The legs' own wire says so by not having a byte of an answer:
    test_a_broken_answer_says_what_broke, in test_legs.py.)"""
    url = URL("http://127.0.0.1:1/v1/completions")
    error = aiohttp.ClientOSError(None, f"Can not write request body for {url}")
    error.__cause__ = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    assert isinstance(mp.transport_error("decode", url, error), mp.Unreachable)
    error.__cause__ = ValueError("not a reset")
    failure = mp.transport_error("decode", url, error)
    assert not isinstance(failure, mp.Unreachable) and failure.status == 502


@dataclass
class Dnsmasq:
    """A real DNS server on loopback, answering for *.test from a hosts file the test rewrites."""

    process: subprocess.Popen[str]
    hosts: Path
    port: int

    def publish(self, *records: str) -> None:
        """``"127.0.0.2 prefill.test"`` lines; dnsmasq rereads its hosts files on SIGHUP."""
        self.hosts.write_text("".join(f"{record}\n" for record in records))
        self.process.send_signal(signal.SIGHUP)

    @property
    def server(self) -> mp.DnsServer:
        return mp.DnsServer("127.0.0.1", self.port)


@pytest.fixture
def dnsmasq(tmp_path: Path) -> collections.abc.Iterator[Dnsmasq]:
    binary = shutil.which("dnsmasq") or shutil.which("/usr/sbin/dnsmasq")
    if binary is None:
        # CI installs Debian's dnsmasq-base and sets this, so there it cannot skip.
        assert not os.environ.get("MOONCAKE_PROXY_TEST_NEEDS_DNSMASQ"), "dnsmasq missing"
        pytest.skip("dnsmasq is not installed here (apt-get install dnsmasq-base)")
    hosts, port = tmp_path / "hosts", free_port()
    hosts.write_text("")
    process = subprocess.Popen(
        [
            binary, "--keep-in-foreground", "--log-facility=-", "--pid-file=",
            f"--port={port}", "--listen-address=127.0.0.1", "--bind-interfaces",
            # Authoritative for .test from the hosts file alone: no upstream, and a name with
            # no AAAA record answers "no such record" rather than REFUSED.
            "--no-resolv", "--no-hosts", "--local=/test/", f"--addn-hosts={hosts}",
            f"--user={getpass.getuser()}",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + FAST
        while not socket_answers(port) and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1]
            time.sleep(0.02)
        yield Dnsmasq(process, hosts, port)
    finally:
        process.terminate()
        process.communicate()


def socket_answers(port: int) -> bool:
    """Whether a DNS server on 127.0.0.1:port answers a query at all (any answer will do)."""
    query = bytes.fromhex("abcd01000001000000000000") + b"\x04ping\x04test\x00\x00\x01\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.settimeout(0.1)
        probe.sendto(query, ("127.0.0.1", port))
        try:
            return probe.recv(512)[:2] == query[:2]
        except OSError:
            return False


async def start_fake_at(
    aiohttp_server: AiohttpServer, fake: FakeVllm, host: str, port: int, bootstrap: int = 0
) -> None:
    fake.api_url = f"http://{host}:{port}"
    await aiohttp_server(fake.api_app(), host=host, port=port)
    if bootstrap:
        await aiohttp_server(fake.bootstrap_app(), host=host, port=bootstrap)


async def test_instances_come_and_go_with_their_dns_records(
    aiohttp_server: AiohttpServer,
    aiohttp_client: AiohttpClient,
    dnsmasq: Dnsmasq,
    caplog: pytest.LogCaptureFixture,
) -> None:
    api, bootstrap, decode_port = free_port(), free_port(), free_port()
    first, second = FakeVllm("prefill"), FakeVllm("prefill")
    decode = FakeVllm("decode", kv_timeout=KV_TIMEOUT)
    await start_fake_at(aiohttp_server, first, "127.0.0.2", api, bootstrap)
    await start_fake_at(aiohttp_server, second, "127.0.0.3", api, bootstrap)
    await start_fake_at(aiohttp_server, decode, "127.0.0.4", decode_port)
    dnsmasq.publish("127.0.0.2 prefill.test", "127.0.0.4 decode.test")
    config = mp.ProxyConfig(
        prefill_dns=(mp.parse_dns_name("prefill", f"prefill.test:{api}:{bootstrap}"),),
        decode_dns=(mp.parse_dns_name("decode", f"decode.test:{decode_port}"),),
        dns_server=dnsmasq.server,
        dns_interval=0.1,
        discovery_interval=0.02,
        health_timeout=0.3,
        policy=mp.Policy.ROUND_ROBIN,
    )
    client = await daemon_client(aiohttp_client, config)
    fleet = client.app[mp.STATE_KEY].fleet

    async def prefills() -> list[tuple[str, str, bool]]:
        health = await (await client.get("/healthcheck")).json()
        return [(p["url"], p["origin"], p["usable"]) for p in health["prefill"]]

    await wait_ready_(client)
    origin = f"dns prefill.test:{api}:{bootstrap}"
    assert await prefills() == [(first.api_url, origin, True)]
    assert (await client.post(COMPLETIONS, json=completion())).status == 200
    # A new record is a new instance; one that goes leaves (once its requests are done).
    dnsmasq.publish("127.0.0.2 prefill.test", "127.0.0.3 prefill.test", "127.0.0.4 decode.test")
    await eventually(lambda: sum(p.usable for p in fleet.prefills) == 2)
    for _ in range(2):
        assert (await client.post(COMPLETIONS, json=completion())).status == 200
    assert len(second.requests) == 1 and len(first.requests) == 2
    dnsmasq.publish("127.0.0.3 prefill.test", "127.0.0.4 decode.test")
    await eventually(lambda: [str(p.url) for p in fleet.prefills] == [second.api_url])
    for _ in range(2):
        assert (await client.post(COMPLETIONS, json=completion())).status == 200
    assert len(second.requests) == 3 and len(first.requests) == 2
    # The DNS server fails: the last answer stays, the failure is said once.
    dnsmasq.process.terminate()
    dnsmasq.process.wait()
    await asyncio.sleep(1.0)  # several intervals
    assert await prefills() == [(second.api_url, origin, True)]
    assert (await client.post(COMPLETIONS, json=completion())).status == 200
    failures = [r for r in caplog.records if "lookup failed" in r.getMessage()]
    assert len(failures) == 2, failures  # one per name
    health = await (await client.get("/healthcheck")).json()
    assert [(d["name"], d["addresses"], bool(d["error"])) for d in health["dns"]] == [
        (f"prefill.test:{api}:{bootstrap}", ["127.0.0.3"], True),
        (f"decode.test:{decode_port}", ["127.0.0.4"], True),
    ]


async def test_the_system_resolver_serves_dns_names_by_default(
    aiohttp_server: AiohttpServer, aiohttp_client: AiohttpClient
) -> None:
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode", kv_timeout=KV_TIMEOUT)
    api, bootstrap, decode_port = free_port(), free_port(), free_port()
    await start_fake_at(aiohttp_server, prefill, "127.0.0.1", api, bootstrap)
    await start_fake_at(aiohttp_server, decode, "127.0.0.1", decode_port)
    config = mp.ProxyConfig(
        prefill_dns=(mp.parse_dns_name("prefill", f"localhost:{api}:{bootstrap}"),),
        decode_dns=(mp.parse_dns_name("decode", f"localhost:{decode_port}"),),
        dns_interval=0.1,
        discovery_interval=0.02,
    )
    client = await daemon_client(aiohttp_client, config)
    async with asyncio.timeout(FAST):
        while (await client.get("/health")).status != 200:
            await asyncio.sleep(0.02)
    assert (await client.post(COMPLETIONS, json=completion())).status == 200
    health = await (await client.get("/healthcheck")).json()
    # localhost may also have ::1, where nothing listens: that instance is simply not usable.
    usable = [(d["url"], d["origin"]) for d in health["decode"] if d["usable"]]
    assert usable == [(decode.api_url, f"dns localhost:{decode_port}")]


# --- a live fleet: health, re-discovery, failover, load-aware routing


async def test_restarted_prefill_is_served_with_its_new_engine_ids(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy")
    cluster = await start_cluster(health_interval=0.2)
    (prefill,) = cluster.prefills
    old_ids = prefill.engine_ids
    prefill.restart()  # new engine ids, no downtime: only the bootstrap tells
    started = time.monotonic()
    await eventually(lambda: fleet_of(cluster).prefills[0].engine_ids == tuple(prefill.engine_ids))
    assert time.monotonic() - started < 0.2 + 1.0
    for _ in range(5):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    named = {r.body["kv_transfer_params"]["remote_engine_id"] for r in cluster.decodes[0].requests}
    assert named == {prefill.engine_ids[0]}
    assert any(
        "engine ids changed" in r.getMessage() and old_ids[0] in r.getMessage()
        for r in caplog.records
    )


async def test_a_stale_engine_id_triggers_an_immediate_recheck(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(health_interval=60)  # the timer alone would take a minute
    (prefill,) = cluster.prefills
    prefill.restart()
    for stream in (False, True):
        # The decode does not know the old engine id and fails the request before any token
        # (vLLM's 500, or in band): the prefill is checked at once, and the next try names the
        # engine id it has now.
        answer = await cluster.client.post(COMPLETIONS, json=completion(stream=stream))
        assert answer.status == 200, await answer.text()
        assert b"error" not in await answer.read()
        assert fleet_of(cluster).prefills[0].engine_ids == tuple(prefill.engine_ids)
        prefill.restart()
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="kv_load") == 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_dead_instance_costs_no_request_once_known_dead(
    start_cluster: StartCluster, role: str
) -> None:
    cluster = await start_cluster(prefill_dp=(1, 1), decodes=2, health_interval=0.05)
    fakes = cluster.prefills if role == "prefill" else cluster.decodes
    backends = fleet_of(cluster).prefills if role == "prefill" else fleet_of(cluster).decodes
    await cluster.kill(fakes[0])
    await eventually(lambda: not backends[0].usable)
    payload = await (await cluster.client.get("/healthcheck")).json()
    state = payload[role][0]
    assert state["usable"] is False and "unreachable" in state["last_error"]
    answers = [await cluster.client.post(COMPLETIONS, json=completion()) for _ in range(10)]
    assert [a.status for a in answers] == [200] * 10
    assert len(fakes[1].requests) == 10


async def test_a_refused_decode_fails_over_to_another_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(
        decodes=2, health_interval=60, decode_policy=mp.Policy.ROUND_ROBIN
    )
    dead, alive = cluster.decodes
    await cluster.kill(dead)
    for stream in (False, True):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=stream))
        assert response.status == 200, await response.text()
        raw = await response.read()
        assert raw == alive.sent_without_token_ids(response.headers["X-Request-Id"])
    decode = fleet_of(cluster).decodes[0]
    assert not decode.usable and decode.last_error and dead.api_url in decode.last_error
    # The prefill ran once per request: the same transfer was pulled by the other decode.
    assert len(cluster.prefills[0].requests) == 2
    assert cluster.prefills[0].transfers_served == 2


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_a_decode_that_dies_after_pulling_is_retried_as_a_new_pair(
    start_cluster: StartCluster, path: str
) -> None:
    """A non-streamed decode sends nothing before its whole answer; killed while it generates,
    it had pulled the KV, which the prefill gives out once. Sent the same transfer_id, the
    next decode would wait out the KV timeout: the pair starts again, with a new one."""
    cluster = await start_cluster(
        decodes=2, health_interval=60, decode_policy=mp.Policy.ROUND_ROBIN
    )
    dying, other = cluster.decodes
    dying.die_after_pull = True
    body = completion(max_tokens=12) if path == COMPLETIONS else chat(max_tokens=12)
    started = time.monotonic()
    response = await cluster.client.post(path, json=body)
    assert response.status == 200, await response.text()
    answer = await response.json()
    assert time.monotonic() - started < FAST
    (died,), (served,) = dying.requests, other.requests
    first, second = (r.body["kv_transfer_params"]["transfer_id"] for r in (died, served))
    assert first != second
    assert [r.body["kv_transfer_params"]["transfer_id"] for r in cluster.prefills[0].requests] == [
        first,
        second,
    ]
    # The answer is the one an uninterrupted request gets.
    local = await (await cluster.client.session.post(other.api_url + path, json=body)).json()
    assert answer["choices"] == local["choices"]
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_retries_total", stage="decode") == 1


async def test_a_refused_prefill_is_retried_elsewhere_with_a_new_transfer_id(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        prefill_dp=(1, 1), health_interval=60, prefill_policy=mp.Policy.ROUND_ROBIN
    )
    dead, alive = cluster.prefills
    await cluster.kill(dead)
    response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
    assert response.status == 200, await response.text()
    await response.read()
    (served,) = alive.requests
    assert served.headers["X-Request-Id"] == response.headers["X-Request-Id"]
    transfers = [r.body["kv_transfer_params"]["transfer_id"] for r in cluster.decodes[0].requests]
    assert len(transfers) == 2 and len(set(transfers)) == 2  # the first decode was abandoned
    assert transfers[1] == served.body["kv_transfer_params"]["transfer_id"]
    await eventually(lambda: cluster.decodes[0].running == 0)
    assert len(cluster.decodes[0].aborted) == 1
    assert not fleet_of(cluster).prefills[0].usable


@pytest.mark.parametrize("how", ["down", "restarted"])
async def test_a_prefill_lost_before_its_kv_was_pulled_is_tried_again(
    start_cluster: StartCluster, how: str
) -> None:
    """The prefill answered, then its instance went down (or restarted) with the KV it held,
    before the decode pulled it: the decode would wait out its KV timeout (vLLM: 90 s and
    more). Once the proxy finds the instance down, or its engine ids new, the pair starts
    again; no byte had reached the client."""
    cluster = await start_cluster(
        prefill_dp=(1, 1), health_interval=0.05, decode={"pull_delay": 1.0},  # a busy decode
        prefill_policy=mp.Policy.ROUND_ROBIN,
    )  # fmt: skip
    started = time.monotonic()
    sent = asyncio.ensure_future(cluster.client.post(COMPLETIONS, json=completion(stream=True)))
    await eventually(lambda: any(p.requests for p in cluster.prefills))
    (first,) = (p for p in cluster.prefills if p.requests)
    await eventually(lambda: first.running == 0)  # it answered: the KV waits for its pull
    await eventually(lambda: cluster.decodes[0].resolved == 1)  # and the decode knows where
    first.restart()  # the KV it held is gone, and its engine ids are new
    if how == "down":
        first.health_status = 503
    response = await sent
    assert response.status == 200
    events = sse_events(await response.read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert time.monotonic() - started < KV_TIMEOUT / 2
    transfers = [r.body["kv_transfer_params"]["transfer_id"] for r in cluster.decodes[0].requests]
    assert len(transfers) == 2 and len(set(transfers)) == 2  # the first decode was abandoned
    await eventually(lambda: cluster.decodes[0].running == 0)
    assert len(cluster.decodes[0].aborted) == 1
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_errors_total", stage="prefill", reason="kv_lost") == 1


async def test_a_non_streamed_decode_is_left_to_finish_when_its_prefill_goes_down(
    start_cluster: StartCluster,
) -> None:
    """A non-streamed decode sends nothing before its whole answer: one that pulled its KV
    and is generating cannot be told from one still waiting, and is not started again."""
    cluster = await start_cluster(
        prefill_dp=(1, 1), health_interval=0.05, decode={"token_delay": 0.1},
        prefill_policy=mp.Policy.ROUND_ROBIN,
    )  # fmt: skip
    sent = asyncio.ensure_future(cluster.client.post(COMPLETIONS, json=completion()))
    await eventually(lambda: cluster.decodes[0].kv_tokens_received > 0)  # it pulled the KV
    (first,) = (p for p in cluster.prefills if p.requests)
    first.health_status = 503
    await eventually(lambda: not fleet_of(cluster).prefills[cluster.prefills.index(first)].usable)
    response = await sent
    assert response.status == 200, await response.text()
    assert len(cluster.decodes[0].requests) == 1  # not started again


def decide_decodes_by(fleet: mp.Fleet, policy: mp.Policy) -> None:
    """As a reload would set it: each decode router's policy."""
    fleet.configure(dataclasses.replace(fleet.config, decode_policy=policy))


async def test_retries_are_bounded_and_the_error_names_what_was_tried(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=4, health_interval=60, max_retries=2)
    for fake in cluster.decodes[:3]:
        await cluster.kill(fake)
    fleet = fleet_of(cluster)
    # Make the three dead ones come first.
    decide_decodes_by(fleet, mp.Policy.ROUND_ROBIN)
    response = await cluster.client.post(COMPLETIONS, json=completion())
    assert response.status == 502
    message = (await response.json())["error"]["message"]
    assert message.startswith("3 attempts failed")
    for fake in cluster.decodes[:3]:
        assert fake.api_url in message
    assert not cluster.decodes[3].requests  # a third retry was not made


async def test_an_upstream_4xx_is_never_retried(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(prefill_dp=(1, 1), prefill={"fail_status": 400})
    response = await cluster.client.post(COMPLETIONS, json=completion())
    assert response.status == 400
    assert len(cluster.prefills[0].requests) + len(cluster.prefills[1].requests) == 1
    assert all(b.usable for b in fleet_of(cluster).prefills)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefills_5xx_is_tried_again_on_another_prefill(
    start_cluster: StartCluster, stream: bool
) -> None:
    """A vLLM that is stopping still takes requests on its open connections and answers them
    500 ("cannot schedule new futures after shutdown": real vLLM 0.32 under SIGTERM, seen in
    CI). Nothing reached the client, so another prefill computes the prompt; the one that
    answered 500 is checked, and stays in the rotation."""
    cluster = await start_cluster(
        prefill_dp=(1, 1), each_prefill=({"fail_status": 500},), health_interval=60,
        prefill_policy=mp.Policy.ROUND_ROBIN,
    )  # fmt: skip
    failing, healthy = cluster.prefills
    for _ in range(4):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=stream))
        assert response.status == 200, await response.text()
        assert b"error" not in await response.read()
    assert len(failing.requests) >= 1 and len(healthy.requests) == 4
    samples = await scrape(cluster)
    failed = len(failing.requests)
    assert sample(samples, "mooncake_proxy_errors_total", stage="prefill", reason="http_500") == (
        failed
    )  # once each, not again as it is tried
    assert sample(samples, "mooncake_proxy_retries_total", stage="prefill") == failed
    assert all(b.usable for b in fleet_of(cluster).prefills)
    await eventually(lambda: all(d.running == 0 for d in cluster.decodes))


async def test_prefills_that_all_answer_5xx_are_each_tried_once_and_named(
    start_cluster: StartCluster,
) -> None:
    """Both prefills answer 500: each is tried once, and the client hears of both (one prefill
    alone passes vLLM's answer as it came: test_prefill_error_reaches_client_before_kv_timeout)."""
    cluster = await start_cluster(prefill_dp=(1, 1), prefill={"fail_status": 500})
    response = await cluster.client.post(COMPLETIONS, json=completion())
    assert response.status == 500
    message = (await response.json())["error"]["message"]
    assert message.startswith("2 attempts failed"), message
    assert all(fake.api_url in message for fake in cluster.prefills)
    assert [len(fake.requests) for fake in cluster.prefills] == [1, 1]


async def test_no_retry_once_a_token_reached_the_client(start_cluster: StartCluster) -> None:
    """Without migration (test_migration.py), a stream cut after a token ends in band."""
    cluster = await start_cluster(
        prefill_dp=(1, 1), decodes=2, decode={"break_after_tokens": 2}, migration_limit=0
    )
    response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
    events = sse_events(await response.read())
    assert response.status == 200 and [e["choices"][0]["text"] for e in events[:2]]
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    prefills = cluster.prefills
    assert len(prefills[0].requests) + len(prefills[1].requests) == 1  # not tried again


@pytest.mark.parametrize("how", ["dropped", "down"])
async def test_a_stream_goes_on_when_its_prefill_is_lost_after_the_first_token(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """Once the decode's first token came, the KV is the decode's: the prefill leg's
    connection dropped unanswered, or its instance found down, cuts nothing and starts
    nothing again. Under load in CI, a prefill found down in the same turn of the loop as
    the first token cut streams the client had the first bytes of (PrefillWatch.kv_arrived)."""
    cluster = await start_cluster(
        health_interval=0.05, decode={"token_delay": 0.1},
        prefill={"drop_after_pull": 0.3} if how == "dropped" else {},
    )  # fmt: skip
    body = completion(stream=True, max_tokens=10, ignore_eos=True)
    async with cluster.client.post(COMPLETIONS, json=body) as response:
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")  # the first token's event
        if how == "down":
            cluster.prefills[0].health_status = 503
            await eventually(lambda: not fleet_of(cluster).prefills[0].usable)
        else:
            await eventually(lambda: cluster.prefills[0].dropped == 1)
        assert cluster.decodes[0].running == 1  # lost while the decode streams
        rest = await response.read()
    events = sse_events(first + rest)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    assert len(events) == 11  # every token, then [DONE]
    assert len(cluster.decodes[0].requests) == 1  # not started again
    if how == "dropped":
        assert "prefill failed once its decode had the KV" in caplog.text


async def test_a_keep_alive_is_no_token_a_prefill_lost_after_it_is_tried_again(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        prefill_dp=(1, 1),
        prefill_policy=mp.Policy.ROUND_ROBIN,
        each_prefill=({"drop_after": 0.3},),
        decode={"keepalive_first": True},
    )
    response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
    raw = await response.read()
    assert response.status == 200 and raw.startswith(b": keep-alive\n\n")
    assert sse_events(raw)[-1] == "[DONE]" and b"error" not in raw
    assert len(cluster.prefills[1].requests) == 1


async def test_least_loaded_sends_new_requests_to_the_idle_decode(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=2, policy=mp.Policy.LEAST_LOADED)
    slow, fast = cluster.decodes
    slow.token_delay = 0.5
    # Four long streams: ties go round robin, so two land on each decode.
    streams = [
        asyncio.create_task(
            cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=20))
        )
        for _ in range(4)
    ]
    await eventually(lambda: len(slow.requests) == 2 and len(fast.requests) == 2)
    await eventually(lambda: fast.running == 0)  # the fast ones are done
    assert slow.running == 2
    for _ in range(10):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    assert len(fast.requests) == 2 + 10  # round robin would have sent five to the busy one
    for task in streams:
        task.cancel()


async def test_simultaneous_arrivals_spread_over_equal_targets(start_cluster: StartCluster) -> None:
    # The prefills take a moment too, so that all twenty are in flight together on both
    # stages: an instant prefill's engine was free again before the next claim, and under
    # uvloop rank 0 then took 11 of them (2026-12-06).
    cluster = await start_cluster(
        prefill_dp=(2,),
        decodes=2,
        prefill={"delay": 0.3},
        decode={"token_delay": 0.05},
        policy=mp.Policy.LEAST_LOADED,
    )
    async with asyncio.timeout(FAST * 2):
        answers = await asyncio.gather(
            *(cluster.client.post(COMPLETIONS, json=completion(stream=True)) for _ in range(20))
        )
        for answer in answers:
            await answer.read()
    assert [len(d.requests) for d in cluster.decodes] == [10, 10]
    ranks = [r.headers["X-data-parallel-rank"] for r in cluster.prefills[0].requests]
    assert sorted(ranks) == ["0"] * 10 + ["1"] * 10


async def test_a_busy_instance_is_not_flapped_out(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="mooncake_proxy")
    cluster = await start_cluster(
        decodes=1,
        health_interval=0.02,
        health_timeout=1.0,
        unhealthy_after=1,
        decode={"health_delay": 0.3, "token_delay": 0.01},
        prefill={"health_delay": 0.3},
    )
    fleet = fleet_of(cluster)
    seen_unusable = False
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        batch = [cluster.client.post(COMPLETIONS, json=completion(stream=True)) for _ in range(8)]
        answers = await asyncio.gather(*batch)
        assert [a.status for a in answers] == [200] * 8
        seen_unusable |= not all(b.usable for b in (*fleet.prefills, *fleet.decodes))
    assert not seen_unusable
    assert cluster.decodes[0].health_count >= 3
    assert not [r for r in caplog.records if "left the rotation" in r.getMessage()]


async def test_a_check_timing_out_while_requests_succeed_is_load_not_failure(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="mooncake_proxy")
    cluster = await start_cluster(health_interval=0.05, health_timeout=0.2, unhealthy_after=2)
    fleet, decode = fleet_of(cluster), cluster.decodes[0]
    decode.health_delay = 1.0  # a saturated vLLM: /health answers after the check gave up
    checks = decode.health_count
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
        assert fleet.decodes[0].usable
    assert decode.health_count >= checks + 3  # several checks timed out meanwhile
    status = await (await cluster.client.get("/healthcheck")).json()
    assert status["decode"][0]["slow"] is True and status["decode"][0]["usable"] is True
    slow_lines = [r for r in caplog.records if "is slow" in r.getMessage()]
    assert len(slow_lines) == 1  # said once, not per check
    # With no request succeeding, the same timeouts take it out as before.
    await eventually(lambda: not fleet.decodes[0].usable, FAST)
    assert any("left the rotation" in r.getMessage() for r in caplog.records)


async def test_checks_of_an_unreachable_instance_back_off_up_to_the_health_interval(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=2, discovery_interval=0.02, health_interval=0.3)
    config, fleet = cluster.config, fleet_of(cluster)
    dead = fleet.decodes[0]
    await cluster.kill(cluster.decodes[0])
    dead.recheck.set()
    await eventually(lambda: dead.same_failures >= 5)
    # Refused the same way each time: 0.02, 0.04, 0.08, 0.16, then the usable pace of 0.3 s.
    assert mp.check_interval(config, dead) == 0.3
    assert mp.check_interval(config, fleet.decodes[1]) == 0.3  # usable
    await cluster.start_again(cluster.decodes[0], new_engine_ids=False)
    dead.recheck.set()  # as a refused request does: checked at once, not after the backoff
    await eventually(lambda: dead.usable)
    assert dead.same_failures == 0 and mp.check_interval(config, dead) == 0.3
    # An instance that answers "not yet" is starting: it is polled at the quick pace.
    starting = mp.DecodeInstance(URL("http://127.0.0.1:1"))
    starting.same_failures = 0
    assert mp.check_interval(config, starting) == 0.02


async def test_an_instance_comes_back_after_enough_good_checks(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(
        decodes=2, health_interval=0.05, discovery_interval=0.05, healthy_after=3
    )
    fleet = fleet_of(cluster)
    await cluster.kill(cluster.decodes[0])
    await eventually(lambda: not fleet.decodes[0].usable)
    before = cluster.decodes[0].health_count
    await cluster.start_again(cluster.decodes[0])
    await eventually(lambda: fleet.decodes[0].usable)
    assert cluster.decodes[0].health_count - before >= 3


@pytest.mark.parametrize("victim", ["prefill", "decode"])
async def test_killing_and_restarting_one_instance_under_load_loses_nothing_after_detection(
    start_cluster: StartCluster, victim: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy")
    cluster = await start_cluster(
        prefill_dp=(1, 1),
        decodes=2,
        health_interval=0.1,
        discovery_interval=0.05,
        decode={"token_delay": 0.005},
    )
    fleet = fleet_of(cluster)
    fake = (cluster.prefills if victim == "prefill" else cluster.decodes)[0]
    backend = (fleet.prefills if victim == "prefill" else fleet.decodes)[0]
    results: list[tuple[float, float, bool]] = []  # started, ended, whole
    stop = asyncio.Event()

    async def client_loop() -> None:
        for _ in range(400):  # bounded
            if stop.is_set():
                return
            started = time.monotonic()
            try:
                response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
                events = sse_events(await response.read())
                ok = response.status == 200 and events[-1] == "[DONE]" and "error" not in events[-2]
            except aiohttp.ClientError:
                ok = False
            results.append((started, time.monotonic(), ok))

    load = [asyncio.create_task(client_loop()) for _ in range(4)]
    await asyncio.sleep(0.3)
    old_ids = fleet.prefills[0].engine_ids
    killed = time.monotonic()
    await cluster.kill(fake)
    await eventually(lambda: not backend.usable)
    detected = time.monotonic()
    await asyncio.sleep(0.3)
    served_before_restart = len(fake.requests)
    await cluster.start_again(fake)
    await eventually(lambda: backend.usable)
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*load)
    after = [ok for started, _, ok in results if started > detected]
    assert len(after) > 20 and all(after)
    # Before it was found out, only the streams cut as it went away (in flight on it, four at
    # most) may fail: one that found its port refused was tried again elsewhere.
    failed = [(started, ended) for started, ended, ok in results if not ok]
    assert all(started <= killed <= ended for started, ended in failed) and len(failed) <= 4
    if victim == "prefill":
        assert fleet.prefills[0].engine_ids != old_ids
        assert fleet.prefills[0].engine_ids == tuple(fake.engine_ids)
    messages = [r.getMessage() for r in caplog.records]
    assert any("left the rotation" in m and fake.api_url in m for m in messages)
    assert any("is usable" in m and fake.api_url in m for m in messages)
    assert len(fake.requests) > served_before_restart  # it served again after the restart


async def test_a_burst_does_not_pile_onto_the_one_idle_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(decodes=2, decode={"token_delay": 0.05})
    busy, idle = cluster.decodes
    fleet = fleet_of(cluster)
    decide_decodes_by(fleet, mp.Policy.ROUND_ROBIN)  # place one long stream on the first decode
    long_stream = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=200))
    )
    await eventually(lambda: busy.running == 1)
    decide_decodes_by(fleet, mp.Policy.LEAST_LOADED)
    # Ten at once: each pick must see the picks before it, or all ten go to the idle one.
    burst = [cluster.client.post(COMPLETIONS, json=completion()) for _ in range(10)]
    assert [a.status for a in await asyncio.gather(*burst)] == [200] * 10
    assert len(busy.requests) - 1 >= 3 and len(idle.requests) >= 5
    long_stream.cancel()


# --- panic: when too few are usable, those that only time out take requests again


async def test_a_fleet_whose_checks_all_time_out_panics_and_serves_on(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Every decode out because its /health timed out (a saturated vLLM, or a slow network to
    it), none refused: taken out, they would make every request a 503. In a panic they take
    requests again, and /healthcheck and a metric say so; it ends when one passes its check."""
    caplog.set_level("WARNING", logger="mooncake_proxy")
    cluster = await start_cluster(
        decodes=2, health_interval=0.05, discovery_interval=0.05, health_timeout=0.5
    )
    fleet = fleet_of(cluster)
    for decode in cluster.decodes:
        decode.health_delay = 2.0
    await eventually(lambda: not any(d.usable for d in fleet.decodes), 10)
    await eventually(lambda: "decode" in fleet.panics, 10)
    answers = [await cluster.client.post(COMPLETIONS, json=completion()) for _ in range(4)]
    assert [a.status for a in answers] == [200] * 4
    status = await (await cluster.client.get("/healthcheck")).json()
    assert status["panic"] == ["decode"] and status["ready"] is True
    assert status["panic_models"] == {"decode": ["fake-model"]}
    assert all(d["timed_out"] and not d["usable"] for d in status["decode"])
    assert sample(await scrape(cluster), "mooncake_proxy_panic", role="decode") == 1
    assert any("decode panic" in r.getMessage() for r in caplog.records)
    cluster.decodes[0].health_delay = 0.0
    await eventually(lambda: fleet.decodes[0].usable and "decode" not in fleet.panics, 10)
    assert sample(await scrape(cluster), "mooncake_proxy_panic", role="decode") == 0


async def test_no_panic_for_instances_that_refuse(start_cluster: StartCluster) -> None:
    """A refused connection is an instance that is down, not a slow one: no panic sends to it."""
    cluster = await start_cluster(health_interval=0.05, discovery_interval=0.05)
    fleet = fleet_of(cluster)
    await cluster.kill(cluster.decodes[0])
    await eventually(lambda: not fleet.decodes[0].usable, 10)
    answer = await cluster.client.post(COMPLETIONS, json=completion())
    assert answer.status == 503 and not fleet.panics


@pytest.mark.parametrize("threshold", [0.0, 0.5])
async def test_the_panic_threshold_is_the_share_of_usable_instances_below_which_it_panics(
    start_cluster: StartCluster, threshold: float
) -> None:
    """Two of three decodes time out: one in three usable is below a threshold of 0.5 (a
    panic: all three take requests), not below 0 (only the usable one does)."""
    cluster = await start_cluster(
        decodes=3,
        health_interval=0.05,
        discovery_interval=0.05,
        health_timeout=0.5,
        panic_threshold=threshold,
        decode_policy=mp.Policy.ROUND_ROBIN,
    )
    fleet = fleet_of(cluster)
    for decode in cluster.decodes[1:]:
        decode.health_delay = 2.0
    await eventually(lambda: [d.usable for d in fleet.decodes] == [True, False, False], 10)
    await eventually(lambda: fleet.decodes[2].timed_out, 10)
    before = [len(d.requests) for d in cluster.decodes]
    for _ in range(6):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    took = [len(d.requests) - b for d, b in zip(cluster.decodes, before, strict=True)]
    assert (took == [2, 2, 2]) if threshold else (took == [6, 0, 0]), took
    assert ("decode" in fleet.panics) == bool(threshold)


# Two models behind one proxy: a prefill and a decode each.
TWO_MODELS = {
    "prefill_dp": (1, 1),
    "decodes": 2,
    "each_prefill": ({"model": "tiny-a"}, {"model": "tiny-b"}),
    "each_decode": ({"model": "tiny-a"}, {"model": "tiny-b"}),
}


async def models_known(cluster: Cluster) -> None:
    """Until the proxy read every instance's /v1/models: each is in its model's group."""
    fleet = fleet_of(cluster)
    await eventually(lambda: all(b.served is not None for b in (*fleet.prefills, *fleet.decodes)))


@pytest.mark.parametrize("threshold", [0.0, 0.5])
async def test_a_panic_is_judged_per_model(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, threshold: float
) -> None:
    """Model b's only decode times out its checks while model a's answers: b's requests can go
    to b's decode only, so b is in a panic and its decode takes them; a's are not touched. The
    role as a whole has half its decodes usable, which is no panic (at either threshold), and
    b's requests got 503 "no usable decode instance" when the role was judged whole."""
    caplog.set_level("WARNING", logger="mooncake_proxy")
    cluster = await start_cluster(
        **TWO_MODELS,
        health_interval=0.05,
        discovery_interval=0.05,
        health_timeout=0.5,
        panic_threshold=threshold,
    )
    await models_known(cluster)
    fleet = fleet_of(cluster)
    cluster.decodes[1].health_delay = 2.0
    await eventually(lambda: not fleet.decodes[1].usable and fleet.decodes[1].timed_out, 10)
    for model in ("tiny-a", "tiny-b") * 2:
        answer = await cluster.client.post(COMPLETIONS, json=completion(model=model))
        assert answer.status == 200, await answer.text()
    assert [len(d.requests) for d in cluster.decodes] == [2, 2]
    assert fleet.panics == {"decode": {"tiny-b"}}
    status = await (await cluster.client.get("/healthcheck")).json()
    assert status["panic"] == ["decode"] and status["panic_models"] == {"decode": ["tiny-b"]}
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_panic", role="decode", model="tiny-b") == 1
    assert sample(samples, "mooncake_proxy_panic", role="decode", model="tiny-a") == 0
    assert sample(samples, "mooncake_proxy_panic", role="prefill") == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("decode panic (model tiny-b): ") for m in messages), messages
    cluster.decodes[1].health_delay = 0.0
    await eventually(lambda: fleet.decodes[1].usable and not fleet.panics, 10)
    assert "decode panic (model tiny-b) over" in [r.getMessage() for r in caplog.records]
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_panic", role="decode", model="tiny-b") == 0


async def test_a_model_whose_only_decode_leaves_keeps_it_until_another_of_its_model_is_usable(
    start_cluster: StartCluster,
) -> None:
    """A reload that replaces model a's decode with one not up yet: the leaving one serves a
    on, as another model's usable decode cannot take a's requests (in_rotation, per model)."""
    cluster = await start_cluster(**TWO_MODELS, health_interval=60)
    await models_known(cluster)
    fleet = fleet_of(cluster)
    replacement = URL(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    prefills = [p.spec for p in fleet.prefills]
    fleet.set_members(prefills, [replacement, fleet.decodes[1].url], {})
    assert fleet.decodes[0].leaving and not fleet.decodes[2].usable
    answer = await cluster.client.post(COMPLETIONS, json=completion(model="tiny-a"))
    assert answer.status == 200, await answer.text()
    assert len(cluster.decodes[0].requests) == 1
