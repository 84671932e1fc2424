"""What the proxy's own steps cost per request, each timed alone, against the time left for them.

    python bench/research/request-floor/prices.py              # the price list
    python bench/research/request-floor/prices.py --budget-us 10 # and a verdict against a budget

bench_mooncake_proxy.py measures the proxy whole: CPU per request, against vllm-router and
against the protocol-legs yardstick (aiohttp's server and both legs on asyncio protocols,
nothing else: this design's floor). What lies between the proxy and that floor is the proxy's
own work, a little at a time, with no single cost to take away (a profile shows no function
above a few percent). This prices each step the proxy takes for one non-streamed request
that the floor does not, on the live objects: the proxy's app runs in this process against
the benchmark's fake cluster (on loopback), and each step is timed with timeit, the least of
rounds. It takes what the fakes and the loop cost out of the figures, so the steps' sum is a
lower bound of what the proxy adds: the frames and objects joining them are not counted.

``--budget-us``: CPU per request the steps may add, say the lean router's figure less the
floor's from one bench_mooncake_proxy.py run; the verdict says whether the steps fit in it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
import timeit
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from aiohttp import web  # noqa: E402

import bench_mooncake_proxy as bench  # noqa: E402
import mooncake_proxy as mp  # noqa: E402
from fake_vllm import free_port  # noqa: E402

BODY: dict[str, Any] = {"model": "bench", "prompt": bench.PROMPT, "max_tokens": bench.TOKENS}
RAW_BODY = mp.encode_json(BODY)
CLIENT_HEADERS = {"Host": "proxy", "Content-Type": "application/json", "Accept": "*/*"}


async def serve(app: web.Application, port: int, runner: web.AppRunner | None = None) -> None:
    runner = runner or web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()


async def proxy_state() -> mp.ProxyState:
    """The proxy's app in this process, in front of the benchmark's fakes, once it is ready."""
    prefill, decode, port = free_port(), free_port(), free_port()
    await serve(bench.fake_app("prefill"), prefill)
    await serve(bench.fake_app("decode"), decode)
    argv = ["--prefill", f"http://127.0.0.1:{prefill}", str(prefill)]
    argv += ["--decode", f"http://127.0.0.1:{decode}", "--log-level", "WARNING"]
    app = mp.create_app(mp.load_config(mp.build_parser(), argv, {}))
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", port))
    await mp.listen(runner, sock)
    state = app[mp.STATE_KEY]
    async with asyncio.timeout(10):
        while not state.fleet.ready or not state.fleet.known_models():
            await asyncio.sleep(0.05)
    return state


def steps(state: mp.ProxyState, loop: asyncio.AbstractEventLoop) -> dict[str, Callable[..., Any]]:
    """Each step, as the request path takes it (functions of mooncake_proxy, called alike)."""
    fleet, config, metrics = state.fleet, state.config, state.metrics
    key = mp.route_key("/v1/completions", BODY, None, config.prefix_block_bytes)
    engine = fleet.claim_prefill((), key, "bench")
    fleet.release_prefill(engine)
    stats = mp.RequestStats("POST", "/v1/completions", "/v1/completions", model="bench")
    stats.model_label = "bench"

    def ids_and_headers() -> bytes:
        request_id = mp.mint_request_id(None)
        headers = mp.upstream_headers(CLIENT_HEADERS, request_id, config)
        return mp.header_lines(headers)

    def routing() -> None:
        route = mp.route_key("/v1/completions", BODY, None, config.prefix_block_bytes)
        fleet.serving("bench")
        engine = fleet.claim_prefill((), route, "bench")
        decode = fleet.claim_decode((), route, "bench")
        fleet.release_prefill(engine)
        fleet.release_decode(decode)

    def leg_bodies() -> tuple[bytes, bytes]:
        transfer_id = mp.transfer_id_for("cmpl-x")
        prefill = mp.prefill_body(BODY, transfer_id, mp.COMPLETIONS_API)
        decode = mp.decode_body(BODY, engine, transfer_id)
        return mp.encode_json(prefill), mp.encode_json(decode)

    def floors_leg_bodies() -> tuple[bytes, bytes]:
        prefill, decode = bench.leg_bodies(BODY, "http://127.0.0.1:1", "bench-engine_dp0")
        return json.dumps(prefill).encode(), json.dumps(decode).encode()

    def accounting() -> None:
        stats.first_byte = stats.first_token = stats.started
        mp.record_request(metrics, stats, 200)
        metrics.prefill_duration.observe(0.001)

    async def deadlines() -> None:
        # --prefill-timeout's (asyncio.timeout) and the next request head's (--header-timeout)
        async with asyncio.timeout(config.prefill_timeout):  # noqa: ASYNC100 (its price only)
            pass
        loop.call_later(config.header_timeout, never).cancel()

    async def prefill_task() -> None:
        task = loop.create_task(nothing())
        task.add_done_callback(noop)
        await task  # the loop's rounds for it, less the direct await's (AsyncStep)

    return {
        "request id, trace context, the legs' headers": ids_and_headers,
        "routing: key, both stages claimed and released": routing,
        "the legs' bodies, as the proxy makes them": leg_bodies,
        "  (the floor's own, for comparison)": floors_leg_bodies,
        "accounting: the request's metrics": accounting,
        "deadlines: the prefill's, the next head's": AsyncStep(loop, deadlines),
        "the prefill leg as a task beside the decode": AsyncStep(loop, prefill_task),
    }


class AsyncStep:
    """A step that awaits, timed inside the running loop: each call of it runs ``number``
    steps in one coroutine, less as many direct awaits of a coroutine that does nothing."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, step: Callable[[], Awaitable[None]]
    ) -> None:
        self.loop, self.step = loop, step

    def __call__(self, number: int) -> float:
        return self.loop.run_until_complete(self.timed(number))

    async def timed(self, number: int) -> float:
        started = time.perf_counter()
        for _ in range(number):
            await self.step()
        middle = time.perf_counter()
        for _ in range(number):
            await nothing()
        return (middle - started) - (time.perf_counter() - middle)


async def nothing() -> None:
    return None


def noop(_: object) -> None:
    return None


def never() -> None:
    return None


def price(step: Callable[..., Any], rounds: int, number: int) -> float:
    """Microseconds per call: the least of ``rounds`` timeit runs of ``number`` calls (on a
    shared machine noise only adds, as timeit's documentation says)."""
    if isinstance(step, AsyncStep):
        runs = [step(number) for _ in range(rounds)]
    else:
        runs = timeit.repeat(step, repeat=rounds, number=number)
    return min(runs) / number * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9, help="timeit runs per step (the least)")
    parser.add_argument("--number", type=int, default=5000, help="calls per timeit run")
    parser.add_argument("--budget-us", type=float, help="CPU per request the steps may add")
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    with contextlib.suppress(ImportError):
        import uvloop

        loop = uvloop.new_event_loop()  # the proxy's default loop
    asyncio.set_event_loop(loop)
    state = loop.run_until_complete(proxy_state())
    rows = [
        (name, price(step, args.rounds, args.number)) for name, step in steps(state, loop).items()
    ]
    print(f"Steps of one non-streamed request the floor does not take, the least of {args.rounds}")
    print(f"runs of {args.number} calls each:\n")
    print("| step | us per request |\n|---|---|")
    for name, cost in rows:
        print(f"| {name.strip()} | {cost:.2f} |")
    total = sum(cost for name, cost in rows if not name.startswith(" "))
    floor_bodies = next(cost for name, cost in rows if name.startswith(" "))
    extra = total - floor_bodies  # the floor makes leg bodies too
    print(f"\nTheir sum: {total:.1f} us; less the bodies the floor makes too: {extra:.1f} us.")
    if args.budget_us is not None:
        fits = "fit in" if extra <= args.budget_us else "do not fit in"
        print(f"Verdict: the steps alone {fits} a budget of {args.budget_us:.1f} us per request.")
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
