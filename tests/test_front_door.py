"""The front door, as a new user tries it (issue 49): --help on one screen and by group
(--version is in test_config.py), a taken port that says how to pick another, /healthcheck's
one-word status, and make demo: what it installs, and that no process outlives it whatever
signal stops it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pytest_aiohttp import AiohttpServer

import mooncake_proxy as mp
from fake_vllm import free_port
from testing_support import (
    COMPLETIONS,
    ROOT,
    Cluster,
    ProxyProcess,
    StartCluster,
    completion,
)


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


# --- /healthcheck's status: one word for the page's many


async def health(cluster: Cluster) -> tuple[int, dict[str, Any]]:
    answer = await cluster.client.get("/healthcheck")
    return answer.status, await answer.json()


async def until_status(cluster: Cluster, wanted: str) -> tuple[int, dict[str, Any]]:
    async with asyncio.timeout(10):
        while (seen := await health(cluster))[1]["status"] != wanted:
            await asyncio.sleep(0.02)
    return seen


QUICK_CHECKS = {"health_interval": 0.05, "discovery_interval": 0.05}


async def test_healthcheck_status_is_ok_when_every_instance_serves(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(prefill_dp=(2, 1), decodes=2)
    code, page = await health(cluster)
    assert code == 200 and page["status"] == "ok" and page["ready"] is True
    assert next(iter(page)) == "status"  # the first thing a reader of the page sees


async def test_healthcheck_status_is_degraded_while_an_instance_is_out(
    start_cluster: StartCluster,
) -> None:
    """One decode of two down: requests are served, by the other, and the page says so."""
    cluster = await start_cluster(decodes=2, **QUICK_CHECKS)
    await cluster.kill(cluster.decodes[1])
    code, page = await until_status(cluster, "degraded")
    assert code == 200 and page["ready"] is True
    assert [d["usable"] for d in page["decode"]] == [True, False] and not page["panic"]
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200
    await cluster.start_again(cluster.decodes[1])
    assert (await until_status(cluster, "ok"))[0] == 200


async def test_healthcheck_status_is_degraded_in_a_panic(start_cluster: StartCluster) -> None:
    """Every decode only times out its checks: they serve on (a panic), and that is no health."""
    cluster = await start_cluster(decodes=2, health_timeout=0.5, **QUICK_CHECKS)
    for decode in cluster.decodes:
        decode.health_delay = 2.0
    async with asyncio.timeout(10):
        while not (page := (await health(cluster))[1])["panic"]:
            await asyncio.sleep(0.02)
    code, page = await health(cluster)
    assert code == 200 and page["status"] == "degraded" and page["panic"] == ["decode"]
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 200


async def test_healthcheck_status_is_degraded_while_a_model_has_no_decode(
    start_cluster: StartCluster,
) -> None:
    """Every instance usable, but model b's prefill has no decode of model b: b's requests get
    503 while a's are served."""
    cluster = await start_cluster(
        prefill_dp=(1, 1),
        decodes=2,
        each_prefill=({"model": "tiny-a"}, {"model": "tiny-b"}),
        each_decode=({"model": "tiny-a"}, {"model": "tiny-a"}),
        **QUICK_CHECKS,
    )
    code, page = await until_status(cluster, "degraded")
    assert code == 200 and all(i["usable"] for i in (*page["prefill"], *page["decode"]))
    assert not page["panic"]
    a, b = (completion(model=model) for model in ("tiny-a", "tiny-b"))
    assert (await cluster.client.post(COMPLETIONS, json=a)).status == 200
    assert (await cluster.client.post(COMPLETIONS, json=b)).status == 503


async def test_healthcheck_status_is_unavailable_without_a_usable_decode(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(**QUICK_CHECKS)
    await cluster.kill(cluster.decodes[0])
    code, page = await until_status(cluster, "unavailable")
    assert code == 503 and page["ready"] is False and page["draining"] is False
    assert (await cluster.client.post(COMPLETIONS, json=completion())).status == 503


async def test_healthcheck_status_is_unavailable_while_draining(
    aiohttp_server: AiohttpServer,
) -> None:
    """SIGTERM with a stream in flight: the proxy drains, and its page says unavailable."""
    proxy, _ = await ProxyProcess.start(aiohttp_server, decode={"token_delay": 0.1})
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(20):
            page_url = f"{proxy.base}/healthcheck"
            async with session.get(page_url) as before:
                assert before.status == 200 and (await before.json())["status"] == "ok"
            body = completion(stream=True, max_tokens=15)
            async with session.post(f"{proxy.base}/v1/completions", json=body) as stream:
                await stream.content.readany()
                proxy.process.send_signal(signal.SIGTERM)
                await proxy.log.wait_for("SIGTERM: draining")
                fresh = aiohttp.TCPConnector(force_close=True)  # a new connection
                async with (
                    aiohttp.ClientSession(connector=fresh) as other,
                    other.get(page_url) as during,
                ):
                    page = await during.json()
                    assert during.status == 503 and page["draining"] is True
                    assert page["status"] == "unavailable"
                await stream.read()
    finally:
        await proxy.stop()


# --- make demo: a taken port; whatever signal stops it, nothing of it is left


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """A process's state, parent and start time (in clock ticks since boot); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1]), int(fields[19])


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) and stat[1] == pid:
            found.append(int(entry.name))
    return found


def tree(pid: int) -> dict[int, int]:
    """``pid`` and its descendants, each with its start time (a pid used again is not it)."""
    found, todo = {}, [pid]
    while todo:
        current = todo.pop()
        if (stat := proc_stat(current)) is not None:
            found[current] = stat[2]
            todo += children(current)
    return found


def alive(pid: int, started: int) -> bool:
    """Not gone, nor a zombie (a container's init may never reap one whose parent died)."""
    stat = proc_stat(pid)
    return stat is not None and stat[2] == started and stat[0] not in "ZX"


def accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def wait_until(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_make_demo(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``make demo ARGS=...`` as a terminal's foreground job (a process group of its own), in
    this test's venv, which it does not install into; what it prints goes to files (a pipe
    would be held open by whatever outlived it)."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    venv = Path(sys.prefix)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out, err = tmp_path / "demo.out", tmp_path / "demo.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        make = subprocess.Popen(
            ["make", "-s", "-C", str(ROOT), "-o", f"{venv}/.installed-run", "demo",
             f"VENV={venv}", f"ARGS={' '.join(args)}"],
            stdout=stdout, stderr=stderr, env=env, start_new_session=True,
        )  # fmt: skip
    return make, out, err


SIGNALS = [
    # Ctrl-C: the terminal sends SIGINT to its foreground job, make, the demo and the proxy.
    ("Ctrl-C", "job", signal.SIGINT),
    # A closed terminal: SIGHUP to the job (the shell passes its own on).
    ("hangup", "job", signal.SIGHUP),
    # kill, timeout, a supervisor: to make alone, which passes SIGTERM on to its commands.
    ("kill make", "make", signal.SIGTERM),
    # make killed at once: the demo hears of it by PR_SET_PDEATHSIG, and stops.
    ("kill -9 make", "make", signal.SIGKILL),
    # To the demo alone.
    ("kill -INT demo", "demo", signal.SIGINT),
    ("kill demo", "demo", signal.SIGTERM),
    ("kill -HUP demo", "demo", signal.SIGHUP),
    # The demo killed at once: the proxy hears of it by PR_SET_PDEATHSIG; the fakes were in it.
    ("kill -9 demo", "demo", signal.SIGKILL),
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("case", "to", "signum"), SIGNALS, ids=[case for case, _, _ in SIGNALS])
def test_make_demo_stopped_by_a_signal_leaves_nothing_behind(
    tmp_path: Path, case: str, to: str, signum: signal.Signals
) -> None:
    port = free_port()
    make, out, err = start_make_demo(tmp_path, "--port", str(port))
    try:
        # Serving, after its streamed request: make, the demo, the proxy.
        assert wait_until(lambda: b"keeps serving" in out.read_bytes(), 60), err.read_text()
        processes = tree(make.pid)
        (demo,) = children(make.pid)
        assert len(children(demo)) == 1 and len(processes) == 3, processes  # and the proxy
        started = re.search(r"^starting: python (.*)$", out.read_text(), re.MULTILINE)
        assert started, out.read_text()
        ports = [int(p) for p in re.findall(r"(?:127\.0\.0\.1:| )(\d{4,5})\b", started[1])]
        assert port in ports and len(ports) == 7  # the proxy's, 4 APIs, 2 bootstrap servers
        assert all(map(accepts, ports))
        if to == "job":
            os.killpg(make.pid, signum)
        else:
            os.kill(make.pid if to == "make" else demo, signum)

        def left() -> list[int]:
            return [pid for pid, since in processes.items() if alive(pid, since)]

        assert wait_until(lambda: not left(), 20), f"{case}: still running: {left()}"
        assert not [p for p in ports if accepts(p)], f"{case}: still listening"
        make.wait(5)
    finally:  # whatever is left of its process group, make gone or not
        with contextlib.suppress(ProcessLookupError):
            os.killpg(make.pid, signal.SIGKILL)
        make.wait(5)
    assert "Traceback" not in err.read_text()


def test_make_demo_on_a_taken_port_says_how_to_pick_another(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        make, out, err = start_make_demo(tmp_path, "--once", "--port", str(port))
        try:
            assert make.wait(30) != 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(make.pid, signal.SIGKILL)
    said = [line for line in err.read_text().splitlines() if line.startswith("demo: ")]
    assert said == [
        f"demo: cannot listen on 127.0.0.1:{port}: the port is in use (another demo, proxy or "
        'vLLM is listening there); run make demo ARGS="--port N" for another port, or '
        'ARGS="--port 0" for any free one'
    ]
    assert "starting:" not in out.read_text()  # nothing was
