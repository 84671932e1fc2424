"""The fake vLLM server itself: vLLM 0.32's chunks with and without ``return_token_ids``, a
generation that continues token for token from the prompt's ids plus the ids generated so far
(what a proxy that moves a broken stream to another pair relies on), and the mid-stream faults
tests inject.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fake_vllm import (
    ENGINE_FAILED,
    MODEL,
    SYSTEM_FINGERPRINT,
    VOCAB,
    FakeVllm,
    build_tokenizer,
    generate,
    start_fake,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
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


async def post(
    url: str, path: str, body: dict[str, Any], request_id: str = "r"
) -> tuple[bytes, list[Any]]:
    """The raw answer, and its events (parsed, [DONE] as None) if streamed."""
    headers = {"X-Request-Id": request_id}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, json={"model": MODEL, **body}, headers=headers) as answer,
    ):
        raw = await answer.read()
    assert answer.status == 200, raw
    if not body.get("stream"):
        return raw, [json.loads(raw)]
    assert raw.endswith(b"\n\n")
    events = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        events.append(None if event == b"data: [DONE]" else json.loads(event[6:]))
    return raw, events


def tokens_of(events: list[Any]) -> tuple[list[str], list[int], str | None]:
    """A one-choice stream's tokens, their ids and how it finished."""
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


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["bytes", "tokenizer"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completion", "chat"])
async def test_a_stream_continues_token_for_token_from_its_ids(
    runners: list[web.AppRunner], request: pytest.FixtureRequest, path: str, with_tokenizer: bool
) -> None:
    """A completion of the prompt's ids plus the first k generated ids, with k fewer tokens
    to go, streams exactly the rest of the uninterrupted answer: same words, same ids, same
    finish, whatever k."""
    tokenizer = request.getfixturevalue("tokenizer") if with_tokenizer else None
    fake = await start_fake(FakeVllm("decode", tokenizer=tokenizer), runners)
    prompt: dict[str, Any] = {"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}
    body = {**prompt, "max_tokens": 12, "stream": True, "return_token_ids": True}
    _, events = await post(fake.url, path, body)
    texts, ids, finish = tokens_of(events)
    prompt_ids = prompt_ids_of(events)
    assert len(texts) == len(ids) == 12 and finish == "length"
    if with_tokenizer:  # the tokenizer's ids, as vLLM's
        prompt_text = MESSAGES if path == CHAT else PROMPT
        blocks = fake.fake.prompt_blocks(prompt_text)
        assert prompt_ids == blocks.ids
    for cut in (1, 5, 11):
        rest = {"prompt": prompt_ids + ids[:cut], "max_tokens": 12 - cut}
        _, more = await post(
            fake.url, COMPLETIONS, rest | {"stream": True, "return_token_ids": True}
        )
        assert tokens_of(more) == (texts[cut:], ids[cut:], "length"), cut
        assert prompt_ids_of(more) == prompt_ids + ids[:cut]
        # Non-streamed alike; its usage counts the ids as prompt tokens.
        _, (whole,) = await post(fake.url, COMPLETIONS, rest | {"return_token_ids": True})
        assert whole["choices"][0]["text"] == "".join(texts[cut:])
        assert whole["choices"][0]["token_ids"] == ids[cut:]
        assert whole["usage"]["prompt_tokens"] == len(prompt_ids) + cut


def test_a_continuation_stops_where_the_whole_answer_stops() -> None:
    """Stop words end a continuation at the same token; EOS_MARKER only ends a text prompt's
    first token, never a continuation's."""
    for stop in VOCAB[:6]:
        body: dict[str, Any] = {"max_tokens": 40, "stop": [stop]}
        whole = generate(PROMPT, body)
        for cut in range(len(whole.tokens)):
            rest = generate(whole.prompt_token_ids + whole.token_ids[:cut], body)
            assert rest.tokens == whole.tokens[cut:] and rest.finish_reason == whole.finish_reason
    marked = generate("<eos-first> " + PROMPT, {"max_tokens": 8})
    assert marked.tokens == [] and marked.finish_reason == "stop"
    ignored = generate("<eos-first> " + PROMPT, {"max_tokens": 8, "ignore_eos": True})
    rest = generate(ignored.prompt_token_ids + ignored.token_ids[:3], {"max_tokens": 5})
    assert rest.tokens == ignored.tokens[3:]


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
        f'{{"index":0,"text":"{whole.tokens[n]}","logprobs":null,'
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
        r'data: \{.*"choices":\[\{"index":0,"delta":\{"content":" \w+"\},"logprobs":null,'
        r'"finish_reason":null,"token_ids":\[\d+\]\}\]\}',
        lines[1],
    )
    assert re.fullmatch(
        r'data: \{.*"choices":\[\{"index":0,"delta":\{"content":" \w+"\},"logprobs":null,'
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
    streams fail (set over /_fake/inject, as the chaos benchmark does)."""
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
        b'data: {"error":{"message":"' + ENGINE_FAILED.encode() + b'",'
        b'"type":"InternalServerError","param":null,"code":500}}'
    )
    _, events = await post(fake.url, COMPLETIONS, body, "second")  # no fault left
    assert len(events) == 7 and tokens_of(events)[2] == "length"
    assert fake.fake.faults_left == 0
