"""The real-vLLM suite's servers and the helpers that read them: a vLLM server on the CPU with
Mooncake (its command line, start, stop, log) and plain HTTP to it and to the proxy.

Kept apart from the tests, with nothing beyond the standard library and the fakes' free_port,
so that a benchmark can start real servers (bench/bench_local_prefill.py) from a venv without
the integration suite's own packages (openai, pytest).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROXY = HERE.parent / "mooncake_proxy.py"
sys.path.insert(0, str(HERE.parent / "tests"))
from fake_vllm import free_port  # noqa: E402  (ports vLLM's own start-up cannot take)

MODEL = "tiny"
# The prefill accepts shorter prompts than the decode: a prompt between the two is rejected by
# the prefill alone, the one case where only fail-fast saves the client from the KV timeout.
PREFILL_MAX_MODEL_LEN = 384
DECODE_MAX_MODEL_LEN = 512
KV_ABORT_TIMEOUT = 30  # seconds; a broken proxy's stranded requests clear this fast


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def http_call(
    base: str, method: str, path: str, body: Any = None, timeout: float = 60
) -> tuple[int, str, bytes]:
    """Status, Content-Type and body of one request, error statuses included."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(base + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    url: str
    bootstrap_port: int | None = None
    process: subprocess.Popen[bytes] | None = None
    kv_events: list[str] = field(default_factory=list)  # the proxy's --kv-events entry for it
    model: str = MODEL  # the name it serves its model under (--served-model-name)

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: vLLM forks engine workers
            )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
            self.process.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    @contextmanager
    def engine_paused(self) -> Iterator[None]:
        """Its engine stopped (SIGSTOP to the EngineCore and Worker processes) while its API
        server goes on: requests sent meanwhile are taken, tokenized and queued, and none is
        scheduled, so a decode pulls no KV, until the engine goes on where it stood."""
        assert self.process is not None
        engine = [pid for pid in in_group(self.process.pid) if comm(pid).startswith("VLLM::")]
        assert engine, f"{self.name}: no VLLM:: engine process in its group"
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in engine:
                os.kill(pid, signal.SIGCONT)

    def wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log}\n{self.tail()}")
            try:
                if http_get(f"{self.url}/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {seconds} s: {self.log}\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def logged(self) -> int:
        """Where its log ends now: what it says from here on can be read with `said_since`."""
        return self.log.stat().st_size

    def said_since(self, offset: int) -> str:
        with self.log.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def warm_up(self) -> None:
        """One request of its own: a CPU vLLM's first ones are slow (the proxy's health checks
        timed out on them), and the tests' requests should not be those."""
        body = {"model": self.model, "prompt": "warm up", "max_tokens": 2}
        status, _, answer = http_call(self.url, "POST", "/v1/completions", body, timeout=120)
        if status != 200:
            raise RuntimeError(f"{self.name} failed its warm-up ({status}): {answer[:200]!r}")


def in_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (Linux: read from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except ProcessLookupError:
                pass
    return members


def comm(pid: int) -> str:
    """The name a process gave itself (vLLM names its engine processes VLLM::EngineCore and
    VLLM::Worker)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def proxy_server(
    name: str, logs: Path, prefill: Server, decode: Server, *extra: str, bootstrap: str = ""
) -> Server:
    """The proxy as the suite starts it in front of ``prefill`` (told ``bootstrap``, else its
    own bootstrap port) and ``decode``: no self-test at start (the suite counts what each
    server computed), and slack for a loaded 2-core machine, whose vLLM servers once took
    over 5 s to accept a connection and over 3 s to answer their checks."""
    port = free_port()
    argv = [sys.executable, str(PROXY), "--port", str(port), "--decode", decode.url]
    argv += ["--no-start-self-test", "--prefill", prefill.url]
    argv += [bootstrap or str(prefill.bootstrap_port)]
    argv += ["--connect-timeout", "30", "--health-timeout", "10", *extra]
    return Server(name, argv, dict(os.environ), logs / f"{name}.log", f"http://127.0.0.1:{port}")


def bring_up(engines: Sequence[Server], proxies: Sequence[Server]) -> None:
    """Start them all: each vLLM server healthy and warmed up, then each proxy healthy."""
    for server in (*engines, *proxies):
        server.start()
    for server in engines:
        server.wait_healthy(300)
        server.warm_up()
    for proxy in proxies:
        proxy.wait_healthy(60)
        wait_all_checked(proxy)


def wait_all_checked(proxy: Server) -> None:
    """Until the proxy uses every server it was given: its /health says 200 once it has one
    prefill engine and one decode, while a check of another may still be under way (on CI
    one took over 3 s), and a test would find that one, or its model, missing."""
    ok = lambda: healthcheck(proxy.url)["status"] == "ok"  # noqa: E731
    assert wait_for(ok, 60), healthcheck(proxy.url)


# The one failure a test may meet and go on: on these loaded 2-core machines Mooncake's TCP
# transport now and then stalls one transfer for its whole timeout, whichever server it came
# from; the decode logs one of these and fails the request. Anything else fails the test.
STALL_SIGNATURES = (
    "no transfer progress within",
    "Mooncake transfer engine returned -1",
    "Sync batch data transfer timeout",
)


def stall_in(decode: Server, since: int) -> str | None:
    """The stall signature the decode logged after `since`, if any."""
    said = decode.said_since(since)
    return next((s for s in STALL_SIGNATURES if s in said), None)


def vllm_server(
    root: Path,
    logs: Path,
    role: str,
    max_len: int,
    *extra: str,
    name: str | None = None,
    model: str = MODEL,
    kv_config: dict[str, Any] | None = None,
) -> Server:
    """A vLLM server of ``role`` (kv_producer, kv_consumer); ``kv_config``: fields added to
    its --kv-transfer-config (kv_load_failure_policy, say)."""
    port, bootstrap = free_port(), free_port()
    libs = f"{root}/sysroot/usr/lib/x86_64-linux-gnu:{root}/sysroot/lib/x86_64-linux-gnu"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": libs,
        "PYTHONPATH": f"{root}/shim",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Without these vLLM pins every worker to core 0 and Mooncake transfers crawl.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap),
        "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": str(KV_ABORT_TIMEOUT),
    }
    kv_config = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_module_path": "cpu_mooncake_shim",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        **(kv_config or {}),
    }
    argv = [
        f"{root}/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", f"{root}/tiny", "--served-model-name", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_len), "--dtype", "float32", "--enforce-eager",
        "--kv-transfer-config", json.dumps(kv_config), *extra,
    ]  # fmt: skip
    name = name or role
    url = f"http://127.0.0.1:{port}"
    return Server(name, argv, env, logs / f"{name}.log", url, bootstrap, model=model)


def metric(server: Server, name: str, timeout: float = 5, **labels: str) -> float:
    """The sum of a Prometheus series on a vLLM server, over the lines matching labels."""
    text = http_get(f"{server.url}/metrics", timeout)[1]
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def running(server: Server) -> float:
    return metric(server, "vllm:num_requests_running")


def unique_prompt(words: int = 12) -> str:
    # A fresh start for every prompt: no prefix-cache hit can stand in for a transfer.
    nonce = " ".join(uuid.uuid4().hex[:8])
    return f"{nonce} " + " ".join(["the proxy sends the prompt to the prefill"] * (words // 8 + 1))


def wait_for(check: Any, seconds: float, every: float = 0.2) -> bool:
    """Whether ``check()`` came true within ``seconds``. A check that cannot reach its server
    (an OSError: a /metrics page over its timeout on a loaded machine) is not true yet."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if answered(check):
            return True
        time.sleep(every)
    return answered(check)


def answered(check: Any) -> bool:
    try:
        return bool(check())
    except OSError:
        return False


def healthcheck(base: str) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads(http_get(f"{base}/healthcheck")[1])
    return payload
