"""The front door, as a new user tries it (issue 49): --help on one screen and by group
(--version is in test_config.py), a taken port that says how to pick another, /healthcheck's
one-word status, and make demo: what it installs, and that no process outlives it whatever
signal stops it."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

import mooncake_proxy as mp
from testing_support import ROOT


def run_proxy(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "mooncake_proxy.py"), *argv],
        capture_output=True,
        text=True,
        timeout=20,
    )


# --- --help: one screen, every option by group or all at once


def group_flags(name: str) -> set[str]:
    settings = next(settings for named, _, settings in mp.FLAG_GROUPS if named == name)
    return {mp.SETTINGS_BY_NAME[setting].flag for setting in settings}


def flags_in(text: str) -> set[str]:
    """The settings' flags that the help lists as options (not in a command line's example)."""
    return set(re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE)) & {
        option.flag for option in mp.SETTINGS
    }


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_fits_a_screen_and_says_how_to_see_more(flag: str) -> None:
    shown = run_proxy(flag)
    assert shown.returncode == 0 and shown.stderr == ""
    lines = shown.stdout.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 88, shown.stdout
    assert lines[0].startswith("usage: mooncake-proxy --prefill URL [BOOTSTRAP] --decode URL")
    assert "disaggregation proxy for vLLM's MooncakeConnector" in shown.stdout
    # The README's command lines: one of each, several of each, a settings file.
    assert "  mooncake-proxy --prefill http://10.0.0.1:8100 8998 --decode http://" in shown.stdout
    assert "  mooncake-proxy --config /etc/mooncake-proxy/proxy.toml" in lines
    for name, about, _ in mp.FLAG_GROUPS:
        assert [line for line in lines if line.split() == [name, *about.split()]], name
    assert "--help=GROUP" in shown.stdout and "--help=all" in shown.stdout
    assert "--version" in shown.stdout
    assert not flags_in(shown.stdout)  # the options themselves are one step further


def test_help_all_is_every_option_in_its_group() -> None:
    shown = run_proxy("--help=all")
    assert shown.returncode == 0 and shown.stderr == ""
    assert flags_in(shown.stdout) == {option.flag for option in mp.SETTINGS}
    assert "  -h, --help[=GROUP]" in shown.stdout and "  --version " in shown.stdout
    for name, about, _ in mp.FLAG_GROUPS:
        assert f"\n{name}: {about}:\n" in shown.stdout
    assert run_proxy("-h", "ALL").stdout == shown.stdout  # -h takes it too, in any case


@pytest.mark.parametrize(
    ("asked", "name"),
    [
        ("fleet", "Fleet"),
        ("LIMITS", "Limits"),
        ("kv_events", "KV-events"),
        ("KV-Events", "KV-events"),
    ],
)
def test_help_of_a_group_is_its_options_alone(asked: str, name: str) -> None:
    shown = run_proxy(f"--help={asked}")
    assert shown.returncode == 0 and shown.stderr == ""
    assert flags_in(shown.stdout) == group_flags(name)
    assert shown.stdout.startswith("usage: mooncake-proxy --prefill URL [BOOTSTRAP]")
    assert "--help=all" in shown.stdout  # how to see the rest
    assert run_proxy("--help", asked).stdout == shown.stdout


@pytest.mark.parametrize("asked", ["nope", "", "--port"])
def test_an_unknown_group_is_one_line_naming_the_groups(asked: str) -> None:
    shown = run_proxy(f"--help={asked}")
    assert shown.returncode == 2 and shown.stdout == ""
    (line,) = shown.stderr.splitlines()
    assert line.startswith(f"mooncake-proxy: error: --help={asked}: no such group")
    for name, _, _ in mp.FLAG_GROUPS:
        assert name in line
    assert "all" in line


# --- a taken port


def ipv6_loopback() -> bool:
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(
    ("host", "workers", "where"),
    [("127.0.0.1", "1", "127.0.0.1"), ("127.0.0.1", "2", "127.0.0.1"), ("::1", "1", "[::1]")],
)
def test_a_taken_port_is_one_line_saying_how_to_pick_another(
    host: str, workers: str, where: str
) -> None:
    if ":" in host and not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as taken:
        taken.bind((host, 0))
        taken.listen()
        port = taken.getsockname()[1]
        shown = run_proxy(
            *("--host", host, "--port", str(port), "--workers", workers),
            *("--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"),
        )
    assert shown.returncode == 1 and shown.stdout == ""
    (line,) = shown.stderr.splitlines()
    assert line.startswith(f"mooncake-proxy: error: cannot listen on {where}:{port}: "), line
    assert "in use" in line and "another mooncake-proxy" in line
    assert "pass --port N" in line and "--port 0 for any free one" in line
