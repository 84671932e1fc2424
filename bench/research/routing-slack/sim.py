"""The recent-share bound's slack, in process: multi-turn chats against shared prefixes at
light traffic. Run from a copy of the repository with experiment.patch applied:

    git apply bench/research/routing-slack/experiment.patch
    cd bench/research/routing-slack
    python sim.py                                                   # as shipped: slack 4
    EXPERIMENT_RECENT_SLACK=0 EXPERIMENT_OWN_TURNS=whole python sim.py
    EXPERIMENT_FIRST_TURN_SLACK=0 EXPERIMENT_OWN_TURNS=whole python sim.py

Each workload is routed by the proxy's own Fleet (prefill stage, prefix_aware) on a simulated
clock; every engine is an LRU cache of the router's 512-byte blocks, and the hit rate is
compared with one LRU cache as large as the fleet's. Nothing here is timed.

- multi-turn: bench_routing's chats (24 per 8 engines, 8 turns, 4 system prompts), at the
  benchmark's default rate (the same total rate at any size); each engine caches 40 blocks
  (bench_routing's 20 KiB), a prefill takes 25 us a token, 128 tokens a block.
- shared prefixes, light: bench_routing's prefix groups (4 KiB prefix, 10 requests a group)
  at a few requests a second, as completions and as single-turn chats (the prefix as the
  system prompt); the caches hold 75% of the distinct blocks.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the daemon
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # bench_routing

import bench_routing as br
import mooncake_proxy as mp

CLOCK = [1000.0]
mp.time.monotonic = lambda: CLOCK[0]  # type: ignore[attr-defined]  # the simulated clock


def fleet_of(engines: int, capacity: int) -> tuple[mp.Fleet, list[mp.PrefillEngine]]:
    fleet = br.costs_fleet(engines // 8, 8, 1)
    members = [e for i in fleet.prefills for e in i.engines]
    for engine in members:
        engine.index.capacity = capacity
    return fleet, members


def multi_turn(engines: int, capacity: int = 40) -> float:
    scale = engines // 8
    fleet, members = fleet_of(engines, capacity)
    caches = {e: collections.OrderedDict[int, None]() for e in members}
    whole: collections.OrderedDict[int, None] = collections.OrderedDict()
    busy: list[tuple[float, mp.PrefillEngine]] = []
    hits = oracle = 0
    for at, path, body in br.multi_turn(24 * scale, 8, 1.0 * scale):
        CLOCK[0] = 1000.0 + at
        while busy and busy[0][0] <= CLOCK[0]:
            fleet.release_prefill(busy.pop(0)[1])
        key = mp.route_key(path, body, None)
        engine = fleet.claim_prefill((), key)
        found = br.lru_serve(caches[engine], key.chain, capacity)
        busy.append((CLOCK[0] + (len(key.chain) - found) * 128 * 25e-6 + 0.01, engine))
        busy.sort(key=lambda b: b[0])
        hits += found
        oracle += br.lru_serve(whole, key.chain, capacity * engines)
    return hits / oracle


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    text = body["prompt"]
    messages = [
        {"role": "system", "content": text[:4096]},
        {"role": "user", "content": text[4096:]},
    ]
    return {"model": "fake-model", "messages": messages}


def shared_prefixes(engines: int, rate: float, groups: int, chat: bool) -> float:
    keys = []
    for at, path, body in br.shared_prefix_groups(groups, 10, rate):
        if chat:
            path, body = br.CHAT, as_chat(body)
        keys.append((at, mp.route_key(path, body, None)))
    distinct = len({block for _, key in keys for block in key.chain})
    capacity = max(16, int(0.75 * distinct / engines))
    fleet, members = fleet_of(engines, capacity)
    caches = {e: collections.OrderedDict[int, None]() for e in members}
    whole: collections.OrderedDict[int, None] = collections.OrderedDict()
    hits = oracle = 0
    for at, key in keys:
        CLOCK[0] = 2000.0 + at
        engine = fleet.claim_prefill((), key)
        fleet.release_prefill(engine)
        hits += br.lru_serve(caches[engine], key.chain, capacity)
        oracle += br.lru_serve(whole, key.chain, capacity * engines)
    return hits / oracle


def main() -> None:
    switches = {k: v for k, v in os.environ.items() if k.startswith("EXPERIMENT_")}
    print("switches:", switches or "none (as shipped)")
    print("hit rate / oracle's")
    for engines in (8, 64):
        print(f"  multi-turn, {engines} engines: {multi_turn(engines):.3f}")
    for engines, rate, groups in ((8, 2.0, 32), (8, 20.0, 32), (64, 2.0, 64), (64, 20.0, 256)):
        for chat in (False, True):
            kind = "single-turn chats" if chat else "completions"
            ratio = shared_prefixes(engines, rate, groups, chat)
            print(f"  shared prefixes as {kind}, {engines} engines, {rate:g}/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
