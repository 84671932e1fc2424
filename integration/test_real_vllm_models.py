"""Two models behind one proxy, against real vLLM: the suite's tiny model served under two
names (``tiny-a`` and ``tiny-b``) by two prefill/decode pairs, and one proxy in front of all
four. Each request goes to the pair that serves the model it names, and its KV crosses over
Mooncake there (that decode's counter of prompt tokens from a KV transfer grows, the other
pair's counters do not move); a model neither serves gets vLLM's own 404; /v1/models lists
both as the servers wrote them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from real_vllm import (  # the suite's servers and their HTTP
    DECODE_MAX_MODEL_LEN,
    PREFILL_MAX_MODEL_LEN,
    PROXY,
    Server,
    free_port,
    http_call,
    metric,
    unique_prompt,
    vllm_server,
    wait_all_checked,
)

MODELS = ("tiny-a", "tiny-b")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Any]]]:
    """The proxy, and each model's prefill and decode by name."""
    root = Path(os.environ["VLLM_ENV_ROOT"])
    logs = Path(os.environ.get("REAL_VLLM_LOGS") or tmp_path_factory.mktemp("models-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Any] = {}
    for model in MODELS:
        servers[model] = (
            vllm_server(root, logs, "kv_producer", PREFILL_MAX_MODEL_LEN,
                        name=f"prefill-{model}", model=model),
            vllm_server(root, logs, "kv_consumer", DECODE_MAX_MODEL_LEN,
                        name=f"decode-{model}", model=model),
        )  # fmt: skip
    port = free_port()
    argv = [sys.executable, str(PROXY), "--port", str(port)]
    argv += ["--no-start-self-test"]  # the suite counts what each server computed
    for prefill, decode in servers.values():
        argv += ["--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url]
    # As the main cluster's proxy (test_real_vllm.py): four CPU servers on two cores are slow
    # to accept and to answer their checks.
    argv += ["--connect-timeout", "30", "--health-timeout", "10"]
    proxy = Server("proxy-models", argv, dict(os.environ), logs / "proxy-models.log",
                   f"http://127.0.0.1:{port}")  # fmt: skip
    started = [server for pair in servers.values() for server in pair]
    try:
        for server in started:
            server.start()
        for server in started:
            server.wait_healthy(400)
            server.warm_up()
        proxy.start()
        started.append(proxy)
        proxy.wait_healthy(60)
        wait_all_checked(proxy)
        yield proxy, servers
    finally:
        for server in reversed(started):
            server.stop()
        print(f"\nserver logs: {logs}")


def kv_tokens(decode: Server) -> float:
    return metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def finished(server: Server) -> float:
    return metric(server, "vllm:request_success_total")


def text_of(base: str, model: str, prompt: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    answer = client.with_options(timeout=120).completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0
    )
    assert answer.usage is not None
    return answer.choices[0].text, answer.usage.prompt_tokens


@pytest.mark.parametrize("model", MODELS)
def test_each_model_is_served_by_its_own_pair_with_its_kv_over_mooncake(
    pairs: tuple[Server, dict[str, Any]], model: str
) -> None:
    proxy, servers = pairs
    prefill, decode = servers[model]
    other_prefill, other_decode = servers[next(m for m in MODELS if m != model)]
    prompt = unique_prompt()

    def counts() -> tuple[float, ...]:
        return (kv_tokens(decode), finished(prefill), finished(other_prefill),
                finished(other_decode))  # fmt: skip

    before = counts()
    text, prompt_tokens = text_of(proxy.url, model, prompt)
    after = counts()
    assert text and after[0] - before[0] == prompt_tokens  # its KV came over Mooncake
    assert after[1] - before[1] == 1  # from its own prefill
    assert after[2:] == before[2:]  # the other model's pair took no part
    assert (text, prompt_tokens) == text_of(decode.url, model, prompt)


def test_a_model_no_pair_serves_gets_vllms_404_and_the_list_holds_both(
    pairs: tuple[Server, dict[str, Any]],
) -> None:
    proxy, servers = pairs
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 2}
    status, content_type, answer = http_call(proxy.url, "POST", "/v1/completions", body)
    own = http_call(servers["tiny-a"][1].url, "POST", "/v1/completions", body)
    assert (status, content_type) == own[:2] == (404, "application/json")
    error, own_error = json.loads(answer)["error"], json.loads(own[2])["error"]
    # vLLM's words, its aliases the fleet's: each server names only its own.
    assert error == own_error | {"message": error["message"]}
    assert (
        error["message"]
        == "The model `no-such-model` does not exist. Valid aliases: tiny-a, tiny-b."
    )
    listed = json.loads(http_call(proxy.url, "GET", "/v1/models")[2])
    cards = {card["id"]: card for card in listed["data"]}
    assert list(cards) == list(MODELS)
    for model in MODELS:
        (own_card,) = json.loads(http_call(servers[model][1].url, "GET", "/v1/models")[2])["data"]
        made = {"created": 0, "permission": []}  # vLLM makes these anew for every answer
        assert cards[model] | made == own_card | made
