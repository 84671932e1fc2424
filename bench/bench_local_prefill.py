"""Disaggregate only when it pays: always-PD against --max-local-prefill-tokens, on real vLLM
or on a simulated pair.

One prefill and one decode (vLLM 0.32 on the CPU, the integration suite's tiny model, real
Mooncake over TCP; or, with ``--simulated``, two fake vLLM servers whose costs are set below),
and two proxies in front of the same pair: one with
``--max-local-prefill-tokens 0`` (every request through PD, as before) and one with the limit
under test. A mixed workload, the same for both, at each concurrency:

- short chats: one turn of ~16 tokens;
- conversations: three turns, the first ~200 tokens, each next one a short question after the
  answer (turn N+1 finds turns 1..N on the decode that answered them);
- long documents: ~400 tokens.

Every request streams 24 tokens. The two proxies take turns, round by round, so that drift of
this shared machine falls on both. Reported per setting and concurrency: time to the first
token (p50, p99) by kind, inter-token latency (p50, p99) over every stream (what computing
prompts on the decode costs its running streams), the prompt tokens each server computed (the
prefill's and the decode's own, from their /metrics), and errors.

Needs the real-vLLM environment that ``make integration`` builds (VLLM_ENV_ROOT, default
~/.cache/mooncake-proxy/real-vllm). ``python bench/bench_local_prefill.py`` (about ten
minutes); ``--quick`` runs one round at concurrency 1.

``--simulated`` needs nothing but the fakes (tests/fake_vllm.py, each a process): a prefill
that computes a prompt's uncached tokens at ``--token-time`` seconds each, a decode that
computes a prompt sent to it alone at the same rate (its running streams paused meanwhile, as
a vLLM step carrying a prompt delays every token in it), waits ``--handoff`` seconds before
each KV pull (the PD handoff) and streams a token every ``--itl`` seconds. Its defaults stand
for a GPU: 0.1 ms a prompt token, 50 ms of handoff (vLLM issue 51919 measures ~200 ms p50
from the prefill's token to the client's first, 29 ms of it the transfer), 5 ms a token.
What it shows is the trade's shape at those costs, not a GPU's figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import itertools
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration"))
from real_vllm import (  # type: ignore[import-not-found]  # noqa: E402  (its servers)
    DECODE_MAX_MODEL_LEN,
    Server,
    bring_up,
    free_port,
    metric,
    proxy_server,
    vllm_server,
)

TOKENS = 24  # each answer's length
FAKE = ROOT / "tests" / "fake_vllm.py"
FAKE_MODEL = "fake-model"  # what the fakes serve
WORDS = {"short": 4, "conversation": 150, "document": 300}  # ~16, ~200, ~400 tokens
KINDS = ("short", "conversation", "document")


def prompt(words: int) -> str:
    nonce = " ".join(uuid.uuid4().hex[:8])  # a fresh start: nothing of it cached anywhere
    return f"{nonce} " + " ".join(["the proxy sends the prompt to the prefill"] * (words // 8 + 1))


@dataclass
class Sample:
    kind: str
    ttft: float
    gaps: list[float]
    error: str | None = None


@dataclass
class Cell:
    samples: list[Sample] = field(default_factory=list)
    prefill_tokens: float = 0.0
    decode_tokens: float = 0.0  # the decode computed itself


def stream(base: str, messages: list[dict[str, str]], kind: str, model: str) -> tuple[Sample, str]:
    where = urlsplit(base)
    connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=300)
    body = {"model": model, "messages": messages, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    started = time.perf_counter()
    try:
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            return Sample(kind, 0.0, [], f"status {response.status}"), ""
        times, parts = [], []
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Sample(kind, 0.0, [], str(event["error"])[:80]), ""
            for choice in event.get("choices") or ():
                if text := (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
                    parts.append(text)
    except OSError as error:
        return Sample(kind, 0.0, [], str(error)[:80]), ""
    finally:
        connection.close()
    if not times:
        return Sample(kind, 0.0, [], "no text"), ""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return Sample(kind, times[0] - started, gaps), "".join(parts)


def job(base: str, kind: str, model: str) -> list[Sample]:
    """One client's job of this kind: a conversation is three turns, one after another."""
    messages = [{"role": "user", "content": prompt(WORDS[kind])}]
    samples = []
    for turn in range(3 if kind == "conversation" else 1):
        sample, answer = stream(base, messages, kind if turn == 0 else "next turn", model)
        samples.append(sample)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"and then, {turn}? say more"}]  # fmt: skip
    return samples


def computed(server: Server) -> float:
    """The prompt tokens a server computed itself (not found in its cache, not pulled)."""
    return float(metric(server, "vllm:prompt_tokens_by_source_total", source="local_compute"))


def run_cell(base: str, prefill: Server, decode: Server, concurrency: int, jobs: int) -> Cell:
    cell = Cell()
    prefilled, local = computed(prefill), computed(decode)
    kinds = [KINDS[i % len(KINDS)] for i in range(jobs)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for samples in pool.map(lambda kind: job(base, kind, decode.model), kinds):
            cell.samples += samples
    cell.prefill_tokens = computed(prefill) - prefilled
    cell.decode_tokens = computed(decode) - local
    return cell


def first_token(base: str, words: int, model: str) -> float:
    """Seconds to the first text of a streamed completion of a fresh prompt."""
    messages = [{"role": "user", "content": prompt(words)}]
    sample, _ = stream(base, messages, "short", model)
    if sample.error is not None:
        raise RuntimeError(sample.error)
    return sample.ttft


def against_the_decode_alone(proxy: Server, decode: Server, rounds: int) -> list[str]:
    """Issue 50's bar: ~16 and ~128 uncached tokens through the proxy, within 1.25 times the
    decode's own time to the first token (p50), the two taking turns, fresh prompts each."""
    lines = []
    for words, size in ((4, "~16"), (90, "~128")):
        through, alone = [], []
        for _ in range(rounds):
            through.append(first_token(proxy.url, words, decode.model))
            alone.append(first_token(decode.url, words, decode.model))
        ratio = quantile(through, 0.5) / quantile(alone, 0.5)
        verdict = "MET" if ratio <= 1.25 else "NOT MET"
        lines.append(
            f"{size} tokens: TTFT p50 through the proxy {quantile(through, 0.5) * 1000:.1f} ms, "
            f"the decode alone {quantile(alone, 0.5) * 1000:.1f} ms: {ratio:.2f}x "
            f"({rounds} each; bar 1.25x): {verdict}"
        )
    return lines


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(cells: dict[tuple[str, int], Cell], limit: int, rounds: int, jobs: int) -> str:
    kinds = (*KINDS, "next turn")
    head = "| setting | concurrency | " + " | ".join(f"TTFT {k} p50/p99 (ms)" for k in kinds)
    head += " | ITL p50/p99 (ms) | prompt tokens: prefill / decode | errors |"
    lines = [head, "|" + "---|" * (len(kinds) + 5)]
    for (setting, concurrency), cell in sorted(cells.items()):
        ok = [s for s in cell.samples if s.error is None]
        ttfts = []
        for kind in kinds:
            values = [s.ttft * 1000 for s in ok if s.kind == kind]
            ttfts.append(f"{quantile(values, 0.5):.0f} / {quantile(values, 0.99):.0f}")
        gaps = [g * 1000 for s in ok for g in s.gaps]
        errors = len(cell.samples) - len(ok)
        lines.append(
            f"| {setting} | {concurrency} | " + " | ".join(ttfts)
            + f" | {quantile(gaps, 0.5):.1f} / {quantile(gaps, 0.99):.1f}"
            + f" | {cell.prefill_tokens:.0f} / {cell.decode_tokens:.0f} | {errors} |"
        )  # fmt: skip
    lines.append(
        f"\nQuantiles over every request of {rounds} round(s) of {jobs} jobs a cell, the two "
        f"proxies taking turns each round; local = --max-local-prefill-tokens {limit}, pd = 0; "
        "prompt tokens: those each server computed itself (vLLM's local_compute)."
    )
    return "\n".join(lines)


def real_pair(root: Path, logs: Path) -> tuple[Server, Server]:
    prefill = vllm_server(root, logs, "kv_producer", DECODE_MAX_MODEL_LEN, name="bench-prefill")
    decode = vllm_server(root, logs, "kv_consumer", DECODE_MAX_MODEL_LEN, name="bench-decode")
    return prefill, decode


def simulated_pair(logs: Path, args: argparse.Namespace) -> tuple[Server, Server]:
    """Two fakes, each a process, at the costs --simulated names."""
    servers = []
    for role in ("prefill", "decode"):
        port, bootstrap = free_port(), free_port()
        argv = [sys.executable, str(FAKE), "--serve", role, "--port", str(port)]
        argv += ["--bootstrap-port", str(bootstrap), "--cache-blocks", "4096"]
        argv += ["--token-time", str(args.token_time), "--token-delay", str(args.itl)]
        argv += ["--pull-delay", str(args.handoff)] if role == "decode" else []
        url, log = f"http://127.0.0.1:{port}", logs / f"{role}.log"
        known = bootstrap if role == "prefill" else None
        servers.append(Server(f"bench-{role}", argv, dict(os.environ), log, url, known))
        servers[-1].model = FAKE_MODEL
    return servers[0], servers[1]


def start_servers(prefill: Server, decode: Server, logs: Path, limit: int) -> dict[str, Server]:
    proxies = {}
    for setting, value in (("pd", 0), ("local", limit)):
        extra = ("--log-level", "WARNING", "--max-local-prefill-tokens", str(value))
        proxies[setting] = proxy_server(f"bench-proxy-{setting}", logs, prefill, decode, *extra)
    bring_up((prefill, decode), list(proxies.values()))
    return proxies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=200, help="--max-local-prefill-tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--jobs", type=int, default=6, help="jobs a cell a round")
    parser.add_argument("--quick", action="store_true", help="one round at concurrency 1")
    parser.add_argument("--simulated", action="store_true", help="fakes, not vLLM")
    parser.add_argument("--token-time", type=float, default=1e-4, help="--simulated: s/token")
    parser.add_argument("--handoff", type=float, default=0.05, help="--simulated: s a pull")
    parser.add_argument("--itl", type=float, default=0.005, help="--simulated: s a token")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.concurrency = 1, [1]
    logs = Path(tempfile.mkdtemp(prefix="bench-local-prefill-"))
    if args.simulated:
        prefill, decode = simulated_pair(logs, args)
    else:
        default_root = Path.home() / ".cache" / "mooncake-proxy" / "real-vllm"
        root = Path(os.environ.get("VLLM_ENV_ROOT", default_root))
        if not (root / "venv").is_dir():
            print(f"no real-vLLM environment at {root}: run make integration once", file=sys.stderr)
            return 2
        prefill, decode = real_pair(root, logs)
    proxies = start_servers(prefill, decode, logs, args.limit)
    cells: dict[tuple[str, int], Cell] = {}
    verdicts: list[str] = []
    try:
        verdicts = against_the_decode_alone(proxies["local"], decode, 20)
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                for setting, proxy in proxies.items():
                    cell = run_cell(proxy.url, prefill, decode, concurrency, args.jobs)
                    into = cells.setdefault((setting, concurrency), Cell())
                    into.samples += cell.samples
                    into.prefill_tokens += cell.prefill_tokens
                    into.decode_tokens += cell.decode_tokens
    finally:
        for server in (*proxies.values(), decode, prefill):
            server.stop()
    if args.simulated:
        print(
            f"Simulated pair (fakes): {args.token_time * 1000:g} ms a prompt token, "
            f"{args.handoff * 1000:g} ms a handoff, {args.itl * 1000:g} ms a token.\n"
        )
    print(report(cells, args.limit, args.rounds, args.jobs))
    print("\n" + "\n".join(verdicts))
    print(f"server logs: {logs}")
    failed = sum(s.error is not None for cell in cells.values() for s in cell.samples)
    # The fakes never stall as real Mooncake over TCP may: there, an error is the proxy's.
    return 1 if args.simulated and failed else 0


if __name__ == "__main__":
    sys.exit(main())
