"""What a full garbage collection costs the proxy, idle and with streams in flight: the price
of LargeGarbage's collection after a large request.

The proxy runs in this process (create_app, served as the daemon serves it, gc.freeze'd as
the daemon does once it serves: tune_gc); the fake prefill and decode (fake_vllm.py --serve)
and the clients run in processes of their own, so the collector walks the proxy's objects
only::

    python bench/research/refused-prompts/gc_cost.py --streams 200 1000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from yarl import URL

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import mooncake_proxy as mp  # noqa: E402
from fake_vllm import free_port  # noqa: E402
from testing_support import DaemonTestServer  # noqa: E402

# The clients: ``count`` streams of 100 tokens at once (the decode sends one every 50 ms).
CLIENTS = """
import asyncio, sys, aiohttp
async def main(base, count):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i):
            body = {"model": "fake-model", "max_tokens": 100, "stream": True,
                    "messages": [{"role": "user", "content": f"question {i} " * 100}]}
            async with session.post(base + "/v1/chat/completions", json=body) as answer:
                await answer.read()
        await asyncio.gather(*(one(i) for i in range(count)))
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def start(*argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, *argv, cwd=str(ROOT))


async def measure(counts: list[int]) -> None:
    api, bootstrap, decode_port = free_port(), free_port(), free_port()
    fakes = [
        await start("tests/fake_vllm.py", "--serve", "prefill", "--port", str(api),
                    "--bootstrap-port", str(bootstrap)),
        await start("tests/fake_vllm.py", "--serve", "decode", "--port", str(decode_port),
                    "--token-delay", "0.05"),
    ]  # fmt: skip
    spec = mp.PrefillSpec(URL(f"http://127.0.0.1:{api}"), URL(f"http://127.0.0.1:{bootstrap}"))
    config = mp.ProxyConfig(prefills=(spec,), decodes=(URL(f"http://127.0.0.1:{decode_port}"),))
    server = DaemonTestServer(mp.create_app(config))
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(30):
            while True:
                try:
                    async with session.get(f"{base}/health") as ready:
                        if ready.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        mp.tune_gc()
        for count in [0, *counts]:
            clients = await start("-c", CLIENTS, base, str(count)) if count else None
            await asyncio.sleep(2.0)  # every stream under way (100 tokens take 5 s)
            times = []
            for _ in range(5):
                started = time.perf_counter()
                gc.collect()
                times.append(time.perf_counter() - started)
                await asyncio.sleep(0.2)
            median, most = statistics.median(times) * 1e3, max(times) * 1e3
            print(
                f"{count:5} streams in flight: gc.collect() median {median:6.2f} ms, "
                f"max {most:6.2f} ms ({len(gc.get_objects())} objects tracked)"
            )
            if clients is not None:
                await clients.wait()
    finally:
        await server.close()
        for fake in fakes:
            fake.terminate()
            await fake.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[200])
    asyncio.run(measure(parser.parse_args().streams))


if __name__ == "__main__":
    main()
