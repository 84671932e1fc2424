"""The upstream legs: the connection pool the proxy keeps to vLLM, and the legs' own HTTP/1.1
wire (HttpLeg, UpstreamPool), tested as a library's would be: split, malformed, cut, stalled
and TLS answers, fuzzed with Hypothesis."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import ssl
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import httptools
import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from testing_support import (
    COMPLETIONS,
    FAST,
    StartCluster,
    assert_openai_error,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
    serve,
    sse_events,
)

# --- the connection pool


async def test_many_concurrent_streams_are_not_capped_by_the_pool(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decode={"token_delay": 0.05})
    count = 150  # above aiohttp's default cap of 100 connections

    url = cluster.client.make_url(COMPLETIONS)

    async def one(session: aiohttp.ClientSession) -> bytes:
        async with session.post(url, json=completion(stream=True, max_tokens=20)) as response:
            return await response.read()

    unlimited = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=unlimited) as session, asyncio.timeout(FAST * 4):
        tasks = [asyncio.create_task(one(session)) for _ in range(count)]
        await eventually(lambda: cluster.decodes[0].running == count, FAST * 3)
        answers = await asyncio.gather(*tasks)
    assert all(sse_events(a)[-1] == "[DONE]" for a in answers)


async def test_a_capped_pool_never_takes_healthy_instances_out(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        max_connections=3,
        pool_timeout=0.3,
        health_interval=0.05,
        health_timeout=0.2,
        decode={"token_delay": 0.1},
    )
    fleet, decode = fleet_of(cluster), cluster.decodes[0]
    # A PD request takes two connections, and keeps one while it streams: 3 allow 2 streams.
    streams = [
        asyncio.create_task(
            cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=15))
        )
        for _ in range(2)
    ]
    await eventually(lambda: decode.running == 2)
    checks = decode.health_count
    started = time.monotonic()
    refused = await cluster.client.post(COMPLETIONS, json=completion())
    waited = time.monotonic() - started
    payload = await refused.json()
    assert refused.status == 503 and 0.25 < waited < FAST
    assert_openai_error(payload, 503)
    message = payload["error"]["message"]
    assert "--max-connections" in message and "3" in message and "--pool-timeout" in message
    assert cluster.prefills[0].api_url in message and decode.api_url in message
    assert refused.headers["Retry-After"] == "1"
    # Health checks have a pool of their own: they go on, and nothing leaves the rotation.
    await asyncio.sleep(0.5)
    assert decode.health_count >= checks + 3
    assert (await cluster.client.get("/health")).status == 200
    assert all(b.usable for b in (*fleet.prefills, *fleet.decodes))
    for stream in streams:
        response = await stream
        assert sse_events(await response.read())[-1] == "[DONE]"
    assert cluster.client.app[mp.STATE_KEY].slots.in_use == 0
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_requests_total", route=COMPLETIONS, status="503") == 1


async def test_pool_slots_are_handed_out_in_order_and_given_back_when_a_wait_ends() -> None:
    slots = mp.UpstreamSlots(3)
    await slots.acquire(2, 1)
    first = asyncio.create_task(slots.acquire(2, 1))
    second = asyncio.create_task(slots.acquire(1, 1))
    await asyncio.sleep(0.01)
    # First come first served: the single slot free does not go to the later, smaller request.
    assert not first.done() and not second.done() and slots.in_use == 2
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0)
    assert second.done() and slots.in_use == 3  # the cancelled wait let the next one through
    with pytest.raises(TimeoutError):
        await slots.acquire(1, 0.05)
    slots.release(2)
    slots.release(1)
    assert slots.in_use == 0
    unlimited = mp.UpstreamSlots(0)
    await unlimited.acquire(100, 0)
    assert unlimited.in_use == 0


async def test_upstream_connections_are_reused(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    for _ in range(5):
        assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    # Sequential requests: each leg finds its previous connection idle in the pool.
    assert len({r.peer for r in cluster.prefills[0].requests}) == 1
    assert len({r.peer for r in cluster.decodes[0].requests}) == 1


async def test_the_pool_lets_idle_connections_go_before_vllm_closes_them(
    start_cluster: StartCluster,
) -> None:
    """--keepalive-timeout (4 s) under vLLM's 5: a request after 4.5 s idle goes on a new
    connection, never on one vLLM is closing as it is written."""
    cluster = await start_cluster()
    decode = cluster.decodes[0]
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    await asyncio.sleep(cluster.config.keepalive_timeout + 0.5)
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    first, second = (recorded.peer for recorded in decode.requests)
    assert first != second
    assert sample(await scrape(cluster), "mooncake_proxy_retries_total", stage="decode") == 0


# --- the legs' wire (HttpLeg, UpstreamPool), tested as a library's would be


class ScriptedUpstream:
    """A raw HTTP/1.1 upstream on loopback: GET /health is answered 200, every other request
    with ``answer``, its pieces written one by one (None: never answered, read until the
    proxy closes). What aiohttp's server never sends (split, malformed, 1xx, cut or stalled
    answers) reaches the legs this way."""

    def __init__(self, answer: Sequence[bytes] | None, *, idle_close: float | None = None) -> None:
        self.answer, self.idle_close = answer, idle_close
        self.connections = 0
        self.closed_by_proxy = 0  # connections the proxy closed, idle or while waiting
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> URL:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return URL(f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}")

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                async with asyncio.timeout(self.idle_close):
                    head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                self.requests.append(
                    head + await reader.readexactly(int(length[1]) if length else 0)
                )
                if head.startswith(b"GET /health "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                if self.answer is None:
                    await reader.read()
                    self.closed_by_proxy += 1
                    return
                for piece in self.answer:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)  # each piece a read of its own, most likely
                if b"connection: close" in b"".join(self.answer).lower():
                    return
        except asyncio.IncompleteReadError:
            self.closed_by_proxy += 1
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


async def leg_reading(answer: Sequence[bytes], *, eof: bool = True) -> mp.HttpLeg:
    """An HttpLeg that sent a request over a socket pair and then read ``answer``, written
    piece by piece, then the far end closed if ``eof``; it is returned complete or failed."""
    near, far = socket.socketpair()
    loop = asyncio.get_running_loop()
    _, leg = await loop.create_connection(lambda: mp.HttpLeg({}), sock=near)
    reader, writer = await asyncio.open_connection(sock=far)
    try:
        leg.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n", (b"{}",), 2
        )
        await reader.readuntil(b"\r\n\r\n{}")
        with contextlib.suppress(ConnectionError):  # a leg that failed has hung up
            for piece in answer:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
        if eof:
            writer.close()
        with contextlib.suppress(mp.LegFailed):
            async with asyncio.timeout(FAST):
                await leg.wait(leg.is_complete)
        return leg
    finally:
        writer.close()
        leg.close()


def split(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def chunked(body: bytes, sizes: Sequence[int]) -> bytes:
    framed, at = [], 0
    for size in itertools.cycle(sizes or [len(body) or 1]):
        if at >= len(body):
            break
        piece = body[at : at + max(size, 1)]
        framed.append(b"%x\r\n%b\r\n" % (len(piece), piece))
        at += len(piece)
    return b"".join(framed) + b"0\r\n\r\n"


def test_any_split_of_a_sized_or_chunked_answer_reads_the_same() -> None:
    """None: sized by Content-Length; a list: chunked in chunks of those sizes, in turn."""
    pytest.importorskip("hypothesis")
    import hypothesis
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=150, deadline=None)
    @hypothesis.given(
        body=st.binary(max_size=3000),
        framing=st.one_of(st.none(), st.lists(st.integers(1, 700), max_size=6)),
        cuts=st.lists(st.integers(0, 10_000), max_size=12),
    )
    def check(body: bytes, framing: list[int] | None, cuts: list[int]) -> None:
        if framing is None:
            head = (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"
            )
            answer = head % len(body) + body
        else:
            head = (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
            )
            answer = head + b"\r\n\r\n" + chunked(body, framing)
        leg = asyncio.run(leg_reading(split(answer, cuts), eof=False))
        assert leg.error is None and leg.complete and leg.reusable
        assert (leg.status, leg.reason, leg.content_type) == (200, b"OK", b"text/event-stream")
        assert leg.body() == body

    check()


VALID_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def test_a_malformed_answer_fails_its_leg_and_nothing_else() -> None:
    """A valid answer with bytes replaced or inserted anywhere (the status line and the
    headers most of all), then the connection closed: the leg either read an answer or failed
    with LegFailed; no other exception, no wait past the close."""
    pytest.importorskip("hypothesis")
    import hypothesis
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(
        edits=st.lists(
            st.tuples(st.integers(0, len(VALID_HEAD) - 1), st.binary(max_size=3)), min_size=1
        ),
        cuts=st.lists(st.integers(0, 200), max_size=4),
    )
    def check(edits: list[tuple[int, bytes]], cuts: list[int]) -> None:
        answer = bytearray(VALID_HEAD)
        for at, new in edits:
            answer[at : at + (len(new) % 2)] = new  # replace a byte, or insert before it
        leg = asyncio.run(leg_reading(split(bytes(answer), cuts)))
        assert leg.complete or leg.error is not None
        if leg.error is not None:
            assert str(leg.error)
            return
        assert 200 <= leg.status <= 999
        # What it read across the pieces is what llhttp reads of the answer in one piece.
        whole = WholeAnswer(bytes(answer))
        if whole.complete:
            assert (leg.status, leg.body()) == (whole.status, whole.body)

    check()


class WholeAnswer:
    """An answer parsed in one piece by httptools itself (its last message: 1xx skipped)."""

    def __init__(self, data: bytes) -> None:
        self.status, self.body, self.complete = 0, b"", False
        self.parser = httptools.HttpResponseParser(self)
        with contextlib.suppress(httptools.HttpParserError):
            self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.body, self.complete = b"", False

    def on_body(self, piece: bytes) -> None:
        self.body += piece

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.complete = self.status >= 200


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed answer (Invalid status code)"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: twelve\r\n\r\n", "malformed answer"),
        (b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n", "malformed answer"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "malformed answer"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
         "a protocol switch it was not asked for"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"x\"", "closed the connection while"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "connection while"),
        (b"", "closed the connection before answering"),
    ],
)  # fmt: skip
async def test_a_broken_answer_says_what_broke(answer: bytes, words: str) -> None:
    leg = await leg_reading([answer])
    assert leg.error is not None and words in str(leg.error), leg.error
    # Only no answer at all may be tried elsewhere: a byte of one means the request was taken.
    assert leg.error.unreachable is (answer == b"")
    assert not leg.open


async def test_informational_answers_are_skipped_and_a_close_ends_an_unsized_body() -> None:
    leg = await leg_reading(
        [
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ",
            b"the end",
        ]
    )
    assert leg.error is None and leg.complete and not leg.reusable
    assert (leg.status, leg.content_type, leg.body()) == (200, b"text/plain", b"until the end")


async def test_an_answer_nobody_asked_for_is_not_read_and_closes_the_connection() -> None:
    """Bytes after a whole answer would be read as the next request's: the connection is
    out of step, so the answer stays as it was and the connection is not kept."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    leg = await leg_reading([ok + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra"], eof=False)
    assert leg.error is None and leg.complete and leg.body() == b"ok"
    assert not leg.reusable


async def test_the_pool_reuses_what_is_open_and_replaces_what_the_upstream_closed() -> None:
    ok = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"ok"]
    pool = mp.UpstreamPool(connect_timeout=FAST, keepalive_timeout=60)

    async def get(url: URL) -> bytes:
        leg = await pool.send(b"POST", url / "v1/completions", b"X: 1\r\n", (b"{}",))
        try:
            return await leg.whole()
        finally:
            pool.finish(leg)

    upstream = ScriptedUpstream(ok, idle_close=0.2)
    async with upstream as url:
        assert [await get(url) for _ in range(3)] == [b"ok"] * 3
        assert upstream.connections == 1  # one kept connection for sequential requests
        await asyncio.sleep(0.5)  # the upstream closed it while idle: not reused, no failure
        assert await get(url) == b"ok" and upstream.connections == 2
        assert upstream.requests[0].startswith(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nX: 1\r\nContent-Length: 2\r\n\r\n{}"
            % url.raw_authority.encode()
        )
    closing = ScriptedUpstream(
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"]
    )
    async with closing as url:
        assert [await get(url) for _ in range(2)] == [b"ok"] * 2
        assert closing.connections == 2  # "Connection: close" is not kept
    pool.close()


async def test_idle_connections_close_after_the_keepalive_timeout() -> None:
    pool = mp.UpstreamPool(connect_timeout=FAST, keepalive_timeout=0.1)
    upstream = ScriptedUpstream([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
    async with upstream as url:
        legs = [await pool.send(b"GET", url / "v1/models", b"") for _ in range(3)]
        for leg in legs:
            await leg.whole()
            pool.finish(leg)
        async with asyncio.timeout(FAST):
            while upstream.closed_by_proxy < 3:  # the pool's sweep closed all three
                await asyncio.sleep(0.02)
        leg = await pool.send(b"GET", url / "v1/models", b"")
        await leg.whole()
        assert upstream.connections == 4
        pool.finish(leg)
    pool.close()


async def test_a_header_with_a_line_break_is_refused_not_sent() -> None:
    with pytest.raises(mp.ProxyError) as refused:
        mp.header_lines({"X-Id": "a\r\nX-Injected: 1"})
    assert refused.value.status == 500  # none can come from a client or the configuration
    assert mp.header_lines({"X-Id": "a", "Y": "b"}) == b"X-Id: a\r\nY: b\r\n"


# A self-signed certificate for 127.0.0.1 (openssl req -x509, EC P-256, valid 100 years).
TLS_CERTIFICATE = """\
-----BEGIN CERTIFICATE-----
MIIBpTCCAUqgAwIBAgIUXYLB7kdSvEeHXP72SXPwU7sFmR4wCgYIKoZIzj0EAwIw
HjEcMBoGA1UEAwwTbW9vbmNha2UtcHJveHkgdGVzdDAgFw0yNjEyMDUwODQwMTFa
GA8yMTI2MTExMTA4NDAxMVowHjEcMBoGA1UEAwwTbW9vbmNha2UtcHJveHkgdGVz
dDBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABGdd7gubtd/BUC3RY2HxQ/NTfjBr
7CAeIRgA7RhTaH6Uno9KEa8SnoOuKdZfyRDIHJ8zhvbHpV2C2W/e0iKH4N+jZDBi
MB0GA1UdDgQWBBQjv3av2CnQJ5LsPjyO2HmmvSJg1TAfBgNVHSMEGDAWgBQjv3av
2CnQJ5LsPjyO2HmmvSJg1TAPBgNVHRMBAf8EBTADAQH/MA8GA1UdEQQIMAaHBH8A
AAEwCgYIKoZIzj0EAwIDSQAwRgIhALYPStiYqg8QbjCuz5AfrCrwUBkgzCeWLclU
RC/ogZiEAiEAiS//6wcmrcDiNNLePH4a72dW2SCBNMwZa6JnZ0+cotc=
-----END CERTIFICATE-----
"""
TLS_KEY = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgccigoXZvkAAMAuvw
TSkJ8dI7DzBDzbKYlJI47FD/ShahRANCAARnXe4Lm7XfwVAt0WNh8UPzU34wa+wg
HiEYAO0YU2h+lJ6PShGvEp6DrinWX8kQyByfM4b2x6Vdgtlv3tIih+Df
-----END PRIVATE KEY-----
"""


@pytest.mark.parametrize("trusted", [True, False])
async def test_a_decode_behind_tls_is_served_only_with_a_certificate_it_trusts(
    start_cluster: StartCluster,
    aiohttp_server: AiohttpServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    trusted: bool,
) -> None:
    """An https:// upstream: the leg checks its certificate against the system's trust store
    (SSL_CERT_FILE names the test's own, where trusted), then streams as over plain HTTP."""
    (tmp_path / "cert.pem").write_text(TLS_CERTIFICATE)
    (tmp_path / "key.pem").write_text(TLS_KEY)
    if trusted:
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))
    cluster = await start_cluster()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server = await aiohttp_server(cluster.decodes[0].api_app(), ssl=tls)
    decode = cluster.client.app[mp.STATE_KEY].fleet.decodes[0]
    decode.routes = mp.route_urls(URL(f"https://127.0.0.1:{server.port}"))
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        raw = await response.read()
    if trusted:
        assert response.status == 200 and sse_events(raw)[-1] == "[DONE]"
        return
    assert response.status == 502
    message = json.loads(raw)["error"]["message"]
    assert "unreachable: cannot connect to 127.0.0.1" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message, message


async def test_a_decode_answering_malformed_http_is_a_502_and_the_proxy_serves_on(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    decode = cluster.client.app[mp.STATE_KEY].fleet.decodes[0]
    served = decode.routes
    async with ScriptedUpstream([b"HTTP/1.1 2x0 OK\r\n\r\n"]) as url:
        decode.routes = mp.route_urls(url)
        async with asyncio.timeout(FAST):
            response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
            assert response.status == 502
            payload = await response.json()
        assert_openai_error(payload, 502)
        assert "malformed answer" in payload["error"]["message"]
    decode.routes = served
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200


async def test_a_stalled_decode_is_a_504_within_the_request_timeout_and_is_hung_up_on(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(request_timeout=0.5)
    decode = cluster.client.app[mp.STATE_KEY].fleet.decodes[0]
    stalled = ScriptedUpstream(None)
    async with stalled as url:
        decode.routes = mp.route_urls(url)
        started = time.monotonic()
        async with asyncio.timeout(FAST):
            response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
            assert response.status == 504
            assert_openai_error(await response.json(), 504)
        assert time.monotonic() - started < 0.5 + 1.0
        async with asyncio.timeout(FAST):
            while not stalled.closed_by_proxy:  # hung up on, so vLLM would abort it
                await asyncio.sleep(0.02)


async def test_a_slow_client_slows_its_decode_instead_of_filling_the_proxy(
    start_cluster: StartCluster, aiohttp_server: AiohttpServer
) -> None:
    """The decode writes as fast as the proxy reads; the client reads nothing for a while.
    Without backpressure the proxy would read the whole answer into its client's buffer."""
    total, piece = 256 * 1024 * 1024, b"x" * (256 * 1024)
    sent = 0

    async def flood(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        while sent < total:
            await response.write(piece)  # waits while the proxy does not read
            sent += len(piece)
        await response.write_eof()
        return response

    async def healthy(_: web.Request) -> web.Response:
        return web.Response()

    cluster = await start_cluster()
    app = web.Application()
    app.router.add_post(COMPLETIONS, flood)
    app.router.add_get("/health", healthy)
    server = await serve(aiohttp_server, app)
    decode = cluster.client.app[mp.STATE_KEY].fleet.decodes[0]
    decode.routes = mp.route_urls(URL(f"http://127.0.0.1:{server.port}"))
    async with asyncio.timeout(60):
        response = await cluster.client.post(COMPLETIONS, json=completion())
        assert response.status == 200
        await asyncio.sleep(1.0)  # the client reads nothing: at most the buffers fill
        assert sent < total / 4, f"{sent / 2**20:.0f} MiB went into the proxy unread"
        received = 0
        async for chunk in response.content.iter_any():
            received += len(chunk)
    assert received == total
