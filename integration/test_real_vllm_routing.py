"""Routing against real vLLM: where the prefix is cached, from vLLM's own counters.

One prefill instance with two data-parallel engines (``--data-parallel-size 2``) whose prefix
caches hold only a few blocks each (``--num-gpu-blocks-override``), one decode, both publishing
vLLM's KV cache events, and the proxy in front of them: with round_robin, with prefix_aware
(its estimate), and with prefix_aware on the engines' events (``--kv-events``). The workload
is a few shared prefixes that do not fit one engine's cache but fit both: round robin makes
each engine hold every prefix, so they evict each other; prefix_aware keeps each prefix on one
engine. The hit rate is vLLM's own: prefix_cache_hits / prefix_cache_queries, summed over both
engines.
"""

from __future__ import annotations

import collections
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from real_vllm import (  # the suite's servers and their HTTP
    MODEL,
    PROXY,
    Server,
    free_port,
    metric,
    stall_in,
    vllm_server,
)

# vLLM's CPU block is 128 tokens; block 0 is its null block. Seven usable blocks per engine hold
# three of the five 2-block prefixes below; the two engines together hold all five. (Five, not
# four: round robin over two engines would keep each of four prefixes on one engine by chance.)
BLOCKS = 8
PREFIXES = 5
ROUNDS = 6


def kv_events(ranks: int) -> tuple[list[str], list[str]]:
    """vLLM's flag for KV events on fresh ports (DP rank r on port + r, its replay likewise),
    and the proxy's --kv-events entry for it, less the instance's URL."""
    events, replay = free_port(ranks), free_port(ranks)
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    endpoints = [f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"]
    return ["--kv-events-config", json.dumps(config)], endpoints


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    root = Path(os.environ["VLLM_ENV_ROOT"])
    logs = Path(os.environ.get("REAL_VLLM_LOGS") or tmp_path_factory.mktemp("routing-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    small_cache = ("--num-gpu-blocks-override", str(BLOCKS))
    prefill_events, prefill_endpoints = kv_events(2)
    decode_events, decode_endpoints = kv_events(1)
    prefill = vllm_server(
        root, logs, "kv_producer", 512, "--data-parallel-size", "2", "--api-server-count", "1",
        *small_cache, *prefill_events, name="prefill-dp2",
    )  # fmt: skip
    decode = vllm_server(
        root, logs, "kv_consumer", 512, *small_cache, *decode_events, name="decode-small"
    )
    prefill.kv_events = [prefill.url, *prefill_endpoints]
    decode.kv_events = [decode.url, *decode_endpoints]
    for server in (prefill, decode):  # for /reset_prefix_cache: each policy starts cold
        server.env["VLLM_SERVER_DEV_MODE"] = "1"
    try:
        prefill.start()
        decode.start()
        prefill.wait_healthy(400)
        decode.wait_healthy(300)
        prefill.warm_up()
        decode.warm_up()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def proxy(prefill: Server, decode: Server, policy: str, logs: Path) -> Server:
    """``policy``: a --policy, or "kv_events": prefix_aware on both servers' KV events (and the
    tokenizer the model's /v1/models root names: the tiny model's directory)."""
    port = free_port()
    argv = [sys.executable, str(PROXY), "--port", str(port), "--decode", decode.url]
    argv += ["--no-start-self-test"]  # the suite counts what each server computed
    argv += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    if policy == "kv_events":
        argv += ["--kv-events", *prefill.kv_events, "--kv-events", *decode.kv_events]
    else:
        argv += ["--policy", policy]
    argv += ["--connect-timeout", "30", "--load-interval", "0.5"]
    # The tiny model's byte-level tokenizer makes a 128-token block about 190 bytes of prompt,
    # not the 512 a usual one (4 bytes a token) makes: route by blocks that size.
    argv += ["--prefix-block-bytes", "128"]
    server = Server(f"proxy-{policy}", argv, dict(os.environ), logs / f"proxy-{policy}.log",
                    f"http://127.0.0.1:{port}")  # fmt: skip
    server.start()
    server.wait_healthy(60)
    return server


def reset_prefix_caches(*servers: Server) -> None:
    """Empty the engines' prefix caches (vLLM publishes AllBlocksCleared): each policy is
    measured from the same cold start, not on what the one before it left behind."""
    for server in servers:
        deadline = time.monotonic() + 30
        while True:  # refused while blocks are still held by requests finishing
            request = urllib.request.Request(f"{server.url}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(request, timeout=10) as answer:
                if json.loads(answer.read()).get("success"):
                    break
            assert time.monotonic() < deadline, f"{server.name} kept refusing to reset"
            time.sleep(0.5)


def hits_and_queries(prefill: Server) -> tuple[float, float]:
    return (
        metric(prefill, "vllm:prefix_cache_hits_total"),
        metric(prefill, "vllm:prefix_cache_queries_total"),
    )


POLICIES = ("round_robin", "prefix_aware", "kv_events")


def prefix_text(policy: str, p: int) -> str:
    """Prefix ``p`` of a policy's run: new text for each run, of the same length in tokens
    (a digit is one token), so that each run's prompts end their blocks alike."""
    tag = f"run {POLICIES.index(policy)}"
    return " ".join(f"{tag} document {p} line {n} says the cache holds blocks" for n in range(8))


@dataclass
class Stalls:
    """At most one environmental stall a test: proven by the decode's own log, printed, the
    request asked once more, and what both attempts did left out of the test's figures."""

    decode: Server
    prefill: Server
    met: list[str] = field(default_factory=list)
    hits_left_out: float = 0.0
    queries_left_out: float = 0.0

    def complete(self, client: openai.OpenAI, prompt: str) -> bool:
        """One request; True if it met a stall and was asked again."""
        logged = self.decode.logged()
        before = hits_and_queries(self.prefill)
        try:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            return False
        except openai.InternalServerError as failure:
            signature = stall_in(self.decode, logged)
            if signature is None or self.met:
                raise  # not the environment's, or not the first: a failure of the test
            self.met.append(f"{prompt[:40]}...: {signature} ({failure})")
            print(f"a KV transfer stalled ({signature}); asked again once the proxy is ready")
        # The stalled prefill may have missed its health checks meanwhile: out for a moment.
        base = str(client.base_url).removesuffix("/").removesuffix("/v1")
        deadline = time.monotonic() + 60
        while healthcheck_status(base) != 200:
            assert time.monotonic() < deadline, "the proxy did not become ready again"
            time.sleep(0.5)
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        after = hits_and_queries(self.prefill)
        self.hits_left_out += after[0] - before[0]  # the failed attempt cached the prefix
        self.queries_left_out += after[1] - before[1]
        return True


def run_workload(base: str, policy: str, stalls: Stalls) -> None:
    """Shared prefixes of 288 tokens (two full blocks and a part), each asked ROUNDS times with
    another question, in a shuffled order."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    prefixes = [prefix_text(policy, p) for p in range(PREFIXES)]
    order = random.Random(3)
    for round_ in range(ROUNDS):
        for p in order.sample(range(PREFIXES), PREFIXES):
            stalls.complete(client, f"{prefixes[p]} question {round_} {p}")


def healthcheck_status(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def healthcheck(router: Server) -> dict[str, object]:
    with urllib.request.urlopen(f"{router.url}/healthcheck", timeout=10) as answer:
        state: dict[str, object] = json.loads(answer.read())
        return state


def wait_for_tokenizer(router: Server) -> None:
    deadline = time.monotonic() + 60
    while healthcheck(router)["tokenizer"] is None:
        assert time.monotonic() < deadline, "the proxy never loaded the model's tokenizer"
        time.sleep(0.2)


def test_prefix_aware_finds_the_prefix_where_vllm_cached_it(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    prefill, decode = servers
    rates = {}
    stalls = Stalls(decode, prefill)
    for policy in POLICIES:
        reset_prefix_caches(prefill, decode)
        router = proxy(prefill, decode, policy, tmp_path)
        try:
            if policy == "kv_events":
                wait_for_tokenizer(router)
            hits, queries = hits_and_queries(prefill)
            local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
            left_out = (stalls.hits_left_out, stalls.queries_left_out)
            run_workload(router.url, policy, stalls)
            new_hits, new_queries = hits_and_queries(prefill)
            new_hits -= stalls.hits_left_out - left_out[0]  # a stall's request: not counted
            new_queries -= stalls.queries_left_out - left_out[1]
            rates[policy] = (new_hits - hits) / (new_queries - queries)
            local_gain = (
                metric(decode, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
                - local
            )
            print(f"{policy}: prefill hit rate {rates[policy]:.3f}, decode local hits {local_gain}")
            if policy == "kv_events":
                check_the_view_agrees_with_vllm(router, prefill, decode, stalls)
        finally:
            router.stop()
    # An oracle with both engines' capacity computes each prefix once: 5 of 6 rounds hit 256 of
    # about 293 prompt tokens, about 0.73. Round robin makes both engines hold all five.
    assert rates["prefix_aware"] > 0.6, rates
    assert rates["prefix_aware"] > rates["round_robin"] + 0.25, rates
    # On the engines' own events, at least as good as the estimate.
    assert rates["kv_events"] >= rates["prefix_aware"] - 0.02, rates
    # The decode keeps what it received: the same prefixes come from its own cache.
    assert local_gain > 0


def check_the_view_agrees_with_vllm(
    router: Server, prefill: Server, decode: Server, stalls: Stalls
) -> None:
    """Every engine's view comes from its events, and it agrees with vLLM's cache: each prefix
    asked once more hits where the proxy found it held (affinity), and misses where it found
    it nowhere (cold)."""
    state = healthcheck(router)
    prefill_state, decode_state = state["prefill"], state["decode"]
    assert isinstance(prefill_state, list) and isinstance(decode_state, list)
    engines = [*prefill_state[0]["engines"], decode_state[0]]
    for engine in engines:
        assert str(engine["kv_source"]).startswith("kv events (tcp://"), engine
        assert engine["kv_event_gaps"] == 0 and engine["kv_event_problem"] is None, engine
    views = [(engine["kv_source"], engine["kv_blocks"]) for engine in engines]
    assert all(int(blocks) > 0 for _, blocks in views), views
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
    seen = collections.Counter()
    for p in range(PREFIXES):
        hits = metric(prefill, "vllm:prefix_cache_hits_total")
        found = decisions(router)
        if stalls.complete(client, f"{prefix_text('kv_events', p)} once more"):
            continue  # asked twice: the second found what the first cached, whatever routed it
        (reason,) = [r for r, n in decisions(router).items() if n > found.get(r, 0)]
        seen[reason] += 1
        hit = metric(prefill, "vllm:prefix_cache_hits_total") - hits
        assert (hit > 0) == (reason in ("affinity", "spill")), (p, reason, hit)
    print(f"kv_events: once more, by the proxy's reason: {dict(seen)}")
    assert seen["affinity"] >= 3, seen  # most prefixes are held somewhere after the workload


def decisions(router: Server) -> dict[str, float]:
    return {
        reason: metric(router, "mooncake_proxy_routing_decisions_total", stage="prefill",
                       reason=reason)
        for reason in ("affinity", "spill", "cold", "fallback")
    }  # fmt: skip
