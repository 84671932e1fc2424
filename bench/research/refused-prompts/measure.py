"""What a refused large prompt leaves in the proxy: its RSS and its prefix index.

Starts a fake prefill and decode here (both refuse prompts past their max_model_len, as vLLM
does, with a 400) and the proxy as a process of its own (``python mooncake_proxy.py``), sends
a few small requests, then ``--count`` prompts of ``--mib`` MiB each (every one refused, unless
``--max-model-len`` says otherwise), each followed by ``--pause`` seconds, then ``--after``
small requests, and prints the proxy's RSS (VmRSS) and the blocks its routing indexes hold
(/healthcheck) at each step::

    python bench/research/refused-prompts/measure.py --policy round_robin
    python bench/research/refused-prompts/measure.py --policy prefix_aware

``--revision REV`` measures the module as it was at a git revision instead of the working
tree's (to compare before and after a change).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

from fake_vllm import FakeVllm, free_port  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def index_blocks(session: aiohttp.ClientSession, base: str) -> int:
    async with session.get(f"{base}/healthcheck") as answer:
        status: dict[str, Any] = await answer.json()
    blocks: int = sum(d.get("index_blocks", 0) for d in status["decode"])
    for prefill in status["prefill"]:
        blocks += sum(e.get("index_blocks", 0) for e in prefill["engines"])
    return blocks


async def post(session: aiohttp.ClientSession, base: str, prompt: str) -> int:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 4}
    async with session.post(f"{base}/v1/completions", json=body) as answer:
        await answer.read()
        return answer.status


async def serve_fake(fake: FakeVllm, app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def module_of(revision: str | None, into: Path) -> Path:
    if revision is None:
        return ROOT / "mooncake_proxy.py"
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:mooncake_proxy.py"],
        check=True,
        capture_output=True,
    ).stdout
    path = into / "mooncake_proxy.py"
    path.write_bytes(source)
    return path


async def measure(args: argparse.Namespace) -> None:
    fakes = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    prefill, decode = FakeVllm("prefill", **fakes), FakeVllm("decode", **fakes)
    api, bootstrap, decode_port = free_port(), free_port(), free_port()
    prefill.api_url = f"http://127.0.0.1:{api}"
    runners = [
        await serve_fake(prefill, prefill.api_app(), api),
        await serve_fake(prefill, prefill.bootstrap_app(), bootstrap),
        await serve_fake(decode, decode.api_app(), decode_port),
    ]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as scratch:
        module = module_of(args.revision, Path(scratch))
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(module), "--port", str(port), "--log-level", "warning",
            "--prefill", prefill.api_url, str(bootstrap),
            "--decode", f"http://127.0.0.1:{decode_port}", "--policy", args.policy,
            "--workers", "1", cwd=str(ROOT),
        )  # fmt: skip
        try:
            async with aiohttp.ClientSession() as session:
                async with asyncio.timeout(20):
                    while True:
                        with contextlib.suppress(aiohttp.ClientError):
                            async with session.get(f"{base}/health") as ready:
                                if ready.status == 200:
                                    break
                        await asyncio.sleep(0.1)
                for i in range(20):
                    assert await post(session, base, f"warm {i}") == 200

                def line(what: str, blocks: int) -> None:
                    print(f"{what:<40} RSS {rss_mib(process.pid):8.1f} MiB   blocks {blocks:>7}")

                line("after 20 small requests", await index_blocks(session, base))
                big = "x" * (args.mib << 20)
                for i in range(args.count):
                    started = time.monotonic()
                    status = await post(session, base, big)
                    took = time.monotonic() - started
                    await asyncio.sleep(args.pause)
                    blocks = await index_blocks(session, base)
                    line(f"large prompt {i + 1}: {status} in {took:.1f} s", blocks)
                del big
                for i in range(args.after):
                    await post(session, base, f"after {i}")
                await asyncio.sleep(1)
                line(f"after {args.after} more small requests", await index_blocks(session, base))
        finally:
            process.terminate()
            await process.wait()
            for runner in runners:
                await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="prefix_aware")
    parser.add_argument("--mib", type=int, default=50)
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--after", type=int, default=300)
    parser.add_argument("--revision")
    parser.add_argument(
        "--pause", type=float, default=3.0, help="seconds after each large prompt, then its RSS"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="the fakes' (tokens of 4 bytes); past the prompts' length, they are accepted",
    )
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
