"""Migration against real vLLM: a stream whose decode is killed after its first token.

One prefill (kv_producer), two decodes (kv_consumer) and the proxy in front of them. A greedy
streamed request of a few hundred tokens is sent once uninterrupted, then again; the second
time the decode serving it is held to the client's pace (``Pacer``) and killed (SIGKILL) once
a few dozen tokens have reached the client. The proxy continues the request on the other
decode, as a completion whose prompt is the prompt's token ids and the tokens already sent: the
client's one stream must end as the uninterrupted one did, text, usage and all, with one id
and one ``[DONE]``. Greedy decoding is deterministic on the CPU build and a continuation from
token ids goes on token for token (``/work/shared/PROTOCOL.md``, "For exact replay"), so
anything else is a defect.

A non-streamed request whose decode is killed is retried whole by the proxy, which
``test_a_decode_killed_during_a_plain_answer_is_answered_whole_by_another`` in
``test_real_vllm.py`` already checks against real vLLM; it is not repeated here.

The module's servers start after the other modules' are down (``run.sh`` runs it last).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from real_vllm import (  # the suite's servers and their HTTP
    DECODE_MAX_MODEL_LEN,
    KV_ABORT_TIMEOUT,
    MODEL,
    PROXY,
    Server,
    free_port,
    healthcheck,
    metric,
    running,
    stall_in,
    unique_prompt,
    vllm_server,
    wait_for,
)

MAX_TOKENS = 300  # a few hundred: about a second of decoding here, the kill comes early in it
KILL_AFTER = 40  # token chunks the client has read when the decode serving it is killed


@dataclass
class MigrationCluster:
    prefill: Server
    decodes: tuple[Server, Server]
    proxy: Server
    figures: list[str] = field(default_factory=list)

    def all_decodes_up(self) -> None:
        """Restarts a decode a previous test killed and waits until the proxy uses it again:
        every kill must leave a live peer to take the continuation."""
        for decode in self.decodes:
            assert decode.process is not None
            if decode.process.poll() is None:
                continue
            decode.start()
            decode.wait_healthy(300)
            decode.warm_up()
        usable = lambda: all(d["usable"] for d in healthcheck(self.proxy.url)["decode"])  # noqa: E731
        assert wait_for(usable, 60), healthcheck(self.proxy.url)["decode"]


@pytest.fixture(scope="module")
def migration_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigrationCluster]:
    with one_prefill_two_decodes(tmp_path_factory, "migration") as cluster:
        yield cluster


@contextlib.contextmanager
def one_prefill_two_decodes(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> Iterator[MigrationCluster]:
    """One prefill, two decodes and the proxy in front of them, all stopped at the end, also
    when a test fails; ``name`` names their logs (the differential module's cluster too)."""
    root = Path(os.environ["VLLM_ENV_ROOT"])
    logs = Path(os.environ.get("REAL_VLLM_LOGS") or tmp_path_factory.mktemp(f"{name}-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    # The prefill takes the decodes' length: a continuation's prompt is the prompt and the
    # tokens already sent, and its prefill leg must accept it.
    prefill = vllm_server(root, logs, "kv_producer", DECODE_MAX_MODEL_LEN, name=f"{name}-prefill")
    decodes = (
        vllm_server(root, logs, "kv_consumer", DECODE_MAX_MODEL_LEN, name=f"{name}-decode-a"),
        vllm_server(root, logs, "kv_consumer", DECODE_MAX_MODEL_LEN, name=f"{name}-decode-b"),
    )
    port = free_port()
    argv = [sys.executable, str(PROXY), "--port", str(port)]
    argv += ["--no-start-self-test"]  # the suite counts what each server computed
    argv += ["--decode", decodes[0].url, "--decode", decodes[1].url]
    argv += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    # Patient with three CPU vLLMs on 2 cores, as the suite's own cluster (test_real_vllm.py
    # says why); the decodes in turn, so that both serve.
    argv += ["--connect-timeout", "30", "--health-timeout", "10"]
    argv += ["--decode-policy", "round_robin"]
    proxy = Server(
        f"{name}-proxy", argv, dict(os.environ), logs / f"{name}-proxy.log",
        f"http://127.0.0.1:{port}",
    )  # fmt: skip
    servers = (prefill, *decodes, proxy)
    try:
        for server in servers:
            server.start()
        for server in (prefill, *decodes):
            server.wait_healthy(300)
        for server in (prefill, *decodes):
            server.warm_up()
        proxy.wait_healthy(60)
        cluster = MigrationCluster(prefill, decodes, proxy)
        cluster.all_decodes_up()
        yield cluster
        for line in cluster.figures:
            print(line)
    finally:
        for server in reversed(servers):
            server.stop()
        print(f"\nserver logs: {logs}")


# --- a stream read event by event


@dataclass
class Stream:
    """What a client read of one streamed answer: its events in order, as parsed JSON, and
    whether ``data: [DONE]`` came, where, and what came after it."""

    events: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0  # how many [DONE]s
    after_done: list[str] = field(default_factory=list)  # frames after the first [DONE]
    arrived: list[float] = field(default_factory=list)  # when each token chunk arrived
    killed_at: int = -1  # token chunks read when the decode was killed
    killed_time: float = 0.0
    cut: str = ""  # how the connection ended before the stream did, if it did

    def token_chunks(self) -> list[dict[str, Any]]:
        """Chunks carrying a generated token: a chat's role chunk and the usage chunk are not."""
        return [e for e in self.events if e.get("choices") and not is_role_chunk(e)]

    def text(self) -> str:
        pieces = []
        for event in self.events:
            for choice in event.get("choices") or []:
                pieces.append(
                    choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                )
        return "".join(pieces)

    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            for c in e.get("choices") or []
            if c.get("finish_reason")
        ]

    def usages(self) -> list[dict[str, Any]]:
        return [e["usage"] for e in self.events if e.get("usage")]


def counts(usage: dict[str, Any]) -> dict[str, int]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def is_role_chunk(event: dict[str, Any]) -> bool:
    return any("role" in (c.get("delta") or {}) for c in event.get("choices") or [])


def body_of(path: str) -> dict[str, Any]:
    """A greedy streamed request that runs its whole length, with usage."""
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": unique_prompt()}]
    else:
        body["prompt"] = unique_prompt()
    return body


class Pacer:
    """Holds the decode serving a stream to its client's pace, and kills it (SIGKILL, its whole
    process group) once the client has read `kill_after` token chunks.

    Left alone, the decode writes a few hundred tokens in under a second, and the proxy's and
    the sockets' buffers take them all: a client that three CPU vLLMs on 2 cores keep from
    running for that long (seen in CI) then finds the decode finished, not killed. So the
    decode runs only while the client has caught up: it is stopped (SIGSTOP) as the client
    reads its next chunk, or after `SLICE` if that is late (a thread waiting for the GIL
    while the client reads), and let run again once no chunk has come for `QUIET`.
    """

    SLICE = 0.01  # seconds the decode runs at most at a time: a few tokens here
    QUIET = 0.05  # no new chunk for this long: the client has read what was sent

    def __init__(self, cluster: MigrationCluster, kill_after: int) -> None:
        self.cluster, self.kill_after = cluster, kill_after
        self.read = 0  # token chunks the client has read
        self.moved = threading.Event()  # the client read one
        self.lock = threading.Lock()  # over the decode's state: both threads signal it
        self.running = False
        self.victim: Server | None = None
        self.killed_at, self.killed_time = -1, 0.0
        self.ended = False  # the client's stream ended
        self.thread = threading.Thread(target=self.pace, daemon=True)
        self.failure: BaseException | None = None

    def opened(self) -> None:
        """The stream's head is here (the proxy sends it with the decode's first token). Both
        decodes are stopped before the proxy is asked which one serves it: while it answers,
        the decode could write the rest of the answer. None does where a stall kept this
        process from the head until the proxy had passed the whole answer on (seen in CI):
        then there is nothing to kill (Trial.void)."""
        decodes = self.cluster.decodes
        for decode in decodes:
            signal_group(decode, signal.SIGSTOP)
        try:
            busy = [
                d["url"] for d in healthcheck(self.cluster.proxy.url)["decode"] if d["in_flight"]
            ]
            assert len(busy) <= 1, busy
            self.victim = next((d for d in decodes if d.url in busy), None)
        finally:
            for decode in decodes:
                if decode is not self.victim:
                    signal_group(decode, signal.SIGCONT)
        if self.victim is not None:
            self.thread.start()

    def token(self) -> None:
        self.read += 1
        self.moved.set()
        with self.lock:
            if self.victim is None:
                return  # no decode held it when its head came: nothing to kill (Trial.void)
            if self.read == self.kill_after:
                assert self.victim.process is not None
                signal_group(self.victim, signal.SIGKILL)
                self.killed_at, self.killed_time = self.read, time.monotonic()
                self.running = False
                # Reaping a decode killed mid-answer once took 30 s on CI's loaded cores.
                self.victim.process.wait(KV_ABORT_TIMEOUT * 3)
            elif self.running:
                self.stop()

    def closed(self) -> None:
        self.ended = True
        self.moved.set()
        if self.thread.is_alive():
            self.thread.join(30)
        with self.lock:
            if self.victim is not None and self.killed_at < 0:
                signal_group(self.victim, signal.SIGCONT)  # finished before the kill
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        assert self.victim is not None
        signal_group(self.victim, signal.SIGSTOP)
        self.running = False

    def pace(self) -> None:
        try:
            while not self.ended and self.killed_at < 0:
                self.moved.clear()
                if self.moved.wait(self.QUIET):
                    continue  # the client is still reading what was sent
                with self.lock:
                    if self.ended or self.killed_at >= 0:
                        return
                    assert self.victim is not None
                    signal_group(self.victim, signal.SIGCONT)
                    self.running = True
                time.sleep(self.SLICE)
                with self.lock:
                    if self.running:
                        self.stop()
        except BaseException as error:  # raised in the test's thread by closed()
            self.failure = error


def signal_group(server: Server, number: int) -> None:
    assert server.process is not None and server.process.poll() is None
    os.killpg(server.process.pid, number)


def read_stream(base: str, path: str, body: dict[str, Any], pacer: Pacer | None = None) -> Stream:
    """Streams `body` and reads it to its end, telling `pacer` of its head and of each token
    chunk. A connection that ends before the stream's last chunk is recorded in `cut`, not
    raised, so that what came before is seen."""
    request = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    stream = Stream()
    try:
        with urllib.request.urlopen(request, timeout=KV_ABORT_TIMEOUT * 3) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            if pacer is not None:
                pacer.opened()
            try:
                for raw in response:
                    read_line(stream, raw.decode().rstrip("\r\n"), pacer)
            except (http.client.HTTPException, OSError) as error:
                stream.cut = repr(error)
    finally:
        if pacer is not None:
            pacer.closed()
            stream.killed_at, stream.killed_time = pacer.killed_at, pacer.killed_time
    return stream


def read_line(stream: Stream, line: str, pacer: Pacer | None) -> None:
    if not line.startswith("data: "):
        return  # the blank line between frames, a keep-alive comment
    data = line[len("data: ") :]
    if stream.done:
        stream.after_done.append(data)
    elif data == "[DONE]":
        stream.done += 1
    else:
        event: dict[str, Any] = json.loads(data)
        stream.events.append(event)
        if event.get("choices") and not is_role_chunk(event):
            stream.arrived.append(time.monotonic())
            if pacer is not None:
                pacer.token()


# Tries at a kill mid-stream (see Trial.void). A try was void 1 time in 2 to 1 in 4 on these
# 2 cores (the differential module's figures): with 3 tries, a case would fail in 1 run of 64
# to 1 of 8 for nothing but voids.
ATTEMPTS = 5


@dataclass
class Trial:
    """One try at killing the decode serving a stream mid-stream."""

    stream: Stream
    killed: Server | None  # None: the answer was whole before its head was read
    peer: Server | None
    logged: dict[str, int]  # the decodes' log sizes when it began
    served: dict[str, float]  # and their requests served
    sent: int  # tokens the killed decode had sent, per the proxy's log; -1: it logged no failure
    took: float

    @property
    def figures(self) -> str:
        sent = self.sent if self.sent >= 0 else "?"
        if self.killed is None:
            return f"the whole answer ({len(self.stream.token_chunks())} chunks) came first"
        return (
            f"killed {self.killed.name} after {self.stream.killed_at} of "
            f"{len(self.stream.token_chunks())} token chunks read ({sent} sent by it per the "
            "proxy's log)"
        )

    def void(self) -> bool:
        """The decode had written the whole answer before the kill (or before this process
        read the stream's head), and the proxy passed it on with no failure to see: nothing
        was migrated, and nothing went wrong. The pacer makes this rare, not impossible: this
        VM stalls a process for tenths of a second at times (a thread sleeping 5 ms, alone on
        an idle box, wakes 0.11 s late), and a decode let run through such a stall writes its
        whole answer. Anything else is judged."""
        whole = self.stream.done == 1 and not self.stream.cut
        return self.sent < 0 and whole and not any("error" in e for e in self.stream.events)


def kill_mid_stream(
    cluster: MigrationCluster, path: str, body: dict[str, Any], kill_after: int = KILL_AFTER
) -> Trial:
    # Counted from here: earlier requests are done on both decodes' counters too.
    assert wait_for(lambda: all(running(d) == 0 for d in cluster.decodes), 10)
    logged = {d.name: d.logged() for d in cluster.decodes}
    served = {d.name: metric(d, "vllm:request_success_total") for d in cluster.decodes}
    pacer = Pacer(cluster, kill_after)
    proxy_logged, started = cluster.proxy.logged(), time.monotonic()
    stream = read_stream(cluster.proxy.url, path, body, pacer)
    took = time.monotonic() - started
    killed = pacer.victim
    assert killed is None or stream.killed_at > 0, (
        f"the stream ended after {len(stream.arrived)} token chunks, before a kill"
    )
    peer = next((d for d in cluster.decodes if d is not killed), None) if killed else None
    # The client reads behind the decode (the proxy's and the sockets' buffers): how many
    # tokens the decode had sent when it died, only the proxy's log says.
    sent = re.search(r"after (\d+) tokens", cluster.proxy.said_since(proxy_logged))
    return Trial(stream, killed, peer, logged, served, int(sent[1]) if sent else -1, took)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_whose_decode_is_killed_mid_stream_ends_as_the_uninterrupted_one(
    migration_cluster: MigrationCluster, path: str
) -> None:
    cluster = migration_cluster
    cluster.all_decodes_up()
    body = body_of(path)

    started = time.monotonic()
    uninterrupted = read_stream(cluster.proxy.url, path, body)
    took_whole = time.monotonic() - started
    (usage,) = uninterrupted.usages()
    assert usage["completion_tokens"] == MAX_TOKENS
    # The continuation's prompt (prompt and tokens sent) and its answer fit both servers.
    assert usage["prompt_tokens"] + MAX_TOKENS <= DECODE_MAX_MODEL_LEN
    assert not uninterrupted.cut and uninterrupted.done == 1
    assert uninterrupted.finish_reasons() == ["length"]

    voided: list[str] = []
    for _ in range(ATTEMPTS):
        cluster.all_decodes_up()
        trial = kill_mid_stream(cluster, path, body)
        if not trial.void():
            break
        voided.append(trial.figures)  # the next try restarts the decode it killed
    migrated, peer = trial.stream, trial.peer
    gaps = [b - a for a, b in zip(migrated.arrived, migrated.arrived[1:], strict=False)]
    after = [t for t in migrated.arrived if t > migrated.killed_time]
    figures = (
        f"migration {path}: {trial.figures}; {len(after)} arrived after the kill; stream "
        f"{trial.took:.2f} s, uninterrupted {took_whole:.2f} s (prompt {usage['prompt_tokens']} "
        f"tokens); longest gap between chunks {max(gaps, default=0.0):.2f} s"
        + (f"; tries before, the decode done before the kill: {voided}" if voided else "")
    )
    print(figures)
    cluster.figures.append(figures)
    assert not trial.void(), figures
    assert peer is not None, figures

    stalled = {d.name: stall_in(d, trial.logged[d.name]) for d in cluster.decodes}
    errors = [e for e in migrated.events if "error" in e]
    assert not errors, (errors, figures, stalled)
    assert not migrated.cut, (migrated.cut, figures, stalled)
    assert migrated.done == 1 and not migrated.after_done, (migrated.after_done, figures)
    assert migrated.text() == uninterrupted.text(), (figures, stalled)
    # The usage counts the whole answer, and the client's prompt, not the continuation's.
    assert [counts(u) for u in migrated.usages()] == [counts(usage)], figures
    assert migrated.finish_reasons() == ["length"]
    # One answer to the client: one id and one creation time, chunks of its own kind (a chat's
    # continuation reshaped as chat chunks), and one role chunk for a chat.
    assert len({e["id"] for e in migrated.events}) == 1
    assert len({e["created"] for e in migrated.events}) == 1
    assert {e["object"] for e in migrated.events} == {e["object"] for e in uninterrupted.events}
    roles = sum(is_role_chunk(e) for e in migrated.events)
    assert roles == sum(is_role_chunk(e) for e in uninterrupted.events)
    # The kill came while the request was generating: its peer served the continuation.
    continued = lambda: metric(peer, "vllm:request_success_total") > trial.served[peer.name]  # noqa: E731
    assert wait_for(continued, 10), figures
    assert wait_for(lambda: running(peer) == 0 and running(cluster.prefill) == 0, 10)
