"""The daemon as it is run for real: started as users and systemd start it (and by make
demo), its metrics, access log, environment, drain, systemd notifications and keys; tracing;
--workers and its supervision; the proxy without the speed extra; the Kubernetes manifests;
and its alerts and dashboard checked by promtool and a real Prometheus server."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from pytest_aiohttp import AiohttpServer

import mooncake_proxy as mp
from fake_vllm import FakeVllm, free_port
from testing_support import (
    CHAT,
    COMPLETIONS,
    FAST,
    HERE,
    JSON_TYPE,
    KV_TIMEOUT,
    LONG_CONTEXT,
    ROOT,
    ProxyProcess,
    StartCluster,
    access_lines,
    assert_openai_error,
    chat,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
    serve,
    sse_events,
)

# --- tracing: the trace context on both legs, the proxy's own spans over OTLP


async def test_trace_context_reaches_both_legs(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The prefill's and the decode's spans share one trace: the client's, or a new one."""
    caplog.set_level("INFO", logger="mooncake_proxy.access")
    cluster = await start_cluster()
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    client_trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    cases = [
        ({}, None),
        ({"traceparent": client_trace, "tracestate": "vendor=1"}, client_trace),
        ({"TraceParent": client_trace}, client_trace),  # header names have no case
        ({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "tracestate": "x=1"}, None),
        ({"traceparent": client_trace + "-extra"}, None),  # version 00 has four fields
        ({"traceparent": "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x"}, "01-"),
        ({"traceparent": "garbage"}, None),
    ]
    seen = set()
    for headers, kept in cases:
        assert (
            await cluster.client.post(COMPLETIONS, json=completion(), headers=headers)
        ).status == 200
        legs = [prefill.requests[-1].headers, decode.requests[-1].headers]
        parents = {leg["traceparent"] for leg in legs}
        assert len(parents) == 1 and len(legs[0].getall("traceparent")) == 1
        (parent,) = parents
        if kept is None:
            assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", parent), parent
            assert parent[3:35] != "0" * 32 and parent not in seen
            assert all("tracestate" not in leg for leg in legs)
        else:
            assert parent.startswith(kept) and parent == next(iter(headers.values()))
        if "tracestate" in headers and kept:
            assert all(leg["tracestate"] == "vendor=1" for leg in legs)
        seen.add(parent)
        assert access_lines(caplog)[-1]["trace_id"] == parent[3:35]
    assert any(f"trace={client_trace[3:35]}" in r.getMessage() for r in caplog.records)


class OtlpCollector:
    """An OTLP/HTTP trace receiver on loopback: what an OpenTelemetry collector is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def app(self) -> web.Application:
        pytest.importorskip("opentelemetry.proto")
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        async def traces(request: web.Request) -> web.Response:
            export = ExportTraceServiceRequest.FromString(await request.read())
            for resource in export.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
            return web.Response(content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        return app


async def test_the_proxy_exports_its_span_and_one_per_leg(
    start_cluster: StartCluster,
    aiohttp_server: AiohttpServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's spans hang under the proxy's legs: each leg's traceparent names its span."""
    pytest.importorskip("opentelemetry.sdk")  # the [tracing] extra, which exports the spans
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    caplog.set_level("INFO", logger="mooncake_proxy.access")
    collector = OtlpCollector()
    receiver = await aiohttp_server(collector.app())
    endpoint = f"http://127.0.0.1:{receiver.port}/v1/traces"
    cluster = await start_cluster(otlp_traces_endpoint=endpoint)
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    client_trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    legs = []
    for headers in ({}, {"traceparent": client_trace}):
        body = completion(stream=True)
        answer = await cluster.client.post(COMPLETIONS, json=body, headers=headers)
        assert sse_events(await answer.read())[-1] == "[DONE]"
        legs.append((prefill.requests[-1].headers, decode.requests[-1].headers))
    trace_ids = [line["trace_id"] for line in access_lines(caplog)]
    await cluster.client.close()  # the exporter sends what it holds as the proxy stops
    async with asyncio.timeout(FAST):
        while len(collector.spans) < 6:
            await asyncio.sleep(0.05)
    spans = {span.span_id.hex(): span for span in collector.spans}
    for (prefill_leg, decode_leg), trace_id in zip(legs, trace_ids, strict=True):
        for stage, leg in (("prefill", prefill_leg), ("decode", decode_leg)):
            _, leg_trace, leg_span, _ = leg["traceparent"].split("-")
            assert leg_trace == trace_id
            span = spans[leg_span]
            assert span.name == stage and span.trace_id.hex() == trace_id
            proxy_span = spans[span.parent_span_id.hex()]
            assert proxy_span.name == f"POST {COMPLETIONS}"
            assert proxy_span.trace_id.hex() == trace_id
    # The client's trace is continued: its span is the proxy span's parent.
    assert trace_ids[1] == client_trace[3:35]
    client_child = [s for s in spans.values() if s.parent_span_id.hex() == client_trace[36:52]]
    assert len(client_child) == 1 and client_child[0].name == f"POST {COMPLETIONS}"
    first_proxy_span = [s for s in spans.values() if s.trace_id.hex() == trace_ids[0]]
    assert sum(not s.parent_span_id for s in first_proxy_span) == 1  # a new trace: its root


async def test_without_the_tracing_extra_the_proxy_says_so_and_serves(
    start_cluster: StartCluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    cluster = await start_cluster(otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    assert "traceparent" in cluster.decodes[0].requests[-1].headers
    warnings = [r.getMessage() for r in caplog.records if "otlp" in r.getMessage()]
    assert len(warnings) == 1 and "pip install '.[tracing]'" in warnings[0]


# --- the daemon as users start it


async def test_daemon_serves_a_stream_end_to_end(aiohttp_server: AiohttpServer) -> None:
    prefill = FakeVllm("prefill", dp_size=2)
    api = await serve(aiohttp_server, prefill.api_app())
    bootstrap = await serve(aiohttp_server, prefill.bootstrap_app())
    prefill.api_url = f"http://127.0.0.1:{api.port}"
    decode = FakeVllm("decode", kv_timeout=KV_TIMEOUT)
    decode_server = await serve(aiohttp_server, decode.api_app())
    proxy = await ProxyProcess.launch(
        "--prefill", prefill.api_url, str(bootstrap.port),
        "--decode", f"http://127.0.0.1:{decode_server.port}", "--policy", "round_robin",
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(15):
            base = proxy.base
            for _ in range(2):
                async with session.post(
                    f"{base}/v1/completions", json=completion(stream=True)
                ) as r:
                    raw = await r.read()
                    assert raw == decode.sent_without_token_ids(r.headers["X-Request-Id"])
        assert sorted(r.headers["X-data-parallel-rank"] for r in prefill.requests) == ["0", "1"]
    finally:
        log = await proxy.stop()
    assert proxy.process.returncode == 0
    assert "is usable: 2 DP rank(s)" in log and "Traceback" not in log


# --- make demo


async def run_demo(port: int) -> tuple[int, str, float]:
    started = time.monotonic()
    demo = await asyncio.create_subprocess_exec(
        *(sys.executable, str(HERE / "fake_vllm.py"), "--once", "--port", str(port)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(demo.communicate(), 60)
    assert demo.returncode is not None
    return demo.returncode, stderr.decode(), time.monotonic() - started


async def test_the_demo_fails_clearly_when_another_server_answers_on_its_port(
    aiohttp_server: AiohttpServer,
) -> None:
    async def everything_is_fine(request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "status": "ok"})  # vLLM's port is 8000 too

    impostor = web.Application()
    impostor.router.add_route("*", "/{tail:.*}", everything_is_fine)
    server = await serve(aiohttp_server, impostor)
    assert server.port is not None
    code, stderr, took = await run_demo(server.port)
    assert code != 0 and took < 30
    assert_taken(stderr, server.port)


async def test_the_demo_fails_clearly_when_a_silent_listener_holds_its_port() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts into the backlog, never answers
        port = silent.getsockname()[1]
        code, stderr, took = await run_demo(port)
    assert code != 0 and took < 30
    assert_taken(stderr, port)


def assert_taken(stderr: str, port: int) -> None:
    """One line, before anything started, saying how to pick another port."""
    (line,) = stderr.splitlines()
    assert line.startswith(f"demo: cannot listen on 127.0.0.1:{port}: the port is in use"), line
    assert "--port N" in line and "--port 0" in line


async def test_sigterm_to_the_demo_stops_the_proxy_it_started(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "demo.out"
    with out.open("wb") as stdout:  # not a pipe: the proxy would hold it open if it outlived
        demo = await asyncio.create_subprocess_exec(
            *(sys.executable, str(HERE / "fake_vllm.py"), "--port", str(port)),
            stdout=stdout,
            stderr=asyncio.subprocess.DEVNULL,
        )
    try:
        # Serving, after its streamed request.
        await eventually(lambda: b"keeps serving" in out.read_bytes(), 60)
        assert listening(port)
        demo.terminate()
        assert await asyncio.wait_for(demo.wait(), 15) == 0
        await eventually(lambda: not listening(port), 10)  # nothing left on its port
    finally:
        if demo.returncode is None:
            demo.kill()
            await asyncio.wait_for(demo.wait(), 15)


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


# --- running it for real: metrics, access log, drain, systemd, auth


async def test_metrics_parse_and_move_as_requests_flow(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(decode={"token_delay": 0.2})
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    before = await scrape(cluster)
    assert sample(before, "mooncake_proxy_ready") == 1
    assert (
        sample(before, "mooncake_proxy_instance_usable", role="decode", backend=decode.api_url) == 1
    )
    stream = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=5))
    )
    await eventually(lambda: decode.running == 1)
    during = await scrape(cluster)
    assert sample(during, "mooncake_proxy_decode_in_flight", backend=decode.api_url) == 1
    await (await stream).read()
    decode.token_delay = 0.0  # two quick non-streamed answers
    for _ in range(2):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    prefill.fail_status = 500
    assert (await cluster.client.post(CHAT, json=chat())).status == 500
    after = await scrape(cluster)
    route = {"route": COMPLETIONS}
    assert sample(after, "mooncake_proxy_requests_total", status="200", **route) == 3
    assert sample(after, "mooncake_proxy_requests_total", route=CHAT, status="500") == 1
    assert sample(after, "mooncake_proxy_errors_total", stage="prefill", reason="http_500") == 1
    assert sample(after, "mooncake_proxy_request_duration_seconds_count", **route) == 3
    assert sample(after, "mooncake_proxy_time_to_first_byte_seconds_count", **route) == 3
    # Time to first token of the stream was well under its total time.
    assert (
        sample(after, "mooncake_proxy_time_to_first_byte_seconds_bucket", le="0.25", **route) >= 3
    )
    assert sample(after, "mooncake_proxy_request_duration_seconds_bucket", le="0.25", **route) == 2
    assert sample(after, "mooncake_proxy_prefill_duration_seconds_count") == 4
    assert sample(after, "mooncake_proxy_decode_in_flight", backend=decode.api_url) == 0
    engine = prefill.engine_ids[0]
    labels = {"backend": prefill.api_url, "dp_rank": "0", "engine_id": engine}
    assert sample(after, "mooncake_proxy_prefill_in_flight", **labels) == 0


async def test_a_fresh_proxy_has_every_series_whose_labels_it_knows(
    start_cluster: StartCluster,
) -> None:
    """Made at 0 before any request meets them (prometheus_client's advice): a dashboard
    panel or an alert over them reads 0 on a fresh proxy, not "no data"."""
    cluster = await start_cluster()
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    samples = await scrape(cluster)
    expected = [
        ("routing_prefix_share_count", {"stage": "prefill"}),
        ("routing_prefix_share_count", {"stage": "decode"}),
        ("routing_decisions_total", {"stage": "prefill", "reason": "affinity"}),
        ("routing_decisions_total", {"stage": "decode", "reason": "spill"}),
        ("errors_total", {"stage": "decode", "reason": "refused"}),
        ("errors_total", {"stage": "prefill", "reason": "kv_lost"}),
        ("errors_total", {"stage": "admission", "reason": "queue_full"}),
        ("retries_total", {"stage": "prefill"}),
        ("retries_total", {"stage": "decode"}),
        ("requests_total", {"route": COMPLETIONS, "status": "200", "model": "-"}),
        ("requests_total", {"route": CHAT, "status": "502", "model": "-"}),
        ("time_to_first_token_seconds_count", {"route": CHAT, "model": "-"}),
        ("inter_token_latency_seconds_count", {"route": COMPLETIONS}),
        ("kv_wait_seconds_count", {"route": COMPLETIONS}),
        ("engine_id_changes_total", {"backend": prefill.api_url}),
        ("check_failures_total", {"role": "prefill", "backend": prefill.api_url}),
        ("check_failures_total", {"role": "decode", "backend": decode.api_url}),
        ("kv_event_batches_total", {"result": "missed"}),
        ("prefill_skipped_total", {"reason": "n"}),
    ]
    for name, labels in expected:
        key = (f"mooncake_proxy_{name}", tuple(sorted(labels.items())))
        assert samples.get(key) == 0, key


async def test_latency_metrics_are_what_the_client_felt(start_cluster: StartCluster) -> None:
    """TTFT to the first event relayed, the KV wait before it, the gaps between events."""
    cluster = await start_cluster(
        prefill={"delay": 0.05}, decode={"transfer_delay": 0.25, "token_delay": 0.05}
    )
    route = {"route": COMPLETIONS}
    response = await cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=5))
    events = sse_events(await response.read())
    assert len(events) == 6  # five tokens and [DONE]
    samples = await scrape(cluster)
    ttft = sample(samples, "mooncake_proxy_time_to_first_token_seconds_sum", **route)
    total = sample(samples, "mooncake_proxy_request_duration_seconds_sum", **route)
    assert 0.3 <= ttft < total - 0.2  # the tokens' 5 x 0.05 s came after it
    # The KV came 0.25 s after the prefill's answer.
    assert sample(samples, "mooncake_proxy_kv_wait_seconds_count", **route) == 1
    assert 0.2 <= sample(samples, "mooncake_proxy_kv_wait_seconds_sum", **route) < 0.6
    gaps = "mooncake_proxy_inter_token_latency_seconds"
    assert sample(samples, f"{gaps}_count", **route) == 5  # between six events
    assert sample(samples, f"{gaps}_bucket", le="+Inf", **route) == 5
    assert 0.2 <= sample(samples, f"{gaps}_sum", **route) < total - ttft + 0.01
    # Not streamed: the whole answer is the first token; no gaps, no KV wait of its own.
    assert (await cluster.client.post(CHAT, json=chat())).status == 200
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_time_to_first_token_seconds_count", route=CHAT) == 1
    assert sample(samples, f"{gaps}_count", route=CHAT) == 0
    assert sample(samples, "mooncake_proxy_kv_wait_seconds_count", route=CHAT) == 0


async def test_a_chat_streams_gaps_count_every_event(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(decode={"token_delay": 0.01})
    body = chat(stream=True, max_tokens=4, stream_options={"include_usage": True})
    events = sse_events(await (await cluster.client.post(CHAT, json=body)).read())
    samples = await scrape(cluster)
    count = sample(samples, "mooncake_proxy_inter_token_latency_seconds_count", route=CHAT)
    assert count == len(events) - 1  # the role, four tokens, the usage, [DONE]


async def test_metrics_count_retries_engine_id_changes_and_check_failures(
    start_cluster: StartCluster,
) -> None:
    # Checks only when asked: a periodic one could find the killed decode down before the
    # request does, and then nothing is refused or retried.
    cluster = await start_cluster(
        decodes=2, health_interval=60, decode_policy=mp.Policy.ROUND_ROBIN
    )
    dead = cluster.decodes[0]
    await cluster.kill(dead)
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    cluster.prefills[0].restart()
    fleet = fleet_of(cluster)
    fleet.prefills[0].recheck.set()
    await eventually(lambda: fleet.prefills[0].engine_ids == tuple(cluster.prefills[0].engine_ids))
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_retries_total", stage="decode") == 1
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="refused") == 1
    assert (
        sample(
            samples, "mooncake_proxy_engine_id_changes_total", backend=cluster.prefills[0].api_url
        )
        == 1
    )
    assert (
        sample(samples, "mooncake_proxy_check_failures_total", role="decode", backend=dead.api_url)
        >= 1
    )
    assert (
        sample(samples, "mooncake_proxy_instance_usable", role="decode", backend=dead.api_url) == 0
    )


async def test_one_access_line_per_request(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy.access")
    cluster = await start_cluster()
    ok = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
    await ok.read()
    assert (await cluster.client.post(CHAT, data=b"nope", headers=JSON_TYPE)).status == 400
    await cluster.client.get("/health")  # probes are DEBUG
    lines = [r for r in caplog.records if r.name == "mooncake_proxy.access"]
    assert len(lines) == 2
    first, second = (r.__dict__["access"] for r in lines)
    assert first["request_id"] == ok.headers["X-Request-Id"]
    assert first["route"] == COMPLETIONS and first["status"] == 200 and first["outcome"] == "ok"
    assert first["model"] == "fake-model"
    assert first["prefill"] == f"{cluster.prefills[0].api_url}#0"
    assert first["decode"] == cluster.decodes[0].api_url
    assert (
        first["bytes_out"]
        == len(cluster.decodes[0].sent_without_token_ids(first["request_id"]))
        > 0
    )
    assert 0 < first["ttfb_s"] <= first["total_s"]
    assert second["status"] == 400 and second["outcome"] == "error:http_400"
    assert "ttfb=" in lines[0].getMessage() and "outcome=ok" in lines[0].getMessage()


async def test_client_gone_is_counted_and_logged(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy.access")
    cluster = await start_cluster(prefill={"delay": 10})
    request = asyncio.create_task(cluster.client.post(COMPLETIONS, json=completion(stream=True)))
    await eventually(lambda: cluster.decodes[0].running == 1)
    request.cancel()
    await eventually(
        lambda: any(r.__dict__.get("access", {}).get("status") == 499 for r in caplog.records)
    )
    (line,) = [r.__dict__["access"] for r in caplog.records if r.name == "mooncake_proxy.access"]
    assert line["outcome"] == "client_gone"
    assert (
        sample(
            await scrape(cluster),
            "mooncake_proxy_errors_total",
            stage="client",
            reason="client_gone",
        )
        == 1
    )


async def test_draining_answers_probes_503(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    cluster.client.app[mp.STATE_KEY].draining = True
    assert (await cluster.client.get("/health")).status == 503
    health = await cluster.client.get("/healthcheck")
    assert health.status == 503
    payload = await health.json()
    assert payload["draining"] is True and payload["ready"] is False
    refused = await cluster.client.post(COMPLETIONS, json=completion())
    assert refused.status == 503
    assert "draining" in (await refused.json())["error"]["message"]


async def test_inbound_api_key(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(api_key="s3cret-proxy-key", protect_metrics=False)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-proxy-key"}):
        denied = await cluster.client.post(COMPLETIONS, json=completion(), headers=headers)
        assert denied.status == 401
        payload = await denied.json()
        assert_openai_error(payload, 401)
        assert payload["error"]["type"] == "AuthenticationError"
        assert "s3cret" not in json.dumps(payload)
    assert (await cluster.client.get("/v1/models")).status == 401
    good = {"Authorization": "Bearer s3cret-proxy-key"}
    assert (await cluster.client.post(COMPLETIONS, json=completion(), headers=good)).status == 200
    assert (await cluster.client.get("/v1/models", headers=good)).status == 200
    # Probes stay open; the proxy's key never reaches vLLM.
    for path in ("/health", "/healthcheck", "/metrics"):
        assert (await cluster.client.get(path)).status == 200
    assert "s3cret" not in await (await cluster.client.get("/healthcheck")).text()
    for leg in (*cluster.prefills[0].requests, *cluster.decodes[0].requests):
        assert "Authorization" not in leg.headers


async def test_protect_metrics(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(api_key="k", protect_metrics=True)
    assert (await cluster.client.get("/metrics")).status == 401
    assert (
        await cluster.client.get("/metrics", headers={"Authorization": "Bearer k"})
    ).status == 200
    assert (await cluster.client.get("/health")).status == 200


def test_every_flag_can_come_from_the_environment_and_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MOONCAKE_PROXY_PREFILL", "http://a:8100 8999, http://b:8100")
    monkeypatch.setenv("MOONCAKE_PROXY_DECODE", "http://d1:1 http://d2:1")
    monkeypatch.setenv("MOONCAKE_PROXY_MAX_RETRIES", "5")
    monkeypatch.setenv("MOONCAKE_PROXY_PROTECT_METRICS", "yes")
    monkeypatch.setenv("MOONCAKE_PROXY_API_KEY", "from-env")
    monkeypatch.setenv("MOONCAKE_PROXY_PORT", "9000")
    argv = ["--port", "9100", "--decode", "http://d3:1"]
    config = mp.load_config(mp.build_parser(), argv, os.environ)
    assert [(str(p.url), p.bootstrap_addr) for p in config.prefills] == [
        ("http://a:8100", "http://a:8999"),
        ("http://b:8100", "http://b:8998"),
    ]
    assert [str(d) for d in config.decodes] == ["http://d3:1"]  # the flag won
    assert config.port == 9100 and config.max_retries == 5
    assert config.protect_metrics is True and config.api_key == "from-env"
    assert "from-env" not in repr(config) and "from-env" not in config.describe()


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"OPENAI_API_KEY": "the-sdk-key"},
            "no upstream key (clients' Authorization is forwarded)",
        ),
        (
            {"OPENAI_API_KEY": "the-sdk-key", "MOONCAKE_PROXY_UPSTREAM_API_KEY": "vllm-key"},
            "upstream key from $MOONCAKE_PROXY_UPSTREAM_API_KEY",
        ),
    ],
    ids=["openai-key-ignored", "from-environment"],
)
async def test_the_upstream_key_comes_only_from_its_own_setting_and_says_whence(
    aiohttp_server: AiohttpServer, env: dict[str, str], said: str
) -> None:
    proxy, decode = await ProxyProcess.start(aiohttp_server, env=env)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{proxy.base}/v1/completions",
            json=completion(),
            headers={"Authorization": "Bearer client-key"},
        ) as response,
    ):
        assert response.status == 200
    log = await proxy.stop()
    (leg,) = decode.requests
    expected = (
        "Bearer vllm-key" if "MOONCAKE_PROXY_UPSTREAM_API_KEY" in env else "Bearer client-key"
    )
    assert leg.headers["Authorization"] == expected
    assert said in log and "the-sdk-key" not in log and "vllm-key" not in log
    # A user switching from vLLM's example proxy, which sends it upstream, is told once.
    warned = "$OPENAI_API_KEY is set but not sent to vLLM"
    assert log.count(warned) == (0 if "MOONCAKE_PROXY_UPSTREAM_API_KEY" in env else 1)
    # Text lines: a UTC timestamp with its zone, and the pid that wrote them.
    for line in log.splitlines():
        assert re.match(
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z [A-Z]+ mooncake_proxy[.a-z]*\[\d+\]: ", line
        ), line


def proc_status_kib(pid: int, key: str) -> int:
    (line,) = [x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key)]
    return int(line.split()[1])


async def test_a_large_request_costs_under_three_times_its_body_at_peak(
    aiohttp_server: AiohttpServer,
) -> None:
    proxy, decode = await ProxyProcess.start(aiohttp_server, both=LONG_CONTEXT)
    pid = proxy.process.pid
    async with aiohttp.ClientSession() as session:
        url = f"{proxy.base}/v1/completions"
        async with session.post(url, json=completion()) as warm:
            assert warm.status == 200
        before = proc_status_kib(pid, "VmRSS")
        body = json.dumps(completion(prompt="x" * (16 << 20))).encode()
        timeout = aiohttp.ClientTimeout(total=60)
        async with session.post(url, data=body, timeout=timeout, headers=JSON_TYPE) as response:
            assert response.status == 200
        peak = proc_status_kib(pid, "VmHWM")
    await proxy.stop()
    assert decode.requests[-1].body["prompt"] == "x" * (16 << 20)
    # The raw bytes and their text while parsing, then the parsed prompt and one encoding of
    # it that both legs send (SharedBody), each in mappings of its own (map_large_buffers):
    # 2.47x here, as for 32 MiB, 2.53x for 90 MB. It was 6.2x (a second raw copy kept,
    # aiohttp's copy of each leg), then 3.46x for 32 MiB and 5.2x for 16 MiB (an encoding per
    # leg, routing's copy of the prompt joined to its head, a heap that kept what it once
    # held); the target is 3x, this leaves room for noise.
    assert (peak - before) * 1024 / len(body) <= 2.75


async def test_refused_large_prompts_give_their_memory_back(
    aiohttp_server: AiohttpServer,
) -> None:
    """Prompts past the instances' max_model_len, refused with vLLM's 400: what the failed
    requests leave is cyclic (exceptions' tracebacks hold the frames that hold the body),
    which the daemon's rare collections (GC_YOUNG_THRESHOLD) left for good: 2x each body.
    A collection follows a large request, and the memory goes back to the system."""
    proxy, _ = await ProxyProcess.start(aiohttp_server, "--policy", "round_robin")
    pid = proxy.process.pid
    try:
        async with aiohttp.ClientSession() as session:
            url = f"{proxy.base}/v1/completions"
            async with session.post(url, json=completion()) as warm:
                assert warm.status == 200
            before = proc_status_kib(pid, "VmRSS")
            body = json.dumps(completion(prompt="x" * (16 << 20))).encode()
            for _ in range(3):
                async with session.post(url, data=body, headers=JSON_TYPE) as refused:
                    assert refused.status == 400

            def kept() -> int:
                return (proc_status_kib(pid, "VmRSS") - before) * 1024

            await eventually(lambda: kept() < len(body) / 2, 5)  # it kept 2x each body
    finally:
        await proxy.stop()


async def test_sigterm_lets_a_stream_finish_then_exits_0(aiohttp_server: AiohttpServer) -> None:
    proxy, decode = await ProxyProcess.start(aiohttp_server, decode={"token_delay": 0.1})
    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        async with session.post(
            f"{proxy.base}/v1/completions", json=completion(stream=True, max_tokens=15)
        ) as response:
            first = await response.content.readany()
            proxy.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            # Draining: still answering on new connections, alive but not to be sent work.
            fresh = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=fresh) as other:
                async with other.get(f"{proxy.base}/livez") as live:
                    assert live.status == 200 and (await live.json())["draining"] is True
                async with other.get(f"{proxy.base}/health") as health:
                    assert health.status == 503
                async with other.post(f"{proxy.base}/v1/completions", json=completion()) as late:
                    assert late.status == 503 and "draining" in (await late.text())
                    assert late.headers["Connection"] == "close"
            rest = await response.read()
        raw = first + rest
        assert raw == decode.sent_without_token_ids(response.headers["X-Request-Id"])
        assert sse_events(raw)[-1] == "[DONE]"
        assert await proxy.process.wait() == 0
        # Its last stream ended: it stopped accepting and exited.
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"{proxy.base}/health")
    log = await proxy.stop()
    assert "SIGTERM: draining" in log and "Traceback" not in log


async def test_a_stream_longer_than_the_shutdown_timeout_is_cut_and_its_legs_aborted(
    aiohttp_server: AiohttpServer,
) -> None:
    proxy, decode = await ProxyProcess.start(
        aiohttp_server, "--shutdown-timeout", "0.5", decode={"token_delay": 0.2}
    )
    body = completion(stream=True, max_tokens=40)  # 8 s of tokens
    async with aiohttp.ClientSession() as session, asyncio.timeout(20):
        async with session.post(f"{proxy.base}/v1/completions", json=body) as response:
            await response.content.readany()
            started = time.monotonic()
            proxy.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await response.read()
        assert await proxy.process.wait() == 0
        assert 0.4 < time.monotonic() - started < 3
    await eventually(lambda: len(decode.aborted) == 1)  # vLLM was told: its leg was closed
    await proxy.stop()


async def test_a_second_sigterm_exits_at_once(aiohttp_server: AiohttpServer) -> None:
    proxy, decode = await ProxyProcess.start(aiohttp_server, decode={"token_delay": 0.5})
    body = completion(stream=True, max_tokens=40)
    async with (
        aiohttp.ClientSession() as session,
        asyncio.timeout(20),
        session.post(f"{proxy.base}/v1/completions", json=body) as response,
    ):
        await response.content.readany()
        proxy.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert proxy.process.returncode is None  # draining: the stream still runs
        started = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)
        assert await proxy.process.wait() != 0
        assert time.monotonic() - started < 2
    await eventually(lambda: decode.running == 0)  # its leg was cut
    await proxy.stop()


async def test_systemd_notify_ready_watchdog_status_and_stopping(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(address)
        notify.setblocking(False)
        proxy, _ = await ProxyProcess.start(
            aiohttp_server, env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}
        )
        await asyncio.sleep(0.5)
        proxy.process.send_signal(signal.SIGTERM)
        assert await proxy.process.wait() == 0
        messages = []
        with contextlib.suppress(BlockingIOError):
            while True:
                messages.append(notify.recv(4096).decode())
    await proxy.stop()
    lines = [line for message in messages for line in message.splitlines()]
    assert lines.index("READY=1") < lines.index("STOPPING=1")
    assert "WATCHDOG=1" in lines
    assert any(line.startswith("STATUS=ready") for line in lines)
    assert any(line.startswith("STATUS=draining") for line in lines)


async def test_json_logs_and_no_key_in_any_log_line(aiohttp_server: AiohttpServer) -> None:
    proxy, _ = await ProxyProcess.start(
        aiohttp_server,
        *("--log-format", "json"),
        *("--api-key", "inbound-s3cret", "--upstream-api-key", "upstream-s3cret"),
    )
    async with aiohttp.ClientSession() as session:
        for auth in ("Bearer inbound-s3cret", "Bearer wrong-guess"):
            async with session.post(
                f"{proxy.base}/v1/completions", json=completion(), headers={"Authorization": auth}
            ) as response:
                await response.read()
    log = await proxy.stop()
    entries = [json.loads(line) for line in log.splitlines()]
    access = [e for e in entries if e["logger"] == "mooncake_proxy.access"]
    assert [e["status"] for e in access] == [200, 401]
    assert all(
        {"request_id", "route", "ttfb_s", "total_s", "bytes_out", "outcome"} <= set(e)
        for e in access
    )
    assert "s3cret" not in log
    assert any("inbound key set" in e["message"] for e in entries)
    assert {e["pid"] for e in entries} == {proxy.process.pid}
    assert all(e["time"].endswith("Z") for e in entries)


def test_the_example_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    verify = shutil.which("systemd-analyze")
    if verify is None:
        # CI installs it (Debian's systemd package) and sets this, so there it cannot skip.
        assert not os.environ.get("MOONCAKE_PROXY_TEST_NEEDS_SYSTEMD"), "systemd-analyze missing"
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd)")
    unit = (ROOT / "deploy" / "mooncake-proxy.service").read_text()
    assert "Type=notify" in unit and "TimeoutStopSec=45" in unit  # above the 30 s drain
    # Point ExecStart at this checkout: the unit's /opt path does not exist on a test machine.
    local = re.sub(
        r"(?m)^ExecStart=.*$", f"ExecStart={sys.executable} {ROOT / 'mooncake_proxy.py'}", unit
    )
    (tmp_path / "mooncake-proxy.service").write_text(local)
    result = subprocess.run(
        [verify, "verify", str(tmp_path / "mooncake-proxy.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "mooncake-proxy.service" not in result.stderr, result.stderr


# --- --workers: one port, metrics summed, reloads and drains, workers supervised


async def test_workers_share_the_port_and_drain_together(aiohttp_server: AiohttpServer) -> None:
    proxy, _ = await ProxyProcess.start(aiohttp_server, "--workers", "2")
    pids = set()
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection each time
    async with aiohttp.ClientSession(connector=connector) as session, asyncio.timeout(20):
        for _ in range(60):
            async with session.get(f"{proxy.base}/healthcheck") as health:
                if health.status == 200:
                    pids.add((await health.json())["pid"])
            if len(pids) == 2:
                break
        assert len(pids) == 2 and proxy.process.pid not in pids
        for _ in range(4):
            async with session.post(
                f"{proxy.base}/v1/completions", json=completion(stream=True)
            ) as r:
                assert sse_events(await r.read())[-1] == "[DONE]"
    proxy.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proxy.process.wait(), 20) == 0
    await proxy.stop()


async def test_metrics_add_up_across_workers(aiohttp_server: AiohttpServer, tmp_path: Path) -> None:
    """Whichever worker answers the scrape, it reports the whole daemon."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"from an earlier start")
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    proxy, _ = await ProxyProcess.start(aiohttp_server, "--workers", "2", env=env)
    try:
        connector = aiohttp.TCPConnector(force_close=True)  # a new connection, maybe a new worker
        pids: set[int] = set()
        sent = 0
        async with aiohttp.ClientSession(connector=connector) as session, asyncio.timeout(30):
            while len(pids) < 2 or sent < 12:
                async with session.get(f"{proxy.base}/healthcheck") as health:
                    page = await health.json()
                    pids.add(page["pid"])
                    assert page["scope"] == "worker of 2"
                body = completion(stream=True)
                async with session.post(f"{proxy.base}/v1/completions", json=body) as answer:
                    assert sse_events(await answer.read())[-1] == "[DONE]"
                    sent += 1
            assert len(pids) == 2
            await asyncio.sleep(mp.METRICS_REFRESH_SECONDS + 0.5)  # every worker's gauges set
            route = {"route": COMPLETIONS}
            for _ in range(6):
                async with session.get(f"{proxy.base}/metrics") as scraped:
                    families = text_string_to_metric_families(await scraped.text())
                samples = {
                    (s.name, tuple(sorted(s.labels.items()))): s.value
                    for family in families
                    for s in family.samples
                }
                assert (
                    sample(samples, "mooncake_proxy_requests_total", status="200", **route) == sent
                )
                ttft = "mooncake_proxy_time_to_first_token_seconds_count"
                assert sample(samples, ttft, **route) == sent
                assert sample(samples, "mooncake_proxy_ready") == 1
        proxy.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proxy.process.wait(), 20) == 0
        assert "Traceback" not in await proxy.stop()
    finally:
        if proxy.process.returncode is None:  # a failed check must not leave it serving
            for _ in range(2):  # the second signal makes the workers exit at once
                proxy.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
            await asyncio.wait_for(proxy.process.wait(), 20)
    assert not (metrics_dir / "counter_1.db").exists()  # cleared when the daemon started


def children_of(pid: int) -> set[int]:
    """The live child processes of ``pid`` (its workers)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
            if int(parent) == pid and state != "Z":
                found.add(int(stat.parent.name))
    return found


async def post_completions(base: str, count: int, **extra: Any) -> list[int]:
    """``count`` requests one after another, each on a connection of its own (so on whichever
    worker the kernel hands it to); their statuses."""
    statuses = []
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, asyncio.timeout(60):
        for _ in range(count):
            async with session.post(f"{base}/v1/completions", json=completion(**extra)) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


async def scrape_process(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as page:
        families = text_string_to_metric_families(await page.text())
    return sum(s.value for family in families for s in family.samples if s.name == name)


async def test_a_killed_worker_is_started_again_and_requests_keep_succeeding(
    aiohttp_server: AiohttpServer,
) -> None:
    proxy, _ = await ProxyProcess.start(aiohttp_server, "--workers", "2")
    pid = proxy.process.pid
    try:
        await eventually(lambda: len(children_of(pid)) == 2, 10)
        victim = min(children_of(pid))
        os.kill(victim, signal.SIGKILL)
        # New connections the kernel hands to its socket wait there for its replacement.
        assert await post_completions(proxy.base, 20) == [200] * 20
        await eventually(lambda: len(children_of(pid) - {victim}) == 2, 10)
        restarts = await scrape_process(proxy.base, "mooncake_proxy_worker_restarts_total")
        assert restarts == 1
    finally:
        log = await proxy.stop()
    assert re.search(rf"worker \d \(pid {victim}\) was killed by SIGKILL after", log), log
    assert "started again as pid" in log and "Traceback" not in log


async def test_sighup_as_the_workers_start_ends_none_of_them(
    aiohttp_server: AiohttpServer,
) -> None:
    """Workers are forked with SIGHUP blocked, and take it once they handle it: its default
    action would end a worker that has no handler yet."""
    proxy, _ = await ProxyProcess.start(aiohttp_server, "--workers", "2", ready=False)
    process = proxy.process
    try:
        await eventually(lambda: len(children_of(process.pid)) == 2, 10)
        workers = children_of(process.pid)
        for _ in range(5):  # as they start, before they serve
            process.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.02)
        assert await post_completions(proxy.base, 4) == [200] * 4
        assert children_of(process.pid) == workers
    finally:
        log = await proxy.stop()
    assert "exited" not in log and "killed" not in log, log
    assert log.count("configuration reloaded") >= 2  # each worker took it, once serving


async def port_taken(base: str) -> float:
    """Once a connection to ``base``'s port is taken (its backlog's, from the bind on), when."""
    host, port = base.removeprefix("http://").split(":")
    async with asyncio.timeout(15):
        while True:
            try:
                _, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(0.01)
                continue
            writer.close()
            return time.monotonic()


@pytest.mark.parametrize("workers", [1, 2])
async def test_requests_as_the_port_opens_wait_for_the_first_checks(
    aiohttp_server: AiohttpServer, workers: int
) -> None:
    """The port takes connections from when it is bound, before the fleet's first checks have
    ended (each /health takes 0.5 s here): requests then wait for them, in every worker,
    instead of getting 503 "proxy is not ready" from a fleet not checked yet."""
    flags = ("--workers", str(workers))
    proxy, _ = await ProxyProcess.start(
        aiohttp_server, *flags, both={"health_delay": 0.5}, ready=False
    )
    try:
        await port_taken(proxy.base)
        answers = await asyncio.gather(*(post_completions(proxy.base, 1) for _ in range(8)))
        assert answers == [[200]] * 8
    finally:
        log = await proxy.stop()
    assert "exited" not in log, log


@pytest.mark.parametrize("down", ["refused", "starting"])
async def test_a_decode_down_as_the_daemon_starts_gets_a_prompt_503(
    aiohttp_server: AiohttpServer, down: str
) -> None:
    """Waiting for the first checks is no hang: a decode that refuses its port, or answers its
    /health 503 (vLLM loading its model), fails its first check at once, and a request is
    answered 503 "not ready" as soon as that is known."""
    prefill = FakeVllm("prefill")
    api = await serve(aiohttp_server, prefill.api_app())
    bootstrap = await serve(aiohttp_server, prefill.bootstrap_app())
    prefill.api_url = f"http://127.0.0.1:{api.port}"
    decode = f"http://127.0.0.1:{free_port()}"  # refused: nothing listens there
    if down == "starting":
        starting = await serve(aiohttp_server, FakeVllm("decode", health_status=503).api_app())
        decode = f"http://127.0.0.1:{starting.port}"
    proxy = await ProxyProcess.launch(
        "--prefill", prefill.api_url, str(bootstrap.port), "--decode", decode, ready=False
    )
    try:
        opened = await port_taken(proxy.base)
        url, body = f"{proxy.base}{COMPLETIONS}", completion()
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
            error = (await answer.json())["error"]
        assert answer.status == 503 and "no usable decode instance" in error["message"]
        assert time.monotonic() - opened < 2.0
    finally:
        await proxy.stop()


async def test_a_reload_under_workers_sends_every_request_to_the_new_decode(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    prefill = FakeVllm("prefill")
    api = await serve(aiohttp_server, prefill.api_app())
    bootstrap = await serve(aiohttp_server, prefill.bootstrap_app())
    prefill.api_url = f"http://127.0.0.1:{api.port}"  # where decodes pull its KV
    old, new = FakeVllm("decode"), FakeVllm("decode")
    old_api = await serve(aiohttp_server, old.api_app())
    new_api = await serve(aiohttp_server, new.api_app())
    port, file = free_port(), tmp_path / "proxy.toml"
    lines = [f"port = {port}", "workers = 2"]
    lines.append(f'prefill = ["http://127.0.0.1:{api.port} {bootstrap.port}"]')
    file.write_text("\n".join([*lines, f'decode = ["http://127.0.0.1:{old_api.port}"]', ""]))
    proxy = await ProxyProcess.launch("--config", str(file), port=port, ready=False)
    process, log = proxy.process, proxy.log
    try:
        await log.wait_for_processes("is usable", 2, seconds=15)
        file.write_text("\n".join([*lines, f'decode = ["http://127.0.0.1:{new_api.port}"]', ""]))
        process.send_signal(signal.SIGHUP)
        await log.wait_for_processes("configuration reloaded: --decode", 2)
        await log.wait_for_processes(f"decode http://127.0.0.1:{new_api.port} is usable", 2)
        before = len(old.requests)
        assert await post_completions(proxy.base, 12) == [200] * 12
        assert len(old.requests) == before and len(new.requests) == 12
        served_by = {
            line.split("[")[1].split("]")[0]
            for line in log.lines
            if "POST /v1/completions 200" in line
        }
        assert len(served_by) == 2  # both workers took some (each of 12 a coin toss)
    finally:
        await proxy.stop()
        assert process.returncode == 0


async def test_a_drain_under_workers_lets_every_stream_finish(
    aiohttp_server: AiohttpServer,
) -> None:
    proxy, decode = await ProxyProcess.start(
        aiohttp_server, "--workers", "2", decode={"token_delay": 0.1}
    )
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, asyncio.timeout(30):

        async def stream() -> list[Any]:
            body = completion(stream=True, max_tokens=15)
            async with session.post(f"{proxy.base}/v1/completions", json=body) as answer:
                return sse_events(await answer.read())

        streams = [asyncio.create_task(stream()) for _ in range(6)]
        await eventually(lambda: decode.running == 6)
        proxy.process.send_signal(signal.SIGTERM)
        for events in await asyncio.gather(*streams):
            assert events[-1] == "[DONE]" and len(events) == 16
    assert await asyncio.wait_for(proxy.process.wait(), 20) == 0
    assert "Traceback" not in await proxy.stop()


async def test_under_workers_systemd_hears_ready_once_all_serve_and_a_watchdog_while_healthy(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    address = str(tmp_path / "notify.sock")
    heard: list[tuple[float, str]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(address)
        notify.setblocking(False)

        def drain() -> list[str]:
            """What systemd heard so far, each line with when it was read."""
            with contextlib.suppress(BlockingIOError):
                while True:
                    for line in notify.recv(4096).decode().splitlines():
                        heard.append((time.monotonic(), line))
            return [line for _, line in heard]

        env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}
        proxy, _ = await ProxyProcess.start(aiohttp_server, "--workers", "2", env=env)
        pid = proxy.process.pid
        try:
            await eventually(lambda: "READY=1" in drain(), 10)
            ready_at = next(t for t, line in heard if line == "READY=1")
            assert any(line.startswith("STATUS=serving with 2 of 2") for _, line in heard)
            await asyncio.sleep(1.0)
            drain()
            assert sum(line == "WATCHDOG=1" and t > ready_at for t, line in heard) >= 3
            victim = min(children_of(pid))
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            await eventually(lambda: len(children_of(pid) - {victim}) == 2, 10)
            await asyncio.sleep(2.5)  # its replacement serves and reports
            drain()
            pings = [t - killed for t, line in heard if line == "WATCHDOG=1" and t > killed]
            # None while a worker was missing (a 1 s wait before a young worker is started
            # again), then again.
            assert pings and pings[0] > 0.9, pings
            assert [line for _, line in heard].count("READY=1") == 1
        finally:
            await proxy.stop()


# --- without the speed extra: the stdlib's json and asyncio's loop


@pytest.mark.parametrize("fast", [True, False], ids=["orjson", "stdlib"])
def test_leg_bodies_encode_alike_with_or_without_the_speed_extra(
    monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    if not fast:
        monkeypatch.setattr(mp, "FAST_DUMPS", None)
    bodies = [
        completion(prompt="caf\u00e9 \u4e2d\u6587 " * 3),
        completion(prompt="x" * 100_000),
        # What orjson refuses and the stdlib parser produces: the slow path takes them.
        mp.parse_request_json(
            b'{"prompt": "\\ud800 lone surrogate", "seed": 123456789012345678901234567890}'
        ),
        mp.parse_request_json(b'{"prompt": ' + b"[" * 400 + b"]" * 400 + b"}"),
    ]
    for body in bodies:
        encoded = mp.encode_json(body)
        assert isinstance(encoded, bytes)
        assert json.loads(encoded) == body


BODIES = [
    b'{"model": "m", "prompt": "caf\xc3\xa9", "max_tokens": 3, "temperature": 0.7}',
    b'{"prompt": "\\ud800 lone surrogate", "seed": 123456789012345678901234567890}',
    b'{"prompt": ' + b"[" * 400 + b"]" * 400 + b"}",
    "\ufeff".encode() + b'{"prompt": "with a BOM"}',
    '{"prompt": "utf-16"}'.encode("utf-16"),
    b'{"a": 1, "a": 2}',
]
BAD_BODIES = [
    b'{"prompt": NaN}',
    b'{"prompt": Infinity}',
    b"[1, 2]",
    b"[" * 5000 + b"]" * 5000,
    b'{"prompt": "\xff"}',
    b'{"x": 1} trailing',
    b"",
]


@pytest.mark.parametrize("raw", BODIES + BAD_BODIES)
def test_a_body_parses_alike_with_or_without_the_speed_extra(
    monkeypatch: pytest.MonkeyPatch, raw: bytes
) -> None:
    """orjson reads what it can (strict UTF-8 JSON), the stdlib the rest: a body is accepted,
    read and refused the same either way, with the same words."""

    def parse() -> object:
        try:
            return mp.parse_request_json(bytearray(raw))
        except mp.ProxyError as refused:
            return (refused.status, refused.message)

    fast = parse()
    monkeypatch.setattr(mp, "FAST_LOADS", None)
    assert parse() == fast
    assert isinstance(fast, dict) == (raw in BODIES)


async def test_the_pd_flow_works_without_the_speed_extra(
    start_cluster: StartCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mp, "FAST_DUMPS", None)
    cluster = await start_cluster()
    response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
    assert sse_events(await response.read())[-1] == "[DONE]"


@pytest.mark.parametrize("installed", [True, False], ids=["uvloop", "no-uvloop"])
def test_loop_choice(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    assert mp.event_loop_factory("asyncio") is None
    if not installed:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
        assert mp.event_loop_factory("auto") is None
        with pytest.raises(mp.ConfigError, match="uvloop is not installed"):
            mp.event_loop_factory("uvloop")
        return
    import uvloop

    assert mp.event_loop_factory("auto") is uvloop.new_event_loop
    assert mp.event_loop_factory("uvloop") is uvloop.new_event_loop


# --- deploy/kubernetes: the manifests against Kubernetes' schemas, the proxy and each other

K8S = ROOT / "deploy" / "kubernetes"
# Kinds that kubernetes-validate has no schema for (a CRD, kustomize's own): checked by hand.
K8S_UNSCHEMED = {"ServiceMonitor", "Kustomization"}
# The fields of monitoring.coreos.com/v1 ServiceMonitor that these manifests may use.
SERVICEMONITOR_SPEC_FIELDS = {
    "selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels", "podTargetLabels",
    "sampleLimit",
}  # fmt: skip
SERVICEMONITOR_ENDPOINT_FIELDS = {
    "port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "authorization",
    "relabelings", "metricRelabelings", "tlsConfig",
}  # fmt: skip


def k8s_documents() -> list[dict[str, Any]]:
    """Every YAML document in deploy/kubernetes, in file order."""
    pytest.importorskip("yaml")
    import yaml

    return [
        document
        for path in sorted(K8S.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found = [
        d for d in k8s_documents() if (d["kind"], d.get("metadata", {}).get("name")) == (kind, name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} named {name!r} in deploy/kubernetes"
    return found[0]


def test_kubernetes_manifests_pass_the_kubernetes_schemas() -> None:
    if importlib.util.find_spec("kubernetes_validate") is None:
        # CI installs it (requirements-dev.txt) and sets this, so there it cannot skip.
        needed = os.environ.get("MOONCAKE_PROXY_TEST_NEEDS_KUBERNETES_VALIDATE") == "1"
        assert not needed, "kubernetes-validate missing"
        pytest.skip("kubernetes-validate is not installed here (pip install kubernetes-validate)")
    versions = ("1.25.0", "1.37.0")  # the oldest and newest schemas that 1.37.0 bundles
    result = subprocess.run(
        [
            sys.executable, "-m", "kubernetes_validate", "--strict",  # unknown fields fail
            *(arg for version in versions for arg in ("-k", version)),
            *sorted(str(path) for path in K8S.glob("*.yaml")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # A kind without a schema only warns (exit 0), a misspelled one too: allow just these.
    for line in output.splitlines():
        if not line.startswith("INFO"):
            assert re.search(rf"for kind ({'|'.join(K8S_UNSCHEMED)}) with", line), output
    schemed = [d for d in k8s_documents() if d["kind"] not in K8S_UNSCHEMED]
    assert output.count(" passed for resource ") == len(schemed) * len(versions), output


def test_kubernetes_manifests_agree_with_the_proxy_and_each_other(tmp_path: Path) -> None:
    flags = {s.flag for s in mp.SETTINGS}
    defaults = {s.flag: s.default for s in mp.SETTINGS}
    pytest.importorskip("yaml")
    import yaml

    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    namespace = kustomization["namespace"]
    assert not [d for d in k8s_documents() if "namespace" in d.get("metadata", {})]

    deployment = k8s_object("Deployment", "mooncake-proxy")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # --config names a key of the ConfigMap, mounted as a directory: a subPath is never updated.
    command = container["command"]
    assert "--config" in flags and command[0] == "mooncake-proxy"
    config_path = Path(command[command.index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    assert "subPath" not in mount and mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = k8s_object("ConfigMap", volume["configMap"]["name"])
    config = tomllib.loads(config_map["data"][config_path.name])
    assert {"--" + key for key in config} <= flags, sorted({"--" + k for k in config} - flags)
    assert "config" not in config
    # ... and the proxy takes it, values included.
    (tmp_path / config_path.name).write_text(config_map["data"][config_path.name])
    mp.load_config(mp.build_parser(), ["--config", str(tmp_path / config_path.name)], {})
    # Secrets come as MOONCAKE_PROXY_* variables, each a real setting's, optional.
    assert {e["name"] for e in container["env"]} <= {s.env for s in mp.SETTINGS}
    assert all(e["valueFrom"]["secretKeyRef"]["optional"] is True for e in container["env"])
    # Else the Service "mooncake-proxy" puts MOONCAKE_PROXY_PORT=tcp://IP:8000 in the pod.
    assert pod["enableServiceLinks"] is False

    # Listening where the probes and the Services look, probing the right routes.
    assert config["host"] in ("0.0.0.0", "::")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == config.get("port", defaults["--port"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}

    # Draining: the kubelet's SIGKILL comes after the preStop pause and the proxy's own drain.
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        pause = float(pre_stop["sleep"]["seconds"])
    else:
        assert pre_stop["exec"]["command"][0] == "sleep"
        pause = float(pre_stop["exec"]["command"][1])
    drain = float(config.get("shutdown-timeout", defaults["--shutdown-timeout"]))
    assert pod["terminationGracePeriodSeconds"] > pause + drain > pause > 0

    # Rollouts and evictions keep one replica serving; the pod runs unprivileged.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = k8s_object("PodDisruptionBudget", "mooncake-proxy")["spec"]
    assert deployment["spec"]["replicas"] > budget["minAvailable"] >= 1
    assert budget["selector"] == deployment["spec"]["selector"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }

    # Each DNS name is a headless Service of this namespace that has the ports named.
    for key in ("prefill-dns", "decode-dns"):
        assert config[key], key
        for entry in config[key]:
            host, *entry_ports = entry.split(":")
            name, in_namespace, svc, *_ = host.split(".")
            assert (in_namespace, svc) == (namespace, "svc"), entry
            service = k8s_object("Service", name)["spec"]
            assert service["clusterIP"] == "None", entry
            assert service["publishNotReadyAddresses"] is False, entry
            assert {int(p) for p in entry_ports} <= {p["port"] for p in service["ports"]}, entry

    # The proxy's Service reaches its pods; the ServiceMonitor scrapes that Service's pods.
    proxy = k8s_object("Service", "mooncake-proxy")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert proxy["spec"]["type"] == "ClusterIP"
    assert proxy["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in proxy["spec"]["ports"]} <= set(ports) | set(ports.values())
    monitor = k8s_object("ServiceMonitor", "mooncake-proxy")["spec"]
    assert set(monitor) <= SERVICEMONITOR_SPEC_FIELDS, set(monitor) - SERVICEMONITOR_SPEC_FIELDS
    assert monitor["selector"]["matchLabels"].items() <= proxy["metadata"]["labels"].items()
    for endpoint in monitor["endpoints"]:
        assert set(endpoint) <= SERVICEMONITOR_ENDPOINT_FIELDS, endpoint
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in {p["name"] for p in proxy["spec"]["ports"]}


# --- observability checked by real tools: promtool and a Prometheus server


def prometheus_tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        # CI installs Debian's prometheus package and sets this, so there it cannot skip.
        assert not os.environ.get("MOONCAKE_PROXY_TEST_NEEDS_PROMETHEUS"), f"{name} missing"
        pytest.skip(f"{name} is not installed here (apt-get install prometheus)")
    return found


def test_alert_rules_are_valid_and_fire_on_their_unit_series() -> None:
    promtool = prometheus_tool("promtool")
    for command in (
        [promtool, "check", "rules", "prometheus-alerts.yml"],
        [promtool, "test", "rules", "prometheus-alerts.test.yml"],
    ):
        result = subprocess.run(
            command, cwd=ROOT / "deploy", capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def shipped_expressions() -> list[str]:
    """Every PromQL expression of the dashboard, and every alert's without its threshold (so
    that a quiet cluster still returns the series it compares)."""
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    expressions = [
        target["expr"].replace("$__rate_interval", "1m")
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    alerts = (ROOT / "deploy" / "prometheus-alerts.yml").read_text()
    for rule in re.findall(r"expr: (\|\n(?:\s{10,}.*\n)+|.*\n)", alerts):
        expr = " ".join(rule.removeprefix("|").split())
        expressions.append(re.sub(r"\s*(==|>|<)\s*[\d.]+$", "", expr))
    return expressions


async def test_every_dashboard_and_alert_expression_finds_its_series(
    start_cluster: StartCluster, tmp_path: Path
) -> None:
    """A real Prometheus scrapes a fresh proxy in front of fakes after a few short requests,
    none failing: every panel and alert finds its series (none may refer to a metric or label
    that does not exist, nor read "no data" until some failure made its series)."""
    binary = prometheus_tool("prometheus")
    cluster = await start_cluster(decode={"token_delay": 0.01})
    port, web_port = cluster.client.port, free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: mooncake-proxy\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    server = await asyncio.create_subprocess_exec(
        binary, f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web_port}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for body in (completion(stream=True, max_tokens=4), completion(), chat(stream=True)):
            path = CHAT if "messages" in body else COMPLETIONS
            assert (await (await cluster.client.post(path, json=body)).read()).strip()
        missing: list[str] = []
        deadline = time.monotonic() + 30  # Prometheus starts, and scrapes twice (for rates)
        async with aiohttp.ClientSession() as session:
            for expr in shipped_expressions():
                while not await query_finds(session, web_port, expr):
                    if time.monotonic() > deadline:
                        missing.append(expr)
                        break
                    await asyncio.sleep(0.5)
    finally:
        server.terminate()
        await server.wait()
    assert not missing, missing


async def query_finds(session: aiohttp.ClientSession, port: int, expr: str) -> bool:
    query = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        async with session.get(query, params={"query": expr}) as answer:
            payload = await answer.json()
    except aiohttp.ClientError:
        return False  # not listening yet
    assert payload["status"] == "success", (expr, payload)
    return bool(payload["data"]["result"])


# --- TLS: the proxy's own listener, its clients' certificates, and a private CA upstream


async def https_status(url: str, tls: ssl.SSLContext, body: dict[str, Any] | None = None) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.request("POST" if body else "GET", url, json=body, ssl=tls) as response,
    ):
        await response.read()
        return response.status


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_the_proxy_serves_https_and_asks_clients_for_certificates_when_told(
    aiohttp_server: AiohttpServer, tmp_path: Path, loop: str
) -> None:
    """Certificates made here (trustme): a CA, the proxy's for 127.0.0.1, a client's. With
    --ssl-certfile/--ssl-keyfile the proxy answers over TLS only; with --ssl-ca-certs too, only
    clients whose certificate that CA signed."""
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("client@example.com")
    server.private_key_pem.write_to_path(key := tmp_path / "key.pem")
    server.cert_chain_pems[0].write_to_path(cert := tmp_path / "cert.pem")
    ca.cert_pem.write_to_path(ca_file := tmp_path / "ca.pem")
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    flags = ["--loop", loop, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    proxy, _ = await ProxyProcess.start(aiohttp_server, *flags, ready=False)
    try:
        await proxy.log.wait_for("listening on", 15)
        https = proxy.base.replace("http://", "https://")
        await eventually_async(lambda: https_status(f"{https}/health", trusting), 200)
        status = await https_status(f"{https}/v1/completions", trusting, completion())
        assert status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):  # an unknown CA
            await https_status(f"{https}/health", ssl.create_default_context())
        with pytest.raises(aiohttp.ClientError):  # plain HTTP on the TLS port
            await https_status(f"{proxy.base}/health", trusting)
    finally:
        await proxy.stop()
    flags += ["--ssl-ca-certs", str(ca_file)]
    proxy, _ = await ProxyProcess.start(aiohttp_server, *flags, ready=False)
    try:
        await proxy.log.wait_for("listening on", 15)
        https = proxy.base.replace("http://", "https://")
        with pytest.raises(aiohttp.ClientError):  # no certificate: the handshake fails
            await https_status(f"{https}/health", trusting)
        client.configure_cert(trusting)
        await eventually_async(lambda: https_status(f"{https}/health", trusting), 200)
        assert await https_status(f"{https}/v1/completions", trusting, completion()) == 200
    finally:
        await proxy.stop()


async def eventually_async(ask: Any, expected: Any, seconds: float = 15) -> None:
    async with asyncio.timeout(seconds):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                if await ask() == expected:
                    return
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_instances_behind_a_private_ca_are_served_with_upstream_ca_certs(
    aiohttp_server: AiohttpServer, tmp_path: Path, loop: str
) -> None:
    """The prefill and the decode over https:// with certificates of a CA the system does
    not know: refused as untrusted without --upstream-ca-certs, served with it."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(ca_file := tmp_path / "ca.pem")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(tls)
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode", kv_timeout=KV_TIMEOUT)
    api = await aiohttp_server(prefill.api_app(), ssl=tls)
    bootstrap = await aiohttp_server(prefill.bootstrap_app())
    prefill.api_url = f"https://127.0.0.1:{api.port}"
    prefill.worker_url = f"http://127.0.0.1:{bootstrap.port}"  # Mooncake's own channel
    decode_api = await aiohttp_server(decode.api_app(), ssl=tls)
    fleet = ["--prefill", prefill.api_url, str(bootstrap.port)]
    fleet += ["--decode", f"https://127.0.0.1:{decode_api.port}", "--loop", loop]
    untrusted = await ProxyProcess.launch(*fleet, "--discovery-interval", "0.2", ready=False)
    try:
        await untrusted.log.wait_for("CERTIFICATE_VERIFY_FAILED", 15)
    finally:
        await untrusted.stop()
    proxy = await ProxyProcess.launch(*fleet, "--upstream-ca-certs", str(ca_file))
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{proxy.base}/v1/completions", json=completion()) as answer,
        ):
            assert answer.status == 200, await answer.text()
        assert len(decode.requests) == 1 and len(prefill.requests) == 1
    finally:
        await proxy.stop()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "missing.pem", "--ssl-certfile", "missing.pem"], "No such file"),
        (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs --ssl-certfile"),
        (["--upstream-ca-certs", "missing.pem"], "--upstream-ca-certs"),
    ],
)
def test_tls_files_that_cannot_serve_stop_the_daemon_with_the_reason(
    flags: list[str], says: str
) -> None:
    fleet = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "mooncake_proxy.py"), *fleet, *flags],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


# --- CORS: browsers' calls from the origins allowed, as vLLM's flags say them


PREFLIGHT = {
    "Origin": "https://app.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_without_allowed_origins_no_answer_lets_a_browser_in(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    preflight = await cluster.client.options(COMPLETIONS, headers=PREFLIGHT)
    assert preflight.status == 405 and "Access-Control-Allow-Origin" not in preflight.headers
    origin = {"Origin": "https://app.example"}
    answer = await cluster.client.post(COMPLETIONS, json=completion(), headers=origin)
    assert answer.status == 200 and "Access-Control-Allow-Origin" not in answer.headers


async def test_an_allowed_origin_passes_its_preflight_and_reads_its_stream(
    start_cluster: StartCluster,
) -> None:
    """Its preflight is answered without the key (browsers send none with it), another
    origin's is refused, and the answers, a stream among them, name the origin."""
    cluster = await start_cluster(allowed_origins=("https://app.example",), api_key="k")
    preflight = await cluster.client.options(COMPLETIONS, headers=PREFLIGHT)
    assert preflight.status == 200, await preflight.text()
    assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert (
        preflight.headers["Access-Control-Allow-Headers"]
        == PREFLIGHT["Access-Control-Request-Headers"]
    )
    other = await cluster.client.options(
        COMPLETIONS, headers=PREFLIGHT | {"Origin": "https://evil.example"}
    )
    assert other.status == 400 and "Access-Control-Allow-Origin" not in other.headers
    headers = {"Origin": "https://app.example", "Authorization": "Bearer k"}
    stream = await cluster.client.post(COMPLETIONS, json=completion(stream=True), headers=headers)
    assert stream.status == 200 and b"[DONE]" in await stream.read()
    assert stream.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Origin" in stream.headers.getall("Vary")
    refused = await cluster.client.post(COMPLETIONS, json=completion(), headers=PREFLIGHT)
    assert refused.status == 401  # the key is still asked for; the browser may read why
    assert refused.headers["Access-Control-Allow-Origin"] == "https://app.example"


async def test_any_origin_is_named_as_any_unless_credentials_are_allowed(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(allowed_origins=("*",))
    origin = {"Origin": "https://anywhere.example"}
    answer = await cluster.client.get("/v1/models", headers=origin)
    assert answer.headers["Access-Control-Allow-Origin"] == "*"
    cluster = await start_cluster(allowed_origins=("*",), allow_credentials=True)
    answer = await cluster.client.get("/v1/models", headers=origin)
    assert answer.headers["Access-Control-Allow-Origin"] == "https://anywhere.example"
    assert answer.headers["Access-Control-Allow-Credentials"] == "true"
