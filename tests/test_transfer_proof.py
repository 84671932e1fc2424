"""Proof that the KV came over Mooncake: a decode that computes the prompts it should pull
(a failed pull under kv_load_failure_policy "recompute") is told apart from one that pulls,
by its vllm:prompt_tokens_by_source_total, within two scrapes.

The fakes count their prompt tokens by source as vLLM does: pulled (external_kv_transfer), or
computed (local_compute) when sent alone or when a pull fails under "recompute"."""

from __future__ import annotations

import asyncio
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


# --- each answer's own word: usage.prompt_tokens_details.cached_tokens


async def send_both_ways(cluster: Cluster) -> None:
    """A whole answer and a stream with include_usage: both end with their usage."""
    await send(cluster, 1)
    options = {"include_usage": True}
    await send(cluster, 1, stream=True, stream_options=options)
    await send(cluster, 1, stream=True)  # no usage at its end: not counted either way


async def test_answers_whose_kv_was_pulled_or_recomputed_are_counted_by_their_cached_tokens(
    start_cluster: StartCluster,
) -> None:
    """With --enable-prompt-tokens-details a pulled prompt is cached whole when it came;
    one whose pull failed under "recompute" was computed: each PD answer counted so."""
    decode = {"prompt_tokens_details": True, "kv_load_failure_policy": "recompute"}
    cluster = await start_cluster(decode=decode)
    await send_both_ways(cluster)
    cluster.decodes[0].fail_pulls = 2
    await send_both_ways(cluster)  # the first two pulls fail, the third answer has no usage
    assert len(cluster.decodes[0].pull_failures) == 2
    status = (await health_of_decode(cluster))["kv_answers"]
    assert status == {"cached_tokens_reported": True, "pulled": 2, "recomputed": 2}
    samples = await scrape(cluster)
    url = str(cluster.decodes[0].api_url)
    for source in ("pulled", "recomputed"):
        assert (
            sample(
                samples,
                "mooncake_proxy_pd_answers_by_prompt_source_total",
                backend=url,
                source=source,
            )
            == 2
        )


async def test_a_decode_without_cached_tokens_is_said_once_and_judged_by_its_counters(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await start_cluster(load_interval=SCRAPE)
    await scrapes(cluster)
    with caplog.at_level(logging.INFO, "mooncake_proxy"):
        await send_both_ways(cluster)
        await send_both_ways(cluster)
        await scrapes(cluster)
    decode = await health_of_decode(cluster)
    assert decode["kv_answers"] == {"cached_tokens_reported": False}
    assert decode["kv_transfer"]["pulled_share"] == 1.0  # the counters still judge it
    said = [r.getMessage() for r in caplog.records if "no cached_tokens" in r.getMessage()]
    assert len(said) == 1 and str(cluster.decodes[0].api_url) in said[0], said


@pytest.mark.parametrize(
    ("tail", "report"),
    [
        (
            b'"usage":{"prompt_tokens":80,"total_tokens":96,"completion_tokens":16,'
            b'"prompt_tokens_details":{"cached_tokens":80,"created_cache_tokens":null},'
            b'"completion_tokens_details":null},"kv_transfer_params":null}',
            (80, 80),
        ),
        (
            b'"usage":{"prompt_tokens":80,"total_tokens":96,"completion_tokens":16,'
            b'"prompt_tokens_details":null,"completion_tokens_details":null}}',
            (80, None),
        ),
        (
            b'"choices":[],"usage":{"prompt_tokens":80,"total_tokens":82,"completion_tokens":2,'
            b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n',
            (80, 0),
        ),
        (
            b'"choices":[],"usage":{"prompt_tokens":80,"total_tokens":82,"completion_tokens":2}}'
            b"\n\ndata: [DONE]\n\n",
            (80, None),
        ),
        (
            b'"usage": {"prompt_tokens": 7, "total_tokens": 9, "completion_tokens": 2, '
            b'"prompt_tokens_details": {"cached_tokens": 7}}',
            (7, 7),
        ),
        (b'"text":" the","usage":null}\n\ndata: [DONE]\n\n', None),
        (b'data: {"choices":[{"text":"usage"}]}\n\ndata: [DONE]\n\n', None),
        (b"", None),
    ],
)
def test_an_answers_usage_is_read_from_its_last_bytes(
    tail: bytes, report: tuple[int, int | None] | None
) -> None:
    """vLLM 0.32's whole answers (model_dump: null details written), its streams' usage chunk
    (null ones left out), spaced JSON; no usage, or a null one: nothing to tell by."""
    assert mp.answer_prompt_cache(tail) == report


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
    assert proof.take(0, 0, proof.asked()) is None  # the first scrape: a baseline
    proof.sent_alone += 50
    assert proof.take(0, 50, proof.asked()) is None and proof.pulled_share is None  # no PD
    proof.answered += 2
    assert proof.take(0, 150, proof.asked()) is True and proof.pulled_share == 0.0
    proof.answered += 1
    assert proof.take(100, 150, proof.asked()) is False and proof.pulled_share == 1.0
    proof.answered += 1
    assert proof.take(50, 10, proof.asked()) is None  # went back: the decode restarted


def test_answers_begun_while_a_scrape_is_out_count_in_the_window_after_it() -> None:
    """The counters a scrape brings back are those of when it was asked for: answers that
    began since are not in them, and are judged with the next scrape's."""
    proof = mp.TransferProof()
    proof.take(0, 0, proof.asked())
    asked = proof.asked()  # a scrape is asked for; while its page is on its way ...
    proof.answered += 3  # ... three PD answers begin, their pulls not in that page
    assert proof.take(0, 0, asked) is None and proof.pulled_share is None
    assert proof.take(300, 0, proof.asked()) is None and proof.pulled_share == 1.0


async def test_a_decode_whose_metrics_come_late_is_judged_on_the_answers_they_count(
    start_cluster: StartCluster,
) -> None:
    """A busy vLLM's /metrics page reaches the proxy late, with its counters as they stood when
    asked. Answers that began meanwhile were once judged against that page (answers, no
    pull) and then lost to the next window (a pull, no answers): a healthy decode was never
    judged."""
    cluster = await start_cluster(load_interval=SCRAPE)
    await scrapes(cluster)
    decode = cluster.decodes[0]
    decode.metrics_delay = 1.0
    asked = decode.metrics_count
    await eventually(lambda: decode.metrics_count > asked)  # a scrape out, its page made
    await send(cluster, 3)  # within that second
    decode.metrics_delay = 0.0
    await scrapes(cluster, 2)
    decode_health = await health_of_decode(cluster)
    assert decode_health["kv_transfer"] == {
        "pulled_share": 1.0, "recomputing": False, "since": None,
    }  # fmt: skip


# --- the PD self-test: a request of a few tokens per prefill engine and decode


async def run_self_test(cluster: Cluster, key: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await cluster.client.post("/admin/self-test", headers=headers)
    return response.status, await response.json()


async def test_the_self_test_finds_every_pair_moving_kv(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(prefill_dp=(2, 1))
    status, result = await run_self_test(cluster)
    assert status == 200 and result["ok"] is True
    pairs = {(p["prefill"], p["dp_rank"]): p for p in result["pairs"]}
    expected = {(fake.api_url, rank) for fake in cluster.prefills for rank in range(fake.dp_size)}
    assert set(pairs) == expected
    assert all(p["why"] == "pulled" and p["decode"] == cluster.decodes[0].api_url
               for p in pairs.values())  # fmt: skip
    # Both legs of each went as a client's would: the prefill's rank told, the decode's pull.
    assert sorted(r.headers[mp.DP_RANK_HEADER] for _, r in cluster.prefill_requests()) == [
        "0", "0", "1",
    ]  # fmt: skip
    health = await (await cluster.client.get("/healthcheck")).json()
    assert health["self_test"] == result
    samples = await scrape(cluster)
    for fake in cluster.prefills:
        ok = sample(samples, "mooncake_proxy_self_test_pair_ok", prefill=fake.api_url,
                    dp_rank="0", decode=cluster.decodes[0].api_url)  # fmt: skip
        assert ok == 1.0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_the_self_test_names_a_pair_that_does_not_move_kv_and_why(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """The decode cannot pull from the first prefill (its pulls fail): with vLLM's default
    policy its leg answers 500; under "recompute" it answers, having computed the prompt."""
    cluster = await start_cluster(
        prefill_dp=(1, 1), each_decode=({"kv_load_failure_policy": policy},)
    )
    first = next(e for p in fleet_of(cluster).prefills for e in p.engines if p.url.port ==
                 int(cluster.prefills[0].api_url.rsplit(":", 1)[1]))  # fmt: skip
    cluster.decodes[0].fail_pulls = 1  # the self-test checks the pairs in their order
    with caplog.at_level(logging.INFO, "mooncake_proxy"):
        status, result = await run_self_test(cluster)
    assert status == 200 and result["ok"] is False
    (bad,) = [p for p in result["pairs"] if not p["ok"]]
    (good,) = [p for p in result["pairs"] if p["ok"]]
    assert bad["prefill"] == str(first.instance.url) and good["why"] == "pulled"
    if policy == "fail":
        assert bad["why"].startswith(f"decode {cluster.decodes[0].api_url} answered 500")
    else:
        assert bad["why"].startswith("the decode computed the prompt itself")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("self-test")]
    assert any(bad["prefill"] in line and "do not move KV" in line for line in said), said
    assert "self-test: 1 of 2 pairs move KV" in said
    samples = await scrape(cluster)
    name = "mooncake_proxy_self_test_pair_ok"
    assert sample(samples, name, prefill=bad["prefill"], dp_rank="0",
                  decode=bad["decode"]) == 0.0  # fmt: skip


async def test_the_self_test_route_wants_the_api_key(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(api_key="sesame")
    status, error = await run_self_test(cluster)
    assert status == 401 and "API key" in error["error"]["message"]
    assert not cluster.prefills[0].requests
    status, result = await run_self_test(cluster, "sesame")
    assert status == 200 and result["ok"] is True


async def test_the_self_test_runs_once_at_start(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(no_start_self_test=False)

    async def tested() -> bool:
        health = await (await cluster.client.get("/healthcheck")).json()
        return health["self_test"] is not None and health["self_test"]["ok"] is True

    for _ in range(100):
        if await tested():
            break
        await asyncio.sleep(0.05)
    assert await tested()
    assert len(cluster.decodes[0].requests) == 1  # once


async def test_a_recomputing_decode_is_passed_over_for_pd_when_asked(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """--avoid-recomputing: once judged recomputing, a decode gets no PD request while
    another pulls, and the log says so."""
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"kv_load_failure_policy": "recompute", "fail_pulls": 100}, {}),
        decode_policy=mp.Policy.ROUND_ROBIN,
        load_interval=SCRAPE,
        avoid_recomputing=True,
    )
    bad = fleet_of(cluster).decodes[0]
    await eventually(lambda: bad.proof.totals is not None)
    with caplog.at_level(logging.WARNING, "mooncake_proxy"):
        await send(cluster, 4)  # two to each
        await eventually(lambda: bad.proof.recomputing)
    said = [r.getMessage() for r in caplog.records if "should pull" in r.getMessage()]
    assert len(said) == 1 and "passed over for PD requests" in said[0]
    before = len(cluster.decodes[0].requests)
    await send(cluster, 4)
    assert len(cluster.decodes[0].requests) == before  # all four to the one that pulls
    assert len(cluster.decodes[1].requests) == 2 + 4


def test_a_recomputing_decode_is_held_out_for_a_while_after_its_last_judgment() -> None:
    proof = mp.TransferProof()
    proof.take(0, 0, proof.asked())
    proof.answered += 1
    assert proof.take(0, 100, proof.asked()) is True
    judged = proof.judged_at
    assert proof.held_out(judged + mp.RECOMPUTE_HOLD - 1)
    assert not proof.held_out(judged + mp.RECOMPUTE_HOLD)  # tried again, to be judged anew
