"""Fake vLLM servers that follow ../../shared/PROTOCOL.md, for the tests and the demo.

A ``FakeVllm`` is one vLLM OpenAI server in the role of a Mooncake ``kv_producer`` (prefill,
with its bootstrap server) or ``kv_consumer`` (decode). The KV "transfer" goes over real
sockets the way Mooncake's does: the decode reads ``remote_bootstrap_addr + "/query"``, finds
the worker of ``remote_engine_id`` and pulls ``transfer_id`` from it; the prefill hands that KV
out only once a request with that ``transfer_id`` finished *length-capped* on that very engine.
So a proxy that skips the prefill, names the wrong engine or rank, or lets the prefill stop
early sees the decode wait, exactly as real vLLM does, and a test sees a failure.

Generation is deterministic: the tokens depend only on the prompt, so a decode's answer from
transferred KV equals its own local answer to the same request. It is autoregressive over
token ids, so a request whose prompt is the prompt's ids plus the ids generated so far (as
``return_token_ids`` gives them) continues the answer exactly.

The fakes are no kinder than vLLM 0.32 where a proxy could tell (each place says where it was
checked: vLLM's source or its server): a chat without a cap runs to max_model_len; some tokens
are pieces of a character, which stream "" until it is whole (and a continuation from inside
one starts with garbage, as vLLM's DecodeStream gives it); stop strings hold text back while
every token id goes out at once; a reasoning parser splits a chat into reasoning and content;
the in-band error is json.dumps's; tools without a tool parser, unknown routes, Anthropic's
Messages and SageMaker's /invocations are answered as vLLM answers them.

``python tests/fake_vllm.py`` (make demo) runs the demo: a small simulated cluster, the proxy
in front of it started as users start it, and one streamed request whose tokens arrive on the
terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import errno
import hashlib
import itertools
import json
import os
import random
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

MODEL = "fake-model"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"  # Anthropic's Messages API, which vLLM serves beside OpenAI's
MAX_MODEL_LEN = 4096  # FakeVllm's default, in the fakes' tokens
GENERATE = "/inference/v1/generate"  # with --enable-scale-out: token ids in, token ids out
# vLLM's API server closes a connection idle this long (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, passed to
# uvicorn's timeout_keep_alive): the fakes are served with it, so that a client pool keeping
# idle connections longer meets closed sockets here as it would there.
KEEPALIVE_SECONDS = 5.0
# The identity the proxy's /healthcheck reports (mooncake_proxy.ID, not imported here so the
# fakes stay independent of the module they test).
PROXY_ID = "inferlab-vllm-mooncake-proxy"
# The marker that makes the first sampled token EOS, unless the request says ignore_eos.
EOS_MARKER = "<eos-first>"
VOCAB = (
    *("the", "a", "PD", "proxy", "mooncake", "prefill", "decode", "cache", "token", "stream"),
    *("engine", "rank", "transfer", "vLLM", "kv", "block", "fast", "model", "answer"),
)


def compact(obj: Any) -> bytes:
    """JSON as vLLM writes its answers and stream chunks (pydantic's model_dump_json): no
    spaces, non-ASCII as UTF-8. A text UTF-8 cannot carry (a lone surrogate) is escaped."""
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def error(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> web.Response:
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    body = {
        "error": {
            "message": message,
            "type": kind or kinds.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
    return web.Response(body=compact(body), status=status, content_type="application/json")


@web.middleware
async def fastapi_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A route vLLM does not serve, or a method it does not take there, answered as its
    FastAPI server answers (seen on vLLM 0.32, a generative model: /v1/embeddings, /pooling,
    /classify, /score, /rerank, /tokenizer_info and unknown paths a 404
    ``{"detail":"Not Found"}``; GET /v1/completions a 405 ``{"detail":"Method Not Allowed"}``
    with Allow), not with aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as refused:
        allowed = ", ".join(sorted(refused.allowed_methods - {"HEAD"}))
        body = compact({"detail": "Method Not Allowed"})
        answer = web.Response(status=405, body=body, content_type="application/json")
        answer.headers["Allow"] = allowed
        return answer
    except web.HTTPNotFound:
        body = compact({"detail": "Not Found"})
        return web.Response(status=404, body=body, content_type="application/json")


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


@dataclass
class Recorded:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    peer: Any = None  # the client's (host, port): tells connection reuse apart


# A whole answer's usage, as vLLM 0.32's UsageInfo.model_dump() writes it: its fields in order,
# the details null where not given (a stream's usage chunk leaves the null ones out).
USAGE_FIELDS: Final = (
    "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
    "completion_tokens_details",
)  # fmt: skip


def cached_when_came(generations: list[Generation], cached: list[int]) -> None:
    """Each prompt's tokens cached when it came (pulled or held), onto its choices."""
    count = len(generations) // len(cached)  # n choices a prompt, the prompts in turn
    for index, generation in enumerate(generations):
        generation.cached_tokens = cached[index // count]


@dataclass
class Generation:
    """One choice's answer as vLLM 0.32's engine and detokenizer give it (v1/engine/
    output_processor.py, v1/engine/detokenizer.py)."""

    finish_reason: str
    prompt_tokens: int
    # Every generated token's id, a stop token or EOS included (vLLM counts and returns it).
    token_ids: list[int] = field(default_factory=list)
    # The text each token's step streams (vLLM's delta output), one per token id: "" inside a
    # character, or while stop strings hold text back; the last one flushes what was held.
    deltas: list[str] = field(default_factory=list)
    text: str = ""  # the whole answer's text, as a non-streamed answer gives it
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # The prompt's token ids as the model read them (model_input), 4 bytes each.
    prompt_input: bytes = b""
    cap: int = 0  # the max_tokens it ran with (vLLM's sampling_params.max_tokens)
    # The prompt's tokens found cached or pulled when it came (vLLM's num_cached_tokens).
    cached_tokens: int = 0
    # With a reasoning parser: whether the prompt's ids end its reasoning already
    # (is_reasoning_end: a think-end token after the last think-start).
    prompt_reasoning_ended: bool = False

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids, as vLLM's ``return_token_ids`` gives them: given with the
        ids, a request that continues the answer from any of its tokens (prompt = these ids +
        the token ids so far, max_tokens lowered as much) gets the rest of it, token for token."""
        return list(struct.unpack(f"<{len(self.prompt_input) // 4}I", self.prompt_input))


def prompt_of(path: str, body: dict[str, Any]) -> Any:
    """The request's (first) prompt."""
    return prompts_of(path, body)[0]


def prompts_of(path: str, body: dict[str, Any]) -> list[Any]:
    """Every prompt of the request: a completion's ``prompt`` may be a batch of them (a list
    of texts or of token lists), each answered with its own choices, as vLLM does."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        return [messages]
    if path == MESSAGES:
        return [anthropic_messages(body)]
    if path == RESPONSES:
        return [response_messages(body)]
    if path == GENERATE:
        if not is_token_prompt(ids := body.get("token_ids")):
            raise BadRequest("token_ids must be a non-empty list of token ids", "token_ids")
        return [ids]
    prompt = body.get("prompt")
    if prompt in (None, "", []):  # CompletionRequest's check (seen on vLLM 0.32)
        raise validation_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return list(prompt)
    return [prompt]


def is_chat(path: str) -> bool:
    """A route answered as a chat (Anthropic's Messages is one, in vLLM, under its shape)."""
    return path.endswith("/chat/completions") or path == MESSAGES


def api_path(path: str, body: dict[str, Any]) -> str:
    """The API whose rules a request follows: its own route's; SageMaker's /invocations tries
    a chat, then a completion (serve/sagemaker/api_router.py, generate/factories.py), and a
    body that is neither is refused as a completion without a prompt (seen on vLLM 0.32)."""
    if path != "/invocations":
        return path
    if "messages" in body:
        return "/v1/chat/completions"
    if body.get("prompt") in (None, "", []):
        raise validation_error(
            "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
        )
    return "/v1/completions"


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Messages request as the chat vLLM makes of it (anthropic/serving.py,
    to_chat_completion_request): the system text first, then each message, its text blocks
    joined into a string when there is one, kept as OpenAI text parts when there are more."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(
            block.get("text") or "" for block in system
            if isinstance(block, dict) and block.get("type") == "text"
        )  # fmt: skip
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            parts = [
                {"type": "text", "text": block.get("text", "")}
                for block in content
                if isinstance(block, dict) and block.get("type") == "text"
            ]
            content = parts[0]["text"] if len(parts) == 1 else parts
        messages.append({"role": message.get("role"), "content": content})
    return messages


def anthropic_error(response: web.StreamResponse) -> web.StreamResponse:
    """An error of the Messages route in Anthropic's shape, as vLLM's
    translate_error_response writes it: {"type": "error", "error": {"type", "message"}} (seen:
    an unknown model's 404)."""
    if response.status < 400 or not isinstance(response, web.Response):
        return response
    if not isinstance(response.body, bytes):
        return response
    try:
        found = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        return response
    body = {"type": "error", "error": {"type": found["type"], "message": found["message"]}}
    return web.Response(body=compact(body), status=response.status, content_type="application/json")


def check_tools(body: dict[str, Any]) -> None:
    """ChatCompletionRequest.check_tool_usage (chat_completion/protocol.py), run as the body is
    read: an empty tools list, a tool_choice without tools, one that is none of "none",
    "auto", "required" or a named function among the tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        raise validation_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            "tools",
        )
    if choice is None or choice == "none":
        return
    if tools is None:
        raise validation_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise validation_error(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" '
            'or "required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise validation_error(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise validation_error(
                f"Expected field `name` in `function` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise validation_error(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        named = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
        if name not in named:
            raise validation_error(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )


def refuse_tool_choice(body: dict[str, Any]) -> None:
    """A server without --tool-call-parser (as the fakes are) refuses any tool choice but
    "none" (renderers/online_renderer.py, render_chat; seen on vLLM 0.32): tools with no
    tool_choice mean "auto". tool_choice "none", or null, gets an ordinary answer."""
    choice = body.get("tool_choice", "auto" if body.get("tools") else None)
    if choice is None or choice == "none":
        return
    if choice == "auto":
        raise BadRequest(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    if isinstance(choice, dict):
        described = f'function "{choice["function"]["name"]}"'
    else:
        described = f'"{choice}"'
    raise BadRequest(f"tool_choice={described} requires --tool-call-parser to be set")


def refuse_unencodable(prompt: Any) -> None:
    """vLLM's tokenizer refuses a text UTF-8 cannot encode (a lone surrogate, which JSON can
    carry): a 400 with its words (seen on vLLM 0.32, completions and chat)."""
    texts: list[Any] = [prompt]
    if isinstance(prompt, list):
        texts = [m.get("content") if isinstance(m, dict) else m for m in prompt]
    try:
        for text in texts:
            if isinstance(text, str):
                text.encode()
    except UnicodeEncodeError:
        raise BadRequest(
            "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"
        ) from None


def sample_count(body: dict[str, Any]) -> int:
    """``n`` as vLLM reads it ("2" and 2.0 are 2), checked as vLLM checks it."""
    given = body.get("n", 1)
    try:
        count = int(float(given)) if isinstance(given, str | float) else given
    except ValueError:
        raise BadRequest("n must be an integer", "n") from None
    if not isinstance(count, int) or count < 1:
        raise BadRequest(f"n must be at least 1, got {count}.")
    temperature = body.get("temperature")
    if count > 1 and isinstance(temperature, int | float) and temperature < 1e-5:
        raise BadRequest(f"n must be 1 when using greedy sampling, got {count}.")
    return count


def digest_of(prompt: Any) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()


# What a stream's error event says when error_after_tokens fails it (vLLM's EngineDeadError).
ENGINE_FAILED = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# What vLLM 0.32 writes in a stream's last chunk.
VLLM_VERSION = "0.32.0"
SYSTEM_FINGERPRINT = f"vllm-{VLLM_VERSION}-fa6e0001"
# A generated word's token id: this base plus its index in VOCAB.
WORD_ID_BASE = 50_000
TOKEN_ID_LIMIT = 1 << 32  # token ids are read as 4-byte integers


def response_messages(body: dict[str, Any]) -> list[Any]:
    """A Responses request as the chat vLLM renders it: the instructions a system message, a
    text input one user message, a list of items as they are."""
    given = body.get("input")
    if not isinstance(given, str | list):
        raise BadRequest("input is required", "input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
    if isinstance(body.get("instructions"), str):
        return [{"role": "system", "content": body["instructions"]}, *items]
    return items


def refuse_stored(body: dict[str, Any]) -> None:
    """vLLM 0.32 without VLLM_ENABLE_RESPONSES_API_STORE: no stored response to go on from,
    and no background mode (store itself is quietly taken as false)."""
    if (previous := body.get("previous_response_id")) is not None:
        raise BadRequest(f"Response with id '{previous}' not found.", "response_id", 404)
    if body.get("background") and body.get("store", True):
        raise BadRequest(
            "This vLLM engine does not support `store=True` and therefore does not support the "
            "background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "background",
        )


def sampling_of(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Where a request's sampling fields are: a generate request's in its sampling_params
    (required, as vLLM's GenerateRequest has it), a Responses request's as response_sampling
    reads them, a Messages request's as its chat has them, the completions' in the body."""
    if path == RESPONSES:
        return response_sampling(body)
    if path == MESSAGES:  # anthropic/serving.py, _build_base_request
        cap = body.get("max_tokens")
        sampling: dict[str, Any] = {"max_tokens": cap, "max_completion_tokens": cap}
        sampling["stop"] = body.get("stop_sequences")
        return sampling | {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    if path != GENERATE:
        return body
    given = body.get("sampling_params")
    if not isinstance(given, dict):
        raise BadRequest("sampling_params is required: an object", "sampling_params")
    return given


def response_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request's sampling as generate reads a completion's: its cap is
    max_output_tokens (vLLM ignores max_tokens and the other completions' fields there)."""
    ignored = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")
    sampling = {key: value for key, value in body.items() if key not in ignored}
    return sampling | {"max_tokens": body.get("max_output_tokens")}


def is_token_prompt(prompt: Any) -> bool:
    """vLLM's token prompt: a (non-empty) list of token ids."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def model_input(prompt: Any, tokenizer: Any = None, ids: list[int] | None = None) -> bytes:
    """The prompt's token ids as the fake model reads them, each a 4-byte little-endian
    integer: a token prompt's own ids; else ``ids`` or the tokenizer's, given one; else one id
    per 4 bytes of prompt_text (zero-padded), so that the text itself is the input."""
    if is_token_prompt(prompt):
        ids = prompt
    elif ids is None and tokenizer is not None:
        ids = token_ids(prompt, tokenizer)
    if ids is None:
        text = prompt_text(prompt)
        return text + bytes(-len(text) % TOKEN_BYTES)
    if any(not 0 <= t < TOKEN_ID_LIMIT for t in ids):
        bad = next(t for t in ids if not 0 <= t < TOKEN_ID_LIMIT)
        raise BadRequest(f"Token id {bad} is out of vocabulary", "prompt")
    return struct.pack(f"<{len(ids)}I", *ids)


# --- the fake model: its tokens, what it generates, and vLLM's detokenizer over them

# The fake model's own tokens. Every id is in 50,000-50,431 (0xC350-0xC4FF): read as the fakes'
# 4-byte pieces of prompt text (model_input), such an id would be a text ending in the UTF-8
# lead byte 0xC3 or 0xC4, which no text does, so a prompt's ids never pass for the model's.
# A word: WORD_ID_BASE plus its index in VOCAB, its text the word after a space.
SPLIT_ID_BASE = 50_100
# Words whose UTF-8 the model writes in pieces, as byte-level BPE models do: each a run of
# tokens that always follow one another (a character begun is finished), some of them no
# text alone. One piece ends a character and begins the next (日本's middle), one holds a
# whole two-byte character (café's é).
SPLIT_WORDS: tuple[tuple[bytes, ...], ...] = (
    (b" \xc3", b"\xa9"),  # " é" in 2 tokens
    (b" \xe2", b"\x98", b"\x83"),  # " ☃" in 3
    (b" \xe6\x97", b"\xa5\xe6", b"\x9c\xac"),  # " 日本" in 3: 日's last byte and 本's first
    (b" \xf0", b"\x9f", b"\x9a", b"\x80"),  # " 🚀" in 4
    (b" caf", b"\xc3\xa9"),  # " café"
)
# vLLM's end-of-sequence token: generated and counted, never text (a special token skipped).
EOS_ID = 50_400
# A reasoning model's markers (FakeVllm.reasoning_parser), text as DeepSeek-R1's are.
THINK_START_ID, THINK_END_ID = 50_401, 50_402
THINK_START, THINK_END = "<think>", "</think>"


def _vocabulary() -> tuple[dict[int, bytes], dict[int, int], tuple[int, ...]]:
    """Each token's bytes, the token that must follow a piece, and the tokens a word starts
    with (what the model draws from)."""
    pieces = {WORD_ID_BASE + n: f" {word}".encode() for n, word in enumerate(VOCAB)}
    follows: dict[int, int] = {}
    starts = list(pieces)
    next_id = SPLIT_ID_BASE
    for word in SPLIT_WORDS:
        ids = list(range(next_id, next_id + len(word)))
        next_id += len(word)
        pieces.update(zip(ids, word, strict=True))
        follows.update(itertools.pairwise(ids))
        starts.append(ids[0])
    pieces |= {EOS_ID: b"", THINK_START_ID: THINK_START.encode(), THINK_END_ID: THINK_END.encode()}
    assert all(0xC350 <= i <= 0xC4FF for i in pieces)
    return pieces, follows, tuple(starts)


PIECES, FOLLOWS, STARTS = _vocabulary()
SPECIAL_IDS = frozenset({EOS_ID})  # skipped in text (vLLM's skip_special_tokens default)


def token_bytes(token: int, table: list[bytes] | None = None) -> bytes:
    """A token's bytes: the model's own; else, given one, the tokenizer's (table); else the
    fakes' 4 bytes of prompt text (its zero padding dropped)."""
    if (piece := PIECES.get(token)) is not None:
        return b"" if token in SPECIAL_IDS else piece
    if table is not None and 0 <= token < len(table):
        return table[token]
    return token.to_bytes(4, "little").rstrip(b"\0")


_TOKENIZER_BYTES: dict[int, tuple[Any, list[bytes]]] = {}


def tokenizer_bytes(tokenizer: Any) -> list[bytes]:
    """Every token's bytes in a byte-level BPE tokenizer (tiny_tokenizer.py), its special
    tokens none (skip_special_tokens): what a DecodeStream concatenates."""
    held = _TOKENIZER_BYTES.get(id(tokenizer))
    if held is not None and held[0] is tokenizer:
        return held[1]
    from tokenizers import pre_tokenizers

    # The byte-level alphabet in byte order, as GPT-2 and tokenizers' ByteLevel map it.
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in visible]
    chars = {chr(b): b for b in visible} | {chr(256 + n): b for n, b in enumerate(hidden)}
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    special = set(tokenizer.all_special_ids)
    table = []
    for token, text in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if token in special or text is None:
            table.append(b"")
        elif all(c in chars for c in text):
            table.append(bytes(chars[c] for c in text))
        else:  # an added token, stored as its text
            table.append(text.encode())
    _TOKENIZER_BYTES[id(tokenizer)] = (tokenizer, table)
    return table


class DecodeStream:
    """tokenizers' DecodeStream (0.23, what vLLM's FastIncrementalDetokenizer steps), for a
    tokenizer whose decoder concatenates its tokens' bytes and decodes them lossily (byte-level
    BPE). A step returns text only when the bytes since the last text do not end in U+FFFD (an
    unfinished character), so a token inside a character returns None.

    Primed with a prompt (vLLM passes ``ids=prompt_token_ids``) that ends inside a character,
    its first text is the whole prompt's text and the new text: the prompt never became its
    prefix. A continuation sent from a token inside a character gets that garbage, as from
    vLLM 0.32 (seen: prompt [1, 267, 460, 166, 254] streamed "hello�\\x1c" first).

    The prompt is held as one element of bytes: the real stream's positions only ever fall
    between the prompt and the tokens after it, so the texts are the same. Checked step for
    step against tokenizers 0.23.3's DecodeStream over the real-vLLM suite's tokenizer, on
    3,000 random prompts and continuations with split characters and stray bytes."""

    def __init__(self, prompt: bytes | None) -> None:
        self.window: list[bytes] = [] if prompt is None else [prompt]
        self.prefix = ""
        self.prefix_index = 0

    def step(self, piece: bytes) -> str | None:
        if not self.prefix and self.window:
            text = b"".join(self.window).decode("utf-8", "replace")
            if not text.endswith("\ufffd"):
                self.prefix, self.prefix_index = text, len(self.window)
        self.window.append(piece)
        text = b"".join(self.window).decode("utf-8", "replace")
        if len(text.encode()) <= len(self.prefix.encode()) or text.endswith("\ufffd"):
            return None
        # Byte-level decoding only appends: text starts with prefix, so no "Invalid prefix".
        new_text = text[len(self.prefix) :]
        kept = len(self.window) - self.prefix_index
        self.window = self.window[self.prefix_index :]
        self.prefix = b"".join(self.window).decode("utf-8", "replace")
        self.prefix_index = kept
        return new_text


class Detokenizer:
    """vLLM 0.32's FastIncrementalDetokenizer (BaseIncrementalDetokenizer.update and
    get_next_output_text, check_stop_strings; v1/engine/detokenizer.py), one token a step:
    the text of the tokens, stop strings found in it, and the text a stream may send now.

    While stop strings may still match, the last ``max(len(s) for s in stop) - 1`` characters
    are held back (not with include_stop_str_in_output); a match cuts the text before the stop
    string (after it, with include_stop_str_in_output). Stop strings are looked for only once
    more than min_tokens tokens were generated, and then only in the text of the tokens after
    the first min_tokens (a match may begin earlier). A stop token's (or EOS's) own text is
    left out unless include_stop_str_in_output."""

    def __init__(
        self, prompt: bytes | None, stop: list[str], min_tokens: int, include_stop: bool
    ) -> None:
        self.stream = DecodeStream(prompt)
        self.stop, self.min_tokens, self.include_stop = stop, min_tokens, include_stop
        self.buffer_length = max(map(len, stop)) - 1 if stop and not include_stop else 0
        self.output_text = ""
        self.tokens = 0
        self.sent = 0  # _last_output_text_offset

    def update(self, piece: bytes, stop_terminated: bool) -> str | None:
        """Add one token; the stop string it completed, if any."""
        previous = self.tokens
        offsets = [len(self.output_text)]
        if not stop_terminated or self.include_stop:
            self.output_text += self.stream.step(piece) or ""
        self.tokens += 1
        offsets.append(len(self.output_text))
        if not self.stop or self.tokens <= self.min_tokens:
            return None
        # vLLM looks from token_offsets[max(min_tokens - previous, 0)]: with one token a step
        # and more than min_tokens tokens, that is where this token's text begins.
        start = offsets[max(self.min_tokens - previous, 0)]
        match = check_stop_strings(
            self.output_text, len(self.output_text) - start, self.stop, self.include_stop
        )
        if match is None:
            return None
        stop, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop

    def next_output_text(self, finished: bool) -> str:
        """The text a stream sends at this step (get_next_output_text with delta)."""
        length = len(self.output_text) - (0 if finished else self.buffer_length)
        if self.sent >= length:
            return ""
        text, self.sent = self.output_text[self.sent : length], length
        return text


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """vLLM 0.32's check_stop_strings (v1/engine/detokenizer.py), as it is: the stop string
    that ends earliest in the new text (or overlaps into it), and where to cut the text (-1:
    nowhere)."""
    if not new_char_count or not stop:
        return None
    best: tuple[str, int, int] | None = None
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if best is None or end < best[2]:
            best = (stop_str, index, end)
    if best is None:
        return None
    stop_str, index, end = best
    if include_in_output:
        return (stop_str, -1) if end >= len(output_text) else (stop_str, end)
    return stop_str, index


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> BadRequest:
    """vLLM's VLLMValidationError as its server answers it (vllm/exceptions.py): a 400 whose
    message ends "(parameter=..., value=...)" for what it names, param the parameter."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    extras += [f"value={value}"] if value is not None else []
    return BadRequest(f"{message} ({', '.join(extras)})" if extras else message, parameter)


def body_error(
    location: str, kind: str, message: str, given: Any, ctx: dict[str, Any] | None = None
) -> BadRequest:
    """pydantic's refusal of a request field, as vLLM 0.32's validation handler writes it
    (serve/exception_handling/handlers/validation.py): type "Bad Request", the field's place
    as param, and the value summed up (seen: max_tokens "abc", 5.5, [1], min_tokens null)."""
    if isinstance(given, list | dict):
        shown: Any = f"<{type(given).__name__} of {len(given)} items>"
    else:
        shown = given if isinstance(given, str) else str(given)
    error = {"type": kind, "loc": location, "msg": message, "input": shown}
    if ctx is not None:
        error["ctx"] = ctx
    return BadRequest(f"1 validation error:\n  {error}", location, kind="Bad Request")


def lax_int(given: Any, location: str) -> int:
    """An integer field as pydantic reads it in lax mode: true is 1, 5.0 and "5" are 5 (seen
    on vLLM 0.32: max_tokens "5", 5.0 and true were taken); else body_error's 400."""
    if isinstance(given, int):
        return int(given)
    if isinstance(given, float) and given.is_integer():
        return int(given)
    if isinstance(given, float):
        raise body_error(
            location, "int_from_float",
            "Input should be a valid integer, got a number with a fractional part", given,
        )  # fmt: skip
    if isinstance(given, str):
        try:
            return int(given.strip())
        except ValueError:
            raise body_error(
                location, "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer", given,
            ) from None  # fmt: skip
    raise body_error(location, "int_type", "Input should be a valid integer", given)


def check_int_fields(path: str, body: dict[str, Any]) -> None:
    """Refuse, before anything else (pydantic reads the body first), a cap or min_tokens that
    is no integer. null is a valid cap (None) but no valid min_tokens."""
    where = "body.sampling_params." if path == GENERATE else "body."
    fields: tuple[str, ...] = ("max_tokens", "min_tokens")
    if path == RESPONSES:
        fields = ("max_output_tokens",)
    if path.endswith("/chat/completions"):
        fields += ("max_completion_tokens",)
    if path == MESSAGES:  # AnthropicMessagesRequest: max_tokens is required, an integer
        if "max_tokens" not in body:
            raise body_error("body.max_tokens", "missing", "Field required", body)
        if (cap := lax_int(body["max_tokens"], "body.max_tokens")) <= 0:  # validate_max_tokens
            raise body_error(
                "body.max_tokens", "value_error", "Value error, max_tokens must be positive", cap,
                {"error": ValueError("max_tokens must be positive")},
            )  # fmt: skip
        return
    sampling = body.get("sampling_params") if path == GENERATE else body
    if not isinstance(sampling, dict):
        return
    for name in fields:
        if name in sampling and (sampling[name] is not None or name == "min_tokens"):
            lax_int(sampling[name], where + name)


def output_cap(
    path: str, sampling: dict[str, Any], prompt_count: int, token_prompt: bool, max_model_len: int
) -> int:
    """The max_tokens vLLM 0.32 gives a request's engine, or its 400.

    Completions: max_tokens, 16 when absent or null (normalize_null_max_tokens). Chat:
    max_completion_tokens, else max_tokens, else all that fits: max_model_len less the prompt
    (get_max_tokens). Responses: max_output_tokens, else all that fits. A cap above
    max_model_len is refused (TokenizeParams), then a prompt longer than max_model_len
    (_token_len_check: a text prompt is tokenized to max_model_len + 1 tokens at most, so it
    says "at least" that), then the cap is cut to what fits, and one under 1 is refused
    (SamplingParams), as is a min_tokens above it. Seen on vLLM 0.32 (max_model_len 512):
    max_tokens 600 a 400; 100 after a 500-token prompt cut to 12; a chat's default 507 after
    5 prompt tokens; a 512-token prompt "max_tokens must be at least 1, got 0"; a 513-token one
    "contains at least 513 input tokens".

    /inference/v1/generate (scale_out/token_in_token_out): no TokenizeParams; without
    max_tokens all that fits, with it the engine stops at max_model_len; a prompt as long as
    max_model_len or longer is refused by the input processor."""
    room = max_model_len - prompt_count
    given = sampling.get("max_tokens")
    min_tokens = lax_int(sampling.get("min_tokens", 0), "body.min_tokens")
    if path == GENERATE:
        if given is not None:
            given = lax_int(given, "body.sampling_params.max_tokens")
            check_min_tokens(given, min_tokens)
        if prompt_count > max_model_len:
            raise validation_error(
                f"The decoder prompt (length {prompt_count}) is longer than the maximum model "
                f"length of {max_model_len}. Make sure that `max_model_len` is no smaller than "
                "the number of text tokens."
            )
        if prompt_count == max_model_len:
            raise validation_error(
                f"The decoder prompt (length {prompt_count}) plus the number of requested "
                "output tokens (at least 1) is longer than the maximum model length of "
                f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number "
                "of text tokens (prompt + requested output tokens)."
            )
        cap = room if given is None else min(given, room)
        check_min_tokens(cap, min_tokens)
        return cap
    name = "max_tokens"
    if path == RESPONSES:
        name = "max_output_tokens"
    elif path.endswith("/chat/completions") or path == MESSAGES:
        if sampling.get("max_completion_tokens") is not None:
            name, given = "max_completion_tokens", sampling["max_completion_tokens"]
    elif given is None:
        given = 16
    if given is not None:
        given = lax_int(given, f"body.{name}")
        if given > max_model_len:
            raise validation_error(
                f"{name}={given} cannot be greater than max_model_len={max_model_len}. Please "
                "request fewer output tokens.",
                name,
                given,
            )
    if prompt_count > max_model_len:
        shown = prompt_count if token_prompt else max_model_len + 1
        at_least = "at least " if shown == max_model_len + 1 else ""
        raise validation_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {at_least}{shown} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            shown,
        )
    cap = room if given is None else min(given, room)
    check_min_tokens(cap, min_tokens)
    return cap


def check_min_tokens(cap: int, min_tokens: int) -> None:
    """SamplingParams' checks of the cap and min_tokens (seen: "max_tokens must be at least 1,
    got 0. (parameter=max_tokens, value=0)"; "min_tokens must be less than or equal to
    max_tokens=507, got 510.", param null)."""
    if cap < 1:
        raise validation_error(f"max_tokens must be at least 1, got {cap}.", "max_tokens", cap)
    if min_tokens < 0:
        raise validation_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > cap:
        raise validation_error(
            f"min_tokens must be less than or equal to max_tokens={cap}, got {min_tokens}."
        )


def stop_strings(sampling: dict[str, Any]) -> list[str]:
    """``stop`` as SamplingParams takes it: a string or a list of them."""
    stop = sampling.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)]


def reasoning_state(ids: list[int]) -> tuple[bool, bool, int]:
    """Where a reasoning model stands after these ids: whether it began thinking at all,
    whether it thinks now, and how many tokens it thought since it began (the last marker)."""
    for back, token in enumerate(reversed(ids)):
        if token == THINK_START_ID:
            return True, True, back
        if token == THINK_END_ID:
            return True, False, 0
    return False, False, 0


def generate(
    prompt: Any,
    body: dict[str, Any],
    choice: int = 0,
    max_model_len: int = MAX_MODEL_LEN,
    *,
    tokenizer: Any = None,
    ids: list[int] | None = None,
    path: str | None = None,
    reasoning: bool = False,
) -> Generation:
    """What this fake model answers, and its text as vLLM 0.32's detokenizer makes it: a
    function of the prompt's token ids (model_input; ``ids`` if the caller has them), the
    sampling fields (``body``: a generate request's sampling_params, a Responses request's
    sampling_of) and which of the request's ``n`` choices it is, only. ``path`` says whose
    defaults and checks apply (output_cap); without it, a chat's if the prompt is messages,
    else a completion's. ``reasoning``: the model thinks first (FakeVllm.reasoning_parser).

    It is autoregressive: each token is drawn from a 64-bit hash of the choice, the prompt's
    ids and the ids generated before it, so a request whose prompt is the prompt's ids plus
    the first k generated ids, with k fewer max_tokens (and min_tokens), generates exactly the
    remaining ones. A piece of a character is always followed by the rest of it; the reasoning
    model writes a think-start token first, then thinks, then a think-end token, as read from
    the ids (a continuation picks up where they stand).

    As vLLM: a stop token ends the answer (its id returned and counted, its text left out); a
    stop string ends it once its text shows (Detokenizer); min_tokens keeps stop tokens and EOS
    from being drawn before then (vLLM masks them)."""
    if path is None:
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        path = "/v1/chat/completions" if chat else "/v1/completions"
    read = model_input(prompt, tokenizer, ids)
    count = len(read) // TOKEN_BYTES
    cap = output_cap(path, body, count, is_token_prompt(prompt), max_model_len)
    stop_ids = {t for t in body.get("stop_token_ids") or () if isinstance(t, int)}
    min_tokens = lax_int(body.get("min_tokens", 0), "body.min_tokens")
    include_stop = bool(body.get("include_stop_str_in_output"))
    ignore_eos = bool(body.get("ignore_eos"))
    table = tokenizer_bytes(tokenizer) if tokenizer is not None else None
    if is_token_prompt(prompt) or table is not None:
        prompt_ids = list(struct.unpack(f"<{count}I", read))
        prompt_bytes = b"".join(token_bytes(t, table) for t in prompt_ids)
    else:  # the text itself, as its 4-byte pieces decode (faster for long prompts)
        prompt_ids, prompt_bytes = [], prompt_text(prompt)
    detokenizer = Detokenizer(prompt_bytes, stop_strings(body), min_tokens, include_stop)
    began, thinking, thought = reasoning_state(prompt_ids) if reasoning else (False, False, 0)
    eos = not is_token_prompt(prompt) and EOS_MARKER in json.dumps(prompt)
    generation = Generation("length", count, prompt_input=read, cap=cap)
    generation.prompt_reasoning_ended = began and not thinking
    state = hashlib.blake2b(choice.to_bytes(8, "little"), digest_size=8)
    state.update(read)
    last = prompt_ids[-1] if prompt_ids else None
    for index in range(cap):
        banned = (stop_ids | {EOS_ID}) if index < min_tokens else set()
        draw = int.from_bytes(state.copy().digest(), "little")
        token = FOLLOWS.get(last, -1) if last is not None else -1
        if index == 0 and eos and not ignore_eos:
            token = EOS_ID
        elif token == -1 and reasoning and not began:
            token = THINK_START_ID
        elif token == -1 and thinking and thought >= 2 and draw % 4 == 0:
            token = THINK_END_ID
        if token == -1 or token in banned:
            allowed = [t for t in STARTS if t not in banned] if banned else STARTS
            token = allowed[draw % len(allowed)]
        began, thought = began or token == THINK_START_ID, thought + 1
        if token in (THINK_START_ID, THINK_END_ID):
            thinking, thought = token == THINK_START_ID, 0
        ends_eos = token == EOS_ID and not ignore_eos
        stop_terminated = ends_eos or token in stop_ids
        generation.token_ids.append(token)
        state.update(token.to_bytes(4, "little"))
        last = token
        stop = detokenizer.update(token_bytes(token), stop_terminated)
        if stop is not None:
            generation.finish_reason, generation.stop_reason = "stop", stop
        elif stop_terminated:
            generation.finish_reason = "stop"
            generation.stop_reason = None if ends_eos else token
        finished = stop is not None or stop_terminated or index == cap - 1
        generation.deltas.append(detokenizer.next_output_text(finished))
        if finished:
            break
    generation.text = detokenizer.output_text
    return generation


# The fakes' own tokenizer and cache geometry, deliberately unlike the proxy's 512-byte blocks:
# a token is 4 bytes of the prompt as the fake serialises it, a KV block 16 tokens.
TOKEN_BYTES = 4
BLOCK_TOKENS = 16


def prompt_tokens(prompt: Any) -> int:
    """The prompt's tokens without a tokenizer: a token prompt's ids, as vLLM counts them;
    else one per 4 bytes of prompt_text."""
    if is_token_prompt(prompt):
        return len(prompt)
    return -(-len(prompt_text(prompt)) // TOKEN_BYTES)


def prompt_text(prompt: Any) -> bytes:
    """The prompt as this fake 'tokenises' it: a chat's messages in order, one per line."""
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return b"".join(
            json.dumps([m.get("role"), m.get("content")]).encode() + b"\n" for m in prompt
        )
    return json.dumps(prompt).encode()


@dataclass
class PromptBlocks:
    """A prompt as an engine's prefix cache sees it."""

    tokens: int  # prompt tokens
    chain: list[bytes]  # per full block, its hash chained with every block before it
    ids: list[int] | None = None  # the token ids, where a real tokenizer made them


def prompt_blocks(prompt: Any, tokenizer: Any = None) -> PromptBlocks:
    """The prompt's full KV blocks, chained as vLLM's prefix cache keys them: of the fake's
    4-byte tokens, or, given a tokenizer, of its token ids as vLLM computes them."""
    if tokenizer is None:
        text, size = prompt_text(prompt), TOKEN_BYTES * BLOCK_TOKENS
        if is_token_prompt(prompt):  # blocks of its ids, as the model reads them
            text = model_input(prompt)
        blocks = [text[start : start + size] for start in range(0, len(text) - size + 1, size)]
        return PromptBlocks(prompt_tokens(prompt), chained(blocks))
    ids = token_ids(prompt, tokenizer)
    blocks = [
        b"".join(t.to_bytes(4, "little") for t in ids[start : start + BLOCK_TOKENS])
        for start in range(0, len(ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS)
    ]
    return PromptBlocks(len(ids), chained(blocks), ids)


def chained(blocks: list[bytes]) -> list[bytes]:
    chain, parent = [], b""
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=32).digest()
        chain.append(parent)
    return chain


def token_ids(prompt: Any, tokenizer: Any) -> list[int]:
    """As vLLM tokenizes: a completion's text with the special tokens, a chat through its
    template without them (the template writes its own)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, verbose=False)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return list(tokenizer(json.dumps(prompt), verbose=False)["input_ids"])


def build_tokenizer(out: Path) -> Any:
    """The small tokenizer the fakes, the proxy's precise routing and the real-vLLM suite's
    tiny model share (tiny_tokenizer.py), saved in ``out``."""
    from tiny_tokenizer import build_tokenizer as build

    return build(out)


class KvEventPublisher:
    """vLLM's ZmqEventPublisher as a subscriber sees it: a PUB socket sending (topic, 8-byte
    sequence number, msgpack [ts, events, dp_rank]) and, given a port, a ROUTER that replays
    buffered batches from a sequence number on, then (b"", -1, b"").

    An XPUB here, which sends as a PUB does and also hears each subscription: a test waits
    for its subscribers instead of sleeping while ZMQ connects them."""

    def __init__(self, port: int, replay_port: int | None, rank: int) -> None:
        import zmq
        import zmq.asyncio

        self.rank = rank
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.subscribers = 0  # subscriptions heard (less those withdrawn)
        self.hear_task = asyncio.ensure_future(self.hear_subscriptions())
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=10_000)
        self.drop: set[int] = set()  # sequence numbers to lose on the way (still replayable)
        self.replay_delay = 0.0  # seconds a replay request waits before it is answered
        self.replay_requests = 0
        # The next replay answer stops after this many batches, without its end marker: as a
        # ROUTER that dropped the rest of it while its reader lagged.
        self.replay_cut: int | None = None
        self.batch_as_map = False  # {"ts", "events", "data_parallel_rank"}: not array-like
        self.replay_task: asyncio.Task[None] | None = None
        if replay_port is not None:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self.replay_task = asyncio.ensure_future(self.serve_replay())

    def publish(self, events: list[Any]) -> None:
        import msgspec

        batch: Any = [time.time(), events, self.rank]
        if self.batch_as_map:
            batch = dict(zip(("ts", "events", "data_parallel_rank"), batch, strict=True))
        payload = msgspec.msgpack.encode(batch)
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if seq not in self.drop:
            self.send(self.frames(seq, payload))

    def send(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)  # a PUB socket never blocks: it drops at its limit

    async def hear_subscriptions(self) -> None:
        while True:
            message = await self.pub.recv()
            self.subscribers += 1 if message[:1] == b"\x01" else -1

    async def serve_replay(self) -> None:
        answers: set[asyncio.Task[None]] = set()  # each in its own task: a delay holds one
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replay_requests += 1
            answer = asyncio.ensure_future(self.answer_replay(client, int.from_bytes(start, "big")))
            answers.add(answer)
            answer.add_done_callback(answers.discard)

    async def answer_replay(self, client: bytes, start: int) -> None:
        """The buffer from ``start`` on, sent as vLLM's publisher thread sends it: all at
        once, whatever the reader's pace (its ROUTER drops what its queue cannot hold), but
        giving the fake's HTTP server turns, as vLLM's thread leaves its API server alone."""
        await asyncio.sleep(self.replay_delay)
        cut, self.replay_cut = self.replay_cut, None
        for n, (seq, payload) in enumerate(list(self.buffer)):
            if cut is not None and seq >= start + cut:
                return  # the rest dropped on the way, the end marker with it
            if seq >= start:
                await self.router.send_multipart([client, b"", *self.frames(seq, payload)])
            if n % 256 == 255:
                await asyncio.sleep(0)
        await self.router.send_multipart([client, b"", *self.frames(-1, b"")])  # the end

    @staticmethod
    def frames(seq: int, payload: bytes) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big", signed=True), payload]

    def close(self) -> None:
        self.hear_task.cancel()
        if self.replay_task is not None:
            self.replay_task.cancel()
        self.context.destroy(linger=0)


@dataclass
class EngineSim:
    """One engine's (DP rank's) prefix cache and queue, and the counters vLLM exports."""

    capacity: int  # KV blocks
    cache: collections.OrderedDict[bytes, None] = field(default_factory=collections.OrderedDict)
    busy: asyncio.Lock | None = None
    running: int = 0
    waiting: int = 0
    queries: int = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
    hits: int = 0  # of those, found cached (vllm:prefix_cache_hits)
    local_hit_tokens: int = 0  # decode: prompt tokens it had cached itself
    transferred_tokens: int = 0  # decode: prompt tokens pulled from a prefill
    computed_tokens: int = 0  # prompt tokens it computed (a prefill's, or a decode's alone)
    requests: int = 0  # prefix cache lookups
    finished: int = 0  # every request answered, as vLLM's request_success_total counts
    active_blocks: int = 0  # held by the prompt being computed
    events: KvEventPublisher | None = None  # where it publishes what it caches and evicts

    def cached(self, prompt: PromptBlocks) -> int:
        """How many of the prompt's leading blocks are cached."""
        cached = 0
        while cached < len(prompt.chain) and prompt.chain[cached] in self.cache:
            cached += 1
        return cached

    def lookup(self, prompt: PromptBlocks) -> int:
        """How many of the prompt's leading blocks are cached; counts the query."""
        cached = self.cached(prompt)
        self.queries += prompt.tokens
        self.hits += cached * BLOCK_TOKENS
        self.requests += 1
        return cached

    def store(self, prompt: PromptBlocks) -> None:
        """Cache the blocks; the least recently used go first, a chain's tail before its head.
        With a publisher, say so as vLLM does (kv_events)."""
        stored = []
        for i in reversed(range(len(prompt.chain))):
            block = prompt.chain[i]
            if block not in self.cache:
                stored.append(i)
            self.cache[block] = None
            self.cache.move_to_end(block)
        removed = []
        while len(self.cache) > self.capacity:
            removed.append(self.cache.popitem(last=False)[0])
        if self.events is not None and prompt.ids is not None and (stored or removed):
            self.events.publish(self.kv_events(prompt, sorted(stored), removed))

    def kv_events(self, prompt: PromptBlocks, stored: list[int], removed: list[bytes]) -> list[Any]:
        """A step's events as vLLM publishes them: a BlockRemoved for each block evicted to
        make room, then one BlockStored for each run of the request's new blocks."""
        assert prompt.ids is not None
        events: list[Any] = [
            {"type": "BlockRemoved", "block_hashes": [block], "medium": "GPU", "group_idx": 0}
            for block in removed
        ]
        for run in consecutive_runs(stored):
            first, end = run[0], run[-1] + 1
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": prompt.chain[first:end],
                    "parent_block_hash": prompt.chain[first - 1] if first else None,
                    "token_ids": prompt.ids[first * BLOCK_TOKENS : end * BLOCK_TOKENS],
                    "block_size": BLOCK_TOKENS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                }
            )
        return events


def consecutive_runs(positions: list[int]) -> list[list[int]]:
    """Sorted positions split where one does not follow the last."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][-1] + 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


# The FakeVllm fields /_fake/inject may set: its failure injection, nothing it observes or
# needs to serve (its role, engines, sessions).
INJECTABLE = frozenset(
    {
        *("fail_status", "force_finish_reason", "delay", "hang", "token_delay"),
        *("transfer_delay", "pull_delay", "keepalive_first", "break_after_tokens"),
        *("error_after_tokens", "faults_left", "fragment_bytes"),
        *("die_after_pull", "fail_pulls", "linger_after_done", "health_status", "health_delay"),
        "die_after_head",
        *("drop_after", "drop_after_pull", "engine_dead", "metrics_status", "extra_waiting"),
        "metrics_delay",
        "kv_usage",
        *("stream_interval", "keepalive_after_finish", "kv_load_failure_policy"),
        "prompt_tokens_details",
    }
)


@dataclass
class FakeVllm:
    """One fake vLLM server. ``role`` is "prefill" (kv_producer) or "decode" (kv_consumer)."""

    role: str
    dp_size: int = 1
    api_key: str | None = None
    # Failure injection.
    fail_status: int | None = None  # answer every completion with this error status
    force_finish_reason: str | None = None  # e.g. "stop": the one-token prefill ends early
    delay: float = 0.0  # seconds of "compute" before answering (prefill) or pulling (decode)
    hang: bool = False  # never answer completions
    token_delay: float = 0.0  # seconds between tokens (a non-streamed answer waits for all)
    transfer_delay: float = 0.0  # decode: seconds a KV transfer takes once the KV is there
    pull_delay: float = 0.0  # decode: seconds before it asks for the KV (its scheduler busy)
    keepalive_first: bool = False  # a streaming decode sends ": keep-alive" before its KV
    # ... and one after its last token's chunk (before the usage and [DONE]), where a break
    # after every token (break_after_tokens = the answer's length) then cuts it.
    keepalive_after_finish: bool = False
    # Tokens per chunk: vLLM's --stream-interval, and what its API server does when it lags
    # behind the engine (RequestOutputCollector merges the steps' outputs: text and ids
    # concatenated). A break (break_after_tokens) loses the steps not yet sent.
    stream_interval: int = 1
    break_after_tokens: int | None = None  # drop the connection mid-stream, after N tokens
    # (all of them: after the last token, before the usage and [DONE])
    fragment_bytes: int | None = None  # a stream's bytes leave in pieces of this size
    # vLLM's --reasoning-parser (deepseek_r1's rules): its model thinks first, between a
    # think-start and a think-end token, on every route; its chats stream "reasoning" and
    # "content" deltas apart and answer message.reasoning and message.content.
    reasoning_parser: bool = False
    # Every chat as vLLM answers one that says include_reasoning false to a server with a
    # reasoning parser whose reasoning had ended before the answer (Reading): chunks carry no
    # token ids even when asked (its prompt's ids still come), each delta's reasoning null,
    # and a token with no content sends no chunk. Completions are untouched, as in vLLM.
    hide_token_ids: bool = False
    # After N tokens, an in-band error event and [DONE], as when vLLM's engine fails.
    error_after_tokens: int | None = None
    # How many more mid-stream faults (the two above) happen; None: every time they are due.
    faults_left: int | None = None
    die_after_pull: bool = False  # decode: drop the connection once the KV arrived (killed)
    fail_pulls: int = 0  # decode: this many KV pulls fail, as Mooncake's can ("returned -1")
    die_after_head: bool = False  # a whole answer's head goes out, then the process dies
    linger_after_done: float = 0.0  # seconds between a stream's [DONE] and its end
    kv_timeout: float = 480.0  # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
    bootstrap_not_ready: int = 0  # answer /query 503 this many times, then {} once
    health_status: int = 200
    max_model_len: int = MAX_MODEL_LEN  # tokens, as /v1/models says; longer prompts refused
    engine_dead: str | None = None  # why its engine core died, as vLLM's can (check_kv_params)
    health_delay: float = 0.0  # a busy server: /health answers, slowly
    drop_after: float | None = None  # accept a completion, then reset the connection
    # prefill: once its KV was pulled, the connection drops this many seconds later with no
    # answer: a process lost after its KV left (vLLM answers as the KV goes; a fault only).
    drop_after_pull: float | None = None
    # A prefix cache per engine (0: none) and prefill compute time per uncached prompt token;
    # a prefill engine computes one prompt at a time, the rest wait (as in vLLM's queue).
    cache_blocks: int = 0
    token_time: float = 0.0
    # A real (small) tokenizer: prompts become its token ids, as in vLLM, and with a port the
    # engines publish vLLM's KV cache events (rank r on port + r; replay likewise).
    tokenizer: Any = None
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    # Observations.
    requests: list[Recorded] = field(default_factory=list)
    sent: dict[str, bytearray] = field(default_factory=dict)  # request id -> bytes written
    # request id -> the bytes without return_token_ids (sent_without_token_ids)
    sent_plain: dict[str, bytearray] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)  # request ids whose client went away
    dropped: int = 0  # connections dropped unanswered after their KV was pulled
    running: int = 0
    # The ids of the streams (completions, chats, generate) that sent a token but not yet their
    # last: a client has part of their answer.
    streaming: set[str] = field(default_factory=set)
    kv_tokens_received: int = 0
    resolved: int = 0  # decode legs whose prefill engine the bootstrap named (resolve_worker)
    transfers_served: int = 0
    pull_failures: list[str] = field(default_factory=list)  # decode: why each failed pull did
    transfer_collisions: int = 0
    query_count: int = 0
    health_count: int = 0
    api_url: str = ""
    # transfer_id -> (engine id, prompt digest, prompt tokens) of finished prefills.
    _held_kv: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    _kv_ready: asyncio.Condition | None = None
    # Where decodes pull this prefill's KV (Mooncake's own channel); its API server by default.
    worker_url: str = ""
    engine_prefix: str = field(default_factory=lambda: str(uuid.uuid4()))
    sims: list[EngineSim] = field(default_factory=list)
    metrics_status: int = 200  # 404: a server without /metrics
    # A busy server: its /metrics page is made when asked, with the counters as they stand
    # then, and reaches the scraper this many seconds later.
    metrics_delay: float = 0.0
    metrics_count: int = 0  # /metrics requests begun
    extra_waiting: int = 0  # added to every engine's vllm:num_requests_waiting
    kv_usage: float | None = None  # said as every engine's vllm:kv_cache_usage_perc instead
    # decode: what a failed pull does, as vLLM's KVTransferConfig field: "fail" the request,
    # or "recompute" the prompt and answer as if nothing happened (PROTOCOL.md).
    kv_load_failure_policy: str = "fail"
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    prompt_tokens_details: bool = False
    _blocks: dict[str, PromptBlocks] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters loaded: name -> path
    model: str = MODEL  # --served-model-name: what it serves, and what requests must name
    models_status: int = 200  # another: /v1/models fails so

    def sim(self, rank: int) -> EngineSim:
        while len(self.sims) < self.dp_size:
            sim, index = EngineSim(self.cache_blocks), len(self.sims)
            if self.kv_events_port is not None:
                replay = self.kv_replay_port + index if self.kv_replay_port else None
                sim.events = KvEventPublisher(self.kv_events_port + index, replay, index)
            self.sims.append(sim)
        return self.sims[rank]

    def prompt_blocks(self, prompt: Any) -> PromptBlocks:
        """prompt_blocks, remembered for the prompts of the last few thousand requests: each
        is asked for by its usage and by the prefix cache, and tokenizing costs."""
        if self.tokenizer is None:
            return prompt_blocks(prompt)
        key = json.dumps(prompt)
        if (blocks := self._blocks.get(key)) is None:
            if len(self._blocks) >= 4096:
                self._blocks.clear()
            blocks = self._blocks[key] = prompt_blocks(prompt, self.tokenizer)
        return blocks

    def close_publishers(self) -> None:
        for sim in self.sims:
            if sim.events is not None:
                sim.events.close()
                sim.events = None

    def prefix_hit_rate(self) -> float:
        queries = sum(sim.queries for sim in self.sims)
        return sum(sim.hits for sim in self.sims) / queries if queries else 0.0

    # --- identity

    @property
    def engine_ids(self) -> list[str]:
        return [f"{self.engine_prefix}_dp{rank}" for rank in range(self.dp_size)]

    def restart(self) -> None:
        """What a vLLM restart looks like from outside: new engine ids, held KV gone."""
        self.engine_prefix = str(uuid.uuid4())
        self._held_kv.clear()
        self.close_publishers()  # a new process: its caches empty, its sequence from 0
        self.sims.clear()

    def condition(self) -> asyncio.Condition:
        if self._kv_ready is None:
            self._kv_ready = asyncio.Condition()
        return self._kv_ready

    # --- apps

    def api_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[fastapi_errors])
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_post("/v1/completions", self.handle_completion)
        app.router.add_post("/v1/chat/completions", self.handle_completion)
        app.router.add_post(RESPONSES, self.handle_completion)
        app.router.add_post(GENERATE, self.handle_completion)
        app.router.add_post(MESSAGES, self.handle_completion)
        app.router.add_post("/invocations", self.handle_completion)
        app.router.add_get("/_fake/kv", self.handle_kv_pull)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/version", self.handle_version)
        app.router.add_post("/tokenize", self.handle_tokenize)
        app.router.add_post("/detokenize", self.handle_detokenize)
        app.router.add_post("/v1/load_lora_adapter", self.handle_load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self.handle_unload_lora)
        app.router.add_post("/_fake/reset", self.handle_reset)
        app.router.add_post("/_fake/warm", self.handle_warm)
        app.router.add_get("/_fake/stats", self.handle_stats)
        app.router.add_post("/_fake/inject", self.handle_inject)
        app.router.add_post("/_fake/die", self.handle_die)
        app.cleanup_ctx.append(self._session_ctx)
        return app

    def bootstrap_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/query", self.handle_query)
        # With worker_url here, KV is pulled from the bootstrap's server: it outlives the API
        # server's drain, as Mooncake's transfer channel outlives vLLM's HTTP server.
        app.router.add_get("/_fake/kv", self.handle_kv_pull)
        return app

    async def _session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.kv_events_port is not None:
            self.sim(0)  # publishers bind as the server starts, as vLLM's engines do
        yield
        await self._session.close()
        self.close_publishers()

    # --- handlers

    async def handle_health(self, request: web.Request) -> web.Response:
        self.health_count += 1
        await asyncio.sleep(self.health_delay)
        return web.Response(status=503 if self.engine_dead else self.health_status)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """vLLM's series, one per engine (the "engine" label is the DP rank)."""
        self.metrics_count += 1
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status)
        lines = []
        for rank in range(self.dp_size):
            sim, labels = self.sim(rank), f'engine="{rank}",model_name="{self.model}"'
            running = sim.running if self.role == "prefill" else self.running
            # As vLLM's: the blocks running requests hold. Cached blocks no request uses are
            # free to evict, so a cache full of them is not a full KV cache.
            usage = sim.active_blocks / sim.capacity if sim.capacity else 0.0
            usage = usage if self.kv_usage is None else self.kv_usage
            lines += [
                f"vllm:num_requests_running{{{labels}}} {float(running)}",
                f"vllm:num_requests_waiting{{{labels}}} {float(sim.waiting + self.extra_waiting)}",
                f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
                f"vllm:prefix_cache_queries_total{{{labels}}} {float(sim.queries)}",
                f"vllm:prefix_cache_hits_total{{{labels}}} {float(sim.hits)}",
                f'vllm:request_success_total{{{labels},finished_reason="length"}} '
                f"{float(sim.finished)}",
                f'vllm:prompt_tokens_by_source_total{{{labels},source="local_cache_hit"}} '
                f"{float(sim.local_hit_tokens)}",
                f'vllm:prompt_tokens_by_source_total{{{labels},source="external_kv_transfer"}} '
                f"{float(sim.transferred_tokens)}",
                f'vllm:prompt_tokens_by_source_total{{{labels},source="local_compute"}} '
                f"{float(sim.computed_tokens)}",
                f'vllm:cache_config_info{{block_size="{BLOCK_TOKENS}",engine="{rank}",'
                f'kv_cache_size_tokens="{sim.capacity * BLOCK_TOKENS}",'
                f'num_gpu_blocks="{sim.capacity * self.dp_size}"}} 1.0',
            ]
        await asyncio.sleep(self.metrics_delay)
        return web.Response(text="\n".join(["# a fake vLLM", *lines, ""]))

    async def handle_warm(self, request: web.Request) -> web.Response:
        """Tokenize these requests' prompts now ({"requests": [[path, body], ...]}), caches
        untouched: a benchmark's first run of a workload would otherwise pay the fake's
        first sight of each prompt (prompt_blocks remembers them), and the runs after it not."""
        for path, body in (await request.json())["requests"]:
            self.prompt_blocks(prompt_of(path, body))
        return web.Response()

    async def handle_stats(self, request: web.Request) -> web.Response:
        """What a test in another process needs to know of this server."""
        stats = {"requests": len(self.requests), "running": self.running}
        return web.json_response(stats | {"engine_ids": self.engine_ids})

    async def handle_die(self, request: web.Request) -> web.Response:
        """SIGKILL itself, as the chaos benchmark kills a decode, having written to the file
        named {"record": path} what was running then: the requests, and the streams among
        them cut after a token and before their last (a chat's role chunk alone is no token,
        and a PD proxy holds it back). Nothing runs between the count and the death (no
        await), so the benchmark knows how many answers the kill cut after the client had
        part of them: the streams a proxy must continue elsewhere."""
        record = Path((await request.json())["record"])
        streaming = len(self.streaming)
        # Blocking on purpose: an await here would let the streams go on before the death.
        record.write_text(json.dumps({"running": self.running, "streaming": streaming}))  # noqa: ASYNC240
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("not reached")  # pragma: no cover

    async def handle_inject(self, request: web.Request) -> web.Response:
        """Set failure-injection fields ({"fail_pulls": 3}) of a fake in another process (one
        started with --serve), as a test sets them on a fake in its own: the chaos benchmark
        drives its faults so. Answers the fields as they now are."""
        changes = await request.json()
        if not isinstance(changes, dict) or not changes.keys() <= INJECTABLE:
            return error(400, f"an object of fields among {sorted(INJECTABLE)}")
        for name, value in changes.items():
            setattr(self, name, value)
        return web.json_response({name: getattr(self, name) for name in changes})

    async def handle_reset(self, request: web.Request) -> web.Response:
        """Empty caches and counters, between two benchmark runs: as vLLM's
        /reset_prefix_cache, which publishes AllBlocksCleared."""
        self.sims = [EngineSim(self.cache_blocks, events=sim.events) for sim in self.sims]
        for sim in self.sims:
            if sim.events is not None:
                sim.events.publish([{"type": "AllBlocksCleared"}])
        return web.Response()

    async def compute_prefill(self, rank: int, prompt: Any) -> None:
        """Queue for the engine, then spend time on the prompt tokens it has not cached."""
        sim = self.sim(rank)
        if sim.busy is None:
            sim.busy = asyncio.Lock()
        sim.waiting += 1
        queued = True
        try:
            async with sim.busy:
                sim.waiting, queued = sim.waiting - 1, False
                sim.running += 1
                try:
                    blocks = self.prompt_blocks(prompt)
                    cached = sim.lookup(blocks)
                    sim.active_blocks = len(blocks.chain)
                    sim.computed_tokens += blocks.tokens - cached * BLOCK_TOKENS
                    await asyncio.sleep((blocks.tokens - cached * BLOCK_TOKENS) * self.token_time)
                    sim.store(blocks)
                    sim.active_blocks = 0
                finally:
                    sim.running -= 1
        finally:
            if queued:  # cancelled while waiting (the proxy closed the connection)
                sim.waiting -= 1

    async def compute_alone(self, prompt: Any) -> int:
        """A decode computing a prompt sent to it alone (no KV to pull): what its prefix cache
        lacks, at token_time a token, its running streams paused meanwhile (between_tokens),
        as vLLM's steps carry the prompt's chunks beside their tokens (here the whole pause
        at once, a simplification). The prompt's tokens its prefix cache held."""
        sim = self.sim(0)
        if sim.busy is None:
            sim.busy = asyncio.Lock()
        async with sim.busy:
            blocks = self.prompt_blocks(prompt)
            if not self.cache_blocks:  # no prefix cache: computed whole, nothing kept
                sim.computed_tokens += blocks.tokens
                await asyncio.sleep(blocks.tokens * self.token_time)
                return 0
            cached = sim.lookup(blocks)
            sim.local_hit_tokens += cached * BLOCK_TOKENS
            sim.computed_tokens += blocks.tokens - cached * BLOCK_TOKENS
            await asyncio.sleep((blocks.tokens - cached * BLOCK_TOKENS) * self.token_time)
            sim.store(blocks)
            return cached * BLOCK_TOKENS

    async def between_tokens(self) -> None:
        """A stream's wait for its next token: token_delay, and on a decode computing a prompt
        alone (compute_alone), until that is done."""
        if self.token_delay:
            await asyncio.sleep(self.token_delay)
        busy = self.sims[0].busy if self.role == "decode" and self.sims else None
        if busy is not None and busy.locked():
            async with busy:
                pass

    def receive_kv(self, prompt: Any) -> int:
        """A decode's prefix cache: it pulls only the blocks it lacks, and keeps them. The
        prompt's tokens cached when it came: all of them, pulled or held."""
        sim = self.sim(0)
        blocks = self.prompt_blocks(prompt)
        if not self.cache_blocks:  # no prefix cache: the whole prompt pulled, nothing kept
            sim.transferred_tokens += blocks.tokens
            return blocks.tokens
        cached = sim.lookup(blocks)
        sim.local_hit_tokens += cached * BLOCK_TOKENS
        sim.transferred_tokens += blocks.tokens - cached * BLOCK_TOKENS
        sim.store(blocks)
        return blocks.tokens

    async def handle_models(self, request: web.Request) -> web.Response:
        if (denied := self.check_auth(request)) is not None:
            return denied
        if self.models_status != 200:
            return error(self.models_status, "models are not listed here")
        model = {
            "id": self.model,
            "object": "model",
            "owned_by": "vllm",
            "max_model_len": self.max_model_len,
        }
        # LoRA adapters, as vLLM lists them: their path as root, the base model as parent.
        adapters = [
            {
                "id": name,
                "object": "model",
                "owned_by": "vllm",
                "root": path,
                "parent": self.model,
                "max_model_len": None,
            }
            for name, path in self.adapters.items()
        ]
        payload = compact({"object": "list", "data": [model, *adapters]})
        return web.Response(body=payload, content_type="application/json")

    # --- vLLM's other routes (PROTOCOL.md): what the proxy passes through

    def unknown_model(self, model: str) -> str:
        """vLLM 0.32's answer to a model it does not serve (_check_model), on every route: its
        aliases are its served model names, not its adapters."""
        return f"The model `{model}` does not exist. Valid aliases: {self.model}."

    def serves(self, model: object) -> bool:
        return not model or model == self.model or model in self.adapters

    async def handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def json_body(self, request: web.Request) -> dict[str, Any]:
        """The body as vLLM reads one: a JSON object naming this model, if any, else a
        BadRequest (an unknown model's 404 among them)."""
        if request.content_type.lower() != "application/json":
            raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest("body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be an object")
        if not self.serves(model := body.get("model")):
            raise BadRequest(self.unknown_model(str(model)), "model", status=404)
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body, None))
        return body

    async def handle_tokenize(self, request: web.Request) -> web.StreamResponse:
        """vLLM's TokenizeResponse: the prompt's (or a chat's) token ids, as this model reads
        them (model_input), with their count and the model's length limit."""
        try:
            body = await self.json_body(request)
            prompt = body["messages"] if "messages" in body else body.get("prompt")
            if not isinstance(prompt, str | list):
                raise BadRequest("prompt or messages is required", "prompt")
            read = model_input(prompt, self.tokenizer)
        except BadRequest as bad:
            return error(bad.status, str(bad), bad.param)
        ids = list(struct.unpack(f"<{len(read) // TOKEN_BYTES}I", read))
        return await self.whole(
            request,
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
             "token_strs": None},
        )  # fmt: skip

    async def whole(self, request: web.Request, payload: Any) -> web.StreamResponse:
        """A JSON answer; with die_after_head its head goes out and the process dies."""
        raw = compact(payload)
        if not self.die_after_head:
            return web.Response(body=raw, content_type="application/json")
        cut = web.StreamResponse(headers={"Content-Type": "application/json"})
        cut.content_length = len(raw)
        await cut.prepare(request)
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError

    async def handle_detokenize(self, request: web.Request) -> web.StreamResponse:
        """vLLM's DetokenizeResponse: the text of token ids (the inverse of handle_tokenize)."""
        try:
            body = await self.json_body(request)
            ids = body.get("tokens")
            if not is_token_prompt(ids) and ids != []:
                raise BadRequest("tokens must be a list of token ids", "tokens")
            read = model_input(ids) if ids else b""
        except BadRequest as bad:
            return error(bad.status, str(bad), bad.param)
        if self.tokenizer is not None:
            return await self.whole(request, {"prompt": self.tokenizer.decode(ids)})
        # The model's own tokens by their bytes, decoded lossily as a byte-level tokenizer does:
        # ids that end inside a character end in U+FFFD (what vLLM's detokenizer tests).
        text = b"".join(token_bytes(token) for token in ids or ()) if read else b""
        return await self.whole(request, {"prompt": text.decode("utf-8", "replace")})

    async def handle_load_lora(self, request: web.Request) -> web.Response:
        """vLLM's runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING): a plain-text 200,
        or an error for a name already loaded."""
        try:
            body = await self.json_body(request)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path:
                raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.")
            if name in self.adapters:
                raise BadRequest(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
        except BadRequest as bad:
            return error(bad.status, str(bad), bad.param)
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def handle_unload_lora(self, request: web.Request) -> web.Response:
        try:
            body = await self.json_body(request)
            name = body.get("lora_name")
            if not name:
                raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
            if name not in self.adapters:
                raise BadRequest(f"The lora adapter '{name}' cannot be found.", status=404)
        except BadRequest as bad:
            return error(bad.status, str(bad), bad.param)
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def handle_query(self, request: web.Request) -> web.Response:
        self.query_count += 1
        if self.role != "prefill":
            return web.Response(status=404)
        if self.bootstrap_not_ready > 0:
            self.bootstrap_not_ready -= 1
            if self.bootstrap_not_ready == 0:
                return web.json_response({})
            return web.json_response({"detail": "topology is not ready."}, status=503)
        worker = {"0": {"0": self.worker_url or self.api_url}}
        return web.json_response(
            {
                str(rank): {"engine_id": engine_id, "worker_addr": worker, "tp_size": 1}
                for rank, engine_id in enumerate(self.engine_ids)
            }
        )

    def check_auth(self, request: web.Request) -> web.Response | None:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return error(401, "Unauthorized")
        return None

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        """The generating routes: completions, chat, Responses, generate, Anthropic's
        Messages and SageMaker's /invocations (a chat or a completion by its body)."""
        if (denied := self.check_auth(request)) is not None:
            return denied
        if request.content_type.lower() != "application/json":
            # vLLM's validate_json_request, answered before the body is read.
            message = (
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
            )
            return error(400, message, kind="Bad Request")
        try:
            body = await request.json()
        except ValueError:
            return error(400, "body is not JSON")
        if not isinstance(body, dict):
            return error(400, "body must be an object")
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body, peer))
        self.running += 1
        try:
            path = api_path(request.path, body)
            response = await self.complete(request, path, body, request_id)
            if response.status == 200:  # complete() checked the rank
                self.sim(int(request.headers.get("X-data-parallel-rank") or 0)).finished += 1
            return anthropic_error(response) if path == MESSAGES else response
        except BadRequest as bad:
            refused = error(bad.status, str(bad), bad.param, bad.kind)
            # What pydantic refuses (type "Bad Request") vLLM's global handler answers in
            # OpenAI's shape on every route; the Messages handler's own errors in Anthropic's.
            if request.path == MESSAGES and bad.kind != "Bad Request":
                return anthropic_error(refused)
            return refused
        except asyncio.CancelledError:
            # The client (the proxy) closed the connection: vLLM aborts the request.
            self.aborted.append(request_id)
            raise
        finally:
            self.running -= 1
            self.streaming.discard(request_id)

    async def complete(
        self, request: web.Request, path: str, body: dict[str, Any], request_id: str
    ) -> web.StreamResponse:
        """One generating request, its ``path`` the API whose rules apply (api_path)."""
        # What pydantic refuses as it reads the body, before any other check.
        check_int_fields(path, body)
        stream = body.get("stream", False)
        if body.get("stream_options") is not None and not stream and path != MESSAGES:
            raise validation_error(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if is_chat(path):
            check_tools(body)
        rank_header = request.headers.get("X-data-parallel-rank")
        if rank_header is not None and (
            not rank_header.isdigit() or int(rank_header) >= self.dp_size
        ):
            raise BadRequest(f"data parallel rank {rank_header} is out of range")
        rank = int(rank_header or 0)
        if self.engine_dead is not None:
            return error(500, "The server had an error while processing your request.")
        params = body.get("kv_transfer_params") or {}
        if (fatal := self.check_kv_params(params)) is not None:
            self.engine_dead = fatal
            return error(500, "The server had an error while processing your request.")
        if not self.serves(model := body.get("model")):
            raise BadRequest(self.unknown_model(str(model)), "model", status=404)
        if path == RESPONSES:
            refuse_stored(body)
        if is_chat(path):
            refuse_tool_choice(body)
        # vLLM's child requests: one per prompt of a batch and per choice of ``n``.
        sampling = sampling_of(path, body)
        prompts, count = prompts_of(path, body), sample_count(sampling)
        for prompt in prompts:
            refuse_unencodable(prompt)
            if is_token_prompt(prompt):
                model_input(prompt)  # refuses ids out of the vocabulary
        children = [prompt for prompt in prompts for _ in range(count)]
        # With a tokenizer, the model reads (and usage counts) the tokenizer's ids.
        ids = [self.prompt_blocks(p).ids if self.tokenizer is not None else None for p in prompts]
        generations = [
            generate(
                prompt,
                sampling,
                choice,
                self.max_model_len,
                tokenizer=self.tokenizer,
                ids=prompt_ids,
                path=path,
                reasoning=self.reasoning_parser,
            )
            for prompt, prompt_ids in zip(prompts, ids, strict=True)
            for choice in range(count)
        ]
        if self.fail_status is not None:
            return error(self.fail_status, f"injected failure {self.fail_status}")
        if self.hang:
            await asyncio.Event().wait()
        if self.drop_after is not None:
            await asyncio.sleep(self.drop_after)
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if self.force_finish_reason is not None:
            for generation in generations:
                generation.finish_reason = self.force_finish_reason
        if self.role == "prefill":
            await asyncio.sleep(self.delay)
            if self.cache_blocks:
                for prompt in prompts:
                    await self.compute_prefill(rank, prompt)
            if params.get("do_remote_decode"):
                # Every child request holds its KV under the one transfer_id, as in vLLM.
                for child, generation in zip(children, generations, strict=True):
                    if generation.finish_reason == "length":
                        await self.hold_kv(self.engine_ids[rank], params, child, generation)
            if self.drop_after_pull is not None:
                while params.get("transfer_id") in self._held_kv:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(self.drop_after_pull)
                assert request.transport is not None
                request.transport.abort()
                self.dropped += 1
                raise asyncio.CancelledError
            return await self.answer(request, path, body, request_id, generations)
        worker: str | None = None
        failure: str | None = None
        if params.get("do_remote_prefill"):
            # An unknown engine id fails at once: non-streamed a 500, streamed in band (as
            # a failed pull does, below; seen on vLLM 0.32).
            worker, failure = await self.resolve_worker(params)
            if failure is None:
                self.resolved += 1
        if failure is not None and self.kv_load_failure_policy == "recompute":
            self.pull_failures.append(failure)
            failure = None  # computed alone below, as if sent so
        if failure is not None and not stream:
            return error(500, failure)
        response: web.StreamResponse | None = None
        if stream:
            # vLLM sends 200 and its headers at once, before the KV has arrived.
            response = await event_stream(request)
            self.begin_sent(request_id)
            if self.keepalive_first:
                await self.write(response, request_id, b": keep-alive\n\n")
        if failure is not None:
            assert response is not None
            return await self.fail_in_band(
                response, request, path, body, request_id, failure, generations
            )
        if worker is not None:
            await asyncio.sleep(self.pull_delay)
            # Every child request pulls the one transfer_id, as in vLLM; Mooncake hands it to
            # one of them, and the rest wait out the KV timeout (or load another's KV).
            pulls = [self.pull_kv(worker, params, child) for child in children]
            failure = next((f for f in await asyncio.gather(*pulls) if f is not None), None)
            if failure is None and self.fail_pulls > 0:
                self.fail_pulls -= 1
                failure = "Mooncake transfer engine returned -1"
            await asyncio.sleep(self.transfer_delay)
            if failure is not None and self.kv_load_failure_policy == "recompute":
                self.pull_failures.append(failure)
                failure = None
                cached_when_came(generations, [await self.compute_alone(p) for p in prompts])
            elif failure is None:
                cached_when_came(generations, [self.receive_kv(p) for p in prompts])
            if failure is None and self.die_after_pull:
                assert request.transport is not None
                request.transport.abort()  # as a process killed while it generates
                raise asyncio.CancelledError
            if failure is not None:
                self.pull_failures.append(failure)
                if response is None:
                    return error(500, "Internal server error")  # vLLM says no more
                return await self.fail_in_band(
                    response, request, path, body, request_id, failure, generations
                )
        else:
            await asyncio.sleep(self.delay)
            cached_when_came(generations, [await self.compute_alone(p) for p in prompts])
        return await self.answer(request, path, body, request_id, generations, response)

    # --- Mooncake, simulated over HTTP

    async def hold_kv(
        self, engine_id: str, params: dict[str, Any], prompt: Any, generation: Generation
    ) -> None:
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id:
            return  # vLLM warns "Missing transfer_id" and transfers nothing
        if transfer_id in self._held_kv:
            self.transfer_collisions += 1
        async with self.condition():
            self._held_kv[transfer_id] = (engine_id, digest_of(prompt), generation.prompt_tokens)
            self.condition().notify_all()

    async def handle_kv_pull(self, request: web.Request) -> web.Response:
        transfer_id = request.query["transfer_id"]
        engine_id = request.query["engine_id"]
        wait = float(request.query.get("timeout", "480"))

        def ready() -> bool:
            held = self._held_kv.get(transfer_id)
            return held is not None and held[0] == engine_id

        try:
            async with self.condition():
                await asyncio.wait_for(self.condition().wait_for(ready), wait)
        except TimeoutError:
            return web.json_response({"error": "timeout"}, status=504)
        _, digest, prompt_tokens = self._held_kv.pop(transfer_id)
        self.transfers_served += 1
        return web.json_response({"digest": digest, "prompt_tokens": prompt_tokens})

    def check_kv_params(self, params: Any) -> str | None:
        """What kills vLLM's engine core in these kv_transfer_params (MooncakeConnector's
        asserts, vLLM 0.33: the engine dies, this and every later request gets a 500 and
        /health 503), or None. Its flags are read as truthy values, as vLLM reads them."""
        if not isinstance(params, dict):
            return "kv_transfer_params is not an object"
        if self.role == "prefill" and params.get("do_remote_prefill"):
            return "do_remote_prefill on a kv_producer"
        if self.role == "decode" and params.get("do_remote_decode"):
            return "do_remote_decode on a kv_consumer"
        return None

    async def resolve_worker(self, params: dict[str, Any]) -> tuple[str | None, str | None]:
        """The prefill worker holding ``remote_engine_id``, found through the bootstrap."""
        if not all(
            p in params for p in ("remote_bootstrap_addr", "remote_engine_id", "transfer_id")
        ):
            # vLLM logs "Got invalid KVTransferParams" and queues no pull: the request waits
            # for KV that never comes, until its client leaves.
            await asyncio.Event().wait()
        bootstrap = params.get("remote_bootstrap_addr")
        engine_id = params.get("remote_engine_id")
        if not isinstance(bootstrap, str):
            await asyncio.Event().wait()  # vLLM's lookup fails before its try: it waits too
        if not all(isinstance(v, str) for v in (engine_id, params.get("transfer_id"))):
            return None, "Internal server error"  # the prefill's typed decoder refuses it
        try:
            async with self._session.get(f"{bootstrap}/query") as query:
                if query.status != 200:
                    return None, f"bootstrap {bootstrap}/query answered {query.status}"
                ranks = await query.json()
        except aiohttp.ClientError as failure:
            return None, f"bootstrap {bootstrap}/query failed: {failure}"
        workers = {entry["engine_id"]: entry["worker_addr"]["0"]["0"] for entry in ranks.values()}
        if engine_id not in workers:
            return None, f"Internal server error: unknown engine id {engine_id}"
        return workers[engine_id], None

    async def pull_kv(self, worker: str, params: dict[str, Any], prompt: Any) -> str | None:
        """Pull the KV the way the decode does; a failure message, or None once it arrived."""
        engine_id, transfer_id = params["remote_engine_id"], params["transfer_id"]
        try:
            async with self._session.get(
                f"{worker}/_fake/kv",
                params={
                    "transfer_id": transfer_id,
                    "engine_id": engine_id,
                    "timeout": str(self.kv_timeout),
                },
            ) as pull:
                if pull.status != 200:
                    return f"KV for {transfer_id} did not arrive within {self.kv_timeout} s"
                kv = await pull.json()
        except aiohttp.ClientError as failure:
            return f"KV transfer failed: {failure}"
        if kv["digest"] != digest_of(prompt):
            return f"KV for {transfer_id} belongs to another prompt"
        self.kv_tokens_received += kv["prompt_tokens"]
        return None

    # --- answers

    def begin_sent(self, request_id: str, raw: bytes = b"", plain: bytes | None = None) -> None:
        """What the answer to ``request_id`` wrote, from nothing (``raw`` for a whole answer;
        ``plain``: it without return_token_ids, if that differs)."""
        self.sent[request_id] = bytearray(raw)
        self.sent_plain[request_id] = bytearray(raw if plain is None else plain)

    def sent_without_token_ids(self, request_id: str) -> bytes:
        """The bytes the answer to ``request_id`` would have been without ``return_token_ids``
        (every token id list null, as vLLM writes it then): what a client of a proxy that
        asks for the ids and blanks them must receive. ``sent``'s bytes for a request without
        the flag."""
        return bytes(self.sent_plain[request_id])

    async def write(
        self, response: web.StreamResponse, request_id: str, data: bytes, plain: bytes | None = None
    ) -> None:
        self.sent.setdefault(request_id, bytearray()).extend(data)
        self.sent_plain.setdefault(request_id, bytearray()).extend(data if plain is None else plain)
        if not self.fragment_bytes:
            await response.write(data)
            return
        for start in range(0, len(data), self.fragment_bytes):  # as TCP may cut them anywhere
            await response.write(data[start : start + self.fragment_bytes])
            await asyncio.sleep(0.001)

    def take_fault(self) -> bool:
        """Whether a mid-stream fault due now happens: always, or while faults_left lasts."""
        if self.faults_left is None:
            return True
        if self.faults_left <= 0:
            return False
        self.faults_left -= 1
        return True

    async def answer(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        request_id: str,
        generations: list[Generation],
        response: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        if path == RESPONSES:
            return await self.answer_response(request, body, request_id, generations[0], response)
        if path == MESSAGES:
            return await self.answer_message(request, body, request_id, generations[0], response)
        return await self.answer_choices(request, path, body, request_id, generations, response)

    def reading(self, path: str, body: dict[str, Any]) -> Reading:
        """How this server's chat parser reads a request's answer (chat_completion/serving.py):
        with --reasoning-parser, reasoning and content apart; include_reasoning false hides
        the reasoning and the token ids (hide_stream_metadata). hide_token_ids: as
        include_reasoning false with a parser whose reasoning already ended."""
        if not is_chat(path) or not (self.reasoning_parser or self.hide_token_ids):
            return Reading()
        shown = body.get("include_reasoning", True) is not False and not self.hide_token_ids
        return Reading(True, shown, self.hide_token_ids and not self.reasoning_parser)

    def chat_usage(self, usage: dict[str, Any], generations: list[Generation]) -> dict[str, Any]:
        """A chat's usage: with a reasoning parser it counts the reasoning tokens too."""
        if not self.reasoning_parser:
            return usage
        thought = sum(count_reasoning_tokens(g.token_ids) for g in generations)
        return usage | {"completion_tokens_details": {"reasoning_tokens": thought}}

    def response_object(
        self, body: dict[str, Any], request_id: str, generation: Generation
    ) -> dict[str, Any]:
        """A Responses answer as vLLM 0.32 writes it (the fields a client reads): one message
        of output text; "incomplete" for max_output_tokens where the cap ended it (what a
        prefill's one token does), max_output_tokens the cap it ran with (seen: 506 for a
        6-token prompt without one, on max_model_len 512), and kv_transfer_params null
        (vLLM's, as a prefill's). With a reasoning parser, the message holds the content only
        (vLLM adds a reasoning item, which the fake leaves out)."""
        text = generation.text
        if self.reasoning_parser:
            text = parse_reasoning(text)[1] or ""
        length = generation.finish_reason == "length"
        part: dict[str, Any] = {
            "annotations": [],
            "text": text,
            "type": "output_text",
            "logprobs": None,
        }
        message = {"id": f"msg_{request_id}", "content": [part], "role": "assistant"}
        message |= {"status": "completed", "type": "message"}
        tokens = len(generation.token_ids)
        thought = count_reasoning_tokens(generation.token_ids) if self.reasoning_parser else 0
        usage: dict[str, Any] = {
            "input_tokens": generation.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": generation.prompt_tokens + tokens,
        }
        return {
            "id": f"resp_{request_id}",
            "created_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "instructions": body.get("instructions"),
            "model": body.get("model", MODEL),
            "object": "response",
            "output": [message],
            "max_output_tokens": generation.cap,
            "previous_response_id": None,
            "status": "incomplete" if length else "completed",
            "usage": usage,
            "kv_transfer_params": None,
        }

    async def answer_response(
        self,
        request: web.Request,
        body: dict[str, Any],
        request_id: str,
        generation: Generation,
        response: web.StreamResponse | None,
    ) -> web.StreamResponse:
        """A Responses answer, whole or streamed: its events in order, a delta for each step
        that has text (responses/serving.py, _process_simple_streaming_events: an empty one
        makes no event, and the message's item and part open with the first text), and no
        [DONE]. A mid-stream fault cuts the stream (vLLM 0.32 has no error event that such a
        stream can carry)."""
        done = self.response_object(body, request_id, generation)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * len(generation.token_ids))
            self.begin_sent(request_id, compact(done))
            return await self.whole(request, done)
        if response is None:
            response = await event_stream(request)
        events = ResponseEvents(done)
        for event in events.head():
            await self.write(response, request_id, event)
        deltas = generation.deltas
        if self.reasoning_parser:
            deltas = [
                (m or {}).get("content") or "" for m in chat_deltas(generation, Reading(True))
            ]
        for position, text in enumerate(deltas):
            if position in (self.break_after_tokens, self.error_after_tokens) and (
                self.take_fault()
            ):
                assert request.transport is not None
                request.transport.abort()
                return response
            if text:
                for event in events.delta(text):
                    await self.write(response, request_id, event)
            await self.between_tokens()
        for event in events.tail():
            await self.write(response, request_id, event)
        await response.write_eof()
        return response

    async def answer_choices(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        request_id: str,
        generations: list[Generation],
        response: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """The choices as vLLM 0.32 writes them: one per generation, indexed in order; streamed,
        a chunk for each choice's token (a chat's role chunks first), the choices' tokens in
        turn, each chunk's text what the detokenizer let out at that token (Generation.deltas:
        "" inside a character or while stop strings hold text back). With
        ``return_token_ids`` each chunk carries its token's id and a choice's first its
        prompt's (a chat's role chunk); without, the same fields are null. A chat read by a
        reasoning parser (Reading) streams reasoning and content apart, and skips the chunks of
        the tokens it swallows unless they must carry token ids. A generate request's (tokens
        mode) carry token ids only, in its own shape (generate_choice)."""
        chat = is_chat(path)
        tokens_only = path == GENERATE
        ids = bool(body.get("return_token_ids")) and not tokens_only
        reading = self.reading(path, body)
        shown_ids = ids and not reading.hides_metadata
        created = int(time.time())
        base: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": body.get("model", MODEL),
        }
        if tokens_only:
            base = {"request_id": f"generate-tokens-{request_id}"}
        count = sample_count(sampling_of(path, body))
        prompt_tokens = sum(g.prompt_tokens for g in generations[::count])  # once per prompt
        completion_tokens = sum(len(g.token_ids) for g in generations)
        usage: dict[str, Any] = {  # in vLLM's order (UsageInfo)
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if self.prompt_tokens_details:  # the last prompt's, as vLLM's whole answer gives
            usage["prompt_tokens_details"] = {"cached_tokens": generations[-1].cached_tokens}
        if chat:
            usage = self.chat_usage(usage, generations)
        if not body.get("stream"):
            # A whole answer is model_dump()'s: its null fields written; a stream's usage not.
            usage = {"prompt_tokens_details": None, "completion_tokens_details": None} | usage
            usage = {key: usage[key] for key in USAGE_FIELDS}
            longest = max(len(g.token_ids) for g in generations)
            await asyncio.sleep(self.token_delay * longest)  # generating them
            if tokens_only:
                payload = generate_answer(base, body, created, usage, generations)
                self.begin_sent(request_id, compact(payload))
                return await self.whole(request, payload)
            choices = []
            for index, generation in enumerate(generations):
                choice: dict[str, Any] = {"index": index}
                if chat:
                    choice["message"] = chat_message(generation, reading)
                else:
                    choice["text"] = generation.text
                choice |= {"logprobs": None, "finish_reason": generation.finish_reason}
                choice["stop_reason"] = generation.stop_reason
                if not chat:  # a chat's are the answer's, below
                    choice["prompt_token_ids"] = generation.prompt_token_ids if ids else None
                choice["token_ids"] = generation.token_ids if shown_ids else None
                choices.append(choice)
            payload = {**base, "choices": choices, "usage": usage}
            if chat:
                payload["object"] = "chat.completion"
                payload["prompt_token_ids"] = generations[0].prompt_token_ids if ids else None
            payload["kv_transfer_params"] = None
            raw = compact(payload)
            self.begin_sent(request_id, raw, compact(without_token_ids(payload)) if ids else None)
            return await self.whole(request, payload)
        if response is None:
            response = await event_stream(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if chat:
            for index, generation in enumerate(generations):
                chunk = role_chunk(base, index, generation, ids)
                await self.frame(response, request_id, chunk, ids)
        deltas = [chat_deltas(g, reading) for g in generations] if chat else []
        longest = max(len(g.token_ids) for g in generations)
        pending: dict[int, dict[str, Any]] = {}  # per choice: the chunk its merged steps make
        for position in range(longest):
            if position == self.break_after_tokens and self.take_fault():
                assert request.transport is not None
                request.transport.abort()
                return response
            if position == self.error_after_tokens and self.take_fault():
                # vLLM's engine failed mid-generation: an error event, [DONE], the end.
                await self.write(response, request_id, error_frame(ENGINE_FAILED))
                await self.write(response, request_id, b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            for index, generation in enumerate(generations):
                if position >= len(generation.token_ids):
                    continue
                token = generation.token_ids[position]
                last = position == len(generation.token_ids) - 1
                finish = generation.finish_reason if last else None
                stop_reason = generation.stop_reason if last else None
                if tokens_only:
                    choice = generate_choice(index, finish, [token], stop_reason)
                    chunk = {**base, "usage": None, "output_mode": "tokens", "choices": [choice]}
                    await self.frame(response, request_id, chunk)
                    continue
                if chat:
                    delta = deltas[index][position]
                    if delta is None:
                        # A token the parser swallowed: a chunk only to end the choice or to
                        # carry its id (chat_completion/serving.py, delta_message is None).
                        if not last and not shown_ids:
                            continue
                        delta = {}
                    choice = {"index": index, "delta": delta, "logprobs": None}
                    choice["finish_reason"] = finish
                    if last:
                        choice["stop_reason"] = stop_reason
                else:
                    text = generation.deltas[position]
                    choice = {"index": index, "text": text, "logprobs": None}
                    choice |= {"finish_reason": finish, "stop_reason": stop_reason}
                    first = ids and position == 0
                    choice["prompt_token_ids"] = generation.prompt_token_ids if first else None
                choice["token_ids"] = [token] if shown_ids else None
                chunk = {**base, "choices": [choice]}
                if last and not include_usage:
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
                if (chunk := merged(pending, chunk, index, last, self.stream_interval)) is None:
                    continue
                self.streaming.add(request_id)  # no await before its bytes reach the transport
                await self.frame(response, request_id, chunk, ids)
            if position == longest - 1:  # every finish_reason went out: the rest is its end
                self.streaming.discard(request_id)
            await self.between_tokens()
        if self.keepalive_after_finish:
            await self.write(response, request_id, b": keep-alive\n\n")
        if self.break_after_tokens == longest and self.take_fault():
            assert request.transport is not None
            request.transport.abort()
            return response
        if include_usage and tokens_only:
            chunk = {**base, "usage": usage, "output_mode": "tokens", "choices": []}
            await self.frame(response, request_id, chunk)
        elif include_usage:
            chunk = {**base, "choices": [], "usage": usage}
            chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
            await self.frame(response, request_id, chunk)
        await self.write(response, request_id, b"data: [DONE]\n\n")
        await asyncio.sleep(self.linger_after_done)
        await response.write_eof()
        return response

    async def answer_message(
        self,
        request: web.Request,
        body: dict[str, Any],
        request_id: str,
        generation: Generation,
        response: web.StreamResponse | None = None,
    ) -> web.StreamResponse:
        """An Anthropic Messages answer as vLLM 0.32 makes it of its chat's (anthropic/
        serving.py; seen on vLLM 0.32): whole, messages_full_converter's message with
        exclude_none; streamed, message_stream_converter's events over the chat's chunks:
        message_start, a content block per run of thinking or text (empty deltas make no
        event), content_block_stop, message_delta with the stop reason and usage,
        message_stop. No [DONE]. A fault mid-stream: the error event that vLLM's converter
        writes when the chat's error chunk is no chunk (its message differs: pydantic's)."""
        chat_id = f"chatcmpl-{request_id}"
        model = body.get("model", MODEL)
        reading = Reading(self.reasoning_parser)
        stop, stop_sequence = anthropic_stop(generation)
        usage = {"input_tokens": generation.prompt_tokens}
        usage["output_tokens"] = len(generation.token_ids)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * len(generation.token_ids))
            reasoning: str | None = None
            content: str | None = generation.text
            if self.reasoning_parser:
                reasoning, content = parse_reasoning(generation.text)
            blocks: list[dict[str, Any]] = []
            if reasoning:
                signature = uuid.uuid4().hex
                blocks.append({"type": "thinking", "thinking": reasoning, "signature": signature})
            if content:
                blocks.append({"type": "text", "text": content})
            payload: dict[str, Any] = {"id": chat_id, "type": "message", "role": "assistant"}
            payload |= {"content": blocks or [{"type": "text", "text": ""}], "model": model}
            payload["stop_reason"] = stop
            if stop_sequence is not None:
                payload["stop_sequence"] = stop_sequence
            payload["usage"] = usage
            self.begin_sent(request_id, compact(payload))
            return await self.whole(request, payload)
        if response is None:
            response = await event_stream(request)
        events = MessageEvents()
        start = message_start(chat_id, model, generation.prompt_tokens)
        await self.write(response, request_id, events.event("message_start", message=start))
        for position, delta in enumerate(chat_deltas(generation, reading)):
            if position == self.break_after_tokens and self.take_fault():
                assert request.transport is not None
                request.transport.abort()
                return response
            if position == self.error_after_tokens and self.take_fault():
                failure = {"type": "internal_error", "message": ENGINE_FAILED}
                await self.write(response, request_id, events.event("error", error=failure))
                await response.write_eof()
                return response
            for event in events.deltas(delta or {}):
                await self.write(response, request_id, event)
            await self.between_tokens()
        for event in events.close():
            await self.write(response, request_id, event)
        ending = {"stop_reason": stop, "stop_sequence": stop_sequence}
        await self.write(
            response, request_id, events.event("message_delta", delta=ending, usage=usage)
        )
        await self.write(response, request_id, events.event("message_stop"))
        await response.write_eof()
        return response

    async def fail_in_band(
        self,
        response: web.StreamResponse,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        request_id: str,
        failure: str,
        generations: list[Generation],
    ) -> web.StreamResponse:
        """A stream that fails before its first token, as vLLM 0.32's does (seen): a chat's
        role chunk, then an error event and [DONE]. A Responses stream has sent its first
        events, and is cut: vLLM's has no error event that its stream can carry. A Messages
        stream: message_start (of the role chunk), then the converter's error event."""
        if path == RESPONSES:
            events = ResponseEvents(self.response_object(body, request_id, generations[0]))
            for event in events.head():
                await self.write(response, request_id, event)
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if path == MESSAGES:
            message_events = MessageEvents()
            chat_id, model = f"chatcmpl-{request_id}", body.get("model", MODEL)
            start = message_start(chat_id, model, generations[0].prompt_tokens)
            await self.write(
                response, request_id, message_events.event("message_start", message=start)
            )
            failed = {"type": "internal_error", "message": failure}
            await self.write(response, request_id, message_events.event("error", error=failed))
            await response.write_eof()
            return response
        if is_chat(path):
            base = {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": body.get("model", MODEL),
            }
            ids = bool(body.get("return_token_ids"))
            await self.frame(response, request_id, role_chunk(base, 0, generations[0], ids), ids)
        await self.write(response, request_id, error_frame(failure))
        await self.write(response, request_id, b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def frame(
        self, response: web.StreamResponse, request_id: str, obj: Any, ids: bool = False
    ) -> None:
        """One event; ``ids``: it carries token ids (sent_plain gets it with them null)."""
        plain = b"data: " + compact(without_token_ids(obj)) + b"\n\n" if ids else None
        await self.write(response, request_id, b"data: " + compact(obj) + b"\n\n", plain)


@dataclass(frozen=True)
class Reading:
    """How a chat's answer is read: ``parser``, by a reasoning parser (DeepSeek-R1's: its
    think tokens swallowed, reasoning and content apart); ``shown``, include_reasoning (false
    hides the reasoning and every chunk's token ids: hide_stream_metadata); ``ended``, the
    reasoning taken as over before the answer (as a prompt that closed it)."""

    parser: bool = False
    shown: bool = True
    ended: bool = False

    @property
    def hides_metadata(self) -> bool:
        return self.parser and not self.shown


def chat_deltas(generation: Generation, reading: Reading) -> list[dict[str, Any] | None]:
    """Each token's delta message in a chat stream, as vLLM 0.32 builds it (None: no
    message). Without a parser: the content, "" included. With one (DelegatingParser.
    parse_delta over DeepSeekR1ReasoningParser, one token a delta): while reasoning — unless
    the prompt's ids ended it (is_reasoning_end) — a think-start or think-end token alone is
    no message, the end one ending it, any other token {"reasoning": text}; then
    {"content": text}. include_reasoning false sets reasoning to None (so it is written null)
    and drops a message left without content, "" included."""
    if not reading.parser:
        return [{"content": text} for text in generation.deltas]
    ended = reading.ended or generation.prompt_reasoning_ended
    messages: list[dict[str, Any] | None] = []
    for token, text in zip(generation.token_ids, generation.deltas, strict=True):
        message: dict[str, Any] | None
        if ended:
            message = {"content": text}
        elif token in (THINK_START_ID, THINK_END_ID):
            message, ended = None, token == THINK_END_ID
        else:
            message = {"reasoning": text}
        if message is not None and not reading.shown:
            message["reasoning"] = None
            if not message.get("content"):
                message = None
        messages.append(message)
    return messages


def parse_reasoning(text: str) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and content, as BaseThinkingReasoningParser.extract_reasoning
    splits its text: after a think-start if there is one; without a think-end, all of it is
    reasoning. Unlike a stream's parser it does not ask whether the prompt ended the
    reasoning (Parser.set_prompt_token_ids does nothing): an answer continued after its
    think-end is all content streamed, all reasoning whole."""
    before, start, after = text.partition(THINK_START)
    text = after if start else before
    if THINK_END not in text:
        return text, None
    reasoning, _, content = text.partition(THINK_END)
    return reasoning, content or None


def count_reasoning_tokens(token_ids: list[int]) -> int:
    """BaseThinkingReasoningParser.count_reasoning_tokens: the tokens between a think-start
    and its think-end."""
    count = depth = 0
    for token in token_ids:
        if token == THINK_START_ID:
            depth += 1
        elif token == THINK_END_ID:
            depth = max(depth - 1, 0)
        elif depth:
            count += 1
    return count


def chat_message(generation: Generation, reading: Reading) -> dict[str, Any]:
    """A whole chat answer's message: its text as content, or, read by a reasoning parser,
    its reasoning and content apart (reasoning null with include_reasoning false)."""
    content: str | None = generation.text
    reasoning: str | None = None
    if reading.parser and not reading.ended:
        reasoning, content = parse_reasoning(generation.text)
    return {
        "role": "assistant",
        "content": content,
        "reasoning": reasoning if reading.shown else None,
    }


def message_start(chat_id: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """message_start's message: the chat's id and model, nothing generated yet; its usage
    from the role chunk (the converter asks for continuous usage stats)."""
    start: dict[str, Any] = {"id": chat_id, "type": "message", "role": "assistant"}
    start |= {"content": [], "model": model, "stop_reason": None, "stop_sequence": None}
    return start | {"usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}


def anthropic_stop(generation: Generation) -> tuple[str | None, str | None]:
    """_to_anthropic_stop_reason: the cap's "max_tokens", a stop string's "stop_sequence" and
    the string, else "end_turn" (EOS or a stop token id)."""
    if generation.finish_reason == "length":
        return "max_tokens", None
    if isinstance(generation.stop_reason, str):
        return "stop_sequence", generation.stop_reason
    return "end_turn", None


class MessageEvents:
    """A streamed Messages answer's events (``event: NAME`` then ``data:``), and its content
    blocks as message_stream_converter opens and closes them: one per run of thinking or of
    text, numbered; a thinking block closes with a signature delta."""

    def __init__(self) -> None:
        self.index = 0
        self.open: str | None = None  # the kind of the block open now

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\n".encode() + b"data: " + compact({"type": kind, **fields}) + b"\n\n"

    def deltas(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        for kind, field_name, delta_type in (
            ("thinking", "reasoning", "thinking_delta"), ("text", "content", "text_delta")
        ):  # fmt: skip
            text = delta.get(field_name)
            if not text:
                continue
            if self.open != kind:
                events += self.close()
                block = {"type": kind, kind: ""}
                events.append(
                    self.event("content_block_start", content_block=block, index=self.index)
                )
                self.open = kind
            piece = {"type": delta_type, "thinking" if kind == "thinking" else "text": text}
            events.append(self.event("content_block_delta", delta=piece, index=self.index))
        return events

    def close(self) -> list[bytes]:
        """The open block's end (a thinking block's signature first), if one is open."""
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            signature = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            events.append(self.event("content_block_delta", delta=signature, index=self.index))
        events.append(self.event("content_block_stop", index=self.index))
        self.open, self.index = None, self.index + 1
        return events


def merged(
    pending: dict[int, dict[str, Any]],
    chunk: dict[str, Any],
    index: int,
    last: bool,
    interval: int,
) -> dict[str, Any] | None:
    """One step's chunk of choice ``index`` merged into those of the steps before it not yet
    sent, as vLLM's RequestOutputCollector adds outputs (text and token ids concatenated, the
    rest the latest's; the first's prompt ids kept); the chunk to send once ``interval`` steps
    are in it, or the choice's last, else None."""
    held = pending.pop(index, None)
    if held is not None:
        (before,), (now,) = held["choices"], chunk["choices"]
        if "text" in now:
            now["text"] = before["text"] + now["text"]
        if "delta" in now and "content" in now["delta"]:
            now["delta"]["content"] = before["delta"].get("content", "") + now["delta"]["content"]
        if now.get("token_ids") is not None:
            now["token_ids"] = before["token_ids"] + now["token_ids"]
        if before.get("prompt_token_ids") is not None:
            now["prompt_token_ids"] = before["prompt_token_ids"]
        chunk["steps"] = held["steps"] + 1
    else:
        chunk["steps"] = 1
    if last or chunk["steps"] >= interval:
        del chunk["steps"]
        return chunk
    pending[index] = chunk
    return None


def generate_choice(
    index: int, finish: str | None, token_ids: list[int], stop_reason: int | str | None = None
) -> dict[str, Any]:
    """A generate answer's choice (tokens mode), its fields in vLLM 0.32's order."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "stop_reason": stop_reason}
    choice |= {"token_ids": token_ids, "routed_experts": None, "sampling_mask": None}
    return choice | {"weight_versions": None, "logprobs": None}


def generate_answer(
    base: dict[str, Any],
    body: dict[str, Any],
    created: int,
    usage: dict[str, Any],
    generations: list[Generation],
) -> dict[str, Any]:
    """A whole generate answer as vLLM 0.32 writes its GenerateTokensResponse."""
    choices = [
        generate_choice(index, g.finish_reason, g.token_ids, g.stop_reason)
        for index, g in enumerate(generations)
    ]
    payload = {**base, "model": body.get("model", MODEL), "created": created, "usage": usage}
    for name in ("prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids"):
        payload[name] = None
    payload |= {"mm_placeholders": None, "metrics": None, "kv_transfer_params": None}
    return payload | {"ec_transfer_params": None, "output_mode": "tokens", "choices": choices}


async def event_stream(request: web.Request) -> web.StreamResponse:
    """A stream's 200 and headers, sent (vLLM sends them before its first event)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    return response


class ResponseEvents:
    """A streamed Responses answer's events, as vLLM 0.32 writes them (``event: NAME`` and
    ``data:`` the event, numbered), for one output message of text: the response created and
    in progress at once; the message's item and content part opened with its first text
    (seen: they come just before the first delta); done, if opened, and completed."""

    def __init__(self, done: dict[str, Any]) -> None:
        self.done, self.number = done, 0
        self.item_id = done["output"][0]["id"]
        self.opened = False

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.number}
        self.number += 1
        return f"event: {kind}\n".encode() + b"data: " + compact(payload) + b"\n\n"

    def head(self) -> list[bytes]:
        """What goes out before the first token: the response, begun."""
        begun = self.done | {"status": "in_progress", "output": [], "usage": None}
        begun |= {"incomplete_details": None, "kv_transfer_params": None}
        return [
            self.event("response.created", response=begun),
            self.event("response.in_progress", response=begun),
        ]

    def delta(self, text: str) -> list[bytes]:
        """A step's text (not ""), its message opened first if it is the first."""
        events = []
        if not self.opened:
            self.opened = True
            item = {"id": self.item_id, "content": [], "role": "assistant"}
            item |= {"status": "in_progress", "type": "message"}
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            place = {"item_id": self.item_id, "output_index": 0}
            events += [
                self.event("response.output_item.added", item=item, output_index=0),
                self.event("response.content_part.added", content_index=0, part=part, **place),
            ]
        events.append(
            self.event(
                "response.output_text.delta",
                content_index=0,
                delta=text,
                item_id=self.item_id,
                logprobs=[],
                output_index=0,
            )
        )
        return events

    def tail(self) -> list[bytes]:
        message = self.done["output"][0]
        part = message["content"][0]
        place = {"item_id": self.item_id, "output_index": 0}
        events = []
        if self.opened:
            events += [
                self.event("response.output_text.done", content_index=0, logprobs=[],
                           text=part["text"], **place),
                self.event("response.content_part.done", content_index=0, part=part, **place),
                self.event("response.output_item.done", item=message, output_index=0),
            ]  # fmt: skip
        return [*events, self.event("response.completed", response=self.done)]


def role_chunk(base: dict[str, Any], index: int, generation: Generation, ids: bool) -> Any:
    """A chat stream's first chunk of a choice: the role, and the prompt's token ids."""
    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    first["finish_reason"] = None
    prompt_ids = generation.prompt_token_ids if ids else None
    return {**base, "choices": [first], "prompt_token_ids": prompt_ids, "prompt_text": None}


def error_event(message: str) -> dict[str, Any]:
    """An in-band error, as vLLM writes one into a stream that already started."""
    return {
        "error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}
    }


def error_frame(message: str) -> bytes:
    """error_event's frame as vLLM writes it: create_streaming_error_response is
    ``json.dumps(ErrorResponse.model_dump())`` (generate/base/serving.py), so json.dumps's
    defaults, not pydantic's compact JSON: a space after each colon and comma, and non-ASCII
    escaped (ensure_ascii)."""
    return b"data: " + json.dumps(error_event(message)).encode() + b"\n\n"


TOKEN_ID_KEYS = frozenset({"prompt_token_ids", "token_ids"})


def without_token_ids(obj: Any) -> Any:
    """An answer or chunk as vLLM writes it without return_token_ids: its id lists null."""
    if isinstance(obj, dict):
        return {k: None if k in TOKEN_ID_KEYS else without_token_ids(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_token_ids(v) for v in obj]
    return obj


# --- a whole simulated cluster, for the demo


_handed_out: set[int] = set()


def free_port(span: int = 1) -> int:
    """A free port below the kernel's ephemeral range, and ``span - 1`` free ones after it
    (a publisher per DP rank binds port + rank).

    A port from bind(0) is free now, but until the server started later binds it the kernel
    may hand it out again (vLLM alone opens several such ports while it starts). Ports below
    32768 are never handed out that way.
    """
    for _ in range(200):
        port = random.randrange(20000, 32000 - span)
        ports = range(port, port + span)
        if _handed_out.intersection(ports):
            continue  # free, but promised to another server of this run
        if all(map(bindable, ports)):
            _handed_out.update(ports)
            return port
    raise RuntimeError("no free port found in 20000-32000")


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class RunningFake:
    fake: FakeVllm
    url: str
    bootstrap_port: int | None


async def start_fake(fake: FakeVllm, runners: list[web.AppRunner]) -> RunningFake:
    async def serve(app: web.Application) -> int:
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_SECONDS
        )
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return port

    port = await serve(fake.api_app())
    fake.api_url = f"http://127.0.0.1:{port}"
    bootstrap = await serve(fake.bootstrap_app()) if fake.role == "prefill" else None
    return RunningFake(fake, fake.api_url, bootstrap)


def port_taken(port: int) -> str | None:
    """What to say when the demo's proxy could not listen on 127.0.0.1:``port``; None when it
    could (bound here as the proxy binds, with SO_REUSEADDR, so a connection of an earlier run
    in TIME_WAIT does not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                return None  # the proxy will say what it is
        else:
            return None
    # Run by make (which tells its commands MAKELEVEL), the flag goes through ARGS.
    how = (
        'run make demo ARGS="--port N" for another port, or ARGS="--port 0" for any free one'
        if "MAKELEVEL" in os.environ
        else "pass --port N for another port, or --port 0 for any free one"
    )
    return (
        f"cannot listen on 127.0.0.1:{port}: the port is in use (another demo, proxy or vLLM "
        f"is listening there); {how}"
    )


DEMO_READY_TIMEOUT = 20.0
DEMO_REQUEST_TIMEOUT = 30.0
# How long the proxy has to stop after the demo's SIGTERM (it drains, with nothing in flight)
# before it is killed.
DEMO_STOP_TIMEOUT = 10.0

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(signum: int, parent: int) -> None:
    """On Linux, this process is sent ``signum`` when the thread that started it ends, however
    it ends (SIGKILL included, when none of its handlers runs); ``parent`` is that process's
    pid, for the case where it ended before this was asked. Nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0 and os.getppid() != parent:
        os.kill(os.getpid(), signum)


async def wait_for_proxy(
    proxy: asyncio.subprocess.Process, session: aiohttp.ClientSession, base: str
) -> str | None:
    """Until the proxy this demo started is ready, its self-test done; else what went wrong.

    Readiness is asked of /healthcheck and must come from that very process (its id and pid):
    another server on the port (vLLM's default is 8000 too) must not pass for it.
    """
    exited = asyncio.ensure_future(proxy.wait())
    deadline = time.monotonic() + DEMO_READY_TIMEOUT
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                probe = aiohttp.ClientTimeout(total=1)
                async with session.get(f"{base}/healthcheck", timeout=probe) as health:
                    state = await health.json(content_type=None)
                    ours = isinstance(state, dict) and state.get("pid") == proxy.pid
                    # Ready, and its self-test done: its line comes before the demo's tokens.
                    tested = state.get("self_test") is not None if ours else False
                    if ours and state.get("id") == PROXY_ID and state.get("ready") and tested:
                        return None
            await asyncio.wait([exited], timeout=0.1)
            if exited.done():
                return f"the proxy exited with code {proxy.returncode} (its error is above)"
        return f"the proxy was not ready within {DEMO_READY_TIMEOUT:g} s"
    finally:
        exited.cancel()


async def demo(once: bool, port: int) -> int:
    # SIGTERM (kill, a closed terminal's SIGHUP) ends the demo as Ctrl-C does, the proxy it
    # started with it: by default it would end only this process, the proxy left listening.
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None
    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, task.cancel)
    if port and (problem := port_taken(port)):
        print(f"demo: {problem}", file=sys.stderr)  # before anything starts
        return 1
    runners: list[web.AppRunner] = []
    cluster = [
        await start_fake(FakeVllm("prefill", dp_size=2), runners),
        await start_fake(FakeVllm("prefill"), runners),
        await start_fake(FakeVllm("decode", token_delay=0.08), runners),
        await start_fake(FakeVllm("decode", token_delay=0.08), runners),
    ]
    port = port or free_port()
    daemon = Path(__file__).parents[1] / "mooncake_proxy.py"  # the repository's top
    argv = [sys.executable, str(daemon), "--port", str(port)]
    for node in cluster:
        if node.bootstrap_port is not None:
            argv += ["--prefill", node.url, str(node.bootstrap_port)]
        else:
            argv += ["--decode", node.url]
    print("simulated cluster: 2 prefill instances (3 DP engines), 2 decode instances")
    print("starting: python", " ".join(argv[1:]), flush=True)
    # The proxy dies with the demo even when the demo is killed at once (SIGKILL, the OOM
    # killer): nothing of the demo is left to serve behind it.
    demo_pid = os.getpid()
    proxy = await asyncio.create_subprocess_exec(
        *argv, preexec_fn=lambda: die_with_parent(signal.SIGKILL, demo_pid)
    )
    base = f"http://127.0.0.1:{port}"
    try:
        # Every wait is bounded, and a client-side timeout covers each request.
        timeout = aiohttp.ClientTimeout(total=DEMO_REQUEST_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if problem := await wait_for_proxy(proxy, session, base):
                print(f"demo: {problem}", file=sys.stderr)
                return proxy.returncode or 1
            request = {
                "model": MODEL,
                "prompt": "Explain prefill/decode disaggregation",
                "max_tokens": 24,
                "stream": True,
            }
            print(f"\nPOST {base}/v1/completions (streamed):\n", flush=True)
            try:
                async with session.post(f"{base}/v1/completions", json=request) as answer:
                    if answer.status != 200:
                        print(f"demo: the proxy answered {answer.status}: {await answer.text()}")
                        return 1
                    async for line in answer.content:
                        if line.startswith(b"data: {"):
                            chunk = json.loads(line[6:])
                            print(chunk["choices"][0]["text"], end="", flush=True)
            except (aiohttp.ClientError, TimeoutError) as failure:
                print(f"\ndemo: the request failed: {failure!r}", file=sys.stderr)
                return 1
            print("\n\nrequest id:", answer.headers.get("X-Request-Id"))
            if once:
                return 0
            print(f"\nThe proxy keeps serving on {base}; try:")
            print(
                f"  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' "
                """-d '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], """
                """"stream": true}'"""
            )
            print(f"  curl {base}/healthcheck\nCtrl-C stops everything.", flush=True)
            return await proxy.wait()
    finally:
        if proxy.returncode is None:
            proxy.terminate()
            try:
                await asyncio.wait_for(proxy.wait(), DEMO_STOP_TIMEOUT)
            except TimeoutError:
                proxy.kill()
                await proxy.wait()
        for runner in runners:
            await runner.cleanup()


# --- one fake server in a process of its own, draining on SIGTERM as a rolling upgrade needs


async def serve_one(args: argparse.Namespace) -> int:
    """One fake vLLM server until SIGTERM; then it drains: /health answers 503 at once, new
    requests are still served for ``--drain-delay`` seconds (while load balancers notice), then
    it stops listening, lets its in-flight requests finish and exits 0."""
    fake = FakeVllm(
        args.serve,
        token_delay=args.token_delay,
        max_model_len=args.max_model_len,
        cache_blocks=args.cache_blocks,
        token_time=args.token_time,
        pull_delay=args.pull_delay,
        prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    fake.api_url = f"http://{args.host}:{args.port}"
    apps = [fake.api_app()]
    if args.serve == "prefill":
        fake.worker_url = f"http://{args.host}:{args.bootstrap_port}"
        apps.append(fake.bootstrap_app())
    runners = []
    for app, port in zip(apps, (args.port, args.bootstrap_port), strict=False):
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_SECONDS
        )
        await runner.setup()
        await web.TCPSite(runner, args.host, port).start()
        runners.append(runner)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    fake.health_status = 503
    await asyncio.sleep(args.drain_delay)
    for runner in runners:  # the API server first: KV pulls of its requests still work
        await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the proxy against a simulated cluster.")
    parser.add_argument("--once", action="store_true", help="exit after the first request")
    parser.add_argument("--port", type=int, default=8000, help="port for the proxy; 0 for any")
    parser.add_argument(
        "--serve",
        choices=("prefill", "decode"),
        help="instead: serve one fake vLLM server on --port (a prefill's bootstrap on "
        "--bootstrap-port) until SIGTERM, then drain",
    )
    parser.add_argument("--host", default="127.0.0.1", help="with --serve: address to bind")
    parser.add_argument("--bootstrap-port", type=int, default=8998)
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument(
        "--max-model-len", type=int, default=4096, help="with --serve: vLLM's --max-model-len"
    )
    # What a benchmark's simulated servers cost (bench/bench_local_prefill.py --simulated).
    parser.add_argument(
        "--cache-blocks", type=int, default=0, help="with --serve: prefix cache blocks (0: none)"
    )
    parser.add_argument(
        "--token-time",
        type=float,
        default=0.0,
        help="with --serve and --cache-blocks: seconds of compute a prompt token it lacks",
    )
    parser.add_argument(
        "--pull-delay",
        type=float,
        default=0.0,
        help="with --serve decode: seconds a KV pull waits before it starts (the handoff)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="with --serve: vLLM's flag of that name (usage.prompt_tokens_details.cached_tokens)",
    )
    parser.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds a draining server still takes requests (0: stop listening at once, as "
        "uvicorn does)",
    )
    args = parser.parse_args(argv)
    try:
        if args.serve:
            return asyncio.run(serve_one(args))
        # The demo stops, its proxy with it, when what started it ends: make, killed, would
        # leave it running (make passes SIGTERM on to its commands, but not SIGKILL).
        die_with_parent(signal.SIGTERM, os.getppid())
        return asyncio.run(demo(args.once, args.port))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM (demo)
        return 0


if __name__ == "__main__":
    sys.exit(main())
