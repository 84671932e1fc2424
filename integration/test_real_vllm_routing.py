"""Routing against real vLLM: where the prefix is cached, from vLLM's own counters.

One prefill instance with two data-parallel engines (``--data-parallel-size 2``) whose prefix
caches hold only a few blocks each (``--num-gpu-blocks-override``), one decode, and the proxy
in front of them, once with round_robin and once with prefix_aware. The workload is a few
shared prefixes that do not fit one engine's cache but fit both: round robin makes each engine
hold every prefix, so they evict each other; prefix_aware keeps each prefix on one engine. The
hit rate is vLLM's own: prefix_cache_hits / prefix_cache_queries, summed over both engines.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_real_vllm import (  # the suite's own servers and helpers
    MODEL,
    PROXY,
    Server,
    free_port,
    metric,
    vllm_server,
)

# vLLM's CPU block is 128 tokens; block 0 is its null block. Seven usable blocks per engine hold
# three of the five 2-block prefixes below; the two engines together hold all five. (Five, not
# four: round robin over two engines would keep each of four prefixes on one engine by chance.)
BLOCKS = 8
PREFIXES = 5
ROUNDS = 6


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    root = Path(os.environ["VLLM_ENV_ROOT"])
    logs = Path(os.environ.get("REAL_VLLM_LOGS") or tmp_path_factory.mktemp("routing-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    small_cache = ("--num-gpu-blocks-override", str(BLOCKS))
    prefill = vllm_server(
        root, logs, "kv_producer", 512, "--data-parallel-size", "2", "--api-server-count", "1",
        *small_cache, name="prefill-dp2",
    )  # fmt: skip
    decode = vllm_server(root, logs, "kv_consumer", 512, *small_cache, name="decode-small")
    try:
        prefill.start()
        decode.start()
        prefill.wait_healthy(400)
        decode.wait_healthy(300)
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def proxy(prefill: Server, decode: Server, policy: str, logs: Path) -> Server:
    port = free_port()
    argv = [sys.executable, str(PROXY), "--port", str(port), "--decode", decode.url]
    argv += ["--prefill", prefill.url, str(prefill.bootstrap_port), "--policy", policy]
    argv += ["--connect-timeout", "30", "--load-interval", "0.5"]
    # The tiny model's byte-level tokenizer makes a 128-token block about 190 bytes of prompt,
    # not the 512 a usual one (4 bytes a token) makes: route by blocks that size.
    argv += ["--prefix-block-bytes", "128"]
    server = Server(f"proxy-{policy}", argv, dict(os.environ), logs / f"proxy-{policy}.log",
                    f"http://127.0.0.1:{port}")  # fmt: skip
    server.start()
    server.wait_healthy(60)
    return server


def hits_and_queries(prefill: Server) -> tuple[float, float]:
    return (
        metric(prefill, "vllm:prefix_cache_hits_total"),
        metric(prefill, "vllm:prefix_cache_queries_total"),
    )


def run_workload(base: str, tag: str) -> None:
    """Shared prefixes of about 270 tokens (two full blocks), each asked ROUNDS times with
    another question, in a shuffled order."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    prefixes = [
        " ".join(f"{tag} document {p} line {n} says the cache holds blocks" for n in range(7))
        for p in range(PREFIXES)
    ]
    order = random.Random(3)
    for round_ in range(ROUNDS):
        for p in order.sample(range(PREFIXES), PREFIXES):
            client.completions.create(
                model=MODEL, prompt=f"{prefixes[p]} question {round_} {p}", max_tokens=2
            )


def test_prefix_aware_finds_the_prefix_where_vllm_cached_it(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    prefill, decode = servers
    rates = {}
    for policy in ("round_robin", "prefix_aware"):
        router = proxy(prefill, decode, policy, tmp_path)
        try:
            hits, queries = hits_and_queries(prefill)
            local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
            run_workload(router.url, policy)
            new_hits, new_queries = hits_and_queries(prefill)
            rates[policy] = (new_hits - hits) / (new_queries - queries)
            local_gain = (
                metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
                - local
            )
        finally:
            router.stop()
        print(f"{policy}: prefill hit rate {rates[policy]:.3f}, decode local hits {local_gain}")
    # An oracle with both engines' capacity computes each prefix once: 5 of 6 rounds hit 256 of
    # about 280 prompt tokens, about 0.76. Round robin makes both engines hold all five.
    assert rates["prefix_aware"] > 0.6, rates
    assert rates["prefix_aware"] > rates["round_robin"] + 0.25, rates
    # The decode keeps what it received: the same prefixes come from its own cache.
    assert local_gain > 0
