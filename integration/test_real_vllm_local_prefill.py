"""Disaggregate only when it pays, against real vLLM: --max-local-prefill-tokens 200.

One prefill, one decode and the proxy in front of them. A prompt of ~16 or ~128 tokens that
the decode holds nothing of is computed by the decode alone: the decode's
``prompt_tokens_by_source_total{source="local_compute"}`` grows by its prompt and the prefill
sees none of it (what that saves in time is bench/bench_local_prefill.py's to measure). A
~400-token prompt still goes through PD (``external_kv_transfer`` grows). Turn 3 of a chat
whose turns 1 and 2 went through the proxy is computed on the decode that holds them, which
computes its new tokens only.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from real_vllm import (  # the suite's servers and their HTTP
    DECODE_MAX_MODEL_LEN,
    MODEL,
    Server,
    bring_up,
    metric,
    proxy_server,
    unique_prompt,
    vllm_server,
)

LIMIT = 200  # --max-local-prefill-tokens
ROUNDS = 5  # fresh prompts a size
LOCAL = 'source="local_compute"'


@dataclass
class LocalCluster:
    prefill: Server
    decode: Server
    proxy: Server
    figures: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = Path(os.environ["VLLM_ENV_ROOT"])
    logs = Path(os.environ.get("REAL_VLLM_LOGS") or tmp_path_factory.mktemp("local-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    prefill = vllm_server(root, logs, "kv_producer", DECODE_MAX_MODEL_LEN, name="local-prefill")
    decode = vllm_server(root, logs, "kv_consumer", DECODE_MAX_MODEL_LEN, name="local-decode")
    proxy = proxy_server(
        "local-proxy", logs, prefill, decode,
        "--max-local-prefill-tokens", str(LIMIT), "--log-level", "WARNING",
    )  # fmt: skip
    servers = (prefill, decode, proxy)
    try:
        bring_up((prefill, decode), (proxy,))
        cluster = LocalCluster(prefill, decode, proxy)
        yield cluster
        for line in cluster.figures:
            print(line)
    finally:
        for server in reversed(servers):
            server.stop()
        print(f"\nserver logs: {logs}")


@dataclass
class Answer:
    ttft: float  # seconds to the first event with text
    prompt_tokens: int
    text: str


def stream(base: str, path: str, body: dict[str, Any]) -> Answer:
    """A streamed request, its usage asked for: the time to its first text, and its usage."""
    where = urlsplit(base)
    connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=120)
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    connection.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.read()
    ttft, prompt_tokens, parts = None, 0, []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices") or ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text and ttft is None:
                ttft = time.perf_counter() - started
            parts.append(text)
        if event.get("usage"):
            prompt_tokens = event["usage"]["prompt_tokens"]
    connection.close()
    assert ttft is not None
    return Answer(ttft, prompt_tokens, "".join(parts))


def completion(words: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": unique_prompt(words), "max_tokens": 8, "temperature": 0}


@pytest.mark.parametrize("words", [4, 90], ids=["~16", "~128"])
def test_a_short_prompt_is_computed_by_the_decode_alone(
    local_cluster: LocalCluster, words: int
) -> None:
    """Its time to the first token against the decode's own is the benchmark's to measure
    (bench/bench_local_prefill.py): here, that the decode computed it and the prefill did
    not see it."""
    cluster = local_cluster
    tokens = 0
    local = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    prefilled = metric(cluster.prefill, "vllm:prompt_tokens_total")
    for _ in range(ROUNDS):
        answer = stream(cluster.proxy.url, "/v1/completions", completion(words))
        assert answer.text
        tokens += answer.prompt_tokens
    grown = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert metric(cluster.prefill, "vllm:prompt_tokens_total") == prefilled  # no PD leg
    assert grown - local == tokens


def test_a_long_prompt_still_goes_through_pd(local_cluster: LocalCluster) -> None:
    cluster = local_cluster
    pulled = metric(
        cluster.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    answer = stream(cluster.proxy.url, "/v1/completions", completion(360))
    assert answer.prompt_tokens > 350
    grown = metric(
        cluster.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert grown > pulled


def test_turn_3_of_a_chat_computes_only_its_new_tokens_on_the_decode_that_holds_it(
    local_cluster: LocalCluster,
) -> None:
    cluster = local_cluster
    messages: list[dict[str, str]] = [{"role": "user", "content": unique_prompt(220)}]
    for turn in range(3):
        body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
        local = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
        answer = stream(cluster.proxy.url, "/v1/chat/completions", body)
        grown = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
        messages += [
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": f"and then, {turn}?"},
        ]
    cluster.figures.append(
        f"chat turn 3: {answer.prompt_tokens} prompt tokens, {grown - local:.0f} computed by "
        "the decode itself"
    )
    assert 0 < grown - local < answer.prompt_tokens / 2, cluster.figures[-1]
