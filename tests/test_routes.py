"""vLLM's routes beside completions and chat: the Responses API in PD (its prefill capped by
max_output_tokens, its named events held until the first token); those that answer from one
instance, passed through whole to a decode (its answer streamed back as written, another
decode tried while none answered); and those that change an instance (LoRA adapters), sent
to every one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

import mooncake_proxy as mp
from fake_vllm import MODEL, VLLM_VERSION, FakeVllm
from testing_support import (
    COMPLETIONS,
    FAST,
    JSON_TYPE,
    Cluster,
    StartCluster,
    access_lines,
    assert_openai_error,
    completion,
    eventually,
    fleet_of,
    sample,
    scrape,
)

TOKENIZE = {"model": MODEL, "prompt": "Hello, PD world"}


async def test_tokenize_detokenize_and_version_answer_as_the_decode_does(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="mooncake_proxy.access")
    cluster = await start_cluster()
    (decode,) = cluster.decodes
    tokenized = await cluster.client.post("/tokenize", json=TOKENIZE)
    assert tokenized.status == 200 and tokenized.content_type == "application/json"
    answer = await tokenized.json()
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 4096
    assert tokenized.headers["X-Request-Id"]
    back = await cluster.client.post("/detokenize", json={"tokens": answer["tokens"]})
    assert (await back.json())["prompt"] == TOKENIZE["prompt"]
    version = await cluster.client.get("/version")
    assert (await version.json()) == {"version": VLLM_VERSION}
    # Sent to the decode as the client sent it, never to a prefill.
    assert [r.path for r in decode.requests] == ["/tokenize", "/detokenize"]
    assert decode.requests[0].body == TOKENIZE and not cluster.prefill_requests()
    routes = [line["route"] for line in access_lines(caplog)]
    assert routes == ["/tokenize", "/detokenize", "/version"]
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_requests_total", route="/tokenize", status="200") == 1


async def test_an_instances_own_error_comes_back_as_it_wrote_it(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    unknown = await cluster.client.post("/tokenize", json={**TOKENIZE, "model": "nope"})
    assert unknown.status == 404
    assert_openai_error(await unknown.json(), 404)
    assert "The model `nope` does not exist." in (await unknown.json())["error"]["message"]
    bad = await cluster.client.post("/detokenize", json={"tokens": "x"})
    assert bad.status == 400
    # A path vLLM does not serve stays the proxy's own JSON 404; the proxy serves on.
    missing = await cluster.client.post("/v1/nothing", json={})
    assert missing.status == 404
    assert_openai_error(await missing.json(), 404)
    assert (await cluster.client.get("/version")).status == 200


async def test_a_decode_that_cannot_be_reached_is_passed_over(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(
        decodes=2, decode_policy=mp.Policy.ROUND_ROBIN, health_interval=60, discovery_interval=60
    )
    await cluster.kill(cluster.decodes[0])
    for _ in range(4):
        response = await cluster.client.post("/tokenize", json=TOKENIZE)
        assert response.status == 200, await response.text()
    assert len(cluster.decodes[1].requests) == 4
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_retries_total", stage="decode") == 1
    assert [d.url.port for d in fleet_of(cluster).decodes if d.usable] == [
        int(cluster.decodes[1].api_url.rsplit(":", 1)[1])
    ]


async def test_with_every_decode_gone_the_client_gets_a_clear_error_at_once(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=2, health_interval=60, discovery_interval=60)
    for fake in cluster.decodes:
        await cluster.kill(fake)
    response = await asyncio.wait_for(cluster.client.post("/tokenize", json=TOKENIZE), FAST)
    assert response.status in (502, 503)
    assert_openai_error(await response.json(), response.status)


async def test_the_api_key_guards_v1_routes_as_vllm_does(start_cluster: StartCluster) -> None:
    cluster = await start_cluster(api_key="secret")
    body: dict[str, Any] = {"model": MODEL, "input": "x"}
    assert (await cluster.client.post("/v1/embeddings", json=body)).status == 401
    assert (await cluster.client.post("/tokenize", json=TOKENIZE)).status == 200


async def test_a_lora_adapter_is_loaded_on_every_instance_and_unloaded_from_every_one(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(prefill_dp=(1, 1), decodes=2)
    adapter = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    loaded = await cluster.client.post("/v1/load_lora_adapter", json=adapter)
    assert loaded.status == 200, await loaded.text()
    assert await loaded.text() == "Success: LoRA adapter 'sql' added successfully."
    fakes = [*cluster.prefills, *cluster.decodes]
    assert all(fake.adapters == {"sql": "/adapters/sql"} for fake in fakes)
    # Loaded again: each instance refuses it, and the answer says so for each.
    again = await cluster.client.post("/v1/load_lora_adapter", json=adapter)
    assert again.status == 400
    message = (await again.json())["error"]["message"]
    assert message.count("has already been loaded") == 4 and "4 of 4" in message
    unloaded = await cluster.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert unloaded.status == 200 and all(fake.adapters == {} for fake in fakes)


async def test_an_instance_that_cannot_take_the_adapter_is_named(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decodes=2, health_interval=60, discovery_interval=60)
    await cluster.kill(cluster.decodes[1])
    adapter = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    response = await cluster.client.post(
        "/v1/load_lora_adapter", data=b'{"lora_name":"sql","lora_path":"/adapters/sql"}',
        headers=JSON_TYPE,
    )  # fmt: skip
    assert response.status == 502
    message = (await response.json())["error"]["message"]
    assert "1 of 3" in message and cluster.decodes[1].api_url in message
    loaded = {"sql": adapter["lora_path"]}
    assert cluster.prefills[0].adapters == cluster.decodes[0].adapters == loaded


async def test_an_answer_cut_after_its_head_reaches_the_client_cut(
    start_cluster: StartCluster,
) -> None:
    """The decode dies once its head is out: the client's answer ends short (its connection
    closed, not a clean end it could take for whole), and the proxy serves on."""
    cluster = await start_cluster(decode={"die_after_head": True})
    response = await cluster.client.post("/tokenize", json=TOKENIZE)
    assert response.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()
    cluster.decodes[0].die_after_head = False
    assert (await cluster.client.post("/tokenize", json=TOKENIZE)).status == 200


# --- the Responses API in PD

RESPONSES = "/v1/responses"


def response_body(**extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "instructions": "You are terse. " * 40, "input": "What is PD?"}
    return body | {"max_output_tokens": 8} | extra


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """A Responses stream's events: each one's name and data."""
    events = []
    for frame in raw.split(b"\n\n"):
        if frame:
            name, data = frame.split(b"\n", 1)
            assert name.startswith(b"event: ") and data.startswith(b"data: "), frame
            events.append((name[7:].decode(), json.loads(data[6:])))
    return events


def streamed_text(events: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(e["delta"] for name, e in events if name == "response.output_text.delta")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_response_is_prefilled_moved_and_answered_as_the_decode_alone_answers(
    start_cluster: StartCluster, stream: bool
) -> None:
    cluster = await start_cluster()
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    body = response_body(stream=stream)
    answer = await cluster.client.post(RESPONSES, json=body)
    assert answer.status == 200, await answer.text()
    raw = await answer.read()
    # The prefill computed one token, for its KV, and stored nothing; the decode pulled it.
    (prefilled,) = prefill.requests
    assert prefilled.body["max_output_tokens"] == 1 and prefilled.body["store"] is False
    assert prefilled.body["stream"] is False and prefilled.body["ignore_eos"] is True
    assert prefilled.body["kv_transfer_params"]["do_remote_decode"] is True
    (decoded,) = decode.requests
    assert decoded.body["max_output_tokens"] == 8 and decoded.body["stream"] is stream
    assert decoded.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert prefill.transfers_served == 1
    # As the decode answers the same request alone.
    session = cluster.client.session
    async with session.post(f"{decode.api_url}{RESPONSES}", json=body) as alone:
        local = await alone.read()
    if not stream:
        proxied, direct = json.loads(raw), json.loads(local)
        assert proxied["output"][0]["content"] == direct["output"][0]["content"]
        assert proxied["usage"] == direct["usage"] and proxied["status"] == "incomplete"
        return
    assert answer.content_type == "text/event-stream"
    events, local_events = named_events(raw), named_events(local)
    assert [name for name, _ in events] == [name for name, _ in local_events]
    assert streamed_text(events) == streamed_text(local_events) != ""
    assert events[-1][0] == "response.completed" and b"[DONE]" not in raw


async def test_a_failed_kv_pull_before_the_first_token_is_tried_again(
    start_cluster: StartCluster,
) -> None:
    """vLLM cuts a Responses stream whose generation failed, after its first events: the
    proxy held those, and starts the pair again; the client sees one whole stream, and the
    decode stays in the rotation (a failed pull is no sign it is down)."""
    cluster = await start_cluster(decode={"fail_pulls": 1})
    answer = await cluster.client.post(RESPONSES, json=response_body(stream=True))
    assert answer.status == 200
    events = named_events(await answer.read())
    assert [name for name, _ in events].count("response.created") == 1
    assert events[-1][0] == "response.completed" and streamed_text(events)
    assert len(cluster.decodes[0].pull_failures) == 1 and len(cluster.decodes[0].requests) == 2
    assert all(d.usable for d in fleet_of(cluster).decodes)
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_errors_total", stage="decode", reason="kv_load") == 1


async def test_a_prefill_that_did_not_end_by_its_cap_fails_at_once(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(prefill={"force_finish_reason": "stop"})
    answer = await asyncio.wait_for(cluster.client.post(RESPONSES, json=response_body()), FAST)
    assert answer.status == 502
    message = (await answer.json())["error"]["message"]
    assert "status 'completed'" in message and "max_output_tokens" in message


async def test_a_decode_lost_mid_stream_ends_the_stream_with_an_error_event(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decode={"break_after_tokens": 3})
    answer = await cluster.client.post(RESPONSES, json=response_body(stream=True))
    assert answer.status == 200
    events = named_events(await answer.read())
    assert len(streamed_text(events).split()) == 3
    name, error = events[-1]
    assert name == "error" and "not continued elsewhere" in error["error"]["message"]


@pytest.mark.parametrize(
    "stored", [{"previous_response_id": "resp_1"}, {"background": True}], ids=["previous", "bg"]
)
async def test_a_response_that_needs_a_stored_one_is_refused_with_the_reason(
    start_cluster: StartCluster, stored: dict[str, Any]
) -> None:
    cluster = await start_cluster()
    answer = await cluster.client.post(RESPONSES, json=response_body(**stored))
    assert answer.status == 400
    payload = await answer.json()
    assert_openai_error(payload, 400)
    (field,) = stored
    assert payload["error"]["param"] == field and "PD proxy" in payload["error"]["message"]
    assert not cluster.prefill_requests() and not cluster.decodes[0].requests
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/r/cancel")):
        answer = await cluster.client.request(method, path)
        assert answer.status == 404
        assert "not stored through the PD proxy" in (await answer.json())["error"]["message"]


async def test_a_conversations_next_response_goes_where_its_turns_are_cached(
    start_cluster: StartCluster,
) -> None:
    """Its input holds the turns before it, as a chat's messages do: the next request goes to
    the engine that holds them, among four."""
    cluster = await start_cluster(prefill_dp=(4,))
    turns: list[dict[str, Any]] = []
    for question in ("What is PD?", "And KV?", "And a decode?"):
        turns.append({"role": "user", "content": f"{question} " * 60})
        answer = await cluster.client.post(RESPONSES, json=response_body(input=turns))
        assert answer.status == 200
        text = (await answer.json())["output"][0]["content"][0]["text"]
        turns.append({"role": "assistant", "content": text})
    ranks = [r.headers.get("X-data-parallel-rank") for r in cluster.prefills[0].requests]
    assert len(ranks) == 3 and len(set(ranks)) == 1
    samples = await scrape(cluster)
    affinity = {"stage": "prefill", "reason": "affinity"}
    assert sample(samples, "mooncake_proxy_routing_decisions_total", **affinity) == 2


# --- several models and LoRA adapters behind one proxy


TWO_MODELS = {
    "prefill_dp": (1, 1),
    "decodes": 2,
    "each_prefill": ({"model": "tiny-a"}, {"model": "tiny-b"}),
    "each_decode": ({"model": "tiny-a"}, {"model": "tiny-b"}),
}


async def known_models(cluster: Cluster, *models: str) -> None:
    """Wait until the proxy read every instance's /v1/models (learn_models)."""
    backends = [*fleet_of(cluster).prefills, *fleet_of(cluster).decodes]
    await eventually(lambda: all(b.served is not None for b in backends))
    assert set(fleet_of(cluster).known_models()) >= set(models)


def models_sent(fake: FakeVllm) -> set[str | None]:
    return {r.body.get("model") for r in fake.requests if r.path == COMPLETIONS}


@pytest.mark.parametrize("stream", [False, True])
async def test_each_model_goes_to_the_pair_that_serves_it(
    start_cluster: StartCluster, stream: bool
) -> None:
    cluster = await start_cluster(**TWO_MODELS)
    await known_models(cluster, "tiny-a", "tiny-b")
    for model in ("tiny-a", "tiny-b") * 3:
        answer = await cluster.client.post(COMPLETIONS, json=completion(model=model, stream=stream))
        assert answer.status == 200, await answer.text()
        assert model.encode() in await answer.read()
    # Each pair saw its own model only, both legs: a KV cache never crosses models.
    for index, model in enumerate(("tiny-a", "tiny-b")):
        assert (
            models_sent(cluster.prefills[index]) == models_sent(cluster.decodes[index]) == {model}
        )
        assert cluster.prefills[index].transfers_served == 3
    # A request that names no model goes where vLLM's first served name is: the first pair's.
    body = completion()
    del body["model"]
    assert (await cluster.client.post(COMPLETIONS, json=body)).status == 200
    assert len(cluster.decodes[0].requests) == 4 and len(cluster.decodes[1].requests) == 3
    samples = await scrape(cluster)
    for model in ("tiny-a", "tiny-b"):
        requests = sample(samples, "mooncake_proxy_requests_total", model=model, status="200")
        assert requests == (3 if model == "tiny-b" else 4)


async def test_a_model_no_instance_serves_gets_vllms_404_and_the_list_is_the_union(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(**TWO_MODELS)
    await known_models(cluster, "tiny-a", "tiny-b")
    for path in (COMPLETIONS, "/v1/chat/completions", RESPONSES, "/tokenize"):
        missing = await cluster.client.post(path, json={"model": "nope", "prompt": "x"})
        assert missing.status == 404, path
        error = (await missing.json())["error"]
        assert_openai_error({"error": error}, 404)
        assert error["type"] == "NotFoundError" and error["param"] == "model"
        assert error["message"] == "The model `nope` does not exist. Valid aliases: tiny-a, tiny-b."
    assert not any(fake.requests for fake in (*cluster.prefills, *cluster.decodes))
    listed = await (await cluster.client.get("/v1/models")).json()
    assert listed["object"] == "list"
    assert [card["id"] for card in listed["data"]] == ["tiny-a", "tiny-b"]
    samples = await scrape(cluster)
    assert sample(samples, "mooncake_proxy_requests_total", status="404", model="-") == 4


async def test_a_models_instances_out_of_the_rotation_give_a_503_that_names_it(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(**TWO_MODELS, health_interval=60, discovery_interval=60)
    await known_models(cluster, "tiny-a", "tiny-b")
    await cluster.kill(cluster.decodes[1])
    fleet_of(cluster).take_out(fleet_of(cluster).decodes[1], "killed by the test")
    answer = await cluster.client.post(COMPLETIONS, json=completion(model="tiny-b"))
    assert answer.status == 503
    assert (
        "no usable decode instance serves model `tiny-b`"
        in (await answer.json())["error"]["message"]
    )
    # The other model is served on.
    assert (await cluster.client.post(COMPLETIONS, json=completion(model="tiny-a"))).status == 200


async def test_an_adapter_loaded_for_one_base_model_is_routed_to_its_instances(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(**TWO_MODELS)
    await known_models(cluster, "tiny-a", "tiny-b")
    adapter = {"lora_name": "sql", "lora_path": "/adapters/sql", "model": "tiny-a"}
    loaded = await cluster.client.post("/v1/load_lora_adapter", json=adapter)
    assert loaded.status == 200, await loaded.text()
    # On tiny-a's instances only, and vLLM was not sent the proxy's own field.
    assert [bool(f.adapters) for f in (*cluster.prefills, *cluster.decodes)] == [1, 0, 1, 0]
    loads = [r for r in cluster.prefills[0].requests if r.path == "/v1/load_lora_adapter"]
    assert "model" not in loads[0].body
    # Known at once: a request for it follows the load without waiting for a check.
    for _ in range(3):
        answer = await cluster.client.post(COMPLETIONS, json=completion(model="sql"))
        assert answer.status == 200, await answer.text()
    assert models_sent(cluster.prefills[0]) == models_sent(cluster.decodes[0]) == {"sql"}
    listed = await (await cluster.client.get("/v1/models")).json()
    card = next(card for card in listed["data"] if card["id"] == "sql")
    assert card["parent"] == "tiny-a"
    # A base model the fleet does not run: vLLM's 404, loaded nowhere.
    wrong = await cluster.client.post("/v1/load_lora_adapter", json={**adapter, "model": "x"})
    assert wrong.status == 404
    unloaded = await cluster.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert unloaded.status == 200, await unloaded.text()
    gone = await cluster.client.post(COMPLETIONS, json=completion(model="sql"))
    assert gone.status == 404


async def test_an_instance_whose_models_cannot_be_read_serves_any_model(
    start_cluster: StartCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await start_cluster(decode={"models_status": 500})
    fleet = fleet_of(cluster)
    await eventually(lambda: fleet.prefills[0].served is not None)
    assert fleet.decodes[0].served is None and "models unknown" in caplog.text
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    # A model the proxy cannot rule out goes on: the instances' own 404 answers it.
    other = await cluster.client.post(COMPLETIONS, json=completion(model="whatever"))
    assert other.status == 404
    assert "Valid aliases: fake-model." in (await other.json())["error"]["message"]


# --- /inference/v1/generate: token ids in, token ids out, in PD

GENERATE = "/inference/v1/generate"


def generate_body(stream: bool = False, **sampling: Any) -> dict[str, Any]:
    sampling = {"max_tokens": 8, "temperature": 0, "stop_token_ids": [7], **sampling}
    return {"model": MODEL, "token_ids": [11, 12, 13, 14, 15], "sampling_params": sampling,
            "stream": stream}  # fmt: skip


def generated_ids(raw: bytes, stream: bool) -> list[int]:
    if not stream:
        return [t for choice in json.loads(raw)["choices"] for t in choice["token_ids"]]
    events = [json.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    choices = [choice for event in events for choice in event.get("choices", ())]
    return [t for choice in choices for t in choice["token_ids"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_generate_request_is_prefilled_moved_and_answered_as_the_decode_alone(
    start_cluster: StartCluster, stream: bool
) -> None:
    cluster = await start_cluster()
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    body = generate_body(stream)
    answer = await cluster.client.post(GENERATE, json=body)
    assert answer.status == 200, await answer.text()
    raw = await answer.read()
    # The prefill's cap and stops are in its sampling_params: one token, ended by length.
    (prefilled,) = prefill.requests
    assert prefilled.body["sampling_params"] == {"max_tokens": 1, "temperature": 0,
                                                 "ignore_eos": True}  # fmt: skip
    assert prefilled.body["stream"] is False and "ignore_eos" not in prefilled.body
    assert prefilled.body["kv_transfer_params"]["do_remote_decode"] is True
    (decoded,) = decode.requests
    assert decoded.body["sampling_params"] == body["sampling_params"]
    assert decoded.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert prefill.transfers_served == 1
    async with cluster.client.session.post(f"{decode.api_url}{GENERATE}", json=body) as alone:
        local = await alone.read()
    assert generated_ids(raw, stream) == generated_ids(local, stream) != []
    assert raw.endswith(b"data: [DONE]\n\n") == stream


async def test_a_generate_request_with_several_samples_goes_to_a_decode_alone(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster()
    body = generate_body(n=2, temperature=1.0)
    answer = await cluster.client.post(GENERATE, json=body)
    assert answer.status == 200, await answer.text()
    assert len((await answer.json())["choices"]) == 2
    assert not cluster.prefill_requests()
    assert "kv_transfer_params" not in cluster.decodes[0].requests[0].body


async def test_a_generate_streams_failed_kv_pull_is_tried_again_and_its_faults_end_it_clearly(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(decode={"fail_pulls": 1})
    answer = await cluster.client.post(GENERATE, json=generate_body(stream=True))
    assert answer.status == 200
    raw = await answer.read()
    assert len(generated_ids(raw, True)) == 8 and raw.count(b'"error"') == 0
    assert len(cluster.decodes[0].pull_failures) == 1 and len(cluster.decodes[0].requests) == 2
    # A request vLLM refuses (no sampling_params) gets its words, from the prefill at once.
    refused = await cluster.client.post(GENERATE, json={"model": MODEL, "token_ids": [1]})
    assert refused.status == 400 and "sampling_params" in await refused.text()
    # Past the first token, a decode that dies ends the stream with an error and no retry.
    cluster.decodes[0].break_after_tokens = 3
    cut = await cluster.client.post(GENERATE, json=generate_body(stream=True))
    raw = await cut.read()
    assert len(generated_ids(raw, True)) == 3
    assert b"not continued elsewhere" in raw and raw.endswith(b"data: [DONE]\n\n")


async def test_anthropics_route_is_passed_on_even_for_a_model_the_proxy_does_not_know(
    start_cluster: StartCluster,
) -> None:
    """vLLM answers an unknown model on /v1/messages in Anthropic's error shape: the proxy
    does not answer it in OpenAI's itself, but lets an instance, whose answer comes back as
    it wrote it."""
    cluster = await start_cluster()
    await known_models(cluster, MODEL)
    body = {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    answer = await cluster.client.post("/v1/messages", json=body)
    local = await cluster.client.session.post(
        cluster.decodes[0].api_url + "/v1/messages", json=body
    )
    assert answer.status == local.status == 404
    assert await answer.json() == await local.json()
    assert (await answer.json())["type"] == "error"  # Anthropic's shape, not OpenAI's
    # Elsewhere the same model is the proxy's own NotFoundError.
    assert (await cluster.client.post("/tokenize", json=body)).content_type == JSON_TYPE[
        "Content-Type"
    ]
