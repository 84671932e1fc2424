"""Pure functions of mooncake_proxy: how the legs' bodies and headers are rewritten, how
vLLM's discovery answers are read, and how the configuration (flags, environment) is taken
and refused; the daemon's own exits on bad configuration."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from multidict import CIMultiDict
from yarl import URL

import mooncake_proxy as mp
from testing_support import ROOT, SPEC, chat, completion

# --- pure functions: body rewriting


def test_prefill_body_is_hardened_so_its_kv_is_always_sent() -> None:
    body = completion(
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=100,
        max_completion_tokens=100,
        min_tokens=5,
        stop=["the"],
        stop_token_ids=[2],
        ignore_eos=False,
        temperature=0.3,
        kv_transfer_params={"remote_bootstrap_addr": "http://evil:1"},
    )
    original = json.loads(json.dumps(body))
    prefill = mp.prefill_body(body, "xfer-abc")
    assert prefill == {
        "model": "fake-model",
        "prompt": "Tell me about KV caches",
        "temperature": 0.3,
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "ignore_eos": True,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": "xfer-abc",
        },
    }
    assert body == original  # the decode leg still needs the client's own values


def test_prefill_body_adds_max_completion_tokens_only_where_present() -> None:
    assert "max_completion_tokens" not in mp.prefill_body(completion(), "x")


def test_decode_body_names_the_chosen_engine_and_keeps_stream_flags() -> None:
    instance = mp.PrefillInstance(mp.PrefillSpec(URL("http://p:1"), URL("http://[::1]:8998")))
    engine = mp.PrefillEngine(instance, dp_rank=1, engine_id="e_dp1")
    body = chat(stream=True, stream_options={"include_usage": True}, kv_transfer_params={"x": 1})
    decode = mp.decode_body(body, engine, "xfer-1")
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    assert decode["max_tokens"] == 8
    assert decode["kv_transfer_params"] == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://[::1]:8998",
        "remote_engine_id": "e_dp1",
        "transfer_id": "xfer-1",
    }


@pytest.mark.parametrize(
    "body",
    [
        completion(stream=True, stop=["."], stream_options={"include_usage": True}),
        {"max_tokens": 3},  # nothing but fields the legs set
        {"prompt": "only a prompt"},
        {},
    ],
)
def test_a_large_bodys_legs_are_the_same_objects_in_pieces(body: dict[str, Any]) -> None:
    """Both legs send one encoding of the fields neither changes, then their own: what vLLM
    parses is the leg's body, whichever fields the client sent."""
    shared = mp.SharedBody.of(body)
    engine = mp.PrefillEngine(mp.PrefillInstance(SPEC), 0, "engine-0")
    for leg in (
        mp.prefill_body(body, "xfer-1"),
        mp.decode_body(body, engine, "xfer-1"),
        mp.alone_body({**body, "kv_transfer_params": {"from": "the client"}}),
    ):
        assert json.loads(b"".join(shared.with_fields(leg))) == leg


def test_request_ids_are_random_and_keep_a_safe_client_id_as_prefix() -> None:
    ids = {mp.mint_request_id(None) for _ in range(1000)}
    assert len(ids) == 1000
    a, b = mp.mint_request_id("trace-7"), mp.mint_request_id("trace-7")
    assert a != b and a.startswith("trace-7-") and b.startswith("trace-7-")
    assert mp.transfer_id_for(a) == f"xfer-{a}"
    # Ids that could smuggle anything into logs or headers are not kept.
    assert "\n" not in mp.mint_request_id("a\nb") and " " not in mp.mint_request_id("a b")
    assert not mp.mint_request_id("x" * 65).startswith("x")


def test_upstream_headers_drop_hop_by_hop_and_client_dp_rank() -> None:
    client = {
        "Host": "proxy:8000",
        "Connection": "keep-alive, X-Secret-Hop",
        "X-Secret-Hop": "1",
        "Keep-Alive": "timeout=5",
        "Transfer-Encoding": "chunked",
        "Content-Length": "10",
        "Content-Type": "text/plain",
        "Accept-Encoding": "gzip",
        "X-data-parallel-rank": "7",
        "X-Request-Id": "client-id",
        "Authorization": "Bearer client-key",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    }
    plain = mp.ProxyConfig(prefills=(SPEC,), decodes=(URL("http://d:1"),))
    headers = mp.upstream_headers(client, "rid", plain)
    assert headers == {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "Content-Type": "application/json",
        "User-Agent": mp.USER_AGENT,
        "X-Request-Id": "rid",
        "Authorization": "Bearer client-key",
    }
    # A client's own User-Agent goes on, under whatever case it came in.
    named = mp.upstream_headers(CIMultiDict({"user-agent": "curl/8"}), "rid", plain)
    assert named["user-agent"] == "curl/8" and "User-Agent" not in named
    upstream_key = dataclasses.replace(plain, upstream_api_key="up-key")
    assert mp.upstream_headers(client, "rid", upstream_key)["Authorization"] == "Bearer up-key"
    assert "Authorization" not in mp.upstream_headers({}, "rid", plain)
    # A key meant for the proxy is not forwarded to vLLM; the upstream key is, if set.
    inbound_key = dataclasses.replace(plain, api_key="proxy-key")
    assert "Authorization" not in mp.upstream_headers(client, "rid", inbound_key)
    both = dataclasses.replace(inbound_key, upstream_api_key="up-key")
    assert mp.upstream_headers(client, "rid", both)["Authorization"] == "Bearer up-key"


# --- pure functions: discovery answers, selection, configuration


def test_parse_engine_ids_orders_ranks_and_ignores_extra_keys() -> None:
    payload = {
        "1": {"engine_id": "e_dp1", "worker_addr": {}, "tp_size": 2},
        "0": {"engine_id": "e_dp0", "shard_info": [1]},
        "version": "0.34",
    }
    assert mp.parse_engine_ids(payload) == ("e_dp0", "e_dp1")
    assert mp.parse_engine_ids({}) == ()


@pytest.mark.parametrize(
    "payload",
    [[], {"0": {"engine_id": 5}}, {"0": {}}, {"1": {"engine_id": "x"}}, {"0": "e"}],
)
def test_parse_engine_ids_rejects_malformed_answers(payload: Any) -> None:
    with pytest.raises(ValueError):
        mp.parse_engine_ids(payload)


def test_round_robin_visits_every_prefill_rank_in_order_then_wraps() -> None:
    config = mp.ProxyConfig(
        prefills=(
            mp.PrefillSpec(URL("http://a:1"), URL("http://a:8998")),
            mp.PrefillSpec(URL("http://b:1"), URL("http://b:8998")),
        ),
        decodes=(URL("http://d1:1"), URL("http://d2:1")),
        prefill_policy=mp.Policy.ROUND_ROBIN,
        decode_policy=mp.Policy.ROUND_ROBIN,
    )
    fleet = mp.Fleet(config)
    for backend in (*fleet.prefills, *fleet.decodes):
        backend.check_passed(healthy_after=1)
    fleet.set_engines(fleet.prefills[1], ["b0"])
    fleet.set_engines(fleet.prefills[0], ["a0", "a1"])
    # Load does not matter to round robin: claims are never released here.
    picks = [
        (str(e.url), e.dp_rank, e.engine_id) for e in (fleet.claim_prefill() for _ in range(7))
    ]
    assert picks == [
        ("http://a:1", 0, "a0"),
        ("http://a:1", 1, "a1"),
        ("http://b:1", 0, "b0"),
        ("http://a:1", 0, "a0"),
        ("http://a:1", 1, "a1"),
        ("http://b:1", 0, "b0"),
        ("http://a:1", 0, "a0"),
    ]
    assert [str(fleet.claim_decode().url) for _ in range(3)] == [
        "http://d1:1",
        "http://d2:1",
        "http://d1:1",
    ]


def parse_cli(*argv: str) -> mp.ProxyConfig:
    return mp.load_config(mp.build_parser(), argv, {})


def test_cli_accepts_every_form_of_vllms_example_proxy() -> None:
    config = parse_cli(
        "--host", "0.0.0.0", "--port", "8192",
        "--prefill", "http://10.0.0.1:8100",
        "--prefill", "http://10.0.0.1:8101", "8999",
        "--prefill", "http://10.0.0.2:8100", "http://10.0.0.9:9000",
        "--prefill", "http://[fd00::2]:8100", "none",
        "--decode", "http://10.0.0.3:8200", "http://10.0.0.4:8200",
        "--decode", "https://10.0.0.5:8200/",
    )  # fmt: skip
    assert (config.host, config.port) == ("0.0.0.0", 8192)
    assert [(str(p.url), p.bootstrap_addr) for p in config.prefills] == [
        ("http://10.0.0.1:8100", "http://10.0.0.1:8998"),
        ("http://10.0.0.1:8101", "http://10.0.0.1:8999"),
        ("http://10.0.0.2:8100", "http://10.0.0.9:9000"),
        ("http://[fd00::2]:8100", "http://[fd00::2]:8998"),
    ]
    assert [str(u) for u in config.decodes] == [
        "http://10.0.0.3:8200",
        "http://10.0.0.4:8200",
        "https://10.0.0.5:8200",
    ]


def test_cli_defaults_are_the_example_proxys_and_streams_have_no_total_timeout() -> None:
    config = parse_cli("--prefill", "http://p:1", "--decode", "http://d:1")
    assert (config.host, config.port) == ("127.0.0.1", 8000)
    assert config.request_timeout is None
    assert config.max_connections == 0
    assert config.keepalive_timeout < 5
    assert config.max_request_bytes == 100 * 1024 * 1024


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "mooncake_proxy.py"), *argv],
        capture_output=True,
        text=True,
        timeout=20,
        env=env,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode", "http://d:1"], "at least one --prefill URL (or --prefill-dns name)"),
        (["--prefill", "http://p:1"], "at least one --decode URL (or --decode-dns name)"),
        (
            ["--prefill-dns", "vllm-prefill:8100:70000", "--decode", "http://d:1"],
            "--prefill-dns 'vllm-prefill:8100:70000': expected NAME:PORT[:BOOTSTRAP_PORT]",
        ),
        (
            ["--prefill", "http://p:1", "--decode-dns", "vllm-decode:8200:8998"],
            "--decode-dns 'vllm-decode:8200:8998': expected NAME:PORT",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--dns-server", "dns.local"],
            "--dns-server 'dns.local': expected the IP address of a DNS server",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--config", "/no/such.toml"],
            "cannot read --config /no/such.toml: No such file or directory",
        ),
        (
            ["--prefill", "p:1", "--decode", "http://d:1"],
            "--prefill 'p:1': expected http(s)://host:port",
        ),
        (["--prefill", "ftp://p:1", "--decode", "http://d:1"], "--prefill 'ftp://p:1': expected"),
        (["--prefill", "http://p", "--decode", "http://d:1"], "--prefill 'http://p': expected"),
        (
            ["--prefill", "http://p:1/v1", "--decode", "http://d:1"],
            "with no path, query or credentials",
        ),
        (
            ["--prefill", "http://p:70000", "--decode", "http://d:1"],
            "--prefill 'http://p:70000': expected",
        ),
        (
            ["--prefill", "http://p:1", "99999", "--decode", "http://d:1"],
            "bootstrap port must be 1-65535",
        ),
        (
            ["--prefill", "http://p:1", "bogus", "--decode", "http://d:1"],
            "http://p:1 BOOTSTRAP 'bogus': expected",
        ),
        (
            ["--prefill", "http://p:1", "1", "2", "--decode", "http://d:1"],
            "--prefill takes URL [BOOTSTRAP], got 'http://p:1 1 2'",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:0"],
            "--decode 'http://d:0': expected http(s)://host:port (port 0 is out of range)",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--port", "x"],
            "--port 'x': expected a whole number",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--upstream-api-key", "k\nX: 1"],
            "error: --upstream-api-key: expected one line of text",  # the key itself not shown
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--port", "70000"],
            "--port '70000': expected a port, 0-65535",
        ),
        (
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--no-such-flag"],
            "unrecognized arguments: --no-such-flag",
        ),
    ],
)
def test_bad_configuration_exits_at_once_with_one_line(argv: list[str], message: str) -> None:
    started = time.monotonic()
    result = run_cli(*argv)
    assert result.returncode != 0
    assert time.monotonic() - started < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "error" in lines[0]
    # The message a user needs: what was wrong, and which flag said it.
    assert lines[0].startswith("mooncake-proxy: error: ") and message in lines[0], lines[0]
    assert result.stdout == ""


def test_port_in_use_exits_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli(
            "--port", str(port), "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"
        )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], result.stderr


def test_version_and_help() -> None:
    assert mp.ID == "inferlab-vllm-mooncake-proxy" and mp.VERSION == 1
    version = run_cli("--version")
    assert version.returncode == 0
    # One line, one name: the command's, and its package release.
    assert version.stdout == f"mooncake-proxy {mp.__version__}\n"
    assert "version = attr: mooncake_proxy.__version__" in (ROOT / "setup.cfg").read_text()
    help_text = run_cli("--help=all").stdout
    # Each setting is declared once, on its field: its flag, help and variable come from there.
    fields = {f.name for f in dataclasses.fields(mp.ProxyConfig)}
    assert {option.name for option in mp.SETTINGS} == fields - {
        "upstream_api_key_source",
        "shadowed",
    }
    for option in mp.SETTINGS:
        assert f"  {option.flag} " in help_text and option.help
        assert option.env == "MOONCAKE_PROXY_" + option.flag[2:].replace("-", "_").upper()
    assert "--prefill URL [BOOTSTRAP]\n" in help_text and "BOOTSTRAP ..." not in help_text
    assert "(default: None)" not in help_text and "(default: [])" not in help_text
    assert "(default: 127.0.0.1)" in help_text


def test_a_missing_dependency_is_one_line_saying_what_to_install() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import runpy, sys; sys.modules['aiohttp'] = None; sys.argv = ['mooncake_proxy.py']; "
            f"runpy.run_path({str(ROOT / 'mooncake_proxy.py')!r}, run_name='__main__')",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "mooncake-proxy: error: the Python package 'aiohttp' is not installed; install the proxy "
        "first: pip install . (or pip install -r requirements.txt)"
    ]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            [],
            {"MOONCAKE_PROXY_MAX_RETRIES": "abc"},
            "MOONCAKE_PROXY_MAX_RETRIES='abc': expected a whole number",
        ),
        (
            [],
            {"MOONCAKE_PROXY_HEALTH_TIMEOUT": "soon"},
            "MOONCAKE_PROXY_HEALTH_TIMEOUT='soon': expected a number",
        ),
        (
            [],
            {"MOONCAKE_PROXY_POLICY": "random"},
            "MOONCAKE_PROXY_POLICY='random': expected one of",
        ),
        (
            ["--api-key", "k"],
            {"MOONCAKE_PROXY_PROTECT_METRICS": "maybe"},
            "MOONCAKE_PROXY_PROTECT_METRICS='maybe'",
        ),
        (["--protect-metrics"], {}, "--protect-metrics needs --api-key"),
        (["--decode", "http://d:1"], {}, "--decode http://d:1 is given twice"),
        (["--prefill", "http://p:1/", "9000"], {}, "--prefill http://p:1 is given twice"),
    ],
    ids=["int", "float", "choice", "bool", "protect-metrics", "decode-twice", "prefill-twice"],
)
def test_configuration_mistakes_are_one_line_naming_the_source(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    base = ["--prefill", "http://p:1", "--decode", "http://d:1"]
    result = run_cli(*base, *argv, env={**os.environ, **env})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("mooncake-proxy: error: ") and message in line, line


def test_openai_api_key_is_never_the_upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "the-sdk-key")
    config = parse_cli("--prefill", "http://p:1", "--decode", "http://d:1")
    assert config.upstream_api_key is None
    assert "clients' Authorization is forwarded" in config.describe()
    assert upstream_authorization_of(config, "Bearer client-key") == "Bearer client-key"
    keyed = parse_cli(
        "--prefill", "http://p:1", "--decode", "http://d:1", "--upstream-api-key", "vllm-key"
    )  # fmt: skip
    assert "upstream key from --upstream-api-key" in keyed.describe()
    assert "vllm-key" not in keyed.describe()


def upstream_authorization_of(config: mp.ProxyConfig, client_header: str) -> str | None:
    return mp.upstream_authorization({"Authorization": client_header}, config)
