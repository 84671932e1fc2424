"""Precise routing on vLLM's KV cache events: the blocks engines report, matched against a
request's own token ids (the small tokenizer of tiny_tokenizer.py, as vLLM tokenizes); the
ZMQ feeds, their gaps, replays and late joins; and the proxy without the [precise] extra."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pytest_aiohttp import AiohttpClient, AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from fake_vllm import BLOCK_TOKENS, EngineSim, FakeVllm, build_tokenizer, prompt_blocks
from testing_support import (
    CHAT,
    COMPLETIONS,
    FAST,
    Cluster,
    ProxyProcess,
    StartCluster,
    chat,
    completion,
    daemon_client,
    engine_of,
    eventually,
    long_prompt,
    sample,
    scrape,
    subscribed,
    wait_ready_,
)

# --- precise routing: vLLM's KV cache events


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers")  # the [precise] extra's, as its tests' fakes tokenize
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    pytest.importorskip("transformers")  # what the proxy loads a tokenizer with
    return mp.PromptTokenizer.load(str(tokenizer_dir)).tokenizer


def test_kv_events_and_a_requests_tokens_hash_alike(tokenizer: Any) -> None:
    """The blocks an engine reports (BlockStored's token ids) and a request's own token ids
    give the same chain: what matters, not vLLM's own block hash, which never reaches here."""
    prompt = prompt_blocks("the proxy sends the prompt to the prefill server . " * 12, tokenizer)
    assert prompt.ids is not None and len(prompt.chain) >= 6
    blocks = len(prompt.chain)
    chain = mp.token_chain(prompt.ids, BLOCK_TOKENS)
    assert len(chain) == blocks
    held = mp.HeldBlocks()
    for event in EngineSim(64).kv_events(prompt, list(range(blocks)), []):
        held.apply(event)
    assert held.match(chain) == blocks and held.block_size == BLOCK_TOKENS
    # The engine evicts the tail: the request matches the head only.
    held.apply({"type": "BlockRemoved", "block_hashes": prompt.chain[-2:], "medium": "GPU"})
    assert held.match(chain) == blocks - 2
    # Another prompt with the same first blocks, then others.
    other = prompt.ids[: 3 * BLOCK_TOKENS] + [7] * (3 * BLOCK_TOKENS)
    assert held.match(mp.token_chain(other, BLOCK_TOKENS)) == 3
    # Blocks whose parent was never heard of cannot be placed in a chain: not believed held.
    orphan = prompt_blocks("cat dog bird fish horse . " * 12, tokenizer)
    assert orphan.ids is not None
    for event in EngineSim(64).kv_events(orphan, [2, 3], []):
        held.apply(event)
    assert held.unplaced == 2
    assert held.match(mp.token_chain(orphan.ids, BLOCK_TOKENS)) == 0
    # The array form older vLLM sends; LoRA blocks named by id alone (a request names an
    # adapter), offloaded copies and other groups skipped.
    first = ["BlockStored", [b"h1"], None, orphan.ids[:BLOCK_TOKENS], BLOCK_TOKENS, None]
    held.apply([*first[:1], [b"cpu copy"], *first[2:], "CPU"])
    assert held.match(mp.token_chain(orphan.ids, BLOCK_TOKENS)) == 0
    held.apply(first)
    assert held.match(mp.token_chain(orphan.ids, BLOCK_TOKENS)) == 1
    second = EngineSim(64).kv_events(orphan, [1], [])[0] | {"parent_block_hash": b"h1"}
    skipped_ones = (
        {"lora_id": 2}, {"medium": "CPU"}, {"group_idx": 1}, {"extra_keys": ["salt"]},
    )  # fmt: skip
    for skipped in skipped_ones:
        held.apply(second | skipped)
    assert held.match(mp.token_chain(orphan.ids, BLOCK_TOKENS)) == 1
    held.apply(second | {"extra_keys": [None]})  # what vLLM sends for plain text
    assert held.match(mp.token_chain(orphan.ids, BLOCK_TOKENS)) == 2
    with pytest.raises(ValueError):
        held.apply({"type": "BlockStored", "block_size": 0, "token_ids": []})
    with pytest.raises(ValueError):
        held.apply({"type": "Something"})
    held.apply({"type": "AllBlocksCleared"})
    assert held.match(chain) == 0 and len(held) == 0


def test_a_lora_adapters_blocks_count_only_for_requests_that_name_it(tokenizer: Any) -> None:
    """vLLM's block hashes include the adapter: the same prompt under another adapter, or
    under none, is other KV. Its events name the adapter (lora_name); a request that names
    it chains its token ids from the adapter's seed, as HeldBlocks chains those blocks."""
    prompt = prompt_blocks("the adapter reads the prompt . " * 12, tokenizer)
    assert prompt.ids is not None
    blocks = len(prompt.chain)
    held = mp.HeldBlocks()
    for event in EngineSim(64).kv_events(prompt, list(range(blocks)), []):
        held.apply(event | {"lora_id": 1, "lora_name": "sql"})
    base = mp.RouteKey(0, [], 0, False, tokens=prompt.ids)
    sql = mp.RouteKey(0, [], 0, False, tokens=prompt.ids, adapter=mp.adapter_seed("sql"))
    other = mp.RouteKey(0, [], 0, False, tokens=prompt.ids, adapter=mp.adapter_seed("chat"))
    assert held.match(sql.token_chain(BLOCK_TOKENS)) == blocks
    assert held.match(base.token_chain(BLOCK_TOKENS)) == 0
    assert held.match(other.token_chain(BLOCK_TOKENS)) == 0
    # The base model's blocks of the same prompt are held apart, and match base requests only.
    for event in EngineSim(64).kv_events(prompt, list(range(2)), []):
        held.apply(event | {"block_hashes": [b"base-" + h for h in event["block_hashes"]]})
    assert held.match(base.token_chain(BLOCK_TOKENS)) == 2
    assert held.match(sql.token_chain(BLOCK_TOKENS)) == blocks


def test_partial_block_entries_leave_the_engines_block_size_alone(tokenizer: Any) -> None:
    """Where vLLM hashes finer than it caches (hybrid models), it also publishes a prompt's
    tail as a partial entry: a BlockStored with the finer block_size. Whenever one comes, the
    engine's blocks stay matched at its cache block size."""
    prompt = prompt_blocks("the proxy sends the prompt to the prefill server . " * 12, tokenizer)
    assert prompt.ids is not None and len(prompt.chain) >= 4
    half = BLOCK_TOKENS // 2

    def partial(parent: object, start: int) -> dict[str, Any]:
        assert prompt.ids is not None
        tokens = prompt.ids[start : start + half]
        return {"type": "BlockStored", "block_hashes": [b"partial %d" % start],
                "parent_block_hash": parent, "token_ids": tokens, "block_size": half}  # fmt: skip

    held = mp.HeldBlocks()
    held.apply(partial(None, 0))  # a prompt shorter than a cache block comes first
    assert held.block_size == half
    for event in EngineSim(64).kv_events(prompt, [0, 1, 2], []):
        held.apply(event)
    chain = mp.token_chain(prompt.ids, BLOCK_TOKENS)
    assert held.block_size == BLOCK_TOKENS and held.match(chain) == 3 and len(held) == 3
    held.apply(partial(prompt.chain[2], 3 * BLOCK_TOKENS))  # the tail after the third
    assert held.block_size == BLOCK_TOKENS and held.match(chain) == 3 and len(held) == 3


def vllm_batches() -> list[list[Any]]:
    """Batches as vLLM publishes them ([ts, events, dp_rank]), events as maps (vLLM 0.32) or
    arrays (older vLLM), with what a view skips: LoRA blocks named by id alone, offloaded and
    other-group blocks, extra keys, partial entries, blocks whose parent it never heard of;
    and a LoRA adapter's blocks named (6, then 13 after it), which it holds on their own
    chain."""
    ids = list(range(100, 100 + 8 * BLOCK_TOKENS))

    def stored(hashes: list[Any], parent: Any, start: int, **more: Any) -> dict[str, Any]:
        tokens = ids[start * BLOCK_TOKENS : (start + len(hashes)) * BLOCK_TOKENS]
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": BLOCK_TOKENS, "lora_id": None,
                "medium": "GPU", "lora_name": None, "group_idx": 0} | more  # fmt: skip

    removed = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0}
    return [
        [1.0, [stored([1, 2], None, 0, extra_keys=[None, None]), stored([3], 2, 2)], 0],
        [2.0, [removed, stored([4, 5], 2, 2, extra_keys=[None, ["salt"]])]],
        [3.0, [stored([6], None, 0, lora_name="adapter"), stored([7], 2, 2, lora_id=3),
               stored([8], 2, 2, medium="CPU"), stored([9], 2, 2, group_idx=1),
               stored([10], 99, 2), stored([b"tail"], 5, 4, block_size=8)], 0],
        [4.0, [["BlockStored", [11, 12], 4, ids[64:96], BLOCK_TOKENS, None, "GPU"],
               ["BlockStored", [13], 6, ids[16:32], BLOCK_TOKENS, 1, "GPU", "adapter"],
               ["BlockStored", [14], 12, ids[96:112], BLOCK_TOKENS, None, "GPU", None, None, 1],
               ["BlockRemoved", [1], "CPU"], ["BlockRemoved", [4, 99], "GPU"]]],
        [5.0, [{"type": "AllBlocksCleared"}], 0],
        [6.0, [stored([21, 22], None, 0)], 0],
        [7.0, [["AllBlocksCleared"]], 0],
        [8.0, [stored([31], None, 0, block_size=True)]],  # not what vLLM sends: untyped
    ]  # fmt: skip


def test_typed_and_untyped_batches_leave_the_same_view() -> None:
    """vLLM's batches are decoded into msgspec's types (kv_batch_decoder), which is quicker
    to decode and apply; whatever is not what vLLM sends is decoded untyped and taken event by
    event, as before. Both leave a view the same after every batch."""
    msgspec = pytest.importorskip("msgspec")
    spec = mp.PrefillSpec(URL("http://p:1"), URL("http://p:2"))
    state = mp.ProxyState(mp.ProxyConfig(prefills=(spec,), decodes=(URL("http://d:1"),)))
    typed_feed, untyped_feed = mp.KvFeed("tcp://a:1", None), mp.KvFeed("tcp://b:1", None)
    decode, untyped = mp.kv_batch_decoder(), msgspec.msgpack.Decoder().decode
    for seq, batch in enumerate(vllm_batches()):
        payload = msgspec.msgpack.encode(batch)
        typed = decode(payload)
        assert isinstance(typed, list) == (seq == 7)  # typed unless not vLLM's
        mp.take_kv_batch(state, typed_feed, seq, typed)
        mp.take_kv_batch(state, untyped_feed, seq, untyped(payload))
        for name in ("chains", "known", "block_size", "unplaced", "stored_total"):
            assert getattr(typed_feed.held, name) == getattr(untyped_feed.held, name), (seq, name)
        if seq == 3:  # 1-4, 11, 12 stored, 3 and 4 removed (1 only as an offloaded copy)
            assert sorted(typed_feed.held.known, key=str) == [1, 11, 12, 13, 2, 6]
            ids = list(range(100, 100 + 2 * BLOCK_TOKENS))  # vllm_batches' first two blocks
            adapter = mp.token_chain(ids, BLOCK_TOKENS, mp.adapter_seed("adapter"))
            assert typed_feed.held.match(adapter) == 2
            assert typed_feed.held.unplaced == 1 and typed_feed.held.block_size == BLOCK_TOKENS
    assert len(typed_feed.held) == 0  # cleared; then a block_size of True (1): a partial entry
    assert typed_feed.problem is None and typed_feed.batches == 8
    # A batch as a map, and one with an event vLLM would not send, are decoded untyped.
    as_map = {"ts": 1.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 0}
    assert isinstance(decode(msgspec.msgpack.encode(as_map)), dict)
    odd = [1.0, [{"type": "BlockStored", "block_size": "sixteen"}], 0]
    assert isinstance(decode(msgspec.msgpack.encode(odd)), list)
    # A typed event msgspec accepts and the view does not: the rest of the batch goes on.
    zero = vllm_batches()[5]
    zero[1].insert(0, zero[1][0] | {"block_size": 0, "block_hashes": [41]})
    mp.take_kv_batch(state, typed_feed, 8, decode(msgspec.msgpack.encode(zero)))
    assert typed_feed.problem == "malformed event ignored: BlockStored with block_size 0"
    assert 21 in typed_feed.held.known and 41 not in typed_feed.held.known


def holders_of(views: list[mp.HeldBlocks], holders: dict[int, int]) -> dict[int, int]:
    """What ``holders`` should be: every chain each view attached to it holds, with its bit."""
    expected: dict[int, int] = {}
    for view in views:
        if view.holders is holders:
            for chain in view.chains:
                expected[chain] = expected.get(chain, 0) | view.bit
    return expected


def test_the_router_learns_which_engines_hold_a_chain_from_their_events() -> None:
    """Every view attached to a stage's holders keeps its bit there for exactly the chains
    it holds: through stored and removed blocks, a clear, and attaching elsewhere."""
    shared = [1, 2] * BLOCK_TOKENS  # two blocks every engine stores
    views = [mp.HeldBlocks() for _ in range(3)]
    holders: dict[int, int] = {}
    views[0].stored(None, [b"early"], [9] * BLOCK_TOKENS, BLOCK_TOKENS)  # before attaching
    for slot, view in enumerate(views):
        view.attach(holders, 1 << (slot * 40))  # bits past a machine word too
    assert holders == holders_of(views, holders) and len(holders) == 1
    for slot, view in enumerate(views):
        view.stored(None, [b"a", b"b"], shared, BLOCK_TOKENS)
        view.stored(b"b", [b"own %d" % slot], [slot] * BLOCK_TOKENS, BLOCK_TOKENS)
        assert holders == holders_of(views, holders)
    head = mp.token_chain(shared, BLOCK_TOKENS)[0]
    assert holders[head] == 1 | 1 << 40 | 1 << 80
    # A second vLLM block with the same tokens: the chain stays held until both are gone.
    views[1].stored(None, [b"again"], shared[:BLOCK_TOKENS], BLOCK_TOKENS)
    views[1].removed([b"a"])
    assert holders[head] == 1 | 1 << 40 | 1 << 80
    views[1].removed([b"again", b"b", b"never stored"])
    assert holders == holders_of(views, holders) and holders[head] == 1 | 1 << 80
    views[2].apply({"type": "AllBlocksCleared"})
    assert holders == holders_of(views, holders) and holders[head] == 1
    views[2].stored(None, [b"a"], shared, BLOCK_TOKENS)  # still attached after a clear
    assert holders[head] == 1 | 1 << 80
    # Attached to another stage's dict: gone from the first, all of it in the second.
    other: dict[int, int] = {}
    views[0].attach(other, 1 << 3)
    assert holders == holders_of(views, holders) and holders[head] == 1 << 80
    assert other == holders_of(views, other) and len(other) == 4
    views[0].attach(None, 0)  # detached: neither carries it
    assert other == {} and holders == holders_of(views, holders)
    views[0].removed([b"a"])
    assert holders == holders_of(views, holders) and other == {}
    for view in views[1:]:
        view.attach(None, 0)
    assert holders == {}


def test_the_token_ids_are_vllms_for_completions_and_chats(tokenizer: Any) -> None:
    prompt_tokenizer = mp.PromptTokenizer(tokenizer)
    text = "hello world ! how are you today ?"
    assert (
        prompt_tokenizer.tokens(COMPLETIONS, completion(prompt=text))
        == tokenizer(text)["input_ids"]
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert (
        prompt_tokenizer.tokens(CHAT, chat(messages=messages))
        == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )
    assert mp.prompt_token_ids(COMPLETIONS, completion(prompt=[5, 6, 7])) == [5, 6, 7]
    assert mp.prompt_token_ids(COMPLETIONS, completion(prompt=[[5, 6], [8]])) == [5, 6]
    assert mp.prompt_token_ids(COMPLETIONS, completion(prompt="text")) is None
    assert prompt_tokenizer.tokens(CHAT, chat(messages="not a list")) is None


def test_earlier_turns_and_shared_prefixes_are_not_tokenized_again(tokenizer_dir: Path) -> None:
    prompt_tokenizer = mp.PromptTokenizer.load(str(tokenizer_dir))
    whole = prompt_tokenizer.tokenizer
    messages = [{"role": "system", "content": "you are terse . " * 20}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn} , hello world !"})
        body = chat(messages=list(messages))
        rendered = whole.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = whole(rendered, add_special_tokens=False)["input_ids"]
        known = dict(prompt_tokenizer.pieces.known)
        assert prompt_tokenizer.tokens(CHAT, body) == expected
        if turn:  # only the new turn's pieces were encoded
            assert len(prompt_tokenizer.pieces.known) - len(known) <= 2
        messages.append({"role": "assistant", "content": f"answer {turn} ."})
    # Completions with one long prefix: its first pieces are encoded once, the ids the same.
    prefix = "the proxy sends the prompt to the prefill server . " * 80
    for question in ("how are you today ?", "one two three"):
        known = dict(prompt_tokenizer.pieces.known)
        text = f"{prefix} {question}"
        assert (
            prompt_tokenizer.tokens(COMPLETIONS, completion(prompt=text))
            == whole(text)["input_ids"]
        )
        assert whole(text)["input_ids"][0] == whole.bos_token_id  # with the special tokens
    assert len(prompt_tokenizer.pieces.known) - len(known) == 1  # only the last piece was new
    pieces = mp.cut("word " * 600)  # cut before a space between words, past 1,024 characters
    assert "".join(pieces) == "word " * 600 and [len(p) for p in pieces] == [1024, 1025, 951]
    assert all(piece.startswith(" word") for piece in pieces[1:])
    # A tokenizer whose markers strip the text around them is not split: encoded whole.
    tokenizers = pytest.importorskip("tokenizers")
    stripping = mp.PromptTokenizer.load(str(tokenizer_dir))
    stripping.tokenizer.add_special_tokens(
        {"additional_special_tokens": [tokenizers.AddedToken("<|tool|>", lstrip=True)]}
    )
    stripping = mp.PromptTokenizer(stripping.tokenizer)
    assert not stripping.pieces.usable
    assert stripping.tokens(CHAT, chat(messages=messages)) is not None


def test_a_prompt_is_read_only_as_far_as_the_engines_hold_it(tokenizer_dir: Path) -> None:
    """A long prompt no engine holds costs one step of tokenizing on its request's path; one
    whose head an engine holds is read past that head, and matches it as the whole would;
    the rest, read after the decision, leaves every piece encoded for the next turn."""
    prompt_tokenizer = mp.PromptTokenizer.load(str(tokenizer_dir))
    for _ in range(2 * mp.PromptPieces.CHECKS):  # past the first requests, read whole to check
        prompt_tokenizer.tokens(COMPLETIONS, completion(prompt=f"{_} red green ."))
        prompt_tokenizer.tokens(CHAT, chat(messages=[{"role": "user", "content": "hi"}]))
    words = "the proxy sends the prompt to the prefill server . decode pulls it . "
    turns = [{"role": "user", "content": f"turn {i} . " + words * 60} for i in range(8)]
    body = chat(messages=turns)  # about 34,000 characters, 9,000 tokens
    whole = prompt_tokenizer.tokens(CHAT, body)
    assert whole is not None
    prompt_tokenizer.pieces.known = {}
    held = mp.HeldBlocks()  # an engine that holds another prompt only
    held.stored(None, [b"other"], [3] * BLOCK_TOKENS, BLOCK_TOKENS)
    route = mp.route_key(CHAT, body, None)
    reading = mp.TokenReading(prompt_tokenizer, CHAT, body, [held])
    reading.read()
    assert reading.tokens is not None and reading.tokens == whole[: len(reading.tokens)]
    assert reading.share < 0.1  # a step or two of new pieces, not the whole prompt
    assert sum(map(len, prompt_tokenizer.pieces.known)) <= 4 * mp.PromptPieces.FIRST_STEP
    key = reading.key(route)
    assert key.token_blocks(BLOCK_TOKENS) == pytest.approx(len(whole) / BLOCK_TOKENS, rel=0.15)
    reading.rest()  # what the proxy does after the decision, in a thread
    assert prompt_tokenizer.tokens(CHAT, body) == whole
    # An engine that holds the first 70% of it: read past that, and matched as the whole is.
    head = whole[: len(whole) * 7 // 10 // BLOCK_TOKENS * BLOCK_TOKENS]
    held.stored(None, [f"b{i}".encode() for i in range(len(head) // BLOCK_TOKENS)],
                head, BLOCK_TOKENS)  # fmt: skip
    prompt_tokenizer.pieces.known = {}
    reading = mp.TokenReading(prompt_tokenizer, CHAT, body, [held])
    reading.read()
    assert reading.tokens is not None and 0.7 < reading.share < 1.0
    chain = reading.key(route).token_chain(BLOCK_TOKENS)
    assert held.match(chain) == held.match(mp.token_chain(whole, BLOCK_TOKENS))
    assert held.match(chain) == len(head) // BLOCK_TOKENS
    # Held all through: read to the end. Evicted again, read as far as a new prompt.
    held.stored(None, [f"w{i}".encode() for i in range(len(whole) // BLOCK_TOKENS)],
                whole, BLOCK_TOKENS)  # fmt: skip
    reading = mp.TokenReading(prompt_tokenizer, CHAT, body, [held])
    reading.read()
    assert reading.share == 1.0 and reading.tokens == whole
    held.removed([f"w{i}".encode() for i in range(len(whole) // BLOCK_TOKENS)])
    held.removed([f"b{i}".encode() for i in range(len(head) // BLOCK_TOKENS)])
    prompt_tokenizer.pieces.known = {}  # pieces encoded before cost nothing to read again
    reading = mp.TokenReading(prompt_tokenizer, CHAT, body, [held])
    reading.read()
    assert reading.share < 0.1
    # An empty prompt is its special tokens.
    empty = mp.TokenReading(prompt_tokenizer, COMPLETIONS, completion(prompt=""), [held])
    empty.read()
    assert empty.tokens == prompt_tokenizer.tokenizer("")["input_ids"] and empty.share == 1.0
    # Not a prompt it can tokenize (no messages; a lone surrogate, which JSON can carry and
    # the tokenizer refuses): the key stays as it was, and vLLM answers the request.
    for path, odd_body in (
        (CHAT, chat(messages="not a list")), (COMPLETIONS, completion(prompt="a \ud800 b")),
    ):  # fmt: skip
        odd = mp.TokenReading(prompt_tokenizer, path, odd_body, [held])
        odd.read()
        odd.rest()
        assert odd.key(route) is route
        assert prompt_tokenizer.tokens(path, odd_body) is None


def test_the_piece_cache_starts_again_when_full(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its limit the cache keeps only the newest pieces, and prompts still come out
    whole and right."""
    prompt_tokenizer = mp.PromptTokenizer.load(str(tokenizer_dir))
    monkeypatch.setattr(mp.PromptPieces, "LIMIT", 5000)
    whole = prompt_tokenizer.tokenizer
    for n in range(6):
        text = f"prompt {n} . " + "the proxy sends the prompt to the prefill server . " * 40
        assert (
            prompt_tokenizer.tokens(COMPLETIONS, completion(prompt=text))
            == whole(text)["input_ids"]
        )
        assert prompt_tokenizer.pieces.size <= 5000
        assert prompt_tokenizer.pieces.size == sum(map(len, prompt_tokenizer.pieces.known))


def precise(tokenizer: Any, cache_blocks: int = 256) -> dict[str, Any]:
    return {"cache_blocks": cache_blocks, "tokenizer": tokenizer}


async def warm(fake: FakeVllm, rank: int, body: dict[str, Any], path: str = COMPLETIONS) -> None:
    """A request straight to one engine, as another router (or replica) would send it."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            fake.api_url + path, json={**body, "max_tokens": 1},
            headers={"X-data-parallel-rank": str(rank)},
        ) as answer,
    ):  # fmt: skip
        assert answer.status == 200, await answer.text()


def feeds(cluster: Cluster) -> dict[str, mp.KvFeed]:
    return cluster.client.app[mp.STATE_KEY].fleet.feeds


async def test_routing_follows_the_blocks_engines_report(
    start_cluster: StartCluster, tokenizer: Any, tokenizer_dir: Path
) -> None:
    """Prefixes another router put on chosen engines: the proxy never saw them, the engines'
    events tell it where they are, and it sends each there (its estimate alone could not)."""
    cluster = await start_cluster(
        prefill_dp=(2, 2), prefill=precise(tokenizer), kv_events=True,
        tokenizer=str(tokenizer_dir),
    )  # fmt: skip
    await eventually(lambda: cluster.client.app[mp.STATE_KEY].tokenizer is not None)
    placed = {}
    for i in range(8):
        instance, rank = i % 2, i // 2 % 2
        if i % 2:
            system = {"role": "system", "content": f"tenant {i} . " + "red green blue . " * 30}
            body = chat(messages=[system, {"role": "user", "content": "hello"}])
            await warm(cluster.prefills[instance], rank, body, CHAT)
            messages = [*body["messages"], {"role": "assistant", "content": "hi"}]
            body = chat(messages=[*messages, {"role": "user", "content": "and now ?"}])
        else:
            prefix = f"tenant {i} . " + "one two three four . " * 30
            await warm(cluster.prefills[instance], rank, completion(prompt=prefix))
            body = completion(prompt=prefix + " and a question")
        placed[i] = (body, (instance, rank))
    await eventually(lambda: sum(f.batches for f in feeds(cluster).values()) == 8)
    for body, (instance, rank) in placed.values():
        before = len(cluster.prefills[instance].requests)
        path = CHAT if "messages" in body else COMPLETIONS
        assert (await cluster.client.post(path, json=body)).status == 200
        assert len(cluster.prefills[instance].requests) == before + 1
        assert cluster.prefills[instance].requests[-1].headers["X-data-parallel-rank"] == str(rank)
    status = (await (await cluster.client.get("/healthcheck")).json())["prefill"][0]
    assert status["engines"][0]["kv_source"].startswith("kv events (tcp://127.0.0.1:")
    assert status["engines"][0]["kv_blocks"] > 0


async def test_long_prompts_go_to_the_engine_that_holds_the_most_of_them(
    start_cluster: StartCluster, tokenizer: Any, tokenizer_dir: Path
) -> None:
    """Long prefixes another router put on two engines, a short head of each on one and the
    whole on the other: the proxy reads each prompt past the head (it stops only where no
    engine holds it) and sends it where the whole is."""
    cluster = await start_cluster(
        prefill_dp=(2, 2), prefill=precise(tokenizer, cache_blocks=4096), kv_events=True,
        tokenizer=str(tokenizer_dir),
    )  # fmt: skip
    await eventually(lambda: cluster.client.app[mp.STATE_KEY].tokenizer is not None)
    words = "the proxy sends the prompt to the prefill server . decode pulls it . "
    engines = [(0, 0), (0, 1), (1, 0), (1, 1)]
    placed = {}
    for i in range(4):
        prefix = f"tenant {i} . {words}" * 180  # 14 KB, its own throughout: steps of reading
        short, whole = engines[i], engines[3 - i]
        await warm(cluster.prefills[short[0]], short[1], completion(prompt=prefix[:5000]))
        await warm(cluster.prefills[whole[0]], whole[1], completion(prompt=prefix))
        placed[prefix + " and a question"] = whole
    await eventually(lambda: sum(f.batches for f in feeds(cluster).values()) == 8)
    for i in range(mp.PromptPieces.CHECKS):  # read whole, to check the reading by pieces
        body = completion(prompt=f"warming up {i} . " + words)
        assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
    for prompt, (instance, rank) in placed.items():
        before = len(cluster.prefills[instance].requests)
        body = completion(prompt=prompt)
        assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
        assert len(cluster.prefills[instance].requests) == before + 1
        assert cluster.prefills[instance].requests[-1].headers["X-data-parallel-rank"] == str(rank)


async def test_a_prompt_the_tokenizer_refuses_is_routed_on_estimates(
    start_cluster: StartCluster, tokenizer: Any, tokenizer_dir: Path
) -> None:
    """A lone surrogate (JSON can carry one) makes the tokenizer raise: the proxy routes that
    request as it would without events, and vLLM answers it (400, as vLLM 0.32 does), not an
    internal error."""
    cluster = await start_cluster(
        prefill=precise(tokenizer), kv_events=True, tokenizer=str(tokenizer_dir)
    )
    await eventually(lambda: cluster.client.app[mp.STATE_KEY].tokenizer is not None)
    await warm(cluster.prefills[0], 0, completion(prompt="red green blue . " * 20))
    await eventually(lambda: cluster.client.app[mp.STATE_KEY].fleet.hears_kv_events)
    raw = b'{"model": "fake-model", "max_tokens": 4, "prompt": "a \\ud800 b"}'
    headers = {"Content-Type": "application/json"}
    response = await cluster.client.post(COMPLETIONS, data=raw, headers=headers)
    assert response.status == 400, await response.text()
    assert "TextEncodeInput" in (await response.json())["error"]["message"]
    assert len(cluster.prefills[0].requests) == 2  # it reached the engine


async def test_kv_event_gaps_are_replayed_or_counted(
    start_cluster: StartCluster, tokenizer: Any
) -> None:
    for replay in (True, False):
        cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True, kv_replay=replay)
        publisher = cluster.prefills[0].sim(0).events
        assert publisher is not None
        publisher.drop = {1}  # the second batch is lost on the way
        prompts = [f"prompt {i} . " + "alpha beta gamma delta . " * 12 for i in range(3)]
        for prompt in prompts:
            await warm(cluster.prefills[0], 0, completion(prompt=prompt))
        (feed,) = (f for f in feeds(cluster).values() if f.engine_id is not None)
        await eventually(lambda feed=feed: feed.next_seq == 3)  # type: ignore[misc]
        lost = mp.token_chain(tokenizer(prompts[1])["input_ids"], BLOCK_TOKENS)
        samples = await scrape(cluster)
        missed = sample(samples, "mooncake_proxy_kv_event_batches_total", result="missed")
        if replay:
            assert feed.gaps == 0 and missed == 0
            assert feed.held.match(lost) == len(lost)
        else:
            assert feed.gaps == 1 and missed == 1
            assert feed.held.match(lost) == 0
        await cluster.client.close()


async def test_a_replay_that_does_not_answer_is_not_asked_again_at_once(
    start_cluster: StartCluster, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ask holds the engine's live events back until it times out: after one that did
    not answer, the next gaps are counted as missed for a while instead."""
    monkeypatch.setattr(mp, "REPLAY_TIMEOUT", 0.5)
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True, kv_replay=True)
    publisher = cluster.prefills[0].sim(0).events
    assert publisher is not None
    (feed,) = (f for f in feeds(cluster).values() if f.engine_id is not None)
    await eventually(lambda: publisher.replay_requests == 1 and not feed.joining)  # the join
    publisher.replay_delay, publisher.drop = 60.0, {1, 3}  # two batches lost, replay stuck
    for i in range(5):
        await warm(cluster.prefills[0], 0, completion(prompt=f"prompt {i} . " + "red . " * 40))
    await eventually(lambda: feed.next_seq == 5, seconds=FAST + 1)
    assert publisher.replay_requests == 2  # the first gap's, not the second's
    assert feed.gaps == 2 and "replay" in feed.logged  # "replay ... did not answer"


async def test_a_proxy_that_joins_late_learns_earlier_blocks_by_replay(
    start_cluster: StartCluster, tokenizer: Any, aiohttp_client: AiohttpClient
) -> None:
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True, kv_replay=True)
    (prefill,) = cluster.prefills
    earlier = "cat dog bird fish horse . " * 12
    await warm(prefill, 0, completion(prompt=earlier))
    late = await daemon_client(aiohttp_client, cluster.config)
    await wait_ready_(late)
    (feed,) = (f for f in late.app[mp.STATE_KEY].fleet.feeds.values() if f.engine_id)
    chain = mp.token_chain(tokenizer(earlier)["input_ids"], BLOCK_TOKENS)
    # At once, not when the engine next speaks: that is when traffic comes.
    await eventually(lambda: feed.live and feed.held.match(chain) == len(chain))
    assert feed.gaps == 0 and feed.next_seq == 1
    await warm(prefill, 0, completion(prompt="red green blue yellow . " * 12))
    await eventually(lambda: feed.next_seq == 2)
    assert feed.gaps == 0 and feed.held.match(chain) == len(chain)


async def test_a_replay_whose_tail_was_dropped_is_asked_again_from_where_it_stopped(
    start_cluster: StartCluster, tokenizer: Any, aiohttp_client: AiohttpClient
) -> None:
    """A ROUTER whose queue overflowed drops the rest of a replay, end marker included (a
    loaded machine's proxy read slower than vLLM sent): once the batches stop coming for
    REPLAY_STALL, the proxy asks for the rest, and misses nothing."""
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True, kv_replay=True)
    publisher = cluster.prefills[0].sim(0).events
    assert publisher is not None
    for n in range(100):
        publisher.publish([{
            "type": "BlockStored", "block_hashes": [n], "block_size": 16,
            "parent_block_hash": n - 1 if n else None, "token_ids": list(range(16)),
        }])  # fmt: skip
    publisher.replay_cut, asked = 40, publisher.replay_requests
    late = await daemon_client(aiohttp_client, cluster.config)
    await wait_ready_(late)
    (feed,) = (f for f in late.app[mp.STATE_KEY].fleet.feeds.values() if f.engine_id)
    await eventually(lambda: feed.live, seconds=mp.REPLAY_STALL + FAST)
    assert publisher.replay_requests == asked + 2  # the join's, and the rest's from batch 40
    assert feed.gaps == 0 and feed.next_seq == 100 and len(feed.held) == 100
    assert feed.problem is None


async def test_a_proxy_that_joins_a_full_replay_buffer_misses_nothing(
    start_cluster: StartCluster, tokenizer: Any, aiohttp_client: AiohttpClient
) -> None:
    """vLLM answers a replay with its whole buffer at once, and its ROUTER drops what its
    queue (1,000) cannot hold while the reader is slower: the proxy must take it all in,
    end marker included, or its join waits out the replay's timeout with batches missed."""
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True, kv_replay=True)
    (prefill,) = cluster.prefills
    publisher = prefill.sim(0).events
    assert publisher is not None
    # 8,000 batches of 3 KB: more than both sockets' queues (1,000 each) and the loopback's
    # buffers hold, since the fake, like vLLM, sends them all before the proxy reads one.
    batches, blocks, size = 8000, 4, 256
    for n in range(batches):  # one chain, as a long run of prompts leaves it
        hashes = [n * blocks + i for i in range(blocks)]
        publisher.publish([{
            "type": "BlockStored", "block_hashes": hashes, "block_size": size,
            "parent_block_hash": hashes[0] - 1 if n else None,
            "token_ids": [(n + i) % 1000 for i in range(blocks * size)],
        }])  # fmt: skip
    started = time.monotonic()
    late = await daemon_client(aiohttp_client, cluster.config)
    await wait_ready_(late)
    (feed,) = (f for f in late.app[mp.STATE_KEY].fleet.feeds.values() if f.engine_id)
    await eventually(lambda: feed.live, seconds=mp.REPLAY_TIMEOUT + 5)
    assert feed.gaps == 0 and feed.next_seq == batches
    assert len(feed.held) == batches * blocks
    assert time.monotonic() - started < mp.REPLAY_TIMEOUT  # the end marker came too


async def test_batches_published_while_a_proxy_catches_up_are_applied_once(
    start_cluster: StartCluster, tokenizer: Any, aiohttp_client: AiohttpClient
) -> None:
    """The live stream repeats what the join's replay already had: not a restart."""
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True, kv_replay=True)
    (prefill,) = cluster.prefills
    publisher = prefill.sim(0).events
    assert publisher is not None
    earlier = "cat dog bird fish horse . " * 12
    await warm(prefill, 0, completion(prompt=earlier))
    publisher.replay_delay = 1.0
    asked = publisher.replay_requests
    late = await daemon_client(aiohttp_client, cluster.config)
    await wait_ready_(late)
    (feed,) = (f for f in late.app[mp.STATE_KEY].fleet.feeds.values() if f.engine_id)
    # Subscribed, its replay asked for and not answered yet.
    await eventually(lambda: subscribed(prefill, 2) and publisher.replay_requests > asked)
    during = "red green blue yellow . " * 12
    await warm(prefill, 0, completion(prompt=during))
    # One more after it: in order on the one socket, so once it is applied the live copy of
    # batch 1, which the replay also had, was read before it.
    after = "one two three four . " * 12
    await warm(prefill, 0, completion(prompt=after))
    await eventually(lambda: feed.next_seq == 3)
    for prompt in (earlier, during, after):
        chain = mp.token_chain(tokenizer(prompt)["input_ids"], BLOCK_TOKENS)
        assert feed.held.match(chain) == len(chain)
    assert feed.gaps == 0 and feed.live
    assert feed.batches == 3  # each applied once, the view never cleared and replayed again


async def test_a_restarted_engine_is_forgotten_by_its_events(
    start_cluster: StartCluster, tokenizer: Any
) -> None:
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True)
    (prefill,) = cluster.prefills
    before = "cat dog bird fish horse . " * 12
    await warm(prefill, 0, completion(prompt=before))
    (feed,) = (f for f in feeds(cluster).values() if f.engine_id is not None)
    old = mp.token_chain(tokenizer(before)["input_ids"], BLOCK_TOKENS)
    await eventually(lambda: feed.held.match(old) == len(old))
    prefill.restart()  # its caches empty, its publisher counting from 0 again
    await eventually(lambda: subscribed(prefill))  # the subscriber reconnected to the new one
    after = "red green blue yellow . " * 12
    await warm(prefill, 0, completion(prompt=after))
    new = mp.token_chain(tokenizer(after)["input_ids"], BLOCK_TOKENS)
    await eventually(lambda: feed.held.match(new) == len(new))
    assert feed.held.match(old) == 0


async def test_malformed_kv_events_are_logged_once_and_ignored(
    start_cluster: StartCluster, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True)
    publisher = cluster.prefills[0].sim(0).events
    assert publisher is not None
    for _ in range(3):
        publisher.send([b"only one frame"])
        publisher.send([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
    publisher.publish([{"type": "BlockStored", "block_size": "sixteen"}])
    prompt = "one two three four five six . " * 12
    await warm(cluster.prefills[0], 0, completion(prompt=prompt))  # good batches go on
    (feed,) = (f for f in feeds(cluster).values() if f.engine_id is not None)
    chain = mp.token_chain(tokenizer(prompt)["input_ids"], BLOCK_TOKENS)
    await eventually(lambda: feed.held.match(chain) == len(chain))
    assert (await cluster.client.post(COMPLETIONS, json=completion(prompt=prompt))).status == 200
    warnings = [r.getMessage() for r in caplog.records if "KV events" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once each: a bad batch, a bad event
    assert all("Traceback" not in w for w in warnings)
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_kv_event_batches_total", result="malformed") >= 7


async def test_kv_event_batches_sent_as_maps_are_applied(
    start_cluster: StartCluster, tokenizer: Any
) -> None:
    # vLLM's EventBatch may be encoded as a map, as its events already are.
    cluster = await start_cluster(prefill=precise(tokenizer), kv_events=True)
    publisher = cluster.prefills[0].sim(0).events
    assert publisher is not None
    publisher.batch_as_map = True
    prompt = "one two three four five six . " * 12
    await warm(cluster.prefills[0], 0, completion(prompt=prompt))
    (feed,) = (f for f in feeds(cluster).values() if f.engine_id is not None)
    chain = mp.token_chain(tokenizer(prompt)["input_ids"], BLOCK_TOKENS)
    await eventually(lambda: feed.held.match(chain) == len(chain))
    assert feed.problem is None


async def test_an_engine_that_publishes_nothing_is_routed_on_estimates(
    start_cluster: StartCluster, tokenizer: Any
) -> None:
    cluster = await start_cluster(prefill_dp=(2,), prefill={"cache_blocks": 64}, kv_events=True)
    cluster.prefills[0].close_publishers()  # a dead publisher: nothing ever arrives
    prompt = long_prompt("a prefix", 1024)
    async with asyncio.timeout(FAST):
        for i in range(4):
            body = completion(prompt=f"{prompt} {i}")
            assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
    engines = (await (await cluster.client.get("/healthcheck")).json())["prefill"][0]["engines"]
    assert all(e["kv_source"].startswith("estimate (no KV events yet") for e in engines)
    assert len(set(engine_of(cluster).values())) == 1  # the estimate still keeps the affinity


async def test_without_the_precise_extra_routing_estimates(
    aiohttp_server: AiohttpServer, tmp_path: Path
) -> None:
    blocked = tmp_path / "zmq"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError(\"No module named 'zmq'\")\n")
    proxy, _ = await ProxyProcess.start(
        aiohttp_server, "--kv-events-port", "5557", env={"PYTHONPATH": str(tmp_path)}
    )
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{proxy.base}/v1/completions", json=completion()) as answer,
    ):
        assert answer.status == 200
    log = await proxy.stop()
    assert "needs the precise extra, pip install '.[precise]'" in log and "Traceback" not in log
