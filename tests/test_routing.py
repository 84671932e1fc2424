"""Routing: where a prompt's prefix is cached (as the proxy estimates it from what it sent),
weighed against each engine's real load, with other replicas of the proxy in the picture.
Routing on vLLM's own KV cache events is in test_kv_events.py."""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import functools
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pytest_aiohttp import AiohttpClient, AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from fake_vllm import BLOCK_TOKENS, FakeVllm, free_port
from testing_support import (
    CHAT,
    COMPLETIONS,
    FAST,
    SPEC,
    Cluster,
    ProxyProcess,
    StartCluster,
    chat,
    completion,
    daemon_client,
    engine_of,
    eventually,
    fleet_of,
    long_prompt,
    sample,
    scrape,
    serve,
    wait_ready_,
)

# --- routing: where the prefix is cached, weighed against real load


def test_a_chats_next_turn_extends_its_routing_bytes_and_block_chain() -> None:
    system = {"role": "system", "content": "You are terse. " * 80}
    first = [system, {"role": "user", "content": "What is KV? " * 40}]
    second = [*first, {"content": "A cache. " * 40, "role": "assistant"}]
    second.append({"role": "user", "content": "And PD?"})
    one, two = (
        mp.prompt_bytes(CHAT, chat(messages=first)),
        mp.prompt_bytes(CHAT, chat(messages=second)),
    )
    assert two.startswith(one)
    chain_one, chain_two = mp.block_chain(one), mp.block_chain(two)
    assert len(chain_one) >= 2 and chain_two[: len(chain_one)] == chain_one
    # Another model, or the same text as token ids, is another prefix.
    other = mp.prompt_bytes(CHAT, {**chat(messages=first), "model": "other"})
    assert mp.block_chain(other)[0] != chain_one[0]
    assert mp.prompt_bytes(COMPLETIONS, completion(prompt=[1, 2, 3])).endswith(b"\0" + b"1,2,3")
    assert mp.block_chain(b"x" * 511) == []  # no full block: nothing to match


def test_a_prompts_blocks_and_turns_hash_alike_in_every_process() -> None:
    """--peer replicas tell each other a send's blocks and turns: they must be the numbers
    the other process computes for the same prompt, whatever its hash seed (str and bytes
    hash apart in each process; these must not)."""
    messages = [
        {"role": "system", "content": "You are terse. " * 80},
        {"role": "user", "content": "What is KV?"},
        {"role": "assistant", "content": "A cache."},
        {"role": "user", "content": "And PD?"},
    ]
    body = chat(messages=messages, tools=[{"type": "function", "function": {"name": "f"}}])
    script = (
        "import json, sys, mooncake_proxy as mp\n"
        "key = mp.route_key(sys.argv[1], json.loads(sys.argv[2]), None)\n"
        "print(json.dumps([key.chain, key.turn, key.earlier_turns]))\n"
    )
    keys = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        argv = [sys.executable, "-c", script, CHAT, json.dumps(body)]
        done = subprocess.run(argv, env=env, capture_output=True, check=True)
        keys.append(json.loads(done.stdout))
    key = mp.route_key(CHAT, body, None)
    assert len(key.chain) >= 2 and key.turn and key.earlier_turns
    assert keys[0] == keys[1] == [key.chain, key.turn, list(key.earlier_turns)]


def test_a_chats_next_turn_names_the_turn_before_it_and_no_other() -> None:
    system = {"role": "system", "content": "You are terse. " * 80}
    first = [system, {"role": "user", "content": "What is KV?"}]
    second = [*first, {"role": "assistant", "content": "A cache."}]
    second.append({"role": "user", "content": "And PD?"})
    # Another conversation whose first turn differs only within its last, partial block.
    other = [system, {"role": "user", "content": "What is PD?"}]
    keys = [mp.route_key(CHAT, chat(messages=m), None) for m in (first, second, other)]
    assert keys[1].earlier_turns == (keys[0].turn,) and keys[0].turn != keys[2].turn
    assert keys[0].earlier_turns == keys[2].earlier_turns == ()  # nothing answered yet
    assert mp.route_key(COMPLETIONS, completion(), None).earlier_turns == ()


def test_the_prefix_index_forgets_tails_first_and_matches_prefixes() -> None:
    index = mp.PrefixIndex(capacity=8)
    first = mp.block_chain(b"a" * 512 * 6)
    index.add(first)
    assert index.match(first) == 6
    assert index.match(mp.block_chain(b"a" * 512 * 3 + b"b" * 512 * 3)) == 3
    index.add(mp.block_chain(b"c" * 512 * 6))  # 12 blocks: over 8 + 8 // 8, so evicted to 8
    assert len(index.blocks) == 8
    assert index.match(first) == 2  # the head of the older chain outlived its tail
    index.clear()
    assert index.match(first) == 0


def test_bounded_consistent_hashing_takes_the_first_target_with_room() -> None:
    """A session's prompt goes to the first target of its hash order (Roster.walk) whose load,
    given it, stays within the bound."""
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=1024) for i in range(3)]
    key = mp.route_key(COMPLETIONS, completion(), "session 7")
    first = targets[router.choose(targets, mp.Policy.PREFIX_AWARE, key).index]
    order = list(router.roster.walk(mp.mix64(key.placement)))
    assert order[0] is first and sorted(order, key=targets.index) == targets
    # Limit ceil(1.25 x (5 + 1) / 3) = 3: the first is over it, the next in the order takes it.
    first.in_flight = 5
    router.rescan()
    assert targets[router.choose(targets, mp.Policy.PREFIX_AWARE, key).index] is order[1]
    assert mp.limit(5, 3, 1.25) == 3 and mp.limit(0, 3, 1.25, slack=2) == 3


def test_the_reverse_index_is_the_union_of_the_targets_indexes() -> None:
    """Roster.held, block -> its holders' bits, through sends, evictions, a restart's clear,
    and a target that leaves the fleet: always exactly what the targets' indexes hold."""
    rng = random.Random(35)
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=40) for i in range(6)]
    roster = router.roster
    roster.sync(targets, time.monotonic(), 10.0)

    def union() -> dict[int, int]:
        expected: dict[int, int] = {}
        for target in roster.slot_of:
            for block in target.index.blocks:
                expected[block] = expected.get(block, 0) | 1 << roster.slot_of[target]
        return expected

    for step in range(400):
        chain = [hash((rng.randrange(30), n)) for n in range(rng.randint(1, 12))]
        rng.choice(targets).index.add(chain)  # 40 blocks each at most: they evict
        if step % 97 == 0:
            rng.choice(targets).index.clear()
        assert roster.held == union()
    assert any(t.index.blocks for t in targets) and len(roster.held) > 40
    gone = targets.pop(2)
    roster.enlist(set(targets))
    assert roster.held == union() and gone.index.holders is None
    newcomer = mp.Target("engine 6", capacity=40)
    newcomer.index.add([1, 2, 3])
    targets.append(newcomer)
    roster.sync(targets, time.monotonic(), 10.0)  # adopted: its blocks in, in the slot freed
    assert roster.held == union() and roster.slot_of[newcomer] == 2


def every_engine_weighed(router: mp.Router, targets: Sequence[mp.Target], key: mp.RouteKey) -> int:
    """The choice as the router made it before the Roster (593dc66), asking every target in
    turn, for a prompt that some target holds: the reference the Roster is held to."""
    now = time.monotonic()
    others = [t.load.others(now, router.fresh_for) for t in targets]
    loads = [t.in_flight + others[i] for i, t in enumerate(targets)]
    roomy = [i for i, t in enumerate(targets) if t.load.kv_usage < mp.KV_FULL] or list(
        range(len(targets))
    )
    recent = [t.recent_share(now) for t in targets]
    mean = sum(recent) / len(recent)
    mine = [min(t.conversation_share(key, now), n) for t, n in zip(targets, recent, strict=True)]
    recent = [n - m + min(m, mean) for n, m in zip(recent, mine, strict=True)]

    def within(values: list[float], balance: float, slack: float) -> list[bool]:
        bound = mp.limit(sum(values), len(values), balance, slack)
        return [value + 1 <= bound for value in values]

    shares = within(recent, max(router.balance, mp.RECENT_BALANCE), mp.RECENT_SLACK)
    queues = within(loads, router.balance, mp.QUEUE_SLACK)
    candidates = [i for i in roomy if shares[i] and queues[i]] or roomy
    matches = {i: targets[i].holds(key) for i in candidates}

    def cost(i: int) -> tuple[float, int]:
        t = targets[i]
        work = router.load_weight * (t.pending_blocks + others[i] * router.mean_uncached)
        lacking = (len(key.chain) - matches[i]) * (1 + t.turnover(now))
        return work + lacking, mp.mix64(key.placement << 32 ^ t.seed)

    return min(candidates, key=cost)


@pytest.mark.parametrize("engines", [8, 24, 64])
def test_the_roster_weighs_as_asking_every_engine_did(engines: int) -> None:
    """On random states (what each engine holds of a few prompt families, its load, recent
    requests, queued work and turnover, a chat's earlier turns), wherever the old router
    chose an engine that holds the prompt, the Roster's holders and ring choose the same one.
    Where it chose one that holds none of it, the Roster weighs only the first of the ring,
    and may choose another: that is by design, and not compared."""
    rng = random.Random(engines)
    families = [long_prompt(f"family {f}", 6 * 512) for f in range(max(6, engines // 3))]
    compared = 0
    for case in range(150):
        router = mp.Router(
            "prefill", load_weight=rng.choice([0.5, 1.0]), balance=1.25, fresh_for=10.0
        )
        router.mean_uncached = rng.uniform(1, 8)
        targets = [mp.Target(f"engine {case} {i}", capacity=4096) for i in range(engines)]
        now = time.monotonic()
        for target in targets:
            for family in rng.sample(families, 2):
                key = mp.route_key(COMPLETIONS, completion(prompt=family + "tail"), None)
                target.index.add(key.chain[: rng.randint(1, len(key.chain))])
            target.in_flight = rng.randint(0, 4)
            target.pending_blocks = rng.uniform(0, 20) * target.in_flight
            target.recent = mp.Decayed(rng.uniform(0, 12), now)
            target.written = mp.Decayed(rng.uniform(0, 3000), now)
            target.load.kv_usage = 0.99 if rng.random() < 0.05 else 0.5
        turns = chat_turns(3)
        sent(router, rng.choice(targets), turns[:2], now)
        prompt = rng.choice(families) + f"question {case}"
        for key in (mp.route_key(COMPLETIONS, completion(prompt=prompt), None), turns[2]):
            holders = [t for t in targets if t.index.match(key.chain)]
            expected = every_engine_weighed(router, targets, key)
            if not targets[expected].holds(key) or len(holders) > mp.HOLDER_CHOICES:
                continue
            compared += 1
            assert router.weigh(targets, key).index == expected, (case, key.turn)
    assert compared >= 100, compared  # a third of the keys at least, or it says little


@pytest.mark.parametrize(("holder_share", "kept"), [(16, True), (24, False)])
def test_an_engine_keeps_its_prefix_through_a_burst_but_not_a_pile_up(
    holder_share: float, kept: bool
) -> None:
    """The share bound: 16 recent requests where the others had 10 (1.36 times the mean) is
    a prefix's burst, and the engine that holds it keeps it; 24 (1.75 times) is a pile-up,
    and the prompt goes elsewhere though that costs its prefix."""
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=1024) for i in range(4)]
    key = mp.route_key(COMPLETIONS, completion(prompt=long_prompt("held", 4096)), None)
    targets[0].index.add(key.chain)
    now = time.monotonic()
    for target, share in zip(targets, [holder_share, 10, 10, 10], strict=True):
        target.recent = mp.Decayed(share, now)
    choice = router.choose(targets, mp.Policy.PREFIX_AWARE, key)
    assert (choice.index == 0) is kept, choice


def first_turn(question: str) -> mp.RouteKey:
    """A new chat's first turn: a shared 4 KiB system prompt and its own short question."""
    system = {"role": "system", "content": long_prompt("shared system prompt", 4096)}
    messages = [system, {"role": "user", "content": question}]
    return mp.route_key(CHAT, chat(messages=messages), None)


@pytest.mark.parametrize(
    ("returning", "seen_for", "kept"),
    [(0, 0.0, False), (0, mp.CHAT_RETURN_SECONDS, True), (8, mp.CHAT_RETURN_SECONDS, False)],
)
def test_a_new_chat_joins_others_on_their_system_prompt_only_where_chats_do_not_come_back(
    returning: int, seen_for: float, kept: bool
) -> None:
    """Engine 0 holds the system prompt, with 5 recent requests where the others have 2: one
    more is within the slack (the mean, 3 with this one, plus 4) but over 1.5 times the mean
    (4.5, rounded up to 5). A new chat's first turn joins it there only where this process,
    having seen chats for CHAT_RETURN_SECONDS, found that they do not come back for a second
    turn: 10 first turns and no second. Where 8 of the 10 came back, or before it could
    know, the chats will grow, and the first turn goes where there is room for them."""
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=1024) for i in range(4)]
    now = time.monotonic()
    targets[0].index.add(first_turn("an earlier chat").chain)
    for target, share in zip(targets, [5, 2, 2, 2], strict=True):
        target.recent = mp.Decayed(share, now)
    earlier = [chat_turns(2)[1]] * returning + [first_turn(f"chat {n}") for n in range(10)]
    for key in earlier:
        router.returns.saw(key, now)
    router.returns.since -= seen_for
    key = first_turn("a new chat")
    assert key.turn and not key.earlier_turns and targets[0].holds(key) >= 8
    choice = router.choose(targets, mp.Policy.PREFIX_AWARE, key)
    assert (choice.index == 0) is kept, choice


def test_with_one_target_the_choice_is_what_weighing_would_give() -> None:
    """Router.only, the shortcut where there is one target, against the full weighing, on
    the same states: a new prefix, a held one, a partly held one, a session, no key."""
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    target = mp.Target("engine 0", capacity=1024)
    prompts = [long_prompt(tag, size) for tag in ("a", "b", "a") for size in (4096, 9000)]
    keys: list[mp.RouteKey | None] = [
        *(mp.route_key(COMPLETIONS, completion(prompt=prompt), None) for prompt in prompts),
        mp.route_key(COMPLETIONS, completion(), "session 7"),
        None,
    ]
    seen = set()
    for key in keys * 2:
        choice = router.only(target, key)
        assert choice == router.weigh([target], key)
        seen.add(choice.reason)
        router.pick([target], mp.Policy.PREFIX_AWARE, key)  # what it holds from now on
    assert seen == {"cold", "affinity", "session", "fallback"}


async def test_a_lone_conversation_stays_on_one_engine_turn_after_turn(
    start_cluster: StartCluster,
) -> None:
    """Its own turns are not a pile-up: counted against the share bound, they moved this
    chat to another engine at its sixth turn, which then computed its whole history."""
    cluster = await start_cluster(prefill_dp=(2, 2))
    messages = [{"role": "system", "content": long_prompt("a lone chat", 2048)}]
    for turn in range(12):
        messages.append({"role": "user", "content": f"question {turn}"})
        answer = await cluster.client.post(CHAT, json=chat(messages=messages))
        assert answer.status == 200
        text = (await answer.json())["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": text})
    engines = [(i, r.headers["X-data-parallel-rank"]) for i, r in cluster.prefill_requests()]
    assert len(set(engines)) == 1, engines


async def test_the_healthcheck_says_how_many_chats_come_back(start_cluster: StartCluster) -> None:
    """A young process assumes every chat comes back; once it has seen chats for
    CHAT_RETURN_SECONDS, the share is its second turns over its first: chat A came back, B, C
    and D did not."""
    cluster = await start_cluster(prefill_dp=(2,))

    async def returning() -> float:
        answer = await cluster.client.get("/healthcheck")
        share: float = (await answer.json())["chats_returning"]
        return share

    assert await returning() == 1.0
    system = {"role": "system", "content": long_prompt("shared", 1024)}
    for name in "ABCD":
        messages = [system, {"role": "user", "content": f"chat {name}"}]
        answer = await cluster.client.post(CHAT, json=chat(messages=messages))
        assert answer.status == 200
        if name == "A":
            text = (await answer.json())["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": "and more"})
            assert (await cluster.client.post(CHAT, json=chat(messages=messages))).status == 200
    assert await returning() == 1.0
    cluster.client.app[mp.STATE_KEY].fleet.prefill_router.returns.since -= mp.CHAT_RETURN_SECONDS
    assert await returning() == pytest.approx(0.25, abs=0.02)


def chat_turns(count: int) -> list[mp.RouteKey]:
    """The keys of a chat's first ``count`` turns, each answered before the next."""
    messages: list[dict[str, str]] = [{"role": "system", "content": long_prompt("sys", 4096)}]
    turns = []
    for turn in range(count):
        messages.append({"role": "user", "content": f"question {turn}"})
        turns.append(mp.route_key(CHAT, chat(messages=list(messages)), None))
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    return turns


def sent(router: mp.Router, target: mp.Target, turns: Sequence[mp.RouteKey], now: float) -> None:
    """What the router's pick records of each turn sent to ``target``."""
    for key in turns:
        router.roster.sent(target, key, now, 1)


@pytest.mark.parametrize(
    ("others_there", "others_elsewhere", "kept"), [(0, 0, True), (8, 4, False)]
)
def test_a_chats_own_turns_are_no_pile_up_but_other_chats_there_are(
    others_there: int, others_elsewhere: int, kept: bool
) -> None:
    """Its eight turns so far on engine 0 count as the mean engine's share: alone, they keep
    its ninth there (counted whole, 8 + 1 were over the bound of 7). With 8 requests of other
    chats there and 4 on each other engine, 8 + 7 + 1 are over the bound of 11 (left out
    altogether, its turns would have kept it there: 8 + 1 within 10)."""
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=1024) for i in range(4)]
    turns = chat_turns(9)
    now = time.monotonic()
    sent(router, targets[0], turns[:-1], now)
    targets[0].recent.add(now, others_there)
    for target in targets[1:]:
        target.recent = mp.Decayed(others_elsewhere, now)
    choice = router.choose(targets, mp.Policy.PREFIX_AWARE, turns[-1])
    assert (choice.index == 0) is kept, choice


@pytest.mark.parametrize(("others_there", "kept"), [(0, True), (8, False)])
def test_a_chats_turns_through_two_replicas_in_turn_are_no_pile_up(
    others_there: int, kept: bool
) -> None:
    """Two replicas behind a round-robin balancer: this one sent turns 1, 3, 5 and 7 of a
    chat to engine 0, the other replica 2, 4, 6 and 8, and the scrape counts all eight. Its
    ninth turn names the eighth as the one before, which this process never saw: it finds
    its seventh among the earlier turns, and its four turns, scaled by everyone's requests
    to its own (two senders), are the chat's eight. Alone, they count as the mean and the
    chat stays. With 8 requests of other chats there too (half of them this process's),
    engine 0 still has too many."""
    router = mp.Router("prefill", load_weight=1.0, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=1024) for i in range(4)]
    turns = chat_turns(9)
    now = time.monotonic()
    sent(router, targets[0], turns[:-1:2], now)
    targets[0].recent.add(now, others_there / 2)
    for target in targets:  # what a fresh scrape says each engine finished lately
        ours = target.recent_share(now)
        target.load.took(0.0, now, ours)
        target.load.took(8.0 + others_there if target is targets[0] else 0.0, now, ours)
        target.load.scraped_at = now
    choice = router.choose(targets, mp.Policy.PREFIX_AWARE, turns[-1])
    assert (choice.index == 0) is kept, choice


@pytest.mark.parametrize(("written", "holder_kept"), [(0, True), (64, False)])
def test_a_prompt_leaves_a_cache_that_turns_over_fast_for_one_at_rest(
    written: int, holder_kept: bool
) -> None:
    """A 20-block prompt whose first 8 blocks engine 0 holds. Where nothing was written there
    lately, its 12 lacking blocks cost less than engine 1's 20. Where this process wrote a
    whole cache's worth there lately, each block computed evicts one in use, and costs
    twice: 24 against 20 on an engine at rest."""
    router = mp.Router("prefill", load_weight=0.5, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=64) for i in range(2)]
    key = mp.route_key(COMPLETIONS, completion(prompt="x" * 512 * 20), None)
    targets[0].index.add(key.chain[:8])
    now = time.monotonic()
    targets[0].written = mp.Decayed(written, now)
    choice = router.choose(targets, mp.Policy.PREFIX_AWARE, key)
    assert (choice.index == 0) is holder_kept, choice


@pytest.mark.parametrize(("others_wrote", "holder_kept"), [(0, True), (48, False)])
def test_a_cache_other_senders_turn_over_shows_in_its_kv_events(
    others_wrote: int, holder_kept: bool
) -> None:
    """As above, engine 0 holds the first 8 blocks of a 20-block prompt, here as its KV
    events say, and this process wrote nothing there. Where the events report that others
    (another proxy replica) stored 48 blocks there lately, its cache of 64 turned over by
    (8 + 48) / 64, and the 12 lacking blocks cost 22.5 against engine 1's 20."""
    state = mp.ProxyState(mp.ProxyConfig(prefills=(SPEC,), decodes=(URL("http://d:1"),)))
    router = mp.Router("prefill", load_weight=0.5, balance=1.25, fresh_for=10.0)
    targets = [mp.Target(f"engine {i}", capacity=64) for i in range(2)]
    tokens = list(range(20 * BLOCK_TOKENS))
    key = mp.route_key(COMPLETIONS, completion(prompt="x" * 512 * 20), None)
    key = dataclasses.replace(key, tokens=tokens)

    def stored(name: str, ids: list[int]) -> dict[str, Any]:
        hashes = [f"{name}{i}".encode() for i in range(len(ids) // BLOCK_TOKENS)]
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": ids, "block_size": BLOCK_TOKENS}  # fmt: skip

    feed = targets[0].feed = mp.KvFeed("tcp://engine-0:5557", None)
    targets[0].kv_tokens = 64 * BLOCK_TOKENS
    others = [stored("other", [10**6 + i for i in range(others_wrote * BLOCK_TOKENS)])]
    mp.take_kv_batch(state, feed, 0, [0.0, [stored("prompt", tokens[: 8 * BLOCK_TOKENS])]])
    mp.take_kv_batch(state, feed, 1, [0.0, others if others_wrote else []])
    assert targets[0].holds(key) == 8
    choice = router.choose(targets, mp.Policy.PREFIX_AWARE, key)
    assert (choice.index == 0) is holder_kept, choice
    # What a join's replay brings was written before: it turns nothing over lately.
    joined = mp.KvFeed("tcp://engine-1:5557", None)
    joined.joining = True
    mp.take_kv_batch(state, joined, 0, [0.0, [stored("old", tokens)]])
    assert len(joined.held) == 20 and joined.written.now(time.monotonic()) == 0.0


async def test_a_repeated_prefix_goes_to_the_engine_that_holds_it(
    start_cluster: StartCluster,
) -> None:
    rates = {}
    for policy in (mp.Policy.PREFIX_AWARE, mp.Policy.ROUND_ROBIN):
        # Two of the three prefixes may be placed on one engine (placement hashes the
        # engines' names, ports included): a loose load bound keeps that engine from being
        # left out as over its share, which is the bound's own test, not this one.
        cluster = await start_cluster(
            prefill_dp=(2, 2), prefill={"cache_blocks": 64}, policy=policy, balance_factor=4.0
        )
        # Three prefixes over four engines: round robin sends each to every engine in turn.
        prefixes = [long_prompt(f"group {i}", 1024) for i in range(3)]
        for turn in range(4):
            for prefix in prefixes:
                body = completion(prompt=f"{prefix} question {turn}")
                assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
        served = engine_of(cluster)
        engines = [{served[p] for p in served if p.startswith(prefix)} for prefix in prefixes]
        if policy is mp.Policy.PREFIX_AWARE:
            assert all(len(used) == 1 for used in engines), engines
        hits = sum(s.hits for fake in cluster.prefills for s in fake.sims)
        queries = sum(s.queries for fake in cluster.prefills for s in fake.sims)
        rates[policy] = hits / queries
    # Each prefix computed once, then found: 3 turns of 4 hit their 1 KiB prefix.
    assert rates[mp.Policy.PREFIX_AWARE] > 0.6 > rates[mp.Policy.ROUND_ROBIN] + 0.3, rates


async def test_a_hot_prefix_spills_once_waiting_costs_more_than_computing_again(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        prefill_dp=(2, 2), prefill={"cache_blocks": 256, "token_time": 0.002}
    )
    prefix = long_prompt("the one system prompt", 2048)
    async with asyncio.timeout(FAST * 5):
        answers = await asyncio.gather(
            *(
                cluster.client.post(COMPLETIONS, json=completion(prompt=f"{prefix} q{i}"))
                for i in range(16)
            )
        )
    assert [a.status for a in answers] == [200] * 16
    per_engine = collections.Counter(engine_of(cluster).values())
    assert len(per_engine) >= 2, per_engine  # not all piled on the engine that had it first
    assert max(per_engine.values()) < 16
    samples = await scrape(cluster)
    assert (
        sample(samples, "mooncake_proxy_routing_decisions_total", stage="prefill", reason="spill")
        >= 1
    )


def arrived(cluster: Cluster, count: int) -> bool:
    return len(cluster.prefill_requests()) == count


async def test_a_new_hot_prefix_does_not_queue_up_behind_its_first_prefill(
    start_cluster: StartCluster,
) -> None:
    """At the default load weight (0.5) waiting weighs half of computing: the engine that
    computes a new prefix's first request would take every next one while that runs (cost 8
    to 9 against 16 here) and the share bound would let it. The queue bound sends the
    fourth one elsewhere: the mean of 4 engines' in-flight requests plus 2."""
    cluster = await start_cluster(
        prefill_dp=(2, 2), prefill={"cache_blocks": 256, "token_time": 0.0005}
    )
    assert cluster.config.prefill_load_weight == 0.5
    prefix = long_prompt("the one system prompt", 8192)  # 2048 fake tokens: about 1 s
    posts = []
    for i in range(6):  # one after another, each once the one before reached its engine
        body = completion(prompt=f"{prefix} q{i}")
        posts.append(asyncio.create_task(cluster.client.post(COMPLETIONS, json=body)))
        await eventually(functools.partial(arrived, cluster, i + 1))
    assert [(await post).status for post in posts] == [200] * 6
    served = engine_of(cluster)
    first = served[f"{prefix} q0"]
    assert sum(engine == first for engine in served.values()) <= 4, served


async def test_two_proxies_that_never_talked_send_a_new_prefix_to_the_same_engine(
    start_cluster: StartCluster, aiohttp_client: AiohttpClient
) -> None:
    """Two proxies, each sent the same new prefixes, place each on the same engine: the
    first of its hash order that had none yet, where that is among its first three.

    No load scrapes after the first: each proxy would see the other's requests at its own
    moments and place by them (the margin's case, tested on its own below). What is tested
    here is that the placement itself is the same function in every process. Only prompts
    with an engine not yet written among their first three are sent, so no placement turns
    on how far equal writes decayed: each process sees that at its own moments, and writes
    about 0.1 s apart (PLACE_ALIKE) were alike in one proxy and apart in the other on a busy
    machine (CI, 2026-12-07; 13 runs in 40 with two busy loops beside them)."""
    cluster = await start_cluster(prefill_dp=(2, 2, 2), load_interval=3600)
    other = await daemon_client(aiohttp_client, cluster.config)
    await wait_ready_(other)
    written: list[tuple[int, int]] = []
    tags = (f"tenant {n}" for n in itertools.count())
    while len(written) < 6:
        first_block = long_prompt(next(tags), 600)  # the same first block on both proxies
        order = hash_order(cluster, first_block)
        unwritten = [e for e in order if e not in written]
        if unwritten[0] not in order[:3]:
            continue
        for client, tail in ((cluster.client, "asked here"), (other, "asked there")):
            body = completion(prompt=f"{first_block} {tail}")
            assert (await client.post(COMPLETIONS, json=body)).status == 200
        served = engine_of(cluster)
        assert served[f"{first_block} asked here"] == served[f"{first_block} asked there"]
        assert served[f"{first_block} asked here"] == unwritten[0], written
        written.append(unwritten[0])


def hash_order(cluster: Cluster, prompt: str) -> tuple[tuple[int, int], ...]:
    """The prefill engines (instance, DP rank) in the order a new prefix's hash ranks them,
    as every proxy process ranks them."""
    placement = mp.route_key(COMPLETIONS, completion(prompt=prompt), None).placement
    fleet = cluster.client.app[mp.STATE_KEY].fleet
    ring = sorted(
        (point, (i, e.dp_rank))
        for i, p in enumerate(fleet.prefills)
        for e in p.engines
        for point in mp.ring_points(e.seed)
    )
    start = bisect.bisect_left(ring, (mp.mix64(placement),))
    return tuple(dict.fromkeys(engine for _, engine in ring[start:] + ring[:start]))


async def test_new_prefixes_that_hash_alike_spread_over_three_engines_by_their_writes(
    start_cluster: StartCluster,
) -> None:
    """Six new prompts, each with a first block of its own, whose hash ranks the same three
    engines first: each goes to the one of the three written least lately, so they share
    the writes, where the first of the order alone would take them all."""
    cluster = await start_cluster(prefill_dp=(2, 2))
    tags = (f"tenant {n}" for n in itertools.count())
    by_order: dict[tuple[tuple[int, int], ...], list[str]] = collections.defaultdict(list)
    while not any(len(prompts) == 6 for prompts in by_order.values()):
        prompt = long_prompt(next(tags), 1024)
        by_order[hash_order(cluster, prompt)[:3]].append(prompt)
    (three, prompts), *_ = ((o, p) for o, p in by_order.items() if len(p) == 6)
    for prompt in prompts:
        answer = await cluster.client.post(COMPLETIONS, json=completion(prompt=prompt))
        assert answer.status == 200
    served = collections.Counter(engine_of(cluster).values())
    assert served == {engine: 2 for engine in three}, (three, served)


@pytest.mark.parametrize("others_send", [False, True], ids=["alone", "with a replica"])
async def test_a_new_prefix_goes_to_the_least_written_by_a_margin_only_where_others_send(
    start_cluster: StartCluster, aiohttp_client: AiohttpClient, others_send: bool
) -> None:
    """Alone, a proxy knows every write it placed, and a new prefix goes to the least written
    of its three candidates, by however little. Where the engines' counts show another
    sender, whose writes this proxy does not see, it moves off the first only by a margin,
    so that replicas pick alike."""
    cluster = await start_cluster(prefill_dp=(2, 2), load_interval=0.05)
    engines = [e for p in cluster.client.app[mp.STATE_KEY].fleet.prefills for e in p.engines]
    await eventually(lambda: all(e.load.finished is not None for e in engines))
    if others_send:
        other = await daemon_client(aiohttp_client, cluster.config)
        await wait_ready_(other)
        for i in range(8):
            body = completion(prompt=f"another replica's prompt {i}")
            assert (await other.post(COMPLETIONS, json=body)).status == 200
        await eventually(lambda: sum(e.load.finished or 0 for e in engines) == 8)
    tags = (f"tenant {n}" for n in itertools.count())
    by_order: dict[tuple[tuple[int, int], ...], list[str]] = collections.defaultdict(list)
    while not any(len(prompts) == 4 for prompts in by_order.values()):
        tag = next(tags)
        by_order[hash_order(cluster, long_prompt(tag, 512))[:3]].append(tag)
    (three, tags_alike), *_ = ((o, t) for o, t in by_order.items() if len(t) == 4)
    # The first three are written 19, 18 and 20 blocks: the second is least, by 5%.
    sizes = (19, 18, 20, 4)
    prompts = [long_prompt(tag, n * 512) for tag, n in zip(tags_alike, sizes, strict=True)]
    for prompt in prompts:
        answer = await cluster.client.post(COMPLETIONS, json=completion(prompt=prompt))
        assert answer.status == 200
    served = engine_of(cluster)
    assert [served[p] for p in prompts[:3]] == list(three)
    assert served[prompts[3]] == (three[0] if others_send else three[1])


async def test_replicas_bound_an_engines_share_of_everyones_requests(
    start_cluster: StartCluster, aiohttp_client: AiohttpClient
) -> None:
    """The share bound counts what the engine says it finished (vllm:request_success_total),
    not only what this proxy sent: replicas that each send a part of a pile-up see all of it."""
    cluster = await start_cluster(prefill_dp=(2, 2), load_interval=0.05)
    other = await daemon_client(aiohttp_client, cluster.config)
    await wait_ready_(other)
    engines = [e for p in other.app[mp.STATE_KEY].fleet.prefills for e in p.engines]
    await eventually(lambda: all(e.load.finished is not None for e in engines))
    prefix = long_prompt("one system prompt", 2048)
    for i in range(5):
        body = completion(prompt=f"{prefix} asked here {i}")
        assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
    holder = engine_of(cluster)[f"{prefix} asked here 0"]
    assert set(engine_of(cluster).values()) == {holder}
    held = engines[2 * holder[0] + holder[1]]
    await eventually(lambda: held.load.finished == 5)  # the other replica counted all five
    for i in range(2):
        body = completion(prompt=f"{prefix} asked there {i}")
        assert (await other.post(COMPLETIONS, json=body)).status == 200
    served = engine_of(cluster)
    # Six of seven recent requests on one of four engines is over the mean plus 4.
    assert served[f"{prefix} asked there 0"] == holder
    assert served[f"{prefix} asked there 1"] != holder


async def test_a_session_stays_on_one_engine_whatever_its_prompts(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(prefill_dp=(2, 2))
    for session in ("alice", "bob", "carol"):
        for i in range(4):
            body = completion(prompt=f"unrelated prompt {session} {i} " * 3)
            response = await cluster.client.post(
                COMPLETIONS, json=body, headers={"X-Session-ID": session}
            )
            assert response.status == 200
        body = completion(prompt=f"one more from {session}", user=session)  # the body's user
        assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
    served = engine_of(cluster)
    for session in ("alice", "bob", "carol"):
        assert len({engine for prompt, engine in served.items() if session in prompt}) == 1
    samples = await scrape(cluster)
    assert (
        sample(samples, "mooncake_proxy_routing_decisions_total", stage="prefill", reason="session")
        == 15
    )


async def test_load_comes_from_each_engines_own_metrics(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(prefill_dp=(2,), load_interval=0.05)
    busy = cluster.prefills[0].sim(0)
    busy.waiting = 10  # rank 0 has a queue this proxy did not send: another replica's
    fleet = fleet_of(cluster)
    await eventually(lambda: fleet.prefills[0].engines[0].load.waiting == 10)
    for i in range(8):
        body = completion(prompt=f"short prompt {i}")  # under one block: placed by hash
        assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
        await asyncio.sleep(0.1)  # a scrape in between: rank 1's finished requests are gone
    assert set(engine_of(cluster).values()) == {(0, 1)}
    status = await (await cluster.client.get("/healthcheck")).json()
    rank0, rank1 = status["prefill"][0]["engines"]
    assert rank0["load"]["waiting"] == 10 and 0 <= rank0["load"]["age_s"] < 1
    assert rank1["index_blocks"] == 0 and status["decode"][0]["load"]["age_s"] is not None
    # Without /metrics the proxy says so and routes by its own counts.
    cluster.prefills[0].metrics_status = 404
    await eventually(lambda: fleet.prefills[0].load_error is not None)
    status = await (await cluster.client.get("/healthcheck")).json()
    assert "404" in status["prefill"][0]["load_error"]
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200


async def test_the_decode_that_holds_the_prefix_gets_it_and_pulls_less(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=2, decode={"cache_blocks": 128})
    prefix = long_prompt("shared document", 2048)
    for i in range(6):
        body = completion(prompt=f"{prefix} question {i}")
        assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
    used = [fake for fake in cluster.decodes if fake.requests]
    assert len(used) == 1  # decode weight 4, but nothing else ran: the prefix decides
    (sim,) = used[0].sims
    assert sim.local_hit_tokens >= 5 * (2048 // 64) * 16 - 16  # 5 of 6 found it there
    assert sim.transferred_tokens < sim.local_hit_tokens


async def test_a_restarted_engine_is_believed_to_hold_nothing(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(
        health_interval=0.05, load_interval=0.05, decode={"cache_blocks": 64}
    )
    fleet = fleet_of(cluster)
    prefix = long_prompt("before the restart", 2048)
    assert (await cluster.client.post(COMPLETIONS, json=completion(prompt=prefix))).status == 200
    (engine,) = fleet.prefills[0].engines
    decode = fleet.decodes[0]
    assert len(engine.index.blocks) == 4 and len(decode.index.blocks) == 4
    cluster.prefills[0].restart()  # new engine ids: new PrefillEngines, with empty indexes
    await eventually(lambda: fleet.prefills[0].engines[0] is not engine)
    assert fleet.prefills[0].engines[0].index.blocks == {}
    await eventually(lambda: decode.load.prefix_queries > 0)
    cluster.decodes[0].sims.clear()  # a decode's counters going back mean it restarted
    await eventually(lambda: decode.index.blocks == {})


@pytest.mark.parametrize("refuses", ["prefill", "decode"])
async def test_a_refused_prompt_leaves_none_of_its_blocks_in_the_indexes(
    start_cluster: StartCluster, refuses: str
) -> None:
    """A prompt past the instances' max_model_len, refused with vLLM's 400 by the prefill or
    by the decode (which answers first when both refuse): no instance cached it, so its picks
    are taken back, the blocks it shared with a prompt served before excepted. The picks
    recorded it at once (concurrent arrivals see it), so only what it added goes."""
    accepting = {"max_model_len": 1 << 26}
    cluster = await start_cluster(
        prefill={} if refuses == "prefill" else accepting,
        decode={} if refuses == "decode" else accepting,
    )
    fleet = fleet_of(cluster)
    served = long_prompt("a shared head", 4096)  # 1,024 tokens: within 4,096
    assert (await cluster.client.post(COMPLETIONS, json=completion(prompt=served))).status == 200
    targets: list[mp.Target] = [*fleet.prefills[0].engines, *fleet.decodes]
    held = [set(target.index.blocks) for target in targets]
    assert all(len(blocks) == 8 for blocks in held)
    refused = completion(prompt=served + long_prompt(" and more", 256 << 10))  # 64 Ki tokens
    answer = await cluster.client.post(COMPLETIONS, json=refused)
    assert answer.status == 400 and "maximum context length" in await answer.text()
    assert len(getattr(cluster, f"{refuses}s")[0].requests) == 2  # the one that refused it
    assert [set(target.index.blocks) for target in targets] == held
    for router in fleet.routers.values():  # the reverse indexes the decisions read too
        assert set(router.roster.held) <= set().union(*held)


# --- replicas told of each other's sends (--peer)


async def fake_pair(aiohttp_server: AiohttpServer) -> tuple[FakeVllm, list[str]]:
    """A prefill and a decode fake served here, and the flags that name them to a proxy
    process: every replica of a test stands in front of the same pair."""
    prefill = FakeVllm("prefill")
    api = await serve(aiohttp_server, prefill.api_app())
    bootstrap = await serve(aiohttp_server, prefill.bootstrap_app())
    prefill.api_url = f"http://127.0.0.1:{api.port}"
    decode = await serve(aiohttp_server, FakeVllm("decode").api_app())
    flags = ["--prefill", prefill.api_url, str(bootstrap.port)]
    return prefill, [*flags, "--decode", f"http://127.0.0.1:{decode.port}"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_replicas_told_of_each_others_sends_count_them_at_once(
    aiohttp_server: AiohttpServer, loop: str
) -> None:
    """Two replicas, each the other's --peer (and its own, as a Service name would list it):
    what one sends a prefill engine, the other counts there at once, not at the next scrape
    (--load-interval 60 keeps that away), and remembers its blocks there. A datagram that is
    not a peer's message is ignored, and the replica serves on."""
    _, pair = await fake_pair(aiohttp_server)
    ports = [free_port(), free_port()]
    flags = [*pair, "--loop", loop, "--load-interval", "60"]
    flags += [word for port in ports for word in ("--peer", f"127.0.0.1:{port}")]
    one, other = [
        await ProxyProcess.launch("--port", str(port), *flags, port=port) for port in ports
    ]
    try:
        async with aiohttp.ClientSession() as session:

            async def healthcheck(proxy: ProxyProcess) -> dict[str, Any]:
                async with session.get(f"{proxy.base}/healthcheck") as response:
                    payload: dict[str, Any] = await response.json()
                    return payload

            async def recent(proxy: ProxyProcess, whose: str = "recent") -> float:
                (engine,) = (await healthcheck(proxy))["prefill"][0]["engines"]
                return float(engine[whose])

            assert await recent(other, "peers_recent") == 0.0
            for n in range(5):
                body = completion(prompt=long_prompt(f"told {n}"))
                async with session.post(f"{one.base}{COMPLETIONS}", json=body) as response:
                    assert response.status == 200, await response.text()
            assert 4.0 < await recent(one) <= 5.0  # decayed over RECENT_SECONDS
            for _ in range(100):
                if await recent(other, "peers_recent") > 4.0:
                    break
                await asyncio.sleep(0.05)
            # Counted as its own would be, and shown apart (one page: both decayed to the same
            # moment); and where they went remembered.
            (engine,) = (await healthcheck(other))["prefill"][0]["engines"]
            assert 4.0 < engine["peers_recent"] <= engine["recent"] <= 5.0
            assert await recent(one, "peers_recent") == 0.0
            blocks = await recent(one, "index_blocks")
            assert blocks >= 5 and await recent(other, "index_blocks") == blocks
            told, heard = (await healthcheck(one))["peers"], (await healthcheck(other))["peers"]
            assert (told["told"], told["heard"], heard["heard"]) == (5, 0, 5)

            async def affinity(proxy: ProxyProcess) -> float:
                async with session.get(f"{proxy.base}/metrics") as response:
                    text = await response.text()
                name, labels = "mooncake_proxy_routing_decisions_total", {"stage": "prefill"}
                found = [
                    s.value
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                    if s.name == name and s.labels == labels | {"reason": "affinity"}
                ]
                return sum(found)

            # The blocks it heard are the ones it reads in the same prompt: a match, although
            # it never sent the prompt itself (another process's hash seed).
            body = completion(prompt=long_prompt("told 3"))
            async with session.post(f"{other.base}{COMPLETIONS}", json=body) as response:
                assert response.status == 200
            assert await affinity(other) == 1.0
            assert sorted(heard["addresses"]) == sorted(f"127.0.0.1:{port}" for port in ports)

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.sendto(b"not json", ("127.0.0.1", ports[1]))
                sock.sendto(b'{"replica": "x", "sends": 3}', ("127.0.0.1", ports[1]))
            for _ in range(100):
                if (await healthcheck(other))["peers"]["ignored"] == 2:
                    break
                await asyncio.sleep(0.05)
            assert (await healthcheck(other))["peers"]["ignored"] == 2
            body = completion(prompt=long_prompt("after the noise"))
            async with session.post(f"{other.base}{COMPLETIONS}", json=body) as response:
                assert response.status == 200
    finally:
        for proxy in (one, other):
            await proxy.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_replica_that_cannot_hear_its_peers_says_so_and_still_tells_them(
    aiohttp_server: AiohttpServer, loop: str
) -> None:
    """Its UDP port is taken: it logs why, serves on, and its sends still reach its peer."""
    prefill, pair = await fake_pair(aiohttp_server)
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer,
    ):
        port = free_port()
        taken.bind(("127.0.0.1", port))
        peer.bind(("127.0.0.1", 0))
        peer.setblocking(False)
        proxy = await ProxyProcess.launch(
            "--port", str(port), *pair, "--loop", loop,
            "--peer", f"127.0.0.1:{peer.getsockname()[1]}", port=port,
        )  # fmt: skip
        try:
            await eventually(lambda: any("cannot hear peers" in line for line in proxy.log.lines))
            async with aiohttp.ClientSession() as session:
                body = completion(prompt=long_prompt("told anyway"))
                async with session.post(f"{proxy.base}{COMPLETIONS}", json=body) as response:
                    assert response.status == 200
            events = asyncio.get_running_loop()
            data = await asyncio.wait_for(events.sock_recv(peer, 65536), 5)
            (send,) = json.loads(data)["sends"]
            assert send[0] == f"{prefill.api_url}#0"  # the engine, as every replica names it
            assert len(send[2]) == len(mp.route_key(COMPLETIONS, body, None).chain)
        finally:
            await proxy.stop()
