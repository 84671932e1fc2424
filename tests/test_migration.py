"""A stream whose decode fails after its first token goes on from the tokens the client has,
on another pair (migration): the client sees one stream, token for token the uninterrupted
one. The fakes generate as a function of the prompt's token ids, so a continuation from the
prompt and the tokens sent gives the rest exactly, as greedy vLLM does (PROTOCOL.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import mooncake_proxy as mp
from fake_vllm import Generation, generate, prompt_of
from testing_support import (
    CHAT,
    COMPLETIONS,
    FAST,
    KV_TIMEOUT,
    Cluster,
    StartCluster,
    assert_openai_error,
    chat,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
    sse_events,
)

PATHS = [COMPLETIONS, CHAT]


def request_body(path: str, **extra: Any) -> dict[str, Any]:
    return chat(**extra) if path == CHAT else completion(**extra)


async def cut_stream(start_cluster: StartCluster, fault: dict[str, Any], **config: Any) -> Cluster:
    """Two decodes, the first of which the first request goes to, faulty for one stream."""
    return await start_cluster(
        decodes=2,
        each_decode=({**fault, "faults_left": 1}, {}),
        decode_policy=mp.Policy.ROUND_ROBIN,
        **config,
    )


async def stream_of(cluster: Cluster, path: str, body: dict[str, Any]) -> list[Any]:
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(path, json=body)
        assert response.status == 200, await response.text()
        return sse_events(await response.read())


def text_of(path: str, events: list[Any]) -> str:
    parts = []
    for event in events:
        if event != "[DONE]" and event.get("choices"):
            choice = event["choices"][0]
            parts.append(choice["delta"].get("content", "") if path == CHAT else choice["text"])
    return "".join(parts)


def assert_one_stream(events: list[Any]) -> None:
    """One id and one created throughout, no error, one [DONE] at the end."""
    chunks = [e for e in events if e != "[DONE]"]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert not any("error" in chunk for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert len({chunk["created"] for chunk in chunks}) == 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("usage", [False, True])
async def test_a_stream_whose_decode_is_lost_goes_on_token_for_token(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture, path: str, usage: bool
) -> None:
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 5})
    body = request_body(path, stream=True, max_tokens=16, ignore_eos=True)
    if usage:
        body["stream_options"] = {"include_usage": True}
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    expected = generate(prompt_of(path, body), body)
    assert text_of(path, events) == expected.text
    chunks = [e for e in events if e != "[DONE]"]
    object_kind = "chat.completion.chunk" if path == CHAT else "text_completion"
    assert {chunk["object"] for chunk in chunks} == {object_kind}
    # The client did not ask for token ids: none reach it, as from vLLM unasked.
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None
    if usage:
        (last,) = [chunk for chunk in chunks if chunk.get("usage")]
        assert last["usage"]["completion_tokens"] == len(expected.token_ids)
        assert last["usage"]["prompt_tokens"] == expected.prompt_tokens
    # The continuation: a completion of the prompt's ids and the 5 tokens sent, on the other
    # decode, with 11 tokens left.
    (continued,) = cluster.decodes[1].requests
    assert continued.path == COMPLETIONS
    assert continued.body["prompt"] == expected.prompt_token_ids + expected.token_ids[:5]
    assert continued.body["max_tokens"] == 11 and continued.body["return_token_ids"] is True
    assert "messages" not in continued.body and continued.body["stream"] is True
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="broken") == 1
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="broken") == 1
    # Its connection went: the lost decode left the rotation (checked again at once, it came
    # back: the fake lives on).
    assert "left the rotation" in caplog.text


@pytest.mark.parametrize("path", PATHS)
async def test_an_error_sent_mid_stream_goes_on_elsewhere(
    start_cluster: StartCluster, path: str
) -> None:
    """vLLM ends a stream whose engine failed with an error event: it is withheld, and the
    stream goes on; the decode that said so stays in the rotation (only this request avoids
    it)."""
    cluster = await cut_stream(start_cluster, {"error_after_tokens": 3})
    body = request_body(path, stream=True, max_tokens=10, ignore_eos=True)
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    assert text_of(path, events) == generate(prompt_of(path, body), body).text
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="in_band") == 1
    assert fleet_of(cluster).decodes[0].usable
    assert len(cluster.decodes[1].requests) == 1


async def test_token_ids_the_client_asked_for_are_the_whole_answers(
    start_cluster: StartCluster,
) -> None:
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 4})
    body = completion(stream=True, max_tokens=12, ignore_eos=True, return_token_ids=True)
    events = await stream_of(cluster, COMPLETIONS, body)
    assert_one_stream(events)
    expected = generate(prompt_of(COMPLETIONS, body), body)
    chunks = [e for e in events if e != "[DONE]" and e["choices"]]
    ids = [i for chunk in chunks for i in chunk["choices"][0]["token_ids"]]
    assert ids == expected.token_ids
    # The prompt's ids once, in the first chunk, as vLLM sends them.
    prompts = [c["choices"][0]["prompt_token_ids"] for c in chunks]
    assert prompts[0] == expected.prompt_token_ids and not any(prompts[1:])


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"logprobs": 0}, "it asks for logprobs"),
        ({"guided_regex": "[a-z ]+"}, "it asks for guided_regex"),
        ({"n": 2, "temperature": 1.0}, "it goes to a decode alone"),
        ({"migration_limit": 0}, "--migration-limit is 0"),
    ],
)
async def test_a_stream_that_cannot_go_on_ends_saying_why(
    start_cluster: StartCluster, extra: dict[str, Any], why: str
) -> None:
    extra = dict(extra)  # the parameters are shared by both loops' runs
    limit = extra.pop("migration_limit", 3)
    cluster = await start_cluster(
        decodes=2, decode={"break_after_tokens": 3}, migration_limit=limit
    )
    events = await stream_of(cluster, COMPLETIONS, completion(stream=True, **extra))
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    assert f"not continued elsewhere: {why}" in events[-2]["error"]["message"]
    assert sum(len(decode.requests) for decode in cluster.decodes) == 1


async def test_migrations_stop_at_the_limit(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(
        decodes=3, decode={"break_after_tokens": 2}, migration_limit=2, health_interval=60
    )
    body = completion(stream=True, max_tokens=16, ignore_eos=True)
    events = await stream_of(cluster, COMPLETIONS, body)
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    assert "--migration-limit 2 reached" in events[-2]["error"]["message"]
    # Each decode cut its part after 2 tokens; what the client got is the answer's beginning,
    # nothing repeated (each continuation went on from the last token that ended a character).
    expected = generate(prompt_of(COMPLETIONS, body), body)
    text = text_of(COMPLETIONS, events[:-2])
    assert text and expected.text.startswith(text)
    assert [len(decode.requests) for decode in cluster.decodes] == [1, 1, 1]


async def test_a_continuation_whose_kv_pull_fails_is_tried_again(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"break_after_tokens": 3, "faults_left": 1}, {"fail_pulls": 1}),
        decode_policy=mp.Policy.ROUND_ROBIN,
    )
    body = chat(stream=True, max_tokens=9, ignore_eos=True)
    events = await stream_of(cluster, CHAT, body)
    assert_one_stream(events)
    assert text_of(CHAT, events) == generate(prompt_of(CHAT, body), body).text
    # The continuation's first try failed its pull; it was tried again, on either decode.
    continuations = [r for d in cluster.decodes for r in d.requests if r.path == COMPLETIONS]
    assert len(continuations) == 2 and cluster.decodes[1].fail_pulls == 0
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="kv_load") == 1


async def test_an_uninterrupted_stream_reaches_the_client_as_vllm_sends_it_unasked(
    start_cluster: StartCluster,
) -> None:
    """The decode is asked for token ids; the client gets the bytes vLLM writes without them."""
    cluster = await start_cluster()
    for path in PATHS:
        body = request_body(path, stream=True, stream_options={"include_usage": True})
        async with asyncio.timeout(FAST):
            response = await cluster.client.post(path, json=body)
            raw = await response.read()
        (decode,) = cluster.decodes
        request_id = response.headers["X-Request-Id"]
        assert decode.requests[-1].body["return_token_ids"] is True
        assert raw == decode.sent_without_token_ids(request_id)
        assert b'"token_ids":[' in bytes(decode.sent[request_id])


async def test_a_stream_whose_prefill_was_lost_after_a_token_still_goes_on(
    start_cluster: StartCluster,
) -> None:
    """A prefill leg lost once its decode streamed is no cause of what befalls the decode
    later: the decode lost too, the stream goes on elsewhere, and does not end with the
    prefill's error."""
    cluster = await cut_stream(
        start_cluster, {"break_after_tokens": 5},
        prefill={"drop_after_pull": 0.25}, decode={"token_delay": 0.1},
    )  # fmt: skip
    body = completion(stream=True, max_tokens=10, ignore_eos=True)
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=body)
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")
        await eventually(lambda: cluster.prefills[0].dropped == 1)
        assert cluster.decodes[0].running == 1  # the prefill was lost while it streamed
        events = sse_events(first + await response.read())
    assert_one_stream(events)
    assert text_of(COMPLETIONS, events) == generate(prompt_of(COMPLETIONS, body), body).text
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="broken") == 1


async def test_a_client_gone_mid_stream_is_not_migrated(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(decodes=2, decode={"token_delay": 0.05})
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(
            COMPLETIONS, json=completion(stream=True, max_tokens=50)
        )
        await response.content.readline()
        response.close()
    await eventually(lambda: sum(decode.running for decode in cluster.decodes) == 0)
    assert sum(len(decode.requests) for decode in cluster.decodes) == 1
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="broken") == 0


@pytest.mark.parametrize("path", PATHS)
async def test_a_stream_cut_after_its_last_token_gets_its_end(
    start_cluster: StartCluster, path: str
) -> None:
    """Cut between its finish_reason and [DONE]: nothing is left to generate; the proxy sends
    the usage it asked for, counting the whole answer, and [DONE]."""
    cluster = await start_cluster(decodes=2, decode={"break_after_tokens": 6})
    body = request_body(path, stream=True, max_tokens=6, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    expected = generate(prompt_of(path, body), body)
    assert text_of(path, events) == expected.text
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == expected.prompt_tokens
    assert usage["total_tokens"] == 6 + expected.prompt_tokens
    assert sum(len(decode.requests) for decode in cluster.decodes) == 1


@pytest.mark.parametrize("path", PATHS)
async def test_events_cut_anywhere_between_reads_go_on_exactly(
    start_cluster: StartCluster, path: str
) -> None:
    """The decode's bytes arrive in pieces that split events (as TCP may): the client gets
    whole events only, as vLLM writes them, and a cut goes on from the last whole one."""
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 4, "fragment_bytes": 7})
    for fake in cluster.decodes:
        fake.fragment_bytes = 7
    body = request_body(path, stream=True, max_tokens=9, ignore_eos=True)
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    assert text_of(path, events) == generate(prompt_of(path, body), body).text
    # An uninterrupted one, in pieces too, is byte for byte what vLLM sends unasked.
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(path, json=body)
        raw = await response.read()
    (decode,) = [fake for fake in cluster.decodes if response.headers["X-Request-Id"] in fake.sent]
    assert raw == decode.sent_without_token_ids(response.headers["X-Request-Id"])


async def test_a_stream_whose_token_ids_are_withheld_is_not_moved(
    start_cluster: StartCluster,
) -> None:
    """vLLM hides the token ids of a chat whose reasoning its parser hides (its deltas say
    "reasoning": null): going on without them would repeat the answer, and as a completion
    would not be parsed, so the stream ends saying why."""
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 3, "hide_token_ids": True})
    events = await stream_of(cluster, CHAT, chat(stream=True, max_tokens=8))
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    assert "reasoning parser" in events[-2]["error"]["message"]
    assert len(cluster.decodes[1].requests) == 0


# --- what clients really send: no cap, and the bounds on a request's tries and wait


def uncapped(path: str, **extra: Any) -> dict[str, Any]:
    body = request_body(path, stream=True, **extra)
    del body["max_tokens"]
    return body


async def test_a_completion_without_a_cap_goes_on_to_vllms_default(
    start_cluster: StartCluster,
) -> None:
    """vLLM caps a completion that names no max_tokens at 16: a continuation, itself a
    completion, must be told what is left of those, not take 16 more."""
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 6})
    body = uncapped(COMPLETIONS, ignore_eos=True)
    events = await stream_of(cluster, COMPLETIONS, body)
    assert_one_stream(events)
    expected = generate(prompt_of(COMPLETIONS, body), body)
    assert len(expected.token_ids) == 16
    assert text_of(COMPLETIONS, events) == expected.text
    (continued,) = cluster.decodes[1].requests
    assert continued.body["max_tokens"] == 10


async def test_a_continuation_whose_tries_run_out_ends_in_band(
    start_cluster: StartCluster,
) -> None:
    """The continuation's decode fails before its first token and no try is left: the client's
    stream ends with an in-band error and [DONE], not with a second HTTP response written
    into its chunked body."""
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"break_after_tokens": 4}, {"fail_status": 500}),
        decode_policy=mp.Policy.ROUND_ROBIN,
        max_retries=0,
    )
    body = completion(stream=True, max_tokens=12, ignore_eos=True)
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=body)
        assert response.status == 200
        raw = await response.read()
    assert b"HTTP/1.1" not in raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert_openai_error(events[-2], 502)
    assert "failed before its first token" in events[-2]["error"]["message"]
    expected = generate(prompt_of(COMPLETIONS, body), body)
    assert text_of(COMPLETIONS, events[:-2]) == "".join(expected.deltas[:4])


async def test_a_chat_with_an_image_is_not_moved(start_cluster: StartCluster) -> None:
    """A continuation is a completion of token ids: an image in the chat would not be seen by
    it (its placeholder tokens would), so the stream ends saying why instead of going on
    blind."""
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 3})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "What is in it?"}, image]
    body = chat(stream=True, messages=[{"role": "user", "content": content}])
    events = await stream_of(cluster, CHAT, body)
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    assert "content part of type 'image_url'" in events[-2]["error"]["message"]
    assert len(cluster.decodes[1].requests) == 0


async def test_a_stream_whose_first_token_never_comes_ends_at_its_deadline(
    start_cluster: StartCluster,
) -> None:
    """A decode that sends its head and then nothing (its KV never comes) holds the client no
    longer than --first-token-timeout: a 504 saying so, every claim let go."""
    cluster = await start_cluster(decode={"pull_delay": 1000.0}, first_token_timeout=0.5)
    started = asyncio.get_running_loop().time()
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion(stream=True))
        payload = await response.json()
    assert response.status == 504
    assert_openai_error(payload, 504)
    assert "no first token within 0.5 s" in payload["error"]["message"]
    assert asyncio.get_running_loop().time() - started < 0.5 + FAST / 2
    fleet = fleet_of(cluster)
    await eventually(lambda: cluster.decodes[0].running == 0)
    assert fleet.decodes[0].in_flight == 0
    assert all(engine.in_flight == 0 for p in fleet.prefills for engine in p.engines)
    samples = await scrape(cluster)
    errors = sample(
        samples, "mooncake_proxy_errors_total", stage="request", reason="first_token_timeout"
    )
    assert errors == 1


async def test_a_continuation_whose_first_token_never_comes_ends_in_band(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        decodes=2,
        each_decode=({"break_after_tokens": 3}, {"pull_delay": 1000.0}),
        decode_policy=mp.Policy.ROUND_ROBIN,
        first_token_timeout=0.5,
    )
    events = await stream_of(cluster, COMPLETIONS, completion(stream=True, ignore_eos=True))
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 504)
    assert "no first token within 0.5 s" in events[-2]["error"]["message"]
    assert len([e for e in events[:-2] if e["choices"]]) == 3


async def test_retries_and_continuations_share_one_budget(start_cluster: StartCluster) -> None:
    """A request's tries are one budget (--max-retries) over its stream's continuations too: a
    continuation does not start afresh with every retry, so a request tries at most 1 +
    --max-retries + --migration-limit pairs."""
    cluster = await start_cluster(
        decodes=4,
        each_decode=(
            {"break_after_tokens": 3},
            {"fail_status": 500},
            {"break_after_tokens": 3},
            {"fail_status": 500},
        ),
        decode_policy=mp.Policy.ROUND_ROBIN,
        max_retries=1,
        health_interval=60,
    )
    events = await stream_of(cluster, COMPLETIONS, completion(stream=True, max_tokens=16))
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    legs = [len(decode.requests) for decode in cluster.decodes]
    # The first cut goes on on the second decode, which fails: its retry (the one the
    # budget holds) on the third, which is cut in turn; its continuation fails on the fourth
    # with nothing left to try. Afresh at each continuation, it would be tried again.
    assert legs == [1, 1, 1, 1], legs
    assert "4 attempts failed" in events[-2]["error"]["message"]


# --- nothing leaks


async def test_after_a_burst_of_faults_every_claim_slot_and_leg_is_let_go(
    start_cluster: StartCluster,
) -> None:
    """Streams cut and continued, continuations whose pulls fail, errors in band, first tokens
    that never come, clients that leave mid-stream, whole answers among them: once all have
    ended, no instance or engine is counted busy, no upstream slot or admission place is held,
    no leg is open but those idle in the pool, and vLLM is running nothing."""
    cluster = await start_cluster(
        prefill_dp=(2,),
        decodes=5,
        each_decode=(
            {"break_after_tokens": 3},
            {"error_after_tokens": 2},
            {"fail_pulls": 4},
            {"pull_delay": 1000.0},
            {"token_delay": 0.01},
        ),
        decode_policy=mp.Policy.ROUND_ROBIN,
        max_connections=100,
        max_in_flight=16,
        first_token_timeout=1.0,
        request_timeout=3.0,  # a whole answer's wait: its first token is its last
        health_interval=60,
    )

    async def one(index: int) -> None:
        path = PATHS[index % 2]
        body = request_body(path, stream=index % 5 != 4, max_tokens=12, ignore_eos=True)
        body["messages" if path == CHAT else "prompt"] = (
            [{"role": "user", "content": f"question {index}"}]
            if path == CHAT
            else f"prompt {index}"
        )
        async with asyncio.timeout(KV_TIMEOUT):
            response = await cluster.client.post(path, json=body)
            if index % 3 == 0 and response.status == 200 and body["stream"]:
                await response.content.readuntil(b"\n\n")
                response.close()  # the client leaves mid-stream
                return
            await response.read()

    await asyncio.gather(*(one(index) for index in range(30)))
    state = cluster.client.app[mp.STATE_KEY]
    fleet = state.fleet

    def let_go() -> bool:
        claims = [b.in_flight for b in (*fleet.prefills, *fleet.decodes)]
        claims += [engine.in_flight for p in fleet.prefills for engine in p.engines]
        held = (state.slots.in_use, state.admission.running, state.admission.queued)
        running = [fake.running for fake in (*cluster.prefills, *cluster.decodes)]
        return not any(claims) and held == (0, 0, 0) and not any(running)

    await eventually(let_go, KV_TIMEOUT)
    await eventually(lambda: state.upstreams.busy == 0 and not state.lingering)
    samples = await scrape(cluster)
    gauges = [
        value
        for (name, _), value in samples.items()
        if name in ("mooncake_proxy_decode_in_flight", "mooncake_proxy_prefill_in_flight")
    ]
    assert gauges and not any(gauges)
    assert sample(samples, "mooncake_proxy_migrations_total", reason="broken") >= 1


# --- stop strings, split characters, merged chunks, parsers: as vLLM streams them


def prompt_where(
    path: str, body: dict[str, Any], wanted: Callable[[Generation], int | None]
) -> tuple[dict[str, Any], Generation, int]:
    """``body`` with the first prompt of a numbered few whose answer ``wanted`` finds a place
    in (a token position it returns): the fakes' answers are a function of the prompt."""
    for number in range(200):
        text = f"Tell me about KV caches, take {number}"
        if path == CHAT:
            body = {**body, "messages": [{"role": "user", "content": text}]}
        else:
            body = {**body, "prompt": text}
        answer = generate(prompt_of(path, body), body)
        if (place := wanted(answer)) is not None:
            return body, answer, place
    raise AssertionError("no prompt has what the test needs")


def inside_a_character(answer: Generation) -> int | None:
    """A cut right after a token that ends inside a character (its step sent no text), with
    whole characters before it."""
    for position in range(2, len(answer.deltas) - 2):
        if answer.deltas[position] == "" and answer.deltas[position - 1]:
            return position + 1
    return None


@pytest.mark.parametrize("path", PATHS)
async def test_a_chat_or_completion_cut_inside_a_character_goes_on_from_the_last_whole_one(
    start_cluster: StartCluster, path: str
) -> None:
    """The cut comes after a token that began a character: the continuation goes on from the
    last token that ended one (vLLM continuing from inside one sends its whole prompt's text
    first), and a client that asked for token ids gets each once."""
    body = request_body(path, stream=True, max_tokens=16, return_token_ids=True)
    body, expected, cut = prompt_where(path, body, inside_a_character)
    cluster = await cut_stream(start_cluster, {"break_after_tokens": cut})
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    assert text_of(path, events) == expected.text
    ids = [i for e in events[:-1] for c in e["choices"] for i in c.get("token_ids") or ()]
    assert ids == expected.token_ids
    (continued,) = cluster.decodes[1].requests
    assert continued.body["prompt"] == expected.prompt_token_ids + expected.token_ids[: cut - 1]


async def test_a_chat_without_a_cap_goes_on_to_what_max_model_len_leaves(
    start_cluster: StartCluster,
) -> None:
    """vLLM caps a chat that names none at max_model_len less its prompt: a continuation, a
    completion (whose default is 16), is told what is left of that, from the decode's
    /v1/models; min_tokens above 16 goes on too."""
    length = 64
    cluster = await cut_stream(
        start_cluster, {"break_after_tokens": 5}, decode={"max_model_len": length}
    )
    body = uncapped(CHAT, ignore_eos=True, min_tokens=30)
    await eventually(lambda: all(d.served is not None for d in fleet_of(cluster).decodes))
    events = await stream_of(cluster, CHAT, body)
    assert_one_stream(events)
    expected = generate(prompt_of(CHAT, body), body, max_model_len=length)
    assert len(expected.token_ids) == length - expected.prompt_tokens > 30
    assert text_of(CHAT, events) == expected.text
    (continued,) = cluster.decodes[1].requests
    assert continued.body["max_tokens"] == len(expected.token_ids) - 5
    assert continued.body["min_tokens"] == 25


LONG_STOP = "a stop string of 27 letters"  # never said: vLLM holds 26 characters back


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cut", [3, 12])
async def test_text_held_back_for_a_stop_string_is_not_lost(
    start_cluster: StartCluster, path: str, cut: int
) -> None:
    """vLLM holds back the last 26 characters while a 27-character stop string may still
    match, but sends every token's id at once: going on from the ids would lose the text held
    back. The continuation goes back far enough, gives that text again, and the client gets
    each character once: after 3 tokens it had none of it, after 12 the text of the first."""
    cluster = await cut_stream(start_cluster, {"break_after_tokens": cut})
    body = request_body(path, stream=True, max_tokens=16, temperature=0, stop=[LONG_STOP])
    body["stream_options"] = {"include_usage": True}
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    expected = generate(prompt_of(path, body), body)
    assert text_of(path, events) == expected.text
    assert events[-2]["usage"]["completion_tokens"] == len(expected.token_ids) == 16


def spanning_stop(answer: Generation) -> int | None:
    """A cut between two tokens that both end a character, with four characters before it
    and three after that make a stop string said nowhere before (stop_across)."""
    for position in range(5, len(answer.deltas) - 3):
        if answer.deltas[position - 1] and answer.deltas[position]:
            before = "".join(answer.deltas[:position])
            if len(before) > 8 and stop_across(answer, position) not in before[:-1]:
                return position
    return None


def stop_across(answer: Generation, cut: int) -> str:
    return "".join(answer.deltas[:cut])[-4:] + answer.deltas[cut][:3]


async def test_a_stop_string_across_the_cut_is_matched(start_cluster: StartCluster) -> None:
    """A stop string whose first characters the tokens before the cut gave, and whose last
    the next token gives: the original would have stopped there; the continuation, which
    matches stop strings in its own text only, must be given those first characters again."""
    plain = request_body(COMPLETIONS, stream=True, max_tokens=16, temperature=0)
    plain, whole, cut = prompt_where(COMPLETIONS, plain, spanning_stop)
    stop = stop_across(whole, cut)  # 4 characters before the cut, 3 after
    body = {**plain, "stop": [stop]}
    expected = generate(prompt_of(COMPLETIONS, body), body)
    assert expected.finish_reason == "stop" and expected.stop_reason == stop
    cluster = await cut_stream(start_cluster, {"break_after_tokens": cut})
    events = await stream_of(cluster, COMPLETIONS, body)
    assert_one_stream(events)
    assert text_of(COMPLETIONS, events) == expected.text
    finishes = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finishes] == [("stop", stop)]


async def test_a_sampled_stream_with_a_stop_string_is_not_moved(
    start_cluster: StartCluster,
) -> None:
    """Sampled (no temperature 0), going on exactly would draw anew text the client has or
    that vLLM held back for the stop string: the stream ends saying so, not with a guess."""
    cluster = await cut_stream(start_cluster, {"break_after_tokens": 8})
    body = completion(stream=True, max_tokens=16, stop=["said never"])
    events = await stream_of(cluster, COMPLETIONS, body)
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    message = events[-2]["error"]["message"]
    assert "not continued elsewhere: it samples" in message and "stop strings" in message
    assert len(cluster.decodes[1].requests) == 0


async def test_a_chat_whose_decode_parses_reasoning_is_not_moved(
    start_cluster: StartCluster,
) -> None:
    """A decode with a reasoning parser streams reasoning apart from content; a continuation,
    a completion, would send it all as content: the stream ends saying why."""
    cluster = await cut_stream(
        start_cluster, {"break_after_tokens": 6}, decode={"reasoning_parser": True}
    )
    events = await stream_of(cluster, CHAT, chat(stream=True, max_tokens=16, temperature=0))
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], 502)
    assert "reasoning or tool parser" in events[-2]["error"]["message"]
    assert len(cluster.decodes[1].requests) == 0


@pytest.mark.parametrize("path", PATHS)
async def test_a_stream_cut_after_its_finish_and_a_keep_alive_is_not_continued(
    start_cluster: StartCluster, path: str
) -> None:
    """Its finish_reason went out, then a keep-alive comment, then the cut: the answer is whole
    and only its end is owed, however the last read ended."""
    cluster = await start_cluster(
        decodes=2,
        decode={"break_after_tokens": 6, "keepalive_after_finish": True, "token_delay": 0.01},
    )
    body = request_body(path, stream=True, max_tokens=6, ignore_eos=True)
    body["stream_options"] = {"include_usage": True}
    events = await stream_of(cluster, path, body)
    assert_one_stream(events)
    expected = generate(prompt_of(path, body), body)
    assert text_of(path, events) == expected.text
    assert events[-2]["usage"]["completion_tokens"] == 6
    assert sum(len(decode.requests) for decode in cluster.decodes) == 1


def merged_cut(inside: bool) -> Callable[[Generation], int | None]:
    """A cut after the second chunk of three tokens each, with text, whose last token ends
    inside a character (``inside``) or not: only the model's tokenizer can tell."""

    def find(answer: Generation) -> int | None:
        deltas = answer.deltas
        if len(deltas) < 8 or not "".join(deltas[3:6]) or not deltas[2]:
            return None
        return 6 if (deltas[5] == "") == inside else None

    return find


@pytest.mark.parametrize("inside", [False, True])
async def test_chunks_of_several_tokens_go_on_from_a_whole_character(
    start_cluster: StartCluster, inside: bool
) -> None:
    """vLLM merges steps into one chunk (its API server behind the engine, or
    --stream-interval): whether a chunk's last token ended a character its text does not say,
    so the proxy asks the model's tokenizer (vLLM's /detokenize), and goes on from there or
    from an earlier chunk, giving again what the client has."""
    body = completion(stream=True, max_tokens=16, temperature=0)
    body, expected, cut = prompt_where(COMPLETIONS, body, merged_cut(inside))
    cluster = await cut_stream(
        start_cluster, {"break_after_tokens": cut + 1}, decode={"stream_interval": 3}
    )
    events = await stream_of(cluster, COMPLETIONS, body)
    assert_one_stream(events)
    assert text_of(COMPLETIONS, events) == expected.text
    (continued,) = [r for r in cluster.decodes[1].requests if r.path == COMPLETIONS]
    gone_back = 3 if inside else 0
    assert continued.body["prompt"] == (
        expected.prompt_token_ids + expected.token_ids[: cut - gone_back]
    )


async def test_a_whole_answer_is_not_tried_again_past_the_first_token_deadline(
    start_cluster: StartCluster,
) -> None:
    """A whole answer's first byte comes with its last, so its wait is not cut; but once
    --first-token-timeout has passed, a failure is not tried again (KV pulls that time out one
    pair after another held a client for three of vLLM's 480 s KV timeouts)."""
    cluster = await start_cluster(
        decodes=2, decode={"pull_delay": 0.6, "fail_pulls": 5}, first_token_timeout=0.3
    )
    async with asyncio.timeout(FAST):
        response = await cluster.client.post(COMPLETIONS, json=completion())
        payload = await response.json()
    assert response.status == 504
    assert_openai_error(payload, 504)
    message = payload["error"]["message"]
    assert "failed before its first token" in message and "not tried again after" in message
    assert sum(len(decode.requests) for decode in cluster.decodes) == 1
