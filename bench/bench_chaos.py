"""Chaos benchmark: how many requests a client loses while faults hit a simulated cluster.

    python bench/bench_chaos.py --quick   # 55 s of load per target: a minute, two with vllm-router
    python bench/bench_chaos.py           # 5 minutes of load per target
    python bench/bench_chaos.py --strict  # exit 1 on any client-visible failure

Run by hand, not by CI: its figures depend on timing, and its point is to show what fails.

It starts a simulated cluster of fake vLLM servers, each a process of its own as a real one is
(``fake_vllm.py --serve``: 2 prefill instances with their bootstrap servers, 3 decodes), the
proxy in front as users start it, and sends it a steady load of streamed and non-streamed
completions and chats, each with a prompt of its own. Meanwhile a schedule of faults hits the
cluster, each kind on its own timer: a decode SIGKILLed mid-stream and started again, an
instance SIGSTOPped for a few seconds, KV pulls that fail on a decode, a prefill restarted (new
engine ids), every decode's /health slower than the proxy's --health-timeout. The faults never
leave the fleet without a prefill and a decode that serve (Claims).

Every answer is checked against what the fake generates uninterrupted (fake_vllm.generate is a
function of the request alone), and every request classified: ok, an error status, a stream
with an in-band error event, an answer cut before its end, wrong tokens, or a client timeout.
The report is a table (per fault kind how often it was applied and how many failed requests
overlapped it; the failures by kind; the proxy's retries and failed legs from its /metrics;
TTFT and total time of the good answers) and a verdict against the target: no
client-visible failure while one healthy prefill/decode pair remains. vllm-router runs the same
schedule on a fresh cluster when its binary is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# The daemon is at the repository's top and the fakes in tests/: run as a script, only bench/
# is on the path.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
sys.path.insert(2, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_mooncake_proxy import percentile, wait_http
from fake_vllm import MODEL, VOCAB, free_port, generate, prompt_of
from mooncake_proxy import MIGRATION_OUTCOMES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository: the daemon at its top, the fakes in tests/
PREFILLS, DECODES = 2, 3
QUICK_SECONDS, FULL_SECONDS = 55.0, 300.0
CONCURRENCY = 12
# A decode paces its tokens so: a stream lasts 0.1-0.2 s, long enough to be cut mid-way.
TOKEN_DELAY = 0.004
# The fakes' --max-model-len: a chat that names no cap runs to it (less its prompt, 30-40
# tokens), a hundred tokens or so, as long as the others.
MAX_MODEL_LEN = 128
# A stop string never said (vLLM holds back its 26 characters while it may still match) and a
# word the fakes say often (the answer stops there): with temperature 0, migrated exactly.
STOPS = ["a stop string of 27 letters", " cache"]
# The proxy's checks, short so that the fleet reacts within the faults' few seconds.
HEALTH_INTERVAL, DISCOVERY_INTERVAL, HEALTH_TIMEOUT = 1.0, 0.5, 1.0
# A client gives up on a request after this long: longer than any fault lasts, so that a
# timeout means a request that hung, not one that waited out a pause.
REQUEST_TIMEOUT = 30.0
START_TIMEOUT = 20.0  # seconds a server may take to answer /health
STOP_GRACE = 5.0  # seconds a SIGTERMed server may drain before it is killed

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# The fault kinds: (first at, then every) seconds into the load. Periods are prime-ish to one
# another so that the kinds meet in changing combinations.
KILL = "decode SIGKILLed mid-stream, started again 3 s later"
PAUSE = "an instance SIGSTOPped for 3 s (decode, prefill in turn)"
PULLS = "a decode's next 3 KV pulls fail"
RESTART = "a prefill restarted (SIGTERM; new engine ids)"
SLOW = "every decode's /health 2 s late (timeout 1 s) for 6 s"
SCHEDULE: Final = {
    KILL: (5.0, 20.0),
    PAUSE: (8.0, 15.0),
    PULLS: (3.0, 10.0),
    RESTART: (12.0, 25.0),
    SLOW: (17.0, 30.0),
}
DOWN_SECONDS, PAUSE_SECONDS, SLOW_SECONDS = 3.0, 3.0, 6.0
FAILED_PULLS, PULLS_HELD = 3, 2.0  # pulls that fail; seconds the decode is held for them
SLOW_HEALTH = 2 * HEALTH_TIMEOUT
# A failure this long after a fault ended is still its: the proxy's checks take a second or
# two to see an instance back.
AFTERMATH = 2.0

# How a request ended, as its client sees it.
OK = "ok"
ERROR_EVENT = "stream with an in-band error event"
CUT = "answer cut before its end ([DONE] or whole body)"
WRONG = "wrong, missing or duplicated tokens"
TIMEOUT = f"client timeout ({REQUEST_TIMEOUT:g} s)"
NO_ANSWER = "no answer (connection failed)"
MALFORMED = "a 200 that is no answer (not JSON, no choices)"


# --- the simulated cluster: one process per fake vLLM server


@dataclass(eq=False)  # held in sets by identity (Claims)
class Node:
    role: str  # prefill or decode
    port: int
    bootstrap_port: int | None  # a prefill's
    log: Path  # its output, appended to across restarts
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Start it (again, on the same ports: a prefill gets new engine ids) and wait for it."""
        argv = [sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "--serve", self.role]
        argv += ["--port", str(self.port), "--token-delay", str(TOKEN_DELAY)]
        argv += ["--max-model-len", str(MAX_MODEL_LEN)]
        if self.bootstrap_port is not None:
            argv += ["--bootstrap-port", str(self.bootstrap_port)]
        with self.log.open("ab") as out:
            self.process = await asyncio.create_subprocess_exec(*argv, stdout=out, stderr=out)
        await until_healthy(self.url)

    def send_signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signum)

    async def stop(self, signum: int | None = signal.SIGKILL) -> None:
        if self.process is not None:
            await stop_process(self.process, signum)


async def stop_process(process: asyncio.subprocess.Process, signum: int | None) -> None:
    """Signal it (None: it was told to end itself) and wait for its end; one that takes
    longer than STOP_GRACE is killed. A signal to one that ended unseen would reap it
    (Popen.send_signal polls), and asyncio's own wait would then find no child."""
    if process.returncode is None and signum is not None:
        process.send_signal(signum)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(STOP_GRACE):
            await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()


async def until_healthy(url: str) -> None:
    """bench_mooncake_proxy's wait, off the event loop: the load runs meanwhile."""
    await asyncio.to_thread(wait_http, url + "/health", START_TIMEOUT)


class Cluster:
    def __init__(self, logs: Path) -> None:
        def node(role: str, index: int) -> Node:
            bootstrap = free_port() if role == "prefill" else None
            return Node(role, free_port(), bootstrap, logs / f"{role}{index}.log")

        self.prefills = [node("prefill", i) for i in range(PREFILLS)]
        self.decodes = [node("decode", i) for i in range(DECODES)]
        self.nodes = self.prefills + self.decodes

    async def start(self) -> None:
        await asyncio.gather(*(node.start() for node in self.nodes))

    async def kill(self) -> None:
        await asyncio.gather(*(node.stop() for node in self.nodes))

    def fleet_args(self) -> list[str]:
        """--prefill URL BOOTSTRAP_PORT and --decode URL: the proxy's and vllm-router's."""
        args = []
        for node in self.prefills:
            args += ["--prefill", node.url, str(node.bootstrap_port)]
        for node in self.decodes:
            args += ["--decode", node.url]
        return args


# --- what the load goes through: the proxy, or vllm-router


@dataclass
class Target:
    name: str
    url: str
    process: asyncio.subprocess.Process
    scraped: bool  # it has the proxy's /metrics

    async def stop(self) -> None:
        await stop_process(self.process, signal.SIGTERM)


def proxy_argv(cluster: Cluster, port: int) -> list[str]:
    return [
        sys.executable, str(ROOT / "mooncake_proxy.py"), "--port", str(port),
        *cluster.fleet_args(), "--log-level", "WARNING", "--no-start-self-test",
        "--health-interval", str(HEALTH_INTERVAL),
        "--discovery-interval", str(DISCOVERY_INTERVAL),
        "--health-timeout", str(HEALTH_TIMEOUT),
    ]  # fmt: skip


def router_binary() -> str | None:
    """As bench_mooncake_proxy looks for it: on PATH, or in this venv's bin."""
    here = str(Path(sys.executable).parent)
    return shutil.which("vllm-router") or shutil.which("vllm-router", path=here)


def router_argv(cluster: Cluster, port: int, binary: str) -> list[str]:
    """Its checks as the proxy's (whole seconds: it takes no fractions), to compare like with
    like; its retries and circuit breaker as they come."""
    return [
        binary, "--host", "127.0.0.1", "--port", str(port),
        "--vllm-pd-disaggregation", "--kv-connector", "mooncake", *cluster.fleet_args(),
        "--health-check-interval-secs", f"{HEALTH_INTERVAL:.0f}",
        "--health-check-timeout-secs", f"{HEALTH_TIMEOUT:.0f}",
    ]  # fmt: skip


async def start_target(name: str, argv: list[str], port: int, log: Path) -> Target:
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(*argv, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    await until_healthy(url)
    return Target(name, url, process, scraped=name == "proxy")


# --- the load: requests whose right answers are known


@dataclass(frozen=True)
class Planned:
    path: str
    body: dict[str, Any]
    text: str  # what the fake answers, uninterrupted


def planned(number: int) -> Planned:
    """Request ``number``: completion or chat, streamed or not, in turn; a prompt of its own
    and 24-48 tokens; one in six names no cap (a chat's is what --max-model-len leaves, a
    completion's vLLM's 16), one in six has stop strings and temperature 0 (STOPS). Its answer
    is the fakes' (generate is deterministic)."""
    chat, stream = number % 2 == 1, number % 4 >= 2
    words = random.Random(number).choices(VOCAB, k=12)
    prompt = f"chaos request {number}: {' '.join(words)}"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 24 + number % 25, "stream": stream}
    if number % 6 == 5:
        del body["max_tokens"]
    elif number % 6 == 3:
        body |= {"stop": STOPS, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = CHAT if chat else COMPLETIONS
    expected = generate(prompt_of(path, body), body, max_model_len=MAX_MODEL_LEN)
    return Planned(path, body, expected.text)


@dataclass
class Outcome:
    kind: str  # OK, or the failure's kind
    started: float
    ended: float = math.inf
    ttft: float | None = None  # to the first token; a non-streamed answer's: to all of it
    tokens: int = 0  # tokens that reached the client
    detail: str = ""  # what the failure said, for the report's examples

    @property
    def failed(self) -> bool:
        return self.kind != OK


async def send(session: aiohttp.ClientSession, base: str, plan: Planned) -> Outcome:
    outcome = Outcome(OK, time.monotonic())
    headed = False
    try:
        async with session.post(base + plan.path, json=plan.body) as answer:
            headed = True
            if answer.status != 200:
                outcome.kind, outcome.detail = f"status {answer.status}", await answer.text()
            elif plan.body["stream"]:
                await read_stream(answer, plan, outcome)
            else:
                await read_whole(answer, plan, outcome)
    except TimeoutError:
        outcome.kind, outcome.detail = TIMEOUT, f"after {outcome.tokens} tokens"
    except (aiohttp.ContentTypeError, ValueError, LookupError, TypeError) as error:
        outcome.kind, outcome.detail = MALFORMED, repr(error)  # not JSON, or not an answer's
    except aiohttp.ClientError as error:
        outcome.kind, outcome.detail = CUT if headed else NO_ANSWER, repr(error)
    outcome.ended = time.monotonic()
    return outcome


async def read_whole(answer: aiohttp.ClientResponse, plan: Planned, outcome: Outcome) -> None:
    payload = await answer.json()
    outcome.ttft = time.monotonic() - outcome.started
    choice = payload["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    if text != plan.text:
        outcome.kind, outcome.detail = WRONG, f"{text!r}, not {plan.text!r}"


async def read_stream(answer: aiohttp.ClientResponse, plan: Planned, outcome: Outcome) -> None:
    """The SSE events to the end (a client that leaves early counts as gone in the proxy's
    metrics): the text, each character once and in order, no error event, and [DONE]. Its
    chunks are vLLM's where nothing failed; a stream that went on elsewhere may have others
    (a continuation gives again the text vLLM held back, in its own chunks)."""
    pieces: list[str] = []
    done, error = False, None
    async for line in answer.content:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: {"):  # not a blank line, not a keep-alive comment
            event = json.loads(line[6:])
            if "error" in event:
                error = error or str(event["error"].get("message"))
            elif piece := token_of(event):
                outcome.ttft = outcome.ttft or time.monotonic() - outcome.started
                outcome.tokens += 1
                pieces.append(piece)
    if error is not None:
        outcome.kind, outcome.detail = ERROR_EVENT, f"after {len(pieces)} tokens: {error}"
    elif not done:
        outcome.kind, outcome.detail = CUT, f"after {len(pieces)} tokens, no [DONE]"
    elif (text := "".join(pieces)) != plan.text:
        outcome.kind, outcome.detail = WRONG, f"{text!r}, not {plan.text!r}"


def token_of(event: dict[str, Any]) -> str:
    """A chunk's token ("" for a chat's role chunk or a usage chunk)."""
    if not (choices := event.get("choices")):
        return ""
    choice = choices[0]
    piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return piece or ""


class Load:
    """``concurrency`` clients, each sending the next request once its last one ended."""

    def __init__(self, session: aiohttp.ClientSession, base: str, seconds: float) -> None:
        self.session, self.base = session, base
        self.deadline = time.monotonic() + seconds
        self.numbers = iter(range(sys.maxsize))
        self.outcomes: list[Outcome] = []

    async def run(self, concurrency: int) -> None:
        await asyncio.gather(*(self.client() for _ in range(concurrency)))

    async def client(self) -> None:
        while time.monotonic() < self.deadline:
            plan = planned(next(self.numbers))
            self.outcomes.append(await send(self.session, self.base, plan))


# --- the faults


Pick = Callable[[set[Node], int], list[Node] | None]
Act = Callable[[list[Node]], Awaitable[None]]


class Claims:
    """The instances faults hold. A fault waits until what it picks among the free ones is
    there: that is how a prefill and a decode that serve always remain."""

    def __init__(self, nodes: list[Node]) -> None:
        self.free = set(nodes)
        self.changed = asyncio.Condition()

    async def take(self, pick: Callable[[set[Node]], list[Node] | None]) -> list[Node]:
        async with self.changed:
            while (nodes := pick(self.free)) is None:
                await self.changed.wait()
            self.free.difference_update(nodes)
            return nodes

    async def give_back(self, nodes: list[Node]) -> None:
        async with self.changed:
            self.free.update(nodes)
            self.changed.notify_all()


def spare(nodes: list[Node], free: set[Node], turn: int) -> list[Node] | None:
    """One of ``nodes`` in turn, if it is free and another of them stays free."""
    usable = [node for node in nodes if node in free]
    return [usable[turn % len(usable)]] if len(usable) >= 2 else None


@dataclass
class Window:
    kind: str
    start: float
    end: float = math.inf


class Chaos:
    """The fault schedule, each kind on its own timer, for ``seconds`` from now."""

    def __init__(self, cluster: Cluster, session: aiohttp.ClientSession, seconds: float) -> None:
        self.cluster, self.session = cluster, session
        self.started, self.seconds = time.monotonic(), seconds
        self.claims = Claims(cluster.nodes)
        self.applied: collections.Counter[str] = collections.Counter()
        self.windows: list[Window] = []
        self.in_flight_killed = 0  # requests running on the decodes when they were killed
        self.streams_cut = 0  # ... of them, streams cut after a token: a proxy continues them
        self.problems: list[str] = []  # faults that could not be applied as planned

    async def run(self) -> None:
        faults: dict[str, tuple[Pick, Act]] = {
            KILL: (self.a_decode, self.kill),
            PAUSE: (self.any_role, self.pause),
            PULLS: (self.a_decode, self.fail_pulls),
            RESTART: (self.a_prefill, self.restart),
            SLOW: (self.every_decode, self.slow_health),
        }
        await asyncio.gather(*(self.every(kind, *fault) for kind, fault in faults.items()))

    async def every(self, kind: str, pick: Pick, act: Act) -> None:
        at, period = SCHEDULE[kind]
        while at < self.seconds:
            await asyncio.sleep(self.started + at - time.monotonic())  # at once if late
            nodes = await self.claims.take(lambda free: pick(free, self.applied[kind]))
            try:
                if time.monotonic() < self.started + self.seconds:  # not after the load
                    await self.apply(kind, act, nodes)
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as problem:
                self.problems.append(f"{kind}: {problem!r}")  # the report says; the load goes on
            finally:
                await self.claims.give_back(nodes)
            at += period

    async def apply(self, kind: str, act: Act, nodes: list[Node]) -> None:
        self.applied[kind] += 1
        window = Window(kind, time.monotonic())
        self.windows.append(window)
        try:
            await act(nodes)
        finally:
            window.end = time.monotonic()

    # What each kind picks: Claims keeps one free prefill and decode, except for SLOW, whose
    # decodes all serve (only their checks are late: the proxy's panic is what is tested).

    def a_decode(self, free: set[Node], turn: int) -> list[Node] | None:
        return spare(self.cluster.decodes, free, turn)

    def a_prefill(self, free: set[Node], turn: int) -> list[Node] | None:
        return spare(self.cluster.prefills, free, turn)

    def any_role(self, free: set[Node], turn: int) -> list[Node] | None:
        role = self.cluster.prefills if turn % 2 else self.cluster.decodes
        return spare(role, free, turn // 2)

    def every_decode(self, free: set[Node], turn: int) -> list[Node] | None:
        decodes = self.cluster.decodes
        return decodes if free.issuperset(decodes) else None

    # What each kind does.

    async def kill(self, nodes: list[Node]) -> None:
        (node,) = nodes
        record = node.log.with_suffix(f".killed{self.applied[KILL]}.json")
        with contextlib.suppress(aiohttp.ClientError):  # it dies answering: the fake's SIGKILL
            async with self.session.post(node.url + "/_fake/die", json={"record": str(record)}):
                pass
        await node.stop(None)  # its own SIGKILL: waited for
        if not record.exists():
            raise RuntimeError(f"{node.url} did not say what ran as it was killed")
        running = json.loads(record.read_text())
        self.in_flight_killed += running["running"]
        self.streams_cut += running["streaming"]
        await asyncio.sleep(DOWN_SECONDS)
        await node.start()

    async def pause(self, nodes: list[Node]) -> None:
        (node,) = nodes
        node.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE_SECONDS)
        finally:
            node.send_signal(signal.SIGCONT)

    async def fail_pulls(self, nodes: list[Node]) -> None:
        (node,) = nodes
        await self.inject(node, fail_pulls=FAILED_PULLS)
        await asyncio.sleep(PULLS_HELD)
        await self.inject(node, fail_pulls=0)  # what was not used up: not in the next window

    async def restart(self, nodes: list[Node]) -> None:
        (node,) = nodes
        await node.stop(signal.SIGTERM)
        await node.start()

    async def slow_health(self, nodes: list[Node]) -> None:
        await asyncio.gather(*(self.inject(node, health_delay=SLOW_HEALTH) for node in nodes))
        await asyncio.sleep(SLOW_SECONDS)
        await asyncio.gather(*(self.inject(node, health_delay=0.0) for node in nodes))

    async def inject(self, node: Node, **fields: Any) -> None:
        async with self.session.post(node.url + "/_fake/inject", json=fields) as answer:
            answer.raise_for_status()


# --- one run: a target in front of a fresh cluster, the load and the schedule


@dataclass
class Run:
    target: str
    started: float  # the load's start, on the monotonic clock
    outcomes: list[Outcome]
    applied: collections.Counter[str]
    windows: list[Window]
    in_flight_killed: int
    streams_cut: int  # streams the kills cut after a token, before their last, as the fakes saw
    problems: list[str]
    metrics: dict[str, float] | None  # the proxy's counters, by row

    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.failed]

    def good(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if not outcome.failed]

    def write_timeline(self, path: Path) -> None:
        """The faults and the failures in the order they began, in seconds into the load:
        what to read when a failure needs explaining."""
        events = [(w.start, w.end, {"fault": w.kind}) for w in self.windows]
        events += [
            (o.started, o.ended, {"failure": o.kind, "detail": o.detail}) for o in self.failures()
        ]
        with path.open("w") as out:
            for start, end, what in sorted(events, key=lambda event: event[0]):
                span = {
                    "start": round(start - self.started, 3),
                    "end": round(end - self.started, 3),
                }
                out.write(json.dumps(span | what) + "\n")

    def causes(self) -> collections.Counter[str | None]:
        """Failures by the fault that caused them, as far as time tells: the latest fault
        begun before the failure ended and not over by more than AFTERMATH then (None: none
        was)."""
        causes: collections.Counter[str | None] = collections.Counter()
        for failure in self.failures():
            under = [w for w in self.windows if w.start <= failure.ended <= w.end + AFTERMATH]
            causes[max(under, key=lambda w: w.start).kind if under else None] += 1
        return causes


async def run_target(
    name: str, argv: Callable[[Cluster, int], list[str]], args: argparse.Namespace, logs: Path
) -> Run:
    (logs / name).mkdir()
    cluster = Cluster(logs / name)
    port = free_port()
    target: Target | None = None
    try:
        await cluster.start()
        target = await start_target(name, argv(cluster, port), port, logs / name / "target.log")
        run = await load_under_chaos(target, cluster, args)
        run.write_timeline(logs / name / "timeline.jsonl")
        return run
    finally:
        if target is not None:
            await target.stop()
        await cluster.kill()


async def load_under_chaos(target: Target, cluster: Cluster, args: argparse.Namespace) -> Run:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with (
        aiohttp.ClientSession(timeout=timeout) as clients,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as control,
    ):
        load = Load(clients, target.url, args.seconds)
        chaos = Chaos(cluster, control, args.seconds)
        await asyncio.gather(load.run(args.concurrency), chaos.run())
        metrics = await scrape(control, target.url) if target.scraped else None
    killed, cut, problems = chaos.in_flight_killed, chaos.streams_cut, chaos.problems
    return Run(
        target.name, chaos.started, load.outcomes, chaos.applied, chaos.windows, killed, cut,
        problems, metrics,
    )  # fmt: skip


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The proxy's retries, its streams gone on elsewhere and what came of them, its failed legs
    by stage and reason, and the mean of each phase of its streams' TTFT."""
    async with session.get(base + "/metrics") as answer:
        text = await answer.text()
    tried, moved = "proxy: legs tried again (retries_total)", "proxy: streams gone on elsewhere"
    rows: dict[str, float] = {tried: 0.0, moved: 0.0}
    phases: dict[tuple[str, str], float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mooncake_proxy_retries_total":
                rows[tried] += sample.value
            elif sample.name == "mooncake_proxy_migrations_total":
                rows[moved] += sample.value
            elif sample.name == "mooncake_proxy_migration_outcomes_total":
                what = f"proxy: cut streams {sample.labels['outcome']}"
                rows[what] = rows.get(what, 0.0) + sample.value
            elif sample.name.startswith("mooncake_proxy_request_phase_seconds_"):
                kind = sample.name.rsplit("_", 1)[1]  # sum, count
                if kind in ("sum", "count"):
                    phases[sample.labels["phase"], kind] += sample.value
            elif sample.name == "mooncake_proxy_errors_total" and sample.value:
                where = f"{sample.labels['stage']}, {sample.labels['reason']}"
                rows[f"proxy: failed legs ({where})"] = sample.value
    for phase in ("queue", "prefill", "handoff", "decode"):  # where the streams' TTFT went
        if count := phases[phase, "count"]:
            rows[f"proxy: TTFT phase {phase}, mean (ms)"] = 1000 * phases[phase, "sum"] / count
    return rows


# --- the report


def table(runs: list[Run]) -> str:
    rows = [("", [run.target for run in runs]), ("---", ["---" for _ in runs])]
    causes = [run.causes() for run in runs]
    for kind, (_, period) in SCHEDULE.items():
        cells = [
            f"{run.applied[kind]} / {cause[kind]}" for run, cause in zip(runs, causes, strict=True)
        ]
        rows.append((f"{kind}, every {period:g} s", cells))
    rows.append(("failures under no fault", [str(cause[None]) for cause in causes]))
    rows.append(("requests", [str(len(run.outcomes)) for run in runs]))
    rows.append(("client-visible failures", [str(len(run.failures())) for run in runs]))
    kinds = sorted({o.kind for run in runs for o in run.failures()})
    for kind in kinds:
        counts = [str(sum(o.kind == kind for o in run.failures())) for run in runs]
        rows.append((f"… {kind}", counts))
    mid = [str(sum(o.tokens > 0 for o in run.failures())) for run in runs]
    rows.append(("… of all failures, after their first token", mid))
    rows += metric_rows(runs)
    streamed = [[o.ttft for o in run.good() if o.ttft and o.tokens] for run in runs]
    rows.append(("TTFT p50 / p99 (ms), streams ok", [times(values) for values in streamed]))
    totals = [times([o.ended - o.started for o in run.good()]) for run in runs]
    rows.append(("total time p50 / p99 (ms), all ok", totals))
    return "\n".join(f"| {label} | {' | '.join(cells)} |" for label, cells in rows)


def metric_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    labels = sorted({label for run in runs for label in (run.metrics or {})})
    return [
        (label, [f"{run.metrics.get(label, 0):g}" if run.metrics else "-" for run in runs])
        for label in labels
    ]


def times(seconds: list[float]) -> str:
    return f"{1000 * percentile(seconds, 0.5):.0f} / {1000 * percentile(seconds, 0.99):.0f}"


def verdict(run: Run) -> str:
    """Against the target, counting every failure, mid-stream cuts included."""
    failures, total = run.failures(), len(run.outcomes)
    if not failures:
        return f"{run.target}: MET: 0 client-visible failures in {total} requests"
    mid = sum(o.tokens > 0 for o in failures)
    return (
        f"{run.target}: NOT MET: {len(failures)} client-visible failures in {total} requests: "
        f"{mid} after their first token and {len(failures) - mid} before it"
    )


def report(runs: list[Run], args: argparse.Namespace, logs: Path) -> None:
    print(
        f"\nbench_chaos: {args.seconds:g} s of load per target, {args.concurrency} clients, "
        f"{PREFILLS} prefills + {DECODES} decodes (fake_vllm.py --serve, "
        f"{TOKEN_DELAY * 1000:g} ms a token, 24-48 tokens)\n"
    )
    print(
        "A fault's row: times applied / client-visible failures it caused (those that ended "
        f"while it lasted or up to {AFTERMATH:g} s after, given to the latest fault begun).\n"
    )
    print(table(runs))
    for run in runs:
        print(
            f"\n{run.target}: {run.in_flight_killed} requests ran on the decodes as killed, "
            f"{run.streams_cut} of them streams cut after a token"
        )
        print(f"  its faults and failures in time: {logs / run.target / 'timeline.jsonl'}")
        for problem in run.problems:
            print(f"  a fault not applied as planned: {problem}")
        for kind, detail in examples(run).items():
            print(f"  e.g. {kind}: {detail[:300]}")
    for run in runs:
        if (check := outcomes_check(run)) is not None:
            print(check[1])
    print("\nverdict (target: 0 client-visible failures while one healthy pair remains):")
    for run in runs:
        print(f"  {verdict(run)}")


def outcomes_check(run: Run) -> tuple[bool, str] | None:
    """The proxy's count of its cut streams against the benchmark's own: every stream a kill
    cut after a token (the fakes counted them as they died) went on elsewhere or was not
    continued, by the proxy's metrics; every migration it began ended one way or the
    other; and the failures after a first token that the clients saw are those it did not
    continue, or whose continuation failed."""
    if run.metrics is None:
        return None
    rows = run.metrics
    outcome = {o: rows.get(f"proxy: cut streams {o}", 0.0) for o in MIGRATION_OUTCOMES}
    began = rows.get("proxy: streams gone on elsewhere", 0.0)
    cut = began + outcome["not_continued"]
    lost = outcome["not_continued"] + outcome["failed"]
    ended = outcome["continued"] + outcome["failed"] + outcome["client_gone"]
    mid = sum(o.tokens > 0 for o in run.failures())
    same = cut == run.streams_cut and began == ended and lost == mid
    return same, (
        f"\n{run.target}: cut streams, the proxy's metrics against the benchmark's count: "
        f"{'EQUAL' if same else 'DIFFERENT'}:\n"
        f"  streams the kills cut after a token: {run.streams_cut} by the fakes, "
        f"{cut:g} by the proxy ({began:g} migrations begun, {outcome['not_continued']:g} not "
        f"continued)\n"
        f"  migrations begun {began:g}, ended {ended:g} ({outcome['continued']:g} continued, "
        f"{outcome['failed']:g} failed, {outcome['client_gone']:g} client gone)\n"
        f"  failures after their first token: {mid} by the clients, {lost:g} by the proxy "
        "(not continued or failed)"
    )


def examples(run: Run) -> dict[str, str]:
    """The first failure of each kind: what it said."""
    first: dict[str, str] = {}
    for outcome in run.failures():
        first.setdefault(outcome.kind, outcome.detail)
    return first


# --- the command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="How many requests a client loses to faults.")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SECONDS:g} s of load")
    parser.add_argument("--seconds", type=float, help="seconds of load per target")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--no-router", action="store_true", help="the proxy alone")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 on any client-visible failure, or the proxy's counts differing from ours",
    )
    args = parser.parse_args(argv)
    args.seconds = args.seconds or (QUICK_SECONDS if args.quick else FULL_SECONDS)
    return args


async def run_all(args: argparse.Namespace, logs: Path) -> list[Run]:
    runs = [await run_target("proxy", proxy_argv, args, logs)]
    binary = None if args.no_router else router_binary()
    if binary is None:
        print("vllm-router: not installed (requirements-bench.txt), its column skipped")
        return runs

    def argv(cluster: Cluster, port: int) -> list[str]:
        return router_argv(cluster, port, binary)

    try:
        runs.append(await run_target("vllm-router", argv, args, logs))
    except RuntimeError as problem:  # it did not answer /health
        print(f"vllm-router: left out, it did not start: {problem}")
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logs = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    print(f"bench_chaos: {args.seconds:g} s of load per target; servers' logs in {logs}")
    runs = asyncio.run(run_all(args, logs))
    report(runs, args, logs)
    failed = any(run.failures() for run in runs)
    counted_apart = any(not check[0] for run in runs if (check := outcomes_check(run)))
    return 1 if args.strict and (failed or counted_apart) else 0


if __name__ == "__main__":
    sys.exit(main())
