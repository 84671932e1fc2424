"""Proof that the KV came over Mooncake, against real vLLM: a decode that computes the prompts
it should pull is reported as such, and a healthy pair as pulling all.

One prefill, one decode started with ``kv_load_failure_policy: "recompute"``, and two proxies
in front of them, judging the decode each by its own PD answers:
- one told the prefill's bootstrap server: a healthy pair, every PD prompt pulled;
- one told a bootstrap server that gives it other engine ids than it gives the decode (as a
  proxy pointed at the wrong bootstrap, or holding ids of a prefill since restarted, would
  have them): the decode cannot find the engine it is told to pull from ("remote engine_id
  ... not found from bootstrap server"), computes each prompt itself and answers 200, right,
  with no error anywhere but its log (PROTOCOL.md). The proxy must say so within two scrape
  intervals: in /healthcheck, in its metric, in one log line, and in the alert, evaluated by
  promtool on the series the proxy exported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from real_vllm import (  # the suite's servers and their HTTP
    DECODE_MAX_MODEL_LEN,
    MODEL,
    Server,
    bring_up,
    healthcheck,
    http_get,
    metric,
    proxy_server,
    unique_prompt,
    vllm_server,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent
SCRAPE = 1.0  # the proxies' --load-interval
PULLED, COMPUTED = 'source="external_kv_transfer"', 'source="local_compute"'


class SplitBootstrap(ThreadingHTTPServer):
    """A bootstrap server in front of the prefill's own that answers the proxy (aiohttp) with
    engine ids of its own making and the decode (vLLM's httpx) with the real ones."""

    def __init__(self, real: str) -> None:
        self.real = real
        self.asked_by: list[str] = []
        super().__init__(("127.0.0.1", 0), SplitBootstrapHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class SplitBootstrapHandler(BaseHTTPRequestHandler):
    server: SplitBootstrap

    def do_GET(self) -> None:  # http.server's name for it
        agent = self.headers.get("User-Agent", "")
        self.server.asked_by.append(agent)
        with urllib.request.urlopen(self.server.real + self.path, timeout=10) as answer:
            payload = json.loads(answer.read())
        if "httpx" not in agent:  # the proxy: ids the decode will not find
            for entry in payload.values():
                entry["engine_id"] = f"elsewhere-{entry['engine_id']}"
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@dataclass
class ProofCluster:
    prefill: Server
    decode: Server
    healthy: Server  # a proxy told the prefill's bootstrap
    misled: Server  # a proxy told the split one
    bootstrap: SplitBootstrap


@pytest.fixture(scope="module")
def proof_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProofCluster]:
    root = Path(os.environ["VLLM_ENV_ROOT"])
    logs = Path(os.environ.get("REAL_VLLM_LOGS") or tmp_path_factory.mktemp("proof-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    prefill = vllm_server(root, logs, "kv_producer", DECODE_MAX_MODEL_LEN, name="proof-prefill")
    decode = vllm_server(
        root, logs, "kv_consumer", DECODE_MAX_MODEL_LEN, "--enable-prompt-tokens-details",
        name="proof-decode", kv_config={"kv_load_failure_policy": "recompute"},
    )  # fmt: skip
    bootstrap = SplitBootstrap(f"http://127.0.0.1:{prefill.bootstrap_port}")
    threading.Thread(target=bootstrap.serve_forever, daemon=True).start()
    proxies = {
        name: proxy_server(
            f"proof-{name}", logs, prefill, decode, "--load-interval", str(SCRAPE), bootstrap=told
        )
        for name, told in (("healthy", ""), ("misled", bootstrap.url))
    }
    servers = (prefill, decode, *proxies.values())
    try:
        bring_up((prefill, decode), list(proxies.values()))
        # A proxy's first scrape of the decode is its baseline, and answers before it are in
        # those counters, never judged: CI's first test sent its three before it.
        for proxy in proxies.values():
            assert wait_for(partial(scraped, proxy), 30), f"{proxy.name} never scraped the decode"
        yield ProofCluster(prefill, decode, proxies["healthy"], proxies["misled"], bootstrap)
    finally:
        for server in reversed(servers):
            server.stop()
        bootstrap.shutdown()
        print(f"\nserver logs: {logs}")


def complete(base: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": unique_prompt(40), "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200
        payload: dict[str, Any] = json.loads(answer.read())
    return payload


def decode_state(proxy: Server, key: str = "kv_transfer") -> dict[str, Any] | None:
    (decode,) = healthcheck(proxy.url)["decode"]
    state: dict[str, Any] | None = decode[key]
    return state


def scraped(proxy: Server) -> bool:
    """Whether the proxy has scraped the decode's /metrics once."""
    load = decode_state(proxy, "load")
    return load is not None and load["age_s"] is not None


def scraped_at(proxy: Server) -> float:
    """When (this process's monotonic clock) the proxy last had the decode's /metrics page."""
    load = decode_state(proxy, "load")
    assert load is not None and load["age_s"] is not None
    return time.monotonic() - float(load["age_s"])


def new_window(proxy: Server) -> None:
    """Until the proxy has scraped the decode with a page asked for from now on, so that the
    decode's counters until now are out of its next window. Two scrapes: the first may have
    been asked for before now; the second was asked for after the first came back."""
    for _ in range(2):
        mark = time.monotonic()
        assert wait_for(lambda at=mark: scraped_at(proxy) > at, 2 * SCRAPE + 10, every=0.1)


def cached(answer: dict[str, Any]) -> int:
    """The prompt's tokens cached when it came, by the decode (--enable-prompt-tokens-details)."""
    tokens: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


def sources(decode: Server) -> tuple[float, float]:
    name = "vllm:prompt_tokens_by_source_total"
    return metric(decode, name, source="external_kv_transfer"), metric(
        decode, name, source="local_compute"
    )


def until(check: Any, seconds: float) -> float | None:
    """Seconds until ``check()`` was true, or None if it was not within ``seconds``."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def test_a_healthy_pair_reports_every_prompt_pulled(proof_cluster: ProofCluster) -> None:
    pulled, computed = sources(proof_cluster.decode)
    answers = [complete(proof_cluster.healthy.url) for _ in range(3)]
    prompts = sum(a["usage"]["prompt_tokens"] for a in answers)
    took = until(lambda: decode_state(proof_cluster.healthy) is not None, 2 * SCRAPE + 5)
    assert took is not None, "no judgment of the healthy pair"
    assert decode_state(proof_cluster.healthy) == {
        "pulled_share": 1.0, "recomputing": False, "since": None,
    }  # fmt: skip
    now_pulled, now_computed = sources(proof_cluster.decode)
    assert now_pulled - pulled == prompts and now_computed == computed
    # Each answer says it too: its whole prompt was cached when it came, and the proxy counts it.
    assert [cached(a) for a in answers] == [a["usage"]["prompt_tokens"] for a in answers]
    answered = decode_state(proof_cluster.healthy, "kv_answers")
    assert answered == {"cached_tokens_reported": True, "pulled": 3}, answered


def test_a_decode_recomputing_what_it_cannot_pull_is_reported(
    proof_cluster: ProofCluster, tmp_path: Path
) -> None:
    proxy, decode = proof_cluster.misled, proof_cluster.decode
    # The healthy pair's pulls just before must be out of this proxy's window: a window that
    # held them read 0.246 pulled once, and one holding all three with these three answers
    # would read 0.5, not recomputing, with no window of answers after it.
    new_window(proxy)
    pulled, computed = sources(decode)
    logged = proxy.logged()
    answers = [complete(proxy.url) for _ in range(3)]  # answered all the same: 200, no error
    answered = time.monotonic()
    prompts = sum(a["usage"]["prompt_tokens"] for a in answers)
    now_pulled, now_computed = sources(decode)
    assert now_pulled == pulled and now_computed - computed == prompts  # computed, not pulled
    assert [cached(a) for a in answers] == [0, 0, 0]  # fresh prompts, none of them pulled
    counted = decode_state(proxy, "kv_answers")
    assert counted == {"cached_tokens_reported": True, "recomputed": 3}, counted
    assert any("httpx" in agent for agent in proof_cluster.bootstrap.asked_by)
    recomputing = lambda: (decode_state(proxy) or {}).get("recomputing") is True  # noqa: E731
    # Two scrape intervals, and the time one scrape of a busy CPU vLLM's /metrics may take.
    took = until(recomputing, 2 * SCRAPE + 5)
    assert took is not None, ("not reported as recomputing", decode_state(proxy))
    print(f"\nreported recomputing {time.monotonic() - answered:.1f} s after the last answer")
    state = decode_state(proxy)
    assert state is not None and state["pulled_share"] < 0.5 and state["since"]
    said = proxy.said_since(logged)
    assert re.search(rf"decode {re.escape(decode.url)} computes the prompts it should pull", said)
    exported = http_get(f"{proxy.url}/metrics")[1]
    line = f'mooncake_proxy_decode_recomputing{{backend="{decode.url}"}} 1.0'
    assert line in exported, [x for x in exported.splitlines() if "recomputing" in x]
    alert_fires_on(tmp_path, decode.url)


def alert_fires_on(tmp_path: Path, backend: str) -> None:
    """The shipped alert, evaluated by promtool on the series the proxy exported: it fires
    once the series has said 1 for its "for"."""
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("MOONCAKE_PROXY_TEST_NEEDS_PROMETHEUS"), "promtool missing"
        pytest.skip("promtool is not installed here (apt-get install prometheus)")
    labels = f'job="mooncake-proxy", instance="proxy:8000", backend="{backend}"'
    test = {
        "rule_files": [str(ROOT / "deploy" / "prometheus-alerts.yml")],
        "evaluation_interval": "30s",
        "tests": [{
            "interval": "30s",
            "input_series": [
                {"series": f"mooncake_proxy_decode_recomputing{{{labels}}}", "values": "1x10"}
            ],
            "alert_rule_test": [{
                "eval_time": "3m",
                "alertname": "MooncakeProxyDecodeRecomputing",
                "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "job": "mooncake-proxy",
                                   "instance": "proxy:8000", "backend": backend},
                    "exp_annotations": {
                        "summary": f"decode {backend} computes the prompts it should pull "
                        "over Mooncake",
                        "runbook": "docs/operations.md#runbook: MooncakeProxyDecodeRecomputing",
                    },
                }],
            }],
        }],
    }  # fmt: skip
    (path := tmp_path / "recomputing.test.yml").write_text(json.dumps(test))  # YAML's subset
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_self_test_names_the_pair_that_does_not_move_kv(proof_cluster: ProofCluster) -> None:
    """Through each proxy, the PD self-test (POST /admin/self-test): the healthy one finds its
    pair pulling, the misled one names its pair and why (the decode computed the prompt)."""
    results = {}
    for name, proxy in (("healthy", proof_cluster.healthy), ("misled", proof_cluster.misled)):
        request = urllib.request.Request(f"{proxy.url}/admin/self-test", b"", method="POST")
        with urllib.request.urlopen(request, timeout=120) as answer:
            results[name] = json.loads(answer.read())
    (healthy,) = results["healthy"]["pairs"]
    assert results["healthy"]["ok"] and healthy["why"] == "pulled", healthy
    (misled,) = results["misled"]["pairs"]
    assert not results["misled"]["ok"] and not misled["ok"]
    assert misled["prefill"] == proof_cluster.prefill.url
    assert misled["decode"] == proof_cluster.decode.url
    assert misled["why"].startswith("the decode computed the prompt itself"), misled
