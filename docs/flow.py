"""Write the walk of a streamed chat through mooncake_proxy.py into docs/flow.md (``make flow``).

The walk is every definition of the module that one streamed chat completion enters, in the
order it first enters each, from the moment the app's middleware is entered until the client
has read the last byte (``data: [DONE]``) and the handler has returned: the proxy in this
process, served as the daemon serves it, in front of one prefill and one decode fake on
loopback. A first chat goes through before it (warm-up: one-time set-up is not the request's
path). ``python docs/flow.py --check`` exits 1 with a diff when the page's section differs;
tests/test_module_shape.py checks the same and that the walk goes back up the file at most 15 times.

How it is made, so that it is the same on every run:

- ``sys.setprofile`` (and ``threading.setprofile``) sees every Python function, coroutine and
  callback the module's code objects start; a definition is recorded the first time it is
  entered, named by its ``co_qualname`` (``Class.method``). Nested functions, lambdas and
  comprehensions are folded into the definition that holds them (named and lined by it), and
  lined by the line of its ``def`` or ``class``, not of its decorators.
- Code the proxy runs on its own is left out: every task started while the app starts (its
  background loops) and every task those start; the loops' intervals are long as well.
- The fakes take their turns one by one: the decode's head, then the prefill's answer (it
  waits ``PREFILL_DELAY``), then the decode's tokens (it pulls the KV ``TRANSFER_DELAY``
  after it is there), each token apart (``TOKEN_DELAY``).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import difflib
import importlib
import itertools
import logging
import re
import sys
import textwrap
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Final

from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.typedefs import Handler, Middleware
from yarl import URL

MODULE: Final = "mooncake_proxy"
# How many times the walk may go back up the file (issue #49).
LIMIT: Final = 15
# The fakes' timing, which orders their events (see the docstring).
PREFILL_DELAY: Final = 0.1
TRANSFER_DELAY: Final = 0.1
TOKEN_DELAY: Final = 0.005
WITHIN: Final = 30.0  # seconds the walked chat may take at most (it takes well under one)
# So long that no health check, discovery or scrape runs during the walk.
IDLE: Final = 3600.0
CHAT_PATH: Final = "/v1/chat/completions"
CHAT: Final = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "Tell me about KV caches"}],
    "max_tokens": 8,
    "stream": True,
}
BEGIN: Final = "<!-- walk: begin (docs/flow.py writes this section: make flow) -->"
END: Final = "<!-- walk: end -->"
UP: Final = "↑"
WIDTH: Final = 100  # the docs' line length


def root_of(start: Path) -> Path:
    """The directory that holds the module: this file's, or the nearest one above it."""
    for directory in start.resolve().parents:
        if (directory / f"{MODULE}.py").is_file():
            return directory
    raise SystemExit(f"flow.py: no {MODULE}.py in any directory above {start}")


ROOT: Final = root_of(Path(__file__))
PAGE: Final = ROOT / "docs" / "flow.md"


def importable(*names: str) -> None:
    """Put the directories holding these modules (the root, or a folder of it such as
    tests/) on sys.path."""
    folders = [ROOT, *sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name[0] not in "._")]
    for name in names:
        folder = next((f for f in folders if (f / f"{name}.py").is_file()), None)
        if folder is None:
            raise SystemExit(f"flow.py: {name}.py is neither in {ROOT} nor in a folder of it")
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


importable(MODULE, "fake_vllm", "testing_support")
import mooncake_proxy as mp  # noqa: E402  (found above; the helpers may live in tests/)

SOURCE: Final = Path(mp.__file__).resolve()
fake_vllm = importlib.import_module("fake_vllm")
testing_support = importlib.import_module("testing_support")


# --- the module's definitions, as a reader finds them


@dataclass(frozen=True)
class Stop:
    """A definition the walk enters: its qualified name, the line of its def or class, and
    that of the top-level definition that holds it (a method's class)."""

    name: str
    line: int
    top: int


@dataclass(frozen=True)
class Definition:
    name: str
    line: int  # of the def or class
    first: int  # of its first decorator, or the def
    last: int


def definitions(source: str) -> dict[str, list[Definition]]:
    """Every function and class the module or a class defines (under if, try or with too),
    by qualified name; not those nested in functions, which fold into theirs."""
    found: dict[str, list[Definition]] = {}

    def visit(body: Sequence[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + node.name
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                end = node.end_lineno or node.lineno
                found.setdefault(name, []).append(Definition(name, node.lineno, first, end))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, name + ".")
            else:  # if, try, with, ...: what they hold is defined where they are
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []), prefix)
                for part in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
                    visit(part.body, prefix)

    visit(ast.parse(source).body, "")
    return found


def folded(qualname: str) -> str:
    """``Class.method`` as it is; ``f.<locals>.g``, ``f.<lambda>``, ``C.m.<locals>.<listcomp>``
    as the definition that holds them (``f``, ``C.m``); "" for the module's own code."""
    parts = qualname.split(".")
    cut = next((i for i, part in enumerate(parts) if part.startswith("<")), len(parts))
    return ".".join(parts[:cut])


class Index:
    """Which definition a code object of the module belongs to."""

    def __init__(self, source: str) -> None:
        self.definitions = definitions(source)
        self.stops: dict[CodeType, Stop | None] = {}

    def stop(self, code: CodeType) -> Stop | None:
        if code not in self.stops:
            self.stops[code] = self.find(code)
        return self.stops[code]

    def find(self, code: CodeType) -> Stop | None:
        name = folded(code.co_qualname)
        if not name:
            return None
        line = code.co_firstlineno  # a decorated def's: its first decorator's line
        holding = [d for d in self.definitions.get(name, ()) if d.first <= line <= d.last]
        outer = name.split(".")[0]
        tops = [d for d in self.definitions.get(outer, ()) if d.first <= line <= d.last]
        at = holding[0].line if holding else line
        return Stop(name, at, tops[0].line if tops else at)


# --- the walk


@dataclass
class Tracer:
    """Records the module's definitions as they are first entered, while ``recording``, in
    any thread, on the loop in any task but the app's own (``background``)."""

    index: Index
    source: Path
    ours: dict[str, bool] = field(default_factory=dict)  # co_filename -> it is the module
    stops: list[Stop] = field(default_factory=list)
    seen: set[Stop] = field(default_factory=set)
    recording: bool = False
    starting: bool = False  # tasks started now are the app's own
    background: weakref.WeakSet[asyncio.Task[Any]] = field(default_factory=weakref.WeakSet)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event != "call" or not self.recording or not self.is_ours(code.co_filename):
            return
        if (stop := self.index.stop(code)) is None or stop in self.seen:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:  # a thread without a loop
            task = None
        if task is not None and task in self.background:
            return
        self.seen.add(stop)
        self.stops.append(stop)

    def is_ours(self, filename: str) -> bool:
        if (ours := self.ours.get(filename)) is None:
            ours = self.ours[filename] = Path(filename).resolve() == self.source
        return ours

    def task_factory(self, old: Any) -> Callable[..., asyncio.Task[Any]]:
        """``old``, or asyncio's own, noting which tasks are the app's."""

        def create(
            loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
        ) -> asyncio.Task[Any]:
            parent = asyncio.current_task(loop)
            task = old(loop, coro, **kwargs) if old else asyncio.Task(coro, loop=loop, **kwargs)
            if self.starting or (parent is not None and parent in self.background):
                self.background.add(task)
            return task

        return create

    @contextlib.contextmanager
    def watching_tasks(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        old = loop.get_task_factory()
        loop.set_task_factory(self.task_factory(old))
        try:
            yield
        finally:
            loop.set_task_factory(old)

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        old, old_threads = sys.getprofile(), threading.getprofile()
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(old)
            threading.setprofile(old_threads)


class Servers:
    """What pytest-aiohttp's aiohttp_server and aiohttp_client fixtures make, closed at the
    end: testing_support's helpers take them."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack

    async def server(self, app: web.Application, *, port: int | None = None, **kw: Any) -> Any:
        server = TestServer(app, port=port)
        await server.start_server(**kw)
        self.stack.push_async_callback(server.close)
        return server

    async def client(self, server: TestServer) -> Any:
        client: TestClient[web.Request, web.Application] = TestClient(server)
        await client.start_server()
        self.stack.push_async_callback(client.close)
        return client


@contextlib.asynccontextmanager
async def proxy(tracer: Tracer, marker: Middleware) -> AsyncIterator[URL]:
    """The proxy, served as the daemon serves it, in front of a prefill and a decode fake;
    ``marker`` its outermost middleware. Yields its URL once both fakes are usable."""
    async with contextlib.AsyncExitStack() as stack:
        # The access log on, as the daemon's default --log-level info has it, wherever this
        # runs (under pytest, whose log capture turns it on too, or on its own).
        access = mp.access_log
        stack.callback(access.setLevel, access.level)
        access.setLevel(logging.INFO)
        servers = Servers(stack)
        serve = testing_support.serve
        prefill = fake_vllm.FakeVllm("prefill", delay=PREFILL_DELAY)
        api = await serve(servers.server, prefill.api_app())
        bootstrap = await serve(servers.server, prefill.bootstrap_app())
        prefill.api_url = f"http://127.0.0.1:{api.port}"
        decode = fake_vllm.FakeVllm(
            "decode",
            kv_timeout=testing_support.KV_TIMEOUT,
            transfer_delay=TRANSFER_DELAY,
            token_delay=TOKEN_DELAY,
        )
        decode_api = await serve(servers.server, decode.api_app())
        config = mp.ProxyConfig(
            prefills=(
                mp.PrefillSpec(URL(prefill.api_url), URL(f"http://127.0.0.1:{bootstrap.port}")),
            ),
            decodes=(URL(f"http://127.0.0.1:{decode_api.port}"),),
            health_interval=IDLE,
            discovery_interval=IDLE,
            load_interval=IDLE,
            dns_interval=IDLE,
        )
        app = mp.create_app(config)
        app.middlewares.insert(0, marker)
        tracer.starting = True
        client = await servers.client(testing_support.DaemonTestServer(app))
        tracer.starting = False
        await testing_support.wait_ready_(client)
        yield client.make_url("")


async def chat(session: ClientSession, base: URL) -> bytes:
    async with session.post(base.join(URL(CHAT_PATH)), json=CHAT) as response:
        body = await response.read()
    if response.status != 200 or not body.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"the chat failed: {response.status} {body[-200:]!r}")
    return body


async def walk() -> list[Stop]:
    """The walk of one streamed chat, after a warm-up chat (see the docstring)."""
    tracer = Tracer(Index(SOURCE.read_text()), SOURCE)
    armed = asyncio.Event()
    returned = asyncio.Event()

    @web.middleware
    async def marker(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not armed.is_set():
            return await handler(request)
        armed.clear()
        tracer.recording = True
        try:
            return await handler(request)
        finally:
            returned.set()

    with tracer.watching_tasks():
        async with proxy(tracer, marker) as base, ClientSession() as session:
            await chat(session, base)
            async with asyncio.timeout(WITHIN):
                with tracer.profiling():
                    armed.set()
                    await chat(session, base)
                    await returned.wait()
                    tracer.recording = False
    return tracer.stops


# --- the page


def back_jumps(stops: Sequence[Stop]) -> list[int]:
    """The positions in the walk that go back up the file: where it first enters a top-level
    definition (a function, or a class by any of its methods) that begins above the last one
    it first entered. A class is read as one: from one of its methods to another, or back to
    one already read, is not a jump."""
    firsts: list[int] = []
    read: set[int] = set()
    for i, stop in enumerate(stops):
        if stop.top not in read:
            read.add(stop.top)
            firsts.append(i)
    return [b for a, b in itertools.pairwise(firsts) if stops[b].top < stops[a].top]


def wrapped(paragraph: str) -> list[str]:
    """The paragraph's lines, no code span cut in two."""
    glued = re.sub(r"`[^`]*`", lambda span: span[0].replace(" ", "\0"), paragraph)
    lines = textwrap.wrap(glued, WIDTH, break_on_hyphens=False, break_long_words=False)
    return [line.replace("\0", " ") for line in lines]


def section(stops: Sequence[Stop]) -> str:
    up = set(back_jumps(stops))
    what = (
        f"Every definition of `{MODULE}.py` that one streamed chat completion "
        f"(`POST {CHAT_PATH}`, `stream: true`, `max_tokens` {CHAT['max_tokens']}, one prefill "
        "and one decode) enters, in the order it first enters each, from the middleware until "
        "the client has read `data: [DONE]` and the handler has returned; each with the line "
        "of its `def` or `class`. Methods are `Class.method`; nested functions, lambdas and "
        "comprehensions are counted as the definition that holds them. Code the proxy runs on "
        "its own (health checks, scrapes) is left out, and a warm-up chat goes first. The "
        "walk goes back up the file where it first enters a top-level definition (a function, "
        "or a class by any of its methods) that begins above the last one it first entered: a "
        "class is read as one."
    )
    checked = (
        "`make flow` writes this list (docs/flow.py, whose docstring says how); "
        "tests/test_module_shape.py fails when it is stale (`python docs/flow.py --check` too) and "
        f"when the walk goes back up the file more than {LIMIT} times. Now: {len(stops)} "
        f"stops, {len(up)} of them back up the file ({UP}); the limit is {LIMIT}."
    )
    lines = [BEGIN, "", "## The walk of a streamed chat", ""]
    for paragraph in (what, checked):
        lines += [*wrapped(paragraph), ""]
    width = len(str(len(stops)))
    for number, stop in enumerate(stops, 1):
        mark = f" {UP}" if number - 1 in up else ""
        lines.append(f"{number:>{width}}. `{stop.name}` {stop.line}{mark}")
    return "\n".join([*lines, "", END, ""])


def page(stops: Sequence[Stop], written: str) -> str:
    """The page ``written`` with its walk section replaced (or added at its end)."""
    if BEGIN in written and END in written:
        before, rest = written.split(BEGIN, 1)
        after = rest.split(END, 1)[1].lstrip("\n")
        return before + section(stops) + (("\n" + after) if after else "")
    return written.rstrip("\n") + "\n\n" + section(stops)


def diff(written: str, wanted: str) -> str:
    return "".join(
        difflib.unified_diff(
            written.splitlines(keepends=True),
            wanted.splitlines(keepends=True),
            "docs/flow.md (written)",
            "docs/flow.md (the walk)",
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/flow.md is stale")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop

        stops = uvloop.run(walk())
    else:
        stops = asyncio.run(walk())
    written = PAGE.read_text()
    wanted = page(stops, written)
    print(f"{len(stops)} stops, {len(back_jumps(stops))} back up the file (limit {LIMIT})")
    if args.check:
        if wanted != written:
            print(diff(written, wanted), end="")
            print("docs/flow.md is stale: run make flow", file=sys.stderr)
            return 1
        return 0
    if wanted != written:
        PAGE.write_text(wanted)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
