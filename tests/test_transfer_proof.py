"""Proof that the KV came over Mooncake: a decode that computes the prompts it should pull
(a failed pull under kv_load_failure_policy "recompute") is told apart from one that pulls,
by its vllm:prompt_tokens_by_source_total, within two scrapes.

The fakes count their prompt tokens by source as vLLM does: pulled (external_kv_transfer), or
computed (local_compute) when sent alone or when a pull fails under "recompute"."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import mooncake_proxy as mp
from testing_support import (
    COMPLETIONS,
    Cluster,
    StartCluster,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
)

SCRAPE = 0.05  # --load-interval here


async def health_of_decode(cluster: Cluster) -> dict[str, Any]:
    health = await (await cluster.client.get("/healthcheck")).json()
    (decode,) = health["decode"]
    assert isinstance(decode, dict)
    return decode


async def send(cluster: Cluster, count: int, **body: Any) -> None:
    for i in range(count):
        prompt = f"prompt {i} " * 20
        response = await cluster.client.post(COMPLETIONS, json=completion(prompt=prompt, **body))
        assert response.status == 200, await response.text()


async def scrapes(cluster: Cluster, count: int = 2) -> None:
    """Until the proxy has scraped the decode ``count`` more times."""
    proof = fleet_of(cluster).decodes[0].proof
    seen: list[object] = []

    def scraped() -> bool:
        if not seen or proof.totals is not seen[-1]:
            seen.append(proof.totals)
        return len(seen) > count

    await eventually(scraped)


async def test_a_decode_that_pulls_is_shown_pulling_all(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(load_interval=SCRAPE)
    await scrapes(cluster)
    await send(cluster, 3)
    await scrapes(cluster)
    decode = await health_of_decode(cluster)
    assert decode["kv_transfer"] == {"pulled_share": 1.0, "recomputing": False, "since": None}
    samples = await scrape(cluster)
    url = str(cluster.decodes[0].api_url)
    assert sample(samples, "mooncake_proxy_decode_kv_pulled_ratio", backend=url) == 1.0
    assert sample(samples, "mooncake_proxy_decode_recomputing", backend=url) == 0.0


async def test_a_decode_that_recomputes_is_reported_within_two_scrapes_and_back_once_it_pulls(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await start_cluster(
        load_interval=SCRAPE, decode={"kv_load_failure_policy": "recompute", "fail_pulls": 3}
    )
    await scrapes(cluster)
    with caplog.at_level(logging.WARNING, "mooncake_proxy"):
        await send(cluster, 3)  # every pull fails; the decode answers them all the same
        assert len(cluster.decodes[0].pull_failures) == 3
        await scrapes(cluster, 2)
    decode = await health_of_decode(cluster)
    assert decode["kv_transfer"]["recomputing"] is True
    assert decode["kv_transfer"]["pulled_share"] == 0.0
    assert decode["kv_transfer"]["since"] is not None
    samples = await scrape(cluster)
    url = str(cluster.decodes[0].api_url)
    assert sample(samples, "mooncake_proxy_decode_recomputing", backend=url) == 1.0
    assert sample(samples, "mooncake_proxy_decode_kv_pulled_ratio", backend=url) == 0.0
    said = [r.getMessage() for r in caplog.records if "should pull" in r.getMessage()]
    assert len(said) == 1 and url in said[0], said  # once, naming it
    await send(cluster, 2)  # its pulls work again
    await scrapes(cluster, 2)
    decode = await health_of_decode(cluster)
    assert decode["kv_transfer"] == {"pulled_share": 1.0, "recomputing": False, "since": None}


async def test_prompts_sent_to_a_decode_alone_do_not_make_it_recomputing(
    start_cluster: StartCluster,
) -> None:
    """Computed there by design (local prefill, n > 1): not taken for failed pulls, alone or
    beside PD answers."""
    cluster = await start_cluster(load_interval=SCRAPE, max_local_prefill_tokens=10_000)
    fleet_of(cluster).bytes_per_token = 4.0  # as the fakes count
    await scrapes(cluster)
    await send(cluster, 3)  # all local
    await send(cluster, 2, n=2)  # alone: n > 1
    await scrapes(cluster)
    decode = await health_of_decode(cluster)
    assert decode["kv_transfer"] is None  # no PD answer there yet: nothing to judge
    cluster.decodes[0].kv_usage = 0.99  # full: the next ones go through PD
    await eventually(lambda: fleet_of(cluster).decodes[0].load.kv_usage == 0.99)
    await send(cluster, 2)
    await send(cluster, 2, n=2)
    await scrapes(cluster)
    decode = await health_of_decode(cluster)
    assert decode["kv_transfer"]["recomputing"] is False


def test_a_decodes_prompt_sources_are_read_from_its_metrics() -> None:
    page = "\n".join(
        [
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 80.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 12.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 7.0',
            'vllm:prompt_tokens_by_source_total{engine="1",source="local_compute"} 3.0',
        ]
    )
    engines, _ = mp.parse_vllm_load(page)
    assert engines == {0: {"pulled": 80.0, "computed": 12.0}, 1: {"computed": 3.0}}


def test_the_proof_judges_only_windows_with_pd_answers() -> None:
    proof = mp.TransferProof()
    assert proof.take(0, 0) is None  # the first scrape: a baseline
    proof.sent_alone = 50
    assert proof.take(0, 50) is None and proof.pulled_share is None  # no PD answer
    proof.answered = 2
    assert proof.take(0, 150) is True and proof.pulled_share == 0.0
    proof.answered = 1
    assert proof.take(100, 150) is False and proof.pulled_share == 1.0
    proof.answered = 1
    assert proof.take(50, 10) is None  # went back: the decode restarted
