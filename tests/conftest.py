"""Every async test runs on both event loops the daemon offers: asyncio's own and uvloop
(``--loop``, uvloop by default), so a failure path that works on one only is seen.

The fixtures the test files share are here too; the helpers they import are in
testing_support.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop
from pytest_aiohttp import AiohttpClient, AiohttpServer
from yarl import URL

import mooncake_proxy as mp
from fake_vllm import FakeVllm, free_port
from testing_support import (
    KV_TIMEOUT,
    Cluster,
    StartCluster,
    daemon_client,
    eventually,
    serve,
    subscribed,
    wait_ready_,
)

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return LOOPS


@pytest.fixture
def start_cluster(aiohttp_server: AiohttpServer, aiohttp_client: AiohttpClient) -> StartCluster:
    async def start(
        prefill_dp: tuple[int, ...] = (1,),
        decodes: int = 1,
        wait_ready: bool = True,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        each_prefill: tuple[dict[str, Any], ...] = (),
        each_decode: tuple[dict[str, Any], ...] = (),
        cancel_handlers: bool = True,
        kv_events: bool = False,
        kv_replay: bool = False,
        **config: Any,
    ) -> Cluster:
        """``kv_events``: every engine publishes vLLM's KV events on ports of its own, which
        the proxy is told of (``kv_replay``: with a replay socket)."""
        if kv_events:  # the [precise] extra's: the fakes publish as vLLM does, over ZMQ
            pytest.importorskip("zmq")
            pytest.importorskip("msgspec")
        prefills, specs, api_servers = [], [], {}
        sources: list[mp.KvEventSource] = []

        def publish(fake: FakeVllm) -> None:
            if kv_events:
                fake.kv_events_port = free_port(fake.dp_size)
                fake.kv_replay_port = free_port(fake.dp_size) if kv_replay else None
                endpoint, replay = (
                    URL(f"tcp://127.0.0.1:{port}") if port else None
                    for port in (fake.kv_events_port, fake.kv_replay_port)
                )
                assert endpoint is not None
                sources.append(mp.KvEventSource(URL(fake.api_url), endpoint, replay))

        for index, dp_size in enumerate(prefill_dp):
            own = each_prefill[index] if index < len(each_prefill) else {}
            fake = FakeVllm("prefill", dp_size=dp_size, **{**(prefill or {}), **own})
            fake.api_url = f"http://127.0.0.1:{free_port()}"
            publish(fake)
            api = await serve(aiohttp_server, fake.api_app(), URL(fake.api_url).port)
            bootstrap = await serve(aiohttp_server, fake.bootstrap_app())
            api_servers[id(fake)] = api
            prefills.append(fake)
            specs.append(
                mp.PrefillSpec(
                    URL(fake.api_url),
                    URL.build(scheme="http", host="127.0.0.1", port=bootstrap.port),
                )
            )
        decode_fakes, decode_urls = [], []
        for index in range(decodes):
            own = each_decode[index] if index < len(each_decode) else {}
            fake = FakeVllm("decode", kv_timeout=KV_TIMEOUT, **{**(decode or {}), **own})
            fake.api_url = f"http://127.0.0.1:{free_port()}"
            publish(fake)
            api = await serve(aiohttp_server, fake.api_app(), URL(fake.api_url).port)
            api_servers[id(fake)] = api
            decode_fakes.append(fake)
            decode_urls.append(URL(fake.api_url))
        config.setdefault("discovery_interval", 0.02)
        # Tests count the requests each fake got: no self-test's among them unless asked.
        config.setdefault("no_start_self_test", True)
        config.setdefault("kv_events", tuple(sources))
        proxy_config = mp.ProxyConfig(prefills=tuple(specs), decodes=tuple(decode_urls), **config)
        client = await daemon_client(aiohttp_client, proxy_config, cancel_handlers)
        if wait_ready:
            await wait_ready_(client)
        if kv_events:  # every engine's publisher heard the proxy subscribe
            await eventually(lambda: all(subscribed(fake) for fake in (*prefills, *decode_fakes)))
        return Cluster(prefills, decode_fakes, proxy_config, client, aiohttp_server, api_servers)

    return start
