"""Where a stream's time to first token went, and what came of streams cut mid-way: the
phases of the handoff (queue, prefill, handoff; decode for a decode alone), which add up to
the TTFT; migration outcomes and the client's wait across a cut; retries before the first
byte by how they ended."""

from __future__ import annotations

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
    sample,
    scrape,
    sse_events,
)

PHASES = "mooncake_proxy_request_phase_seconds"


async def streamed(cluster: Cluster, path: str, body: dict[str, Any]) -> list[Any]:
    response = await cluster.client.post(path, json=body)
    assert response.status == 200, await response.text()
    return sse_events(await response.read())


def phase_sums(samples: dict[Any, float]) -> dict[str, float]:
    return {
        phase: sample(samples, f"{PHASES}_sum", phase=phase)
        for phase in ("queue", "prefill", "handoff", "decode")
    }


async def test_a_streams_phases_add_up_to_its_time_to_first_token(
    start_cluster: StartCluster,
) -> None:
    """The prefill computes for 0.15 s, the decode waits 0.1 s before it pulls: each shows in
    its phase, and the three add up to the request's TTFT."""
    cluster = await start_cluster(prefill={"delay": 0.15}, decode={"pull_delay": 0.1})
    await streamed(cluster, CHAT, chat(stream=True))
    samples = await scrape(cluster)
    sums = phase_sums(samples)
    assert sums["prefill"] >= 0.15 and sums["handoff"] >= 0.0 and sums["decode"] == 0
    assert 0 <= sums["queue"] < 0.1
    ttft = sample(samples, "mooncake_proxy_time_to_first_token_seconds_sum", route=CHAT)
    assert sums["queue"] + sums["prefill"] + sums["handoff"] == pytest.approx(ttft, abs=1e-6)
    counts = {p: sample(samples, f"{PHASES}_count", phase=p, route=CHAT) for p in sums}
    assert counts == {"queue": 1, "prefill": 1, "handoff": 1, "decode": 0}


async def test_a_decode_alones_phases_are_queue_and_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(decode={"delay": 0.1})
    await streamed(cluster, COMPLETIONS, completion(stream=True, n=2))  # n > 1: alone
    samples = await scrape(cluster)
    sums = phase_sums(samples)
    assert sums["decode"] >= 0.1 and sums["prefill"] == sums["handoff"] == 0
    ttft = sample(samples, "mooncake_proxy_time_to_first_token_seconds_sum", route=COMPLETIONS)
    assert sums["queue"] + sums["decode"] == pytest.approx(ttft, abs=1e-6)


async def outcomes(cluster: Cluster) -> dict[str, float]:
    samples = await scrape(cluster)
    return {
        outcome: sample(samples, "mooncake_proxy_migration_outcomes_total", outcome=outcome)
        for outcome in mp.MIGRATION_OUTCOMES
    }


async def test_a_stream_continued_elsewhere_counts_continued_and_its_wait(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"break_after_tokens": 4, "faults_left": 1}, {"pull_delay": 0.1}),
        decode_policy=mp.Policy.ROUND_ROBIN,
    )
    events = await streamed(cluster, COMPLETIONS, completion(stream=True, max_tokens=12))
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert await outcomes(cluster) == {
        "continued": 1, "not_continued": 0, "failed": 0, "client_gone": 0,
    }  # fmt: skip
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="broken") == 1
    assert sample(samples, "mooncake_proxy_migration_gap_seconds_count") == 1
    assert sample(samples, "mooncake_proxy_migration_gap_seconds_sum") >= 0.1  # its pull's wait
    # The continuation's own pair is not the TTFT's: one queue, prefill and handoff each.
    assert sample(samples, f"{PHASES}_count", phase="queue") == 1


async def test_a_stream_that_cannot_go_on_counts_not_continued(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=2, decode={"break_after_tokens": 3}, migration_limit=0)
    events = await streamed(cluster, COMPLETIONS, completion(stream=True))
    assert "error" in events[-2]
    assert await outcomes(cluster) == {
        "continued": 0, "not_continued": 1, "failed": 0, "client_gone": 0,
    }  # fmt: skip


async def test_a_continuation_that_never_came_counts_failed(start_cluster: StartCluster) -> None:
    """The second decode fails its pull and the tries run out: the stream ends in band."""
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"break_after_tokens": 3, "faults_left": 1}, {"fail_pulls": 10}),
        decode_policy=mp.Policy.ROUND_ROBIN,
        max_retries=0,  # two pairs in all: the one cut, and the continuation's one try
        migration_limit=1,
    )
    events = await streamed(cluster, COMPLETIONS, completion(stream=True, max_tokens=12))
    assert "error" in events[-2] and events[-1] == "[DONE]"
    found = await outcomes(cluster)
    assert found == {"continued": 0, "not_continued": 0, "failed": 1, "client_gone": 0}, found
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total") == 1
    assert sample(samples, "mooncake_proxy_migration_gap_seconds_count") == 0


async def test_retries_before_the_first_byte_are_counted_by_how_they_ended(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        decodes=2, each_decode=({"fail_pulls": 1}, {}), decode_policy=mp.Policy.ROUND_ROBIN
    )
    await streamed(cluster, COMPLETIONS, completion(stream=True))  # retried, answered
    await streamed(cluster, COMPLETIONS, completion(stream=True))  # first time
    samples = await scrape(cluster)
    # The retried one's phases are its last pair's: no prefill phase before its legs went.
    assert sample(samples, f"{PHASES}_count", phase="prefill") == 2
    ttft = sample(samples, "mooncake_proxy_time_to_first_token_seconds_sum", route=COMPLETIONS)
    sums = phase_sums(samples)
    assert min(sums.values()) >= 0
    assert sums["queue"] + sums["prefill"] + sums["handoff"] == pytest.approx(ttft, abs=1e-6)
    name = "mooncake_proxy_first_token_retries_total"
    assert sample(samples, name, outcome="answered") == 1
    assert sample(samples, name, outcome="failed") == 0
    cluster.decodes[0].fail_pulls = cluster.decodes[1].fail_pulls = 10
    response = await cluster.client.post(COMPLETIONS, json=completion())
    assert response.status >= 500
    samples = await scrape(cluster)
    assert sample(samples, name, outcome="failed") == 1
