"""Tests for mooncake_proxy: fake vLLM servers on real loopback sockets, the proxy over HTTP.

This file holds the core PD path: the flow itself, prefill and decode failures, the client
going away, bad input and admission. The other areas have files of their own beside it
(test_config.py, test_legs.py, test_fleet.py, test_routing.py, test_kv_events.py,
test_migration.py, test_routes.py, test_operations.py); what they share is in
testing_support.py and conftest.py.

The fakes (fake_vllm.py) behave as ../../shared/PROTOCOL.md says; in particular a decode only
answers once the prefill with its ``transfer_id`` finished on the engine it names, so every test
that gets tokens back also proves the prefill leg was sent, and sent right.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pytest_aiohttp import AiohttpClient, AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from fake_vllm import EOS_MARKER, KEEPALIVE_SECONDS, FakeVllm, generate, prompt_of
from testing_support import (
    CHAT,
    COMPLETIONS,
    FAST,
    JSON_TYPE,
    LONG_CONTEXT,
    StartCluster,
    access_lines,
    assert_openai_error,
    chat,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
    serve,
    sse_events,
    wait_ready_,
)

# --- the harness: every async test runs on both event loops (conftest.py)


async def test_async_tests_run_on_the_loop_they_name(request: pytest.FixtureRequest) -> None:
    """conftest.py runs each async test on asyncio's loop and on uvloop, the daemon's default:
    the second really is uvloop (a failure path that works on one loop only once hid here)."""
    loop = type(asyncio.get_running_loop())
    assert request.node.name.endswith(("[asyncio]", "[uvloop]"))
    assert (loop.__module__.split(".")[0] == "uvloop") == request.node.name.endswith("[uvloop]")


# --- the PD flow


async def test_streamed_answer_is_the_decodes_bytes_exactly(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    body = completion(stream=True, stream_options={"include_usage": True})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=body)
        raw = await response.read()
    assert response.status == 200
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    request_id = response.headers["X-Request-Id"]
    assert raw == cluster.decodes[0].sent_without_token_ids(request_id)
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and "usage" in events[-2]
    assert cluster.decodes[0].kv_tokens_received > 0
    assert cluster.prefills[0].transfers_served == 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_answer_through_the_proxy_equals_the_decodes_local_answer(
    start_cluster: StartCluster, path: str, stream: bool
) -> None:
    cluster = await start_cluster()
    body = (chat if path == CHAT else completion)(stream=stream, max_tokens=12)
    async with asyncio.timeout(FAST):
        proxied = await (await cluster.client.post(path, json=body)).read()
        async with aiohttp.ClientSession() as direct:
            local = await (await direct.post(cluster.decodes[0].api_url + path, json=body)).read()

    def text(raw: bytes) -> str:
        if not stream:
            choice = json.loads(raw)["choices"][0]
            return str(choice["message"]["content"] if path == CHAT else choice["text"])
        parts = []
        for event in sse_events(raw):
            if event != "[DONE]" and event["choices"]:
                choice = event["choices"][0]
                parts.append(choice["delta"].get("content", "") if path == CHAT else choice["text"])
        return "".join(parts)

    expected = generate(prompt_of(path, body), body)
    assert len(expected.token_ids) == 12
    assert text(proxied) == text(local) == expected.text
    assert cluster.prefills[0].transfers_served == 1


async def test_legs_carry_the_protocols_bodies_and_headers(start_cluster: StartCluster) -> None:
    # Round robin: the first pick is rank 0, whatever rank the client's header asks for.
    cluster = await start_cluster(prefill_dp=(2,), policy=mp.Policy.ROUND_ROBIN)
    body = chat(
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=6,
        min_tokens=2,
        stop=["never-said"],
        kv_transfer_params={"remote_bootstrap_addr": "http://attacker:1", "remote_engine_id": "x"},
    )
    headers = {
        "X-Request-Id": "trace-42",
        "X-data-parallel-rank": "1",
        "Authorization": "Bearer client-key",
        "X-Custom": "kept",
    }
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(CHAT, json=body, headers=headers)
        await response.read()
    assert response.status == 200
    request_id = response.headers["X-Request-Id"]
    assert request_id.startswith("trace-42-")
    (prefill,) = cluster.prefills[0].requests
    (decode,) = cluster.decodes[0].requests
    transfer_id = f"xfer-{request_id}"
    assert prefill.body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    assert decode.body["kv_transfer_params"] == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": cluster.config.prefills[0].bootstrap_addr,
        "remote_engine_id": cluster.prefills[0].engine_ids[0],
        "transfer_id": transfer_id,
    }
    for key in ("stream_options", "min_tokens", "stop"):
        assert key not in prefill.body
    assert (
        prefill.body["stream"],
        prefill.body["max_tokens"],
        prefill.body["max_completion_tokens"],
    ) == (
        False,
        1,
        1,
    )
    assert prefill.body["ignore_eos"] is True
    # The decode is asked for token ids too: the stream could go on elsewhere from them.
    assert {k: v for k, v in decode.body.items() if k != "kv_transfer_params"} == {
        **{k: v for k, v in body.items() if k != "kv_transfer_params"},
        "return_token_ids": True,
    }
    assert "return_token_ids" not in prefill.body
    # The first engine of the rotation is rank 0, whatever rank the client asked for.
    assert prefill.headers["X-data-parallel-rank"] == "0"
    assert "X-data-parallel-rank" not in decode.headers
    for leg in (prefill, decode):
        assert leg.headers["X-Request-Id"] == request_id
        assert leg.headers["Authorization"] == "Bearer client-key"
        assert leg.headers["X-Custom"] == "kept"
        assert leg.headers["Content-Type"] == "application/json"


async def test_requests_rotate_over_prefill_ranks_and_decodes_in_the_seeds_order(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(prefill_dp=(2, 1), decodes=2, policy=mp.Policy.ROUND_ROBIN)
    request_ids = []
    async with asyncio.timeout(FAST):
        for _ in range(6):
            response = await cluster.client.post(COMPLETIONS, json=completion())
            assert response.status == 200, await response.text()
            request_ids.append(response.headers["X-Request-Id"])
    prefill_of = {
        r.headers["X-Request-Id"]: (index, int(r.headers["X-data-parallel-rank"]))
        for index, r in cluster.prefill_requests()
    }
    decode_of = {
        r.headers["X-Request-Id"]: (index, r.body["kv_transfer_params"]["remote_engine_id"])
        for index, fake in enumerate(cluster.decodes)
        for r in fake.requests
    }
    assert [prefill_of[rid] for rid in request_ids] == [(0, 0), (0, 1), (1, 0)] * 2
    assert [decode_of[rid][0] for rid in request_ids] == [0, 1] * 3
    # Each decode named the engine id of exactly the rank that got its prefill.
    for rid in request_ids:
        instance, rank = prefill_of[rid]
        assert decode_of[rid][1] == cluster.prefills[instance].engine_ids[rank]


async def test_same_client_request_id_never_shares_a_transfer(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    headers = {"X-Request-Id": "same"}
    async with asyncio.timeout(FAST):
        answers = await asyncio.gather(
            *(
                cluster.client.post(COMPLETIONS, json=completion(), headers=headers)
                for _ in range(8)
            )
        )
    assert [a.status for a in answers] == [200] * 8
    transfer_ids = {
        r.body["kv_transfer_params"]["transfer_id"] for r in cluster.prefills[0].requests
    }
    assert len(transfer_ids) == 8
    assert cluster.prefills[0].transfer_collisions == 0
    ids = {json.loads(await a.read())["id"] for a in answers}
    assert len(ids) == 8 and all(i.startswith("cmpl-same-") for i in ids)


async def test_upstream_api_key_replaces_the_clients(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(
        upstream_api_key="vllm-key",
        prefill={"api_key": "vllm-key"},
        decode={"api_key": "vllm-key"},
    )
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(
            COMPLETIONS, json=completion(), headers={"Authorization": "Bearer wrong"}
        )
        assert response.status == 200, await response.text()
        assert (await cluster.client.get("/v1/models")).status == 200


async def test_headers_are_held_until_the_first_decode_bytes_then_streamed_unbuffered(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decode={"token_delay": 0.3}, prefill={"delay": 0.3})
    started = time.monotonic()
    async with asyncio.timeout(FAST + 5):
        response = await cluster.client.post(
            COMPLETIONS, json=completion(stream=True, max_tokens=10)
        )
        headers_at = time.monotonic() - started
        first = await response.content.readany()
        first_at = time.monotonic() - started
        rest = await response.read()
        done_at = time.monotonic() - started
    # Headers waited for the prefill (0.3 s) and the first token; tokens came one by one.
    assert headers_at >= 0.25
    assert first.startswith(b"data: ") and first_at < done_at - 2.0
    assert sse_events(first + rest)[-1] == "[DONE]"


FANS_OUT = {
    "n": completion(n=3),
    "n-chat": chat(n=3),
    "n-as-text": completion(n="2"),
    "best_of": completion(best_of=2),
    "beam": completion(use_beam_search=True),
    "batch": completion(prompt=["first prompt", "second prompt"]),
    "token-batch": completion(prompt=[[1, 2, 3], [4, 5, 6]]),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("case", list(FANS_OUT))
async def test_requests_vllm_splits_go_to_a_decode_alone(
    start_cluster: StartCluster, case: str, stream: bool
) -> None:
    """vLLM splits these into child requests that all carry the one transfer_id; Mooncake
    hands a transfer to one, and the rest would wait out the KV timeout (or load another
    prompt's KV). The decode computes such a prompt itself, and answers every choice."""
    cluster = await start_cluster()
    body = {**FANS_OUT[case], "stream": stream, "kv_transfer_params": {"from": "the client"}}
    path = CHAT if "messages" in body else COMPLETIONS
    started = time.monotonic()
    response = await cluster.client.post(path, json=body)
    assert response.status == 200, await response.text()
    raw = await response.read()
    assert time.monotonic() - started < FAST
    assert not cluster.prefills[0].requests
    (sent,) = cluster.decodes[0].requests
    assert "kv_transfer_params" not in sent.body
    assert {k: v for k, v in sent.body.items()} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }
    assert raw == cluster.decodes[0].sent_without_token_ids(response.headers["X-Request-Id"])
    reason = {"n-chat": "n", "n-as-text": "n", "beam": "use_beam_search"}.get(case, case)
    reason = "prompt" if "batch" in case else reason
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_prefill_skipped_total", reason=reason) == 1


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (completion(), None),
        (completion(n=1, best_of=1, use_beam_search=False), None),
        (completion(n=2), "n"),
        (completion(n=2.0), "n"),
        (completion(n=" 3"), "n"),
        (completion(n=True), None),
        (completion(n="many"), None),  # vLLM answers it 400, whichever way it goes
        (completion(best_of="2"), "best_of"),
        (completion(use_beam_search="true"), "use_beam_search"),
        (completion(prompt=["one prompt"]), None),
        (completion(prompt=[1, 2, 3]), None),  # one prompt of token ids
        (completion(prompt=["one", "two"]), "prompt"),
        (completion(prompt=[[1], [2]]), "prompt"),
        (chat(n=4), "n"),
    ],
)
def test_what_vllm_splits_is_read_as_vllm_reads_it(body: dict[str, Any], why: str | None) -> None:
    path = CHAT if "messages" in body else COMPLETIONS
    assert mp.fans_out(path, body) == why


# --- prefill failures fail fast


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 500])
async def test_prefill_error_reaches_client_before_kv_timeout(
    start_cluster: StartCluster, stream: bool, status: int
) -> None:
    cluster = await start_cluster(prefill={"fail_status": status})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=stream))
        payload = await response.json()
    assert response.status == status
    assert payload["error"]["message"] == f"injected failure {status}"  # vLLM's own body
    assert response.headers["X-Request-Id"]
    await eventually(lambda: cluster.decodes[0].running == 0)
    assert len(cluster.decodes[0].aborted) == 1  # the waiting decode was cancelled


async def test_vllm_rejecting_the_prefill_body_reaches_client(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(max_tokens="many"))
    assert response.status == 400
    # vLLM 0.32's pydantic names the field as it found it: body.max_tokens.
    assert (await response.json())["error"]["param"] == "body.max_tokens"


VLLM_REFUSALS = {  # what vLLM 0.32 answers (seen on the real server), and the fakes with it
    "unknown model": (completion(model="not-served"), 404, "NotFoundError", "does not exist"),
    "past max_model_len": (completion(prompt="x" * 20_000), 400, "BadRequestError", "context"),
    "n of 0": (completion(n=0), 400, "BadRequestError", "n must be at least 1"),
    "greedy n": (completion(n=2, temperature=0), 400, "BadRequestError", "greedy sampling"),
}


@pytest.mark.parametrize("case", list(VLLM_REFUSALS))
async def test_what_vllm_refuses_reaches_the_client_at_once_as_vllm_said_it(
    start_cluster: StartCluster, case: str
) -> None:
    body, status, kind, words = VLLM_REFUSALS[case]
    cluster = await start_cluster()
    local = await cluster.client.session.post(cluster.decodes[0].api_url + COMPLETIONS, json=body)
    assert local.status == status  # the fake, as vLLM
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=body)
    assert response.status == status
    error = (await response.json())["error"]
    assert error["type"] == kind and words in error["message"]
    assert error == (await local.json())["error"]


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_that_stops_early_fails_fast(
    start_cluster: StartCluster, stream: bool
) -> None:
    cluster = await start_cluster(prefill={"force_finish_reason": "stop"})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=stream))
        payload = await response.json()
    assert response.status == 502
    assert_openai_error(payload, 502)
    assert "'stop'" in payload["error"]["message"] and "length" in payload["error"]["message"]
    await eventually(lambda: cluster.decodes[0].running == 0)


async def test_eos_and_stop_strings_cannot_stop_the_prefill_early(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    # The fake's first token for this prompt is EOS unless ignore_eos is set.
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(
            COMPLETIONS, json=completion(prompt=f"hi {EOS_MARKER}")
        )
        assert response.status == 200, await response.text()
        # A stop string equal to the first token would end the prefill "stopped".
        local = await (
            await cluster.client.post(
                COMPLETIONS, json=completion(prompt="stop test", max_tokens=1)
            )
        ).json()
        first_word = local["choices"][0]["text"].strip()
        stopped = await cluster.client.post(
            COMPLETIONS, json=completion(prompt="stop test", stop=[first_word])
        )
        assert stopped.status == 200, await stopped.text()
    # vLLM cuts the text before the stop string: what preceded it in the token (its space).
    answer = await stopped.json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["stop_reason"] == first_word
    assert answer["choices"][0]["text"] == local["choices"][0]["text"].split(first_word)[0]


async def test_prefill_refused_fails_fast_naming_the_prefill(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    (prefill,) = cluster.prefills
    await cluster.kill(prefill)
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        payload = await response.json()
    assert response.status == 502
    assert_openai_error(payload, 502)
    assert prefill.api_url in payload["error"]["message"]
    assert "prefill" in payload["error"]["message"]
    await eventually(lambda: cluster.decodes[0].running == 0)
    # It left the rotation at once: the next request is told so without trying it.
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion())
    assert response.status == 503
    assert_openai_error(await response.json(), 503)
    await cluster.start_again(prefill, new_engine_ids=False)
    await wait_ready_(cluster.client)
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200


async def test_prefill_timeout_is_a_504(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(prefill={"hang": True}, prefill_timeout=0.3)
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        payload = await response.json()
    assert response.status == 504
    assert_openai_error(payload, 504)
    await eventually(lambda: cluster.decodes[0].running == 0 and cluster.prefills[0].running == 0)


async def test_a_prefill_failure_after_the_decodes_keep_alive_has_its_own_status(
    start_cluster: StartCluster,
) -> None:
    """The decode's 200 and keep-alive come before its KV: held until a token, so a prefill
    that fails meanwhile is answered with its own status, not in band."""
    cluster = await start_cluster(prefill={"delay": 0.2}, decode={"keepalive_first": True})
    cluster.prefills[0].force_finish_reason = "stop"
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        payload = await response.json()
    assert response.status == 502
    assert_openai_error(payload, 502)
    assert "stop" in payload["error"]["message"]
    await eventually(lambda: cluster.decodes[0].running == 0)
    assert cluster.decodes[0].aborted


# --- the fakes: they do as vLLM does, which every test file relies on


async def test_the_fakes_answer_n_choices_and_a_batch_as_vllm_does(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    url = cluster.decodes[0].api_url
    session = cluster.client.session
    answer = await (await session.post(url + COMPLETIONS, json=completion(n=3))).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in answer["choices"]}) > 1  # samples, not copies
    batch = completion(prompt=["one", "two"], n=2, stream=True)
    events = sse_events(await (await session.post(url + COMPLETIONS, json=batch)).read())
    finished = [c["index"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]
    chat_events = sse_events(
        await (await session.post(url + CHAT, json=chat(n=2, stream=True))).read()
    )
    roles = [e["choices"][0]["index"] for e in chat_events[:2]]
    assert roles == [0, 1] and all("role" in e["choices"][0]["delta"] for e in chat_events[:2])


@pytest.mark.asyncio(loop_factories=["asyncio"])  # the fake's own behaviour: one loop is enough
async def test_the_fakes_close_an_idle_connection_after_vllms_keepalive(
    aiohttp_server: AiohttpServer,
) -> None:
    fake = FakeVllm("decode")
    server = await serve(aiohttp_server, fake.api_app())
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    answered = time.monotonic()
    assert await asyncio.wait_for(reader.read(), KEEPALIVE_SECONDS + 3) == b""  # closed
    assert KEEPALIVE_SECONDS - 0.5 < time.monotonic() - answered < KEEPALIVE_SECONDS + 2
    writer.close()


@pytest.mark.parametrize(
    ("role", "params"),
    [("prefill", {"do_remote_prefill": True}), ("decode", {"do_remote_decode": "false"})],
)
async def test_the_fakes_die_of_kv_params_vllms_engine_asserts_against(
    aiohttp_client: AiohttpClient, role: str, params: dict[str, Any]
) -> None:
    """MooncakeConnector asserts its role: vLLM's engine core dies (every request then 500,
    /health 503). Its flags are read as truthy values: "false" is true."""
    fake = FakeVllm(role)
    client = await aiohttp_client(fake.api_app())
    body = completion(kv_transfer_params=params)
    assert (await client.post(COMPLETIONS, json=body)).status == 500
    assert (await client.get("/health")).status == 503
    assert (await client.post(COMPLETIONS, json=completion())).status == 500


async def test_a_fake_decode_told_no_kv_source_waits_as_vllm_does(
    aiohttp_client: AiohttpClient,
) -> None:
    """vLLM logs "Got invalid KVTransferParams" and queues no pull: the request waits."""
    client = await aiohttp_client(FakeVllm("decode").api_app())
    body = completion(kv_transfer_params={"do_remote_prefill": True, "transfer_id": "x"})
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await client.post(COMPLETIONS, json=body)


async def test_a_fake_decode_that_dies_after_its_pull_took_the_kv_and_answers_nothing(
    start_cluster: StartCluster,
) -> None:
    """die_after_pull: the KV left the prefill (it gives a transfer out once), then the
    connection drops before any answer, as a decode killed while it generates."""
    cluster = await start_cluster()
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    decode.die_after_pull = True
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 502
    assert prefill.transfers_served == 1 and not decode.sent  # pulled, nothing answered


async def test_a_fake_takes_its_failures_injected_over_http(
    aiohttp_client: AiohttpClient,
) -> None:
    """/_fake/inject sets failure-injection fields of a fake in another process (the chaos
    benchmark's); fields that are not failure injection are refused, and nothing is set."""
    fake = FakeVllm("decode")
    client = await aiohttp_client(fake.api_app())
    answer = await client.post("/_fake/inject", json={"fail_pulls": 3, "health_delay": 0.5})
    assert await answer.json() == {"fail_pulls": 3, "health_delay": 0.5}
    assert (fake.fail_pulls, fake.health_delay) == (3, 0.5)
    refused = await client.post("/_fake/inject", json={"fail_pulls": 1, "role": "prefill"})
    assert refused.status == 400
    assert (fake.role, fake.fail_pulls) == ("decode", 3)


async def test_a_duplicate_transfer_id_collides_in_the_fake_as_in_vllm(
    start_cluster: StartCluster,
) -> None:
    """Two prefills of one transfer_id: vLLM keeps one entry, which the last to finish
    writes; one decode pulls it (the other prompt's KV: vLLM answers with the wrong text, the
    fake fails it), the next waits out the KV timeout."""
    cluster = await start_cluster()
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    decode.kv_timeout = 0.5
    session, engine = cluster.client.session, prefill.engine_ids[0]
    for prompt in ("the first prompt", "the second prompt"):
        kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}
        body = completion(prompt=prompt, kv_transfer_params=kv)
        assert (await session.post(prefill.api_url + COMPLETIONS, json=body)).status == 200
    assert prefill.transfer_collisions == 1
    bootstrap = fleet_of(cluster).prefills[0].spec.bootstrap
    pull = {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
        "remote_bootstrap_addr": str(bootstrap), "remote_engine_id": engine,
    }  # fmt: skip
    first = completion(prompt="the first prompt", kv_transfer_params=pull)
    assert (await session.post(decode.api_url + COMPLETIONS, json=first)).status == 500
    second = completion(prompt="the second prompt", kv_transfer_params=pull)
    answer = await session.post(decode.api_url + COMPLETIONS, json=second)
    assert (await answer.json())["error"]["message"] == "Internal server error"  # as vLLM says
    assert answer.status == 500 and "did not arrive" in decode.pull_failures[-1]
    assert "belongs to another prompt" in decode.pull_failures[0]


# --- decode failures


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_error_with_no_retry_left_reaches_the_client_and_cancels_the_prefill(
    start_cluster: StartCluster, stream: bool
) -> None:
    cluster = await start_cluster(decode={"fail_status": 500}, prefill={"delay": 5}, max_retries=0)
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=stream))
        payload = await response.json()
    assert response.status == 502
    assert_openai_error(payload, 502)
    message = payload["error"]["message"]
    assert "failed before its first token" in message and "injected failure 500" in message
    await eventually(lambda: cluster.prefills[0].running == 0)
    assert len(cluster.prefills[0].aborted) == 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_kv_pull_is_tried_again_as_a_new_pair(
    start_cluster: StartCluster, path: str, stream: bool
) -> None:
    """vLLM fails a request whose KV pull failed: non-streamed a 500, streamed a 200 whose first
    event is an error (a chat's after its role chunk). No token reached the client: the pair is
    tried again with a new prefill leg and transfer_id, and the client sees one whole answer."""
    cluster = await start_cluster(decode={"fail_pulls": 1})
    body = chat(stream=stream) if path == CHAT else completion(stream=stream)
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(path, json=body)
        raw = await response.read()
    assert response.status == 200
    if stream:
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert sum(1 for e in events[:-1] if e["choices"][0].get("delta", {}).get("role")) <= 1
    else:
        assert "error" not in json.loads(raw)
    (decode,) = cluster.decodes
    assert decode.fail_pulls == 0 and len(cluster.prefills[0].requests) == 2
    transfers = {r.body["kv_transfer_params"]["transfer_id"] for r in decode.requests}
    assert len(transfers) == 2  # a new transfer_id, not the one that failed
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="kv_load") == 1
    assert sample(samples, "mooncake_proxy_retries_total", stage="decode") == 1


async def test_a_stream_is_held_until_its_first_token(start_cluster: StartCluster) -> None:
    """The client's headers wait for the first event that carries a token, not for the decode's
    200 and its role chunk (sent before the KV arrives): a pull that fails in between is
    tried again."""
    cluster = await start_cluster(decode={"fail_pulls": 2, "keepalive_first": True})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(CHAT, json=chat(stream=True))
        events = sse_events(await response.read())
    assert response.status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("error" not in e for e in events[:-1]) and len(cluster.decodes[0].requests) == 3


async def test_decode_refused_is_a_502_naming_the_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    # One request first, so the prefill leg finds a pooled connection and reaches the prefill
    # before the decode's refusal comes back (health checks have a pool of their own).
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    cluster.prefills[0].delay = 5
    dead = cluster.decodes[0].api_url
    await cluster.kill(cluster.decodes[0])
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        payload = await response.json()
    assert response.status == 502
    assert_openai_error(payload, 502)
    assert dead in payload["error"]["message"] and "decode" in payload["error"]["message"]
    # Said as it is: no "ssl:default" for a plain-http URL.
    assert "Connection refused" in payload["error"]["message"]
    assert "ssl" not in payload["error"]["message"]
    await eventually(lambda: cluster.prefills[0].running == 0)
    assert len(cluster.prefills[0].aborted) == 1


async def test_decode_dropping_mid_stream_ends_with_an_in_band_error(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decode={"break_after_tokens": 3})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        raw = await response.read()
    events = sse_events(raw)
    assert len([e for e in events if e != "[DONE]" and "choices" in e]) == 3
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)


async def test_decode_dropping_a_plain_body_is_not_passed_off_as_complete(
    start_cluster: StartCluster, aiohttp_server: AiohttpServer
) -> None:
    async def half_body(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b'{"partial": ')
        assert request.transport is not None
        request.transport.close()
        return response

    cluster = await start_cluster()
    app = web.Application()
    app.router.add_post(COMPLETIONS, half_body)
    server = await serve(aiohttp_server, app)
    fleet = cluster.client.app[mp.STATE_KEY].fleet
    fleet.decodes[0].routes = mp.route_urls(URL(f"http://127.0.0.1:{server.port}"))
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion())
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    # The proxy keeps serving.
    fleet.decodes[0].routes = mp.route_urls(URL(cluster.decodes[0].api_url))
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200


# --- the client going away


async def test_client_gone_mid_stream_aborts_the_decode(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(decode={"token_delay": 0.1})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(
            COMPLETIONS, json=completion(stream=True, max_tokens=100)
        )
        assert (await response.content.readany()).startswith(b"data: ")
        response.close()  # drops the socket
        await eventually(lambda: cluster.decodes[0].running == 0)
    assert len(cluster.decodes[0].aborted) == 1
    assert cluster.prefills[0].running == 0


async def raw_post(port: int, body: Any, path: str = COMPLETIONS) -> asyncio.StreamReader:
    """A POST over a plain socket; the reader sees the answer's raw bytes, framing included."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    raw_writers.append(writer)
    return reader


raw_writers: list[asyncio.StreamWriter] = []


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    data = b""
    async with asyncio.timeout(FAST):
        while marker not in data:
            chunk = await reader.read(65536)
            assert chunk, f"connection closed before {marker!r}: {data!r}"
            data += chunk
    return data


def close_raw() -> None:
    while raw_writers:
        raw_writers.pop().close()


CANCEL_HANDLERS = pytest.mark.parametrize(
    "cancel_handlers", [True, False], ids=["cancelled", "found-on-write"]
)


@CANCEL_HANDLERS
async def test_a_client_closing_right_after_done_had_its_whole_answer(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, cancel_handlers: bool
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy")
    cluster = await start_cluster(
        decode={"linger_after_done": 0.3}, cancel_handlers=cancel_handlers
    )
    reader = await raw_post(cluster.port, completion(stream=True))
    await read_until(reader, b"data: [DONE]")
    close_raw()  # the client leaves before the decode ends its stream
    await eventually(lambda: bool(access_lines(caplog)))
    (line,) = access_lines(caplog)
    assert line["status"] == 200 and line["outcome"] in ("ok", "client_gone")
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_requests_total", route=COMPLETIONS, status="500") == 0
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="broken") == 0


@CANCEL_HANDLERS
async def test_a_client_gone_mid_stream_is_not_blamed_on_the_decode(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, cancel_handlers: bool
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy")
    cluster = await start_cluster(decode={"token_delay": 0.1}, cancel_handlers=cancel_handlers)
    reader = await raw_post(cluster.port, completion(stream=True, max_tokens=50))
    await read_until(reader, b"data: {")
    close_raw()
    await eventually(lambda: bool(access_lines(caplog)))
    (line,) = access_lines(caplog)
    assert line["outcome"] == "client_gone"
    await eventually(lambda: cluster.decodes[0].running == 0)
    assert len(cluster.decodes[0].aborted) == 1
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_errors_total", stage="client", reason="client_gone") == 1
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="broken") == 0


async def test_client_gone_before_any_byte_aborts_both_legs(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(prefill={"delay": 10})
    request = asyncio.create_task(cluster.client.post(COMPLETIONS, json=completion(stream=True)))
    await eventually(lambda: cluster.prefills[0].running == 1 and cluster.decodes[0].running == 1)
    request.cancel()
    await eventually(lambda: cluster.prefills[0].running == 0 and cluster.decodes[0].running == 0)
    assert len(cluster.prefills[0].aborted) == 1 and len(cluster.decodes[0].aborted) == 1


# --- bad input


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [
        (b"", "application/json"),
        (b"not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'"text"', "application/json"),
        (b"null", "application/json"),
        (b'{"prompt": NaN}', "application/json"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),
        (b'{"prompt": "' + "\u00e9".encode("latin-1") + b'"}', "application/json"),
        (b'{"prompt": "\xff\xfe\xfd"}', "application/json"),
        (b'{"n": ' + b"9" * 5000 + b"}", "application/json"),
        (b"x=1&y=2", "application/x-www-form-urlencoded"),
    ],
)
async def test_malformed_bodies_get_a_400_and_the_proxy_keeps_serving(
    start_cluster: StartCluster, raw: bytes, content_type: str
) -> None:
    cluster = await start_cluster()
    for path in (COMPLETIONS, CHAT):
        response = await cluster.client.post(path, data=raw, headers={"Content-Type": content_type})
        assert response.status == 400
        assert_openai_error(await response.json(), 400)
    assert not cluster.prefills[0].requests and not cluster.decodes[0].requests
    good = await cluster.client.post(COMPLETIONS, json=completion())
    assert good.status == 200


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


async def raw_exchange(
    port: int, *parts: bytes, pause: float = 0.0, seconds: float = FAST
) -> RawAnswer:
    """Send bytes over a plain socket (``pause`` s between parts) while reading the answer,
    until the proxy closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(pause)

    sending = asyncio.create_task(send())
    raw = b""
    try:
        async with asyncio.timeout(seconds):
            # To EOF: the proxy must close the connection. A part sent after it closed draws a
            # reset, which may come before its FIN is read: the answer already read stands.
            while chunk := await reader.read(65536):
                raw += chunk
    except ConnectionResetError:
        if not raw:
            raise
    finally:
        sending.cancel()
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return RawAnswer(int(status_line.split()[1]), headers, body)


def request_head(path: str = COMPLETIONS, *extra: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: proxy", "Content-Type: application/json", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


SECRET_MARKER = "client-bytes-never-echoed"


@pytest.mark.parametrize(
    ("raw", "status", "reason"),
    [
        (
            request_head(COMPLETIONS, f"X-Request-Id: {SECRET_MARKER}{'a' * 9000}"),
            431,
            "header_too_long",
        ),
        (
            request_head(COMPLETIONS, *(f"X-{i}: {SECRET_MARKER}" for i in range(200))),
            431,
            "too_many_headers",
        ),
        (
            request_head(COMPLETIONS, f"X-A: {SECRET_MARKER}").replace(b"\r\n", b"\n"),
            400,
            "bad_request_line",
        ),
        (request_head(COMPLETIONS, f"X-A: {SECRET_MARKER}\x00"), 400, "bad_header"),
        (request_head(COMPLETIONS, "X-A: a", f"  {SECRET_MARKER}"), 400, "bad_header"),
        (f"G@T /{SECRET_MARKER} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), 400, "bad_method"),
        (
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + SECRET_MARKER.encode(),
            400,
            "bad_method",
        ),
    ],
    ids=["long-header", "many-headers", "bare-lf", "nul", "folded", "method", "tls"],
)
async def test_malformed_http_gets_the_proxys_own_answer_and_one_line(
    start_cluster: StartCluster,
    caplog: pytest.LogCaptureFixture,
    raw: bytes,
    status: int,
    reason: str,
) -> None:
    caplog.set_level("DEBUG")
    cluster = await start_cluster()
    answer = await raw_exchange(cluster.port, raw)
    assert answer.status == status
    assert answer.headers["Content-Type"].startswith("application/json")
    assert_openai_error(json.loads(answer.body), status)
    assert SECRET_MARKER.encode() not in answer.body
    lines = [r for r in caplog.records if r.name.startswith(("aiohttp", "mooncake_proxy"))]
    assert not [r for r in lines if r.levelno >= logging.WARNING or r.exc_info]
    assert not [r for r in lines if SECRET_MARKER in r.getMessage()]
    (access,) = access_lines(caplog)
    assert access["status"] == status and access["outcome"] == f"error:{reason}"
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_requests_total", route="unparsed", status=str(status))
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200


async def test_a_request_head_that_trickles_in_gets_408_and_the_connection_closes(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy")
    cluster = await start_cluster(header_timeout=0.5)
    port = cluster.port
    started = time.monotonic()
    head = request_head(length=10)
    trickle = [head[i : i + 1] for i in range(len(head))]  # slowloris: a byte every 0.1 s
    answer = await raw_exchange(port, *trickle, pause=0.1)
    assert answer.status == 408 and 0.4 < time.monotonic() - started < FAST
    assert "--header-timeout" in json.loads(answer.body)["error"]["message"]
    # A connection that never sends anything is closed the same way.
    assert (await raw_exchange(port)).status == 408
    assert [line["outcome"] for line in access_lines(caplog)] == ["error:header_timeout"] * 2
    assert not cluster.prefills[0].requests and not cluster.decodes[0].requests


async def test_keep_alive_idle_is_not_a_slow_head(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(header_timeout=0.3)
    body = json.dumps(completion()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.port)
    try:
        for _ in range(2):
            writer.write(request_head(length=len(body)) + body)
            head = await read_until(reader, b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
            rest = head.partition(b"\r\n\r\n")[2]
            await reader.readexactly(length - len(rest))
            await asyncio.sleep(0.6)  # idle between requests, longer than --header-timeout
    finally:
        writer.close()


async def test_a_body_that_trickles_in_gets_408_and_holds_no_backend_slot(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(body_timeout=0.5, body_min_rate=1000, max_connections=2)
    port = cluster.port
    body = json.dumps(completion(prompt="x" * 500)).encode()
    slow = asyncio.create_task(
        raw_exchange(
            port,
            request_head(length=len(body)),
            *(body[i : i + 10] for i in range(0, len(body), 10)),
            pause=0.1,
        )
    )
    await asyncio.sleep(0.2)
    # The upstream cap is 2, one PD request's worth: the trickling client holds none of it.
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    answer = await slow
    assert answer.status == 408
    message = json.loads(answer.body)["error"]["message"]
    assert "--body-timeout" in message and "--body-min-rate" in message
    assert len(cluster.prefills[0].requests) == 1  # the good request only


async def test_a_big_body_at_a_sane_rate_earns_the_time_it_needs(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        body_timeout=0.3, body_min_rate=50_000, prefill=LONG_CONTEXT, decode=LONG_CONTEXT
    )
    body = json.dumps(completion(prompt="y" * 60_000)).encode()
    parts = [body[i : i + 10_000] for i in range(0, len(body), 10_000)]
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.port)
    try:
        writer.write(request_head(length=len(body)))
        for part in parts:  # 10 kB every 0.1 s: 100 kB/s, twice the minimum rate, for 0.7 s
            writer.write(part)
            await asyncio.sleep(0.1)
        assert (await read_until(reader, b"\r\n")).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


async def test_open_client_connections_are_capped(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="mooncake_proxy")
    cluster = await start_cluster(max_client_connections=3, header_timeout=5)
    port = cluster.port
    connections = cluster.client.app[mp.STATE_KEY].connections
    # The test client's own keep-alive connection may be one of the three.
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3 - connections.open)]
    await eventually(lambda: connections.open == 3)
    answer = await raw_exchange(port, request_head(length=2) + b"{}")
    assert answer.status == 503 and answer.headers["Retry-After"] == "1"
    assert "--max-client-connections" in json.loads(answer.body)["error"]["message"]
    assert len([r for r in caplog.records if "--max-client-connections" in r.getMessage()]) == 1
    idle.pop()[1].close()
    await eventually(lambda: connections.open == 2)
    body = json.dumps(completion()).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_head(length=len(body)) + body)
    assert (await read_until(reader, b"\r\n")).startswith(b"HTTP/1.1 200")
    writer.close()
    for _, other in idle:
        other.close()
    assert connections.rejected == 1
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_client_connections_rejected_total") == 1


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_a_body_not_declared_json_gets_vllms_400_and_no_leg(
    start_cluster: StartCluster, content_type: str | None
) -> None:
    # vLLM 0.32 answers these 400 before reading the body (seen on the real server).
    cluster = await start_cluster()
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session:
        url = cluster.client.make_url(COMPLETIONS)
        data = json.dumps(completion()).encode()
        async with session.post(url, data=data, headers=headers) as response:
            assert response.status == 400
            payload = await response.json()
    assert_openai_error(payload, 400)
    assert "Only 'application/json' is allowed" in payload["error"]["message"]
    assert not cluster.prefills[0].requests and not cluster.decodes[0].requests
    for declared in ("application/json; charset=utf-8", "Application/JSON"):
        served = await cluster.client.post(
            COMPLETIONS, data=json.dumps(completion()), headers={"Content-Type": declared}
        )
        assert served.status == 200, declared


async def test_oversized_body_is_a_413(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(max_request_bytes=10_000)
    big = completion(prompt="x" * 20_000)
    response = await cluster.client.post(COMPLETIONS, json=big)
    assert response.status == 413
    assert_openai_error(await response.json(), 413)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: caught while reading
        data = json.dumps(big).encode()
        for start in range(0, len(data), 4096):
            yield data[start : start + 4096]

    chunked = await cluster.client.post(COMPLETIONS, data=chunks(), headers=JSON_TYPE)
    assert chunked.status == 413
    assert_openai_error(await chunked.json(), 413)
    assert (
        await cluster.client.post(COMPLETIONS, json=completion(prompt="x" * 9000))
    ).status == 200


async def test_a_big_prompt_is_passed_on_whole(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(prefill=LONG_CONTEXT, decode=LONG_CONTEXT)
    prompt = "word " * 200_000  # 1 MB
    async with asyncio.timeout(FAST * 3):
        response = await cluster.client.post(COMPLETIONS, json=completion(prompt=prompt))
    assert response.status == 200
    assert cluster.prefills[0].requests[0].body["prompt"] == prompt
    assert cluster.decodes[0].requests[0].body["prompt"] == prompt

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read as it comes
        data = json.dumps(completion(prompt=prompt, max_tokens=3)).encode()
        for start in range(0, len(data), 65536):
            yield data[start : start + 65536]

    async with asyncio.timeout(FAST * 3):
        chunked = await cluster.client.post(COMPLETIONS, data=chunks(), headers=JSON_TYPE)
    assert chunked.status == 200
    assert cluster.decodes[0].requests[1].body == {
        **completion(prompt=prompt, max_tokens=3),
        "kv_transfer_params": cluster.decodes[0].requests[1].body["kv_transfer_params"],
    }


# --- admission: --max-in-flight, its queue and its priorities


async def test_past_max_in_flight_requests_wait_lowest_priority_value_first(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(max_in_flight=1, decode={"token_delay": 0.2})
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    first = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=5))
    )
    await eventually(lambda: decode.running == 1)
    admission = cluster.client.app[mp.STATE_KEY].admission
    waiting = []
    for tag, headers, extra in (
        ("later", {"X-Vllm-Priority": "3"}, {}),
        ("first", {"X-Vllm-Priority": "-1"}, {}),
        ("second", {}, {"priority": 1}),
    ):
        body = completion(prompt=tag, **extra)
        waiting.append(
            asyncio.create_task(cluster.client.post(COMPLETIONS, json=body, headers=headers))
        )
        await eventually(lambda: admission.queued == len(waiting))  # in this order of arrival
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_admission_queue") == 3
    assert len(prefill.requests) == 1  # only the first one reached an engine
    assert (await (await first).read()).endswith(b"data: [DONE]\n\n")
    for answer in await asyncio.gather(*waiting):
        assert answer.status == 200
    order = [r.body["prompt"] for r in prefill.requests[1:]]
    assert order == ["first", "second", "later"]
    # Priorities reach both legs as the client gave them.
    legs = {r.body["prompt"]: r for r in decode.requests[1:]}
    assert legs["first"].headers["X-Vllm-Priority"] == "-1" and legs["second"].body["priority"] == 1
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_admission_wait_seconds_count") == 4
    assert sample(samples, "mooncake_proxy_admission_queue") == 0


async def test_a_full_or_slow_queue_is_answered_429_with_retry_after(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        max_in_flight=1, max_queue=1, queue_timeout=0.3, decode={"token_delay": 0.2}
    )
    running = asyncio.create_task(
        cluster.client.post(COMPLETIONS, json=completion(stream=True, max_tokens=5))
    )
    await eventually(lambda: cluster.decodes[0].running == 1)
    queued = asyncio.create_task(cluster.client.post(COMPLETIONS, json=completion()))
    await eventually(lambda: cluster.client.app[mp.STATE_KEY].admission.queued == 1)
    full = await cluster.client.post(COMPLETIONS, json=completion())
    slow = await queued
    for answer, why in ((full, "--max-queue"), (slow, "waited 0.3 s")):
        assert answer.status == 429 and answer.headers["Retry-After"] == "1"
        payload = await answer.json()
        assert_openai_error(payload, 429)
        assert why in payload["error"]["message"]
    assert (await (await running).read()).endswith(b"data: [DONE]\n\n")
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200  # none lost
    samples = await scrape(cluster)
    for reason in ("queue_full", "queue_timeout"):
        assert sample(samples, "mooncake_proxy_errors_total", stage="admission", reason=reason) == 1
    assert sample(samples, "mooncake_proxy_requests_total", route=COMPLETIONS, status="429") == 2


async def test_a_failed_kv_pull_is_tried_again_on_another_pair_where_there_is_one(
    start_cluster: StartCluster,
) -> None:
    """A decode whose pulls keep failing (its transfer engine broken) stays in the rotation,
    as a failed KV load proves nothing down; but the retry goes to the other decode, so three
    failing pulls in a row cost no request."""
    cluster = await start_cluster(decodes=2, decode_policy=mp.Policy.ROUND_ROBIN)
    broken, other = cluster.decodes
    broken.fail_pulls = 3
    for _ in range(2):
        async with asyncio.timeout(FAST):
            answer = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
            assert answer.status == 200 and b"error" not in await answer.read()
    assert broken.fail_pulls == 3 - len(broken.requests) and len(broken.requests) <= 2
    assert len(other.requests) == 2  # each request's retry, or the request itself
    assert all(d.usable for d in fleet_of(cluster).decodes)


async def test_a_decode_lost_as_it_writes_a_whole_answer_is_tried_again(
    start_cluster: StartCluster,
) -> None:
    """A non-streamed answer's head came, then the decode's connection went (killed as it
    wrote): nothing reached the client, so the pair starts again on the other decode."""
    cluster = await start_cluster(decodes=2, decode_policy=mp.Policy.ROUND_ROBIN)
    dying, other = cluster.decodes
    dying.die_after_head = True
    async with asyncio.timeout(FAST):
        answer = await cluster.client.post(COMPLETIONS, json=completion())
        payload = await answer.json()
    assert answer.status == 200 and "error" not in payload, payload
    assert len(dying.requests) == 1 and len(other.requests) == 1
    assert len(cluster.prefills[0].requests) == 2  # a new pair: a new prefill leg
