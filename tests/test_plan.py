"""The API table and the plan a PD request is given (plan_request): table tests, no socket.

A request's plan is a pure function of its path, headers, body, the configuration and its
model's serving group; each row below is one request as a client sends it, and what the run
is then to do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from yarl import URL

import mooncake_proxy as mp
from testing_support import SPEC, chat, completion

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
GENERATE = "/inference/v1/generate"

CONFIG = mp.ProxyConfig(prefills=(SPEC,), decodes=(URL("http://d:1"),))
SMALL = {"Content-Length": "300"}


def group(adapter: str | None = None, policy: mp.Policy = mp.Policy.ROUND_ROBIN) -> mp.Serving:
    """A serving group with no instance: planning reads its routers' policies and adapter."""
    routers = (mp.Router("prefill", 1.0, 1.0, 0.0), mp.Router("decode", 1.0, 1.0, 0.0))
    for router in routers:
        router.policy = policy
    return mp.Serving((), (), *routers, model=adapter, adapter=adapter)


def plan(
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    config: mp.ProxyConfig = CONFIG,
    serving: mp.Serving | None = None,
) -> mp.Plan:
    given = SMALL if headers is None else headers
    return mp.plan_request(path, given, body, config, serving or group())


def responses(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "input": "Hello", **extra}


def generate(**extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 4},
        **extra,
    }


def test_the_table_has_a_row_for_each_pd_route_and_no_other() -> None:
    assert sorted(mp.API_ROUTES) == sorted(mp.PD_PATHS)
    assert all(path == api.path for path, api in mp.API_ROUTES.items())
    assert mp.CONTINUATION_API is mp.API_ROUTES[COMPLETIONS]  # a continuation is a completion


@pytest.mark.parametrize(
    ("path", "prompt", "cap", "named", "continues"),
    [
        (COMPLETIONS, "prompt", "max_tokens", False, True),
        (CHAT, "messages", "max_tokens", False, True),
        (RESPONSES, "input", "max_output_tokens", True, False),
        (GENERATE, "token_ids", "max_tokens", False, False),
    ],
)
def test_each_row_says_where_a_requests_fields_are(
    path: str, prompt: str, cap: str, named: bool, continues: bool
) -> None:
    api = mp.API_ROUTES[path]
    assert (api.prompt, api.cap, api.named_events) == (prompt, cap, named)
    assert (api.continues is None) is continues


# (what the client sends, whether it streams, why it goes to a decode alone, why its stream
# cannot go on elsewhere)
ALONE = "it goes to a decode alone"
PLANS: list[tuple[str, dict[str, Any], bool, str | None, str | None]] = [
    (CHAT, chat(stream=True), True, None, None),
    (COMPLETIONS, completion(stream=True), True, None, None),
    (COMPLETIONS, completion(), False, None, None),  # a whole answer: nothing to go on from
    (CHAT, chat(stream=True, n=2), True, "n", ALONE),
    (COMPLETIONS, completion(prompt=["a", "b"]), False, "prompt", None),
    (
        COMPLETIONS,
        completion(stream=True, best_of="3"),
        True,
        "best_of",
        "it goes to a decode alone",
    ),
    (CHAT, chat(stream=True, logprobs=True), True, None, "it asks for logprobs"),
    (
        RESPONSES,
        responses(stream=True),
        True,
        None,
        "a Responses stream is not continued elsewhere",
    ),
    (GENERATE, generate(stream=True), True, None, mp.GENERATE_API.continues),
    (GENERATE, generate(sampling_params={"n": 2}), False, "n", None),
]


@pytest.mark.parametrize(("path", "body", "stream", "alone", "unmigratable"), PLANS)
def test_the_plan_of_a_request(
    path: str, body: dict[str, Any], stream: bool, alone: str | None, unmigratable: str | None
) -> None:
    planned = plan(path, body)
    assert planned.api is mp.API_ROUTES[path]
    assert (planned.stream, planned.alone, planned.unmigratable) == (stream, alone, unmigratable)
    assert planned.model == "fake-model" and planned.route is None  # round robin: no route key


def test_a_plan_is_frozen() -> None:
    planned = plan(CHAT, chat())
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.alone = "n"  # type: ignore[misc]


def test_migration_limit_0_leaves_every_stream_where_it_is() -> None:
    config = dataclasses.replace(CONFIG, migration_limit=0)
    assert plan(CHAT, chat(stream=True), config=config).unmigratable == "--migration-limit is 0"


@pytest.mark.parametrize(
    "body",
    [responses(previous_response_id="resp_1"), responses(background=True)],
)
def test_what_the_responses_row_refuses_is_a_400_naming_the_field(body: dict[str, Any]) -> None:
    with pytest.raises(mp.ProxyError) as refused:
        plan(RESPONSES, body)
    assert refused.value.status == 400 and refused.value.param in body


def test_a_prefix_aware_plan_has_a_route_key_the_session_and_the_adapter_shape() -> None:
    body = chat(messages=[{"role": "user", "content": "x" * 2000}])
    planned = plan(CHAT, body, serving=group(policy=mp.Policy.PREFIX_AWARE))
    assert planned.route is not None and not planned.route.session and planned.route.adapter == 0
    assert len(planned.route.chain) == planned.route.length // mp.ROUTING_BLOCK_BYTES
    headers = {**SMALL, mp.SESSION_HEADER: "s1"}
    session = plan(CHAT, body, headers, serving=group(policy=mp.Policy.PREFIX_AWARE))
    assert session.route is not None and session.route.session
    lora = plan(CHAT, {**body, "model": "sql"}, serving=group("sql", mp.Policy.PREFIX_AWARE))
    assert lora.route is not None and lora.route.adapter == mp.adapter_seed("sql") != 0


@pytest.mark.parametrize(
    ("headers", "shared"),
    [(SMALL, False), ({}, True), ({"Content-Length": str(mp.LEG_BODY_COPY_LIMIT)}, True)],
)
def test_a_large_or_chunked_body_is_encoded_once_for_both_legs(
    headers: dict[str, str], shared: bool
) -> None:
    planned = plan(COMPLETIONS, completion(), headers)
    assert (planned.shared is not None) is shared
    if planned.shared is not None:
        common = {k: v for k, v in completion().items() if k not in mp.LEG_FIELDS}
        assert mp.parse_request_json(planned.shared.json) == common


@pytest.mark.parametrize(
    ("path", "body", "capped"),
    [
        (COMPLETIONS, completion(max_tokens=50), {"max_tokens": 1}),
        (RESPONSES, responses(max_output_tokens=50), {"max_output_tokens": 1, "store": False}),
        (
            GENERATE,
            generate(),
            {"sampling_params": {"max_tokens": 1, "ignore_eos": True}},
        ),
    ],
)
def test_each_rows_prefill_is_capped_where_its_api_keeps_the_cap(
    path: str, body: dict[str, Any], capped: dict[str, Any]
) -> None:
    prefill = mp.prefill_body(body, "xfer-1", mp.API_ROUTES[path])
    assert {key: prefill[key] for key in capped} == capped
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
