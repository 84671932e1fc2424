"""Disaggregate only when it pays (--max-local-prefill-tokens): a prompt its decode would
compute few tokens of itself goes to that decode alone, with no prefill leg.

The fakes compute a prompt sent alone in ``delay`` seconds (vLLM's prefill on the decode) and
say which requests came with KV to pull (``kv_transfer_params``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

import mooncake_proxy as mp
from testing_support import (
    CHAT,
    COMPLETIONS,
    Cluster,
    StartCluster,
    chat,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
    sse_events,
)

BYTES_PER_TOKEN = 4.0


def pulled(request: Any) -> bool:
    """A decode request that came with KV to pull (PD), not one it computes alone."""
    params = request.body.get("kv_transfer_params") or {}
    return bool(params.get("do_remote_prefill"))


async def local_cluster(start_cluster: StartCluster, **config: Any) -> Cluster:
    cluster = await start_cluster(**{"max_local_prefill_tokens": 100, **config})
    fleet_of(cluster).bytes_per_token = BYTES_PER_TOKEN  # the fakes' PD answers teach another
    return cluster


def prompt_of_tokens(tokens: int) -> str:
    """A completion prompt of about ``tokens`` tokens at BYTES_PER_TOKEN, as routing reads it
    (the model's name and a separator come first)."""
    head = len(completion()["model"]) + 1
    return "x" * int(tokens * BYTES_PER_TOKEN - head)


@pytest.mark.parametrize(("tokens", "alone"), [(20, True), (99, True), (101, False), (400, False)])
async def test_a_prompt_under_the_limit_goes_to_the_decode_alone(
    start_cluster: StartCluster, tokens: int, alone: bool
) -> None:
    cluster = await local_cluster(start_cluster, policy=mp.Policy.ROUND_ROBIN)
    body = completion(prompt=prompt_of_tokens(tokens))
    response = await cluster.client.post(COMPLETIONS, json=body)
    assert response.status == 200, await response.text()
    (sent,) = cluster.decodes[0].requests
    assert pulled(sent) is not alone
    assert len(cluster.prefills[0].requests) == (0 if alone else 1)
    samples = await scrape(cluster)
    decision, reason = ("local", "short") if alone else ("pd", "long")
    name = "mooncake_proxy_local_prefill_decisions_total"
    assert sample(samples, name, decision=decision, reason=reason) == 1
    computed = {
        where: sample(samples, "mooncake_proxy_prompt_tokens_total", computed_by=where)
        for where in ("decode", "prefill")
    }
    if alone:  # as estimated: the prompt's bytes at BYTES_PER_TOKEN
        assert computed == {"decode": pytest.approx(tokens, abs=1), "prefill": 0}
    else:  # as the prefill's answer counts them
        assert computed["decode"] == 0 and computed["prefill"] > 0


async def test_limit_0_sends_every_request_through_pd(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(policy=mp.Policy.ROUND_ROBIN)
    response = await cluster.client.post(COMPLETIONS, json=completion(prompt="hi"))
    assert response.status == 200
    assert pulled(cluster.decodes[0].requests[0]) and len(cluster.prefills[0].requests) == 1
    samples = await scrape(cluster)
    decisions = [v for k, v in samples.items() if k[0].endswith("local_prefill_decisions_total")]
    assert len(decisions) == len(mp.LOCAL_PREFILL_REASONS) and not any(decisions)
    assert sample(samples, "mooncake_proxy_prompt_tokens_total", computed_by="prefill") > 0


async def test_a_decode_computing_a_prompt_already_gets_the_next_short_one_through_pd(
    start_cluster: StartCluster,
) -> None:
    cluster = await local_cluster(
        start_cluster, policy=mp.Policy.ROUND_ROBIN, decode={"delay": 0.5}
    )
    decode = fleet_of(cluster).decodes[0]
    first = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(prompt="a", stream=True))
    )
    async with asyncio.timeout(5):
        while decode.local_prefills == 0:
            await asyncio.sleep(0.01)
    health = await (await cluster.client.get("/healthcheck")).json()
    assert [d["local_prefills"] for d in health["decode"]] == [1]
    second = await cluster.client.post(COMPLETIONS, json=completion(prompt="b"))
    assert second.status == 200
    assert (await first).status == 200
    assert [pulled(r) for r in cluster.decodes[0].requests] == [False, True]
    assert decode.local_prefills == 0  # let go once its first token came
    samples = await scrape(cluster)
    name = "mooncake_proxy_local_prefill_decisions_total"
    assert sample(samples, name, decision="pd", reason="decode_busy") == 1


async def test_a_decode_whose_kv_cache_is_full_gets_even_a_short_prompt_through_pd(
    start_cluster: StartCluster,
) -> None:
    """A full cache, as the decode's /metrics says: a prompt computed there would preempt its
    running streams. Once it has room again, short prompts go to it alone again."""
    cluster = await local_cluster(start_cluster, load_interval=0.05, decode={"kv_usage": 0.99})
    decode = fleet_of(cluster).decodes[0]
    await eventually(lambda: decode.load.kv_usage == 0.99)
    response = await cluster.client.post(COMPLETIONS, json=completion(prompt="full"))
    assert response.status == 200
    cluster.decodes[0].kv_usage = 0.5
    await eventually(lambda: decode.load.kv_usage == 0.5)
    response = await cluster.client.post(COMPLETIONS, json=completion(prompt="roomy"))
    assert response.status == 200
    assert [pulled(r) for r in cluster.decodes[0].requests] == [True, False]
    health = await (await cluster.client.get("/healthcheck")).json()
    assert health["local_prefill"] == {
        "max_tokens": 100,
        "max_per_decode": 1,
        "decisions": {
            "local": {"short": 1, "cached": 0, "no_prefill": 0},
            "pd": {"long": 0, "decode_busy": 1},
        },
    }


@pytest.mark.parametrize("limit", [0, 100])
async def test_a_long_prompt_whose_prefill_went_away_is_computed_by_its_decode(
    start_cluster: StartCluster, limit: int
) -> None:
    """The only prefill refuses the prompt's leg (gone before its health check saw it): with
    local prefill on, the try after it has no prefill engine to pull from, and the decode
    computes the prompt, however long, rather than the client getting a 503."""
    cluster = await start_cluster(max_local_prefill_tokens=limit, health_interval=3600)
    fleet_of(cluster).bytes_per_token = BYTES_PER_TOKEN
    await cluster.kill(cluster.prefills[0])
    body = completion(prompt=prompt_of_tokens(400))
    response = await cluster.client.post(COMPLETIONS, json=body)
    if not limit:  # as before: PD or nothing, the prefill's failure said
        assert response.status == 502, await response.text()
        assert all(pulled(r) for r in cluster.decodes[0].requests)  # sent beside it, cut
        return
    assert response.status == 200, await response.text()
    *beside, alone = cluster.decodes[0].requests  # the first try's leg, cut, if it was sent
    assert all(pulled(r) for r in beside) and not pulled(alone)
    samples = await scrape(cluster)
    name = "mooncake_proxy_local_prefill_decisions_total"
    assert sample(samples, name, decision="pd", reason="long") == 1  # the first try
    assert sample(samples, name, decision="local", reason="no_prefill") == 1


def turns(first_user: str, answer: str, then: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": first_user},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": then},
    ]


async def test_a_conversations_next_turn_goes_to_its_decode_and_computes_only_the_new_turn(
    start_cluster: StartCluster,
) -> None:
    cluster = await local_cluster(start_cluster, decodes=2, max_local_prefill_tokens=200)
    long_question = "tell me everything about KV caches " * 40  # ~350 tokens: PD
    first = chat(messages=[{"role": "user", "content": long_question}])
    response = await cluster.client.post(CHAT, json=first)
    assert response.status == 200
    answer = (await response.json())["choices"][0]["message"]["content"]
    holder = next(d for d in cluster.decodes if d.requests)
    nxt = chat(messages=turns(long_question, answer, "and then?"))
    response = await cluster.client.post(CHAT, json=nxt)
    assert response.status == 200
    assert [pulled(r) for r in holder.requests] == [True, False]  # the same decode, alone
    assert len(cluster.prefills[0].requests) == 1
    samples = await scrape(cluster)
    name = "mooncake_proxy_local_prefill_decisions_total"
    assert sample(samples, name, decision="local", reason="cached") == 1
    computed = sample(samples, "mooncake_proxy_prompt_tokens_total", computed_by="decode")
    assert 0 < computed < len(long_question) / BYTES_PER_TOKEN / 2


async def test_when_the_conversations_decode_is_gone_its_next_turn_goes_pd_elsewhere(
    start_cluster: StartCluster,
) -> None:
    cluster = await local_cluster(start_cluster, decodes=2, max_local_prefill_tokens=200)
    long_question = "tell me everything about KV caches " * 40
    first = chat(messages=[{"role": "user", "content": long_question}])
    response = await cluster.client.post(CHAT, json=first)
    answer = (await response.json())["choices"][0]["message"]["content"]
    holder = next(d for d in cluster.decodes if d.requests)
    other = next(d for d in cluster.decodes if d is not holder)
    await cluster.kill(holder)
    nxt = chat(messages=turns(long_question, answer, "and then?"))
    response = await cluster.client.post(CHAT, json=nxt)
    assert response.status == 200, await response.text()
    # Nothing of it is held there: PD, whether the proxy saw the holder gone before it
    # picked (the other decode at once) or when the holder refused (decided again).
    assert [pulled(r) for r in other.requests] == [True]
    assert len(cluster.prefills[0].requests) == 2


async def test_a_stream_its_decode_computed_alone_goes_on_elsewhere_when_cut(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"break_after_tokens": 4, "faults_left": 1}, {}),
        decode_policy=mp.Policy.ROUND_ROBIN,
        prefill_policy=mp.Policy.ROUND_ROBIN,
        max_local_prefill_tokens=100,
    )
    fleet_of(cluster).bytes_per_token = BYTES_PER_TOKEN
    body = completion(prompt="Tell me", stream=True, max_tokens=12, ignore_eos=True)
    response = await cluster.client.post(COMPLETIONS, json=body)
    assert response.status == 200
    events = sse_events(await response.read())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if e != "[DONE]")
    texts = [e["choices"][0]["text"] for e in events if e != "[DONE]" and e.get("choices")]
    assert not cluster.prefills[0].requests  # computed alone, and continued alone
    (cut,) = cluster.decodes[0].requests
    (continued,) = cluster.decodes[1].requests
    assert not pulled(cut) and not pulled(continued)
    assert continued.path == COMPLETIONS and isinstance(continued.body["prompt"], list)
    assert continued.body["max_tokens"] == 12 - 4
    whole = await cluster.client.post(COMPLETIONS, json={**body, "stream": False})
    assert "".join(texts) == (await whole.json())["choices"][0]["text"]
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="broken") == 1


def test_the_tokens_a_decode_computes_itself() -> None:
    key = mp.route_key(COMPLETIONS, completion(prompt="x" * 2000), None, 512)
    blocks = len(key.chain)
    assert mp.local_tokens(key, 0, 0, 512, 4.0) == key.length / 4
    assert mp.local_tokens(key, 0, blocks, 512, 4.0) == max(0, key.length - blocks * 512) / 4
    assert mp.local_tokens(None, 400, 0, 512, 4.0) == 100
    with_ids = dataclasses.replace(key, tokens=list(range(500)))
    assert mp.local_tokens(with_ids, 0, blocks / 2, 512, 4.0) == 250  # by its ids, when known
