"""The proxy's time in CPython's cyclic garbage collector, per request, under the benchmark's load.

    python bench/research/request-floor/gc_time.py                    # this tree's daemon
    python bench/research/request-floor/gc_time.py --baseline 21b8126 # and that commit's, in turn

Starts the benchmark's fake cluster and the proxy as bench_mooncake_proxy.py does, but through
a small wrapper that times each collection (gc.callbacks) and writes the totals when the proxy
exits; runs the 32-concurrent load (non-streamed, then streamed) against each build in turn,
``--rounds`` times, and prints the collections and the milliseconds they took, per 1,000
requests served. Startup's collections are counted too (a few, under a millisecond).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import bench_mooncake_proxy as bench  # noqa: E402
from fake_vllm import free_port  # noqa: E402

WRAPPER = """
import atexit, gc, json, sys, time
sys.path.insert(0, {source!r})
import mooncake_proxy
totals = {{"collections": [0, 0, 0], "seconds": [0.0, 0.0, 0.0]}}
began = [0.0]
def timed(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
        return
    totals["collections"][info["generation"]] += 1
    totals["seconds"][info["generation"]] += time.perf_counter() - began[0]
gc.callbacks.append(timed)
atexit.register(lambda: open({out!r}, "w").write(json.dumps(totals)))
sys.exit(mooncake_proxy.main())
"""


def measure(runner: bench.Bench, source: Path, stream: bool, seconds: float) -> dict[str, float]:
    """One proxy of ``source``'s, one load against it, its collections per 1,000 requests."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    wrapper = Path(tempfile.mkstemp(suffix=".py")[1])
    wrapper.write_text(WRAPPER.format(source=str(source), out=str(out)))
    port = free_port()
    argv = [sys.executable, str(wrapper), "--port", str(port), "--log-level", "WARNING"]
    argv += ["--prefill", runner.prefill_url, str(runner.bootstrap_port)]
    argv += ["--decode", runner.decode_url]
    process = runner.spawn(argv)
    target = bench.Target(str(source), f"http://127.0.0.1:{port}", process.pid, process)
    bench.wait_http(target.url + "/health")
    result = runner.run_load(target, "gc", 32, stream, seconds)
    runner.stop(target)
    totals = json.loads(out.read_text())
    per = 1000 / result.requests
    return {
        "collections": sum(totals["collections"]) * per,
        "oldest": totals["collections"][2] * per,
        "ms": sum(totals["seconds"]) * 1000 * per,
        "cpu_ms": result.cpu_ms_per_request or 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", metavar="REV", help="also this commit's proxy, in turn")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    builds = {"this tree": bench.module_at(None)}
    if args.baseline:
        builds[args.baseline] = bench.module_at(args.baseline)
    runner = bench.Bench(argparse.Namespace())
    rows: list[tuple[str, bool, dict[str, float]]] = []
    try:
        runner.start_cluster()
        for _ in range(args.rounds):
            for stream in (False, True):
                for name, source in builds.items():
                    rows.append((name, stream, measure(runner, source, stream, args.seconds)))
    finally:
        runner.close()
    print("\nPer 1,000 requests at 32 concurrent (each row one proxy, one load):\n")
    print("| build | answers | GC collections | of them full | GC ms | CPU ms per request |")
    print("|---|---|---|---|---|---|")
    for name, stream, figures in rows:
        kind = "streamed" if stream else "non-streamed"
        print(
            f"| {name} | {kind} | {figures['collections']:.1f} | {figures['oldest']:.2f} "
            f"| {figures['ms']:.1f} | {figures['cpu_ms']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
