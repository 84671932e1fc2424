"""The fake vLLM server itself: vLLM 0.32's chunks with and without ``return_token_ids``, a
generation that continues token for token from the prompt's ids plus the ids generated so far
(what a proxy that moves a broken stream to another pair relies on), the mid-stream faults
tests inject, and the places where vLLM is less kind than a naive fake: its default caps, text
that comes in pieces of characters, stop strings that hold text back, reasoning deltas, its
in-band error's own JSON, tools without a parser, and the routes a proxy passes through.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fake_vllm import (
    ENGINE_FAILED,
    EOS_ID,
    FOLLOWS,
    MODEL,
    PIECES,
    SYSTEM_FINGERPRINT,
    THINK_END_ID,
    THINK_START_ID,
    VOCAB,
    WORD_ID_BASE,
    DecodeStream,
    FakeVllm,
    build_tokenizer,
    free_port,
    generate,
    start_fake,
    tokenizer_bytes,
)
from testing_support import until_healthy

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
GENERATE = "/inference/v1/generate"
PROMPT = "Explain prefill/decode disaggregation, é and 漢字 included"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello world ! how are you today ?"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    path: Path = tmp_path_factory.mktemp("tokenizer")
    return build_tokenizer(path)


@pytest.fixture
async def runners() -> AsyncIterator[list[web.AppRunner]]:
    started: list[web.AppRunner] = []
    yield started
    for runner in started:
        await runner.cleanup()


async def send(
    url: str, path: str, body: dict[str, Any], request_id: str = "r", method: str = "POST"
) -> tuple[int, bytes, str]:
    """The status, raw body and content type of an answer."""
    headers = {"X-Request-Id": request_id}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.read(), answer.headers.get("Content-Type", "")


async def post(
    url: str, path: str, body: dict[str, Any], request_id: str = "r"
) -> tuple[bytes, list[Any]]:
    """The raw answer, and its events (parsed, [DONE] as None) if streamed."""
    status, raw, _ = await send(url, path, {"model": MODEL, **body}, request_id)
    assert status == 200, raw
    if not body.get("stream"):
        return raw, [json.loads(raw)]
    assert raw.endswith(b"\n\n")
    events = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        events.append(None if event == b"data: [DONE]" else json.loads(event[6:]))
    return raw, events


async def refused(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, raw, _ = await send(url, path, {"model": MODEL, **body})
    return status, json.loads(raw)


def tokens_of(events: list[Any]) -> tuple[list[str], list[int], str | None]:
    """A one-choice stream's chunks' texts (one per token), their ids and how it finished."""
    texts, ids, finish = [], [], None
    for event in events:
        if event is None or not event["choices"]:
            continue
        choice = event["choices"][0]
        text = choice["delta"].get("content") if "delta" in choice else choice["text"]
        if choice.get("token_ids") is not None:
            texts.append(text)
            ids += choice["token_ids"]
        finish = choice["finish_reason"] or finish
    return texts, ids, finish


def prompt_ids_of(events: list[Any]) -> list[int]:
    first = events[0]
    ids = first.get("prompt_token_ids") or first["choices"][0]["prompt_token_ids"]
    assert isinstance(ids, list)
    return ids


def inside_a_character(token: int) -> bool:
    """Whether the model's text after this token is inside a character: a piece follows and
    this one ends in a byte of a multibyte character (not café's " caf")."""
    return token in FOLLOWS and PIECES[token][-1] >= 0x80


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["bytes", "tokenizer"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completion", "chat"])
async def test_a_stream_continues_token_for_token_from_its_ids(
    runners: list[web.AppRunner], request: pytest.FixtureRequest, path: str, with_tokenizer: bool
) -> None:
    """A completion of the prompt's ids plus the first k generated ids, with k fewer tokens
    to go, streams exactly the rest of the uninterrupted answer: same ids, same finish,
    whatever k; the same text too where k ends between characters."""
    tokenizer = request.getfixturevalue("tokenizer") if with_tokenizer else None
    fake = await start_fake(FakeVllm("decode", tokenizer=tokenizer), runners)
    prompt: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    body = {**prompt, "max_tokens": 24, "stream": True, "return_token_ids": True}
    _, events = await post(fake.url, path, body)
    texts, ids, finish = tokens_of(events)
    prompt_ids = prompt_ids_of(events)
    assert len(texts) == len(ids) == 24 and finish == "length"
    assert any(map(inside_a_character, ids)) and "" in texts  # pieces of characters
    if with_tokenizer:  # the tokenizer's ids, as vLLM's
        prompt_text = MESSAGES if path == CHAT else PROMPT
        blocks = fake.fake.prompt_blocks(prompt_text)
        assert prompt_ids == blocks.ids
    for cut in range(1, 24):
        rest = {"prompt": prompt_ids + ids[:cut], "max_tokens": 24 - cut}
        _, more = await post(
            fake.url, COMPLETIONS, rest | {"stream": True, "return_token_ids": True}
        )
        more_texts, more_ids, more_finish = tokens_of(more)
        assert (more_ids, more_finish) == (ids[cut:], "length"), cut
        assert prompt_ids_of(more) == prompt_ids + ids[:cut]
        _, (whole,) = await post(fake.url, COMPLETIONS, rest | {"return_token_ids": True})
        assert whole["choices"][0]["token_ids"] == ids[cut:]
        assert whole["usage"]["prompt_tokens"] == len(prompt_ids) + cut
        if not inside_a_character(ids[cut - 1]):
            assert more_texts == texts[cut:], cut
            assert whole["choices"][0]["text"] == "".join(texts[cut:])


async def test_a_continuation_from_inside_a_character_begins_with_the_prompts_text(
    runners: list[web.AppRunner],
) -> None:
    """vLLM's DecodeStream primed with a prompt that ends inside a character never takes the
    prompt as its prefix: the first text it lets out is the whole prompt's text and the new
    text (seen on vLLM 0.32). A proxy continuing a stream there receives that garbage."""
    fake = await start_fake(FakeVllm("decode"), runners)
    whole = generate(PROMPT, {"max_tokens": 40})
    cut = next(n + 1 for n, t in enumerate(whole.token_ids) if inside_a_character(t))
    rest = {"prompt": whole.prompt_token_ids + whole.token_ids[:cut], "max_tokens": 40 - cut}
    _, events = await post(fake.url, COMPLETIONS, rest | {"stream": True})
    texts = [e["choices"][0]["text"] for e in events if e is not None]
    first = next(text for text in texts if text)
    assert first.startswith(PROMPT + "".join(whole.deltas[:cut]).rstrip("\ufffd"))
    assert "".join(texts) != "".join(whole.deltas[cut:])
    _, (answer,) = await post(fake.url, COMPLETIONS, rest)
    assert answer["choices"][0]["text"].startswith(PROMPT)


def test_its_text_comes_as_vllms_detokenizer_lets_it_out() -> None:
    """Pieces of multibyte characters: a step inside a character streams "", the one that
    finishes it the whole character (and what came before, if that piece began the next one,
    as 日本's middle token does); the whole text is valid UTF-8 and the deltas joined."""
    seen: set[str] = set()
    for number in range(20):
        generation = generate(f"{PROMPT} {number}", {"max_tokens": 60})
        assert "".join(generation.deltas) == generation.text
        assert "\ufffd" not in generation.text
        for token, delta in zip(generation.token_ids, generation.deltas, strict=True):
            if inside_a_character(token):
                assert delta == ""
            seen.add(delta)
    assert {" é", " ☃", " 日本", " 🚀", "é"} <= seen  # café's é: one token, one character


def test_its_decode_stream_is_tokenizers_own(tokenizer: Any) -> None:
    """The fake's DecodeStream against tokenizers' (what vLLM's FastIncrementalDetokenizer
    steps) over the tiny byte-level tokenizer: random prompts and continuations, characters
    split anywhere, stray bytes, special tokens; the same text at every step."""
    from tokenizers.decoders import DecodeStream as RealDecodeStream

    table = tokenizer_bytes(tokenizer)
    byte_id = {piece[0]: token for token, piece in enumerate(table) if len(piece) == 1}
    rng = random.Random(7)

    def some(count: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < count:
            if rng.random() < 0.4:  # a character, its bytes one token each
                ids += [byte_id[b] for b in rng.choice("é☃日本🚀a").encode()]
            else:  # any token: a word, a stray byte, a special one
                ids.append(rng.randrange(len(table)))
        return ids[:count]

    for _ in range(400):
        prompt, steps = some(rng.randrange(0, 6)), some(rng.randrange(1, 10))
        real = RealDecodeStream(ids=prompt, skip_special_tokens=True)
        ours = DecodeStream(b"".join(table[t] for t in prompt) if prompt else None)
        for token in steps:
            expected = real.step(tokenizer.backend_tokenizer, token)
            assert ours.step(table[token]) == expected, (prompt, steps)


def test_stop_strings_end_the_answer_as_vllms_detokenizer_does() -> None:
    """A stop string ends the answer once its text shows: the text cut before it (after it
    with include_stop_str_in_output), finish "stop" and stop_reason the string; while it
    could still be forming, the stream holds back len - 1 characters, but every step still
    returns its token. min_tokens: no stop before more than that many tokens."""
    free = generate(PROMPT, {"max_tokens": 60})
    word = next(w for w in VOCAB if f" {w}" in free.text[10:])
    start = free.text.index(f" {word}", 10)
    stop = f" {word}"
    body: dict[str, Any] = {"max_tokens": 60, "stop": [stop, "zzzzzzzzzz"]}
    cut = generate(PROMPT, body)
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.text == free.text[:start] and "".join(cut.deltas) == cut.text
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]  # the token with it included
    held = [len("".join(cut.deltas[: n + 1])) for n in range(len(cut.deltas) - 1)]
    shown = [len(generate(PROMPT, {"max_tokens": n + 1}).text) for n in range(len(held))]
    assert all(h == max(s - 9, 0) for h, s in zip(held, shown, strict=True))  # 10 - 1 held
    kept = generate(PROMPT, body | {"include_stop_str_in_output": True, "stop": stop})
    assert kept.text == free.text[: start + len(stop)] and kept.stop_reason == stop
    late = generate(PROMPT, body | {"min_tokens": len(cut.token_ids)})
    assert late.finish_reason != "stop" or len(late.text) > start


def test_stop_tokens_and_eos_are_returned_and_counted_but_not_text() -> None:
    """stop_token_ids: the answer ends at the token, stop_reason its id, its id in token_ids,
    its text left out (unless include_stop_str_in_output); min_tokens keeps it from being
    drawn before then. EOS (EOS_MARKER's first token): finish "stop", stop_reason null. A
    continuation stops at the same token."""
    free = generate(PROMPT, {"max_tokens": 30})
    token = next(t for t in free.token_ids[3:] if not inside_a_character(t))
    place = free.token_ids.index(token)
    body: dict[str, Any] = {"max_tokens": 30, "stop_token_ids": [token]}
    cut = generate(PROMPT, body)
    assert cut.token_ids == free.token_ids[: place + 1]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", token)
    assert cut.text == generate(PROMPT, {"max_tokens": place}).text
    shown = generate(PROMPT, body | {"include_stop_str_in_output": True})
    assert shown.text == generate(PROMPT, {"max_tokens": place + 1}).text
    rest = generate(cut.prompt_token_ids + cut.token_ids[:2], body | {"max_tokens": 28})
    assert rest.token_ids == cut.token_ids[2:] and rest.stop_reason == token
    masked = generate(PROMPT, body | {"min_tokens": 30})
    assert token not in masked.token_ids and len(masked.token_ids) == 30
    marked = generate("<eos-first> " + PROMPT, {"max_tokens": 8})
    assert marked.token_ids == [EOS_ID] and marked.text == ""
    assert (marked.finish_reason, marked.stop_reason) == ("stop", None)
    ignored = generate("<eos-first> " + PROMPT, {"max_tokens": 8, "ignore_eos": True})
    assert EOS_ID not in ignored.token_ids


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completion", "chat"])
async def test_a_stop_string_streams_as_vllm_streams_it(
    runners: list[web.AppRunner], path: str
) -> None:
    """Streamed: each chunk its token's id at once, the text behind it; the last chunk the
    rest, finish "stop" and the string as stop_reason. Whole: the cut text."""
    fake = await start_fake(FakeVllm("decode"), runners)
    prompt: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    body = {**prompt, "max_tokens": 40, "stop": "zzzzzz", "return_token_ids": True}
    _, events = await post(fake.url, path, body | {"stream": True})
    texts, ids, finish = tokens_of(events)
    expected = generate(MESSAGES if path == CHAT else PROMPT, body)
    assert ids == expected.token_ids and texts == expected.deltas and finish == "length"
    first = generate(MESSAGES if path == CHAT else PROMPT, {"max_tokens": 1}).text
    assert texts[0] == first[: max(len(first) - 5, 0)]  # 5 characters held back
    assert "".join(texts) == expected.text  # and let out at the end
    word = expected.text.split()[3]
    _, events = await post(fake.url, path, body | {"stream": True, "stop": [word]})
    last = [e for e in events if e is not None][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", word)
    _, (whole,) = await post(fake.url, path, body | {"stop": [word]})
    choice = whole["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert text == expected.text[: expected.text.index(word)] and choice["stop_reason"] == word


async def test_default_caps_are_vllms(runners: list[web.AppRunner]) -> None:
    """Without a cap a completion gets 16 tokens, with max_tokens null too; a chat, all that
    fits (max_model_len less the prompt), with null too; Responses and generate alike. A cap
    above max_model_len is refused, one that does not fit cut; min_tokens above the cap and a
    cap under 1 refused, with vLLM 0.32's words (seen on its server)."""
    fake = await start_fake(FakeVllm("decode", max_model_len=64), runners)
    for body in ({}, {"max_tokens": None}):
        _, (answer,) = await post(fake.url, COMPLETIONS, {"prompt": "hi", **body})
        assert answer["usage"]["completion_tokens"] == 16
    room = 64 - generate(MESSAGES, {"max_tokens": 1}).prompt_tokens
    for body in ({}, {"max_tokens": None, "max_completion_tokens": None}):
        _, (answer,) = await post(fake.url, CHAT, {"messages": MESSAGES, **body})
        assert answer["usage"]["completion_tokens"] == room
        assert answer["usage"]["total_tokens"] == 64
    _, (answer,) = await post(fake.url, RESPONSES, {"input": "hi"})
    fits = 64 - answer["usage"]["input_tokens"]
    assert answer["max_output_tokens"] == answer["usage"]["output_tokens"] == fits
    generate_body = {"token_ids": [1, 2, 3], "sampling_params": {}}
    _, (answer,) = await post(fake.url, GENERATE, generate_body)
    assert len(answer["choices"][0]["token_ids"]) == 61
    _, (answer,) = await post(fake.url, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 64})
    assert answer["usage"]["completion_tokens"] == 61  # cut to what fits
    status, error = await refused(fake.url, COMPLETIONS, {"prompt": "hi", "max_tokens": 65})
    assert status == 400 and error["error"] == {
        "message": "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer "
        "output tokens. (parameter=max_tokens, value=65)",
        "type": "BadRequestError", "param": "max_tokens", "code": 400,
    }  # fmt: skip
    status, error = await refused(
        fake.url, CHAT, {"messages": MESSAGES, "max_completion_tokens": 65}
    )
    assert error["error"]["param"] == "max_completion_tokens"
    status, error = await refused(fake.url, CHAT, {"messages": MESSAGES, "min_tokens": room + 1})
    assert status == 400 and error["error"]["param"] is None
    assert error["error"]["message"] == (
        f"min_tokens must be less than or equal to max_tokens={room}, got {room + 1}."
    )
    status, error = await refused(fake.url, COMPLETIONS, {"prompt": [5] * 64, "max_tokens": 1})
    assert error["error"]["message"] == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )
    status, error = await refused(fake.url, COMPLETIONS, {"prompt": [5] * 65, "max_tokens": 1})
    assert "contains at least 65 input tokens" in error["error"]["message"]
    assert error["error"]["param"] == "input_tokens"
    status, error = await refused(fake.url, COMPLETIONS, {"prompt": "hi", "max_tokens": "abc"})
    assert (status, error["error"]["type"], error["error"]["param"]) == (
        400, "Bad Request", "body.max_tokens",
    )  # fmt: skip
    _, (answer,) = await post(fake.url, COMPLETIONS, {"prompt": "hi", "max_tokens": "5"})
    assert answer["usage"]["completion_tokens"] == 5  # pydantic's lax int, as vLLM's


async def test_a_reasoning_parser_streams_reasoning_and_content_apart(
    runners: list[web.AppRunner],
) -> None:
    """--reasoning-parser: the think-start token swallowed (a chunk {"delta": {}} with its
    id only when return_token_ids asks for ids), reasoning as {"reasoning": ...}, the
    think-end swallowed, then {"content": ...}; whole, message.reasoning and .content.
    include_reasoning false: no reasoning, no token ids."""
    fake = await start_fake(FakeVllm("decode", reasoning_parser=True), runners)
    body = {"messages": MESSAGES, "max_tokens": 20, "stream": True}
    expected = generate(MESSAGES, body, reasoning=True)
    assert expected.token_ids[0] == THINK_START_ID and THINK_END_ID in expected.token_ids
    end = expected.token_ids.index(THINK_END_ID)
    _, events = await post(fake.url, CHAT, body | {"return_token_ids": True})
    chunks = [e["choices"][0] for e in events[1:] if e is not None and e["choices"]]
    assert [c["token_ids"] for c in chunks] == [[t] for t in expected.token_ids]
    assert chunks[0]["delta"] == {} and chunks[end]["delta"] == {}
    assert all(set(c["delta"]) == {"reasoning"} for c in chunks[1:end])
    assert all(set(c["delta"]) == {"content"} for c in chunks[end + 1 :])
    reasoning = "".join(c["delta"]["reasoning"] for c in chunks[1:end])
    content = "".join(c["delta"]["content"] for c in chunks[end + 1 :])
    _, events = await post(fake.url, CHAT, body)
    assert len([e for e in events if e is not None]) == 1 + len(expected.token_ids) - 2
    _, (whole,) = await post(fake.url, CHAT, body | {"stream": False})
    message = whole["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": end - 1}
    hidden = body | {"include_reasoning": False, "return_token_ids": True}
    raw, events = await post(fake.url, CHAT, hidden)
    chunks = [e["choices"][0] for e in events[1:] if e is not None and e["choices"]]
    assert b'"token_ids":[' not in raw.split(b"\n\n", 1)[1]  # the prompt's only, first
    assert all(c["delta"] == {"content": c["delta"]["content"], "reasoning": None} for c in chunks)
    assert "".join(c["delta"]["content"] for c in chunks) == content
    _, (whole,) = await post(fake.url, CHAT, hidden | {"stream": False})
    assert whole["choices"][0]["message"]["reasoning"] is None
    assert whole["choices"][0]["token_ids"] is None
    # A completion shows the markers' text: vLLM parses chats only.
    _, (plain,) = await post(fake.url, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 20})
    assert plain["choices"][0]["text"].startswith("<think>")


def normal(raw: bytes) -> bytes:
    """Two answers' bytes, their time stamps aside."""
    return re.sub(rb'"created":\d+', b'"created":0', raw)


async def test_chunks_are_vllm_032s(runners: list[web.AppRunner]) -> None:
    """Byte for byte as vLLM 0.32 streams a completion with return_token_ids and usage."""
    fake = await start_fake(FakeVllm("decode"), runners)
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "return_token_ids": True}
    body["stream_options"] = {"include_usage": True}
    raw, _ = await post(fake.url, COMPLETIONS, body, "8433")
    whole = generate(PROMPT, body)
    head = '{"id":"cmpl-8433","object":"text_completion","created":0,"model":"fake-model",'
    chunks = [
        f'{{"index":0,"text":{json.dumps(whole.deltas[n], ensure_ascii=False)},"logprobs":null,'
        f'"finish_reason":{"null" if n < 2 else chr(34) + "length" + chr(34)},'
        f'"stop_reason":null,"prompt_token_ids":'
        f"{json.dumps(whole.prompt_token_ids).replace(' ', '') if n == 0 else 'null'},"
        f'"token_ids":[{whole.token_ids[n]}]}}'
        for n in range(3)
    ]
    prompt_tokens = whole.prompt_tokens
    expected = "".join(f'data: {head}"choices":[{chunk}]}}\n\n' for chunk in chunks)
    expected += (
        f'data: {head}"choices":[],"usage":{{"prompt_tokens":{prompt_tokens},'
        f'"total_tokens":{prompt_tokens + 3},"completion_tokens":3}},'
        f'"system_fingerprint":"{SYSTEM_FINGERPRINT}"}}\n\ndata: [DONE]\n\n'
    )
    assert normal(raw).decode() == expected
    # A chat's: the prompt's ids on the role chunk, the fingerprint on the last (no usage).
    chat = {"messages": MESSAGES, "max_tokens": 2, "stream": True, "return_token_ids": True}
    raw, _ = await post(fake.url, CHAT, chat, "9d66")
    lines = normal(raw).decode().split("\n\n")
    assert lines[0].startswith(
        'data: {"id":"chatcmpl-9d66","object":"chat.completion.chunk","created":0,'
        '"model":"fake-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        '"logprobs":null,"finish_reason":null}],"prompt_token_ids":['
    ) and lines[0].endswith('],"prompt_text":null}')
    assert re.fullmatch(
        r'data: \{.*"choices":\[\{"index":0,"delta":\{"content":"[^"]*"\},"logprobs":null,'
        r'"finish_reason":null,"token_ids":\[\d+\]\}\]\}',
        lines[1],
    )
    assert re.fullmatch(
        r'data: \{.*"choices":\[\{"index":0,"delta":\{"content":"[^"]*"\},"logprobs":null,'
        r'"finish_reason":"length","stop_reason":null,"token_ids":\[\d+\]\}\],'
        r'"system_fingerprint":"vllm-0\.32\.0-\w+"\}',
        lines[2],
    )
    assert lines[3:] == ["data: [DONE]", ""]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completion", "chat"])
async def test_sent_without_token_ids_is_the_answer_without_the_flag(
    runners: list[web.AppRunner], path: str, stream: bool
) -> None:
    """sent_without_token_ids: the bytes of the same request without return_token_ids, which
    carry the same fields, null."""
    fake = await start_fake(FakeVllm("decode"), runners)
    prompt: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    body = {**prompt, "max_tokens": 5, "stream": stream, "n": 2}
    with_ids, _ = await post(fake.url, path, body | {"return_token_ids": True}, "a")
    without, _ = await post(fake.url, path, body, "b")
    assert with_ids == bytes(fake.fake.sent["a"]) and b"token_ids" in without
    assert b'_ids":[' in with_ids and b'_ids":[' not in without
    expected = normal(without).replace(b"-b", b"-a")
    assert normal(fake.fake.sent_without_token_ids("a")) == expected
    assert fake.fake.sent_without_token_ids("b") == without == bytes(fake.fake.sent["b"])


async def test_error_after_tokens_fails_the_next_streams_in_band(
    runners: list[web.AppRunner],
) -> None:
    """error_after_tokens: N tokens, vLLM's error event and [DONE]; faults_left: only so many
    streams fail (set over /_fake/inject, as the chaos benchmark does). The event is
    json.dumps's, as vLLM's create_streaming_error_response writes it: spaces after colons
    and commas."""
    fake = await start_fake(FakeVllm("decode"), runners)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            fake.url + "/_fake/inject", json={"error_after_tokens": 3, "faults_left": 1}
        ) as injected,
    ):
        assert injected.status == 200
    body = {"prompt": PROMPT, "max_tokens": 6, "stream": True}
    raw, events = await post(fake.url, COMPLETIONS, body, "first")
    assert len(events) == 5 and events[-1] is None
    assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None] * 3
    assert raw.split(b"\n\n")[3] == (
        b'data: {"error": {"message": "' + ENGINE_FAILED.encode() + b'", '
        b'"type": "InternalServerError", "param": null, "code": 500}}'
    )
    _, events = await post(fake.url, COMPLETIONS, body, "second")  # no fault left
    assert len(events) == 7 and tokens_of(events)[2] == "length"
    assert fake.fake.faults_left == 0


async def test_tools_without_a_tool_parser_are_refused_as_vllm_refuses_them(
    runners: list[web.AppRunner],
) -> None:
    """No --tool-call-parser: tools with tool_choice absent or "auto", "required" or a named
    function are refused with vLLM 0.32's words; "none" gets an ordinary answer."""
    fake = await start_fake(FakeVllm("decode"), runners)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"messages": MESSAGES, "max_tokens": 3, "tools": tools}
    named = {"type": "function", "function": {"name": "get_weather"}}
    auto = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    for choice, message in (
        ({}, auto),
        ({"tool_choice": "auto"}, auto),
        ({"tool_choice": "required"}, 'tool_choice="required" requires --tool-call-parser '
                                      "to be set"),
        ({"tool_choice": named}, 'tool_choice=function "get_weather" requires --tool-call-parser '
                                 "to be set"),
    ):  # fmt: skip
        status, error = await refused(fake.url, CHAT, body | choice)
        assert (status, error["error"]) == (
            400, {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        ), choice  # fmt: skip
    _, (answer,) = await post(fake.url, CHAT, body | {"tool_choice": "none"})
    assert answer["choices"][0]["finish_reason"] == "length"
    status, error = await refused(fake.url, CHAT, body | {"tools": []})
    assert status == 400 and error["error"]["param"] == "tools"


async def test_routes_a_proxy_passes_through_answer_as_vllms(
    runners: list[web.AppRunner],
) -> None:
    """A generative vLLM 0.32's answers (seen on its server): pooling routes and unknown ones
    a JSON 404 {"detail":"Not Found"}; a wrong method a 405; /invocations a completion or a
    chat by its body, else vLLM's 400."""
    fake = await start_fake(FakeVllm("decode"), runners)
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/nope"):
        status, raw, kind = await send(fake.url, path, {"model": MODEL, "input": "hi"})
        assert (status, raw, kind) == (404, b'{"detail":"Not Found"}', "application/json")
    status, raw, _ = await send(fake.url, "/tokenizer_info", {}, method="GET")
    assert (status, raw) == (404, b'{"detail":"Not Found"}')
    status, raw, _ = await send(fake.url, COMPLETIONS, {}, method="GET")
    assert (status, raw) == (405, b'{"detail":"Method Not Allowed"}')
    _, (answer,) = await post(fake.url, "/invocations", {"prompt": PROMPT, "max_tokens": 3})
    assert answer["object"] == "text_completion" and answer["id"] == "cmpl-r"
    assert answer["choices"][0]["text"] == generate(PROMPT, {"max_tokens": 3}).text
    _, (answer,) = await post(fake.url, "/invocations", {"messages": MESSAGES, "max_tokens": 3})
    assert answer["object"] == "chat.completion"
    status, error = await refused(fake.url, "/invocations", {"max_tokens": 3})
    assert (status, error["error"]["message"], error["error"]["param"]) == (
        400,
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
        "prompt",
    )


async def test_anthropic_messages_are_answered_in_their_shape(
    runners: list[web.AppRunner],
) -> None:
    """/v1/messages as vLLM 0.32 answers it (seen on its server): whole, one message with a
    text block, stop_reason "max_tokens" and usage; streamed, message_start, a text block's
    start, deltas and stop, message_delta, message_stop. Its errors in Anthropic's shape, but
    a missing max_tokens is pydantic's, in OpenAI's."""
    fake = await start_fake(FakeVllm("decode"), runners)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    expected = generate([{"role": "user", "content": "hi"}], body)
    _, (answer,) = await post(fake.url, "/v1/messages", body, "m1")
    assert answer == {
        "id": "chatcmpl-m1", "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": expected.text}], "model": MODEL,
        "stop_reason": "max_tokens",
        "usage": {"input_tokens": expected.prompt_tokens, "output_tokens": 6},
    }  # fmt: skip
    status, raw, _ = await send(fake.url, "/v1/messages", {"model": MODEL, **body, "stream": True})
    events = [frame.split("\n", 1) for frame in raw.decode().split("\n\n") if frame]
    names = [name.removeprefix("event: ") for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    data = [json.loads(line.removeprefix("data: ")) for _, line in events]
    assert data[0]["message"]["usage"] == {
        "input_tokens": expected.prompt_tokens, "output_tokens": 0,
    }  # fmt: skip
    text = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    assert text == expected.text and all(d.get("delta", {}).get("text") != "" for d in data)
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    status, error = await refused(fake.url, "/v1/messages", body | {"model": "other"})
    assert status == 404 and error == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": f"The model `other` does not exist. "
                  f"Valid aliases: {MODEL}."},
    }  # fmt: skip
    status, error = await refused(fake.url, "/v1/messages", {"messages": body["messages"]})
    assert status == 400 and error["error"]["param"] == "body.max_tokens"
    status, error = await refused(fake.url, "/v1/messages", body | {"max_tokens": 0})
    assert error["error"]["message"] == (
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body.max_tokens', 'msg': 'Value "
        "error, max_tokens must be positive', 'input': '0', 'ctx': {'error': ValueError('max_tokens"
        " must be positive')}}"
    )  # seen on vLLM 0.32
    stop = expected.text.split()[2]
    _, (answer,) = await post(fake.url, "/v1/messages", body | {"stop_sequences": [stop]})
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", stop)


def test_the_models_own_tokens_never_pass_for_a_prompts() -> None:
    """Every id the model writes reads, as the fakes' 4-byte prompt pieces, as a text ending in
    a UTF-8 lead byte: no prompt's ids are the model's."""
    for token in PIECES:
        assert token >= WORD_ID_BASE
        tail = token.to_bytes(4, "little").rstrip(b"\0")
        with pytest.raises(UnicodeDecodeError):
            tail.decode()


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completion", "chat"])
async def test_steps_merged_into_chunks_carry_their_text_and_ids_together(
    runners: list[web.AppRunner], path: str
) -> None:
    """vLLM's API server, behind its engine, adds the steps' outputs it has not sent into one
    (v1/engine/output_processor.py, RequestOutputCollector: text and token ids concatenated),
    as --stream-interval does by design: the same answer in fewer chunks."""
    fake = await start_fake(FakeVllm("decode", stream_interval=3), runners)
    prompt: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    body = {**prompt, "max_tokens": 10, "stream": True, "return_token_ids": True}
    _, events = await post(fake.url, path, body)
    texts, ids, finish = tokens_of(events)
    expected = generate(MESSAGES if path == CHAT else PROMPT, body)
    assert ids == expected.token_ids and "".join(texts) == expected.text
    assert len(texts) == 4 and finish == "length"  # 3 + 3 + 3 + 1
    assert prompt_ids_of(events) == expected.prompt_token_ids


async def test_detokenize_ends_in_a_replacement_inside_a_character(
    runners: list[web.AppRunner],
) -> None:
    """/detokenize decodes the model's tokens' bytes lossily, as a byte-level tokenizer does:
    ids that end inside a character end in U+FFFD, the test vLLM's detokenizer makes."""
    fake = await start_fake(FakeVllm("decode"), runners)
    answer = generate(PROMPT, {"max_tokens": 40})
    inside = next(n for n, token in enumerate(answer.token_ids) if inside_a_character(token))
    for end, ends_inside in ((inside + 1, True), (inside, False)):
        status, raw, _ = await send(fake.url, "/detokenize", {"tokens": answer.token_ids[:end]})
        assert status == 200
        assert json.loads(raw)["prompt"].endswith("\ufffd") == ends_inside


async def test_a_decode_sent_a_prompt_alone_computes_it_and_pauses_its_streams(
    runners: list[web.AppRunner],
) -> None:
    """As vLLM's decode computes a prompt that comes without KV to pull: counted under
    prompt_tokens_by_source's local_compute (its cached blocks under local_cache_hit), and
    its running streams wait while it computes."""
    fake = await start_fake(
        FakeVllm("decode", cache_blocks=64, token_time=0.002, token_delay=0.005), runners
    )

    async def by_source() -> dict[str, float]:
        status, raw, _ = await send(fake.url, "/metrics", {}, method="GET")
        assert status == 200
        found = re.findall(r'source="(\w+)"\} ([\d.]+)', raw.decode())
        return {source: float(value) for source, value in found}

    async def timed_stream() -> tuple[float, list[Any]]:
        started = time.perf_counter()
        _, events = await post(fake.url, COMPLETIONS, {"prompt": "a", "max_tokens": 30,
                                                       "stream": True})  # fmt: skip
        return time.perf_counter() - started, events

    long_prompt = "the decode computes this prompt itself " * 40
    streaming = asyncio.create_task(timed_stream())
    await asyncio.sleep(0.03)  # the stream is under way
    started = time.perf_counter()
    _, (answer,) = await post(fake.url, COMPLETIONS, {"prompt": long_prompt, "max_tokens": 1})
    computing = time.perf_counter() - started
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert computing >= prompt_tokens * 0.002
    took, events = await streaming
    assert events[-1] is None  # the stream went on after the pause, whole
    assert took >= 30 * 0.005 + prompt_tokens * 0.002  # its tokens, and the pause
    counted = await by_source()
    assert counted["local_compute"] >= prompt_tokens and counted["external_kv_transfer"] == 0
    before = counted["local_compute"]
    await post(fake.url, COMPLETIONS, {"prompt": long_prompt, "max_tokens": 1})
    counted = await by_source()
    assert counted["local_cache_hit"] > 0 and counted["local_compute"] - before < prompt_tokens


async def test_a_fake_told_to_die_says_which_answers_it_cut(tmp_path: Path) -> None:
    """/_fake/die, as the chaos benchmark kills a decode: the fake SIGKILLs itself, having
    written down what ran, and how many of those were streams cut after a token: a client
    has part of their answer. A whole answer still generating is not one (its bytes come at
    its end)."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).parent / "fake_vllm.py"), "--serve", "decode",
        "--port", str(port), "--token-delay", "0.05",
    )  # fmt: skip
    base, record = f"http://127.0.0.1:{port}", tmp_path / "killed.json"
    try:
        async with aiohttp.ClientSession() as session:
            await until_healthy(session, base)
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}

            async def whole_answer() -> bytes:
                async with session.post(base + COMPLETIONS, json=body) as answer:
                    return await answer.read()

            async def running() -> int:
                async with session.get(base + "/_fake/stats") as stats:
                    count: int = (await stats.json())["running"]
                    return count

            whole = asyncio.create_task(whole_answer())
            async with session.post(base + COMPLETIONS, json=body | {"stream": True}) as stream:
                assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: {")
                while await running() < 2:
                    await asyncio.sleep(0.01)
                with pytest.raises(aiohttp.ClientError):
                    async with session.post(base + "/_fake/die", json={"record": str(record)}):
                        pass
            with pytest.raises(aiohttp.ClientError):
                await whole
        assert await asyncio.wait_for(process.wait(), 10) == -signal.SIGKILL
        assert json.loads(record.read_text()) == {"running": 2, "streaming": 1}
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
