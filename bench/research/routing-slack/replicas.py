"""Multi-turn chats through proxy replicas, in process. Run from the repository's root:

    python bench/research/routing-slack/replicas.py          # replicas count everyone's requests
    OWN_COUNTS=1 python bench/research/routing-slack/replicas.py  # each counts only its own
    PEERS=1 python bench/research/routing-slack/replicas.py  # each told the others' sends (--peer)

Each replica is the proxy's own Fleet (prefill stage, prefix_aware), on a simulated clock
(sim.py's); a round-robin balancer hands them the requests in turn. What KV events would tell
a replica is stood in for: the others' sends reach its indexes 0.2 s after their prefill
ends. Every second a scrape gives each replica every engine's count of finished requests
(vllm:request_success_total), as the proxy's load loop would, unless OWN_COUNTS is set.
With PEERS, each replica also remembers the others' sends as its own (Router.heard: their
blocks, turns and counts) 5 ms after they were sent, as --peer's datagrams would (the events'
writes then stand aside: the proxy weighs its own and its peers' writes against the events'
by the larger).
Engines are LRU caches of the router's blocks, as in sim.py; the hit rate is over the
oracle's (one LRU cache as large as the fleet's). Nothing here is timed.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim  # first: it puts the repository on the path, and sets the simulated clock

import bench_routing as br
import mooncake_proxy as mp

EVENTS_DELAY = 0.2  # after a prefill ends, its blocks reach the other replicas
SCRAPE_EVERY = 1.0
PEERS = bool(os.environ.get("PEERS"))
PEER_DELAY = 0.005  # --peer: a datagram, after the proxy's 10 ms batching on average


def scrape(fleets: list[tuple[mp.Fleet, list[mp.PrefillEngine]]], finished: dict[str, int]) -> None:
    now = sim.CLOCK[0]
    for fleet, members in fleets:
        for engine in members:
            engine.load.took(float(finished[engine.name]), now, engine.recent_share(now))
            engine.load.scraped_at = now
        fleet.prefill_router.rescan()


def multi_turn(engines: int, replicas: int, capacity: int = 40) -> float:
    scale = engines // 8
    fleets = [sim.fleet_of(engines, capacity) for _ in range(replicas)]
    by_name = [{e.name: e for e in members} for _, members in fleets]
    caches = {name: collections.OrderedDict[int, None]() for name in by_name[0]}
    whole: collections.OrderedDict[int, None] = collections.OrderedDict()
    finished: dict[str, int] = collections.Counter()
    later: list[tuple[float, int, Callable[[], None]]] = []  # what happens at a time
    order = itertools.count()
    next_scrape = 1000.0
    hits = oracle = 0
    for n, (at, path, body) in enumerate(br.multi_turn(24 * scale, 8, 1.0 * scale)):
        now = 1000.0 + at
        while later and later[0][0] <= now:
            sim.CLOCK[0], _, event = heapq.heappop(later)
            event()
        while not os.environ.get("OWN_COUNTS") and next_scrape <= now:
            sim.CLOCK[0] = next_scrape
            scrape(fleets, finished)
            next_scrape += SCRAPE_EVERY
        sim.CLOCK[0] = now
        fleet = fleets[n % replicas][0]
        key = mp.route_key(path, body, None)
        engine = fleet.claim_prefill((), key)
        found = br.lru_serve(caches[engine.name], key.chain, capacity)
        done = now + (len(key.chain) - found) * 128 * 25e-6 + 0.01

        def end(fleet: mp.Fleet = fleet, engine: mp.PrefillEngine = engine) -> None:
            fleet.release_prefill(engine)
            finished[engine.name] += 1

        heapq.heappush(later, (done, next(order), end))
        for (other, _), views in zip(fleets, by_name, strict=True):
            if (view := views[engine.name]) is not engine:

                def told(
                    view: mp.PrefillEngine = view, key: mp.RouteKey = key, computed: int = found
                ) -> None:
                    view.index.add(key.chain)
                    if not PEERS:
                        view.written.add(sim.CLOCK[0], len(key.chain) - computed)

                heapq.heappush(later, (done + EVENTS_DELAY, next(order), told))
                if PEERS:
                    uncached = max(len(key.chain) - found, 1)  # the blocks it computed

                    def heard(
                        other: mp.Fleet = other,
                        view: mp.PrefillEngine = view,
                        key: mp.RouteKey = key,
                        uncached: int = uncached,
                    ) -> None:
                        other.prefill_router.heard(view, key, uncached)

                    heapq.heappush(later, (now + PEER_DELAY, next(order), heard))
        hits += found
        oracle += br.lru_serve(whole, key.chain, capacity * engines)
    return hits / oracle


def main() -> None:
    print("counts:", "each replica its own" if os.environ.get("OWN_COUNTS") else "everyone's")
    print("sends told to the other replicas (--peer):", "yes" if PEERS else "no")
    print("multi-turn, hit rate / oracle's")
    for engines in (8, 64):
        rates = (f"x{r} {multi_turn(engines, r):.3f}" for r in (1, 2, 4))
        print(f"  {engines} engines:", "  ".join(rates))


if __name__ == "__main__":
    main()
