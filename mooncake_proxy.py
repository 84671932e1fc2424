"""mooncake-proxy: a prefill/decode (PD) disaggregation proxy for vLLM's MooncakeConnector.

Clients send ordinary OpenAI requests (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``, and vLLM's token-in/token-out ``/inference/v1/generate``). For each
one the proxy picks a prefill engine (a prefill instance and one of its data-parallel ranks) and
a decode instance, mints a unique ``transfer_id`` and sends both legs at once: the prefill
computes the prompt's KV cache with ``max_tokens`` 1, the decode pulls that KV through Mooncake
and streams the answer, which the proxy passes to the client byte for byte. A prefill that fails
fails the request at once instead of leaving the decode waiting for vLLM's 480 s KV timeout.

Run it as vLLM's example proxy is run::

    python mooncake_proxy.py --host 0.0.0.0 --port 8000 \\
        --prefill http://10.0.0.1:8100 8998 --decode http://10.0.0.3:8200

``python mooncake_proxy.py --help`` is one screen, ``--help=all`` every flag; docs/ the manual.

The module, in chapters in the order a request travels (each opens with a banner saying what
it holds and which chapters it uses; tests/test_module_shape.py checks those)::

     1. Identity and defaults     names, version, wire constants
     2. Configuration             ProxyConfig (frozen), its SETTINGS, flags/env/TOML loading
     3. Errors and state          ProxyError (status + OpenAI type), the failure vocabulary
                                  (Unreachable, KvLoadFailed, StreamCut), ProxyState
     4. The front door            the middleware and the handlers; a request starts here
     5. The plan and admission    the API table (Api), Plan and plan_request; Admission
     6. The run                   run_pd_request: the protocol's steps; Exchange, Tries and
                                  Attempt (failover), the prefill beside the decode, the legs'
                                  bodies and headers
     7. The stream                the relay (relay_body, DecodeRelay); a stream going on
                                  elsewhere (StreamJournal, Exchange.migrate)
     8. The legs, client conns    HttpLeg/UpstreamPool (our HTTP client); the client's side
     9. Routing                   RouteKey, prefix index, load view, Router; Serving (a model's
                                  group, which a request's claims are made of)
    10. KV events, tokenizer      vLLM's KV cache events over ZMQ, the model's tokenizer
    11. The fleet                 instances and engines; health, discovery, load, DNS
    12. Metrics, tracing          the Prometheus table, access log, OpenTelemetry
    13. The application           create_app: resources (cleanup_ctx) and background coroutines
    14. The process               serve, reload, drain, systemd, the --workers Supervisor
    15. Command line              build_parser (grouped --help), main

A streamed chat completion reads top to bottom: front_middleware and handle_completion (4) ->
plan_request (5) -> run_pd_request (6) -> Exchange.attempt, which claims from the model's
serving group (9) -> send_prefill beside Attempt.relay_decode on the legs (8) -> relay_body and
DecodeRelay (7) to the last byte. docs/flow.md lists each definition it enters, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import dataclasses
import enum
import errno
import functools
import gc
import glob
import heapq
import hmac
import importlib
import ipaddress
import itertools
import json
import logging
import math
import operator
import os
import random
import re
import resource
import select
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
import tomllib
import zlib
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Container,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, ClassVar, Final, Generic, Literal, NoReturn, TypedDict, TypeVar, cast

try:
    import aiohttp
    import httptools
    import prometheus_client.values
    from aiohttp import hdrs, web
    from aiohttp.abc import AbstractStreamWriter
    from aiohttp.http_exceptions import (
        BadHttpMethod,
        BadStatusLine,
        HttpProcessingError,
        LineTooLong,
    )
    from aiohttp.typedefs import Handler
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
    from yarl import URL
except ImportError as missing:  # one line instead of a traceback, saying what to do
    sys.exit(
        f"mooncake-proxy: error: the Python package {missing.name!r} is not installed; "
        "install the proxy first: pip install . (or pip install -r requirements.txt)"
    )


# ================================================================================================
# 1. Identity and defaults
# Holds the process's name, version and the wire constants every chapter shares. Uses: 11.
# ================================================================================================


log = logging.getLogger("mooncake_proxy")


T = TypeVar("T")


B = TypeVar("B", bound="Backend")


# The fast path (regular dependencies where they install): the same behaviour, less CPU.
def _fast_dumps() -> Callable[[Any], bytes] | None:
    try:
        from orjson import dumps
    except ImportError:
        return None
    return dumps


# orjson encodes a 1 MiB prompt in 50 us where the stdlib takes 3 ms, twice per request.
FAST_DUMPS: Final = _fast_dumps()


def _fast_loads() -> Callable[[bytes | bytearray | memoryview], Any] | None:
    try:
        from orjson import loads
    except ImportError:
        return None
    return loads


# And parses one in 0.4 ms where the stdlib takes 1.5 ms (and 0.4 us a 200-byte body, 1.8),
# up to this size. Past it the stdlib parses: measured on a 16 MiB body, a request's peak
# memory was 3.1 times the body through orjson, 2.6 through the stdlib (which lets the bytes
# go before it builds the objects), and at that size memory is what counts.
FAST_LOADS_LIMIT: Final = 4 << 20


FAST_LOADS: Final = _fast_loads()


# Byte-stable identity that tools launching the proxy record as evidence (the seed's values).
ID: Final = "inferlab-vllm-mooncake-proxy"


VERSION: Final = 1


USER_AGENT: Final = f"{ID}/{VERSION}"


# The package's own release (setup.cfg reads it from here).
__version__ = "1.0.0"


# vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default: one bootstrap server per prefill instance.
DEFAULT_BOOTSTRAP_PORT: Final = 8998


# Prompts are hashed in blocks of --prefix-block-bytes (512 by default: about 128 tokens at 4
# bytes a token, vLLM's block size on the CPU). A GPU's 16-token blocks are finer, but a few
# hundred bytes at the end of a long shared prefix is all the coarser grain loses, and a 1 MiB
# prompt is then 2,048 blocks, hashed in about a millisecond.
ROUTING_BLOCK_BYTES: Final = 512


LISTEN_BACKLOG: Final = 1024


# Every flag can also be set as MOONCAKE_PROXY_<FLAG> (systemd EnvironmentFile); flags win.
ENV_PREFIX: Final = "MOONCAKE_PROXY_"


COMPLETION_PATHS: Final = ("/v1/completions", "/v1/chat/completions")


# OpenAI's Responses API, which vLLM serves in PD as the completions (PROTOCOL.md: the prefill's
# cap is max_output_tokens, and its events are named and end without [DONE]).
RESPONSES_PATH: Final = "/v1/responses"


# vLLM's token-in/token-out route (served with --enable-scale-out), PD as the completions but
# for where the fields are: the prompt is token_ids, the cap and stops are in sampling_params.
GENERATE_PATH: Final = "/inference/v1/generate"


# The routes whose requests take the PD flow.
PD_PATHS: Final = (*COMPLETION_PATHS, RESPONSES_PATH, GENERATE_PATH)


# vLLM's other routes (0.32, PROTOCOL.md) that answer from one instance: passed through whole to
# a decode, which computes what they ask itself (handle_passthrough). Each is its own route
# label; any other path stays a 404.
PASSTHROUGH_ROUTES: Final = (
    ("GET", "/version"),
    ("GET", "/tokenizer_info"),  # with vLLM's --enable-tokenizer-info-endpoint
    *(("POST", path) for path in ("/tokenize", "/detokenize", "/v1/embeddings", "/pooling")),
    *(("POST", path) for path in ("/classify", "/score", "/v1/score", "/rerank", "/v1/rerank")),
    *(("POST", path) for path in ("/v2/rerank", "/invocations")),
    *(("POST", path) for path in ("/v1/audio/transcriptions", "/v1/audio/translations")),
    # Anthropic's Messages API: generation, but computed by the decode alone (vLLM takes no
    # kv_transfer_params there), and its errors in Anthropic's shape (ANTHROPIC_PATHS).
    *(("POST", path) for path in ("/v1/messages", "/v1/messages/count_tokens")),
    # With --enable-scale-out: a request rendered to token ids, and token ids back to text.
    *(
        ("POST", f"/v1/{api}/{way}")
        for api in ("completions", "chat/completions", "messages")
        for way in ("render", "derender")
        if (api, way) != ("messages", "derender")
    ),
)


# Routes whose errors vLLM writes in Anthropic's shape: the proxy does not answer an unknown
# model there itself (an instance does, in that shape).
ANTHROPIC_PATHS: Final = ("/v1/messages", "/v1/messages/count_tokens")


# vLLM's routes that change an instance: sent to every one (handle_every_instance), as the
# two legs of a request must find the same LoRA adapter on the prefill and on the decode.
EVERY_INSTANCE_PATHS: Final = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


REQUEST_ID_HEADER: Final = "X-Request-Id"


DP_RANK_HEADER: Final = "X-data-parallel-rank"


PRIORITY_HEADER: Final = "X-Vllm-Priority"  # vLLM's, with --scheduling-policy priority


SSE_CONTENT_TYPE: Final = "text/event-stream"


# Headers that describe one hop, not the request (RFC 9110 section 7.6.1), plus the ones the
# proxy sets itself on each leg. A client-sent DP rank must never steer the prefill.
HOP_BY_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


NOT_FORWARDED_HEADERS: Final = HOP_BY_HOP_HEADERS | {
    "host",
    "content-length",
    "content-type",
    # aiohttp already decoded a compressed request body, and upstream answers must stay
    # uncompressed so they can be passed through byte for byte.
    "content-encoding",
    "accept-encoding",
    "expect",
    "authorization",
    REQUEST_ID_HEADER.lower(),
    DP_RANK_HEADER.lower(),
    "traceparent",  # checked, or minted, by trace_headers
    "tracestate",
}


# W3C trace context: version, trace id, parent span id, flags (a later version may add more).
TRACEPARENT_PATTERN: Final = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^-].*)?"
)


# A client's own request id is kept for tracing only if it is short and harmless in logs.
CLIENT_REQUEST_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:-]{1,64}")


# ================================================================================================
# 2. Configuration
# Holds ProxyConfig (every setting, frozen), its parsing from flags, environment and a TOML file,
# and the Setting table (where each setting comes from and which are reloadable). Uses: 1, 8.
# ================================================================================================


class ConfigError(ValueError):
    """A setting's value is unusable; the message names the flag or variable and the value."""


class Policy(enum.StrEnum):
    """How a stage picks among its usable targets."""

    PREFIX_AWARE = "prefix_aware"  # where the prompt's prefix is, weighed against load
    LEAST_LOADED = "least_loaded"  # fewest requests this proxy has in flight there
    ROUND_ROBIN = "round_robin"  # the seed's exact rotation


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    """One prefill instance as configured: its OpenAI server and its bootstrap server."""

    url: URL
    bootstrap: URL

    @property
    def bootstrap_addr(self) -> str:
        # The decode requests ``remote_bootstrap_addr + "/query"``: no trailing slash.
        return str(self.bootstrap)


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where an instance's engines publish vLLM's KV cache events: DP rank r on port + r."""

    url: URL  # the instance's OpenAI server
    endpoint: URL  # tcp://host:port, the PUB socket of rank 0
    replay: URL | None  # tcp://host:port, its replay (ROUTER) socket, where given

    def of_rank(self, rank: int) -> tuple[str, str | None]:
        def offset(url: URL) -> str:
            return str(url.with_port((url.port or 0) + rank))

        return offset(self.endpoint), offset(self.replay) if self.replay else None


@dataclass(frozen=True, slots=True)
class DnsName:
    """A name whose A and AAAA records are instances of one role, all on one port."""

    role: str  # "prefill" or "decode"
    name: str
    port: int
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT  # a prefill's

    def __str__(self) -> str:
        tail = f":{self.bootstrap_port}" if self.role == "prefill" else ""
        return f"{self.name}:{self.port}{tail}"

    def url(self, address: str) -> URL:
        return URL.build(scheme="http", host=address, port=self.port)

    def spec(self, address: str) -> PrefillSpec:
        bootstrap = URL.build(scheme="http", host=address, port=self.bootstrap_port)
        return PrefillSpec(self.url(address), bootstrap)


@dataclass(frozen=True, slots=True)
class DnsServer:
    host: str
    port: int = 53

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


# Parsers turn what a flag or variable said into a setting's value; their ValueError says
# what was expected, and the loader adds where the value came from.


def parse_backend_url(text: str) -> URL:
    """An upstream base URL, normalised to ``scheme://host:port`` with no trailing slash."""
    expected = f"{text!r}: expected http(s)://host:port"
    try:
        url = URL(text)
        port = url.explicit_port
    except ValueError as error:
        raise ValueError(f"{expected} ({error})") from None
    if url.scheme not in ("http", "https") or not url.host or port is None:
        raise ValueError(expected)
    if url.path not in ("", "/") or url.query_string or url.fragment or url.user:
        raise ValueError(f"{expected}, with no path, query or credentials")
    if not 1 <= port <= 65535:
        raise ValueError(f"{expected} (port {port} is out of range)")
    return URL.build(scheme=url.scheme, host=url.host, port=port)


def parse_bootstrap(url: URL, value: str | None) -> URL:
    """The bootstrap server of a prefill: a port on its host, a full URL, or 8998 by default."""
    if value is None or value.lower() == "none":
        return URL.build(scheme="http", host=url.raw_host or "", port=DEFAULT_BOOTSTRAP_PORT)
    if value.isdigit():
        if not 1 <= int(value) <= 65535:
            raise ValueError(f"{url} {value}: bootstrap port must be 1-65535")
        return URL.build(scheme="http", host=url.raw_host or "", port=int(value))
    try:
        return parse_backend_url(value)
    except ValueError as error:
        raise ValueError(f"{url} BOOTSTRAP {error}, a port, or 'none'") from None


def parse_prefills(groups: Sequence[Sequence[str]]) -> tuple[PrefillSpec, ...]:
    specs = []
    for group in groups:
        if len(group) > 2:
            raise ValueError(f"takes URL [BOOTSTRAP], got {' '.join(group)!r}")
        url = parse_backend_url(group[0])
        specs.append(PrefillSpec(url, parse_bootstrap(url, group[1] if len(group) > 1 else None)))
    return tuple(specs)


def parse_decodes(groups: Sequence[Sequence[str]]) -> tuple[URL, ...]:
    return tuple(parse_backend_url(text) for group in groups for text in group)


def header_words(groups: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Words for a response header's list (CORS origins, methods, headers): one line each."""
    return tuple(header_value(word.rstrip(",")) for group in groups for word in group)


def dns_names(role: str) -> Callable[[Sequence[Sequence[str]]], tuple[DnsName, ...]]:
    def parse(groups: Sequence[Sequence[str]]) -> tuple[DnsName, ...]:
        return tuple(parse_dns_name(role, text) for group in groups for text in group)

    return parse


DNS_NAME: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")


def parse_dns_name(role: str, text: str) -> DnsName:
    """NAME:PORT, and for a prefill optionally :BOOTSTRAP_PORT (8998 by default)."""
    shape = "NAME:PORT[:BOOTSTRAP_PORT]" if role == "prefill" else "NAME:PORT"
    name, *ports = text.split(":")
    if not DNS_NAME.fullmatch(name) or not 1 <= len(ports) <= (2 if role == "prefill" else 1):
        raise ValueError(f"{text!r}: expected {shape}")
    try:
        numbers = [port_number(port) for port in ports]
    except ValueError:
        raise ValueError(f"{text!r}: expected {shape} with ports 1-65535") from None
    if 0 in numbers:
        raise ValueError(f"{text!r}: expected {shape} with ports 1-65535")
    return DnsName(role, name.lower(), *numbers)


def parse_dns_server(text: str) -> DnsServer | None:
    """HOST[:PORT] of a DNS server; an IPv6 address in brackets when it has a port."""
    if text.strip().lower() in ("", "none"):
        return None
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address, number = ipaddress.ip_address(host), port_number(port)
    except ValueError:
        number = 0
    if not number:  # a bad address or port, or port 0
        raise ValueError("expected the IP address of a DNS server, optionally with :PORT")
    return DnsServer(str(address), number)


def parse_kv_event_endpoint(text: str) -> URL:
    """A ZMQ endpoint a vLLM engine publishes KV events on: tcp://host:port."""
    expected = f"{text!r}: expected tcp://host:port"
    try:
        url = URL(text)
        port = url.explicit_port
    except ValueError:
        raise ValueError(expected) from None
    if url.scheme != "tcp" or not url.host or port is None or not 1 <= port <= 65535:
        raise ValueError(expected)
    return URL.build(scheme="tcp", host=url.raw_host or "", port=port)


def parse_kv_event_overrides(groups: Sequence[Sequence[str]]) -> tuple[KvEventSource, ...]:
    sources = []
    for group in groups:
        if len(group) not in (2, 3):
            raise ValueError(f"takes URL ENDPOINT [REPLAY], got {' '.join(group)!r}")
        url, *endpoints = group
        replay = parse_kv_event_endpoint(endpoints[1]) if len(endpoints) > 1 else None
        sources.append(
            KvEventSource(parse_backend_url(url), parse_kv_event_endpoint(endpoints[0]), replay)
        )
    return tuple(sources)


def at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("expected a whole number") from None
        if value < minimum:
            raise ValueError(f"expected a whole number of {minimum} or more")
        return value

    return parse


def seconds(text: str) -> float:
    """A positive number of seconds."""
    if (value := seconds_or_none(text)) is None:
        raise ValueError("expected a number of seconds above 0")
    return value


def seconds_or_none(text: str) -> float | None:
    """A number of seconds, where 0 means no limit."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise ValueError("expected a number of seconds (0 for none)")
    return value or None


def weight(text: str) -> float:
    """A non-negative number."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number") from None
    if not 0 <= value < math.inf:
        raise ValueError("expected a number of 0 or more")
    return value


def share(text: str) -> float:
    """A number from 0 to 1."""
    if (value := weight(text)) > 1:
        raise ValueError("expected a number from 0 to 1")
    return value


def factor(text: str) -> float:
    """A number of 1 or more."""
    if (value := weight(text)) < 1:
        raise ValueError("expected a number of 1 or more")
    return value


def port_number(text: str) -> int:
    if not 0 <= (value := at_least(0)(text)) <= 65535:
        raise ValueError("expected a port, 0-65535")
    return value


def port_or_none(text: str) -> int | None:
    """A port (1-65535), or 'none'."""
    if text.strip().lower() in ("", "none"):
        return None
    if not 1 <= (value := port_number(text)) <= 65535:
        raise ValueError("expected a port, 1-65535, or 'none'")
    return value


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


POLICIES: Final = "{" + ",".join(Policy) + "}"


def parse_policy(text: str) -> Policy:
    return Policy(one_of(*Policy)(text))


def parse_log_level(text: str) -> str:
    return one_of("DEBUG", "INFO", "WARNING", "ERROR")(text.upper())


def text_value(text: str) -> str:
    return text


def header_value(text: str) -> str:
    """Text sent in an HTTP header: a line break would end the header and start another."""
    if any(character in text for character in "\r\n\0"):
        raise ValueError("expected one line of text (it is sent in an HTTP header)")
    return text


TRUE_WORDS: Final = frozenset({"1", "true", "yes", "on"})


FALSE_WORDS: Final = frozenset({"0", "false", "no", "off", ""})


def switch(given: str | bool) -> bool:
    """A flag that is given or not; from the environment, a word that says which."""
    if isinstance(given, bool):
        return given
    if (word := given.strip().lower()) not in TRUE_WORDS | FALSE_WORDS:
        raise ValueError("expected 1/true/yes/on or 0/false/no/off")
    return word in TRUE_WORDS


def setting(
    default: Any,
    description: str,
    parse: Callable[[Any], Any],
    *,
    flag: str | None = None,
    metavar: str | tuple[str, str] | None = None,
    repeat: str | None = None,
    secret: bool = False,
    restart: bool = False,
) -> Any:
    """A ProxyConfig field that is also a flag (``--field-name``, or ``flag``), an environment
    variable (MOONCAKE_PROXY_FIELD_NAME) and a key of the --config file (``field-name``), all
    declared here, once.

    ``repeat`` is for flags given several times with several values each: "entries" takes them
    from the variable as comma-separated groups of words, "words" as one group. ``restart``:
    a reload cannot change it (it is built into the listener, the pools or the process).
    """
    meta = {"help": description, "parse": parse, "flag": flag, "metavar": metavar}
    meta |= {"repeat": repeat, "restart": restart, "secret": secret}
    return field(default=default, repr=not secret, metadata=meta)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything the daemon needs. Each field that has a flag says so beside it; the command
    line, the environment and the --config file are read from these declarations
    (load_config)."""

    config_file: str | None = setting(
        None,
        "a TOML file with any of these settings, keyed by their flag's name without the "
        'dashes in front (prefill = ["http://10.0.0.1:8100 8998"], max-retries = 3); flags '
        "and environment variables win over it. SIGHUP (systemctl reload) reads it again",
        text_value,
        flag="--config",
        metavar="FILE",
        restart=True,
    )
    prefills: tuple[PrefillSpec, ...] = setting(
        (),
        "a prefill instance (repeatable): its OpenAI URL, then optionally its bootstrap server "
        f"as a port on the same host, a full http://host:port, or 'none' for port "
        f"{DEFAULT_BOOTSTRAP_PORT}",
        parse_prefills,
        flag="--prefill",
        metavar=("URL", "BOOTSTRAP"),  # argparse writes it "URL [BOOTSTRAP ...]": see below
        repeat="entries",
    )
    decodes: tuple[URL, ...] = setting(
        (), "decode instance URL(s) (repeatable)", parse_decodes, flag="--decode", repeat="words"
    )
    prefill_dns: tuple[DnsName, ...] = setting(
        (),
        "prefill instances found in DNS (repeatable): every A and AAAA record of NAME is one, "
        "its OpenAI server on PORT and its bootstrap server on BOOTSTRAP_PORT (8998), e.g. "
        "a Kubernetes headless Service",
        dns_names("prefill"),
        metavar="NAME:PORT[:BOOTSTRAP_PORT]",
        repeat="words",
    )
    decode_dns: tuple[DnsName, ...] = setting(
        (),
        "decode instances found in DNS (repeatable): every A and AAAA record of NAME, on PORT",
        dns_names("decode"),
        metavar="NAME:PORT",
        repeat="words",
    )
    dns_interval: float = setting(
        5.0, "seconds between two lookups of the --prefill-dns and --decode-dns names", seconds
    )
    peers: tuple[DnsName, ...] = setting(
        (),
        "the other replicas of this proxy (repeatable; every A and AAAA record of NAME is one, "
        "listening on PORT, e.g. a Kubernetes headless Service): each tells the others over "
        "UDP, on the port it listens on, where it sends each request, and each routes as if "
        "it had sent them too",
        dns_names("peer"),
        flag="--peer",
        metavar="NAME:PORT",
        repeat="words",
        restart=True,
    )
    dns_server: DnsServer | None = setting(
        None,
        "ask this DNS server (HOST[:PORT]) instead of the system's resolver",
        parse_dns_server,
        metavar="HOST[:PORT]",
    )
    host: str = setting("127.0.0.1", "address to listen on", text_value, restart=True)
    port: int = setting(8000, "port to listen on", port_number, restart=True)
    upstream_api_key: str | None = setting(
        None,
        "send 'Authorization: Bearer KEY' to vLLM instead of the client's own header (without "
        f"it the client's is forwarded; ${ENV_PREFIX}UPSTREAM_API_KEY sets it too, "
        "$OPENAI_API_KEY never does)",
        header_value,
        metavar="KEY",
        secret=True,
    )
    # Where the upstream key came from, for the startup line (never the key itself).
    upstream_api_key_source: str = "--upstream-api-key"
    # Keys of the --config file that a flag or a variable also set (and so win over).
    shadowed: tuple[str, ...] = ()
    # Long prompts and base64 images make big bodies; 100 MiB still stops a runaway upload.
    max_request_bytes: int = setting(
        100 * 1024 * 1024, "largest request body accepted; larger is answered 413", at_least(1)
    )
    connect_timeout: float = setting(
        5.0, "seconds to open a connection to an upstream", seconds, restart=True
    )
    # vLLM (uvicorn) closes idle keep-alive connections after 5 s; reusing one it already
    # closed fails the request, so the pool must forget idle connections before vLLM does.
    keepalive_timeout: float = setting(
        4.0,
        "seconds an idle upstream connection is kept; keep it below vLLM's 5 s",
        seconds,
        restart=True,
    )
    # None: a stream may last as long as the decode keeps producing tokens.
    request_timeout: float | None = setting(
        None,
        "total seconds for one upstream request, stream included; 0 for none",
        seconds_or_none,
        restart=True,
    )
    # Below vLLM's 480 s KV timeout, so that a stream whose KV never comes (a decode that sent
    # its head and then nothing) hears it first; far above a long prompt's first token on a
    # busy cluster.
    first_token_timeout: float | None = setting(
        300.0,
        "seconds a streamed request may wait for its first token, retries included (and a "
        "stream going on elsewhere for its continuation's); then 504, or an in-band error "
        "once streaming; a whole answer is not tried again after it; 0 for none",
        seconds_or_none,
    )
    # Past vLLM's default VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT the decode gives up on the KV.
    prefill_timeout: float | None = setting(
        480.0,
        "seconds the prefill leg may take before the request fails with 504; 0 for none",
        seconds_or_none,
    )
    max_connections: int = setting(
        0,
        "cap on upstream connections in use at once, 0 for none: a PD request takes two (its "
        "prefill's until the prefill answered, its decode's until its stream ends); health "
        "checks have a pool of their own",
        at_least(0),
        restart=True,
    )
    max_in_flight: int = setting(
        0,
        "requests served at once by each process (PD and passed through), 0 for no limit; "
        "more wait in a queue "
        "(a lower X-Vllm-Priority or body priority first, then in order of arrival)",
        at_least(0),
    )
    max_queue: int = setting(
        1024, "PD requests that may wait for --max-in-flight; more are answered 429", at_least(0)
    )
    queue_timeout: float = setting(
        30.0, "seconds a request may wait for --max-in-flight; then 429 with Retry-After", seconds
    )
    # httpx's default for the same wait.
    pool_timeout: float = setting(
        5.0, "seconds a request may wait for --max-connections to let it through; then 503", seconds
    )
    # A usable instance is checked every health interval; one out of the rotation (not yet
    # discovered, or down) every discovery interval, so that it is back soon after it is.
    health_interval: float = setting(
        5.0,
        "seconds between checks of a usable instance (prefill: /health and its bootstrap "
        "/query, picking up new engine ids; decode: /health)",
        seconds,
    )
    discovery_interval: float = setting(
        1.0,
        "seconds between checks of an instance out of the rotation (not yet discovered, or "
        "down); doubled up to --health-interval while it stays unreachable the same way",
        seconds,
    )
    # Long enough that a busy vLLM still answers /health in time: busy is not unhealthy.
    health_timeout: float = setting(
        3.0, "seconds one health check or bootstrap query may take", seconds
    )
    unhealthy_after: int = setting(
        2,
        "failed checks in a row that take an instance out of the rotation (a refused "
        "connection on a live request takes it out at once)",
        at_least(1),
    )
    healthy_after: int = setting(1, "good checks in a row that bring an instance back", at_least(1))
    panic_threshold: float = setting(
        0.0,
        "panic (Envoy's word): while fewer than this share of a role's instances that run one "
        "model are usable, or none is, those out only because their checks timed out take "
        "requests again; 0 panics only when none is usable, 1 always sends to every instance "
        "that is only slow",
        share,
    )
    # Off where something counts the requests each instance got from the start (tests).
    no_start_self_test: bool = setting(
        False,
        "do not run the PD self-test (a request of a few tokens to each prefill engine and "
        "decode, checked by the decode's counters) once PD requests are first served; "
        "POST /admin/self-test runs it any time",
        switch,
    )
    # Three, not two: the budget is the request's, its stream's continuations included, and
    # the chaos benchmark's three faults in three seconds (a failed pull, a killed decode, a
    # prefill gone) used up two once (1 of 16,784 lost; 2026-12-07).
    max_retries: int = setting(
        3,
        "per request, how many times the pair is tried again: a leg that could not connect "
        "or was lost before answering, or a decode that failed before its first token (a "
        "failed KV pull); never after bytes reached the client, never for a 4xx; one budget "
        "for the request and the continuations of its stream",
        at_least(0),
    )
    migration_limit: int = setting(
        3,
        "per streamed request, how many times a stream whose decode failed after its first "
        "token goes on from the tokens sent on another pair, token for token (docs/flow.md "
        "says which streams cannot); 0 ends such a stream with an in-band error",
        at_least(0),
    )
    policy: Policy = setting(
        Policy.PREFIX_AWARE,
        "how both stages pick a target: prefix_aware (where the prompt's prefix is cached, "
        "weighed against each engine's load from its /metrics), least_loaded (fewest requests "
        "in flight from this proxy, ties round robin) or round_robin",
        parse_policy,
        metavar=POLICIES,
    )
    # None: as --policy.
    prefill_policy: Policy | None = setting(
        None,
        "--policy for the prefill stage only",
        parse_policy,
        metavar=POLICIES,
    )
    decode_policy: Policy | None = setting(
        None,
        "--policy for the decode stage only",
        parse_policy,
        metavar=POLICIES,
    )
    load_interval: float = setting(
        1.0,
        "seconds between scrapes of each instance's /metrics (its running and waiting requests "
        "and KV usage per engine) for prefix_aware, and of each decode's prompt sources, "
        "for the proof that it pulls its KV",
        seconds,
    )
    prefix_index_blocks: int = setting(
        65536,
        "prompt blocks remembered per engine at most, for prefix_aware; fewer where an "
        "engine's /metrics says its KV cache holds fewer",
        at_least(1),
        restart=True,
    )
    prefix_block_bytes: int = setting(
        ROUTING_BLOCK_BYTES,
        "bytes of prompt hashed as one block, for prefix_aware: about vLLM's block size in "
        "bytes (tokens per block x bytes per token); smaller matches finer and costs more",
        at_least(16),
        restart=True,
    )
    balance_factor: float = setting(
        1.25,
        "a prompt no engine holds goes where a consistent hash of its first block says, unless "
        "that engine has more than this times the mean load (then the next in the hash's "
        "order); an engine that holds a prompt takes it only within this bound too, or the "
        "mean plus 2",
        factor,
    )
    # Not 1, though a queued block takes as long as one computed: a spill costs more than its
    # own blocks. They land away from the engine its relatives go to, and on a busy cluster
    # everyone waits for the work done twice. The routing benchmark, at 0.5 against 1 (with
    # QUEUE_SLACK's bound): the Mooncake trace 0.78-0.81 of the oracle's hit rate against
    # 0.56-0.59 and a lower TTFT.
    prefill_load_weight: float = setting(
        0.5,
        "prefix_aware cost of one request on a prefill engine, in multiples of the work an "
        "average prompt needs",
        weight,
    )
    decode_load_weight: float = setting(
        4.0,
        "the same for a decode: its streams run long, and a cached prefix there only saves "
        "the transfer",
        weight,
    )
    # Disaggregation pays for a long prompt its decode does not hold. For a short one, or a
    # conversation's next turn whose earlier turns the decode holds, the handoff (two legs,
    # a bootstrap look-up, a pull, and the decode's wait for it) costs more than the decode
    # computing the few new tokens itself: on vLLM 0.32 (CPU, PROTOCOL.md) ~16 tokens took
    # 350 ms through PD against 46 ms at the decode alone, ~128 tokens 53 against 22. Off by
    # default: on a decode where a prompt token costs much (that CPU, four streams at once) it
    # paused the running streams for more than it saved; performance.md, "Local prefill".
    max_local_prefill_tokens: int = setting(
        0,
        "a PD request whose chosen decode would compute fewer than this many tokens of the "
        "prompt itself (the prompt less what that decode holds) goes to that decode alone, "
        "with no prefill leg; 0: every request goes through PD",
        at_least(0),
    )
    # Computing a prompt pauses the decode's running streams for as long: a decode is given
    # at most this many at once, the next short prompt goes through PD.
    max_local_prefills: int = setting(
        1,
        "how many prompts one decode computes itself at once (--max-local-prefill-tokens): "
        "past that, a short prompt goes through PD, sparing the decode's running streams",
        at_least(1),
    )
    # Off by default: a decode that recomputes still answers right, only slower and dearer;
    # an operator may rather have its PD requests go where pulls work.
    avoid_recomputing: bool = setting(
        False,
        "pass over a decode that computes the prompts it should pull (its pulls fail under "
        "kv_load_failure_policy recompute) for PD requests while another decode is left; it is "
        "tried again a minute after it was last judged so",
        switch,
    )
    kv_events_port: int | None = setting(
        None,
        "route on what each engine really holds, from vLLM's KV cache events: the port every "
        "instance publishes them on (vLLM's --kv-events-config endpoint tcp://*:PORT; DP rank "
        "r on PORT+r); needs the [precise] extra",
        port_or_none,
        metavar="PORT",
        restart=True,
    )
    kv_events_replay_port: int | None = setting(
        None,
        "the port of their replay socket (vLLM's replay_endpoint; DP rank r on PORT+r), where "
        "events missed in a gap are asked for again",
        port_or_none,
        metavar="PORT",
        restart=True,
    )
    kv_events: tuple[KvEventSource, ...] = setting(
        (),
        "one instance's own KV event endpoint (repeatable), overriding --kv-events-port: its "
        "URL, tcp://host:port (DP rank r on port+r) and optionally a replay tcp://host:port",
        parse_kv_event_overrides,
        metavar=("URL", "ENDPOINT"),
        repeat="entries",
    )
    otlp_traces_endpoint: str | None = setting(
        None,
        "export the proxy's own span per request, with a child span per leg, over OTLP/HTTP to "
        "this URL (e.g. http://collector:4318/v1/traces); needs the tracing extra: pip "
        "install '.[tracing]' in the proxy's source tree",
        text_value,
        metavar="URL",
        restart=True,
    )
    tokenizer: str | None = setting(
        None,
        "the model's tokenizer directory, for routing text prompts on KV events (default: the "
        "root vLLM's /v1/models names, when it is a local directory here)",
        text_value,
        metavar="DIR",
        restart=True,
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on /v1/* (the client's header is then not "
        "forwarded to vLLM; --upstream-api-key is, if set)",
        text_value,
        metavar="KEY",
        secret=True,
    )
    protect_metrics: bool = setting(
        False, "require the --api-key on /metrics too (/health and /healthcheck stay open)", switch
    )
    # TLS as vLLM's own server has it: the proxy often takes its place in front of clients.
    ssl_keyfile: str | None = setting(
        None, "serve HTTPS with this private key (PEM), with --ssl-certfile", text_value,
        metavar="FILE", restart=True,
    )  # fmt: skip
    ssl_certfile: str | None = setting(
        None, "serve HTTPS with this certificate chain (PEM), with --ssl-keyfile", text_value,
        metavar="FILE", restart=True,
    )  # fmt: skip
    ssl_ca_certs: str | None = setting(
        None,
        "with HTTPS, require clients to present a certificate signed by one of these CAs "
        "(PEM): mutual TLS",
        text_value,
        metavar="FILE",
        restart=True,
    )
    # CORS as vLLM's flags say it, but off unless asked: vLLM allows every origin by default,
    # which lets any web page a user opens call an unguarded cluster from their browser.
    allowed_origins: tuple[str, ...] = setting(
        (),
        "let web pages from these origins call the proxy from a browser (CORS; repeatable, "
        "'*' for any); none by default",
        header_words,
        metavar="ORIGIN",
        repeat="words",
    )
    allowed_methods: tuple[str, ...] = setting(
        ("*",), "with --allowed-origins, the methods they may use ('*': any)", header_words,
        metavar="METHOD", repeat="words",
    )  # fmt: skip
    allowed_headers: tuple[str, ...] = setting(
        ("*",), "with --allowed-origins, the headers they may send ('*': any)", header_words,
        metavar="HEADER", repeat="words",
    )  # fmt: skip
    allow_credentials: bool = setting(
        False, "with --allowed-origins, let browsers send their cookies and credentials", switch
    )
    upstream_ca_certs: str | None = setting(
        None,
        "trust these CA certificates (PEM) for https:// instances, in place of the system's "
        "(a private CA)",
        text_value,
        metavar="FILE",
        restart=True,
    )
    # The unit's TimeoutStopSec is longer.
    shutdown_timeout: float = setting(
        30.0,
        "on SIGTERM/SIGINT, seconds in-flight requests may take to finish before both their "
        "legs are cancelled; a second signal exits at once",
        seconds,
    )
    # Clients on a network: a head must arrive within --header-timeout (slowloris), a body
    # within --body-timeout plus a second per --body-min-rate bytes (Apache's mod_reqtimeout
    # rule), and open connections are capped so that idle or slow clients cannot use up file
    # descriptors (about 3 per stream: the client's, the decode's, the prefill's).
    header_timeout: float = setting(
        10.0,
        "seconds a client has to send a request's head, from connecting or from the head's "
        "first byte; then 408 and the connection is closed",
        seconds,
    )
    body_timeout: float = setting(
        30.0,
        "seconds a client has to send a request body, plus 1 s per --body-min-rate bytes "
        "received; then 408 and the connection is closed",
        seconds,
    )
    body_min_rate: int = setting(
        64 * 1024, "bytes per second a large body earns its extra time at", at_least(1)
    )
    max_client_connections: int = setting(
        4096,
        "open client connections per worker; more are answered 503 and closed",
        at_least(1),
        restart=True,
    )
    # nginx's keepalive_timeout: longer than the idle timeouts of common load balancers (60 s).
    client_keepalive_timeout: float = setting(
        75.0, "seconds an idle client connection is kept open", seconds, restart=True
    )
    loop: str = setting(
        "auto",
        "event loop: uvloop when installed (auto), or the stdlib's",
        one_of("auto", "asyncio", "uvloop"),
        metavar="{auto,asyncio,uvloop}",
        restart=True,
    )
    # Processes sharing the port (SO_REUSEPORT), each with its own pools and checks.
    workers: int = setting(
        1,
        "processes sharing the port through SO_REUSEPORT, each with its own connection pool "
        "and health checks; more than the cores available buys nothing",
        at_least(1),
        restart=True,
    )
    log_level: str = setting(
        "INFO",
        "logging threshold",
        parse_log_level,
        metavar="{DEBUG,INFO,WARNING,ERROR}",
    )
    log_format: str = setting(
        "text",
        "json: one object per line, for log shippers",
        one_of("text", "json"),
        metavar="{text,json}",
        restart=True,
    )

    def __post_init__(self) -> None:
        # What no single value can say wrong on its own (parse_* check each value).
        if not self.prefills and not self.prefill_dns:
            raise ConfigError("at least one --prefill URL (or --prefill-dns name) is required")
        if not self.decodes and not self.decode_dns:
            raise ConfigError("at least one --decode URL (or --decode-dns name) is required")
        for flag, urls in (
            ("--prefill", [p.url for p in self.prefills]),
            ("--decode", self.decodes),
        ):
            if twice := [str(url) for url, count in collections.Counter(urls).items() if count > 1]:
                raise ConfigError(f"{flag} {twice[0]} is given twice")
        known = {*(p.url for p in self.prefills), *self.decodes}
        unknown = [str(s.url) for s in self.kv_events if s.url not in known]
        if unknown and not self.prefill_dns and not self.decode_dns:  # DNS may add it
            raise ConfigError(f"--kv-events {unknown[0]} is not a --prefill or --decode URL")
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            raise ConfigError("--kv-events-replay-port needs --kv-events-port")
        if self.protect_metrics and not self.api_key:
            raise ConfigError("--protect-metrics needs --api-key: it is the key /metrics asks for")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs both")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ConfigError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (HTTPS)")
        server_tls(self)  # files that cannot be read say so now, not at the first client
        if self.upstream_ca_certs is not None:
            upstream_tls(self)

    @property
    def dns_names(self) -> tuple[DnsName, ...]:
        return (*self.prefill_dns, *self.decode_dns)

    @property
    def precise(self) -> bool:
        """Whether to route on the engines' KV cache events."""
        return self.kv_events_port is not None or bool(self.kv_events)

    def kv_event_source(self, url: URL) -> KvEventSource | None:
        for source in self.kv_events:
            if source.url == url:
                return source
        if self.kv_events_port is None:
            return None
        host = url.raw_host or ""
        replay = self.kv_events_replay_port
        return KvEventSource(
            url,
            URL.build(scheme="tcp", host=host, port=self.kv_events_port),
            URL.build(scheme="tcp", host=host, port=replay) if replay is not None else None,
        )

    @property
    def policies(self) -> tuple[Policy, Policy]:
        """The prefill stage's policy and the decode stage's."""
        return self.prefill_policy or self.policy, self.decode_policy or self.policy

    def describe(self) -> str:
        """The configuration for the startup log line: everything but the secrets."""
        prefills = [f"{p.url} (bootstrap {p.bootstrap_addr})" for p in self.prefills]
        prefills += [f"dns {name}" for name in self.prefill_dns]
        decodes = [str(url) for url in self.decodes] + [f"dns {n}" for n in self.decode_dns]
        prefill_policy, decode_policy = self.policies
        source = f"config {self.config_file}; " if self.config_file else ""
        return (
            f"{source}prefill {', '.join(prefills)}; decode {', '.join(decodes)}; "
            f"policy prefill={prefill_policy} "
            f"decode={decode_policy}; health every {self.health_interval:g} s "
            f"(timeout {self.health_timeout:g} s, out after {self.unhealthy_after}, back after "
            f"{self.healthy_after}); max retries {self.max_retries}; inbound key "
            f"{'set' if self.api_key else 'not set'}; {self.describe_upstream_key()}"
        )

    def warn_shadowed(self) -> None:
        """Say which keys of the file do nothing: a reload of it would not change them."""
        if self.shadowed:
            log.warning(
                "%s: %s also set by a flag or an environment variable, which win: editing them "
                "in the file changes nothing", self.config_file, ", ".join(self.shadowed),
            )  # fmt: skip

    def describe_upstream_key(self) -> str:
        if self.upstream_api_key:
            return f"upstream key from {self.upstream_api_key_source}"
        if self.api_key:
            return "no upstream key (clients' Authorization is for the proxy, not forwarded)"
        return "no upstream key (clients' Authorization is forwarded)"

    @property
    def load_fresh_for(self) -> float:
        """How old a scrape of an instance's /metrics may be and still count: three
        --load-interval, so that one late scrape does not drop what it said."""
        return 3 * self.load_interval

    def upstream_timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        """A per-call timeout that keeps the connect limit (a ClientTimeout replaces, not adds)."""
        return client_timeout(total, self.connect_timeout)


@functools.cache
def client_timeout(total: float | None, connect: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_connect=connect)  # made once, not per request


@dataclass(frozen=True, slots=True)
class Setting:
    """A ProxyConfig field seen from the command line and the environment."""

    name: str
    default: Any
    help: str
    parse: Callable[[Any], Any]
    flag: str
    env: str
    metavar: str | tuple[str, str] | None
    repeat: str | None
    restart: bool  # a reload leaves it as it was
    secret: bool  # never shown, not even in an error about it

    @classmethod
    def of(cls, declared: dataclasses.Field[Any]) -> Setting:
        meta = declared.metadata
        flag = meta["flag"] or "--" + declared.name.replace("_", "-")
        env = ENV_PREFIX + flag[2:].replace("-", "_").upper()
        return cls(
            declared.name, declared.default, meta["help"], meta["parse"], flag, env,
            meta["metavar"], meta["repeat"], meta["restart"], meta["secret"],
        )  # fmt: skip

    @property
    def key(self) -> str:
        """Its key in the --config file."""
        return self.flag[2:]

    @property
    def is_switch(self) -> bool:
        return self.parse is switch

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        shown = self.default.value if isinstance(self.default, enum.Enum) else self.default
        help_text = self.help
        if not (shown is None or shown is False or shown == ()):  # 0 is a default to show
            help_text += f" (default: {shown})"
        options: dict[str, Any] = {"dest": self.name, "default": argparse.SUPPRESS}
        if self.is_switch:
            options["action"] = "store_true"
        elif self.repeat:
            options.update(action="append", nargs="+", metavar=self.metavar or "URL")
        else:
            options["metavar"] = self.metavar or self.name.upper()
        # argparse would read "%" as the start of a format: the help is text, not a template.
        parser.add_argument(self.flag, help=help_text.replace("%", "%%"), **options)

    def from_environment(self, text: str) -> Any:
        if self.repeat == "entries":
            return [entry.split() for entry in text.split(",") if entry.strip()]
        if self.repeat == "words":
            return [text.split()]
        return text

    def from_file(self, value: object) -> Any:
        """A TOML value as the flag would have given it: a list for a repeated flag (of
        strings, or for entries also of lists of words), a bool for a switch, else a scalar."""
        if self.repeat:
            groups: list[list[str]] = []
            for item in value if isinstance(value, list) else [value]:
                words = item.split() if isinstance(item, str) else item
                if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                    raise ValueError("expected a list of strings")
                groups.append(words)
            if self.repeat == "words":
                return [[word for group in groups for word in group]]
            return groups
        if self.is_switch:
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
            return value
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError("expected a string or a number")
        return str(value)


SETTINGS: Final = tuple(
    Setting.of(declared) for declared in dataclasses.fields(ProxyConfig) if declared.metadata
)


SETTINGS_BY_KEY: Final = {option.key: option for option in SETTINGS}


SETTINGS_BY_NAME: Final = {option.name: option for option in SETTINGS}


def read_config_file(path: str) -> dict[str, Any]:
    """The settings of a --config file, by key; ConfigError for a file that cannot be read or
    parsed or names a setting there is not (a typo must not pass for a default)."""
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    settings = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        if name not in SETTINGS_BY_KEY or name == "config":
            raise ConfigError(
                f"{path}: {key!r} is not a setting (keys are the flags' names without the "
                "leading dashes, as in --help)"
            )
        settings[name] = value
    return settings


def load_config(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]
) -> ProxyConfig:
    """The configuration from the command line, then the environment, then the --config
    file, then the defaults.

    Raises ConfigError naming the flag, the variable or the file a bad value came from.
    """
    given = vars(parser.parse_args(argv))
    path = given.get("config_file") or environ.get(SETTINGS_BY_KEY["config"].env)
    in_file = read_config_file(path) if path else {}
    values: dict[str, Any] = {}
    for option in SETTINGS:
        if option.name in given:
            raw, source = given[option.name], option.flag
            where = source if option.repeat else f"{source} {raw!r}"
        elif option.env in environ:
            raw, source = option.from_environment(environ[option.env]), f"${option.env}"
            where = option.env if option.repeat else f"{option.env}={environ[option.env]!r}"
        elif option.key in in_file:
            source = where = f"{path}: {option.key}"
            if not option.repeat:
                where += f" = {in_file[option.key]!r}"
            try:
                raw = option.from_file(in_file[option.key])
            except ValueError as error:
                raise ConfigError(f"{where}: {error}") from None
        else:
            continue
        if option.secret:
            where = source
        try:
            values[option.name] = option.parse(raw)
        except ValueError as error:
            # A repeated flag's parser names the entry it refused; a single value is named here.
            raise ConfigError(
                f"{where} {error}" if option.repeat else f"{where}: {error}"
            ) from None
        if option.name == "upstream_api_key":
            values["upstream_api_key_source"] = source
        if option.key in in_file and not source.startswith(f"{path}:"):
            values["shadowed"] = (*values.get("shadowed", ()), option.key)
    return ProxyConfig(**values)


# ================================================================================================
# 3. Errors and state
# Holds ProxyError (one error type: HTTP status, OpenAI error type, the bytes to answer with) and
# the failure vocabulary the flow speaks (Unreachable, KvLoadFailed, StreamCut, what a transport
# error means), and ProxyState, what the application holds. Uses: 1-2, 5-6, 8, 10-12, 14.
# ================================================================================================


def error_type(status: int) -> str:
    """The OpenAI/vLLM error type for a status: 400 BadRequestError, 503 ..., and so on."""
    if status == 401:
        return "AuthenticationError"  # the OpenAI SDK's name for it
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError"
    name = "".join(word.capitalize() for word in re.split(r"[\s-]+", phrase))
    return name if name.endswith("Error") else f"{name}Error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


class ProxyError(Exception):
    """A request failed: carries the HTTP status and the OpenAI-style error for the client.

    An upstream's own error answer is carried as it came (``body``, ``content_type``) so that
    the client sees vLLM's message, not the proxy's paraphrase of it.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        body: bytes | None = None,
        content_type: str | None = None,
        reason: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.body = body
        self.content_type = content_type
        # For the errors metric: refused, timeout, http_<status>, stopped_early, ...
        self.reason = reason or f"http_{status}"
        # Seconds a client should wait before trying again (the Retry-After header).
        self.retry_after = retry_after

    @classmethod
    def from_upstream(
        cls, stage: str, url: URL, status: int, body: bytes, ctype: str
    ) -> ProxyError:
        summary = body[:200].decode("utf-8", "replace")
        return cls(
            status,
            f"{stage} {url} answered {status}: {summary}",
            body=body,
            content_type=ctype or "application/json",
            reason=f"http_{status}",
        )

    def payload(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        if self.body is not None:
            response = web.Response(status=self.status, body=self.body, headers=headers)
            response.headers[hdrs.CONTENT_TYPE] = self.content_type or "application/json"
        else:
            response = web.json_response(self.payload(), status=self.status, headers=headers)
        if self.retry_after is not None:
            response.headers[hdrs.RETRY_AFTER] = str(self.retry_after)
        return response

    def sse_frame(self, named: bool = False) -> bytes:
        """The in-band error vLLM itself sends once a stream's 200 has gone out. ``named``: a
        Responses stream's, an ``error`` event and no [DONE] (vLLM 0.32 has none, and cuts
        such a stream; the OpenAI SDK raises on a data line with an error)."""
        payload = self.payload()
        if self.body is not None:
            with contextlib.suppress(ValueError):
                upstream = json.loads(self.body)
                if isinstance(upstream, dict) and isinstance(upstream.get("error"), dict):
                    payload = upstream
        data = json.dumps(payload).encode()
        if named:
            return b"event: error\ndata: " + data + b"\n\n"
        return b"data: " + data + b"\n\ndata: [DONE]\n\n"


@dataclass(eq=False)
class ProxyState:
    """Everything one serving process holds, under one AppKey: its configuration, its fleet
    and the limits, pools and counters shared by every request."""

    config: ProxyConfig
    fleet: Fleet = field(init=False)
    slots: UpstreamSlots = field(init=False)
    connections: ClientConnections = field(init=False)
    admission: Admission = field(init=False)
    metrics: Metrics = field(init=False)
    # Set by the first SIGTERM/SIGINT: in-flight requests finish, new ones get 503.
    draining: bool = False
    # Opened with the app and closed with it (pools_ctx): one for the legs of client
    # requests, one for health checks and discovery, which never queue behind clients.
    upstreams: UpstreamPool = field(init=False)
    health_session: aiohttp.ClientSession = field(init=False)
    # Prefill legs that outlived their decode, kept until they answer.
    lingering: set[asyncio.Task[None]] = field(default_factory=set)
    # The model's tokenizer, for routing text prompts on KV events (watch_tokenizer loads it).
    tokenizer: PromptTokenizer | None = None
    # The rest of a prompt whose reading stopped early, being read in a thread after its
    # decision (TokenReading.rest): one at a time, as it only saves later requests' work.
    reading_rest: asyncio.Future[None] | None = None
    # With --otlp-traces-endpoint and the [tracing] extra (tracing_ctx sets it up).
    tracing: Tracing | None = None
    # The last good answer for each --prefill-dns and --decode-dns name (watch_dns).
    dns_answers: dict[DnsName, tuple[str, ...]] = field(default_factory=dict)
    # Why the last lookup of a name failed, while it fails.
    dns_errors: dict[DnsName, str] = field(default_factory=dict)
    # Set by a reload: the names are looked up again at once.
    dns_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Collects, soon after each large request, the cyclic garbage a failed one leaves.
    large_garbage: LargeGarbage = field(default_factory=lambda: LargeGarbage())
    # The last PD self-test's result (at start, and POST /admin/self-test), for /healthcheck.
    self_test: SelfTest | None = None
    # With --max-local-prefill-tokens: how many PD requests went each way, by (decision, reason)
    # (LOCAL_PREFILL_REASONS), for /healthcheck (the metrics count them too).
    local_prefill_decisions: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter
    )

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.config)
        self.slots = UpstreamSlots(self.config.max_connections)
        self.connections = ClientConnections(self.config.max_client_connections)
        config = self.config
        self.admission = Admission(config.max_in_flight, config.max_queue, config.queue_timeout)
        self.metrics = Metrics(self)
        self.peers: Peers | None = None  # with --peer (peers_ctx)
        self.fleet.observe = self.metrics.routed
        self.fleet.configure(self.config)  # every Router tells the metrics of its decisions
        self.sync_members()

    def read_rest(self, reading: TokenReading) -> None:
        if self.reading_rest is None or self.reading_rest.done():
            self.reading_rest = asyncio.ensure_future(asyncio.to_thread(reading.rest))

    def sync_members(self) -> None:
        """The fleet as the configuration and the DNS answers name it now."""
        config = self.config
        prefills, decodes = list(config.prefills), list(config.decodes)
        origins = dict.fromkeys((spec.url for spec in prefills), "--prefill")
        origins |= dict.fromkeys(decodes, "--decode")
        for name in config.dns_names:
            for address in self.dns_answers.get(name, ()):
                if (url := name.url(address)) in origins:
                    continue  # also named as it is: once is enough
                origins[url] = f"dns {name}"
                if name.role == "prefill":
                    prefills.append(name.spec(address))
                else:
                    decodes.append(url)
        self.fleet.set_members(prefills, decodes, origins)

    def reconfigure(self, new: ProxyConfig) -> None:
        """Apply a reloaded configuration: members join and leave, limits and routing take
        their new values; what only a restart can change stays, and is logged."""
        old = self.config
        kept = {
            option.name: getattr(old, option.name)
            for option in SETTINGS
            if option.restart and getattr(new, option.name) != getattr(old, option.name)
        }
        for name in kept:
            log.warning(
                "reload: %s changed, but only a restart applies it", SETTINGS_BY_NAME[name].flag
            )
        new = dataclasses.replace(new, **kept)
        changed = [o.flag for o in SETTINGS if getattr(new, o.name) != getattr(old, o.name)]
        self.config = new
        self.admission.configure(new.max_in_flight, new.max_queue, new.queue_timeout)
        self.fleet.configure(new)
        logging.getLogger().setLevel(new.log_level)
        self.dns_answers = {n: a for n, a in self.dns_answers.items() if n in new.dns_names}
        self.sync_members()
        self.dns_changed.set()
        log.info("configuration reloaded: %s", ", ".join(changed) or "nothing changed")

    @property
    def serving(self) -> bool:
        """PD requests are taken: a prefill engine and a decode usable, and not draining."""
        return self.fleet.ready and not self.draining

    def count_local_prefill_decision(self, alone: bool, why: str, left: float) -> None:
        """One decision of local_prefill_decision, in the metrics and in /healthcheck; the
        tokens a decode is to compute itself (``left``), in prompt_tokens."""
        decision = "local" if alone else "pd"
        self.local_prefill_decisions[decision, why] += 1
        metrics = self.metrics
        metrics.of(metrics.local_prefill_decisions, decision, why).inc()
        if alone:
            metrics.of(metrics.prompt_tokens, "decode").inc(left)


STATE_KEY: Final = web.AppKey("state", ProxyState)


class ClientGone(Exception):
    """Writing to the client failed: it closed its connection before its answer was whole."""


class KvLoadFailed(ProxyError):
    """The decode of a PD pair failed before its first token: a 5xx, or a stream whose first
    event is an error. vLLM fails a request whose KV pull failed so (its
    kv_load_failure_policy "fail") and says nothing that tells it apart from other causes;
    before a token nothing reached the client, so the pair starts again whole
    (Exchange.try_again), and no instance leaves the rotation for it."""

    # Its prefill instance and decode: the retry prefers others (Exchange.try_again).
    pair: tuple[Backend, Backend] | None = None

    @classmethod
    def of(cls, attempt: Attempt, url: URL, why: str) -> KvLoadFailed:
        """The failure, with the prefill instance checked at once: vLLM fails so a decode that
        names the engine id of a prefill that restarted, and the next try should know the new
        one (suspect_checked)."""
        assert attempt.engine is not None  # a decode alone pulls no KV
        prefill = attempt.engine.instance
        prefill.recheck.set()
        failure = cls(502, f"decode {url} failed before its first token: {why}", reason="kv_load")
        failure.pair = prefill, attempt.decode
        return failure

    async def suspect_checked(self, within: float) -> None:
        """Until the prefill instance's check (started by ``of``) has ended, for ``within``
        seconds at most: a restarted prefill's new engine ids are then in place."""
        if self.pair is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    await self.pair[0].checked.wait()


class PrefillFailed(ProxyError):
    """A prefill's own 5xx: the KV it was to compute will never come, and nothing reached the
    client. A vLLM stopping answers so while its port still takes requests (500 "cannot
    schedule new futures after shutdown", seen on real vLLM 0.32 under SIGTERM), so the pair
    starts again on another prefill instance where the model has one not tried
    (Exchange.try_again); with none, vLLM's answer reaches the client as it came. The
    instance is checked at once (upstream_failure) but stays in the rotation: one 5xx says
    nothing of the next request."""

    instance: Backend  # the prefill instance that answered it (set by ``of``)

    @classmethod
    def of(cls, said: ProxyError, instance: Backend) -> PrefillFailed:
        failure = cls(
            said.status, said.message, body=said.body, content_type=said.content_type,
            reason=said.reason,
        )  # fmt: skip
        failure.instance = instance
        return failure


class StreamCut(ProxyError):
    """A stream's decode failed after tokens reached the client (StreamJournal): its
    connection was lost (``lost``), it sent an error, or its answer ended unfinished."""

    def __init__(self, message: str, decode: DecodeInstance, *, lost: bool) -> None:
        super().__init__(502, message, reason="broken" if lost else "in_band")
        self.decode, self.lost = decode, lost


class Unreachable(ProxyError):
    """A leg never reached its upstream: safe to try elsewhere, and a sign the host is down.

    ``backend`` is the instance that could not be reached; None once no try is left.
    """

    def __init__(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend = backend


# Seconds a decode's 5xx waits for its prefill leg to fail too (a refused or reset connection
# shows within a round trip); a prefill still computing is not waited for longer than this.
PREFILL_FAILURE_GRACE: Final = 0.25


# Refused or reset connections and connect timeouts; not a slow answer, not an HTTP status.
UNREACHABLE_ERRORS: Final = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ConnectionTimeoutError,
)


RESET_ERRNOS: Final = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


def was_reset(error: BaseException) -> bool:
    """A connection reset before the answer came: a restarting server closing its idle
    keep-alive connections as the request was written on one (uvicorn does on SIGTERM)."""
    if isinstance(error, aiohttp.ClientConnectionResetError):
        return True
    if not isinstance(error, aiohttp.ClientOSError):
        return False
    # A connection found closing as the body is written comes as "Can not write request
    # body", a ClientOSError without an errno, the reset its cause (aiohttp 3.14).
    return error.errno in RESET_ERRNOS or isinstance(error.__cause__, ConnectionResetError)


def failure_detail(error: BaseException) -> str:
    """What went wrong, in words: aiohttp's connect errors mention ssl even for plain http."""
    if isinstance(error, aiohttp.ClientConnectorError) and not isinstance(
        error, aiohttp.ClientSSLError
    ):
        return f"cannot connect to {error.host}:{error.port}: {os_error_reason(error.os_error)}"
    return str(error) or type(error).__name__


def os_error_reason(error: OSError) -> str:
    # An SSLError's errno is OpenSSL's (1 for a certificate refused), not the system's.
    if isinstance(error, ssl.SSLError):
        return str(error)
    if isinstance(error, socket.gaierror) or not error.errno:
        return error.strerror or str(error) or type(error).__name__
    return os.strerror(error.errno)


def transport_error(
    stage: str, url: URL, error: BaseException, backend: Backend | None = None
) -> ProxyError:
    """The one place that turns a failure to reach an upstream into the client's error: a
    leg's (LegFailed, or its deadline) or a health check's (aiohttp's client)."""
    if isinstance(error, LegFailed):
        unreachable, timed_out = error.unreachable, error.timed_out
    else:
        unreachable = isinstance(error, UNREACHABLE_ERRORS) or was_reset(error)
        timed_out = isinstance(error, TimeoutError)
    status = 504 if timed_out else 502
    if unreachable:
        reason = "timeout" if timed_out else "refused"
        message = f"{stage} {url} unreachable: {failure_detail(error)}"
        return Unreachable(status, message, reason=reason, backend=backend)
    if timed_out:
        return ProxyError(status, f"{stage} {url} timed out", reason="timeout")
    return ProxyError(status, f"{stage} {url} failed: {failure_detail(error)}", reason="broken")


def upstream_failure(
    stage: str, url: URL, leg: HttpLeg, body: bytes, suspect: Backend
) -> ProxyError:
    """An upstream's own error answer, passed on as it came. A 5xx has ``suspect`` checked at
    once: vLLM answers a decode that names a stale engine id with an immediate 500."""
    if leg.status >= 500:
        suspect.recheck.set()
    ctype = (leg.content_type or b"").decode("latin-1")
    return ProxyError.from_upstream(stage, url, leg.status, body, ctype)


def pool_exhausted(config: ProxyConfig, legs: str) -> ProxyError:
    return ProxyError(
        503,
        f"all {config.max_connections} upstream connections allowed by --max-connections are "
        f"in use; none came free within {config.pool_timeout:g} s (--pool-timeout) for {legs}",
        reason="pool_timeout",
        retry_after=1,
    )


# ================================================================================================
# 4. The front door
# Holds the middleware every request passes (ids, CORS, the API key, the access log) and the
# handlers: a PD route's (handle_completion -> plan_request (5) -> run_pd_request (6)), and the
# passthrough, models, health and metrics routes. Uses: 1-3, 5-6, 8-9, 11-12.
# ================================================================================================


@web.middleware
async def front_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request's one middleware, outermost first: its access line and metrics however
    it ended; a browser's CORS preflight (answered before any key is asked for: browsers send
    none with it); the --api-key check; and every failure as an OpenAI-style error body,
    never a traceback. One frame, not four: each would cost a coroutine per request."""
    state = request.app[STATE_KEY]
    stats = request[STATS_KEY] = RequestStats(
        request.method, route_label(request), loggable_path(request)
    )
    # Every request gets an id, for the access line and the client's X-Request-Id.
    stats.request_id = mint_request_id(request.headers.get(REQUEST_ID_HEADER))
    connection = request.protocol
    if isinstance(connection, ClientConnection):
        connection.head_received()
    status = 499  # nginx's "client closed request", for a client that left before the answer
    try:
        response: web.StreamResponse | None = preflight(request, state.config)
        if response is None:
            try:
                require_key(request, state.config)
                response = await handler(request)
            except Exception as error:
                response = error_response(request, stats, error)
        status = response.status
        if not response.prepared and isinstance(response, web.Response):
            stats.bytes_out = response.content_length or 0
        if state.draining:
            response.force_close()  # the client's next request goes to a proxy that stays
        return response
    except asyncio.CancelledError:
        # 499 (nginx's "client closed request") only if the client left before the answer began.
        status = stats.status_sent or status
        stats.outcome = "client_gone"
        state.metrics.errors.labels("client", "client_gone").inc()
        raise
    finally:
        record_request(state.metrics, stats, status)
        if isinstance(connection, ClientConnection):
            connection.request_done()


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def loggable_path(request: web.BaseRequest) -> str:
    """The request's path as the client sent it, cut short and safe for one log line."""
    path = request.raw_path
    path = path if len(path) <= 200 else f"{path[:200]}..."
    return path if path.isprintable() and path.isascii() else ascii(path)[1:-1]


def mint_request_id(client_request_id: str | None) -> str:
    """A request id unique across restarts and replicas: random, never a counter.

    A client's own id is kept as a prefix so it shows in vLLM's logs and response ids, but the
    random part keeps two requests with the same client id from sharing a ``transfer_id``.
    """
    suffix = os.urandom(16).hex()  # a random UUID's 32 hex digits, without making one
    if client_request_id and CLIENT_REQUEST_ID_PATTERN.fullmatch(client_request_id):
        return f"{client_request_id}-{suffix}"
    return suffix


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


# What a preflight's answer allows where --allowed-methods is '*' (Starlette's, as vLLM's).
CORS_ALL_METHODS: Final = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"


def preflight(request: web.Request, config: ProxyConfig) -> web.Response | None:
    """With --allowed-origins, the answer to a browser's preflight (OPTIONS with Origin and
    Access-Control-Request-Method); None for any other request. The other answers get their
    CORS headers as they are prepared (cors_headers), streams too."""
    if not config.allowed_origins or request.method != "OPTIONS":
        return None
    origin = request.headers.get(hdrs.ORIGIN)
    asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_METHOD)
    if not origin or not asked:
        return None
    refused = []
    if not cors_allows(config.allowed_origins, origin):
        refused.append("origin")
    if "*" not in config.allowed_methods and asked.upper() not in config.allowed_methods:
        refused.append("method")
    wanted = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "")
    names = {name.strip().lower() for name in wanted.split(",") if name.strip()}
    allowed = {name.lower() for name in config.allowed_headers}
    if "*" not in allowed and not names <= allowed:
        refused.append("headers")
    if refused:
        return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}")
    methods = config.allowed_methods
    listed = CORS_ALL_METHODS if "*" in methods else ", ".join(methods)
    headers = {hdrs.ACCESS_CONTROL_ALLOW_METHODS: listed, hdrs.ACCESS_CONTROL_MAX_AGE: "600"}
    if wanted:
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = (
            wanted if "*" in allowed else ", ".join(config.allowed_headers)
        )
    return web.Response(status=200, text="OK", headers=headers)


def cors_allows(origins: Sequence[str], origin: str) -> bool:
    return "*" in origins or origin in origins


def require_key(request: web.Request, config: ProxyConfig) -> None:
    """With --api-key, /v1/*, /inference/* and /admin/* (and /metrics with --protect-metrics)
    need the bearer key."""
    if config.api_key and (
        request.path.startswith(("/v1/", "/inference/", "/admin/"))  # /v1/, as vLLM guards
        or (config.protect_metrics and request.path == "/metrics")
    ):
        supplied = request.headers.get(hdrs.AUTHORIZATION, "").encode()
        # Constant time: how much of a guess matched must not show in the answer's timing.
        if not hmac.compare_digest(supplied, f"Bearer {config.api_key}".encode()):
            raise ProxyError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


async def handle_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    require_ready(state)
    require_json(request)
    body = parse_request_json(await read_body(request, state.config))
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if model is not None:
        request[STATS_KEY].model = model[:100]
    group = state.fleet.serving(model)  # vLLM's 404 for a model none serves, before a wait
    request[STATS_KEY].model_label = state.metrics.model_label(group.model)
    plan = plan_request(request.path, request.headers, body, state.config, group)
    admission = state.admission
    try:
        waited = await admission.enter(request_priority(request, body))
    except ProxyError as refused:
        state.metrics.errors.labels("admission", refused.reason).inc()
        raise
    try:
        if admission.limit:
            state.metrics.admission_wait.observe(waited)
            require_ready(state)  # the fleet may have changed while it waited
        return await run_pd_request(request, state, plan, body)
    finally:
        admission.leave()


async def handle_passthrough(request: web.Request) -> web.StreamResponse:
    """One of vLLM's other routes (PASSTHROUGH_ROUTES): the request whole to one decode, its
    answer streamed back as it comes. While no byte of an answer came, another decode is
    tried (an unreachable one leaves the rotation), up to --max-retries times."""
    state = request.app[STATE_KEY]
    require_serving(state)
    body = await read_body(request, state.config) if request.can_read_body else bytearray()
    stats = request[STATS_KEY]
    model = named_model(request, body)
    try:
        state.fleet.serving(model)  # vLLM's 404 for a model no instance serves
    except ProxyError:
        if request.path not in ANTHROPIC_PATHS:
            raise
        model = None  # any decode answers it, in Anthropic's shape
    headers = passthrough_headers(request, stats.request_id, state.config)
    try:
        await state.admission.enter(request_priority(request, {}))
    except ProxyError as refused:
        state.metrics.errors.labels("admission", refused.reason).inc()
        raise
    tried: set[Backend] = set()
    try:
        while True:
            decode = state.fleet.claim_decode(tried, model=model)
            stats.decode = str(decode.url)
            try:
                return await forward_whole(request, decode, bytes(body), headers)
            except Unreachable as failure:
                state.metrics.errors.labels("decode", failure.reason).inc()
                tried.add(decode)
                state.fleet.take_out(decode, failure.message)
                if len(tried) > state.config.max_retries:
                    raise
                state.metrics.retries.labels("decode").inc()
            finally:
                state.fleet.release_decode(decode)
    finally:
        state.admission.leave()


def named_model(request: web.Request, body: bytearray) -> str | None:
    """The model a passed-through JSON body names, if any: a decode that serves it answers.
    (A form's, as an audio upload's, is not read: those go where a request naming none does.)"""
    if not body or request.content_type != "application/json":
        return None
    try:
        fields = json.loads(body)
    except ValueError:
        return None  # vLLM's own answer to it is passed back
    model = fields.get("model") if isinstance(fields, dict) else None
    return model if isinstance(model, str) else None


def passthrough_headers(
    request: web.Request, request_id: str, config: ProxyConfig
) -> dict[str, str]:
    """upstream_headers, with the client's own Content-Type (an audio upload is a form)."""
    headers = upstream_headers(request.headers, request_id, config)
    if (content_type := request.headers.get(hdrs.CONTENT_TYPE)) is not None:
        headers[hdrs.CONTENT_TYPE] = content_type
    elif not request.can_read_body:
        del headers[hdrs.CONTENT_TYPE]
    return headers


async def forward_whole(
    request: web.Request, upstream: Backend, body: bytes, headers: Mapping[str, str]
) -> web.StreamResponse:
    """The request to ``upstream`` as the client sent it (its path and query), the answer
    back as the upstream wrote it: its status, its Content-Type, its body streamed. Raises
    Unreachable while nothing was answered; once the answer began, a failure cuts the
    client's connection (its answer is known incomplete) rather than ending it cleanly."""
    state, config = request.app[STATE_KEY], request.app[STATE_KEY].config
    url = upstream.url.join(request.rel_url)
    try:
        await state.slots.acquire(1, config.pool_timeout)
    except TimeoutError:
        raise pool_exhausted(config, f"{upstream.role} {upstream.url}") from None
    leg = None
    response = web.StreamResponse()
    try:
        async with asyncio.timeout(config.request_timeout):
            payload = (body,) if body else ()
            leg = await state.upstreams.send(
                request.method.encode(), url, header_lines(headers), payload
            )
            await leg.head()
            response.set_status(leg.status, leg.reason.decode("latin-1") or None)
            response.headers[hdrs.CONTENT_TYPE] = (
                leg.content_type or b"application/octet-stream"
            ).decode("latin-1")
            if leg.content_length is not None:
                response.content_length = leg.content_length
            response.headers[REQUEST_ID_HEADER] = request[STATS_KEY].request_id
            await response.prepare(request)
            while piece := await leg.next_bytes():
                await response.write(piece)
                request[STATS_KEY].bytes_out += len(piece)
            await response.write_eof()
        return response
    except (LegFailed, TimeoutError) as error:
        failure = transport_error(upstream.role, url, error, upstream)
        if not response.prepared:
            raise failure from None
        log.warning("%s %s: %s", request.method, request[STATS_KEY].path, failure.message)
        request[STATS_KEY].outcome = f"error:{failure.reason}"
        if request.transport is not None:
            request.transport.close()  # the client sees its answer cut, not ended
        return response
    except ConnectionResetError:  # the client left mid-answer
        request[STATS_KEY].outcome = "client_gone"
        return response
    finally:
        if leg is not None:
            state.upstreams.finish(leg)
        state.slots.release(1)


async def handle_every_instance(request: web.Request) -> web.Response:
    """vLLM's routes that change an instance (EVERY_INSTANCE_PATHS): sent to every prefill
    and decode instance that should hold the adapter (adapter_holders) at once. 200 with the
    first instance's answer where every one answered 2xx; else an error naming each that did
    not, with the status of the first (502 where it could not be reached). Either way their
    models are read again before the answer: a request for the adapter may follow at once."""
    state = request.app[STATE_KEY]
    require_serving(state)
    body = bytes(await read_body(request, state.config))
    instances, body = adapter_holders(state.fleet, request.path, body)
    if not instances:  # DNS names that resolve to none yet
        raise ProxyError(503, "no prefill or decode instance is known yet")
    try:
        return await every_instance(request, instances, body)
    finally:
        limits = state.config.upstream_timeout(state.config.health_timeout)
        await asyncio.gather(*(learn_models(state, instance, limits) for instance in instances))


def adapter_holders(fleet: Fleet, path: str, body: bytes) -> tuple[list[Backend], bytes]:
    """Where a LoRA adapter is loaded or unloaded, and the body to send there. A load goes to
    every instance, or, where it names a base ``model`` (the proxy's own field, taken out),
    to those that run that model: an adapter fits one base model's weights. An unload goes
    to the instances that list the adapter, or to every one where none does."""
    instances: list[Backend] = [*fleet.prefills, *fleet.decodes]
    with contextlib.suppress(ValueError):
        fields = json.loads(body)
        if not isinstance(fields, dict):
            return instances, body
        if path == "/v1/load_lora_adapter" and isinstance(base := fields.pop("model", None), str):
            body = encode_json(fields)
            runs = [b for b in instances if b.served is not None and b.served.model == base]
            if not runs:
                bases = (b.model for b in instances if b.served is not None)
                raise unknown_model(base, dict.fromkeys(bases))
            return runs, body
        if path == "/v1/unload_lora_adapter" and isinstance(name := fields.get("lora_name"), str):
            return [b for b in instances if b.served and name in b.served] or instances, body
    return instances, body


async def every_instance(
    request: web.Request, instances: Sequence[Backend], body: bytes
) -> web.Response:
    state = request.app[STATE_KEY]
    headers = header_lines(
        passthrough_headers(request, request[STATS_KEY].request_id, state.config)
    )
    answers = await asyncio.gather(
        *(answer_of(state, request, instance, body, headers) for instance in instances)
    )
    failed = [(i, a) for i, a in zip(instances, answers, strict=True) if not 200 <= a[0] < 300]
    if not failed:
        status, content_type, answer = answers[0]
        return web.Response(status=status, body=answer, headers={hdrs.CONTENT_TYPE: content_type})
    said = "; ".join(
        f"{i.role} {i.url}: {status} {answer_text(answer)}" for i, (status, _, answer) in failed
    )
    message = f"{request.path} failed on {len(failed)} of {len(instances)} instances: {said}"
    status = failed[0][1][0]
    raise ProxyError(status if 400 <= status < 500 else 502, message, reason="instances")


async def answer_of(
    state: ProxyState, request: web.Request, instance: Backend, body: bytes, headers: bytes
) -> tuple[int, str, bytes]:
    """One instance's whole answer to the client's request: its status, Content-Type and
    body; 502 and why where it could not be reached."""
    url = instance.url.join(request.rel_url)
    leg = None
    try:
        async with asyncio.timeout(state.config.request_timeout):
            leg = await state.upstreams.send(request.method.encode(), url, headers, (body,))
            answer = await leg.whole()
        return leg.status, (leg.content_type or b"text/plain").decode("latin-1"), answer
    except (LegFailed, TimeoutError) as error:
        return 502, "text/plain", transport_error(instance.role, url, error).message.encode()
    finally:
        if leg is not None:
            state.upstreams.finish(leg)


def answer_text(answer: bytes) -> str:
    """An instance's answer in an error message: an OpenAI error's message, else the text."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(answer)["error"]["message"])[:300]
    return answer.decode("utf-8", "replace")[:300]


async def handle_stored_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id} and POST .../cancel: vLLM's routes for a stored response, which
    the proxy never has (refuse_stored_responses): vLLM's 404, saying why."""
    raise ProxyError(
        404,
        f"Response with id '{request.match_info['response_id']}' not found: responses are not "
        "stored through the PD proxy (the server that would hold one is not the one this "
        "request would reach)",
        param="response_id",
        reason="stored_response",
    )


def require_ready(state: ProxyState) -> Fleet:
    fleet = state.fleet
    require_serving(state)
    if not fleet.ready:
        missing = "prefill engine" if not fleet.engine_count else "decode instance"
        raise ProxyError(503, f"proxy is not ready: no usable {missing}")
    return fleet


def require_serving(state: ProxyState) -> None:
    if state.draining:
        raise ProxyError(503, "proxy is draining: it is shutting down")


def require_json(request: web.Request) -> None:
    """A body declared JSON, as vLLM requires before it reads one (its answer, and status, to
    anything else; a form or text/plain re-sent as JSON would only meet that answer later)."""
    if request.content_type.lower() != "application/json":  # parameters (charset) aside
        message = "Unsupported Media Type: Only 'application/json' is allowed"
        raise ProxyError(400, message, reason="content_type")


async def handle_models(request: web.Request) -> web.Response:
    """Every model an instance serves, LoRA adapters with their parent, as vLLM lists them:
    each model's card as the first instance to list it wrote it. Until the instances' models
    are known (learn_models), one decode's own answer."""
    state = request.app[STATE_KEY]
    fleet = require_ready(state)
    if cards := fleet.known_models():
        payload = {"object": "list", "data": list(cards.values())}
        return web.Response(body=encode_json(payload), content_type="application/json")
    config = state.config
    decode = fleet.claim_decode()
    fleet.release_decode(decode)  # a quick read: not worth counting as load
    url = decode.routes["/v1/models"]
    headers: dict[str, str] = {hdrs.USER_AGENT: USER_AGENT}
    if authorization := upstream_authorization(request.headers, config):
        headers[hdrs.AUTHORIZATION] = authorization
    slots = state.slots
    try:
        await slots.acquire(1, config.pool_timeout)
    except TimeoutError:
        raise pool_exhausted(config, f"decode {decode.url}") from None
    leg = None
    try:
        async with asyncio.timeout(config.request_timeout):
            leg = await state.upstreams.send(b"GET", url, header_lines(headers))
            body = await leg.whole()
        response = web.Response(status=leg.status, body=body)
        content_type = (leg.content_type or b"application/json").decode("latin-1")
        response.headers[hdrs.CONTENT_TYPE] = content_type
        return response
    except (LegFailed, TimeoutError) as error:
        raise transport_error("decode", url, error) from None
    finally:
        if leg is not None:
            state.upstreams.finish(leg)
        slots.release(1)


def healthcheck_payload(state: ProxyState) -> dict[str, Any]:
    fleet = state.fleet
    return {
        "status": health_status(state),
        "id": ID,
        "version": VERSION,
        "ready": state.serving,
        "draining": state.draining,
        "pid": os.getpid(),  # which --workers process answered
        # Under --workers this page is one worker's view (each checks the fleet itself, and
        # in-flight counts are its own); /metrics adds up the whole daemon.
        "scope": "daemon" if state.config.workers == 1 else f"worker of {state.config.workers}",
        # Roles sending to instances that only time out, as too few are usable (panic); and
        # in each, the models whose instances are in one (a panic is judged per model).
        "panic": sorted(fleet.panics),
        "panic_models": {role: sorted(models) for role, models in sorted(fleet.panics.items())},
        "prefill_instances": len(fleet.prefills),
        "decode_instances": len(fleet.decodes),
        "tokenizer": state.tokenizer.path if state.tokenizer else None,  # with KV events
        # Why a chat's first turn spread, or joined others on its system prompt (ChatReturns).
        "chats_returning": round(fleet.prefill_router.returns.share(time.monotonic()), 2),
        "dns": [
            {
                "name": str(name),
                "role": name.role,
                "addresses": list(state.dns_answers.get(name, ())),
                "error": state.dns_errors.get(name),
            }
            for name in state.config.dns_names
        ],
        # With --peer: the replicas told of this process's sends, and how many it heard.
        "peers": state.peers.status() if state.peers is not None else None,
        "local_prefill": local_prefill_status(state),
        # The last PD self-test: per prefill engine and decode, whether it moved KV and why not.
        "self_test": state.self_test.status() if state.self_test is not None else None,
        "prefill": [instance.status() for instance in fleet.prefills],
        "decode": [instance.status() for instance in fleet.decodes],
    }


def local_prefill_status(state: ProxyState) -> dict[str, Any] | None:
    """--max-local-prefill-tokens at work: the limit and every decision so far by reason
    (None while every request goes through PD)."""
    config = state.config
    if not config.max_local_prefill_tokens:
        return None
    counts = state.local_prefill_decisions
    decisions: dict[str, dict[str, int]] = {}
    for decision, reason in LOCAL_PREFILL_REASONS:
        decisions.setdefault(decision, {})[reason] = counts[decision, reason]
    return {
        "max_tokens": config.max_local_prefill_tokens,
        "max_per_decode": config.max_local_prefills,
        "decisions": decisions,
    }


def health_status(state: ProxyState) -> Literal["ok", "degraded", "unavailable"]:
    """/healthcheck's word for it: "unavailable" while PD requests are refused (no usable
    prefill engine or decode, or draining: the page's 503); "degraded" while they are served
    but an instance is out of the rotation (one a reload let go aside), a role or a model is
    in a panic, or a model some instance serves has no usable prefill engine or decode; "ok"
    otherwise."""
    if not state.serving:
        return "unavailable"
    fleet = state.fleet
    out = any(not b.usable and not b.leaving for b in (*fleet.prefills, *fleet.decodes))
    return "degraded" if out or fleet.panics or any_model_unserved(fleet) else "ok"


def any_model_unserved(fleet: Fleet) -> bool:
    for model in fleet.known_models():
        try:
            view = fleet.serving(model)
        except ProxyError:
            return True
        if not view.engines or not view.decodes:
            return True
    return False


async def handle_self_test(request: web.Request) -> web.Response:
    """POST /admin/self-test: the PD self-test now (every pair, a few seconds), its result."""
    state = request.app[STATE_KEY]
    require_ready(state)
    result = await self_test(state)
    return web.json_response(result.status())


async def handle_healthcheck(request: web.Request) -> web.Response:
    payload = healthcheck_payload(request.app[STATE_KEY])
    return web.json_response(payload, status=200 if payload["ready"] else 503)


async def handle_livez(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves, draining included (unlike /health, which says
    whether to send it requests); what a Kubernetes livenessProbe asks."""
    return web.json_response({"alive": True, "draining": request.app[STATE_KEY].draining})


async def handle_health(request: web.Request) -> web.Response:
    ready = request.app[STATE_KEY].serving
    return web.Response(status=200 if ready else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    response = web.Response(body=request.app[STATE_KEY].metrics.exposition())
    response.headers[hdrs.CONTENT_TYPE] = "text/plain; version=0.0.4; charset=utf-8"
    return response


async def read_body(request: web.Request, config: ProxyConfig) -> bytearray:
    """The body, within --max-request-bytes (else 413) and its deadline (else 408).

    The deadline is --body-timeout plus a second per --body-min-rate bytes received, so a big
    upload at a sane rate gets the time it needs while a trickle is cut off. Read here and not
    with request.read(), which would keep a second copy for the whole request.
    """
    limit = config.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ProxyError(413, f"request body of {request.content_length} bytes exceeds {limit}")
    content = request.content
    body = bytearray(content.read_nowait())  # what came with the head: most often all of it
    if content.at_eof():
        if len(body) > limit:
            raise ProxyError(413, f"request body exceeds {limit} bytes")
        return body
    started = asyncio.get_running_loop().time()
    try:
        async with asyncio.timeout_at(started + config.body_timeout) as deadline:
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise ProxyError(413, f"request body exceeds {limit} bytes")
                allowed = config.body_timeout + len(body) / config.body_min_rate
                deadline.reschedule(started + allowed)
    except TimeoutError:
        raise ProxyError(
            408,
            f"request body not received in time: {len(body)} bytes in "
            f"{config.body_timeout + len(body) / config.body_min_rate:.1f} s "
            f"(--body-timeout {config.body_timeout:g} s plus 1 s per --body-min-rate "
            f"{config.body_min_rate} bytes)",
            reason="body_timeout",
        ) from None
    return body


def parse_request_json(raw: bytes | bytearray) -> dict[str, Any]:
    """The client's body as a JSON object, or a 400 saying what is wrong with it.

    A bytearray is consumed: it is emptied once decoded, so that a large body is never held as
    bytes, text and objects at once (json.loads of bytes would keep all three).
    """
    if not raw or raw.isspace():
        raise ProxyError(400, "request body is empty: expected a JSON object")
    body: object = None
    if FAST_LOADS is not None and len(raw) <= FAST_LOADS_LIMIT:
        # orjson reads strict UTF-8 JSON as the stdlib does; what it refuses (other encodings,
        # a BOM, lone surrogates, integers past 64 bits, NaN, deep nesting) is read below,
        # which accepts or refuses it as before, with the stdlib's words. Read through a view:
        # given a bytearray itself, orjson copies it first; the view goes before the bytes.
        with contextlib.suppress(ValueError), memoryview(raw) as view:
            body = FAST_LOADS(view)
    if isinstance(body, dict):
        if isinstance(raw, bytearray):
            raw.clear()
        return body
    try:
        # What json.loads does with bytes, done here so the bytes can go before parsing.
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError as error:
        raise ProxyError(400, f"request body is not valid JSON: {error}") from None
    if isinstance(raw, bytearray):
        raw.clear()
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ProxyError(400, "request body is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, invalid UTF-8, oversized integers
        raise ProxyError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"request body must be a JSON object, not {type(body).__name__}")
    return body


async def cors_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed origin's answer says so (Access-Control-Allow-Origin,
    and credentials where allowed), as its headers go out, for every answer."""
    if not isinstance(request, web.Request):
        return
    config = request.app[STATE_KEY].config
    origin = request.headers.get(hdrs.ORIGIN)
    if not config.allowed_origins or not origin or not cors_allows(config.allowed_origins, origin):
        return
    exact = config.allow_credentials or "*" not in config.allowed_origins
    response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin if exact else "*"
    if exact:
        response.headers.add(hdrs.VARY, "Origin")
    if config.allow_credentials:
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_CREDENTIALS] = "true"


def error_response(
    request: web.Request, stats: RequestStats, error: Exception
) -> web.StreamResponse:
    """A failure (``error``) as an OpenAI-style error body, never as a traceback; aiohttp's
    redirects are no failure and go on as raised."""
    allow = None
    if isinstance(error, ProxyError):
        log.info("%s %s -> %d: %s", request.method, stats.path, error.status, error.message)
        failure = error
    elif isinstance(error, web.HTTPException):  # aiohttp's own 404 and 405
        if error.status < 400:
            raise error
        message = f"{request.method} {stats.path}: {error.reason}"
        failure = ProxyError(error.status, message, reason="http")
        allow = error.headers.get(hdrs.ALLOW)
    else:
        log.error(
            "unexpected error while handling %s %s", request.method, stats.path, exc_info=error
        )
        failure = ProxyError(
            500, "internal error in mooncake-proxy; see its log", reason="internal"
        )
    stats.outcome = f"error:{failure.reason}"
    response = failure.response({REQUEST_ID_HEADER: stats.request_id})
    if allow:
        response.headers[hdrs.ALLOW] = allow
    if not request.content.is_eof():
        response.force_close()  # a body left unread (413, 408): the connection ends here
    return response


# ================================================================================================
# 5. The plan and admission
# Holds the API table (one Api row per PD route: where its prompt, cap and stops are, how its stream
# is written, what it refuses), the Plan a request is given once before any claim (plan_request),
# and its turn to run (Admission). Uses: 1-3, 8-9.
# ================================================================================================


@dataclass(frozen=True, slots=True)
class Api:
    """One route the PD flow serves, as vLLM reads its requests (API_ROUTES): where the prompt,
    the cap and the stop strings are, how its stream is written, what the proxy refuses."""

    path: str
    prompt: str  # the field that holds the prompt
    chat: bool  # messages, which the model's chat template renders (vLLM's chat defaults)
    conversation: bool  # the prompt is turns (a chat's messages, Responses' input items)
    sampling: str | None  # the object holding the cap and the stops; None: the body itself
    cap: str  # the field of the cap the prefill is given (one token)
    stores: bool  # vLLM keeps its answers (Responses' store): the prefill's one is not to be
    batch: bool  # a list of prompts is several requests to vLLM (fans_out)
    named_events: bool  # its stream's events are named (an error event too)
    tokenized_here: bool  # the proxy's tokenizer reads its prompt as vLLM does (KV events)
    continues: str | None = None  # why a stream of it does not go on elsewhere; None: it can
    refuse: Callable[[Mapping[str, Any]], None] | None = None  # raises for what it refuses


def refuse_stored_responses(body: Mapping[str, Any]) -> None:
    """A Responses request that needs a response kept on one server: 400, saying why. The
    proxy sends a request's prefill and decode to two servers, and the next request of a
    conversation to others again, so none holds what another stored (SGLang's gateway
    answers so too). The conversation's items can be sent in ``input`` instead."""
    if body.get("previous_response_id") is not None:
        raise ProxyError(
            400,
            "previous_response_id is not supported through the PD proxy: the response it names "
            "is stored on one vLLM server, and this request's prefill and decode run on others; "
            "send the conversation's items in 'input' instead",
            param="previous_response_id",
            reason="stored_response",
        )
    if lax_bool(body.get("background")):
        raise ProxyError(
            400,
            "background is not supported through the PD proxy: a background response is stored "
            "on the vLLM server that runs it, which later requests through the proxy do not reach",
            param="background",
            reason="stored_response",
        )


COMPLETIONS_API: Final = Api(
    COMPLETION_PATHS[0], "prompt", chat=False, conversation=False, sampling=None,
    cap="max_tokens", stores=False, batch=True, named_events=False, tokenized_here=True,
)  # fmt: skip


CHAT_API: Final = Api(
    COMPLETION_PATHS[1], "messages", chat=True, conversation=True, sampling=None,
    cap="max_tokens", stores=False, batch=False, named_events=False, tokenized_here=True,
)  # fmt: skip


# Its events are not rebuilt from token ids; its items are rendered by vLLM, not the
# proxy's tokenizer.
RESPONSES_API: Final = Api(
    RESPONSES_PATH, "input", chat=False, conversation=True, sampling=None,
    cap="max_output_tokens", stores=True, batch=False, named_events=True, tokenized_here=False,
    continues="a Responses stream is not continued elsewhere", refuse=refuse_stored_responses,
)  # fmt: skip


# A continuation is a completion's request, whose prompt is token ids: not this one's events.
GENERATE_API: Final = Api(
    GENERATE_PATH, "token_ids", chat=False, conversation=False, sampling="sampling_params",
    cap="max_tokens", stores=False, batch=False, named_events=False, tokenized_here=True,
    continues="a generate stream is not continued elsewhere",
)  # fmt: skip


API_ROUTES: Final[Mapping[str, Api]] = {
    api.path: api for api in (COMPLETIONS_API, CHAT_API, RESPONSES_API, GENERATE_API)
}


@dataclass(frozen=True, slots=True)
class Plan:
    """What a PD request is to do, settled once in the handler (plan_request) and read by its
    run: its API, its model (each attempt asks the fleet for that model's serving group as
    it is then), the route its prompt goes by, whether it goes to a decode alone, whether its
    stream can go on elsewhere, and what of its body both legs share."""

    api: Api
    model: str | None  # what the client named: the serving group's (Fleet.serving)
    stream: bool
    route: RouteKey | None  # for prefix_aware routing; None: not routed by prefix
    alone: str | None  # why it goes to a decode alone (fans_out); None: PD
    unmigratable: str | None  # why its stream cannot go on elsewhere; None: it can, or no stream
    shared: SharedBody | None  # a large body's fields both legs send, encoded once
    # The prompt's bytes as routing reads it (prompt_bytes), where its decode may compute it
    # alone (--max-local-prefill-tokens) and it has no route key to say so (route.length);
    # else 0.
    prompt_size: int = 0


def plan_request(
    path: str, headers: Mapping[str, str], body: Mapping[str, Any], config: ProxyConfig,
    group: Serving,
) -> Plan:  # fmt: skip
    """The plan of a request to a PD route (PD_PATHS) for the model ``group`` serves (whose
    routers' policies say whether it is routed by prefix); raises ProxyError for what its API
    refuses. Pure: no socket, no clock, nothing of the fleet's but the group."""
    api = API_ROUTES[path]
    if api.refuse is not None:
        api.refuse(body)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    route = None
    if Policy.PREFIX_AWARE in (group.prefill_router.policy, group.decode_router.policy):
        user = body.get("user")
        session = headers.get(SESSION_HEADER) or (user if isinstance(user, str) else None)
        route = route_key(api.path, body, session, config.prefix_block_bytes)
        if model is not None and group.adapter:
            route = dataclasses.replace(route, adapter=adapter_seed(group.adapter))
    alone = fans_out(api.path, body)
    # A large body's fields that both legs send are encoded once, for both; a small one's
    # legs are each encoded whole, which costs less than the pieces (3 us a request).
    size = headers.get(hdrs.CONTENT_LENGTH)  # None: chunked
    small = size is not None and size.isdigit() and int(size) < LEG_BODY_COPY_LIMIT
    stream = body.get("stream") is True
    why = None
    if stream:
        why = "it goes to a decode alone" if alone else api.continues
        why = why or unmigratable(body, config.migration_limit)
    shared = None if small else SharedBody.of(body)
    prompt_size = 0
    if config.max_local_prefill_tokens and alone is None and route is None:
        prompt_size = len(prompt_bytes(api.path, body))
    return Plan(api, model, stream, route, alone, why, shared, prompt_size)


# The fields of a request that a continuation cannot give as the decode would have: outputs
# computed over the prompt (logprobs, echo, suffix), output a grammar constrains or a chat's
# tool parser reads (/v1/completions would not go on with either), embeddings as prompt, and
# what vLLM computes over the output alone, which the continuation's prompt would hold
# (presence and frequency penalties, bad words; repetition_penalty counts prompt and output
# alike, and goes on unchanged).
UNMIGRATABLE_FIELDS: Final = (
    *("logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "prompt_embeds"),
    *("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
    *("response_format", "tools", "presence_penalty", "frequency_penalty", "bad_words"),
)


# vLLM splits a request with these fields into several that all carry its kv_transfer_params,
# each computing the prompt on the prefill and pulling it on the decode under the one
# transfer_id. Mooncake hands a transfer to one puller: the others wait out vLLM's KV timeout
# (seen on vLLM 0.32 through PD: 3 of 23 requests with n > 1 hung until it, most on prompts
# the decode had cached before), or load another prompt's KV (a batch of prompts came back
# with wrong text, with no error). Beam search sends requests of its own, which never pull the
# KV at all. Such requests go to a decode alone, which computes the prompt itself.
SAMPLE_COUNTS: Final = ("n", "best_of")


def fans_out(path: str, body: Mapping[str, Any]) -> str | None:
    """Why vLLM would split this request (the field that says so), or None if it would not.
    Values are read as vLLM's validation reads them: "3" and 3.0 are 3."""
    api = API_ROUTES[path]
    fields = body.get(api.sampling) if api.sampling is not None else body
    fields = fields if isinstance(fields, dict) else {}
    for name in SAMPLE_COUNTS:
        if lax_int(fields.get(name)) > 1:
            return name
    if lax_bool(body.get("use_beam_search")):
        return "use_beam_search"
    if api.batch and is_prompt_batch(body.get(api.prompt)):
        return "prompt"
    return None


def lax_int(value: object) -> int:
    """An integer as pydantic reads one in its lax mode; 0 for anything else."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else 0


def lax_bool(value: object) -> bool:
    """True as pydantic reads it in its lax mode."""
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "t", "yes", "y", "on"}
    return isinstance(value, int | float) and value == 1  # True among them


def is_prompt_batch(prompt: object) -> bool:
    """More than one prompt: a list of texts or of token lists (a list of ints is one)."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(one, str | list) for one in prompt)
    )


# The fields either leg sets or drops (prefill_body, decode_body, alone_body). The rest of the
# client's body is the same on both legs, and is encoded once for both (SharedBody).
LEG_FIELDS: Final = (
    *("stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens"),
    *("stop", "stop_token_ids", "ignore_eos", "kv_transfer_params", "return_token_ids"),
    *("max_output_tokens", "store", "sampling_params"),
)


# A leg's body as it goes on the wire, in pieces written one after the other.
LegPayload = tuple[bytes | memoryview, ...]


@dataclass(frozen=True, slots=True)
class SharedBody:
    """What every leg of a request sends of the client's body: its fields but LEG_FIELDS,
    encoded once. A large prompt is then held once for both legs (and every retry) instead of
    once per leg, and encoded once."""

    json: bytes  # a JSON object, b"{...}"

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> SharedBody:
        return cls(
            encode_json({key: value for key, value in body.items() if key not in LEG_FIELDS})
        )

    def with_fields(self, leg: Mapping[str, Any]) -> LegPayload:
        """``leg`` (a body the rewriting functions made from the client's) on the wire: the
        shared encoding, then the leg's own fields. The same object vLLM would have received
        in one piece, its keys in another order."""
        own = {key: leg[key] for key in LEG_FIELDS if key in leg}
        if not own:
            return (self.json,)
        tail = encode_json(own)
        if self.json == b"{}":
            return (tail,)
        return memoryview(self.json)[:-1], b"," + tail[1:]


def unmigratable(body: Mapping[str, Any], limit: int) -> str | None:
    """Why a stream could not go on token for token on another pair (None: it can)."""
    if limit == 0:
        return "--migration-limit is 0"
    for name in UNMIGRATABLE_FIELDS:
        value = body.get(name)
        if value is None or value is False or value == [] or value == {}:
            continue  # not asked for (logprobs 0 is: the sampled token's)
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "tools" and body.get("tool_choice") == "none":
            continue
        if name.endswith("_penalty") and not lax_float(value):
            continue
        return f"it asks for {name}"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "it asks for continuous_usage_stats"
    if (media := media_part(body.get("messages"))) is not None:
        return f"its messages hold {media}, which a continuation of token ids would not see"
    return None


def media_part(messages: object) -> str | None:
    """The first content part of a chat's messages that is not text (an image, audio, a
    video): vLLM computes it into the prompt apart from the token ids that stand for it."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                return f"a content part of type {kind!r}"
    return None


def lax_float(value: object) -> float:
    """A number as pydantic reads one in its lax mode; 0.0 for anything else."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def request_priority(request: web.Request, body: Mapping[str, Any]) -> int:
    """vLLM's request priority (lower runs first): the body's, else X-Vllm-Priority, else 0.
    Both go to the legs unchanged; here it only orders the proxy's own queue."""
    given = body.get("priority", request.headers.get(PRIORITY_HEADER))
    try:
        return int(given) if given is not None and not isinstance(given, bool) else 0
    except (TypeError, ValueError):
        return 0  # vLLM answers the bad value itself; the queue only needs an order


class Admission:
    """--max-in-flight: requests past it wait for one to finish, the lowest priority value
    first (vLLM's own order under --scheduling-policy priority), then first come first served;
    a bounded queue and a bounded wait, each answered 429 with Retry-After when exceeded, so a
    saturated cluster pushes back at the door instead of growing vLLM's queues."""

    RETRY_AFTER: ClassVar[int] = 1  # seconds: come back soon, the queue moves

    def __init__(self, limit: int, max_queue: int, timeout: float) -> None:
        self.limit, self.max_queue, self.timeout = limit, max_queue, timeout
        self.running = 0
        self.queued = 0  # waiting now (the heap may still hold some that gave up)
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrival = itertools.count()

    async def enter(self, priority: int) -> float:
        """Wait for a turn; the seconds waited. Raises ProxyError(429) when none comes."""
        if not self.limit or (self.running < self.limit and not self.queued):
            self.running += 1
            return 0.0
        if self.queued >= self.max_queue:
            raise self.refused(f"{self.queued} requests already wait (--max-queue)", "queue_full")
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (priority, next(self._arrival), turn))
        self.queued += 1
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                await turn
        except BaseException as error:
            if turn.done() and not turn.cancelled():
                self.leave()  # handed a turn just as the wait ended: pass it on
            else:
                turn.cancel()  # left in the heap, skipped when its turn comes
                self.queued -= 1
            if isinstance(error, TimeoutError):
                waited = f"waited {self.timeout:g} s for one of --max-in-flight {self.limit}"
                raise self.refused(waited, "queue_timeout") from None
            raise
        return time.monotonic() - started

    def configure(self, limit: int, max_queue: int, timeout: float) -> None:
        """New limits from a reload; a raised (or lifted) limit lets waiting requests in."""
        self.limit, self.max_queue, self.timeout = limit, max_queue, timeout
        while self.queued and (not limit or self.running < limit):
            self.running += 1
            self.leave()

    def leave(self) -> None:
        """A request ended: its turn goes to the first waiting one, if any (none while a
        reload lowered the limit below what runs)."""
        while self._heap and (not self.limit or self.running <= self.limit):
            _, _, turn = heapq.heappop(self._heap)
            if not turn.done():
                self.queued -= 1
                turn.set_result(None)  # it runs in this one's place
                return
        self.running -= 1

    def refused(self, why: str, reason: str) -> ProxyError:
        message = f"the proxy is at capacity: {why}; try again shortly"
        return ProxyError(429, message, reason=reason, retry_after=self.RETRY_AFTER)


# ================================================================================================
# 6. The run
# Holds one PD request as the protocol's steps (run_pd_request), its run state (Exchange) and tries
# (Tries, Attempt), the prefill leg beside the decode (PrefillWatch, send_prefill) and the legs'
# bodies and headers. Uses: 1-5, 7-12.
# ================================================================================================


async def run_pd_request(
    request: web.Request, state: ProxyState, plan: Plan, body: dict[str, Any]
) -> web.StreamResponse:
    """One PD request, as docs/flow.md's "The PD steps" numbers them (1 is the
    handler's: the body is parsed, the proxy is ready, the request planned)."""
    exchange = Exchange.of(request, state, plan, body)
    await exchange.learn_tokens()
    while True:
        try:
            async with (
                exchange.until_first_token(),  # --first-token-timeout, for a stream
                await exchange.attempt() as attempt,  # 2, 3: a prefill engine, a decode, ids
                attempt.beside_prefill(),  # 4; 6, 7 if it fails (none for a decode alone)
            ):
                await attempt.relay_decode()  # 4, 5; and 7 while a decode is refused
            return exchange.response
        except ProxyError as failure:
            # 7: a new pair, a new transfer_id; or migration. Else the error it ends with.
            if (final := await exchange.try_again(failure)) is None:
                continue
            return await exchange.fail(final)  # 6: its own answer, or in band once streaming
        except ClientGone:
            return exchange.client_gone()


class RelayResponse(web.StreamResponse):
    """The client's response: its headers leave together with the first body bytes.

    The relay prepares it only when those bytes are in hand, so buffering the headers saves
    a write (a syscall and a TCP segment) per request and delays nothing.
    """

    _send_headers_immediately = False
    writer: AbstractStreamWriter | None = None  # once prepared


@dataclass(slots=True)
class Tries:
    """A request's tries of pairs, its continuations' included: one budget (--max-retries),
    what failed, and what its picks left in routing's indexes."""

    left: int  # retries not yet used
    count: int = 0
    failures: list[ProxyError] = field(default_factory=list)  # those tried again (try_again)
    tried: set[Backend] = field(default_factory=set)  # unreachable, failed a KV load or a 5xx
    sends: list[Sent] = field(default_factory=list)  # what its picks added to routing's index

    def exhausted(self) -> Unreachable:
        """The error of a request that ran out of tries: it names each, and is not retried."""
        last = self.failures[-1]
        message = last.message
        if len(self.failures) > 1:
            tried = "; ".join(failure.message for failure in self.failures)
            message = f"{len(self.failures)} attempts failed: {tried}"
        return Unreachable(last.status, message, reason=last.reason)


@dataclass(eq=False, slots=True)
class Exchange:
    """One client request on its way through the PD flow: its plan, and the state of its run
    that its attempts share."""

    request: web.Request
    state: ProxyState
    plan: Plan
    stats: RequestStats
    legs: LegRequest
    tries: Tries
    # A stream that can go on elsewhere after its first token (migration).
    journal: StreamJournal | None = None
    response: RelayResponse = field(default_factory=RelayResponse)
    relaying: bool = False  # the attempt's tokens reach the client: it can no longer retry
    # When a stream's first token must have come by (loop time; --first-token-timeout), and
    # the scope that holds its attempts to it until it came (until_first_token).
    deadline: float | None = None
    first_token: FirstToken | None = None

    @classmethod
    def of(
        cls, request: web.Request, state: ProxyState, plan: Plan, body: dict[str, Any]
    ) -> Exchange:
        stats = request[STATS_KEY]
        headers = upstream_headers(request.headers, stats.request_id, state.config)
        stats.trace_id = trace_id_of(headers)
        if state.tracing is not None:
            stats.span = state.tracing.request_span(request.headers, stats.route)
            stats.span.set_attribute("mooncake.request_id", stats.request_id)
            stats.trace_id = trace_id_of_span(stats.span)
        if plan.alone is not None:
            state.metrics.of(state.metrics.prefill_skipped, plan.alone).inc()
        lines = header_lines(headers)  # the first attempt's, rendered before any claim
        legs = LegRequest(plan.api, body, plan.shared, headers, lines, plan.route)
        exchange = cls(request, state, plan, stats, legs, Tries(state.config.max_retries))
        exchange.deadline = exchange.first_token_deadline()
        if plan.stream and plan.unmigratable is None:
            exchange.journal = StreamJournal(plan.api, body)
        return exchange

    def first_token_deadline(self) -> float | None:
        """From now, when a stream's first token must have come (None: no limit, or not a
        stream: a whole answer's first byte comes with its last)."""
        limit = self.state.config.first_token_timeout
        if limit is None or not self.plan.stream:
            return None
        return asyncio.get_running_loop().time() + limit

    def until_first_token(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The scope an attempt runs in: until the deadline, while no token has come."""
        if self.deadline is None or self.relaying:
            self.first_token = None
            return contextlib.nullcontext()
        limit = self.state.config.first_token_timeout
        assert limit is not None  # a deadline is set only with one
        self.first_token = FirstToken(self.deadline, limit, self.state.metrics)
        return self.first_token

    async def learn_tokens(self) -> None:
        """With KV events heard, the prompt's token ids as vLLM computes them, as far as they
        match blocks the engines hold (a long prompt is tokenized in a thread, off the loop)."""
        state, legs = self.state, self.legs
        if legs.route is None or not state.fleet.hears_kv_events or not legs.api.tokenized_here:
            return
        if (tokens := prompt_token_ids(legs.api.path, legs.body)) is not None:
            legs.route = dataclasses.replace(legs.route, tokens=tokens)
        elif (tokenizer := state.tokenizer) is not None:
            views = state.fleet.kv_views()
            reading = TokenReading(tokenizer, legs.api.path, legs.body, views, legs.route.adapter)
            if legs.route.length > INLINE_TOKENS:
                await asyncio.to_thread(reading.read)
            else:
                reading.read()
            legs.route = reading.key(legs.route)
            if reading.share < 1.0:
                state.read_rest(reading)

    async def attempt(self) -> Attempt:
        """One try, to run as a context (Attempt.__aexit__ lets its claims go): a prefill
        engine (none for a decode alone), a decode and the legs' upstream connections claimed;
        the first attempt goes by the request's id, a retry by a new one (so a new
        ``transfer_id``)."""
        if self.tries.failures and isinstance(failed := self.tries.failures[-1], KvLoadFailed):
            await failed.suspect_checked(self.state.config.health_timeout)
        engine, decode, local = self.claim_pair()
        try:
            await self.state.slots.acquire(
                1 if engine is None else 2, self.state.config.pool_timeout
            )
        except BaseException as error:
            decode.local_prefills -= local
            self.state.fleet.release_decode(decode)
            named = f"decode {decode.url}"
            if engine is not None:
                self.state.fleet.release_prefill(engine)
                named = f"prefill {engine.url} rank {engine.dp_rank} and {named}"
            if isinstance(error, TimeoutError):
                raise pool_exhausted(self.state.config, named) from None
            raise
        self.tries.count += 1
        if (stats := self.stats).first_token is None:  # a continuation's pairs are not TTFT's
            stats.legs_sent, stats.pairs = time.monotonic(), stats.pairs + 1
            stats.prefill_answered = None  # an earlier pair's prefill is not this one's
        request_id, legs = self.stats.request_id, self.legs
        if self.tries.count > 1:
            request_id = mint_request_id(self.request.headers.get(REQUEST_ID_HEADER))
            self.stats.request_id = legs.headers[REQUEST_ID_HEADER] = request_id
            legs.lines = header_lines(legs.headers)  # passed once already: cannot fail now
        if not self.response.prepared:  # a continuation's stream has its id already
            self.response.headers[REQUEST_ID_HEADER] = request_id
        if engine is not None:
            self.stats.prefill = f"{engine.url}#{engine.dp_rank}"
        self.stats.decode = str(decode.url)
        if self.tries.failures:
            failure, where = self.tries.failures[-1].message, (engine or decode).url
            log.info("%s; retrying on %s as request %s", failure, where, request_id)
        return Attempt(self, request_id, engine, decode, local)

    def claim_pair(self) -> tuple[PrefillEngine | None, DecodeInstance, bool]:
        """From the model's serving group as it is now, among those not tried: a decode, and
        a prefill engine unless the decode computes the prompt alone (fans_out, or as
        computes_alone decides): then None, and whether it was decided here (a local
        prefill, counted on the decode until its first token)."""
        fleet, tries, route = self.state.fleet, self.tries, self.legs.route
        try:
            group = fleet.serving(self.plan.model)
            avoid: Collection[Backend] = tries.tried
            if self.state.config.avoid_recomputing and self.plan.alone is None:
                now = time.monotonic()
                avoid = tries.tried | {d for d in group.decodes if d.proof.held_out(now)}
            decode, held = group.claim_decode_holding(avoid, route, tries.sends)
            if self.plan.alone is not None:
                return None, decode, False
            if self.computes_alone(decode, held, prefills=bool(group.engines)):
                decode.local_prefills += 1
                return None, decode, True
            try:
                return group.claim_prefill(tries.tried, route, tries.sends), decode, False
            except ProxyError:
                fleet.release_decode(decode)
                raise
        except ProxyError as nothing_left:
            raise tries.exhausted() if tries.failures else nothing_left from None

    def computes_alone(self, decode: DecodeInstance, held: float, prefills: bool) -> bool:
        """Whether ``decode``, holding ``held`` of the prompt's blocks, is to compute the rest
        itself (--max-local-prefill-tokens), and not to pull it (local_prefill_decision);
        ``prefills``: whether the model has a usable prefill engine."""
        state = self.state
        if not state.config.max_local_prefill_tokens:
            return False
        if (journal := self.journal) is not None and self.legs.api is not self.plan.api:
            left = float(journal.prompt_count() + journal.count())  # a continuation: exactly
        else:
            left = local_tokens(
                self.legs.route, self.plan.prompt_size, held, state.config.prefix_block_bytes,
                state.fleet.bytes_per_token,
            )  # fmt: skip
        alone, why = local_prefill_decision(state.config, decode, left, held, prefills)
        state.count_local_prefill_decision(alone, why, left)
        return alone

    def fail_over(self, stage: str, backend: Backend | None, failure: ProxyError) -> None:
        """Step 7, for either leg: take the instance that could not be reached (if one could
        not) out of the rotation and allow another try; raises naming every try when none is
        left."""
        tries = self.tries
        tries.failures.append(failure)
        if backend is not None:
            tries.tried.add(backend)
            self.state.fleet.take_out(backend, failure.message)
        self.state.metrics.errors.labels(stage, failure.reason).inc()
        if tries.left <= 0:
            raise tries.exhausted()
        tries.left -= 1
        self.state.metrics.retries.labels(stage).inc()

    async def try_again(self, failure: ProxyError) -> ProxyError | None:
        """None to start the pair again: nothing of this attempt reached the client, and an
        instance was unreachable or lost the request before answering, the decode failed
        before its first token (KvLoadFailed), or a prefill answered 5xx while another is
        left (PrefillFailed). A decode that took the request may have pulled
        the KV, which the prefill gives out once, so the pair starts again whole. A stream cut
        after tokens goes on elsewhere from them (migrate). Else the error the request ends
        with: ``failure``, or one naming every try once none is left."""
        if isinstance(failure, StreamCut):
            return await self.migrate(failure)
        if self.relaying:
            return failure
        try:
            if isinstance(failure, KvLoadFailed):  # no instance is out: a transfer failed
                self.fail_over("decode", None, failure)
                self.tries.tried.update(failure.pair or ())  # another pair, where there is one
            elif isinstance(failure, Unreachable) and failure.backend is not None:
                self.fail_over(failure.backend.role, failure.backend, failure)
            elif isinstance(failure, PrefillFailed):
                if (last := self.prefill_failed(failure)) is not None:
                    return last
            else:
                return failure
        except ProxyError as exhausted:
            return exhausted
        return self.too_late(failure)

    def prefill_failed(self, failure: PrefillFailed) -> ProxyError | None:
        """None to try again on another prefill instance, where the model has one not tried;
        else the error the request ends with: vLLM's answer as it came, or, after other
        tries, one naming each (raised by fail_over once --max-retries are used)."""
        tries = self.tries
        if self.another_prefill(failure.instance):
            self.fail_over("prefill", None, failure)
            tries.tried.add(failure.instance)
            return None
        self.state.metrics.errors.labels("prefill", failure.reason).inc()
        if not tries.failures:
            return failure
        tries.failures.append(failure)
        return tries.exhausted()

    def another_prefill(self, failed: Backend) -> bool:
        """Whether the model's serving group has a usable prefill instance that this request
        has not tried, ``failed`` aside."""
        try:
            engines = self.state.fleet.serving(self.plan.model).engines
        except ProxyError:
            return False
        return any(e.instance is not failed and e.instance not in self.tries.tried for e in engines)

    def too_late(self, failure: ProxyError) -> ProxyError | None:
        """A whole answer's retry, once --first-token-timeout has passed since the request
        came: none starts (its first byte comes with its last, so the wait itself is not cut;
        a stream's attempts are held to it by until_first_token). None: try again."""
        limit = self.state.config.first_token_timeout
        if limit is None or self.deadline is not None:
            return None
        if (waited := time.monotonic() - self.stats.started) < limit:
            return None
        message = f"{failure.message}; not tried again after {waited:.0f} s (--first-token-timeout)"
        return ProxyError(504, message, reason="first_token_timeout")

    async def migrate(self, cut: StreamCut) -> ProxyError | None:
        """Go on from the tokens the client has, on another pair, as a completion of the
        prompt's token ids and those (StreamJournal.continuation); the error the stream ends
        with once --migration-limit continuations were made, or where it cannot go on exactly.
        A continuation draws on the request's one budget of tries (Tries), and has its own
        deadline to its first token."""
        journal, state = self.journal, self.state
        assert journal is not None  # a stream is cut (StreamCut) only with a journal
        state.metrics.errors.labels("decode", cut.reason).inc()
        self.tries.tried.add(cut.decode)
        if cut.lost:  # its connection went: likely down, as a refused one is
            state.fleet.take_out(cut.decode, cut.message)
        try:
            why = journal.why_not_continued(state.config.migration_limit)
            why = why or await journal.rewind(self.ends_a_character)
            body = why or journal.continuation(max_model_len(cut.decode, self.plan.model))
        except (ValueError, AttributeError, TypeError) as error:  # not what vLLM writes
            body = f"its last chunks could not be read ({error})"
        if isinstance(body, str):
            cut.message = f"{cut.message}; not continued elsewhere: {body}"
            state.metrics.of(state.metrics.migration_outcomes, "not_continued", cut.reason).inc()
            return cut
        legs = self.legs
        legs.body, legs.api, legs.shared = body, CONTINUATION_API, None
        self.relaying = False
        self.deadline = self.first_token_deadline()
        self.tries.failures.append(cut)
        state.metrics.migrations.labels(cut.reason).inc()
        if self.stats.cut is None:  # else one cut before it still waits for its continuation
            self.stats.cut = (time.monotonic(), cut.reason)
        log.warning("%s; going on from its last whole token on another pair", cut.message)
        return None

    async def ends_a_character(self, ids: list[int]) -> bool:
        """Whether the tokens ``ids`` end on a whole character as the model's tokenizer decodes
        them: vLLM's /detokenize of the last few, on a decode of the model that did not fail
        this request, ends in no U+FFFD (the test vLLM's detokenizer makes before it sends
        text). False where none answers: the place is not taken."""
        state = self.state
        try:
            group = state.fleet.serving(self.plan.model)
        except ProxyError:
            return False
        decodes = [d for d in group.decodes if d not in self.tries.tried]
        fields: dict[str, Any] = {"tokens": ids[-CHARACTER_TOKENS:]}
        if self.plan.model is not None:
            fields["model"] = self.plan.model
        payload = encode_json(fields)
        for decode in decodes[:2]:
            text = await detokenized(state, decode, payload, self.legs.lines)
            if text is not None:
                return not text.endswith("\ufffd")
        return False

    def count_failure(self, stage: str, failure: ProxyError) -> None:
        # Those are counted as they are tried again, or as they end the request (try_again).
        if not isinstance(failure, Unreachable | KvLoadFailed | StreamCut | PrefillFailed):
            self.state.metrics.errors.labels(stage, failure.reason).inc()

    async def fail(self, error: ProxyError) -> web.StreamResponse:
        """Answer with the error, or in band once the stream has started (step 6)."""
        response = self.response
        if 400 <= error.status < 500 and not response.prepared:  # refused: cached nowhere
            self.state.fleet.take_back(self.tries.sends)
        if not response.prepared:
            raise error  # the middleware answers with it (error_response)
        self.stats.outcome = f"stream_error:{error.reason}"
        log.warning("stream already started, ending it with an error: %s", error.message)
        if response.headers.get(hdrs.CONTENT_TYPE, "").startswith(SSE_CONTENT_TYPE):
            frame = error.sse_frame(named=self.plan.api.named_events)
            self.stats.bytes_out += len(frame)
            with contextlib.suppress(ConnectionError):
                await response.write(frame)
                await response.write_eof()
        else:  # a plain body cut short must not look complete: drop the connection instead
            ClientWire(self.request, response).drop()
        return response

    def client_gone(self) -> web.StreamResponse:
        # Found on a write before aiohttp cancelled the handler: the same as being cancelled.
        self.stats.outcome = "client_gone"
        self.state.metrics.errors.labels("client", "client_gone").inc()
        return self.response


def upstream_headers(
    client_headers: Mapping[str, str], request_id: str, config: ProxyConfig
) -> dict[str, str]:
    """Headers for both legs: the client's end-to-end headers plus the proxy's own.

    The client's Authorization is forwarded only while the proxy checks no key of its own:
    a key meant for the proxy is not vLLM's to see.
    """
    listed = {name.strip().lower() for name in client_headers.get(hdrs.CONNECTION, "").split(",")}
    headers = {
        name: value
        for name, value in client_headers.items()
        if name.lower() not in NOT_FORWARDED_HEADERS and name.lower() not in listed
    }
    headers[hdrs.CONTENT_TYPE] = "application/json"
    if hdrs.USER_AGENT not in client_headers:
        headers[hdrs.USER_AGENT] = USER_AGENT
    headers[REQUEST_ID_HEADER] = request_id
    if authorization := upstream_authorization(client_headers, config):
        headers[hdrs.AUTHORIZATION] = authorization
    headers.update(trace_headers(client_headers))
    return headers


def upstream_authorization(client_headers: Mapping[str, str], config: ProxyConfig) -> str | None:
    if config.upstream_api_key:
        return f"Bearer {config.upstream_api_key}"
    if config.api_key:
        return None
    return client_headers.get(hdrs.AUTHORIZATION)


def trace_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    """W3C trace context for both legs: the client's, if it is valid; else a new trace, so
    that the prefill's and the decode's spans (vLLM's --otlp-traces-endpoint) share one trace
    id all the same. Sampled: vLLM records what its parent asks to be recorded."""
    given = client_headers.get("traceparent", "").strip()
    if (match := TRACEPARENT_PATTERN.fullmatch(given)) is not None:
        version, trace_id, span_id, _ = match.groups()[:4]
        fields_fit = version != "00" or match[5] is None  # version 00 has four, no more
        if version != "ff" and fields_fit and trace_id != "0" * 32 and span_id != "0" * 16:
            headers = {"traceparent": given}
            if state := client_headers.get("tracestate"):
                headers["tracestate"] = state
            return headers
    trace_id, span_id = random.getrandbits(128) or 1, random.getrandbits(64) or 1
    return {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"}


def trace_id_of(headers: Mapping[str, str]) -> str:
    return headers["traceparent"][3:35]


def header_lines(headers: Mapping[str, str]) -> bytes:
    """Headers as they go on the wire (UpstreamPool.send adds Content-Length and the end)."""
    block = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    if block.count("\n") != len(headers) or block.count("\r") != len(headers):
        # aiohttp's parser lets no line break into a client's header, nor the configuration
        # into the upstream key (header_value): one here is the proxy's bug. Refuse rather
        # than send a header nobody wrote.
        raise ProxyError(500, "a header for the upstream contains a line break")
    return block.encode("utf-8", "surrogateescape")


class FirstToken:
    """A stream's deadline to its first token (--first-token-timeout), over its attempts: a
    decode that sent its head and then nothing, or KV pulls that time out one pair after
    another, end in a 504 (in band for a continuation) instead of holding the client. The
    relay lifts it once the token is in hand (came): a stream may then last for hours."""

    __slots__ = ("limit", "metrics", "scope")

    def __init__(self, deadline: float, limit: float, metrics: Metrics) -> None:
        self.scope, self.limit, self.metrics = asyncio.timeout_at(deadline), limit, metrics

    async def __aenter__(self) -> None:
        await self.scope.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: Any
    ) -> None:
        try:
            await self.scope.__aexit__(kind, error, tb)
        except TimeoutError:  # its own deadline: the attempt was cancelled, its claims let go
            self.metrics.errors.labels("request", "first_token_timeout").inc()
            message = f"no first token within {self.limit:g} s (--first-token-timeout)"
            raise ProxyError(504, message, reason="first_token_timeout") from None

    def came(self) -> None:
        self.scope.reschedule(None)


@dataclass(eq=False)
class Attempt:
    """One try of the pair of legs: the ids it goes by, the prefill engine (None for a decode
    alone) and the decode it holds claims on (the decode changes while one refuses), and its
    prefill leg."""

    exchange: Exchange
    request_id: str
    engine: PrefillEngine | None
    decode: DecodeInstance
    local: bool = False  # its decode computes the prompt (counted there until its first bytes)
    prefill: asyncio.Task[None] | None = None
    watch: PrefillWatch | None = None  # the prefill leg's, while the decode leg runs
    decode_leg: HttpLeg | None = None
    prefill_span: Any = None  # with --otlp-traces-endpoint
    decode_span: Any = None

    async def __aenter__(self) -> Attempt:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """However the try ended, its claims and slots are released, and a prefill still
        running is kept if the decode finished, else cancelled (vLLM then aborts it). A class
        and not a generator's context: this runs for every request."""
        try:
            if kind is None:
                self.hand_over_prefill()
            else:
                await self.abandon_prefill()
        finally:
            self.prompt_computed()
            self.exchange.state.fleet.release_decode(self.decode)
            self.exchange.state.slots.release(1)

    def prompt_computed(self) -> None:
        """A local prefill's decode is done computing the prompt (its first bytes came, or the
        attempt ended): it may take another (--max-local-prefills)."""
        if self.local:
            self.local = False
            self.decode.local_prefills -= 1

    def prompt_arrived(self) -> None:
        """Its decode has the prompt (its first bytes came): for the decode's TransferProof,
        one PD prompt it should have pulled, or tokens it computed alone (estimated whole:
        what it held of them is not counted computed, so the estimate errs on the side of
        never calling a decode recomputing that is not)."""
        proof = self.decode.proof
        if self.engine is not None:
            proof.answered += 1
            return
        exchange = self.exchange
        proof.sent_alone += local_tokens(
            exchange.legs.route, exchange.plan.prompt_size, 0,
            exchange.state.config.prefix_block_bytes, exchange.state.fleet.bytes_per_token,
        )  # fmt: skip

    def prompt_reported(self, tail: bytes) -> None:
        """A whole PD answer's usage (in ``tail``, its last bytes), where it has one: for the
        decode's TransferProof, whether its prompt's KV was pulled, by vLLM's cached_tokens;
        said once where the decode does not report them."""
        if (report := answer_prompt_cache(tail)) is None:
            return  # no usage at its end: a stream without include_usage, a Responses answer
        decode, metrics = self.decode, self.exchange.state.metrics
        first = decode.proof.cached_reported is None
        if (source := decode.proof.take_answer(*report)) is not None:
            metrics.pd_answers.labels(str(decode.url), source).inc()
        elif first:
            log.info(
                "decode %s reports no cached_tokens in its answers (vLLM's "
                "--enable-prompt-tokens-details): its requests whose KV was recomputed are not "
                "counted; its prompt-source counters still tell whether it pulls", decode.url,
            )  # fmt: skip

    @property
    def transfer_id(self) -> str:
        return transfer_id_for(self.request_id)

    def beside_prefill(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The decode leg's context: the prefill leg sent beside it, which stops it if the
        prefill fails; nothing for a decode alone."""
        if self.engine is None:
            return contextlib.nullcontext()
        engine = self.engine
        self.watch = PrefillWatch(self, engine.instance, self.send_prefill(engine))
        return self.watch

    def send_prefill(self, engine: PrefillEngine) -> asyncio.Task[None]:
        """Step 4's prefill leg, as a task beside the decode; its claims go when it ends."""
        exchange = self.exchange
        leg = prefill_body(exchange.legs.body, self.transfer_id, exchange.legs.api)
        payload = exchange.legs.payload(leg)
        rank = b"%s: %d\r\n" % (DP_RANK_HEADER.encode(), engine.dp_rank)
        self.prefill_span, headers = self.leg_span("prefill", engine.instance)
        headers += rank
        self.prefill = asyncio.create_task(send_prefill(exchange, engine, payload, headers))
        # A done callback runs even for a task cancelled before it started: claims never leak.
        self.prefill.add_done_callback(self.prefill_ended)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s: prefill %s rank %d, decode %s",
                *(self.request_id, engine.url, engine.dp_rank, self.decode.url),
            )
        return self.prefill

    def prefill_ended(self, _: object = None) -> None:
        assert self.engine is not None  # a prefill leg ran on it
        self.exchange.state.fleet.release_prefill(self.engine)
        self.exchange.state.slots.release(1)
        if self.prefill_span is not None:
            if self.prefill is not None and (error := leg_error(self.prefill)) is not None:
                self.prefill_span.set_status(span_error(str(error)))
            self.prefill_span.end()

    def leg_span(self, stage: str, backend: Backend) -> tuple[Any, bytes]:
        """The leg's headers; with tracing, its own span too, which they name as their parent."""
        exchange, legs = self.exchange, self.exchange.legs
        if exchange.stats.span is None or exchange.state.tracing is None:
            return None, legs.lines
        span, headers = exchange.state.tracing.leg(exchange.stats.span, stage, legs.headers)
        span.set_attribute("server.address", str(backend.url))
        if self.engine is not None:
            span.set_attribute("mooncake.transfer_id", self.transfer_id)
        return span, header_lines(headers)

    async def abandon_prefill(self) -> None:
        """The client went away or the decode failed: closing the prefill's connection makes
        vLLM abort the request and free its slot."""
        if self.prefill is None:
            if self.engine is not None:
                self.prefill_ended()  # never sent: its claims go all the same
        elif not self.prefill.done():
            self.prefill.cancel()
            await asyncio.gather(self.prefill, return_exceptions=True)

    def hand_over_prefill(self) -> None:
        """The decode finished: a prefill still running is kept until it answers."""
        prefill = self.prefill
        if prefill is None:
            return
        lingering = self.exchange.state.lingering
        if prefill.done():
            self.prefill_outlived(prefill)
            return
        lingering.add(prefill)
        prefill.add_done_callback(lingering.discard)
        prefill.add_done_callback(self.prefill_outlived)

    def prefill_outlived(self, prefill: asyncio.Task[None]) -> None:
        if (error := leg_error(prefill)) is not None:
            log.warning(
                "request %s: prefill failed once its decode had the KV: %s", self.request_id, error
            )

    async def open_decode(self) -> HttpLeg:
        """Send the decode leg and wait for its head, moving to another decode while they
        refuse the connection: one that never had the request never pulled the KV, which
        waits for whoever pulls its ``transfer_id``. A decode that took the request and then
        failed before answering may have pulled it (a non-streamed one answers only once it
        generated all): the prefill gives a transfer out once, so the failure goes up, and
        the pair starts again whole (Exchange.try_again)."""
        exchange, legs = self.exchange, self.exchange.legs
        fleet, upstreams = exchange.state.fleet, exchange.state.upstreams
        if self.engine is None:
            body = alone_body(legs.body)
        else:
            body = decode_body(legs.body, self.engine, self.transfer_id)
        if exchange.journal is not None:  # what the stream would go on from (StreamJournal)
            body["return_token_ids"] = True
        payload = legs.payload(body)
        while True:
            url = self.decode.routes[legs.api.path]
            self.decode_span, headers = self.leg_span("decode", self.decode)
            try:
                self.decode_leg = leg = await upstreams.send(b"POST", url, headers, payload)
            except LegFailed as error:
                failure = self.decode_failed(url, error)  # refused: never sent
            else:
                try:
                    await leg.head()
                    return leg
                except LegFailed as error:
                    raise self.decode_failed(url, error) from None
            if not isinstance(failure, Unreachable) or self.local:
                # A local prefill was decided on what that decode holds: another attempt
                # decides again on another (try_again), PD where it holds nothing.
                raise failure
            exchange.fail_over("decode", self.decode, failure)
            tries = exchange.tries
            try:
                group = fleet.serving(exchange.plan.model)
                decode = group.claim_decode(tries.tried, legs.route, tries.sends)
            except ProxyError:
                raise tries.exhausted() from None
            fleet.release_decode(self.decode)
            log.info("decode %s unreachable, trying %s", url, decode.url)
            self.decode, exchange.stats.decode = decode, str(decode.url)

    def decode_failed(self, url: URL, error: LegFailed) -> ProxyError:
        failure = transport_error("decode", url, error, self.decode)
        self.end_decode_span(failure.message)
        self.finish_decode_leg()
        return failure

    async def relay_decode(self) -> None:
        """Step 5: the decode's status, content type and bytes reach the client as they come.

        The client's headers are held until the decode's first body bytes, a PD stream's until
        its first token: a streaming decode sends 200 before its KV arrives, and until a token
        flows a prefill failure can still be answered with the prefill's own status, and a
        failed KV pull tried again.
        """
        exchange = self.exchange
        try:
            if (limit := exchange.state.config.request_timeout) is None:
                await self.decode_leg_through()  # the default: a stream may last for hours
            else:
                async with asyncio.timeout(limit):
                    await self.decode_leg_through()
        except (LegFailed, TimeoutError) as error:
            url = self.decode.routes[exchange.legs.api.path]
            failure = transport_error("decode", url, error)
            if isinstance(error, LegFailed) and not exchange.relaying:
                # Lost as it answered, before a byte reached the client (a whole answer's
                # head came, then the connection went): the pair starts again (try_again).
                lost = Unreachable(502, failure.message, reason="broken", backend=self.decode)
                raise lost from None
            if isinstance(error, LegFailed):
                await self.end_stream(failure, lost=True)
                return
            exchange.count_failure("decode", failure)
            raise ProxyError(failure.status, failure.message, reason="broken") from None
        except ProxyError as failure:
            exchange.count_failure("decode", failure)
            self.end_decode_span(failure.message)
            raise
        finally:
            self.finish_decode_leg()
            self.end_decode_span()

    async def decode_leg_through(self) -> None:
        leg = await self.open_decode()
        url = self.decode.routes[self.exchange.legs.api.path]
        if leg.status >= 400:
            body = await leg.whole()
            if leg.status >= 500:
                await self.let_prefill_speak()
            suspect = self.decode if self.engine is None else self.engine.instance
            failure = upstream_failure("decode", url, leg, body, suspect)
            if leg.status >= 500 and self.engine is not None:  # as vLLM fails a failed KV pull
                raise KvLoadFailed.of(self, url, failure.message)
            raise failure
        self.decode.last_success = time.monotonic()
        await relay_body(self, leg, url)

    async def end_stream(self, cut: ProxyError | str | None, *, lost: bool = False) -> None:
        """How an answer whose bytes reach the client ends: decided here alone. ``cut`` None:
        it is whole, and ends. Else why its decode stopped short of its end (``lost``: its
        connection went). An answer whose last token went out already is owed only its end;
        a stream with a journal goes on on another pair (StreamCut, for Exchange.migrate);
        any other ends with the error (in band once streaming: Exchange.fail), saying why it
        was not continued."""
        exchange, journal, response = self.exchange, self.exchange.journal, self.exchange.response
        if cut is None or (journal is not None and journal.finished):
            with contextlib.suppress(ConnectionError):
                if cut is not None and journal is not None:
                    await response.write(journal.ending())
                await response.write_eof()
            return
        if journal is not None:
            why = cut if isinstance(cut, str) else f"{cut.message} after {journal.count()} tokens"
            self.end_decode_span(why)
            raise StreamCut(f"request {self.request_id}: {why}", self.decode, lost=lost)
        assert isinstance(cut, ProxyError)  # a text only says why a journal's stream stopped
        exchange.count_failure("decode", cut)
        reason = "in_band" if cut.reason == "in_band" else "broken"
        metrics = exchange.state.metrics
        metrics.of(metrics.migration_outcomes, "not_continued", reason).inc()
        message = cut.message
        if (unmigratable := exchange.plan.unmigratable) is not None:
            message = f"{message}; not continued elsewhere: {unmigratable}"
        raise ProxyError(cut.status, message, reason="broken")

    def finish_decode_leg(self) -> None:
        if self.decode_leg is not None:
            self.exchange.state.upstreams.finish(self.decode_leg)
            self.decode_leg = None

    async def let_prefill_speak(self) -> None:
        """A decode's 5xx is often the echo of a prefill that is gone (its bootstrap refused,
        its engine id unknown): a moment for the prefill leg to fail first, so that its error
        wins and the pair is tried elsewhere (PrefillWatch) instead of failing."""
        if self.prefill is not None and not self.prefill.done():
            await asyncio.wait({self.prefill}, timeout=PREFILL_FAILURE_GRACE)

    def end_decode_span(self, error: str | None = None) -> None:
        if (span := self.decode_span) is None:
            return
        if error is not None:
            span.set_status(span_error(error))
        span.end()
        self.decode_span = None


def transfer_id_for(request_id: str) -> str:
    return f"xfer-{request_id}"


def prefill_body(
    body: Mapping[str, Any], transfer_id: str, api: Api = COMPLETIONS_API
) -> dict[str, Any]:
    """The prefill leg: one length-capped token whose only purpose is the KV cache.

    The prefill pushes KV only if its single token ends the request by length. EOS, a stop
    string or a stop token would end it "stopped" and free the KV unsent, so everything that
    can stop it early is removed; the token itself is discarded (the decode samples its own).
    A Responses request's cap is max_output_tokens, and its one token is not to be stored; a
    generate request's cap and stops are in its sampling_params.
    """
    prefill = dict(body)
    for key in ("stream_options", "min_tokens", "stop", "stop_token_ids"):
        prefill.pop(key, None)
    prefill["stream"] = False
    if api.sampling is not None:
        if api.sampling in body:  # required: vLLM refuses a request without
            prefill[api.sampling] = capped_sampling(body[api.sampling])
    else:
        prefill[api.cap] = 1
        if api.stores:
            prefill["store"] = False
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        prefill["ignore_eos"] = True
    prefill["kv_transfer_params"] = PrefillKvTransferParams(
        do_remote_decode=True, do_remote_prefill=False, transfer_id=transfer_id
    )
    return prefill


def capped_sampling(given: object) -> object:
    """A generate request's sampling_params for its prefill: one token, ended by length (as
    prefill_body does to a completion's fields). What is not an object goes as it came, for
    vLLM to refuse."""
    if not isinstance(given, dict):
        return given
    sampling = {k: v for k, v in given.items() if k not in ("min_tokens", "stop", "stop_token_ids")}
    sampling["max_tokens"], sampling["ignore_eos"] = 1, True
    return sampling


@dataclass(slots=True)
class LegRequest:
    """What the legs of the next attempt send: the client's request, or a continuation's (a
    completion, whatever the client's API); the headers, whose request id each retry renews
    (``lines``: as written, header_lines); the route its prompt goes by (learn_tokens)."""

    api: Api
    body: dict[str, Any]
    shared: SharedBody | None  # what both legs of every attempt send of a large body
    headers: dict[str, str]
    lines: bytes
    route: RouteKey | None

    def payload(self, leg: Mapping[str, Any]) -> LegPayload:
        """``leg`` (a body the rewriting functions made of the client's) as it is sent."""
        return (encode_json(leg),) if self.shared is None else self.shared.with_fields(leg)


class PrefillWatch:
    """Runs the decode leg (the block) while ``prefill`` runs beside it on ``instance``.

    A prefill that fails before the decode's first token means its KV will never come: the
    block is cancelled at once rather than after vLLM's KV timeout, and the prefill's error
    leaves it in place of whatever the decode did, as the root cause. So does a prefill
    instance that goes down (its checks fail, its port refuses) or restarts before a streamed
    decode's first token, even after the prefill answered: the KV it held went with it, and
    the decode would wait out Mooncake's timeouts; no byte has reached the client, so the pair
    is tried again elsewhere. Not a non-streamed one: it sends nothing before its whole
    answer, so a decode still waiting for the KV cannot be told from one generating.

    Once a token came (kv_arrived), the KV is the decode's: whatever befalls the prefill then
    stops nothing, and is no cause of the decode's own failures. The block runs in the
    handler's own task (one task less per request); a client gone at the same time still wins
    (asyncio.timeout lets a cancellation that is not its own through).
    """

    __slots__ = ("exchange", "instance", "lost", "prefill", "running", "scope")

    def __init__(
        self, attempt: Attempt, instance: PrefillInstance, prefill: asyncio.Task[None]
    ) -> None:
        self.exchange, self.instance, self.prefill = attempt.exchange, instance, prefill
        self.lost: Unreachable | None = None  # the KV, with the prefill instance that held it
        # The block's scope: asyncio.timeout with no deadline, set to "now" to stop the block.
        # It cancels the block alone and tells that cancellation apart from the client's.
        self.scope = asyncio.timeout(None)
        self.running = False

    async def __aenter__(self) -> None:
        self.prefill.add_done_callback(self.prefill_done)
        if self.exchange.plan.stream:
            self.instance.down_watchers.add(self.instance_down)
        self.running = True
        await self.scope.__aenter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: Any
    ) -> None:
        self.running = False
        self.instance.down_watchers.discard(self.instance_down)
        try:
            await self.scope.__aexit__(kind, error, tb)
        except TimeoutError:  # stopped here
            if (cause := self.cause()) is None:
                raise
            raise cause from None
        if isinstance(error, TimeoutError | ProxyError) and (cause := self.cause()) is not None:
            raise cause from None

    def cause(self) -> BaseException | None:
        """Why the block failed at root, if the prefill did before the decode's first token:
        its error, or its KV lost."""
        if self.exchange.relaying:
            return None
        return leg_error(self.prefill) or self.lost

    def stop(self, cause: Unreachable | None = None) -> None:
        # Once, and only while the block runs and no token has come.
        if self.running and not self.exchange.relaying and self.scope.when() is None:
            self.lost = cause
            self.scope.reschedule(0)

    def kv_arrived(self) -> None:
        """The decode's first token is in hand: a stop not yet carried out is called off. One
        asked for in the same turn of the loop (the prefill's instance found down as the token
        came) would cut a stream the client already has the first bytes of; a stop carried
        out would have woken the block with it instead of the token."""
        if self.scope.when() is not None and not self.scope.expired():
            self.scope.reschedule(None)
            self.lost = None

    def prefill_done(self, done: asyncio.Task[None]) -> None:
        if leg_error(done) is not None:
            self.stop()

    def instance_down(self, why: str) -> None:
        message = f"prefill {self.instance.url} {why} before its KV was pulled"
        self.stop(Unreachable(502, message, reason="kv_lost", backend=self.instance))


def decode_body(body: Mapping[str, Any], engine: PrefillEngine, transfer_id: str) -> dict[str, Any]:
    """The decode leg: the client's request as sent, told where to pull its KV from."""
    decode = dict(body)
    decode["kv_transfer_params"] = DecodeKvTransferParams(
        do_remote_decode=False,
        do_remote_prefill=True,
        remote_bootstrap_addr=engine.bootstrap_addr,
        remote_engine_id=engine.engine_id,
        transfer_id=transfer_id,
    )
    return decode


def alone_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A request for a decode alone (fans_out): the client's, with no KV to pull."""
    alone = dict(body)
    alone.pop("kv_transfer_params", None)
    return alone


async def send_prefill(
    exchange: Exchange, engine: PrefillEngine, payload: LegPayload, headers: bytes
) -> None:
    """The prefill leg; raises ProxyError for every outcome after which no KV will be sent."""
    state = exchange.state
    url = engine.instance.routes[exchange.legs.api.path]
    where = f"prefill rank {engine.dp_rank}"
    started = time.monotonic()
    leg = None
    try:
        async with asyncio.timeout(state.config.prefill_timeout):
            leg = await state.upstreams.send(b"POST", url, headers, payload)
            body = await leg.whole()  # to the end, so the connection goes back to the pool
        if not 200 <= leg.status < 300:
            said = upstream_failure(where, url, leg, body, suspect=engine.instance)
            raise PrefillFailed.of(said, engine.instance) if leg.status >= 500 else said
        problem, prompt_tokens = prefill_outcome(body)
        if problem:
            raise ProxyError(502, f"{where} {problem}", reason="stopped_early")
        state.metrics.of(state.metrics.prompt_tokens, "prefill").inc(prompt_tokens)
        if exchange.stats.first_token is None:  # a continuation's prefill is not TTFT's
            exchange.stats.prefill_answered = time.monotonic()
        legs = exchange.legs
        if legs.route is not None and legs.api is exchange.plan.api:  # not a continuation's
            state.fleet.learn_bytes_per_token(legs.route.length, prompt_tokens)
    except (LegFailed, TimeoutError) as error:
        failure = transport_error(where, url, error, engine.instance)
        exchange.count_failure("prefill", failure)
        raise failure from None
    except ProxyError as failure:
        exchange.count_failure("prefill", failure)
        raise
    finally:
        if leg is not None:
            state.upstreams.finish(leg)
        finished = time.monotonic()
        state.metrics.prefill_duration.observe(finished - started)
    engine.instance.last_success = finished


def prefill_outcome(body: bytes) -> tuple[str | None, int]:
    """Why a 2xx prefill answer means its KV will never reach the decode (None if it will),
    and the prompt's length in tokens that it reports (0 if it does not)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return "answered 2xx with a body that is not JSON", 0
    if isinstance(payload, dict) and payload.get("object") == "response":
        return response_outcome(payload)
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices:
        return "answered 2xx without choices", 0
    for choice in choices:
        reason = choice.get("finish_reason") if isinstance(choice, dict) else None
        if reason != "length":
            return (
                f"ended with finish_reason {reason!r} instead of 'length', "
                "so vLLM frees its KV cache instead of sending it"
            ), 0
    usage = payload.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return None, tokens if isinstance(tokens, int) else 0


def response_outcome(payload: Mapping[str, Any]) -> tuple[str | None, int]:
    """prefill_outcome for a Responses prefill: vLLM reports the one token that ended by length
    as status "incomplete", for max_output_tokens."""
    details = payload.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    status = payload.get("status")
    if status != "incomplete" or reason != "max_output_tokens":
        return (
            f"ended with status {status!r} ({reason or 'no reason'}) instead of 'incomplete' "
            "for max_output_tokens, so vLLM frees its KV cache instead of sending it"
        ), 0
    usage = payload.get("usage")
    tokens = usage.get("input_tokens") if isinstance(usage, dict) else None
    return None, tokens if isinstance(tokens, int) else 0


class PrefillKvTransferParams(TypedDict):
    do_remote_decode: bool
    do_remote_prefill: bool
    transfer_id: str


class DecodeKvTransferParams(TypedDict):
    do_remote_decode: bool
    do_remote_prefill: bool
    remote_bootstrap_addr: str
    remote_engine_id: str
    transfer_id: str


def leg_error(task: asyncio.Task[None]) -> BaseException | None:
    """How a leg run as a task failed; None while it runs, or if it succeeded or was cancelled."""
    if not task.done() or task.cancelled():
        return None
    return task.exception()


async def until_first_token(leg: HttpLeg, data: bytes, attempt: Attempt, url: URL) -> bytes:
    """A PD stream's bytes up to its first event that carries a token (or all of it, if it
    ended without one); KvLoadFailed if an error event comes first, or if a Responses stream
    is cut before it: vLLM ends one whose generation failed so, with no error event."""
    while (start := stream_start(data)) is None:
        try:
            more = await leg.next_bytes()
        except LegFailed as error:
            if data.startswith(RESPONSE_STREAM_HEAD):
                raise KvLoadFailed.of(attempt, url, f"its stream was cut ({error})") from None
            raise
        if not more:
            return data
        data += more
    if isinstance(start, str):
        raise KvLoadFailed.of(attempt, url, start)
    return data


# ================================================================================================
# 7. The stream
# Holds the relay of the decode's bytes to the client (relay_body, DecodeRelay), and the journal of
# a stream that goes on on another pair when its decode fails after tokens (StreamJournal,
# Exchange.migrate). Uses: 1, 3, 5-6, 8, 11-12.
# ================================================================================================


# Where a stream's chunks carry their token ids, once return_token_ids asks for them (vLLM
# writes chunks with pydantic: compact, in a fixed order, each field once).
TOKEN_IDS: Final = b',"token_ids":['


PROMPT_IDS: Final = b'"prompt_token_ids":['


# What a journal keeps of its last events, to find where to go on from (StreamJournal.rewind):
# reads (each one or more events) or events, this many and more per character its stop strings
# reach back; a character's bytes span a few tokens, and a rewind past a stop string's reach a
# few tokens per character.
RECENT_EVENTS: Final = 32


EVENTS_PER_REACHED_CHAR: Final = 4


# What shows in a chat's chunks when vLLM runs a reasoning or tool parser over its output: a
# token the parser swallowed (an empty delta), reasoning apart from content, calls apart from
# text. A continuation is a completion, whose text no parser splits (chat_completion/serving.py).
PARSER_SIGNS: Final = (
    (b'"delta":{}', "a token its decode's reasoning or tool parser swallowed"),
    (b'"reasoning":', "reasoning that its decode's reasoning parser split off"),
    (b'"reasoning_content":', "reasoning that its decode's reasoning parser split off"),
    (b'"tool_calls":', "tool calls that its decode's tool parser split off"),
)


# What a continuation does not take from the client's request: what makes or shapes the
# prompt (the token ids replace it), chat-only fields, and the fields it sets itself.
NOT_CONTINUED: Final = frozenset(
    {
        *("messages", "prompt", "truncate_prompt_tokens", "add_special_tokens"),
        *("chat_template", "chat_template_kwargs", "add_generation_prompt", "documents"),
        *("continue_final_message", "mm_processor_kwargs", "tool_choice", "parallel_tool_calls"),
        *("reasoning_effort", "include_reasoning", "max_completion_tokens", "return_token_ids"),
        *("stream_options", "kv_transfer_params"),
    }
)


# vLLM's cap of a completion that names none, and of one whose max_tokens is null (0.32's
# CompletionRequest.normalize_null_max_tokens); a chat's is what is left of max_model_len.
COMPLETION_MAX_TOKENS: Final = 16


class StreamJournal:
    """What a stream that may go on elsewhere has sent its client, as much as going on needs:
    the prompt's token ids and the generated ones, as the decode wrote them (JSON digits,
    parsed only if the stream goes on), and its last events. The decode is asked for the ids
    (return_token_ids), and each list reaches the client as null, as vLLM writes it unasked,
    unless the client asked.

    Going on is exact where it can be (rewind): from the last token that completed a
    character, far enough back that a stop string the original would have matched is matched
    by the continuation too; the text and ids the continuation gives again, which the client
    has, are checked against what it has and left out (take_continued).
    """

    __slots__ = (*("body", "chat", "strip", "usage", "prompt", "generated", "head", "recent"),
                 *("error", "continued", "migrations", "finished", "parser", "reach", "held"),
                 *("greedy", "whole", "replay_ids", "replay_text", "diverged", "last"),
                 "usage_sent")  # fmt: skip

    def __init__(self, api: Api, body: Mapping[str, Any]) -> None:
        self.body, self.chat = body, api.chat
        self.strip = not lax_bool(body.get("return_token_ids"))
        options = body.get("stream_options")
        self.usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.prompt = b""  # the prompt's token ids: b"1,47,656"
        self.generated = bytearray()  # b"684,280,"
        self.head = b""  # the first chunk's id, object, created and model: b'{"id":...}'
        self.reach, self.held = stop_reach(body)
        # vLLM samples greedily below this temperature (SamplingParams); a request that names
        # none takes the model's default, which the proxy cannot know: sampled.
        temperature = body.get("temperature")
        self.greedy = temperature is not None and lax_float(temperature) < 1e-5
        # The last reads relayed as the decode wrote them (parsed only on a cut), or events
        # as the client got them (a continuation's, and what a rewind gave again).
        limit = RECENT_EVENTS + EVENTS_PER_REACHED_CHAR * self.reach
        self.recent: collections.deque[bytes | Given] = collections.deque(maxlen=limit)
        self.whole = True  # recent still holds the answer's first events
        self.error: str | None = None  # an error event the decode sent after tokens
        self.continued = False  # a continuation's events are relayed (take_continued)
        self.migrations = 0
        self.finished = False  # a finish_reason went out: only the end is owed (ending)
        self.usage_sent = False  # and the usage after it
        self.last = b""  # the last read relayed: whether it ended the stream ([DONE])
        self.parser: str | None = None  # what showed a parser at work in a chat's chunks
        self.replay_ids: list[int] = []  # ids a continuation gives again, the client has
        self.replay_text = ""  # text it gives again, the client has
        self.diverged = False  # a continuation gave other than the client has: no more

    def take(self, data: bytes) -> bytes:
        """Whole events from the decode, as the client gets them: token ids noted, their lists
        written as null; an error event and what follows it withheld (self.error). This runs
        for every read of every stream that may go on: no parse, a split and a join."""
        parts = data.split(TOKEN_IDS)
        # An error comes after the tokens, in the last part: searched there only.
        if b'data: {"error"' in parts[-1] or not self.prompt or self.continued:
            return self.take_rarely(data)
        self.keep(data)
        return self.noted(data, parts)

    def take_rarely(self, data: bytes) -> bytes:
        """take, for the first events (the prompt's ids), an error, or a continuation's."""
        if (failed := data.find(b'data: {"error"')) >= 0:
            self.error = error_event_message(data[failed + 6 : data.find(b"\n\n", failed)])
            data = data[:failed]
        if self.continued:
            return self.take_continued(data)
        self.keep(data)
        if not self.prompt:
            data = self.take_prompt(data)
        return self.noted(data, data.split(TOKEN_IDS))

    def keep(self, data: bytes | Given) -> None:
        """Note one read (or a continuation's event): kept among the last; whether the answer
        finished, and whether a parser shows (a few scans of bytes per read, no parse)."""
        if len(self.recent) == self.recent.maxlen:
            self.whole = False
        self.recent.append(data)
        if not isinstance(data, bytes):
            return
        self.last = data
        if self.finished:
            self.usage_sent = self.usage_sent or b'"usage":{' in data
        elif b'"finish_reason":"' in data:
            self.finished, self.usage_sent = True, b'"usage":{' in data
        if self.chat and self.parser is None:
            self.parser = next((why for sign, why in PARSER_SIGNS if sign in data), None)

    def noted(self, data: bytes, parts: list[bytes]) -> bytes:
        """``data`` (split at its token id lists into ``parts``) with each list noted, and
        written as null unless the client asked for them."""
        if len(parts) == 1:
            return data
        generated = self.generated
        for index in range(1, len(parts)):
            part = parts[index]
            if (end := part.find(b"]")) > 0:
                generated += part[:end]
                generated.append(0x2C)  # b","
            parts[index] = part[end + 1 :]
        return b',"token_ids":null'.join(parts) if self.strip else data

    def take_prompt(self, data: bytes) -> bytes:
        """The first events: the chunk's head (for a continuation's chunks) and the prompt's
        token ids, which reach the client as null."""
        if not self.head and (end := data.find(b',"choices"')) >= 0:
            self.head = data[data.find(b"{") : end] + b"}"
        if (at := data.find(PROMPT_IDS)) < 0 or (end := data.find(b"]", at)) < 0:
            return data
        self.prompt = data[at + len(PROMPT_IDS) : end]
        if not self.strip:
            return data
        return b'%b"prompt_token_ids":null%b' % (data[:at], data[end + 1 :])

    def cut_by(self, complete: bool) -> str | None:
        """Why the stream must go on elsewhere once its decode's answer stopped (``complete``:
        it ended rather than the relay stopping it), or None."""
        if self.error is not None:
            return f"sent an error after {self.count()} tokens: {self.error}"
        if complete and not self.last.endswith(b"data: [DONE]\n\n"):
            return f"ended its answer after {self.count()} tokens without [DONE]"
        return None

    def count(self) -> int:
        return self.generated.count(b",")

    def prompt_count(self) -> int:
        return self.prompt.count(b",") + 1

    def ending(self) -> bytes:
        """What an answered stream cut before its end still owes: the usage asked for, [DONE]."""
        if not self.usage or self.usage_sent or not self.prompt:
            return b"data: [DONE]\n\n"
        prompt, completion = self.prompt_count(), self.count()
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
        chunk = {**json.loads(self.head), "choices": [], "usage": usage}
        usage["completion_tokens"] = completion
        return b"data: " + vllm_json(chunk) + b"\n\ndata: [DONE]\n\n"

    def why_not_continued(self, limit: int) -> str | None:
        if self.diverged:
            return self.error or "its continuation gave other than the client has"
        if self.migrations >= limit:
            return f"--migration-limit {limit} reached"
        if self.parser is not None:
            return f"its chunks show {self.parser}, which a continuation would not split off"
        if not self.prompt or not self.head:
            return "the decode did not return the token ids (return_token_ids)"
        return None

    def continuation(self, max_model_len: int | None) -> dict[str, Any] | str:
        """The /v1/completions request that goes on from where the answer can go on exactly
        (once rewound): the prompt's ids and the tokens before it, the client's sampling, the
        cap left; or why it cannot go on. ``max_model_len`` is the decode's, for a chat's cap."""
        generated = json.loads(b"[" + self.generated[:-1] + b"]")
        cap = self.cap(max_model_len)
        if isinstance(cap, str):
            return cap
        body = {key: value for key, value in self.body.items() if key not in NOT_CONTINUED}
        body["prompt"] = json.loads(b"[" + self.prompt + b"]") + generated
        body["max_tokens"] = max(1, cap - len(generated))
        if (least := lax_int(self.body.get("min_tokens"))) > 0:
            body["min_tokens"] = max(0, least - len(generated))
        body["stream"] = True
        if self.usage:
            body["stream_options"] = {"include_usage": True}
        self.continued, self.migrations, self.error = True, self.migrations + 1, None
        return body

    def cap(self, max_model_len: int | None) -> int | str:
        """The answer's cap in tokens, as vLLM reads the client's request: its own, else 16 for
        a completion and what max_model_len leaves for a chat (get_max_tokens)."""
        given = self.body.get("max_completion_tokens") if self.chat else None
        if given is None:
            given = self.body.get("max_tokens")
        if given is not None:
            return lax_int(given)
        if not self.chat:
            return COMPLETION_MAX_TOKENS
        if max_model_len is None:
            return "its decode's max_model_len, which its cap is, is not known (/v1/models)"
        return max_model_len - self.prompt_count()

    async def rewind(self, whole: Callable[[list[int]], Awaitable[bool]]) -> str | None:
        """Forget the last tokens back to where the answer can go on exactly, and note what the
        continuation will give again that the client has; or why there is no such place.

        A continuation starts its text afresh after its prompt, so it goes on from a token
        that completed a character (vLLM's detokenizer sends text at such a token only; one
        continued from inside a character sends its whole prompt's text, seen on 0.32), and
        from at least ``reach`` characters of text before the end, so that a stop string that
        begins in text the client has is matched. With stop strings, vLLM holds back ``held``
        characters, and the client's text ends that much before its tokens'. An event that grew
        the client's text with one token completed a character; whether one of several tokens
        (vLLM merges steps when its API server lags, and by --stream-interval) did, ``whole``
        asks the model's tokenizer: its text cannot say (a token that began a character holds
        back what came before it in that token too). Text and ids past the place, which the
        client has already: the continuation gives them again (replay_*).
        """
        events = self.sent_events()
        if isinstance(events, str):
            return events
        generated: list[int] = json.loads(b"[" + self.generated[:-1] + b"]")
        after: list[Given] = []
        length, later = 0, 0  # text and ids after events[index]
        for index in range(len(events) - 1, -1, -1):
            text, ids = events[index]
            if (
                text
                and ids
                and length >= self.reach
                and (len(ids) == 1 or await whole(generated[: len(generated) - later]))
            ):
                return self.replay(events[: index + 1], after, self.held)
            after.append(events[index])
            length, later = length + len(text), later + len(ids or ())
        if not self.whole:
            return f"no token in its last {len(events)} events is known to complete a character"
        return self.replay([], after, 0)

    def replay(self, kept: list[Given], after: list[Given], held: int) -> str | None:
        """Go on from the end of ``kept``: the events ``after`` it (latest first) are given
        again, their text past the first ``held`` characters too (those are the kept tokens'
        text, sent late)."""
        text = "".join(event[0] for event in reversed(after))[held:]
        ids = [i for _, event_ids in reversed(after) for i in event_ids or ()]
        if not self.greedy and (text or (self.reach and any(e[0] for e in (*kept, *after)))):
            # A new sample of what the client has would differ; one of text vLLM held back
            # could end in a stop string that begins in text the client has.
            held_back = " or text vLLM held back for its stop strings" if self.reach else ""
            return f"it samples (no temperature 0): going on would draw anew text it has{held_back}"
        self.forget(len(ids))
        self.replay_ids, self.replay_text = ids, text
        self.recent.clear()
        self.recent.extend(kept)
        self.recent.append(("".join(e[0] for e in reversed(after)), None))
        return None

    def sent_events(self) -> list[Given] | str:
        """Each event the client got, from the last reads (parsed: only on a cut); or why they
        cannot tell where to go on from."""
        events: list[Given] = []
        for read in self.recent:
            if not isinstance(read, bytes):
                events.append(read)
                continue
            for event in read.split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                for choice in json.loads(event[6:]).get("choices") or ():
                    text, ids = choice_text(choice), choice.get("token_ids")
                    if text and not ids:  # hidden (include_reasoning false): would repeat
                        return "the decode did not return the token ids (return_token_ids)"
                    events.append((text, tuple(ids or ())))
        return events

    def forget(self, tokens: int) -> None:
        """Drop the last ``tokens`` generated ids."""
        end = len(self.generated) - 1  # the last id's comma
        for _ in range(tokens):
            end = self.generated.rfind(b",", 0, end)
        del self.generated[end + 1 :]

    def take_continued(self, data: bytes) -> bytes:
        """A continuation's whole events, as the client's stream goes on: its id and created,
        a chat's chunk shape, usage counting the whole answer, and nothing the client has
        (parsed: this is rare). Stops at an event that gives other than the client has."""
        events = []
        for event in data.split(b"\n\n")[:-1]:
            if event.startswith(b"data: {"):
                with contextlib.suppress(ValueError, AttributeError):  # else passed on as it came
                    chunk = self.as_client_chunk(json.loads(event[6:]))
                    if chunk is None:
                        if self.diverged:
                            break
                        continue
                    event = b"data: " + vllm_json(chunk)
            events.append(event + b"\n\n")
        self.last = data = b"".join(events)
        return data

    def as_client_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's chunk as the client's stream has it; None for one that carries
        nothing the client has not (or that gives other than it has: diverged)."""
        choices = chunk.get("choices") or []
        for choice in choices:
            if not self.given_again(choice):
                return None
        if isinstance(usage := chunk.get("usage"), dict):
            self.usage_sent = True
            prompt = self.prompt_count()
            usage["prompt_tokens"] = prompt
            usage["completion_tokens"] = usage.get("total_tokens", prompt) - prompt
        head = json.loads(self.head)
        if not self.chat:
            return {**chunk, "id": head["id"], "created": head["created"]}
        shaped = {**head, "choices": [chat_choice(choice) for choice in choices]}
        for key in ("usage", "system_fingerprint"):
            if key in chunk:
                shaped[key] = chunk[key]
        return shaped

    def given_again(self, choice: dict[str, Any]) -> bool:
        """A continuation's choice, with what it gives again of the client's (replay_*) checked
        and taken out, its ids noted (and kept with the text the client gets of it, for a
        rewind); False if nothing is left to send, or it diverged."""
        ids, text = list(choice.get("token_ids") or ()), choice_text(choice)
        replayed = bool(self.replay_ids or self.replay_text)
        if ids:
            self.generated += b"%b," % ",".join(map(str, ids)).encode()
        noted = tuple(ids)
        again = min(len(ids), len(self.replay_ids))
        if again and not self.strip and ids[:again] != self.replay_ids[:again]:
            return self.diverge(f"token ids {ids[:again]} where it had {self.replay_ids[:again]}")
        ids, self.replay_ids = ids[again:], self.replay_ids[again:]
        same = min(len(text), len(self.replay_text))
        if text[:same] != self.replay_text[:same]:
            return self.diverge(f"{text[:same]!r} where it had {self.replay_text[:same]!r}")
        text, self.replay_text = text[same:], self.replay_text[same:]
        if choice.get("finish_reason") is not None:
            if self.replay_text or (self.replay_ids and not self.strip):
                return self.diverge("an end before what it had")
            self.finished = True
        self.keep((text, noted))
        if replayed and not text and not ids and choice.get("finish_reason") is None:
            return False
        choice["text"] = text
        choice["token_ids"] = None if self.strip else ids
        if choice.get("prompt_token_ids") is not None:  # the continuation's own prompt
            choice["prompt_token_ids"] = None
        return True

    def diverge(self, what: str) -> bool:
        self.diverged = True
        self.error = f"its continuation gave {what}: not the answer the client has"
        return False


def choice_text(choice: Mapping[str, Any]) -> str:
    """A streamed choice's text: a completion's, or a chat's content."""
    delta = choice.get("delta")
    text = choice.get("text") if delta is None else delta.get("content")
    return text if isinstance(text, str) else ""


def chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A completion's streamed choice as a chat's (vLLM 0.32's fields, in its order)."""
    shaped = {"index": choice.get("index", 0), "delta": {"content": choice.get("text", "")}}
    shaped["logprobs"] = None
    shaped["finish_reason"] = finish = choice.get("finish_reason")
    if finish is not None:
        shaped["stop_reason"] = choice.get("stop_reason")
    shaped["token_ids"] = choice.get("token_ids")
    return shaped


def vllm_json(value: object) -> bytes:
    """JSON as vLLM writes its chunks (pydantic): compact, text as UTF-8."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def error_event_message(payload: bytes) -> str:
    """The message of an in-band error event's JSON."""
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(payload)["error"]["message"]
        return str(message)
    return payload[:200].decode("utf-8", "replace")


def stop_reach(body: Mapping[str, Any]) -> tuple[int, int]:
    """How far back a stream's stop strings reach, in characters: vLLM matches each one
    against new text and up to ``reach`` characters before it (the longest, less one), and
    holds the last ``held`` of them back while it streams (none with
    include_stop_str_in_output). v1/engine/detokenizer.py in vLLM 0.32."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    reach = max((len(s) for s in stops if isinstance(s, str)), default=1) - 1
    return reach, 0 if lax_bool(body.get("include_stop_str_in_output")) else reach


# One event the client got: its text, and its new token ids (None: ids a continuation gives
# again, its text the client's all the same).
Given = tuple[str, tuple[int, ...] | None]


async def relay_body(attempt: Attempt, leg: HttpLeg, url: URL) -> None:
    """Pass the decode's answer (from ``url``) on byte for byte: no re-chunking, what each
    read brought at once. A PD stream (not a decode alone's) is held until its first token:
    vLLM fails a stream whose KV pull failed with an error event before any token, and until
    one came the pair can start again. A stream that may go on elsewhere (a journal) is
    relayed by whole events, and goes on elsewhere if its decode fails (Attempt.end_stream).

    The first bytes leave with the client's headers through aiohttp's response; the rest is
    written by the leg's read callback (DecodeRelay), and this task only wakes when the answer
    is over, the client is gone, or the client fell behind and reading must wait for it.
    """
    exchange = attempt.exchange
    response, stats, journal = exchange.response, exchange.stats, exchange.journal
    continued = response.prepared  # a continuation, into the stream its client already has
    gaps = stats.token_gaps if continued else answer_head(response, leg, stats)
    first = await leg.next_bytes()
    if gaps is not None and attempt.engine is not None:
        first = await until_first_token(leg, first, attempt, url)
    exchange.relaying = True  # from here the attempt's bytes are the client's
    if exchange.first_token is not None:
        exchange.first_token.came()
    if attempt.watch is not None:
        attempt.watch.kv_arrived()
    attempt.prompt_computed()
    attempt.prompt_arrived()
    if not continued:
        response.writer = await response.prepare(exchange.request)
        stats.first_byte = time.monotonic()
        stats.status_sent = response.status
    else:
        stats.continued(exchange.state.metrics)
    assert response.writer is not None  # None only for a response already ended
    relay = DecodeRelay(exchange, gaps) if journal is None else JournalRelay(exchange, gaps)
    try:
        if first and (first := relay.events(first)):
            relay.account(first)
            await response.write(first)
        if relay.client.closing:
            raise ClientGone
        complete = False
        if journal is None or journal.error is None:
            complete = await leg.stream_to(relay, response.writer.drain)
    except ConnectionError:  # aiohttp's ClientConnectionResetError is one too
        raise ClientGone from None
    if journal is not None and (why := journal.cut_by(complete)) is not None:
        await attempt.end_stream(f"decode {url} {why}")
        return
    if not complete:
        raise ClientGone
    if gaps is None and leg.status == 200:
        stats.first_token = time.monotonic()  # a whole answer: its first token came with it
    if not continued and attempt.engine is not None and leg.status == 200:
        last = relay.last  # the usage is at the answer's end: in its last write, or across two
        attempt.prompt_reported(last if b'"usage":' in last else relay.before[-512:] + last)
    await attempt.end_stream(None)  # a client that closed once it read the last bytes had it all


def answer_head(
    response: web.StreamResponse, leg: HttpLeg, stats: RequestStats
) -> TokenGaps | None:
    """The client's status and headers, the decode's; token timing (TokenGaps) for a stream."""
    response.set_status(leg.status, leg.reason.decode("latin-1"))
    content_type = "application/octet-stream"
    if leg.content_type is not None:
        content_type = leg.content_type.decode("latin-1")
    response.headers[hdrs.CONTENT_TYPE] = content_type
    if leg.content_length is not None and not leg.chunked:
        # A whole answer of known size (not a stream): headers, body and end in one write
        # instead of a chunked body and its terminator.
        response.content_length = leg.content_length
    if leg.status == 200 and content_type.startswith(SSE_CONTENT_TYPE):
        stats.token_gaps = TokenGaps()
        return stats.token_gaps
    return None


RESPONSE_PREAMBLE: Final = frozenset(
    (b"response.created", b"response.in_progress", b"response.output_item.added",
     b"response.content_part.added")
)  # fmt: skip


def stream_start(data: bytes) -> str | bool | None:
    """What a stream's whole events so far say: True once one carries a token (or anything
    but a chat's role chunk), the error's message if an error comes first, None while
    neither (no whole event yet, keep-alive comments, role chunks)."""
    start = 0
    while (end := data.find(b"\n\n", start)) >= 0:  # each whole event, the first first
        event, start = data[start:end], end + 2
        if event.startswith(b"event:"):  # a Responses stream's: the name says what it holds
            name = event[6 : event.find(b"\n")].strip() if b"\n" in event else b""
            if name in RESPONSE_PREAMBLE:
                continue
            if name in (b"error", b"response.failed"):
                return response_error(event)
            return True
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # a comment (": keep-alive") or another field
            if b'"error"' not in line and b'"role"' not in line:
                return True  # a token (or [DONE]): no need to parse it
            try:
                payload = json.loads(line[5:])
            except ValueError:
                return True  # [DONE], or what vLLM never sends: not ours to judge
            if not isinstance(payload, dict):
                return True
            if "error" in payload or payload.get("object") == "error":
                error = payload.get("error")
                message = error.get("message") if isinstance(error, dict) else None
                return str(message or payload.get("message") or "an error event")
            choices = payload.get("choices")
            if not (isinstance(choices, list) and choices and all(map(says_nothing, choices))):
                return True
    return None


def response_error(event: bytes) -> str:
    """The message of a Responses stream's error event, or of its response.failed."""
    data = event[event.find(b"\ndata:") + 6 :] if b"\ndata:" in event else b"{}"
    with contextlib.suppress(ValueError, AttributeError):
        payload = json.loads(data)
        failed = payload.get("response") or {}
        error = payload.get("error") or failed.get("error") or {}
        return str(payload.get("message") or error.get("message") or "an error event")
    return "an error event"


def says_nothing(choice: object) -> bool:
    """A streamed choice that carries no token yet: a chat's role chunk ({"role": "assistant",
    "content": ""})."""
    if not isinstance(choice, dict) or choice.get("finish_reason") or choice.get("token_ids"):
        return False
    delta = choice.get("delta")
    return isinstance(delta, dict) and set(delta) <= {"role", "content"} and not delta["content"]


def max_model_len(decode: DecodeInstance, model: str | None) -> int | None:
    """What the decode's /v1/models card says of ``model`` (or of what it runs, for a request
    naming none or an adapter whose card says nothing): the cap of a chat that names none."""
    served = decode.served
    if served is None:
        return None
    cards = {card.get("id"): card for card in served.cards}
    for name in (model, served.parents.get(model or ""), served.model):
        length = cards.get(name, {}).get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool):
            return length
    return None


# Tokens whose text tells whether they end a character: a character's bytes span at most 4
# tokens of a byte-level tokenizer, and those before them decode it whole.
CHARACTER_TOKENS: Final = 8


async def detokenized(
    state: ProxyState, decode: DecodeInstance, payload: bytes, headers: bytes
) -> str | None:
    """The decode's /detokenize of ``payload`` (its text), or None if it could not say."""
    url = decode.url.join(URL("/detokenize"))
    leg = None
    try:
        async with asyncio.timeout(state.config.health_timeout):
            leg = await state.upstreams.send(b"POST", url, headers, (payload,))
            answer = await leg.whole()
        text = json.loads(answer).get("prompt") if leg.status == 200 else None
        return text if isinstance(text, str) else None
    except (LegFailed, TimeoutError, ValueError, AttributeError) as error:
        log.info("decode %s could not detokenize: %s", decode.url, error)
        return None
    finally:
        if leg is not None:
            state.upstreams.finish(leg)


# A continuation is a completion of token ids, whatever the client's request was.
CONTINUATION_API: Final = COMPLETIONS_API


class DecodeRelay:
    """The decode's body after its first bytes, written to the client's connection from the
    leg's read callback (HttpLeg.stream_to): one write per read, framed as the client's
    response is (chunked, or as it is), and no task woken for it. It tells the leg when the
    client's connection holds more than it can send (aiohttp's protocol says its writing is
    paused): the leg stops reading until the client caught up, so a slow client slows its
    decode instead of filling the proxy's memory.
    """

    __slots__ = ("before", "client", "gaps", "last", "stats")

    def __init__(self, exchange: Exchange, gaps: TokenGaps | None) -> None:
        self.client = ClientWire(exchange.request, exchange.response)
        self.stats, self.gaps = exchange.stats, gaps
        self.before = self.last = b""  # the last two writes: where the answer's usage is

    def __call__(self, pieces: list[bytes]) -> bool | None:
        """The pieces one read of the decode brought (HttpLeg.stream_to's Sink): None if the
        client is gone, else whether it fell behind."""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        behind = self.client.send(data)
        if behind is not None:
            self.account(data)
        return behind

    def events(self, data: bytes) -> bytes:
        """The first bytes, as the client gets them: as they came."""
        return data

    def account(self, data: bytes) -> None:
        """Bytes out, and token timing for a stream: an SSE event ends with a blank line and
        a JSON payload has no raw newline, so counting b"\n\n" finds the events unparsed."""
        stats = self.stats
        stats.bytes_out += len(data)
        self.before, self.last = self.last, data
        if self.gaps is not None and (events := data.count(b"\n\n")):
            now = time.monotonic()
            self.gaps.events(events, now)
            if stats.first_token is None:
                stats.first_token = now


class JournalRelay(DecodeRelay):
    """DecodeRelay for a stream that may go on elsewhere: whole events only, through its
    journal, so that what the client has is known exactly when the decode fails. It stops
    the read (as for a client gone) at an error event, which the journal withheld."""

    __slots__ = ("journal", "partial")

    def __init__(self, exchange: Exchange, gaps: TokenGaps | None) -> None:
        super().__init__(exchange, gaps)
        assert exchange.journal is not None
        self.journal, self.partial = exchange.journal, b""

    def __call__(self, pieces: list[bytes]) -> bool | None:
        if self.journal.error is not None:  # what the read after the error brought: not sent
            return None
        data = self.events(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if not data:  # an empty write would end a chunked body
            behind: bool | None = None if self.client.closing else False
        elif (behind := self.client.send(data)) is not None:
            self.account(data)
        return None if self.journal.error is not None else behind

    def events(self, data: bytes) -> bytes:
        if self.partial:
            data, self.partial = self.partial + data, b""
        if not data.endswith(b"\n\n"):  # the last event is not whole: it waits for its end
            if (end := data.rfind(b"\n\n") + 2) < 2:
                self.partial = data
                return b""
            data, self.partial = data[:end], data[end:]
        return self.journal.take(data)


class ClientWire:
    """The client's connection under aiohttp's response, as the relay writes to it after the
    first bytes: the one place (with RelayResponse) that reaches past aiohttp's public API.

    Writing a decode's reads to the transport as they come, framed as the response is, saves
    a task wake-up and a copy per read over StreamResponse.write; aiohttp's protocol says when
    the client cannot keep up (writing_paused), which is when the relay stops reading.
    """

    __slots__ = ("chunked", "protocol", "transport")

    def __init__(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        self.transport = request.transport
        self.protocol = request.protocol
        self.chunked = response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def send(self, data: bytes) -> bool | None:
        """Write ``data`` framed; None if the client is gone, else whether it fell behind
        (one call a read: this runs for every piece of every stream)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return None
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return self.protocol.writing_paused

    def drop(self) -> None:
        if self.transport is not None:
            self.transport.close()


# vLLM's first event of a streamed Responses answer, and those that carry no token yet: it
# sends them as soon as it takes the request, before the KV arrived.
RESPONSE_STREAM_HEAD: Final = b"event: response.created\n"


# ================================================================================================
# 8. The legs and client connections
# Holds the upstream pool (UpstreamPool, HttpLeg, httptools parsing) and the slots it grants, and
# the client connection (ClientConnection: parser limits, slow clients, lingering close). Uses: 1-3,
# 5, 12.
# ================================================================================================


# After answering a connection that is to close (an unread body, a slow head, over the cap),
# how long its further bytes are read and dropped, so that closing does not reset the
# connection before the client read the answer; aiohttp's own 10 s would let a trickling
# client keep its connection that much longer.
CLOSE_LINGER: Final = 2.0


# The route label of requests whose head never parsed (malformed, or too slow to arrive).
UNPARSED: Final = "unparsed"


class ClientConnection(web.RequestHandler):
    """One client connection: aiohttp's HTTP/1.1 protocol, plus what a server facing a network
    needs and aiohttp leaves out: a deadline for each request head (--header-timeout), a cap on
    open connections, and malformed requests answered in the proxy's words (an OpenAI-style
    error, counted, one access line, no traceback).

    The middleware (front_middleware) tells it when a request's head is in and when the
    request is done.
    """

    __slots__ = ("_admitted", "_busy", "_closing", "_head_deadline", "_received", "app")

    def __init__(self, manager: web.Server, app: web.Application, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.app = app
        self._head_deadline: asyncio.TimerHandle | None = None
        self._busy = False  # a request is being handled
        self._admitted = False  # counted against --max-client-connections
        self._closing = False  # answered for the last time: further bytes are dropped
        self._received = 0  # bytes received since the last request was done

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        connections = self.app[STATE_KEY].connections
        if not connections.admit():
            message = (
                f"too many open client connections (--max-client-connections {connections.limit})"
            )
            self._answer_and_close(ProxyError(503, message, retry_after=1))
            return
        self._admitted = True
        self._start_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._admitted:
            self._admitted = False
            self.app[STATE_KEY].connections.release()
        self._stop_head_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if not self._busy and self._head_deadline is None:
            self._start_head_deadline()  # the first bytes of the next request on this connection
        self._received += len(data)
        super().data_received(data)

    def head_received(self) -> None:
        self._busy = True
        self._stop_head_deadline()

    def _stop_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def request_done(self) -> None:
        self._busy = False
        self.app[STATE_KEY].large_garbage.request_done(self._received)
        self._received = 0

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)  # a bug: keep the trace
        self.head_received()
        error = malformed_request_error(exc)
        self._record(error)
        response = error.response()
        response.force_close()
        return response

    def _start_head_deadline(self) -> None:
        timeout = self.app[STATE_KEY].config.header_timeout
        self._head_deadline = self._loop.call_later(timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        timeout = self.app[STATE_KEY].config.header_timeout
        message = f"request head not received within {timeout:g} s (--header-timeout)"
        error = ProxyError(408, message, reason="header_timeout")
        self._record(error)
        self._answer_and_close(error)

    def _record(self, error: ProxyError) -> None:
        stats = RequestStats("-", UNPARSED, outcome=f"error:{error.reason}")
        record_request(self.app[STATE_KEY].metrics, stats, error.status)

    def _answer_and_close(self, error: ProxyError) -> None:
        """Answer, end our side, read and drop what still comes for a moment, then close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._closing = True
        # aiohttp types it asyncio.Transport; uvloop's (the default loop) are no subclass of
        # asyncio's, so it is used as one, never checked (an isinstance here failed on uvloop).
        transport.write(raw_error_response(error))
        transport.write_eof()
        asyncio.get_running_loop().call_later(CLOSE_LINGER, self.force_close)


async def listen(runner: web.AppRunner, sock: socket.socket) -> asyncio.Server:
    """Serve a set-up runner's app on a bound socket, each connection a ClientConnection."""
    app, server = runner.app, runner.server
    assert server is not None, "the runner is set up first"
    config = app[STATE_KEY].config
    loop = asyncio.get_running_loop()

    def connection() -> ClientConnection:
        return ClientConnection(
            server,
            app,
            loop=loop,
            keepalive_timeout=config.client_keepalive_timeout,
            lingering_time=CLOSE_LINGER,
            access_log=None,  # the proxy writes its own access line, with PD fields
        )

    tls = server_tls(config)
    return await loop.create_server(connection, sock=sock, backlog=LISTEN_BACKLOG, ssl=tls)


def server_tls(config: ProxyConfig) -> ssl.SSLContext | None:
    """The listener's TLS (--ssl-certfile, --ssl-keyfile; with --ssl-ca-certs, clients must
    present a certificate those CAs signed), or None for plain HTTP."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return None
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        tls.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
        if config.ssl_ca_certs is not None:
            tls.load_verify_locations(config.ssl_ca_certs)
            tls.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(f"cannot serve HTTPS: {tls_problem(error)}") from None
    return tls


def upstream_tls(config: ProxyConfig) -> ssl.SSLContext:
    """How the legs, health checks and scrapes check an https:// instance: the system's trust
    store, or --upstream-ca-certs in its place."""
    try:
        return ssl.create_default_context(cafile=config.upstream_ca_certs)
    except (OSError, ssl.SSLError) as error:
        raise ConfigError(f"--upstream-ca-certs: {tls_problem(error)}") from None


def tls_problem(error: OSError | ssl.SSLError) -> str:
    if isinstance(error, FileNotFoundError | PermissionError):
        return f"{error.strerror}: {error.filename}"
    return str(error)


def encode_json(body: Mapping[str, Any]) -> bytes:
    if FAST_DUMPS is not None:
        # orjson refuses what the stdlib parser may have produced (lone surrogates, integers
        # past 64 bits, nesting past 254): those rare bodies take the slow path below.
        with contextlib.suppress(TypeError):
            encoded = FAST_DUMPS(body)
            # orjson's result keeps its 4 KiB starting buffer; an exact copy of a small body
            # frees it: 8 KiB less per open stream, for a copy of a few hundred bytes.
            return bytes(memoryview(encoded)) if len(encoded) < 4096 else encoded
    try:
        return json.dumps(body, separators=(",", ":")).encode()
    except RecursionError:
        raise ProxyError(400, "request body is nested too deeply") from None


class UpstreamSlots:
    """The --max-connections cap: upstream connections in use, handed out first come first served.

    The proxy counts them itself instead of capping aiohttp's pool, so that a request waits for
    a slot before its legs start (a bounded wait with an error of its own) and a health check,
    which has a pool of its own, never waits behind client traffic and never mistakes the
    proxy's own limit for an upstream that is down. A PD request takes both its slots at once:
    decodes holding slots while waiting for prefills that cannot get one would deadlock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no cap, and no bookkeeping either
        self.in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def acquire(self, count: int, within: float) -> None:
        """Take ``count`` slots; raises TimeoutError if they did not come free ``within`` s."""
        if not self.limit:
            return
        if not self._waiters and self.in_use + count <= self.limit:
            self.in_use += count
            return
        granted = asyncio.get_running_loop().create_future()
        waiter = (count, granted)
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(within):
                await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.release(count)  # granted just as the wait ended: give it back
            else:
                with contextlib.suppress(ValueError):  # _grant may have dropped it already
                    self._waiters.remove(waiter)
                self._grant()  # a smaller request behind this one may fit now
            raise

    def release(self, count: int) -> None:
        if self.limit:
            self.in_use -= count
            self._grant()

    def _grant(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.limit:
            count, granted = self._waiters.popleft()
            if not granted.done():  # done: its request gave up (cancelled) while queued
                self.in_use += count
                granted.set_result(None)


class LegFailed(Exception):
    """A leg's HTTP exchange failed on the wire: not an error status, no answer at all.

    ``unreachable``: not one byte of an answer came (refused, reset, closed before answering),
    so the request may be tried elsewhere and the upstream is likely down; ``timed_out``: the
    connection could not be opened within --connect-timeout.
    """

    def __init__(self, message: str, *, unreachable: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.unreachable, self.timed_out = unreachable, timed_out


# A relay's side of HttpLeg.stream_to: handed the pieces one read brought (a list the leg
# reuses: not kept), it says whether the client fell behind (True) or is gone (None).
Sink = Callable[[list[bytes]], bool | None]


# Below this a copy costs less than a second write (and a second syscall); above it the body
# goes out as it is, not joined to the head (a 100 MiB prompt would be copied once more).
LEG_BODY_COPY_LIMIT: Final = 64 * 1024


HEADS_KEPT: Final = 4096  # UpstreamPool's request lines: a few routes per instance


class UpstreamPool:
    """The legs' keep-alive connections, by upstream.

    The newest idle connection is reused first (the likeliest still open, and the others age
    out); none is kept idle past --keepalive-timeout, below vLLM's own idle limit, so the pool
    does not reuse one vLLM is closing. A leg whose answer was not read whole is closed, not
    kept: vLLM aborts a request whose connection closes.
    """

    def __init__(
        self, connect_timeout: float, keepalive_timeout: float, cafile: str | None = None
    ) -> None:
        self.connect_timeout, self.keepalive_timeout = connect_timeout, keepalive_timeout
        self._idle: dict[str, dict[HttpLeg, None]] = {}  # by host:port, oldest first
        self.busy = 0  # legs sent and not yet finished: 0 whenever no request is under way
        self._heads: dict[tuple[bytes, URL], bytes] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._cafile = cafile  # --upstream-ca-certs, in place of the system's trust store
        self._tls: ssl.SSLContext | None = None

    async def send(self, method: bytes, url: URL, headers: bytes, body: LegPayload = ()) -> HttpLeg:
        """A request on its way on a kept connection or a new one; LegFailed if none opens.
        ``headers``: header_lines' of the request's own headers."""
        size = sum(map(len, body))
        head = self._head(method, url) + headers + b"Content-Length: %d\r\n\r\n" % size
        leg = self._reuse(url.raw_authority) or await self._connect(url)
        leg.send(head, body, size)
        self.busy += 1
        return leg

    def finish(self, leg: HttpLeg) -> None:
        """The leg is over: kept for the next if its answer was read whole and may be kept,
        else closed (mid-answer, that aborts the request upstream)."""
        self.busy -= 1
        leg.sink = None
        if not (leg.complete and leg.reusable and leg.open and not leg.kept):
            leg.close()
            return
        leg.resume()
        leg.idle_since = time.monotonic()
        leg.idle[leg] = None
        if self._sweep is None:
            self._sweep = leg.loop.call_later(self.keepalive_timeout, self._close_expired)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for leg in list(idle):
                leg.close()
            idle.clear()

    def _reuse(self, upstream: str) -> HttpLeg | None:
        idle = self._idle.get(upstream)
        now = time.monotonic()
        while idle:
            leg, _ = idle.popitem()  # the newest: if it aged out, so did the rest
            if leg.open and now - leg.idle_since < self.keepalive_timeout:
                return leg
            leg.close()
        return None

    async def _connect(self, url: URL) -> HttpLeg:
        loop = asyncio.get_running_loop()
        idle = self._idle.setdefault(url.raw_authority, {})
        host, port = url.host or "", url.port or 0  # parse_backend_url made it explicit
        tls = self.tls() if url.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, leg = await loop.create_connection(lambda: HttpLeg(idle), host, port, ssl=tls)
        except TimeoutError:
            message = f"cannot connect to {host}:{port} within {self.connect_timeout:g} s"
            raise LegFailed(message, unreachable=True, timed_out=True) from None
        except OSError as error:
            message = f"cannot connect to {host}:{port}: {os_error_reason(error)}"
            raise LegFailed(message, unreachable=True) from None
        return leg

    def _head(self, method: bytes, url: URL) -> bytes:
        """The request line and Host, made once per upstream route."""
        head = self._heads.get((method, url))
        if head is None:
            if len(self._heads) >= HEADS_KEPT:  # instances come and go (DNS): start again
                self._heads.clear()
            line = f"{method.decode()} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_authority}\r\n"
            head = self._heads[method, url] = line.encode()
        return head

    def _close_expired(self) -> None:
        """Close the connections idle for --keepalive-timeout; again later while any is idle."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        oldest_kept = time.monotonic() - self.keepalive_timeout
        for idle in self._idle.values():
            for leg in list(idle):
                if leg.idle_since > oldest_kept:
                    break  # the rest came back later still
                del idle[leg]
                leg.close()
        if any(self._idle.values()):
            self._sweep = loop.call_later(self.keepalive_timeout, self._close_expired)

    def tls(self) -> ssl.SSLContext:
        if self._tls is None:  # made at the first https:// upstream: it reads the CA store
            self._tls = ssl.create_default_context(cafile=self._cafile)
        return self._tls


# aiohttp's parser limits (its defaults), named in the errors that enforce them.
MAX_LINE_BYTES: Final = 8190


MAX_HEADERS: Final = 128


def malformed_request_error(error: HttpProcessingError) -> ProxyError:
    """The client's answer to a request aiohttp's parser refused. Its messages quote the
    client's bytes; these never do, so that no client can write into the log."""
    if isinstance(error, LineTooLong):
        message = f"a request line or header field is longer than {MAX_LINE_BYTES} bytes"
        return ProxyError(431, message, reason="header_too_long")
    if "Too many headers" in error.message:
        return ProxyError(431, f"more than {MAX_HEADERS} header fields", reason="too_many_headers")
    if isinstance(error, BadHttpMethod):
        return ProxyError(
            400, "malformed request method (TLS on a plain HTTP port?)", reason="bad_method"
        )
    if isinstance(error, BadStatusLine):
        message = "malformed request line (HTTP/1.1 lines end in CRLF)"
        return ProxyError(400, message, reason="bad_request_line")
    return ProxyError(400, "malformed header field", reason="bad_header")


def raw_error_response(error: ProxyError) -> bytes:
    """A whole HTTP/1.1 error answer, for a connection that has no request to answer through."""
    body = json.dumps(error.payload()).encode()
    head = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if error.retry_after is not None:
        head.append(f"Retry-After: {error.retry_after}")
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


class ClientConnections:
    """Open client connections against --max-client-connections (the daemon's listener)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.rejected = 0
        self._full = False

    def admit(self) -> bool:
        if self.open >= self.limit:
            self.rejected += 1
            if not self._full:
                self._full = True
                log.warning(
                    "%d client connections open (--max-client-connections): new ones are "
                    "answered 503 until some close",
                    self.limit,
                )
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1
        if self._full and self.open < self.limit:
            self._full = False
            log.info("client connections below --max-client-connections again")


class HttpLeg(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to an upstream, carrying one leg at a time.

    Below aiohttp's client on purpose (issue 15: two fifths less CPU per relayed token, with
    the rest of its steps half as much per request): httptools
    (llhttp, as uvicorn uses it) parses the answer in the read callback itself, and the body
    pieces of one read go to ``sink`` together, right there, with no task woken for them.
    Until a sink is set they are kept. The task that sent the request waits in ``wait`` for
    what it needs (the head, a piece, the end, a pause); a failure on the wire raises there.
    """

    __slots__ = (
        "answered",
        "chunked",
        "complete",
        "content_length",
        "content_type",
        "error",
        "head_in",
        "idle",
        "idle_since",
        "informational",
        "kept",
        "loop",
        "out_of_step",
        "parser",
        "paused",
        "reason",
        "reusable",
        "sink",
        "sink_gone",
        "status",
        "transport",
        "waiter",
    )

    def __init__(self, idle: dict[HttpLeg, None]) -> None:
        self.idle = idle  # its upstream's idle connections, which it leaves when it closes
        self.idle_since = 0.0
        self.loop = asyncio.get_running_loop()  # made in the loop: for its futures, once
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Sink | None = None
        self.kept: list[bytes] = []
        self.status, self.reason = 0, b""
        self.content_type: bytes | None = None
        self.content_length: int | None = None
        self.chunked = self.informational = self.answered = False
        self.head_in = self.reusable = self.paused = self.out_of_step = self.sink_gone = False
        self.complete = True  # no answer outstanding (send starts one)
        self.error: LegFailed | None = None

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, head: bytes, body: LegPayload, size: int) -> None:
        """Write a request whose body is ``size`` bytes in pieces; the answer to the last one
        was read whole (or there was none)."""
        assert self.transport is not None and self.sink is None
        self.kept, self.status, self.answered = [], 0, False
        self.head_in = self.complete = self.reusable = self.sink_gone = False
        if size < LEG_BODY_COPY_LIMIT:
            self.transport.write(b"".join((head, *body)))
        else:
            self.transport.write(head)
            for piece in body:
                self.transport.write(piece)

    # What the leg's users call: the answer's head (status, reason, content_type,
    # content_length, chunked) once head() returned, then its body: whole(), or next_bytes()
    # and stream_to() for a relay. Each raises LegFailed if the exchange fails first.

    async def head(self) -> None:
        await self.wait(self.has_head)

    async def whole(self) -> bytes:
        """The whole answer's body (the connection can then go back to the pool)."""
        await self.wait(self.is_complete)
        return self.body()

    async def next_bytes(self) -> bytes:
        """The body's bytes come since the last call (at least one piece); b"" once it is
        over."""
        await self.wait(self.has_piece)
        return self.body()

    async def stream_to(self, sink: Sink, drain: Callable[[], Awaitable[None]]) -> bool:
        """Hand the rest of the body to ``sink`` as each read brings it, in the read callback
        (no task woken per piece), until the answer is complete. The sink says whether the
        client fell behind (True: reading stops until ``drain()`` returns, so a slow client
        slows its decode instead of filling memory) or is gone (None: the connection is
        dropped, which makes vLLM abort the request, and this returns False)."""
        self.sink = sink
        if self.kept:
            self.relayed(sink([self.body()]))
        while not self.complete:
            await self.wait(self.must_act)
            if self.sink_gone:
                return False
            if self.paused:
                await drain()
                self.resume()
        return True

    def close(self) -> None:
        """Drop the connection: an upstream that sees it close aborts the request (vLLM does)."""
        if self.transport is not None:
            self.transport.close()

    # Within the leg and its pool

    async def wait(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()``; raises LegFailed if the exchange fails first."""
        while not ready():
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def has_head(self) -> bool:
        return self.head_in

    def has_piece(self) -> bool:
        return bool(self.kept) or self.complete

    def is_complete(self) -> bool:
        return self.complete

    def must_act(self) -> bool:
        return self.complete or self.paused or self.sink_gone

    def body(self) -> bytes:
        """The pieces kept so far, as one (the whole body, once complete without a sink)."""
        body = self.kept[0] if len(self.kept) == 1 else b"".join(self.kept)
        self.kept = []
        return body

    def relayed(self, behind: bool | None) -> None:
        """What the sink said of the pieces it was handed (see stream_to)."""
        if behind is None:
            self.sink_gone = True
            self.close()
            self.wake()
        elif behind:
            self.pause()

    def pause(self) -> None:
        """Stop reading the answer (the client is slower than the upstream) and wake the
        waiting task, which resumes it once the client caught up."""
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
            self.wake()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.transport is not None:
                self.transport.resume_reading()

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, message: str) -> None:
        self.close()
        if self.error is None and not self.complete:
            self.error = LegFailed(message, unreachable=not self.answered)
            self.wake()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.answered = True
            self.fail("answered with a protocol switch it was not asked for")
        except httptools.HttpParserCallbackError:
            if not self.out_of_step:
                raise  # a bug of the proxy's, in a callback: not the upstream's fault
        except httptools.HttpParserError as error:
            self.answered = True
            self.fail(f"sent a malformed answer ({error})")
        if self.kept and self.sink is not None:
            # Every piece this read brought, in one write to the client.
            if (behind := self.sink(self.kept)) is not False:
                self.relayed(behind)
            self.kept.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.idle.pop(self, None)
        if self.complete or self.error is not None:
            return
        if self.head_in and exc is None and self.content_length is None and not self.chunked:
            # An answer without a length ends with its connection (allowed, if rare).
            self.complete = True
        else:
            when = "while answering" if self.answered else "before answering"
            why = f" ({failure_detail(exc)})" if exc is not None else ""
            self.error = LegFailed(
                f"closed the connection {when}{why}", unreachable=not self.answered
            )
        self.wake()

    # httptools' callbacks, as it parses

    def on_message_begin(self) -> None:
        if self.complete:  # an answer nobody asked for: the connection is out of step
            self.out_of_step, self.reusable = True, False
            self.close()
            raise ConnectionError("an answer nobody asked for")  # stops the parser here
        self.answered = True
        self.reason, self.content_type, self.content_length, self.chunked = b"", None, None, False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason  # in pieces, if it came split across reads

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name == b"content-length":
            self.content_length = int(value)  # llhttp let through only digits
        elif name == b"transfer-encoding":
            self.chunked = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self.informational = True  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status, self.head_in = status, True
        self.wake()

    def on_body(self, piece: bytes) -> None:
        self.kept.append(piece)
        if self.sink is None:
            self.wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        # Asked here: once the parser has moved on it reads as a message without a length.
        self.reusable = self.parser.should_keep_alive()
        self.complete = True
        self.wake()


# ================================================================================================
# 9. Routing
# Holds the routers each stage picks with (Router, PrefixIndex), their keys (RouteKey) and the
# chat-turn tracking; a request reaches it through its serving group (Serving, 11). Uses: 1-3, 5, 8,
# 10-11.
# ================================================================================================


# Routing's tuned numbers, all in one list. Each constant below says what measured it (the
# routing benchmark, bench/bench_routing.py, unless it says otherwise); the flags' defaults are in
# ProxyConfig (2) and docs/routing.md gives their reasons:
#   --balance-factor 1.25       the load bound: HAProxy's hash-balance-factor; bounded-load
#                               consistent hashing (Mirrokni et al.) at its usual setting
#   --prefill-load-weight 0.5   a spill costs more than its own blocks (docs/routing.md)
#   --decode-load-weight 4      a decode's streams run long; a prefix held saves one transfer
#   --prefix-block-bytes 512    ROUTING_BLOCK_BYTES (1): about vLLM's 16-token block in bytes
#   --prefix-index-blocks 65536 per engine, at most: fewer where its KV cache holds fewer
#   --load-interval 1           each engine's /metrics scraped once a second
#   RECENT_SECONDS 10, RECENT_SLACK 4, RECENT_BALANCE 1.5    the share of recent requests
#   QUEUE_SLACK 2               a prompt's queue where it is held
#   PLACE_CHOICES 3, PLACE_MARGIN 0.9, PLACE_ALIKE 0.01      where a new prefix goes
#   HOLDER_CHOICES 8, SPILL_CHOICES 5, RING_POINTS 16   what a decision weighs, at any size
#   OTHERS_SEND 1.3, PENDING_SECONDS 2, TURNS_KEPT 4096, EARLIER_TURNS 8
#   KV_FULL 0.98                a cache this full is passed over (vLLM would preempt)
#   MEAN_UNCACHED_EVENTS 32, INDEX_EVICT_BATCH 1/8           bookkeeping, not behaviour
#   TokenReading.FIRST_STEP, LAST_STEP, CHECKS (9)           how far a prompt is tokenized
#   Fleet.bytes_per_token 4 (10)                             a first guess, learned per answer

SESSION_HEADER: Final = "X-Session-ID"


MASK64: Final = (1 << 64) - 1


# A target whose KV cache is this full is passed over while another is not: vLLM would
# preempt (recompute) running requests to make room.
KV_FULL: Final = 0.98


# Each target's share of recent requests (every sender's where the engines' counters say,
# else this process's: recent_requests; decayed over RECENT_SECONDS) is bounded: no engine
# takes more than RECENT_BALANCE (or --balance-factor, if higher) times the mean, or the
# mean plus a few requests of slack while there are only a few (so that affinity holds).
# Without the bound, a group of conversations that share a system prompt piles onto one
# engine and thrashes its cache. Not 1.25, the load bound's default: a prefix's requests
# come in bursts, an engine holding a few prefixes often runs above 1.25 times the mean for
# a moment, and moving a prompt off it then costs its whole prefix. The routing benchmark at
# 1.5 against 1.25: 0.03-0.08 more of the oracle's hit rate on shared prefixes, the same or
# up to 0.06 more on multi-turn; at 2, conversations piled up again. The slack keeps a
# prefix's few requests together when traffic is light: without it, shared-prefix groups at
# 20 requests a second on 64 engines reached 0.79 of the oracle's hit rate in process, not
# 1.00 (bench/research/routing-slack). A chat's first turn has less (CHAT_RETURN_SECONDS).
RECENT_SECONDS: Final = 10.0


RECENT_SLACK: Final = 4.0


RECENT_BALANCE: Final = 1.5


# A chat's first turn is a system prompt and a question: its prompt cannot be told from a
# single-turn chat's. Where chats come back for more turns, RECENT_SLACK piles new ones onto
# the engines that hold their system prompt; as the chats grow, those caches thrash and the
# chats move (multi-turn at 64 engines: 0.84 of the oracle's hit rate in process, 0.94
# without the slack for first turns). Where chats do not come back, the slack keeps
# single-turn chats that share a system prompt together (0.79-0.97 of the oracle without it,
# 0.97-1.01 with it). So a first turn's slack is RECENT_SLACK times the share of chats that
# do not come back (ChatReturns). Until a process has seen chats for this long, none could
# have come back yet, and it assumes they do: single-turn chats sharing a system prompt lost
# up to 0.05 of the oracle over the simulation's two minutes with 30 s, up to 0.10 with 60
# (bench/research/routing-slack).
CHAT_RETURN_SECONDS: Final = 30.0


# A target's queue is bounded too, for a prompt it holds: its requests in flight (this
# process's, and other senders' from the scrape) within --balance-factor times the mean, or
# the mean plus this many while that is more. With the prefill's load weight under 1, a new
# hot prefix's next requests would otherwise queue behind its first, cold, prefill: in the
# routing benchmark, TTFT p90 20 ms against 6.
QUEUE_SLACK: Final = 2.0


# A new prefix goes to whichever of the first this many engines of its hash order was written
# least lately; where other senders are seen, only if clearly less than the first (under this
# share of the first's writes). The routing benchmark's Mooncake trace, its placement
# simulated with every cache known and no load bound, over six hash seeds: the first alone
# reached 0.89-0.99 of the oracle's hit rate, median 0.91; three 0.95-1.00, median 0.97, and
# with the margin 0.90-1.01, median 0.94. But two proxy replicas without the margin, each
# counting its own writes at once and the other's only as events tell, picked apart: 0.52-0.68
# of the oracle where the first alone gave 0.73.
PLACE_CHOICES: Final = 3


PLACE_MARGIN: Final = 0.9


# Candidates whose writes differ by less than this share are alike (Router.place): equal
# writes made moments apart differ only by their decay, which each process sees at its own
# moments; taken for a difference, two proxies placed the same new prefix apart.
PLACE_ALIKE: Final = 0.01


# Of a prompt's holders, at most this many are weighed of those that hold its first block and
# as many of those that hold the most of it (the first of each in its rendezvous order, or
# where more than 8 times as many hold it, of the hash ring's walk): a prefix that every
# engine holds, a system prompt, would otherwise be weighed on every engine.
HOLDER_CHOICES: Final = 8


# Targets that hold none of a prompt weighed as where it may spill (Router.weigh), besides the
# first PLACE_CHOICES of its hash order: the first of the ring from the prompt's own spread.
# Multi-turn chats sharing 4 system prompts on 64 engines, in process, engines as LRU caches:
# prefill hit rate 0.722 with 1, 0.731 with 3, 0.742 with 5, 0.745 with 8; every engine
# weighed, as before the Roster, 0.742. Without any, the chats' spills never left the few
# engines their system prompts' hash order names: 46 of the 64 took requests.
SPILL_CHOICES: Final = 5


# Points each target has on the hash ring (Roster.walk): with 16, the share of new prefixes
# the luckiest of 512 engines ranks first for is about twice the mean, where the bounded
# loads take over.
RING_POINTS: Final = 16


# Other senders (replicas, workers) are seen where the engines' counts of recent requests are
# this much above this process's own.
OTHERS_SEND: Final = 1.3


# How long this process's own sends count for a target whose KV events it hears: about the
# longest a prefill queues and runs before the engine publishes its blocks.
PENDING_SECONDS: Final = 2.0


# Routing's running mean of the blocks a request computes weighs the last this many requests
# about as much as all before: it follows a change of workload within a few dozen requests.
MEAN_UNCACHED_EVENTS: Final = 32


# A prefix index evicts once it holds this share more blocks than its capacity, to the
# capacity: eviction sorts the index, so it runs once in many additions instead of each time.
INDEX_EVICT_BATCH: Final = 1 / 8


# Chat turns remembered per target: the next turn of each of that many conversations finds
# its own there (Target.conversation_share).
TURNS_KEPT: Final = 4096


# A chat's turns before the latest that a request names (RouteKey.earlier_turns): the last
# one this process sent is among them with up to this many replicas or workers in turn.
EARLIER_TURNS: Final = 8


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What routing knows of one request: its prompt's blocks and where a first sight goes."""

    length: int  # bytes of the prompt as routing reads it (prompt_bytes)
    chain: list[int]  # per block, a hash of it and of every block before it
    placement: int  # the same in every proxy process: the first block, or the session key
    session: bool  # the client named a session (X-Session-ID, or the body's "user")
    # A chat's turn (turn_id) and, once it answered before, the turns it continues, the
    # latest first: routing tells a conversation's next turn from a new prompt that shares a
    # prefix. Not only the latest: where replicas share the traffic, that one went through
    # another replica as often as not.
    turn: int = 0
    earlier_turns: tuple[int, ...] = ()
    # The prompt's token ids as vLLM computes them, where known (precise routing), and their
    # token_chain per block size.
    tokens: Sequence[int] | None = None
    token_chains: dict[int, list[int]] = field(default_factory=dict, compare=False)
    token_share: float = 1.0  # of the prompt that ``tokens`` cover (TokenReading stops early)
    # The same in every proxy process, and another for each prompt (its last block's): which
    # of many engines that hold its head are weighed (Router.among), so that the prompts of
    # one system prompt spread over all of them.
    spread: int = 0
    # Where it names a LoRA adapter, adapter_seed of its name: the adapter's KV blocks, as
    # KV events say, serve only requests that name it (HeldBlocks.stored chains them so).
    adapter: int = 0

    def token_chain(self, size: int) -> list[int]:
        if (chain := self.token_chains.get(size)) is None:
            chain = self.token_chains[size] = token_chain(self.tokens or (), size, self.adapter)
        return chain

    def token_blocks(self, size: int) -> float:
        """How many blocks of ``size`` tokens the whole prompt has (estimated from the share
        read, where the reading stopped early)."""
        return len(self.token_chain(size)) / self.token_share


def prompt_bytes(path: str, body: Mapping[str, Any]) -> bytes:
    """The prompt as routing reads it: bytes whose prefixes match when the prompts' do.

    A chat becomes one line per message (role, content, name, tool calls), so turn N+1 starts
    with turn N; token ids become their digits; the model and the tools come first.
    """
    head, data, _ = prompt_reading(path, body)
    return head + data


def route_key(
    path: str, body: Mapping[str, Any], session_id: str | None, block: int = ROUTING_BLOCK_BYTES
) -> RouteKey:
    head, data, befores = prompt_reading(path, body)
    seed = zlib.crc32(head)  # in every block's hash: a prompt to another model or other tools
    if session_id:
        placement = zlib.crc32(b"session\0" + session_id.encode("utf-8", "replace"))
    else:
        placement = zlib.crc32(data[:block], zlib.crc32(head))
    chain = block_chain(data, block, seed)
    length = len(head) + len(data)
    spread = zlib.crc32(data[-block:], placement)
    if befores is None:  # a completion: no later request names it as a turn before
        return RouteKey(length, chain, placement, bool(session_id), spread=spread)
    turn = turn_id(data, chain, len(data), block, seed)
    earlier = tuple(turn_id(data, chain, before, block, seed) for before in befores)
    return RouteKey(length, chain, placement, bool(session_id), turn, earlier, spread=spread)


def prompt_reading(path: str, body: Mapping[str, Any]) -> tuple[bytes, bytes, list[int] | None]:
    """prompt_bytes as its head (the model, and a chat's tools) and the rest, kept apart so
    that a large prompt is not copied once more to join them; and for a chat, how many bytes
    of the rest each of its turns before an answer sent, the latest first, at most
    EARLIER_TURNS (none where none answered yet; None for a completion)."""
    head = str(body.get("model", "")).encode() + b"\0"
    api = API_ROUTES[path]
    if api.conversation:
        if tools := body.get("tools"):
            head += encode_json({"tools": tools}) + b"\n"
        messages = body.get(api.prompt) if api.chat else response_messages(body)
        messages = messages if isinstance(messages, list) else []
        lines = [message_line(m) for m in messages]
        ends = itertools.accumulate(map(len, lines), initial=0)
        befores = [end for end, m in zip(ends, messages, strict=False) if is_answer(m)]
        return head, b"".join(lines), befores[: -EARLIER_TURNS - 1 : -1]
    prompt = body.get(api.prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: it is placed by its first prompt
    if isinstance(prompt, str):
        return head, prompt.encode("utf-8", "surrogatepass"), None
    if isinstance(prompt, list):
        return head, ",".join(map(str, prompt)).encode(), None
    return head, b"", None


def response_messages(body: Mapping[str, Any]) -> list[object]:
    """A Responses request's instructions and input as a chat's messages: the instructions a
    system message, a text input one user message, a list of items as they are."""
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    items = items if isinstance(items, list) else []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        return [{"role": "system", "content": instructions}, *items]
    return items


def message_line(message: object) -> bytes:
    if not isinstance(message, dict) or "role" not in message:  # a Responses item, a call...
        return encode_json({"message": message}) + b"\n"
    fields = ("role", "content", "name", "tool_calls", "tool_call_id")
    return encode_json({"m": [message.get(key) for key in fields]}) + b"\n"


def prompt_token_ids(path: str, body: Mapping[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids (a batch: its first), or a generate request's,
    which need no tokenizer."""
    api = API_ROUTES[path]
    if api.conversation:
        return None
    prompt = body.get(api.prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


# Within a text, a piece is cut after this many characters, before the next space between two
# words: tokenizers split words at spaces (GPT-2's pre-tokenizer, SentencePiece's "▁"), so both
# sides encode as they would together, and prompts that share a prefix share its first pieces.
PIECE_CHARS: Final = 1024


WORD_GAP: Final = re.compile(r"(?<=\S) (?=\S)")


def cut(text: str) -> list[str]:
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        if (gap := WORD_GAP.search(text, start + PIECE_CHARS)) is None:
            break
        pieces.append(text[start : gap.start()])
        start = gap.start()
    pieces.append(text[start:])
    return [piece for piece in pieces if piece]


class PromptPieces:
    """A prompt's token ids, piece by piece, each piece encoded once: a chat's earlier turns,
    which it resends every turn, and the shared prefix of completions are not encoded again.

    The tokenizer itself splits its input at added tokens (a template's role and end-of-turn
    markers) and encodes the text between them on its own; within that text, pieces are cut
    at spaces between words (cut). Tokenizers whose added tokens strip the text around them
    are used whole, and the first requests of each kind are checked against a whole encoding:
    one difference and this stops (logged), and every prompt is encoded whole."""

    CHECKS: Final = 8  # requests of each kind (with special tokens or not) checked
    # Characters of pieces not seen before that one step encodes: one piece first (about
    # 0.2 ms), twice as many each next step, so a prompt held deep takes a few steps only.
    FIRST_STEP: Final = PIECE_CHARS
    LAST_STEP: Final = 64 * PIECE_CHARS
    LIMIT: Final = 16 << 20  # characters of pieces remembered, at most

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        added = encoder.get_added_tokens_decoder()
        self.ids = {token.content: token_id for token_id, token in added.items()}
        self.usable = all(
            not (token.lstrip or token.rstrip or token.single_word or token.normalized)
            for token in added.values()
        )
        longest_first = sorted(self.ids, key=len, reverse=True)
        markers = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
        self.split: Callable[[str], list[str]] = markers.split if self.ids else lambda t: [t]
        self.around = special_tokens_around(encoder)
        # Without offsets (tokenizers 0.21+): the same ids, about a third faster.
        self.encode_many = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
        self.known: dict[str, list[int]] = {}
        self.size = 0
        self.checks = {False: 0, True: 0}

    def steps(self, text: str, special: bool) -> Iterator[tuple[list[int], int]] | None:
        """The ids of ``text`` (with the post-processor's special tokens if ``special``) in
        steps, each encoding a few pieces not seen before (FIRST_STEP), with the characters
        read so far; None where only a whole encoding is right. The first requests of each
        kind are read whole here and checked."""
        if not self.usable or (special and self.around is None):
            return None
        parts = self.split(text)
        items: list[str | int] = []  # pieces of text, and the ids of the markers between them
        for i, part in enumerate(parts):
            items += cut(part) if i % 2 == 0 else [self.ids[part]]
        before, after = self.around if special and self.around else ((), ())
        steps = self.read(items, list(before), list(after))
        if self.checks[special] >= self.CHECKS:
            return steps
        self.checks[special] += 1
        ids = [token for step, _ in steps for token in step]
        if self.encoder.encode_batch([text], add_special_tokens=special)[0].ids != ids:
            log.warning("this tokenizer encodes a prompt's pieces otherwise than the whole: "
                        "prompts are tokenized whole (slower for long ones)")  # fmt: skip
            self.usable = False
            return None
        return iter([(ids, len(text))])

    def read(
        self, items: list[str | int], before: list[int], after: list[int]
    ) -> Iterator[tuple[list[int], int]]:
        ids, read, at, step = before, 0, 0, self.FIRST_STEP
        while at < len(items):
            known = self.known
            new: dict[str, None] = {}  # the next pieces not seen before, up to ``step``
            size = 0
            for item in itertools.islice(items, at, None):
                if isinstance(item, str) and item not in known and item not in new:
                    if new and size + len(item) > step:
                        break
                    new[item], size = None, size + len(item)
            if new:
                encoded = self.encode_many(list(new), add_special_tokens=False)
                known = self.remember({p: e.ids for p, e in zip(new, encoded, strict=True)})
                step = min(2 * step, self.LAST_STEP)
            while at < len(items):  # up to the next piece not encoded yet
                if isinstance(item := items[at], int):
                    ids.append(item)
                elif item in known:
                    ids += known[item]
                    read += len(item)
                else:
                    break
                at += 1
            yield ids, read
            ids = []
        if ids or after:  # an empty text's special tokens, or those after the text
            yield ids + after, read

    def remember(self, new: dict[str, list[int]]) -> dict[str, list[int]]:
        """Add pieces in place (a copy of a full cache costs 0.4 ms; another thread's
        lookups stay whole under the GIL, str keys run no Python code); over LIMIT, start a
        new cache with them: the next requests' pieces come back first."""
        self.size += sum(map(len, new))
        if self.size > self.LIMIT:
            self.known, self.size = dict(new), sum(map(len, new))
        else:
            self.known.update(new)
        return self.known


def special_tokens_around(encoder: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a text (a BOS, ...), found by where a
    text's own ids sit among them; None if they do not sit whole."""
    plain = encoder.encode("a", add_special_tokens=False).ids
    special = encoder.encode("a", add_special_tokens=True).ids
    for at in range(len(special) - len(plain) + 1):
        if special[at : at + len(plain)] == plain:
            return special[:at], special[at + len(plain) :]
    return None


def chat_message(message: object) -> object:
    """A message as vLLM hands it to a chat template: text parts joined by newlines."""
    if isinstance(message, dict) and isinstance(content := message.get("content"), list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and "text" in p]
        return message | {"content": "\n".join(texts)}
    return message


def is_answer(message: object) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def block_chain(data: bytes, size: int = ROUTING_BLOCK_BYTES, seed: int = 0) -> list[int]:
    """A hash per full block, chained with ``seed`` and every block before it (XOR of each
    block's hash with its position). The same in every process, as --peer replicas tell each
    other these: Python's hash() of bytes is seeded per process, so a block is read by its
    CRC-32 (zlib's C code, as fast), and hash() takes ints and tuples of ints alike
    everywhere."""
    count = len(data) // size
    if not count:  # most chats' and completions' first turn: no setting up for nothing
        return []
    blocks = map(
        data.__getitem__, map(slice, range(0, count * size, size), itertools.count(size, size))
    )
    hashes = map(hash, zip(itertools.count(), map(zlib.crc32, blocks)))
    return list(itertools.accumulate(hashes, operator.xor, initial=seed))[1:]


def turn_id(data: bytes, chain: list[int], length: int, block: int, seed: int) -> int:
    """A hash of the prompt's first ``length`` bytes, from the chain's blocks and the rest:
    a chat's turn, which its later turns name as one before (RouteKey.earlier_turns)."""
    whole = length // block
    rest = zlib.crc32(data[whole * block : length])
    return hash((chain[whole - 1] if whole else seed, length, rest))


def adapter_seed(name: str | None) -> int:
    """A LoRA adapter's token chains start from this, the base model's from 0: the same ids
    under another adapter are other KV. The same in every process (crc32, not hash())."""
    return zlib.crc32(name.encode("utf-8", "replace"), 0x10AA) if name else 0


def token_chain(tokens: Sequence[int], size: int, seed: int = 0) -> list[int]:
    """A hash per full block of ``size`` token ids, chained with every block before it, the
    same way as HeldBlocks.stored hashes the token ids of vLLM's BlockStored events. Hashes of
    ints and tuples of ints are the same in every process (unlike those of str and bytes)."""
    chain: list[int] = []
    extend_chain(chain, tokens, size, seed)
    return chain


def extend_chain(chain: list[int], tokens: Sequence[int], size: int, seed: int = 0) -> None:
    """Append to ``chain`` (token_chain's of a prefix of ``tokens``) the blocks it lacks."""
    start = len(chain)
    rest = iter(tokens[start * size : len(tokens) // size * size])
    # One iterator zipped with itself: tuples of ``size`` ids, as many as whole blocks.
    blocks = zip(itertools.count(start), zip(*[rest] * size, strict=True))
    hashes = itertools.accumulate(
        map(hash, blocks), operator.xor, initial=chain[-1] if chain else seed
    )
    chain += itertools.islice(hashes, 1, None)


@dataclass(frozen=True, slots=True)
class Serving:
    """Where a model's requests go (Fleet.serving): the usable prefill engines and decodes that
    serve it, and each stage's Router, that of the instances that run it."""

    engines: tuple[PrefillEngine, ...]
    decodes: tuple[DecodeInstance, ...]
    prefill_router: Router
    decode_router: Router
    model: str | None = None
    adapter: str | None = None  # the model, where it is a LoRA adapter (its KV events' blocks)

    # Picks claim their target at once, before any await, so that concurrent arrivals see
    # each other's load; every claim is released when its leg ends (Fleet.release_*: by the
    # router of the group the target is in then). ``sends`` gets what each pick added to the
    # routing indexes (Sent): the request keeps it, to take back if the prompt is refused
    # (Fleet.take_back).

    def claim_prefill(
        self, avoid: Collection[Backend] = (), key: RouteKey | None = None,
        sends: list[Sent] | None = None,
    ) -> PrefillEngine:  # fmt: skip
        engines = self.engines
        if avoid:  # passed over while another is left (see claim_decode)
            engines = tuple(e for e in engines if e.instance not in avoid) or engines
        if not engines:
            raise ProxyError(503, f"no usable prefill engine{naming_model(self)}")
        router = self.prefill_router
        choice = router.pick(engines, router.policy, key)
        if sends is not None and choice.sent is not None:
            sends.append(choice.sent)
        engine = engines[choice.index]
        engine.instance.in_flight += 1
        return engine

    def claim_decode(
        self, avoid: Collection[Backend] = (), key: RouteKey | None = None,
        sends: list[Sent] | None = None,
    ) -> DecodeInstance:  # fmt: skip
        return self.claim_decode_holding(avoid, key, sends)[0]

    def claim_decode_holding(
        self, avoid: Collection[Backend] = (), key: RouteKey | None = None,
        sends: list[Sent] | None = None,
    ) -> tuple[DecodeInstance, float]:  # fmt: skip
        """A decode, and how many of the prompt's blocks (key.chain's) it is believed to hold
        (Choice.matched: 0 unless routed by prefix)."""
        decodes = self.decodes
        if avoid:
            # Those tried are passed over while another is left. One that could not be
            # reached is out of the rotation anyway; one whose KV load failed stays in it
            # and, the last one left, may be tried again.
            decodes = tuple(d for d in decodes if d not in avoid) or decodes
        if not decodes:
            raise ProxyError(503, f"no usable decode instance{naming_model(self)}")
        router = self.decode_router
        choice = router.pick(decodes, router.policy, key)
        if sends is not None and choice.sent is not None:
            sends.append(choice.sent)
        return decodes[choice.index], choice.matched


def local_tokens(
    route: RouteKey | None, size: int, held: float, block: int, bytes_per_token: float
) -> float:
    """How many of a prompt's tokens a decode that holds ``held`` of its blocks (key.chain's)
    computes itself: by the prompt's token ids where they are known (KV events), else by
    its bytes (``size`` where it has no route key) at the fleet's learned bytes a token."""
    if route is not None and route.tokens is not None and route.chain:
        return len(route.tokens) * max(0.0, 1.0 - held / len(route.chain))
    length = route.length if route is not None else size
    return max(0.0, length - held * block) / bytes_per_token


def local_prefill_decision(
    config: ProxyConfig, decode: DecodeInstance, left: float, held: float, prefills: bool
) -> tuple[bool, str]:
    """Whether a decode that would compute ``left`` tokens of a prompt itself (``held``: the
    blocks of it it holds) is to do so rather than pull them, and why (LOCAL_PREFILL_REASONS).
    The load of both pools counts: a decode computing --max-local-prefills prompts already,
    or whose KV cache is full (vLLM would preempt its running streams for the prompt), is
    spared; and where the model has no usable prefill engine left (a try whose prefill
    went away), the decode computes the prompt whatever its length, rather than the request
    failing."""
    if not prefills:
        return True, "no_prefill"
    if left >= config.max_local_prefill_tokens:
        return False, "long"
    if decode.local_prefills >= config.max_local_prefills or decode.kv_full(config):
        return False, "decode_busy"
    return True, ("cached" if held else "short")


# What came of a stream cut mid-way (Metrics.migration_outcomes).
MIGRATION_OUTCOMES: Final = ("continued", "not_continued", "failed", "client_gone")


# Every (decision, reason) of local_prefill_decision, for the metrics and /healthcheck.
LOCAL_PREFILL_REASONS: Final = (
    ("local", "short"),
    ("local", "cached"),
    ("local", "no_prefill"),
    ("pd", "long"),
    ("pd", "decode_busy"),
)


def naming_model(serving: Serving) -> str:
    """For a 503: the model the request named, where the fleet knows models."""
    return f" serves model `{serving.model}`" if serving.model is not None else ""


class Router:
    """Picks one stage's target: prefix_aware (the cost below), least_loaded or round_robin.

    prefix_aware: a prompt none of the targets holds goes where a bounded-load consistent
    hash of its first block (or its session key) ranks first, or to the one of its first
    three written least lately (place), so every proxy process sends a new prefix to the
    same few engines. Otherwise, of the targets that hold the prompt's first block (at most
    HOLDER_CHOICES of them, and as many of those that hold the most of it) and, where it may
    spill, the first of its hash order and of the ring from its own spread, the one with the
    least
        cost = load_weight x queued work + blocks of this prompt it lacks x (1 + turnover)
    wins, the queued work being the blocks this process's requests there still have to
    compute, plus other senders' requests (from the scrape) at the mean such work: a prompt
    spills to another engine once waiting where its prefix is weighs more than computing it
    again. The turnover is the share of the target's cache written lately (at most 1), by
    this process or, as its KV events say, by every sender: there, each block computed
    evicts one in use. Targets over their share of recent requests (RECENT_SECONDS; a chat's
    own earlier turns count at most the mean, and its first turn has the slack only as far
    as chats do not come back: ChatReturns), or whose queue is past its bound (QUEUE_SLACK),
    are left out first.

    The Roster keeps what that reads of the whole stage, so a decision costs the same on 8
    engines or 1,024 (bench/bench_routing.py --scale).
    """

    def __init__(self, stage: str, load_weight: float, balance: float, fresh_for: float) -> None:
        self.stage = stage
        self.load_weight = load_weight
        self.balance = balance
        self.fresh_for = fresh_for
        self.policy = Policy.ROUND_ROBIN  # its stage's, as the configuration says (Fleet.tune)
        self.turn = itertools.count()
        self.roster = Roster()
        # Blocks a request has to compute, on average: what one more queued request weighs.
        self.mean_uncached = 1.0
        self.returns = ChatReturns()
        # Told of every decision (the metrics set it).
        self.observe: Callable[[str, Choice, RouteKey | None], None] | None = None
        # Told of every prefix_aware send, with its uncached blocks (--peer sets it).
        self.tell: Callable[[Target, RouteKey, float], None] | None = None

    def pick(self, targets: Sequence[Target], policy: Policy, key: RouteKey | None) -> Choice:
        """Choose a target and claim it: its counts include this request from now on."""
        choice = self.choose(targets, policy, key)
        target = targets[choice.index]
        blocks = len(key.chain) if key is not None else 0
        uncached = max(blocks - choice.matched, 1)  # a request costs a block at the least
        self.roster.claimed(target, uncached)
        if key is not None and policy is Policy.PREFIX_AWARE:  # what only prefix_aware reads
            now = time.monotonic()
            choice.sent = self.roster.sent(target, key, now, uncached)
            self.returns.saw(key, now)
            if self.tell is not None:
                self.tell(target, key, uncached)
            self.mean_uncached += (uncached - self.mean_uncached) / MEAN_UNCACHED_EVENTS
        if self.observe is not None:
            self.observe(self.stage, choice, key)
        return choice

    def release(self, target: Target) -> None:
        self.roster.released(target)

    def heard(self, target: Target, key: RouteKey, uncached: float) -> None:
        """A --peer replica's send, remembered as this process's own: its blocks, its turn
        and its count. Replicas that tell each other every send then route as one."""
        now = time.monotonic()
        self.roster.sent(target, key, now, uncached)
        target.told.add(now, 1)

    def rescan(self) -> None:
        """After a round of scrapes: the other senders' load, summed again."""
        self.roster.rescan(time.monotonic(), self.fresh_for)

    def choose(self, targets: Sequence[Target], policy: Policy, key: RouteKey | None) -> Choice:
        if policy is not Policy.PREFIX_AWARE:
            return Choice(choose_index(targets, self.turn, policy, _in_flight), policy.value, 0)
        if len(targets) == 1:
            return self.only(targets[0], key)
        return self.weigh(targets, key)

    @staticmethod
    def only(target: Target, key: RouteKey | None) -> Choice:
        """weigh's choice where there is none to make (one prefill engine, or one decode),
        reason and match included, without weighing: a quarter of the time."""
        if key is None:
            return Choice(0, "fallback", 0)
        if key.session:
            return Choice(0, "session", 0)
        matched = target.holds(key)
        return Choice(0, "affinity", matched) if matched else Choice(0, "cold", 0)

    def bounds(self, key: RouteKey | None, now: float) -> Bounds:
        roster = self.roster
        count = len(roster.targets)
        loads = roster.in_flight + roster.others
        recent = roster.recent_total(now)
        conversation = self.own_turns_over_mean(key, recent, now) if key is not None else {}
        recent -= sum(conversation.values())
        slack = RECENT_SLACK
        if key is not None and key.turn and not key.earlier_turns:  # a chat's first turn
            slack *= 1 - self.returns.share(now)
        return Bounds(
            now=now,
            fresh_for=self.fresh_for,
            everyone=roster.counted,
            recent_limit=limit(recent, count, max(self.balance, RECENT_BALANCE), slack),
            queue_limit=limit(loads, count, self.balance, QUEUE_SLACK),
            room_limit=limit(loads, count, self.balance),
            conversation=conversation,
        )

    def own_turns_over_mean(self, key: RouteKey, recent: float, now: float) -> dict[Target, float]:
        """Where a chat's earlier turns went, its requests there over the mean target's share:
        not counted against that target's bound. A conversation's turns come one after
        another and cannot be spread, so one busy chat alone on a cluster is no pile-up
        (counted whole, it went elsewhere every few turns, writing its whole history into
        another cache each time); counted as the mean, several on one engine still are.

        Where replicas or workers share the traffic, this process sent its part of the
        conversation's turns, and the counts are everyone's: its part is scaled up by the
        ratio of everyone's requests to its own."""
        roster = self.roster
        if not key.earlier_turns or not (where := roster.conversation(key)):
            return {}
        mean = recent / len(roster.targets)
        ours = roster.recent.now(now)
        senders = max(recent / ours, 1.0) if ours > 0 else 1.0
        over = {}
        for target in where:
            if target not in roster.position:
                continue
            everyone = roster.counted
            here = target.everyones_recent(now) if everyone else target.recent_share(now)
            mine = min(target.conversation_share(key, now) * senders, here)
            if mine > mean:
                over[target] = mine - mean
        return over

    def weigh(self, targets: Sequence[Target], key: RouteKey | None) -> Choice:
        roster = self.roster
        now = time.monotonic()
        if targets is not roster.targets:
            roster.sync(targets, now, self.fresh_for)
        bounds = self.bounds(key, now)
        if key is None or key.session:
            bounds.bounded = False  # only the instantaneous load moves these
        if key is None:  # the least loaded of a few, from a point that turns
            near = self.admitted(mix64(next(self.turn)), bounds, PLACE_CHOICES)
            return Choice(roster.position[min(near, key=bounds.load)], "fallback", 0)
        point = mix64(key.placement)
        if key.session:  # an explicit key: the first of its hash order with room
            self.admitted(point, bounds, 1)
            target = self.with_room(point, bounds, 1)[0]
            return Choice(roster.position[target], "session", 0)
        near = self.admitted(point, bounds, PLACE_CHOICES)
        first, most = roster.holders(key)
        holders = self.among(first, key, bounds) + self.among(most, key, bounds)
        matches = {t: m for t in holders if (m := t.holds(key)) > 0}
        if not matches:
            # Where the bounds left out every target that holds it, the prompt spilled.
            reason = "spill" if first else "cold"
            target = self.place(point, bounds)
            return Choice(roster.position[target], reason, 0)
        best = max(matches.values())

        def cost(target: Target) -> tuple[float, int]:
            others = target.load.others(now, self.fresh_for)
            work = self.load_weight * (target.pending_blocks + others * self.mean_uncached)
            # A block computed where the cache turns over fast evicts one that was in use
            # lately, which its prompt's next request computes again: it costs up to twice.
            lacking = (len(key.chain) - matches[target]) * (1 + target.turnover(now))
            return work + lacking, mix64(key.placement << 32 ^ target.seed)

        costs = {target: cost(target) for target in matches}
        pick = min(costs, key=costs.__getitem__)
        # Where it may spill: the first of its hash order, and the first of its own spread's
        # (prompts that share a head would otherwise all spill onto the same few). These hold
        # none of it (the holders were weighed, but for those past HOLDER_CHOICES), so each
        # costs the whole prompt at the least: they are weighed only where the best holder
        # costs as much, and most decisions are a few holders' costs.
        if costs[pick][0] >= len(key.chain):
            for target in near + self.admitted(mix64(key.spread), bounds, SPILL_CHOICES):
                if target not in costs:
                    matches[target] = target.holds(key)
                    costs[target] = cost(target)
            pick = min(costs, key=costs.__getitem__)
        reason = "affinity" if matches[pick] == best else "spill"
        return Choice(roster.position[pick], reason, matches[pick])

    def among(self, holders: int, key: RouteKey, bounds: Bounds) -> list[Target]:
        """Of the holders (a mask of slots), at most HOLDER_CHOICES that the bounds admit: the
        first of them in the rendezvous order of the prompt's own spread (not its placement,
        which the prompts sharing its head share: they would all weigh the same few), or,
        where a great many hold it, the first few the hash ring's walk meets from there."""
        roster = self.roster
        if holders.bit_count() <= 8 * HOLDER_CHOICES:
            found = [t for slot in slots_in(holders) if bounds.admits(t := roster.target(slot))]
            if len(found) <= HOLDER_CHOICES:
                return found
            return heapq.nsmallest(
                HOLDER_CHOICES, found, key=lambda t: mix64(key.spread << 32 ^ t.seed)
            )
        walk = roster.walk(mix64(key.spread))
        met = (t for t in walk if holders >> roster.slot_of[t] & 1)
        # Examined at most this many: where most of them are over the bounds, a walk to
        # find 8 admitted would cross the fleet.
        examined = itertools.islice(met, 4 * HOLDER_CHOICES)
        return list(itertools.islice(filter(bounds.admits, examined), HOLDER_CHOICES))

    def admitted(self, point: int, bounds: Bounds, count: int) -> list[Target]:
        """The first ``count`` targets in the hash order from ``point`` that the bounds admit;
        where none is, the bounds are relaxed (Bounds.relax) until one is."""
        while True:
            chosen = list(itertools.islice(filter(bounds.admits, self.roster.walk(point)), count))
            if chosen or not bounds.relax():
                return chosen

    def with_room(self, point: int, bounds: Bounds, count: int) -> list[Target]:
        """The first ``count`` admitted targets in the hash order from ``point`` with room
        under the load bound (consistent hashing with bounded loads: Mirrokni, Thorup and
        Zadimoghaddam); where none has, the least loaded admitted."""
        walk = self.roster.walk(point)
        roomy = (t for t in walk if bounds.admits(t) and bounds.has_room(t))
        if chosen := list(itertools.islice(roomy, count)):
            return chosen
        return [min(filter(bounds.admits, self.roster.walk(point)), key=bounds.load)]

    def place(self, point: int, bounds: Bounds) -> Target:
        """Where a prefix no target holds goes: of the first PLACE_CHOICES targets in its hash
        order that have room under the load bound, the one whose cache was written least
        lately (write_share). Where other senders are seen, whose writes reach this process
        late if at all, only if clearly less than the first's (under PLACE_MARGIN of it), so
        that processes which count the writes apart still mostly agree: the candidates are
        the same in all of them.

        Not the first of the hash order alone: a family of prompts whose shared head was
        evicted comes back to the same engine each time, two busy families that hash alike
        share one cache, and it turns over faster than the rest, evicting their next
        relatives' heads. Nor back to the engine that evicted the prefix (as KV events say):
        the same stickiness."""
        now, roster = bounds.now, self.roster
        choices = self.with_room(point, bounds, PLACE_CHOICES)
        shares = {t: t.write_share(now) for t in choices}
        # Writes alike but for when they decayed from are alike: the first of them in the
        # hash order, in every process, however their moments differ.
        alike = min(shares.values()) * (1 + PLACE_ALIKE)
        least = next(t for t in choices if shares[t] <= alike)
        others_send = roster.recent_total(now) > OTHERS_SEND * roster.recent.now(now)
        margin = PLACE_MARGIN if others_send else 1.0
        return least if shares[least] < margin * shares[choices[0]] else choices[0]


class Target:
    """What a stage picks among: a prefill engine, or a decode instance."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name  # stable across restarts and proxy processes: its place in the hash
        self.seed = zlib.crc32(name.encode())
        self.index = PrefixIndex(capacity)
        self.load = LoadView()
        self.in_flight = 0  # this process's requests on it
        self.pending_blocks = 0.0  # the prompt blocks those have to compute (or pull)
        self.recent = Decayed()  # this process's requests, and its --peer replicas'
        self.told = Decayed()  # those of its --peer replicas alone (for /healthcheck)
        # The prompt blocks they had to compute here, decayed alike: how fast its cache
        # turns over (turnover).
        self.written = Decayed()
        self.kv_tokens = 0  # its KV cache in tokens, as its /metrics says; 0 if unknown
        self.feed: KvFeed | None = None  # its KV events, with --kv-events-port
        # The chat turns (turn_id) this process sent here lately, oldest first: with each, its
        # conversation's requests here (decayed like recent) and when it was sent.
        self.turns: dict[int, Decayed] = {}

    @property
    def hears_events(self) -> bool:
        return self.feed is not None and self.feed.live and self.feed.held.block_size > 0

    def holds(self, key: RouteKey) -> float:
        """How many of the prompt's leading blocks (key.chain's) the target holds: as its KV
        events say where it has published any and the prompt's tokens are known, else as
        this process's own index estimates."""
        feed = self.feed
        if feed is None or not self.hears_events or key.tokens is None:
            return self.index.match(key.chain)
        size = feed.held.block_size
        chain = key.token_chain(size)
        reported = (
            feed.held.match(chain) * len(key.chain) / key.token_blocks(size) if chain else 0.0
        )
        # A prompt's blocks reach the events once its prefill ran: what this process sent
        # there a moment ago is on its way, and counts too.
        return max(reported, self.index.match_sent_lately(key.chain))

    def recent_share(self, now: float) -> float:
        """This process's recent requests here."""
        return self.recent.now(now)

    def counts_everyone(self, now: float, fresh_for: float) -> bool:
        """Whether a fresh scrape gave the engine's request counter (everyones_recent)."""
        return self.load.finished is not None and now - self.load.scraped_at <= fresh_for

    def everyones_recent(self, now: float) -> float:
        """Every sender's recent requests here, as of its last scrape those the engine
        finished and those it was running or queueing, and this process's sent since."""
        view = self.load
        decay = math.exp((view.scraped_at - now) / RECENT_SECONDS)
        since = max(self.recent_share(now) - view.ours_recent * decay, 0.0)
        return view.recent * decay + view.running + view.waiting + since

    def claimed(self, uncached: float) -> None:
        self.in_flight += 1
        self.pending_blocks += uncached

    def count_recent(self, now: float, uncached: float) -> None:
        self.recent.add(now, 1)
        self.written.add(now, uncached)

    def turnover(self, now: float) -> float:
        """The share of its cache written lately, at most 1."""
        return min(self.write_share(now), 1.0)

    def write_share(self, now: float) -> float:
        """How much was written to its cache lately, as a share of it: by this process's
        requests, or by every sender's where its KV events say more (other replicas' writes,
        and this process's own reach them once their prefill ran)."""
        share = self.written.now(now) / max(self.index.capacity, 1)
        if self.hears_events and self.kv_tokens and self.feed is not None:
            share = max(share, self.feed.written.now(now) / self.kv_tokens)
        return share

    def sent_turn(self, key: RouteKey, now: float) -> None:
        """Remember a chat's turn in place of those before it, with their conversation's
        requests here."""
        if key.turn:
            share = self.conversation_share(key, now)
            for turn in key.earlier_turns:
                self.turns.pop(turn, None)
            self.turns.pop(key.turn, None)  # a turn sent again goes to the end
            self.turns[key.turn] = Decayed(share + 1, now)
            if len(self.turns) > TURNS_KEPT:
                del self.turns[next(iter(self.turns))]

    def conversation_share(self, key: RouteKey, now: float) -> float:
        """Of recent_share, the requests of this prompt's conversation (the chat turns before
        it that this process sent here)."""
        for earlier in key.earlier_turns:  # the latest this process sent
            if (turn := self.turns.get(earlier)) is not None:
                return turn.now(now)
        return 0.0

    def released(self) -> None:
        # Their mean share: requests do not say their own at the end, and rarely need to.
        self.pending_blocks -= self.pending_blocks / self.in_flight if self.in_flight > 0 else 0
        self.in_flight -= 1

    def routing_status(self, now: float) -> dict[str, Any]:
        status = {"load": self.load.status(now), "index_blocks": len(self.index.blocks)}
        # Requests sent here lately (decayed): this process's and its --peer replicas', and
        # those of the replicas alone.
        status["recent"] = round(self.recent_share(now), 2)
        status["peers_recent"] = round(self.told.now(now), 2)
        status["pending_blocks"] = round(self.pending_blocks, 1)
        status["turnover"] = round(self.turnover(now), 2)
        if self.feed is not None:
            status |= self.feed.status(now)
        return status


def mix64(value: int) -> int:
    """splitmix64's finaliser: every input bit moves every output bit."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & MASK64
    return value ^ (value >> 31)


def ring_points(seed: int) -> list[int]:
    """A target's points on the hash ring, from its name's hash: the same in every process."""
    return [mix64(seed << 8 | n) for n in range(RING_POINTS)]


def slots_in(mask: int) -> Iterator[int]:
    """The slots whose bits are set, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def deepest_holders(chain: Sequence[int], holders: Mapping[int, int], members: int) -> int:
    """The members that hold the most of the chain's leading blocks (a binary search, as in
    leading: what a target holds of a chain is a prefix of it)."""
    low, high = 0, len(chain)
    while low < high:
        middle = (low + high + 1) // 2
        if holders.get(chain[middle - 1], 0) & members:
            low = middle
        else:
            high = middle - 1
    return holders.get(chain[low - 1], 0) & members if low else 0


def limit(total: float, count: int, balance: float, slack: float = 0.0) -> float:
    """The most a target may carry, given one more: ``balance`` times the mean (HAProxy's
    hash-balance-factor), or the mean plus ``slack`` while that is more."""
    mean = (total + 1) / count
    return math.ceil(max(balance * mean, mean + slack))


class PrefixIndex:
    """The prompt blocks a target is believed to hold: those this process sent it, the least
    recently sent evicted first, at most ``capacity`` (its KV cache, or --prefix-index-blocks).

    A chain's blocks are stamped tail first, so its head outlives its tail, as in vLLM's own
    eviction: the blocks held are a prefix of each chain, and matching is a binary search.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: dict[int, int] = {}  # chained hash -> when it was last sent
        self.clock = 0
        # (monotonic time, clock before) of each send of the last PENDING_SECONDS.
        self.sends: collections.deque[tuple[float, int]] = collections.deque()
        # Routing's reverse index (Roster.held), where this index's blocks carry its bit.
        self.holders: dict[int, int] | None = None
        self.bit = 0

    def match(self, chain: Sequence[int]) -> int:
        """How many of the chain's leading blocks are held."""
        return leading(chain, self.blocks)

    def add(self, chain: Sequence[int]) -> Sent:
        """Hold the chain's blocks from now on; what was new of them, to take back (Sent)."""
        now = time.monotonic()
        self.forget_sends_before(now - PENDING_SECONDS)  # kept short however it is read
        self.sends.append((now, self.clock))
        sent = Sent(self, chain, self.match(chain), self.clock + len(chain))
        start, self.clock = self.clock, self.clock + len(chain)
        self.blocks.update(zip(chain, range(self.clock, start, -1), strict=True))
        if (holders := self.holders) is not None:
            for block in chain:
                add_holder(holders, block, self.bit)
        if len(self.blocks) > self.capacity * (1 + INDEX_EVICT_BATCH):
            newest = heapq.nlargest(self.capacity, self.blocks.items(), key=operator.itemgetter(1))
            kept = dict(newest)
            self.unhold(self.blocks.keys() - kept.keys())
            self.blocks = kept
        return sent

    def take_back(self, sent: Sent) -> None:
        """Forget the blocks a send brought (``sent``, add's), those no send since stamped
        again: the target refused the prompt, and holds none of it."""
        blocks, top = self.blocks, sent.top
        brought = range(sent.held, len(sent.chain))
        gone = [block for i in brought if blocks.get(block := sent.chain[i]) == top - i]
        for block in gone:
            del blocks[block]
        self.unhold(gone)

    def attach(self, holders: dict[int, int] | None, bit: int) -> None:
        """Carry ``bit`` in ``holders`` for every block held, from now on (and no longer in
        the reverse index it carried one in before)."""
        self.unhold(self.blocks)
        self.holders, self.bit = holders, bit
        if holders is not None:
            for block in self.blocks:
                add_holder(holders, block, bit)

    def unhold(self, blocks: Iterable[int]) -> None:
        """Take this index's bit off ``blocks`` in the reverse index."""
        if (holders := self.holders) is not None:
            for block in blocks:
                remove_holder(holders, block, self.bit)

    def match_sent_lately(self, chain: Sequence[int]) -> int:
        """How many of the chain's leading blocks this process sent in the last
        PENDING_SECONDS."""
        self.forget_sends_before(time.monotonic() - PENDING_SECONDS)
        return leading(chain, SentAfter(self.blocks, self.sends[0][1])) if self.sends else 0

    def forget_sends_before(self, horizon: float) -> None:
        while self.sends and self.sends[0][0] < horizon:
            self.sends.popleft()

    def clear(self) -> None:
        self.unhold(self.blocks)
        self.blocks.clear()
        self.sends.clear()


@dataclass(slots=True, eq=False)
class Sent:
    """What one send added to a PrefixIndex (add), to take back if the prompt is refused
    (Fleet.take_back): the chain's blocks from ``held`` on were new to it, and each was
    stamped ``top`` less its place in the chain. Kept with the request (its chain is the
    RouteKey's own list), so the index holds the send from the pick on, as concurrent
    arrivals must see it, and loses it only if the send comes to nothing."""

    index: PrefixIndex
    chain: Sequence[int]
    held: int  # the chain's leading blocks the index held before (a prefix: PrefixIndex)
    top: int


class SentAfter:
    """The blocks of an index stamped after a clock value."""

    def __init__(self, blocks: dict[int, int], clock: int) -> None:
        self.blocks, self.clock = blocks, clock

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int) and self.blocks.get(block, -1) > self.clock


@dataclass(slots=True)
class LoadView:
    """A target's load as its own /metrics said at the last scrape: every proxy process and
    replica reads the same engine, so they weigh its load alike."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    scraped_at: float = -math.inf  # monotonic
    ours_at_scrape: int = 0  # of those, this process's requests
    prefix_queries: float = 0.0  # a counter: when it goes back, the engine restarted
    finished: float | None = None  # vllm:request_success_total; None before it was seen
    # The requests it finished, decayed over RECENT_SECONDS as of the scrape: every sender's,
    # alike for every proxy process and replica. And this process's Target.recent_share then.
    recent: float = 0.0
    ours_recent: float = 0.0

    def others(self, now: float, fresh_for: float) -> float:
        """Requests on the target that this process did not send (other processes' and
        replicas'), as of a fresh scrape; none known without one."""
        if now - self.scraped_at > fresh_for:
            return 0.0
        return max(0.0, self.running + self.waiting - self.ours_at_scrape)

    def took(self, finished: float | None, now: float, ours_recent: float) -> None:
        """Count what the engine finished since the last scrape into its recent requests."""
        if finished is None:
            self.finished = None
            return
        if self.finished is None:
            done = 0.0  # its whole history, of unknown age
        elif finished < self.finished:
            done = finished  # the counter went back: the engine restarted
        else:
            done = finished - self.finished
        self.recent = self.recent * math.exp((self.scraped_at - now) / RECENT_SECONDS) + done
        self.finished, self.ours_recent = finished, ours_recent

    def status(self, now: float) -> dict[str, Any]:
        age = now - self.scraped_at
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": round(self.kv_usage, 4),
            "age_s": round(age, 3) if age != math.inf else None,
        }


def leading(chain: Sequence[int], held: Container[int]) -> int:
    """How many of the chain's leading blocks are held, found by binary search: engines evict
    a chain's tail before its head, so what they hold of a chain is a prefix of it."""
    low, high = 0, len(chain)
    while low < high:
        middle = (low + high + 1) // 2
        if chain[middle - 1] in held:
            low = middle
        else:
            high = middle - 1
    return low


class Roster:
    """One stage's targets as a decision reads them without visiting each: a slot per target
    (its bit in the reverse indexes), the hash ring, which targets hold each block (this
    process's sends, and the engines' KV events), and running totals of their loads and
    recent requests. A decision then weighs the prompt's holders and the first few targets
    of its hash order, whatever the fleet's size.

    The totals count this process's claims as they happen; what the engines' scrapes say
    (other senders' requests) is summed again after each round of scrapes (rescan)."""

    def __init__(self) -> None:
        self.slot_of: dict[Target, int] = {}
        self.by_slot: list[Target | None] = []
        self.free: list[int] = []
        # The ring: RING_POINTS points per target, sorted, and each point's slot. Every known
        # target is on it, usable or not, so that every proxy process walks the same ring.
        self.points: list[int] = []
        self.point_slots: list[int] = []
        self.ring_stale = True
        self.held: dict[int, int] = {}  # PrefixIndex block -> its holders' bits
        self.reported: dict[int, int] = {}  # HeldBlocks chain -> its holders' bits (KV events)
        self.block_size = 0  # the KV events' block size, where any target hears them
        # The targets the last decision was given (a Fleet's tuple), and their bits.
        self.targets: Sequence[Target] = ()
        self.position: dict[Target, int] = {}
        self.members = 0
        self.in_flight = 0
        self.recent = Decayed()  # this process's recent requests on them all
        self.others = 0.0  # other senders' requests on them, as of the last scrapes
        self.counted = False  # every target's scrape gives its engine's request counter
        self.counted_recent = Decayed()  # sum of LoadView.recent - ours_recent, decayed
        self.queued = 0.0  # sum of LoadView.running + waiting
        self.turn_at: dict[int, Target] = {}  # a chat's turn -> where it went (sent_turn)

    def sync(self, targets: Sequence[Target], now: float, fresh_for: float) -> None:
        """Take ``targets`` as the stage's usable ones; those not seen before are adopted."""
        self.targets = targets
        self.position = {target: i for i, target in enumerate(targets)}
        members = 0
        for target in targets:
            members |= self.bit(target)
        self.members = members
        self.rescan(now, fresh_for)

    def bit(self, target: Target) -> int:
        if (slot := self.slot_of.get(target)) is None:
            slot = self.free.pop() if self.free else len(self.by_slot)
            if slot == len(self.by_slot):
                self.by_slot.append(None)
            self.by_slot[slot], self.slot_of[target] = target, slot
            target.index.attach(self.held, 1 << slot)
            self.ring_stale = True
        held = target.feed.held if target.feed is not None else None
        if held is not None and (held.holders is not self.reported or held.bit != 1 << slot):
            held.attach(self.reported, 1 << slot)  # a new feed (a reload), or a new engine's
        return 1 << slot

    def enlist(self, targets: Collection[Target]) -> None:
        """Take ``targets`` as every one the fleet has, usable or not: those new get a slot
        now, while their KV events' views are small (attaching a full view to the reverse
        index takes a while: 10 ms for 20,000 blocks); those gone lose theirs (an engine that
        restarted is a new target, and the old one holds nothing)."""
        for target in targets:
            self.bit(target)
        for target in [t for t in self.slot_of if t not in targets]:
            slot = self.slot_of.pop(target)
            if target.index.holders is self.held:  # unless another Roster took it (regroup)
                target.index.attach(None, 0)
            held = target.feed.held if target.feed is not None else None
            if held is not None and held.holders is self.reported and held.bit == 1 << slot:
                held.attach(None, 0)  # unless a new engine of its instance took the feed
            self.by_slot[slot] = None
            self.free.append(slot)
            self.ring_stale = True
            self.members &= ~(1 << slot)

    def rescan(self, now: float, fresh_for: float) -> None:
        """Sum the targets' counts again: what the scrapes said, and this process's own (which
        the claims keep current between scrapes, and which this sets right)."""
        targets = self.targets
        self.in_flight = sum(t.in_flight for t in targets)
        self.recent = Decayed(sum(t.recent_share(now) for t in targets), now)
        self.others = sum(t.load.others(now, fresh_for) for t in targets)
        self.counted = bool(targets) and all(t.counts_everyone(now, fresh_for) for t in targets)
        views = [t.load for t in targets]
        # Exponential decay is linear: their sum decays as one count.
        decayed = sum(
            (v.recent - v.ours_recent) * math.exp((v.scraped_at - now) / RECENT_SECONDS)
            for v in views
        )
        self.counted_recent = Decayed(decayed if self.counted else 0.0, now)
        self.queued = sum(v.running + v.waiting for v in views)
        sizes = (t.feed.held.block_size for t in targets if t.hears_events and t.feed)
        self.block_size = next(sizes, 0)

    def recent_total(self, now: float) -> float:
        """The sum of every target's recent requests: everyones_recent where every scrape
        counts them (counted), else recent_share."""
        ours = self.recent.now(now)
        return self.counted_recent.now(now) + self.queued + ours if self.counted else ours

    def walk(self, point: int) -> Iterator[Target]:
        """The usable targets in the ring's order from ``point``, each once."""
        if self.ring_stale:
            ring = sorted(
                (at, slot)
                for target, slot in self.slot_of.items()
                for at in ring_points(target.seed)
            )
            self.points = [at for at, _ in ring]
            self.point_slots = [slot for _, slot in ring]
            self.ring_stale = False
        start = bisect.bisect_left(self.points, point)
        slots, by_slot, members = self.point_slots, self.by_slot, self.members
        seen = 0
        for i in itertools.chain(range(start, len(slots)), range(start)):
            slot = slots[i]
            bit = 1 << slot
            if members & bit and not seen & bit:
                seen |= bit
                yield cast(Target, by_slot[slot])  # a member's slot holds it

    def holders(self, key: RouteKey) -> tuple[int, int]:
        """The usable targets believed to hold the prompt's first block, and those believed to
        hold the most of it: as this process sent it, and as KV events say."""
        chain, members, held = key.chain, self.members, self.held
        first = held.get(chain[0], 0) & members if chain else 0
        tokens: list[int] = []
        if self.reported and key.tokens is not None and self.block_size:
            tokens = key.token_chain(self.block_size)
            first |= self.reported.get(tokens[0], 0) & members if tokens else 0
        if first.bit_count() <= HOLDER_CHOICES:
            return first, 0  # all of them are weighed
        most = deepest_holders(chain, held, members)
        if tokens:
            most |= deepest_holders(tokens, self.reported, members)
        return first, most

    def target(self, slot: int) -> Target:
        return cast(Target, self.by_slot[slot])

    def claimed(self, target: Target, uncached: float) -> None:
        target.claimed(uncached)
        if target in self.position:
            self.in_flight += 1

    def released(self, target: Target) -> None:
        target.released()
        if target in self.position:
            self.in_flight -= 1

    def sent(self, target: Target, key: RouteKey, now: float, uncached: float) -> Sent:
        """What prefix_aware remembers of a request sent: its blocks, and its turn; what the
        blocks added to the target's index, to take back (Sent)."""
        sent = target.index.add(key.chain)
        target.count_recent(now, uncached)
        if target in self.position:
            self.recent.add(now, 1)
        if key.turn:
            target.sent_turn(key, now)
            for turn in key.earlier_turns:
                if self.turn_at.get(turn) is target:
                    del self.turn_at[turn]
            self.turn_at.pop(key.turn, None)
            self.turn_at[key.turn] = target
            if len(self.turn_at) > TURNS_KEPT * max(len(self.targets), 1):
                del self.turn_at[next(iter(self.turn_at))]
        return sent

    def conversation(self, key: RouteKey) -> set[Target]:
        """Where this process sent the chat's earlier turns."""
        return {t for turn in key.earlier_turns if (t := self.turn_at.get(turn)) is not None}


@dataclass(slots=True)
class Decayed:
    """A count whose every part fades over RECENT_SECONDS."""

    value: float = 0.0
    at: float = 0.0  # monotonic, as of value

    def now(self, now: float) -> float:
        return self.value * math.exp((self.at - now) / RECENT_SECONDS)

    def add(self, now: float, amount: float) -> None:
        self.value, self.at = self.now(now) + amount, now


# A stage's reverse index (Roster.held, Roster.reported): block -> a bit per target that holds
# it, kept by each target's PrefixIndex and KV events' view (HeldBlocks) alike.


def add_holder(holders: dict[int, int], chain: int, bit: int) -> None:
    """``bit`` set for ``chain``. Most chains have one holder: one dict operation for them."""
    if (mask := holders.setdefault(chain, bit)) is not bit:
        holders[chain] = mask | bit


def remove_holder(holders: dict[int, int], chain: int, bit: int) -> None:
    """``bit`` cleared for ``chain``, and the chain gone with its last holder."""
    if (mask := holders.pop(chain, 0)) is not bit and (rest := mask & ~bit):
        holders[chain] = rest


@dataclass(slots=True)
class ChatReturns:
    """How many chats come back for a second turn: second turns over first turns among this
    process's chat requests lately. A load balancer spreads both alike over replicas and
    workers, so every process sees the same share without hearing of the others' chats."""

    first: Decayed = field(default_factory=Decayed)
    second: Decayed = field(default_factory=Decayed)
    since: float = math.inf  # monotonic: the first chat request this process routed

    def saw(self, key: RouteKey, now: float) -> None:
        if not key.turn:
            return
        self.since = min(self.since, now)
        if not key.earlier_turns:
            self.first.add(now, 1)
        elif len(key.earlier_turns) == 1:
            self.second.add(now, 1)

    def share(self, now: float) -> float:
        """Assumed 1 for the first CHAT_RETURN_SECONDS, and where no chat began lately."""
        first = self.first.now(now)
        if now - self.since < CHAT_RETURN_SECONDS or first <= 0:
            return 1.0
        return min(self.second.now(now) / first, 1.0)


@dataclass
class Choice:
    index: int
    reason: str  # affinity, spill, cold, session, fallback or the policy's name
    matched: float  # blocks of the prompt the target is believed to hold
    sent: Sent | None = None  # what the pick added to the target's index (prefix_aware)


@dataclass(slots=True)
class Bounds:
    """One decision's bounds (Router.bounds): the most recent requests and the longest queue
    a target may have to be weighed, and the queue it may have to take a new prefix."""

    now: float
    fresh_for: float
    everyone: bool  # recent requests as the engines counted them (Roster.counted)
    recent_limit: float
    queue_limit: float
    room_limit: float
    conversation: dict[Target, float]  # a chat's own turns over the mean, not counted
    roomy_only: bool = True  # KV caches past KV_FULL are passed over
    bounded: bool = True  # the recent and queue bounds apply

    def load(self, target: Target) -> float:
        return target.in_flight + target.load.others(self.now, self.fresh_for)

    def admits(self, target: Target) -> bool:
        if self.roomy_only and target.load.kv_usage >= KV_FULL:
            return False
        if not self.bounded:
            return True
        now = self.now
        recent = target.everyones_recent(now) if self.everyone else target.recent_share(now)
        recent -= self.conversation.get(target, 0.0)
        return recent + 1 <= self.recent_limit and self.load(target) + 1 <= self.queue_limit

    def has_room(self, target: Target) -> bool:
        return self.load(target) + 1 <= self.room_limit

    def relax(self) -> bool:
        """Where no target is admitted: first without the bounds, then without KV_FULL."""
        if self.bounded:
            self.bounded = False
        elif self.roomy_only:
            self.roomy_only = False
        else:
            return False
        return True


# ================================================================================================
# 10. KV events and the tokenizer
# Holds vLLM's KV events (ZMQ subscriber, HeldBlocks) and the prompt tokenizer that precise routing
# reads prompts with. Uses: 1, 3, 5, 9, 11.
# ================================================================================================


# Prompts up to this many bytes are tokenized on the event loop: a thread's round trip costs
# more than tokenizing them.
INLINE_TOKENS: Final = 16384


class PromptTokenizer:
    """The token ids vLLM computes for a request's prompt: the model's own tokenizer and chat
    template, through transformers as vLLM itself uses them (the [precise] extra)."""

    def __init__(self, tokenizer: Any, path: str = "") -> None:
        self.tokenizer = tokenizer
        self.path = path
        self.encoder = tokenizer.backend_tokenizer  # the Rust one: it releases the GIL
        self.pieces = PromptPieces(self.encoder)

    @classmethod
    def load(cls, path: str) -> PromptTokenizer:
        if not os.path.isdir(path):
            raise ValueError("not a local directory")
        # Its import would say on stderr that PyTorch is missing: only tokenizers are used.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        transformers = importlib.import_module("transformers")
        return cls(transformers.AutoTokenizer.from_pretrained(path, local_files_only=True), path)

    def tokens(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """All of a prompt's ids; None where the request is not one this can tokenize as
        vLLM would."""
        if (prompt := self.text(path, body)) is None:
            return None
        try:
            return [token for ids, _ in self.steps(*prompt) for token in ids]
        except Exception:  # text the tokenizer refuses (a lone surrogate): vLLM answers it
            return None

    def text(self, path: str, body: Mapping[str, Any]) -> tuple[str, bool] | None:
        """The text vLLM tokenizes for this request, and whether with special tokens."""
        try:
            if API_ROUTES[path].chat:
                text = self.chat_text(body)
                special = body.get("add_special_tokens", False)  # vLLM's defaults, per API
            else:
                text, special = body.get("prompt"), body.get("add_special_tokens", True)
                if isinstance(text, list) and text and isinstance(text[0], str):
                    text = text[0]
        except Exception:  # a template that refuses these messages: vLLM answers it, not us
            return None
        if not isinstance(text, str) or not isinstance(special, bool):
            return None
        return text, special

    def steps(self, text: str, special: bool) -> Iterator[tuple[list[int], int]]:
        """The text's ids in order, a step at a time, each with the characters read so far:
        piece by piece where that encodes as the whole does, else whole in one step."""
        if (steps := self.pieces.steps(text, special)) is not None:
            return steps
        whole = self.encoder.encode_batch([text], add_special_tokens=special)[0]
        return iter([(list(whole.ids), len(text))])

    def chat_text(self, body: Mapping[str, Any]) -> Any:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        kwargs = body.get("chat_template_kwargs")
        return self.tokenizer.apply_chat_template(
            [chat_message(m) for m in messages],
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tokenize=False,
            **(kwargs if isinstance(kwargs, dict) else {}),
        )


class TokenReading:
    """A text prompt's token ids, read only as far as routing needs them: up to the first
    block that no engine's KV events say it holds, at every block size the engines use. A
    prompt never seen costs a step (FIRST_STEP), not the whole of it. The rest is read after
    the decision (rest), off the request's path: a chat's next turn then finds this one's
    pieces encoded."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        path: str,
        body: Mapping[str, Any],
        views: list[HeldBlocks],
        seed: int = 0,
    ) -> None:
        self.tokenizer, self.path, self.body = tokenizer, path, body
        self.views = views
        self.seed = seed  # RouteKey.adapter
        self.tokens: list[int] | None = None  # None: not a prompt this can tokenize
        self.chains: dict[int, list[int]] = {view.block_size: [] for view in views}
        self.share = 0.0
        self.steps: Iterator[tuple[list[int], int]] = iter(())

    def read(self) -> None:
        """Runs in a thread for long prompts: the views are only looked up, never iterated."""
        if (prompt := self.tokenizer.text(self.path, self.body)) is None:
            return
        text, special = prompt
        try:
            self.tokens, self.steps = [], self.tokenizer.steps(text, special)
            for ids, read in self.steps:
                self.tokens += ids
                self.share = read / max(len(text), 1)
                for size, chain in self.chains.items():
                    extend_chain(chain, self.tokens, size, self.seed)
                if self.past_held():
                    return
        except Exception:  # text the tokenizer refuses (a lone surrogate): vLLM answers it
            self.tokens, self.steps = None, iter(())
            return
        self.share = 1.0

    def past_held(self) -> bool:
        for view in self.views:
            chain = self.chains[view.block_size]
            if not chain or chain[-1] in view.chains:
                return False
        return True

    def key(self, route: RouteKey) -> RouteKey:
        if self.tokens is None:
            return route
        # The reading is done with its chains (rest() only encodes pieces): the key takes
        # them as they are. A share of 0 (an empty prompt: its special tokens only) would
        # divide by zero in token_blocks.
        share = max(self.share, 1e-3)
        return dataclasses.replace(
            route, tokens=self.tokens, token_chains=self.chains, token_share=share
        )

    def rest(self) -> None:
        with contextlib.suppress(Exception):  # what read() could encode, this can
            for _ in self.steps:  # each encoded piece is remembered
                pass


# vLLM's KV event fields by position, for publishers that send events as arrays (older vLLM;
# now they are maps with a "type"): the order of its classes' fields, those after medium
# optional.
STORED_FIELDS: Final = ("block_hashes", "parent_block_hash", "token_ids", "block_size")


EVENT_FIELDS: Final = {
    "BlockStored": (*STORED_FIELDS, "lora_id", "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


# What a request reuses: blocks on the GPU (an offloaded copy is not), of the first KV cache group.
GPU_MEDIA: Final = (None, "GPU")


FIRST_GROUP: Final = (None, 0)


# HeldBlocks.chains' values: a chain's position in its prompt times this, plus how many of
# vLLM's blocks have it.
POSITION: Final = 1 << 32


class HeldBlocks:
    """The blocks an engine's KV events say it holds, keyed by a chain hash of their token ids
    (token_chain), not by vLLM's own block hash: that one depends on the engine's
    PYTHONHASHSEED and hash algorithm, and a request's tokens must be hashed to match.

    Its work per block is what following many engines costs (bench_routing --scale-events):
    a hash and a few dict operations for each, with nothing else that a loop in C (zip, map,
    accumulate) can do instead. Its dicts hold ints only, which the garbage collector never
    tracks: with a tuple per block, a full collection and the young ones after it walked every
    view, on the event loop (0.36 s at 512 engines)."""

    def __init__(self) -> None:
        self.chains: dict[int, int] = {}  # chain hash -> position * POSITION + count
        self.known: dict[object, int] = {}  # vLLM's hash -> chain hash
        self.block_size = 0
        self.unplaced = 0  # blocks whose parent this process never heard of
        self.stored_total = 0  # blocks it ever newly held: what turned its cache over
        # The router's reverse index, shared by a stage's engines (attach): chain hash -> a bit
        # per engine that holds it, so that a decision need not ask every engine.
        self.holders: dict[int, int] | None = None
        self.bit = 0  # this engine's bit in holders, a power of two

    def __len__(self) -> int:
        return len(self.known)

    def match(self, chain: Sequence[int]) -> int:
        return leading(chain, self.chains)

    def apply(self, event: object) -> None:
        """One event of a batch as msgpack decodes it untyped (a list or a map); ValueError for
        one that is not what vLLM sends."""
        if isinstance(event, list) and event and event[0] in EVENT_FIELDS:
            kind, event = event[0], dict(zip(EVENT_FIELDS[event[0]], event[1:], strict=False))
        elif isinstance(event, dict) and event.get("type") in EVENT_FIELDS:
            kind = event["type"]
        else:
            raise ValueError(f"not a KV cache event: {str(event)[:80]}")
        if event.get("medium") not in GPU_MEDIA or event.get("group_idx") not in FIRST_GROUP:
            return  # an offloaded copy, or another KV cache group: not what a request reuses
        try:
            if kind == "AllBlocksCleared":
                self.clear()
            elif kind == "BlockRemoved":
                self.removed(event["block_hashes"])
            elif not event.get("lora_id") or event.get("lora_name"):
                # A LoRA's blocks serve only requests that name it (by name: an id alone,
                # as older vLLM sends, names none a request could).
                self.stored(
                    event["parent_block_hash"], event["block_hashes"], event["token_ids"],
                    event["block_size"], event.get("extra_keys") or (), event.get("lora_name"),
                )  # fmt: skip
        except (KeyError, TypeError, AttributeError) as missing:
            raise ValueError(f"{kind} without a usable {missing}") from None

    def take(self, events: Iterable[Any]) -> list[str]:
        """A batch's events as kv_batch_decoder types them: apply's work without its checks,
        which msgspec made. What is wrong with an event is returned, the others applied."""
        problems: list[str] = []
        evicted: list[object] = []  # vLLM sends a BlockRemoved per block: one call for a run
        for event in events:
            if event.medium not in GPU_MEDIA or event.group_idx not in FIRST_GROUP:
                continue
            if event.removes:
                evicted += event.block_hashes
                continue
            if evicted:
                self.removed(evicted)
                evicted = []
            if not event.stores:
                self.clear()
            elif not event.lora_id or event.lora_name:
                try:
                    self.stored(
                        event.parent_block_hash, event.block_hashes, event.token_ids,
                        event.block_size, event.extra_keys or (), event.lora_name,
                    )  # fmt: skip
                except ValueError as error:
                    problems.append(str(error))
        if evicted:
            self.removed(evicted)
        return problems

    def stored(
        self,
        parent: object,
        hashes: Sequence[object],
        tokens: Sequence[int],
        size: int,
        extra_keys: Sequence[object] = (),
        lora_name: str | None = None,
    ) -> None:
        if not isinstance(size, int) or size <= 0 or not isinstance(tokens, list):
            raise ValueError(f"BlockStored with block_size {size!r}")
        if size < self.block_size:
            # A partial entry: where the engine hashes finer than it caches (vLLM's
            # hash_block_size, hybrid models), a prompt's tail block is also published at
            # the finer grain. Requests match whole cache blocks only.
            return
        if size > self.block_size > 0:
            self.clear()  # all it said before was such partial entries
            self.block_size = size
        if parent is None:
            chain, position = adapter_seed(lora_name), 0
        elif (parent_chain := self.known.get(parent)) is not None:
            chain, position = parent_chain, self.chains[parent_chain] // POSITION + 1
        else:
            self.unplaced += len(hashes)
            return
        self.block_size = size
        if extra_keys and extra_keys.count(None) < len(extra_keys):
            # Images or a cache salt from this block on: only requests with the same match it.
            hashes = hashes[: next(i for i, key in enumerate(extra_keys) if key is not None)]
        # Whole blocks only (a partial one is not matched), hashed and chained as token_chain
        # does: one iterator zipped with itself gives tuples of ``size`` ids.
        blocks = zip(itertools.count(position), zip(*[iter(tokens)] * size, strict=False))
        chained = itertools.accumulate(map(hash, blocks), operator.xor, initial=chain)
        next(chained)
        firsts = itertools.count(position * POSITION + 1, POSITION)  # each block's value, held once
        known, chains, holders, bit = self.known, self.chains, self.holders, self.bit
        new = 0
        # As many as there are hashes and whole blocks, whichever are fewer.
        for block_hash, chain, first in zip(hashes, chained, firsts, strict=False):
            if block_hash in known:
                continue  # held already: vLLM may report a reused block again
            known[block_hash] = chain
            new += 1
            if count := chains.get(chain, 0):
                chains[chain] = count + 1
            else:
                chains[chain] = first
                # add_holder, inline: this runs for every block of every engine.
                if holders is not None and (mask := holders.setdefault(chain, bit)) is not bit:
                    holders[chain] = mask | bit
        self.stored_total += new

    def removed(self, hashes: Iterable[object]) -> None:
        known, chains, holders, bit = self.known, self.chains, self.holders, self.bit
        for block_hash in hashes:
            if (chain := known.pop(block_hash, None)) is None:
                continue
            if (count := chains[chain] - 1) % POSITION:
                chains[chain] = count
            else:
                del chains[chain]
                # remove_holder, inline: this runs for every block of every engine.
                if (
                    holders is not None
                    and (mask := holders.pop(chain, 0)) is not bit
                    and (rest := mask & ~bit)
                ):
                    holders[chain] = rest

    def clear(self) -> None:
        self.release()  # still attached: what it holds from now on is carried again
        self.chains.clear()
        self.known.clear()

    def attach(self, holders: dict[int, int] | None, bit: int) -> None:
        """Carry ``bit`` in ``holders`` for every chain held, from now on, and no longer in the
        dict attached before; None detaches."""
        self.release()
        self.holders, self.bit = holders, bit
        if holders is not None:
            for chain in self.chains:
                add_holder(holders, chain, bit)

    def release(self) -> None:
        """This engine's bit out of holders, for every chain it holds."""
        if (holders := self.holders) is not None:
            for chain in self.chains:
                remove_holder(holders, chain, self.bit)


def kv_batch_decoder() -> Callable[[bytes], object]:
    """A msgpack batch as take_kv_batch applies it: typed by msgspec where it is as vLLM sends
    it ([ts, events, dp_rank], the events as maps, or as arrays from older vLLM), which is
    quicker to decode and to apply than lists and dicts; anything else (a batch as a map, an
    event that is not what vLLM sends) untyped, for HeldBlocks.apply to take event by event.
    Needs msgspec (the [precise] extra)."""
    import msgspec

    def batch_of(events: Any) -> Callable[[bytes], object]:
        # defstruct: the events are local names, which postponed annotations cannot resolve.
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
            ("ts", float), ("events", list[events]), ("data_parallel_rank", Any, None),
        ]  # fmt: skip
        batch = msgspec.defstruct("KvEventBatch", fields, array_like=True, gc=False)
        return msgspec.msgpack.Decoder(batch).decode

    as_maps, as_arrays = (batch_of(events) for events in kv_event_types())
    untyped = msgspec.msgpack.Decoder().decode

    def decode(payload: bytes) -> object:
        for typed in (as_maps, as_arrays):
            with contextlib.suppress(msgspec.ValidationError):
                return typed(payload)
        return untyped(payload)

    return decode


def kv_event_types() -> tuple[Any, Any]:
    """vLLM's KV cache events as msgspec types for HeldBlocks.take: as maps with a "type" (vLLM
    0.32), and as arrays led by it (older vLLM)."""
    import msgspec

    class Event(msgspec.Struct, gc=False):
        """What HeldBlocks.take does with one (no fields here: they would come first)."""

        removes: ClassVar[bool] = False
        stores: ClassVar[bool] = False

    class BlockStored(Event, tag="BlockStored"):
        # vLLM's fields in its order, as older vLLM sends them in an array; those it added
        # after group_idx are of no use here, and ignored.
        stores = True
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None = None
        medium: str | None = None
        lora_name: str | None = None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

    class BlockRemoved(Event, tag="BlockRemoved"):
        removes = True
        block_hashes: list[int | bytes]
        medium: str | None = None
        group_idx: int | None = None

    class AllBlocksCleared(Event, tag="AllBlocksCleared"):
        medium: str | None = None
        group_idx: int | None = None

    class StoredArray(BlockStored, array_like=True):
        pass

    class RemovedArray(BlockRemoved, array_like=True):
        pass

    class ClearedArray(AllBlocksCleared, array_like=True):
        pass

    return BlockStored | BlockRemoved | AllBlocksCleared, StoredArray | RemovedArray | ClearedArray


class KvFeed:
    """One engine's KV event stream (vLLM's ZMQ publisher) and what it says the engine holds.

    Until the engine has published something, its blocks are unknown and routing estimates
    them (PrefixIndex): an idle engine and a wrong port look alike from here.
    """

    def __init__(self, endpoint: str, replay: str | None) -> None:
        self.endpoint = endpoint
        self.replay = replay
        self.held = HeldBlocks()
        self.next_seq: int | None = None
        self.heard_at = -math.inf  # monotonic
        self.engine_id: str | None = None  # a prefill engine's: a new one means a restart
        self.batches = 0
        self.gaps = 0  # sequence numbers never received, not even by replay
        self.problem: str | None = None  # the last malformed message or failed replay
        self.logged: set[str] = set()  # kinds of problem logged: each once
        self.joining = False  # replaying what the engine said before this process listened
        self.replayed = range(0)  # what that replay applied: the live stream repeats some of it
        self.replay_paused_until = -math.inf  # monotonic; see REPLAY_PAUSE
        # The tokens it stored lately, every sender's: how fast its cache turns over.
        self.written = Decayed()

    def may_replay(self) -> bool:
        return time.monotonic() >= self.replay_paused_until

    @property
    def live(self) -> bool:
        return self.batches > 0 and not self.joining

    def restarted(self, why: str) -> None:
        if self.held:
            log.info("KV events %s: %s, its blocks are forgotten", self.endpoint, why)
        self.held.clear()
        self.held.block_size = 0  # it may have come back with another

    def status(self, now: float) -> dict[str, Any]:
        if self.joining:
            source = f"estimate (catching up on the replay of {self.replay})"
        elif not self.live:
            source = f"estimate (no KV events yet from {self.endpoint})"
        else:
            source = f"kv events ({self.endpoint}, last {now - self.heard_at:.1f} s ago)"
        status = {"kv_source": source, "kv_blocks": len(self.held), "kv_event_gaps": self.gaps}
        return status | {"kv_event_problem": self.problem}


# Batches a subscriber keeps while it falls behind; beyond them ZMQ drops, and the gap in the
# sequence numbers is asked for again (replay) or counted.
KV_EVENTS_HWM: Final = 100_000


# Seconds for a replay socket to answer each batch: a busy engine's publisher thread answers
# between its work (real vLLM on 2 loaded cores took over a second). Only this engine's events
# wait meanwhile, never a request.
REPLAY_TIMEOUT: Final = 10.0


REPLAY_SLICE: Final = 32  # replayed batches applied between two turns of the event loop


# Seconds of silence after a replay's batches began that mean the rest was dropped: vLLM sends
# a replay all at once, and its ROUTER drops what its queue cannot hold when the reader lags.
# The rest is asked for again, from where it stopped.
REPLAY_STALL: Final = 2.0


# After a replay that did not answer, gaps are counted as missed for this long instead of
# asked for again: each ask would hold this engine's live events back for REPLAY_TIMEOUT.
REPLAY_PAUSE: Final = 30.0


async def watch_kv_events(app: web.Application) -> None:
    """With --kv-events-port, follow every engine's KV event stream, each in a task of its
    own, as discovery adds them. Nothing here is on a request's path: a slow or dead
    publisher only leaves its engine's view as it was (and estimated until it speaks)."""
    state = app[STATE_KEY]
    fleet = state.fleet
    try:
        import zmq.asyncio

        decode = kv_batch_decoder()
    except ImportError as missing:
        log.warning(
            "routing on KV events needs the precise extra, pip install '.[precise]' in the "
            "proxy's source tree (%s); "
            "what each engine holds is estimated instead", missing,
        )  # fmt: skip
        return
    context = zmq.asyncio.Context()
    followed: dict[KvFeed, asyncio.Task[None]] = {}
    try:
        async with asyncio.TaskGroup() as tasks:
            while True:
                fleet.feeds_changed.clear()
                feeds = set(fleet.feeds.values())
                for feed in feeds - followed.keys():
                    followed[feed] = tasks.create_task(follow_kv_feed(state, feed, context, decode))
                for feed in followed.keys() - feeds:  # its instance left the fleet
                    followed.pop(feed).cancel()
                await fleet.feeds_changed.wait()
    finally:
        context.destroy(linger=0)


async def follow_kv_feed(
    state: ProxyState, feed: KvFeed, context: Any, decode: Callable[[bytes], Any]
) -> None:
    """Subscribe to one engine's events (ZMQ PUB: topic, 8-byte sequence number, msgpack
    batch) and apply them in order; ZMQ reconnects by itself when the engine comes back."""
    import zmq

    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.setsockopt(zmq.RCVHWM, KV_EVENTS_HWM)
    subscriber.setsockopt(zmq.IPV6, 1)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(feed.endpoint)
    try:
        if feed.replay:
            # Catch up on what the engine said before this process listened now, not when it
            # next speaks: that is when traffic comes, and a full buffer takes a while.
            await replay_kv_events(state, feed, context, decode, None)
        while True:
            frames = await subscriber.recv_multipart()
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise ValueError(f"{len(frames)} frames, not topic, sequence and batch")
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq in feed.replayed:
                    continue  # published while we caught up, and the replay had it too
                feed.replayed = range(0)
                if feed.next_seq is not None and seq < feed.next_seq:
                    feed.restarted("its sequence numbers started again")
                    feed.next_seq = None
                # A gap, or joining an engine that was already publishing (this proxy, or
                # the engine, started again): what it said before is in its replay buffer.
                if feed.replay and seq > (feed.next_seq or 0) and feed.may_replay():
                    await replay_kv_events(state, feed, context, decode, seq)
                take_kv_batch(state, feed, seq, decode(frames[2]))
            except Exception as error:  # msgspec's DecodeError is a ValueError
                kv_feed_problem(state, feed, "batch", f"malformed batch ignored: {error}")
    except Exception as error:  # a bug must not stop the other feeds
        log.error("KV events %s: following stopped: %r", feed.endpoint, error)
    finally:
        subscriber.close(linger=0)


def take_kv_batch(state: ProxyState, feed: KvFeed, seq: int, batch: object) -> None:
    """Apply one batch ([ts, events, dp_rank]), as kv_batch_decoder typed it or as msgpack
    decodes it untyped; what was skipped before it counts as missed."""
    typed: list[Any] | None = getattr(batch, "events", None)
    events = untyped_events(batch) if typed is None else typed
    if feed.next_seq is not None and seq > feed.next_seq:
        missed = seq - feed.next_seq
        feed.gaps += missed
        state.metrics.kv_event_batches.labels("missed").inc(missed)
        kv_feed_problem(state, feed, "missed", f"{missed} batch(es) missed", count=False)
    feed.next_seq = seq + 1
    stored_before = feed.held.stored_total
    if typed is not None:
        for problem in feed.held.take(typed):
            kv_feed_problem(state, feed, "event", f"malformed event ignored: {problem}")
    else:
        for event in events:
            try:
                feed.held.apply(event)
            except (ValueError, KeyError, TypeError, IndexError) as error:
                kv_feed_problem(state, feed, "event", f"malformed event ignored: {error}")
    feed.batches += 1
    feed.heard_at = time.monotonic()
    if not feed.joining:  # a join's replay tells what was written before, not lately
        stored = feed.held.stored_total - stored_before
        feed.written.add(feed.heard_at, stored * feed.held.block_size)
    state.metrics.kv_event_batches.labels("applied").inc()


def untyped_events(batch: object) -> list[object]:
    if isinstance(batch, dict):  # a map, where vLLM's EventBatch is no longer array-like
        batch = [batch.get("ts"), batch.get("events")]
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        raise ValueError("a batch is [timestamp, events, ...]")
    return cast(list[object], batch[1])


def kv_feed_problem(
    state: ProxyState, feed: KvFeed, kind: str, problem: str, count: bool = True
) -> None:
    """Logged once while it repeats: a publisher that sends garbage must not flood the log."""
    if count:
        state.metrics.kv_event_batches.labels("malformed").inc()
    if kind not in feed.logged:
        feed.logged.add(kind)
        log.warning(
            "KV events %s: %s (logged once; /healthcheck shows the last)", feed.endpoint, problem
        )
    feed.problem = problem


async def replay_kv_events(
    state: ProxyState,
    feed: KvFeed,
    context: Any,
    decode: Callable[[bytes], Any],
    upto: int | None,
) -> None:
    """Ask the engine's replay socket (a ROUTER) for the batches from feed.next_seq (before
    ``upto``, a live batch's seq; None when joining as this process subscribes); it answers
    each as (topic, seq, batch), then a sequence number of -1. An answer whose tail was
    dropped on the way is asked for again from where it stopped. Joining, an engine that is
    not up yet is no problem: its first batch will bring us here."""
    import zmq

    joining = upto is None
    if joining:  # from here (or from the oldest batch kept: take_replay) to where it ends
        feed.replayed = range(feed.next_seq or 0, feed.next_seq or 0)
    # Joining, the engine may replay thousands of batches: until they are applied its view is
    # not used, and other work gets the loop between every few of them.
    feed.joining = feed.next_seq is None
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IPV6, 1)
    # vLLM sends the whole buffer at once (10,000 batches by default), and its ROUTER drops
    # what exceeds its queue (1,000) while we read slower than it sends; ZMQ's I/O thread
    # takes them all in here, our reading pace aside. Dropped, the batches were missed
    # again, and the end marker with them (take_replay's stall asks for them again).
    dealer.setsockopt(zmq.RCVHWM, KV_EVENTS_HWM)
    dealer.connect(feed.replay)
    try:
        while True:
            start = feed.next_seq or 0  # None: from the oldest batch it kept
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            if await take_replay(state, feed, dealer, decode, upto):
                return
    except TimeoutError:
        feed.replay_paused_until = time.monotonic() + REPLAY_PAUSE
        if not joining:
            problem = f"replay {feed.replay} did not answer"
            kv_feed_problem(state, feed, "replay", problem, count=False)
    finally:
        feed.joining = False
        if joining and feed.next_seq is not None:  # the live stream repeats some of these
            feed.replayed = range(feed.replayed.start, feed.next_seq)
        dealer.close(linger=0)


async def take_replay(
    state: ProxyState, feed: KvFeed, dealer: Any, decode: Callable[[bytes], Any], upto: int | None
) -> bool:
    """Apply one replay answer's batches: True at its end marker, False if it fell silent
    for REPLAY_STALL after some came (its tail was dropped); TimeoutError if none came."""
    wait, applied = REPLAY_TIMEOUT, 0
    while True:
        try:
            # Not asyncio.wait_for: on 3.11 it swallows a cancel that comes as the answer does.
            async with asyncio.timeout(wait):
                frames = await dealer.recv_multipart()
        except TimeoutError:
            if wait == REPLAY_TIMEOUT:
                raise
            return False
        seq = int.from_bytes(frames[2], "big", signed=True) if len(frames) == 4 else -1
        if seq < 0:
            return True
        wait = REPLAY_STALL
        if (upto is not None and seq >= upto) or (
            feed.next_seq is not None and seq < feed.next_seq
        ):
            continue
        if feed.next_seq is None:  # joining: from the oldest batch kept, none missed
            feed.next_seq, feed.replayed = seq, range(seq, seq)
        take_kv_batch(state, feed, seq, decode(frames[3]))
        if (applied := applied + 1) % REPLAY_SLICE == 0:
            await asyncio.sleep(0)


async def watch_tokenizer(app: web.Application) -> None:
    """Load the model's tokenizer for routing text prompts on KV events: --tokenizer, or the
    root a prefill's /v1/models names, once one answers, if that is a local directory."""
    state = app[STATE_KEY]
    path = state.config.tokenizer
    while path is None:
        if (path := await model_root(state)) is None:
            await asyncio.sleep(state.config.discovery_interval)
    try:
        state.tokenizer = await asyncio.to_thread(PromptTokenizer.load, path)
    except Exception as error:
        log.warning(
            "no tokenizer in %r (%s): text prompts are routed on estimates (--tokenizer names "
            "the model's tokenizer directory)", path, error,
        )  # fmt: skip
        return
    log.info("text prompts are tokenized with %s for routing on KV events", path)


async def model_root(state: ProxyState) -> str | None:
    """The ``root`` of the first model a usable prefill's /v1/models lists."""
    limits = state.config.upstream_timeout(state.config.health_timeout)
    for instance in state.fleet.prefills:
        if not instance.usable:
            continue
        with contextlib.suppress(CheckFailed, ValueError, LookupError, TypeError):
            page = await get_checked(
                state.health_session, "models", instance.routes["/v1/models"], limits
            )
            root = json.loads(page)["data"][0].get("root")
            return root if isinstance(root, str) else None
    return None


# ================================================================================================
# 11. The fleet: instances, discovery, health and load
# Holds the instances (PrefillInstance, DecodeInstance), their serving groups per model (Serving:
# where a request's claims are made), health checks, discovery (DNS, bootstrap), load scraping,
# the proof that each decode pulls its KV, and the PD self-test (a request down each pair).
# Uses: 1-6, 9-10.
# ================================================================================================


def _in_flight(target: Target) -> int:
    return target.in_flight


def route_urls(base: URL) -> dict[str, URL]:
    # Built once per instance so the hot path never parses or joins a URL.
    paths = (*PD_PATHS, "/v1/models", "/health", "/metrics")
    return {path: base.with_path(path) for path in paths}


@dataclass(frozen=True, slots=True, eq=False)
class Served:
    """The models an instance serves, as its ``/v1/models`` lists them: each id with its card
    (for the proxy's own /v1/models) and its ``parent``, the base model of a LoRA adapter.

    ``model`` is the first base model: what the instance runs (further base ids are aliases
    of it, vLLM's --served-model-name), and the routing group its targets belong to."""

    cards: tuple[dict[str, Any], ...]
    parents: dict[str, str | None]  # id -> parent (None for a base model)
    model: str

    def __contains__(self, model: object) -> bool:
        return model in self.parents


def parse_served(payload: object) -> Served:
    """A /v1/models answer as vLLM writes it; ValueError naming what is wrong with another."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("no list of models in its data")
    cards = tuple(card for card in data if isinstance(card, dict))
    parents: dict[str, str | None] = {}
    for card in cards:
        model, parent = card.get("id"), card.get("parent")
        if not isinstance(model, str) or not isinstance(parent, str | None):
            raise ValueError(f"a model card without a string id: {str(card)[:80]}")
        parents.setdefault(model, parent)
    model = next((m for m, parent in parents.items() if parent is None), None)
    if model is None:
        raise ValueError("no base model listed")
    return Served(cards, parents, model)


class Fleet:
    """The instances the configuration and DNS name, which of them are usable, and what is in
    flight on each.

    Membership changes as one step (set_members): an instance that joins is usable once its
    checks pass; one that leaves takes no new request once another of its role is usable
    (never a gap: until then it serves on) and is let go when its last request ended.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.index_blocks = config.prefix_index_blocks
        # Every engine's KV event stream by endpoint, with --kv-events-port; watch_kv_events
        # follows each one there is.
        self.feeds: dict[str, KvFeed] = {}
        self.feeds_changed = asyncio.Event()
        self.prefills = tuple(PrefillInstance(spec) for spec in config.prefills)
        self.decodes = tuple(DecodeInstance(url, self.index_blocks) for url in config.decodes)
        for decode in self.decodes:
            decode.feed = self.feed_for(decode.url, 0)
        # Set when an instance joins or may be let go: watch_fleet starts and stops checks.
        self.changed = asyncio.Event()
        # Usable targets in configuration order; prefill engines are every (instance, DP rank)
        # pair, the seed's rotation. Rebuilt on every change, read without locks.
        self._engines: tuple[PrefillEngine, ...] = ()
        self._by_name: tuple[tuple[PrefillEngine, ...], dict[str, PrefillEngine]] = ((), {})
        self._decodes: tuple[DecodeInstance, ...] = ()
        # The roles in a panic, each with the routing groups (Backend.model) in one there:
        # a panic is judged per group, as the group is where a request may go (unless_panic).
        self.panics: dict[str, set[str]] = {}
        # A Router per stage and routing group: the instances that run one model (Served.model;
        # "" while unknown). A target is in one group's Roster, whose reverse indexes it feeds;
        # a request names a model, and is routed in its group (serving).
        self.routers: dict[tuple[str, str], Router] = {}
        self.observe: Callable[[str, Choice, RouteKey | None], None] | None = None  # metrics
        self.tell: Callable[[Target, RouteKey, float], None] | None = None  # --peer
        # Where each model's requests go, rebuilt with the rotation (regroup); ``None`` for a
        # request that names none, and for any model while no instance's models are known.
        self._serving: dict[str | None, Serving] = {}
        self._anything: Serving | None = None
        self.prefill_policy, self.decode_policy = config.policies
        # Prompt bytes per token, learnt from the prefills' answers: sizes the indexes by the
        # engines' KV capacity, which /metrics gives in tokens.
        self.bytes_per_token = 4.0
        self.regroup()

    def engines_by_name(self) -> dict[str, PrefillEngine]:
        """The usable prefill engines by Target.name, the same in every replica (--peer)."""
        engines, named = self._by_name
        if engines is not self._engines:
            named = {engine.name: engine for engine in self._engines}
            self._by_name = (self._engines, named)
        return named

    def configure(self, config: ProxyConfig) -> None:
        """A reloaded configuration's routing settings (members come with set_members)."""
        self.config = config
        self.prefill_policy, self.decode_policy = config.policies
        for (stage, _), router in self.routers.items():
            self.tune(router, stage)

    def tune(self, router: Router, stage: str) -> None:
        config = self.config
        router.load_weight = (
            config.prefill_load_weight if stage == "prefill" else config.decode_load_weight
        )
        router.balance, router.fresh_for = config.balance_factor, config.load_fresh_for
        router.policy = config.policies[0 if stage == "prefill" else 1]
        router.observe = self.observe
        router.tell = self.tell if stage == "prefill" else None

    def router(self, stage: str, group: str) -> Router:
        """The stage's Router for a routing group (Backend.model), made at its first use."""
        if (router := self.routers.get((stage, group))) is None:
            config = self.config
            router = self.routers[stage, group] = Router(stage, 1.0, config.balance_factor, 0.0)
            self.tune(router, stage)
        return router

    @property
    def prefill_router(self) -> Router:
        """The Router of the requests that name no model (of every request, with one model)."""
        return self.serving(None).prefill_router

    @property
    def decode_router(self) -> Router:
        return self.serving(None).decode_router

    def router_of(self, target: Target) -> Router:
        """The Router whose Roster holds ``target``: its instance's group's."""
        if isinstance(target, PrefillEngine):
            return self.router("prefill", target.instance.model)
        return self.router("decode", cast(DecodeInstance, target).model)

    def set_members(
        self, prefills: Sequence[PrefillSpec], decodes: Sequence[URL], origins: Mapping[URL, str]
    ) -> None:
        """The instances there are now: the ones not there yet join, the ones missing leave.
        ``origins`` says where each was named (a flag, the file, a DNS name)."""
        specs = {spec.url: spec for spec in prefills}
        for instance in self.prefills:
            if (spec := specs.pop(instance.url, None)) is None:
                self.leave(instance)
            else:
                self.stay(instance, origins)
                if spec.bootstrap != instance.spec.bootstrap:
                    log.info("prefill %s: bootstrap now %s", instance.url, spec.bootstrap_addr)
                    instance.move_bootstrap(spec)
        urls = dict.fromkeys(decodes)
        for decode in self.decodes:
            if decode.url in urls:
                del urls[decode.url]
                self.stay(decode, origins)
            else:
                self.leave(decode)
        joining: list[Backend] = [PrefillInstance(spec) for spec in specs.values()]
        joining += [DecodeInstance(url, self.index_blocks) for url in urls]
        for backend in joining:
            backend.origin = origins.get(backend.url, "")
            log.info("%s %s joins (%s): usable once its checks pass", *backend.named)
            if isinstance(backend, DecodeInstance):
                backend.feed = self.feed_for(backend.url, 0)
        self.prefills += tuple(b for b in joining if isinstance(b, PrefillInstance))
        self.decodes += tuple(b for b in joining if isinstance(b, DecodeInstance))
        self.refresh()
        self.changed.set()

    def leave(self, backend: Backend) -> None:
        if not backend.leaving:
            backend.leaving = True
            log.info(
                "%s %s leaves (%s): no new requests once another %s is usable, gone when its "
                "%d in flight have ended",
                *backend.named, backend.role, backend.in_flight,
            )  # fmt: skip

    def stay(self, backend: Backend, origins: Mapping[URL, str]) -> None:
        backend.origin = origins.get(backend.url, backend.origin)
        if backend.leaving:
            backend.leaving = False
            log.info("%s %s stays (%s)", *backend.named)
            self.refresh()

    def let_go(self) -> list[Backend]:
        """Leaving instances out of the rotation with nothing in flight: they are gone now."""
        serving = {*(engine.instance for engine in self._engines), *self._decodes}
        gone = [
            backend
            for backend in (*self.prefills, *self.decodes)
            if backend.leaving and backend not in serving and not backend.in_flight
        ]
        if not gone:
            return gone
        self.prefills = tuple(p for p in self.prefills if p not in gone)
        self.decodes = tuple(d for d in self.decodes if d not in gone)
        for backend in gone:
            log.info("%s %s has left the fleet", backend.role, backend.url)
            targets: Sequence[Target] = ()
            if isinstance(backend, PrefillInstance):
                targets = backend.engines
            elif isinstance(backend, DecodeInstance):
                targets = (backend,)
            for target in targets:
                if target.feed is not None:
                    self.feeds.pop(target.feed.endpoint, None)
                    self.feeds_changed.set()
        return gone

    @property
    def routes_by_prefix(self) -> bool:
        return Policy.PREFIX_AWARE in (self.prefill_policy, self.decode_policy)

    @property
    def ready(self) -> bool:
        return bool(self._engines) and bool(self._decodes)

    @property
    def engine_count(self) -> int:
        return len(self._engines)

    def refresh(self) -> None:
        prefills = self.unless_panic("prefill", self.prefills)
        engines = tuple(itertools.chain.from_iterable(p.engines for p in prefills))
        decodes = self.unless_panic("decode", self.decodes)
        # Kept where nothing changed: a router sums its targets again for a new tuple.
        self._engines = self._engines if engines == self._engines else engines
        self._decodes = self._decodes if decodes == self._decodes else decodes
        self.regroup()
        if any(backend.leaving for backend in (*self.prefills, *self.decodes)):
            self.changed.set()  # one may be let go now

    def regroup(self) -> None:
        """Each routing group's Roster takes its targets: those new to the fleet join routing,
        those no longer in it (an engine that restarted is a new one) or gone to another
        group (a new model) leave it. Then where each model's requests go (serving)."""
        groups: dict[tuple[str, str], set[Target]] = {key: set() for key in self.routers}
        for instance in self.prefills:
            groups.setdefault(("prefill", instance.model), set()).update(instance.engines)
        for decode in self.decodes:
            groups.setdefault(("decode", decode.model), set()).add(decode)
        for (stage, group), targets in groups.items():
            self.router(stage, group).roster.enlist(targets)
            if not targets and group:
                del self.routers[stage, group]  # a model no instance runs any more
        self._serving, self._anything = self.views()

    def views(self) -> tuple[dict[str | None, Serving], Serving | None]:
        """Where each model's requests go (serving_of), and a request that names none: to the
        model of the first prefill, as vLLM takes its first. While some instance's models are
        not known, it serves whatever is asked, as before the proxy knew models: the view of
        every usable target, for the models no known instance lists and those naming none."""
        backends = (*self.prefills, *self.decodes)
        models = dict.fromkeys(m for b in backends if b.served for m in b.served.parents)
        views: dict[str | None, Serving] = {model: self.serving_of(model) for model in models}
        if views and all(b.served is not None for b in backends):
            first = next((p.model for p in self.prefills if p.model in views), next(iter(models)))
            views[None] = views[first]
            return views, None
        routers = (self.router("prefill", ""), self.router("decode", ""))
        views[None] = anything = Serving(self._engines, self._decodes, *routers)
        return views, anything

    def serving_of(self, model: str) -> Serving:
        """Where requests for ``model`` go: the usable targets that serve it, in the routing
        group of the instances that run it (where several groups list it, as an alias, the
        largest). The tuples of its view before, or the fleet's, where they are the same: a
        Router re-reads a new tuple whole."""
        prefill_group = largest_group(p for p in self.prefills if p.served and model in p.served)
        decode_group = largest_group(d for d in self.decodes if d.served and model in d.served)
        engines = tuple(
            e for e in self._engines
            if e.instance.model == prefill_group and e.instance.serves(model)
        )  # fmt: skip
        decodes = tuple(d for d in self._decodes if d.model == decode_group and d.serves(model))
        before = self._serving.get(model)
        for earlier in (self._engines, before.engines if before else ()):
            engines = earlier if engines == earlier else engines
        for earlier_decodes in (self._decodes, before.decodes if before else ()):
            decodes = earlier_decodes if decodes == earlier_decodes else decodes
        parent = next(
            (b.served.parents[model] for b in (*self.prefills, *self.decodes)
             if b.served is not None and model in b.served),
            None,
        )  # fmt: skip
        return Serving(
            engines, decodes, self.router("prefill", prefill_group),
            self.router("decode", decode_group), model, model if parent is not None else None,
        )  # fmt: skip

    def serving(self, model: str | None) -> Serving:
        """Where a request for ``model`` goes; vLLM's 404 for a model no instance serves."""
        if (view := self._serving.get(model)) is not None:
            return view
        if self._anything is not None:
            return self._anything
        bases = (m for m, card in self.known_models().items() if card.get("parent") is None)
        raise unknown_model(str(model), bases)

    def known_models(self) -> dict[str, dict[str, Any]]:
        """Every model some instance lists, with its card (the first instance's)."""
        cards: dict[str, dict[str, Any]] = {}
        for backend in (*self.decodes, *self.prefills):
            for card in backend.served.cards if backend.served is not None else ():
                cards.setdefault(card["id"], card)
        return cards

    def unless_panic(self, role: str, backends: Sequence[B]) -> tuple[B, ...]:
        """The role's instances that take requests, in their order: group by group (the
        instances that run one model, Backend.model), those in the rotation and, in the
        group's panic, those out only because their checks timed out (panic_takes). Per
        group, as a request can go to its model's group only: one model's decodes all timing
        out is that model's outage, however well the other models' do."""
        groups: dict[str, list[B]] = {}
        for backend in backends:
            groups.setdefault(backend.model, []).append(backend)
        before, panicking = self.panics.pop(role, set()), set()
        taking: set[B] = set()
        for group, members in groups.items():
            usable = in_rotation(members)
            slow = panic_takes(members, usable, self.config.panic_threshold)
            taking.update(usable + slow)
            if slow:
                panicking.add(group)
            if bool(slow) != (group in before):  # a group gone to another model ends silently
                say_panic(role, group if len(groups) > 1 else None, slow)
        if panicking:
            self.panics[role] = panicking
        return tuple(backend for backend in backends if backend in taking)

    def set_engines(self, instance: PrefillInstance, engine_ids: Sequence[str]) -> None:
        engines = []
        for rank, engine_id in enumerate(engine_ids):
            engine = PrefillEngine(instance, rank, engine_id, self.index_blocks)
            engine.feed = self.feed_for(instance.url, rank, engine_id)
            engines.append(engine)
        instance.engines = tuple(engines)
        self.refresh()

    def feed_for(self, url: URL, rank: int, engine_id: str | None = None) -> KvFeed | None:
        """The KV event stream of an instance's DP rank, if it is configured; an engine id
        other than the last one it carried means a restart: the blocks it held are gone."""
        if (source := self.config.kv_event_source(url)) is None:
            return None
        endpoint, replay = source.of_rank(rank)
        if (feed := self.feeds.get(endpoint)) is None:
            feed = self.feeds[endpoint] = KvFeed(endpoint, replay)
            self.feeds_changed.set()
        if engine_id is not None:
            if feed.engine_id not in (None, engine_id):
                feed.restarted(f"engine id {engine_id} is new")
            feed.engine_id = engine_id
        return feed

    @property
    def hears_kv_events(self) -> bool:
        """Whether any engine has published KV events: only then are prompts tokenized."""
        return any(feed.live for feed in self.feeds.values())

    def kv_views(self) -> list[HeldBlocks]:
        """What the engines that publish KV events hold, as they say."""
        return [f.held for f in self.feeds.values() if f.live and f.held.block_size > 0]

    def take_out(self, backend: Backend, error: str) -> None:
        """A live request could not reach ``backend``: out of the rotation at once (and out of
        a panic's: it is no longer only slow)."""
        if backend.connection_refused(error):
            log.warning("%s %s left the rotation: %s", backend.role, backend.url, error)
        self.refresh()

    def claim_prefill(
        self,
        avoid: Collection[Backend] = (),
        key: RouteKey | None = None,
        model: str | None = None,
        sends: list[Sent] | None = None,
    ) -> PrefillEngine:
        """From ``model``'s serving group (Serving.claim_prefill)."""
        return self.serving(model).claim_prefill(avoid, key, sends)

    def release_prefill(self, engine: PrefillEngine) -> None:
        self.router_of(engine).release(engine)
        engine.instance.in_flight -= 1
        if engine.instance.leaving:
            self.changed.set()

    def claim_decode(
        self,
        avoid: Collection[Backend] = (),
        key: RouteKey | None = None,
        model: str | None = None,
        sends: list[Sent] | None = None,
    ) -> DecodeInstance:
        """From ``model``'s serving group (Serving.claim_decode)."""
        return self.serving(model).claim_decode(avoid, key, sends)

    def release_decode(self, decode: DecodeInstance) -> None:
        self.router_of(decode).release(decode)
        if decode.leaving:
            self.changed.set()

    def take_back(self, sends: list[Sent]) -> None:
        """A request's prompt was refused (a leg's 4xx before any token): no instance cached
        it, so what its picks added to the indexes goes: else a prompt that can never be
        served would draw the next ones that share its head where nothing of it is, and hold
        its blocks (a 50 MB prompt: an index's 65,536)."""
        for sent in sends:
            sent.index.take_back(sent)
        sends.clear()

    def learn_bytes_per_token(self, prompt_bytes: int, prompt_tokens: int) -> None:
        if prompt_tokens > 0 and prompt_bytes > 0:
            self.bytes_per_token += (prompt_bytes / prompt_tokens - self.bytes_per_token) / 16


def parse_engine_ids(payload: object) -> tuple[str, ...]:
    """Engine ids by DP rank from a bootstrap ``/query`` answer; () means "not registered yet".

    Raises ValueError, naming what is wrong, for an answer that is not the expected shape.
    """
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object of ranks, got {type(payload).__name__}")
    ranks: dict[int, str] = {}
    for key, entry in payload.items():
        if not (isinstance(key, str) and key.isdigit()):
            continue  # not a rank: newer builds may add fields of their own
        engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"rank {key} has no string engine_id")
        ranks[int(key)] = engine_id
    if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"ranks must be contiguous from 0, got {sorted(ranks)}")
    return tuple(ranks[rank] for rank in range(len(ranks)))


class CheckFailed(ValueError):
    """A health check or discovery failed; the message says why."""

    def __init__(
        self, message: str, *, no_answer_in_time: bool = False, unreachable: bool = False
    ) -> None:
        super().__init__(message)
        # Connected, but the answer took longer than --health-timeout: maybe only busy.
        self.no_answer_in_time = no_answer_in_time
        # Not reached at all (unresolvable, refused): while it lasts, checks back off. An
        # instance that answers "not yet" is starting, and is checked at the quick pace.
        self.unreachable = unreachable


def check_error(stage: str, url: URL, error: BaseException) -> CheckFailed:
    failure = transport_error(stage, url, error)
    slow = isinstance(error, TimeoutError) and not isinstance(error, aiohttp.ConnectionTimeoutError)
    unreachable = isinstance(failure, Unreachable)
    return CheckFailed(failure.message, no_answer_in_time=slow, unreachable=unreachable)


async def get_checked(
    session: aiohttp.ClientSession,
    stage: str,
    url: URL,
    limits: aiohttp.ClientTimeout,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """GET for a check: the body of a 2xx answer, else CheckFailed saying why not."""
    try:
        async with session.get(url, timeout=limits, headers=headers) as answer:
            body = await answer.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        raise check_error(stage, url, error) from None
    if answer.status == 503 and stage == "bootstrap":
        raise CheckFailed(f"bootstrap {url}: topology is not ready yet (503)")
    if not 200 <= answer.status < 300:
        raise CheckFailed(f"{stage} {url} answered {answer.status}")
    return body


async def check_health(
    session: aiohttp.ClientSession, backend: Backend, limits: aiohttp.ClientTimeout
) -> None:
    """vLLM's ``GET /health``: 2xx when its engine is alive; raises CheckFailed saying why not."""
    await get_checked(session, "health check", backend.routes["/health"], limits)


async def query_engine_ids(
    session: aiohttp.ClientSession, instance: PrefillInstance, limits: aiohttp.ClientTimeout
) -> tuple[str, ...]:
    """Wait for the prefill API to be healthy, then read its engines from the bootstrap."""
    # Workers register before the API server listens: a healthy API means a full answer.
    await check_health(session, instance, limits)
    raw = await get_checked(session, "bootstrap", instance.query_url, limits)
    try:
        engine_ids = parse_engine_ids(json.loads(raw))
    except ValueError as error:
        raise CheckFailed(f"bootstrap {instance.query_url}: {error}") from None
    if not engine_ids:
        raise CheckFailed(f"bootstrap {instance.query_url}: no DP rank registered yet")
    return engine_ids


async def check_backend(app: web.Application, backend: Backend) -> None:
    """One health check; moves the backend in or out of the rotation and says so once."""
    state = app[STATE_KEY]
    config, fleet, session = state.config, state.fleet, state.health_session
    limits = config.upstream_timeout(config.health_timeout)
    previous_check, backend.checked_at = backend.checked_at, time.monotonic()
    try:
        if isinstance(backend, PrefillInstance):
            engine_ids = await query_engine_ids(session, backend, limits)
        else:
            await check_health(session, backend, limits)
    except CheckFailed as failure:
        count_failed_check(state, backend, failure, previous_check)
        return
    backend.same_failures, backend.timed_out = 0, False
    if backend.slow:
        backend.slow = False
        log.info("%s %s answers its checks in time again", backend.role, backend.url)
    if isinstance(backend, PrefillInstance) and engine_ids != backend.engine_ids:
        if backend.engines:
            state.metrics.engine_id_changes.labels(str(backend.url)).inc()
            log.warning(
                "prefill %s engine ids changed (restarted?): %s -> %s",
                *(backend.url, ", ".join(backend.engine_ids), ", ".join(engine_ids)),
            )
            backend.lost_all("restarted (new engine ids)")
        # Swapped in one assignment: no request after this names an old engine id.
        fleet.set_engines(backend, engine_ids)
    await learn_models(state, backend, limits)
    if backend.check_passed(config.healthy_after):
        fleet.refresh()
        extra = ""
        if isinstance(backend, PrefillInstance):
            extra = (
                f": {len(backend.engines)} DP rank(s), engine ids {', '.join(backend.engine_ids)}"
            )
        log.info("%s %s is usable%s", backend.role, backend.url, extra)


async def learn_models(state: ProxyState, backend: Backend, limits: aiohttp.ClientTimeout) -> None:
    """What the instance serves, read from its /v1/models at every passing check, so that a
    LoRA adapter loaded or unloaded there counts within --health-interval. A page that cannot
    be read keeps what was known, and does not fail the check: routing by model is a
    refinement of health, not part of it."""
    headers: dict[str, str] = {}
    if authorization := upstream_authorization({}, state.config):
        headers[hdrs.AUTHORIZATION] = authorization
    url = backend.routes["/v1/models"]
    try:
        page = await get_checked(state.health_session, "models", url, limits, headers)
        served = parse_served(json.loads(page))
    except ValueError as error:  # CheckFailed among them
        if str(error) != backend.models_error:
            known = "keeps the models it was known for" if backend.served else "serves any model"
            log.warning("%s %s: models unknown (%s): it %s", *backend.named[:2], error, known)
        backend.models_error = str(error)
        return
    backend.models_error = None
    # What it serves, not its cards: vLLM stamps those anew (created, permission) every time.
    if backend.served is None or served.parents != backend.served.parents:
        log.info("%s %s serves %s", backend.role, backend.url, ", ".join(served.parents))
        backend.served = served
        state.fleet.refresh()


def count_failed_check(
    state: ProxyState, backend: Backend, failure: CheckFailed, previous_check: float
) -> None:
    """A failed check: counted, and the instance out of the rotation once enough failed (not
    for a check that only timed out while its requests succeed)."""
    error = str(failure)
    repeated = error == backend.last_error
    if failure.unreachable:
        backend.same_failures = backend.same_failures + 1 if repeated else 1
    else:
        backend.same_failures = 0
    state.metrics.check_failures.labels(backend.role, str(backend.url)).inc()
    if backend.timed_out != failure.no_answer_in_time:
        backend.timed_out = failure.no_answer_in_time
        state.fleet.refresh()  # whether it may take requests in a panic changed
    if failure.no_answer_in_time and backend.usable and backend.last_success > previous_check:
        # Envoy's outlier detection weighs real outcomes: requests that keep succeeding
        # outvote a probe that timed out. A refusal, a 5xx or silence still count.
        if not backend.slow:
            log.warning(
                "%s %s is slow: %s, but its requests succeed; it stays in the rotation",
                *(backend.role, backend.url, error),
            )
        backend.slow, backend.last_error = True, error
        return
    if backend.check_failed(error, state.config.unhealthy_after):
        log.warning("%s %s left the rotation: %s", backend.role, backend.url, error)
        state.fleet.refresh()
    elif not repeated:
        log.warning("%s %s check failed: %s", backend.role, backend.url, error)


def check_interval(config: ProxyConfig, backend: Backend) -> float:
    """Calm while usable; quick while out, doubling while it stays unreachable the same way
    (an unresolvable host, a refused port) up to the usable instances' pace."""
    if backend.usable:
        return config.health_interval
    slowest = max(config.health_interval, config.discovery_interval)
    return min(config.discovery_interval * 2.0 ** max(backend.same_failures - 1, 0), slowest)


async def watch_backend(app: web.Application, backend: Backend) -> None:
    """Check one instance forever: often while it is out of the rotation, calmly while in."""
    config = app[STATE_KEY].config
    while True:
        backend.recheck.clear()
        try:
            await check_backend(app, backend)
        except Exception:  # a bug must not end the checks of this instance
            log.exception("checking %s %s failed", backend.role, backend.url)
        ended, backend.checked = backend.checked, asyncio.Event()
        ended.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(check_interval(config, backend)):
                await backend.recheck.wait()


# vLLM's /metrics series read for load: one per engine (the "engine" label is the DP rank).
LOAD_SERIES: Final = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:request_success_total": "finished",
}


ENGINE_LABEL: Final = re.compile(r'[{,]engine="(\d+)"')


# Where a decode's prompt tokens came from (vllm:prompt_tokens_by_source_total's source), read
# as the series TransferProof takes: pulled over Mooncake, or computed there.
PROMPT_SOURCES: Final = {
    'source="external_kv_transfer"': "pulled",
    'source="local_compute"': "computed",
}


# One engine's KV cache in tokens: with DP, num_gpu_blocks counts every rank's blocks.
KV_TOKENS_LABEL: Final = re.compile(r'kv_cache_size_tokens="(\d+)"')


def parse_vllm_load(page: str) -> tuple[dict[int, dict[str, float]], int | None]:
    """Per engine (DP rank), the load series of a vLLM /metrics page; and the KV cache size of
    one engine in tokens, where vllm:cache_config_info says it."""
    engines: dict[int, dict[str, float]] = {}
    capacity = None
    for line in page.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if name == "vllm:cache_config_info":
            if found := KV_TOKENS_LABEL.search(rest):
                capacity = int(found[1])
            continue
        if name == "vllm:prompt_tokens_by_source_total":
            series = next((v for k, v in PROMPT_SOURCES.items() if k in rest), None)
        else:
            series = LOAD_SERIES.get(name)
        if series is None:
            continue
        labels, _, value = rest.rpartition("}")
        engine = ENGINE_LABEL.search("{" + labels)
        with contextlib.suppress(ValueError, IndexError):
            sample = engines.setdefault(int(engine[1]) if engine else 0, {})
            sample[series] = sample.get(series, 0.0) + float(value.split()[0])
    return engines, capacity


def take_load(
    target: Target, sample: Mapping[str, float], now: float, capacity: int, tokens: int
) -> None:
    view = target.load
    queries = sample.get("prefix_queries", 0.0)
    if queries < view.prefix_queries:
        target.index.clear()  # the counter went back: the engine restarted, its cache is empty
    view.running, view.waiting = sample.get("running", 0.0), sample.get("waiting", 0.0)
    view.kv_usage, view.prefix_queries = sample.get("kv_usage", 0.0), queries
    view.took(sample.get("finished"), now, target.recent_share(now))
    view.scraped_at, view.ours_at_scrape = now, target.in_flight
    target.index.capacity, target.kv_tokens = capacity, tokens


async def scrape_load(state: ProxyState, backend: Backend) -> None:
    """One scrape of an instance's /metrics into its targets' load views."""
    config, fleet = state.config, state.fleet
    limits = config.upstream_timeout(config.health_timeout)
    sent = backend.proof.asked() if isinstance(backend, DecodeInstance) else (0, 0.0)
    try:
        page = await get_checked(
            state.health_session, "metrics", backend.routes["/metrics"], limits
        )
    except CheckFailed as failure:
        state.metrics.check_failures.labels(backend.role, str(backend.url)).inc()
        if backend.load_error is None:
            log.info("%s %s gives no load: %s", backend.role, backend.url, failure)
        backend.load_error = str(failure)
        return
    backend.load_error = None
    engines, tokens = parse_vllm_load(page.decode("utf-8", "replace"))
    capacity = fleet.index_blocks
    if tokens:  # the index holds what the engine's KV cache can, in the proxy's blocks
        blocks = int(tokens * fleet.bytes_per_token / config.prefix_block_bytes)
        capacity = max(16, min(capacity, blocks))
    now = time.monotonic()
    if isinstance(backend, PrefillInstance):
        for engine in backend.engines:
            take_load(engine, engines.get(engine.dp_rank, {}), now, capacity, tokens or 0)
    elif isinstance(backend, DecodeInstance):
        total = whole_instance(engines)  # a decode is one target, whatever its DP size
        take_load(backend, total, now, capacity, tokens or 0)
        take_proof(backend, total, sent, state.config.avoid_recomputing)


def whole_instance(engines: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """parse_vllm_load's series summed over an instance's engines (DP ranks)."""
    total: dict[str, float] = {}
    for sample in engines.values():
        for series, value in sample.items():
            total[series] = total.get(series, 0.0) + value
    return total


# The usage a completion, chat or generate answer ends with, as vLLM 0.32 writes it (UsageInfo
# in its field order; a stream's without null fields): prompt_tokens, and cached_tokens where
# the decode runs with --enable-prompt-tokens-details.
USAGE_CACHED: Final = re.compile(
    rb'"usage":\s*\{\s*"prompt_tokens":\s*(\d+)(?:\s*,\s*"(?:total|completion)_tokens":\s*\d+)*'
    rb'(?:\s*,\s*"prompt_tokens_details":\s*(?:null|\{\s*"cached_tokens":\s*(\d+|null)))?'
)


def answer_prompt_cache(tail: bytes) -> tuple[int, int | None] | None:
    """(prompt_tokens, cached_tokens) of the usage in an answer's last bytes, cached_tokens
    None where the decode does not report them; None where there is no usage there."""
    if (at := tail.rfind(b'"usage":')) < 0 or (match := USAGE_CACHED.match(tail, at)) is None:
        return None
    cached = match.group(2)
    return int(match.group(1)), None if cached in (None, b"null") else int(cached)


def take_proof(
    decode: DecodeInstance, sample: Mapping[str, float], sent: tuple[int, float], avoid: bool
) -> None:
    """A decode's prompt sources at a scrape, and what it had been sent as the scrape was
    asked for, into its TransferProof; a line when it starts or stops computing what it
    should pull."""
    if "pulled" not in sample or "computed" not in sample:
        return  # a vLLM without the series: nothing to tell by (healthcheck's null)
    turned = decode.proof.take(sample["pulled"], sample["computed"], sent)
    share = decode.proof.pulled_share
    if turned:
        log.warning(
            "decode %s computes the prompts it should pull over Mooncake: %.0f%% of the PD "
            "prompt tokens since its last scrape were pulled (a failed pull under "
            "kv_load_failure_policy recompute, or a KV connector that does not pull)%s",
            decode.url, 100 * (share or 0.0),
            "; passed over for PD requests while another decode is left "
            "(--avoid-recomputing)" if avoid else "",
        )  # fmt: skip
    elif turned is False:
        log.warning("decode %s pulls its PD prompts again (%.0f%%)", decode.url, 100 * (share or 0))


async def watch_load(app: web.Application) -> None:
    """Scrape every usable instance's /metrics, side by side, every --load-interval: with
    prefix_aware routing, the load every proxy process and replica sees alike; and the
    decodes' always, for the proof that they pull their KV (TransferProof)."""
    state = app[STATE_KEY]
    fleet = state.fleet
    while True:
        started = time.monotonic()
        scraped = (*fleet.prefills, *fleet.decodes) if fleet.routes_by_prefix else fleet.decodes
        usable = [b for b in scraped if b.usable]
        for outcome in await asyncio.gather(
            *(scrape_load(state, b) for b in usable), return_exceptions=True
        ):
            if isinstance(outcome, Exception):  # a bug must not end the scrapes
                log.error("scraping load failed: %r", outcome)
        for router in fleet.routers.values():
            router.rescan()
        await asyncio.sleep(max(0.0, state.config.load_interval - (time.monotonic() - started)))


# --- The PD self-test: one tiny request per prefill engine and decode, down the real PD path
#
# A new cluster, or one after a change, shows at once which pairs move KV and which do not:
# each pair's answer and the decode's own counters say whether the prompt's KV was pulled,
# computed again (a failed pull under kv_load_failure_policy "recompute"), or failed (an
# unknown engine id, a bootstrap the decode cannot reach, a leg refused).

SELF_TEST_PROMPT: Final = "mooncake-proxy self-test: this prompt's KV is pulled over Mooncake"
# A pair whose decode waits for KV that never comes would hold the test for the KV timeout.
SELF_TEST_TIMEOUT: Final = 60.0


@dataclass(frozen=True, slots=True)
class PairCheck:
    """How one prefill engine and one decode did in the self-test."""

    prefill: str  # the instance's URL
    dp_rank: int
    decode: str
    ok: bool
    why: str  # "pulled", or what went wrong
    seconds: float


@dataclass(frozen=True, slots=True)
class SelfTest:
    at: float  # wall time it ended
    pairs: tuple[PairCheck, ...]

    def status(self) -> dict[str, Any]:
        return {
            "at": datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds"),
            "ok": all(pair.ok for pair in self.pairs),
            "pairs": [dataclasses.asdict(pair) for pair in self.pairs],
        }


async def self_test(state: ProxyState) -> SelfTest:
    """Every usable prefill engine with every usable decode of its model: a decode's pairs one
    after another (its counters tell one request from the next), the decodes side by side.
    Kept for /healthcheck and the metrics; a line for each pair that does not move KV."""
    fleet = state.fleet

    async def pairs_of(decode: DecodeInstance) -> list[PairCheck]:
        engines = [
            engine
            for instance in fleet.prefills
            if instance.usable and instance.model == decode.model
            for engine in instance.engines
        ]
        return [await check_pair(state, engine, decode) for engine in engines]

    found = await asyncio.gather(*(pairs_of(d) for d in fleet.decodes if d.usable))
    result = SelfTest(time.time(), tuple(itertools.chain.from_iterable(found)))
    for pair in result.pairs:
        if not pair.ok:
            log.warning(
                "self-test: prefill %s rank %d and decode %s do not move KV: %s",
                pair.prefill, pair.dp_rank, pair.decode, pair.why,
            )  # fmt: skip
    moved = sum(pair.ok for pair in result.pairs)
    log.info("self-test: %d of %d pairs move KV", moved, len(result.pairs))
    state.self_test = result
    return result


async def check_pair(state: ProxyState, engine: PrefillEngine, decode: DecodeInstance) -> PairCheck:
    started = time.monotonic()
    try:
        why = await pair_moves_kv(state, engine, decode)
    except CheckFailed as failure:
        why = str(failure)
    seconds = round(time.monotonic() - started, 3)
    url = str(engine.instance.url)
    return PairCheck(url, engine.dp_rank, str(decode.url), why == "pulled", why, seconds)


async def pair_moves_kv(state: ProxyState, engine: PrefillEngine, decode: DecodeInstance) -> str:
    """One PD request of a few tokens to this pair, both legs at once as for a client: "pulled"
    if the decode's counters say it pulled the prompt, else why not (CheckFailed for a leg
    that failed)."""
    before = await prompt_sources(state, decode)
    request_id = mint_request_id("self-test")
    transfer_id = transfer_id_for(request_id)
    body = {"model": decode.model or engine.instance.model, "max_tokens": 2, "temperature": 0}
    body["prompt"] = f"{SELF_TEST_PROMPT} {request_id}"  # nothing of it cached anywhere
    headers = upstream_headers({}, request_id, state.config)
    prefill_leg = self_test_leg(
        state, engine.instance.routes[COMPLETIONS_API.path], prefill_body(body, transfer_id),
        headers | {DP_RANK_HEADER: str(engine.dp_rank)},
        f"prefill {engine.url} rank {engine.dp_rank}",
    )  # fmt: skip
    decode_leg = self_test_leg(
        state, decode.routes[COMPLETIONS_API.path], decode_body(body, engine, transfer_id), headers,
        f"decode {decode.url}",
    )  # fmt: skip
    answer = (await asyncio.gather(prefill_leg, decode_leg))[1]
    after = await prompt_sources(state, decode)
    if before is None or after is None:
        return "pulled" if prompt_cached(answer) else "answered; its decode gives no counters"
    pulled, computed = after[0] - before[0], after[1] - before[1]
    if pulled > 0 and pulled >= computed:
        return "pulled"
    return (
        f"the decode computed the prompt itself ({computed:.0f} tokens, {pulled:.0f} pulled): "
        "its pull failed under kv_load_failure_policy recompute (its log says why)"
    )


async def self_test_leg(
    state: ProxyState, url: URL, body: Mapping[str, Any], headers: Mapping[str, str], named: str
) -> dict[str, Any]:
    """One leg's answer; CheckFailed naming the leg where it could not be had."""
    limits = state.config.upstream_timeout(SELF_TEST_TIMEOUT)
    try:
        async with state.health_session.post(
            url, json=body, headers=headers, timeout=limits
        ) as answer:
            raw = await answer.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        raise check_error(named, url, error) from None
    if answer.status != 200:
        said = raw[:200].decode("utf-8", "replace")
        raise CheckFailed(f"{named} answered {answer.status}: {said}")
    try:
        payload = json.loads(raw)
    except ValueError:
        raise CheckFailed(f"{named} answered with no JSON") from None
    return payload if isinstance(payload, dict) else {}


def prompt_cached(answer: Mapping[str, Any]) -> bool:
    """Whether a decode's answer says its whole prompt was cached when it came (vLLM's
    cached_tokens, with --enable-prompt-tokens-details): pulled, as the self-test's prompt is
    new."""
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return isinstance(cached, int) and pulled_whole(usage.get("prompt_tokens") or 0, cached)


async def prompt_sources(state: ProxyState, decode: DecodeInstance) -> tuple[float, float] | None:
    """A decode's prompt tokens pulled and computed so far, by its /metrics; None where it
    does not say (or cannot be read)."""
    limits = state.config.upstream_timeout(state.config.health_timeout)
    try:
        page = await get_checked(state.health_session, "metrics", decode.routes["/metrics"], limits)
    except CheckFailed:
        return None
    total = whole_instance(parse_vllm_load(page.decode("utf-8", "replace"))[0])
    if "pulled" not in total and "computed" not in total:
        return None
    return total.get("pulled", 0.0), total.get("computed", 0.0)


async def self_test_at_start(app: web.Application) -> None:
    """The self-test once, as soon as PD requests are first served."""
    state = app[STATE_KEY]
    while not state.serving:
        await asyncio.sleep(0.5)
    await self_test(state)


# --- Replicas told of each other's sends (--peer)
#
# A replica learns what the others sent an engine from the engine's /metrics, up to
# --load-interval late, and where from KV events once the prefill ran, or never (the
# estimate); between two scrapes, replicas that read the same one send new requests to the
# same engines, each within the recent-share bound on its own, and the next scrape finds them
# over it: the chats' next turns then move. Told of every send as it goes, replicas route as
# one. A datagram lost costs only that: the next scrape counts the send anyway.

PEER_FLUSH_SECONDS: Final = 0.01  # sends batched this long before they are told


PEER_DATAGRAM_BYTES: Final = 8192  # sends per datagram up to this size (one at the least)


# A send's leading blocks told: the prompt's head, where its relatives match it. Keeps a send
# within about 1.5 KB; the rest of a long prompt a peer learns from KV events, or not.
PEER_CHAIN_BLOCKS: Final = 64


class Peers(asyncio.DatagramProtocol):
    """This process's side of --peer: its sends told to every peer address, theirs
    remembered as its own (Router.heard): each send's engine, its uncached blocks, its
    chain's head and its chat turns. Datagrams from an address no --peer name has are
    ignored, and so are this process's own, come back through a name that includes it."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.id = os.urandom(8).hex()
        self.pending: list[bytes] = []
        self.addresses: dict[DnsName, tuple[str, ...]] = {}
        self.transport: asyncio.DatagramTransport | None = None
        self.told = self.heard = self.ignored = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def tell(self, target: Target, key: RouteKey, uncached: float) -> None:
        send = [target.name, round(uncached, 1), key.chain[:PEER_CHAIN_BLOCKS], key.turn]
        self.pending.append(json.dumps([*send, key.earlier_turns]).encode())

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if not any(addr[0] in found for found in self.addresses.values()):
            self.ignored += 1
            return
        try:
            message = json.loads(data)
            replica, sends = message["replica"], message["sends"]
            named = self.state.fleet.engines_by_name()
            heard = [told_send(send, named) for send in sends]
        except (ValueError, TypeError, KeyError):
            self.ignored += 1
            return
        if replica == self.id:
            return
        fleet = self.state.fleet
        for engine, key, uncached in (send for send in heard if send is not None):
            fleet.router_of(engine).heard(engine, key, uncached)
            self.heard += 1

    def flush(self) -> None:
        sends, self.pending = self.pending, []
        if self.transport is None or not sends:
            return
        head = b'{"replica": "' + self.id.encode() + b'", "sends": ['
        batch: list[bytes] = []
        for send in [*sends, b""]:
            size = len(head) + sum(len(s) + 1 for s in batch) + len(send)
            if batch and (not send or size > PEER_DATAGRAM_BYTES):
                self.send_to_all(head + b",".join(batch) + b"]}")
                batch = []
            if send:
                batch.append(send)
        self.told += len(sends)

    def send_to_all(self, data: bytes) -> None:
        assert self.transport is not None
        for name, found in self.addresses.items():
            for address in found:
                self.transport.sendto(data, (address, name.port))

    def status(self) -> dict[str, Any]:
        addresses = sorted(f"{a}:{n.port}" for n, found in self.addresses.items() for a in found)
        return {"addresses": addresses, "told": self.told, "heard": self.heard,
                "ignored": self.ignored}  # fmt: skip


def told_send(
    send: Any, named: Mapping[str, PrefillEngine]
) -> tuple[PrefillEngine, RouteKey, float] | None:
    """A peer's send as Peers.tell wrote it, checked; None for an engine not usable here.
    Raises ValueError for one that is not such a send."""
    name, uncached, chain, turn, earlier = send
    numbers = [*chain, turn, *earlier]
    if not all(type(n) is int and -(1 << 63) <= n <= MASK64 for n in numbers):
        raise ValueError("a send's blocks and turns are 64-bit numbers")
    if type(uncached) not in (int, float) or not 0 <= uncached <= 1e6 or len(earlier) > 64:
        raise ValueError("not a send")
    if (engine := named.get(name)) is None:
        return None
    key = RouteKey(0, list(chain), 0, False, turn, tuple(earlier))
    return engine, key, float(uncached)


async def peers_ctx(app: web.Application) -> AsyncIterator[None]:
    """With --peer: the UDP socket on the proxy's own port (each --workers process shares it,
    and a datagram reaches one of them), the sends told every PEER_FLUSH_SECONDS, the names
    looked up every --dns-interval."""
    state = app[STATE_KEY]
    config = state.config
    if not config.peers:
        yield
        return
    peers = state.peers = Peers(state)
    loop = asyncio.get_running_loop()
    where = (config.host, config.port)
    try:
        await loop.create_datagram_endpoint(
            lambda: peers, local_addr=where, reuse_port=config.workers > 1
        )
    except OSError as error:  # it still tells its own sends, from another port
        log.error("--peer: cannot hear peers on UDP %s:%d: %s", *where, error.strerror or error)
        await loop.create_datagram_endpoint(lambda: peers, local_addr=(config.host, 0))
    state.fleet.tell = peers.tell
    state.fleet.configure(state.fleet.config)  # every prefill Router tells the peers its sends
    tasks = [asyncio.create_task(tell_peers(peers)), asyncio.create_task(look_up_peers(peers))]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        state.fleet.tell = None
        state.fleet.configure(state.fleet.config)
        if peers.transport is not None:
            peers.transport.close()


async def tell_peers(peers: Peers) -> None:
    while True:
        await asyncio.sleep(PEER_FLUSH_SECONDS)
        peers.flush()


async def look_up_peers(peers: Peers) -> None:
    """A name that fails to resolve keeps its last answer, as --prefill-dns names do."""
    while True:
        config = peers.state.config
        for name in config.peers:
            try:
                peers.addresses[name] = await look_up(name, config)
            except (OSError, TimeoutError) as error:
                log.warning("--peer %s: lookup failed: %s", name, error)
        await asyncio.sleep(config.dns_interval)


async def watch_dns(app: web.Application) -> None:
    """Look up every --prefill-dns and --decode-dns name each --dns-interval, and at once
    after a reload: each address is an instance; one that is no longer there leaves the fleet
    as a removed instance does. A lookup that fails keeps the name's last good answer."""
    state = app[STATE_KEY]
    while True:
        state.dns_changed.clear()
        config = state.config
        names = config.dns_names
        outcomes = await asyncio.gather(
            *(look_up(name, config) for name in names), return_exceptions=True
        )
        changed = [
            take_dns_answer(state, name, outcome)
            for name, outcome in zip(names, outcomes, strict=True)
            if name in state.config.dns_names  # not reloaded away meanwhile
        ]
        if any(changed):
            state.sync_members()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(config.dns_interval if names else None):
                await state.dns_changed.wait()


def take_dns_answer(
    state: ProxyState, name: DnsName, outcome: tuple[str, ...] | BaseException
) -> bool:
    """Keep a lookup's answer, or the last good one if it failed; True if the answer changed."""
    if isinstance(outcome, BaseException):
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
        reason = failure_detail(outcome)
        if isinstance(outcome, TimeoutError):
            reason = f"no answer within {state.config.health_timeout:g} s (--health-timeout)"
        if name not in state.dns_errors:  # once, until it answers again
            kept = ", ".join(state.dns_answers.get(name, ())) or "none"
            log.warning("DNS %s: lookup failed (%s); its last answer stays: %s", name, reason, kept)
        state.dns_errors[name] = reason
        return False
    if state.dns_errors.pop(name, None) is not None:
        log.info("DNS %s answers again", name)
    if state.dns_answers.get(name) == outcome:
        return False
    state.dns_answers[name] = outcome
    log.info("DNS %s: %s", name, ", ".join(outcome) or "no addresses")
    return True


# getaddrinfo's answers for a name that exists with no address, or does not exist.
NO_ADDRESS_ERRORS: Final = frozenset(
    {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
)


async def look_up(name: DnsName, config: ProxyConfig) -> tuple[str, ...]:
    async with asyncio.timeout(config.health_timeout):
        return await resolve(name.name, config.dns_server)


async def resolve(name: str, server: DnsServer | None) -> tuple[str, ...]:
    """The A and AAAA addresses of ``name``, sorted; () when it has none (no such name, no
    records). Raises when no answer came: a failing server, no resolver."""
    if server is not None:
        return await ask_dns_server(name, server)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno in NO_ADDRESS_ERRORS:
            return ()
        raise
    families = (socket.AF_INET, socket.AF_INET6)
    return tuple(sorted({str(info[4][0]) for info in infos if info[0] in families}))


async def ask_dns_server(name: str, server: DnsServer) -> tuple[str, ...]:
    """A and AAAA records from one given server (dnspython: the system's resolver cannot be
    pointed at another server)."""
    import dns.asyncresolver
    import dns.resolver

    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers, resolver.port = [server.host], server.port
    resolver.cache = None  # every interval asks anew
    addresses: set[str] = set()
    for record_type in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, record_type, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        addresses.update(str(record.address) for record in answer)
    return tuple(sorted(addresses))


async def watch_fleet(app: web.Application) -> None:
    """Check every instance in a task of its own, side by side (one slow or dead host never
    delays the others), from when it joins the fleet until it is let go."""
    state = app[STATE_KEY]
    fleet = state.fleet
    checks: dict[Backend, asyncio.Task[None]] = {}
    try:
        while True:
            fleet.changed.clear()
            state.metrics.forget(fleet.let_go())
            members = {*fleet.prefills, *fleet.decodes}
            for backend in members - checks.keys():
                checks[backend] = asyncio.create_task(watch_backend(app, backend))
            for backend in checks.keys() - members:
                checks.pop(backend).cancel()
            await fleet.changed.wait()
    finally:
        for task in checks.values():
            task.cancel()
        await asyncio.gather(*checks.values(), return_exceptions=True)


class PrefillEngine(Target):
    """One data-parallel rank of a prefill instance: what a decode names as its KV source.

    A restart brings new engine ids and so new PrefillEngines: what the old ones were believed
    to hold is gone with them.
    """

    def __init__(
        self, instance: PrefillInstance, dp_rank: int, engine_id: str, capacity: int = 65536
    ) -> None:
        super().__init__(f"{instance.url}#{dp_rank}", capacity)
        self.instance = instance
        self.dp_rank = dp_rank
        self.engine_id = engine_id

    def __repr__(self) -> str:
        return f"PrefillEngine({self.name}, {self.engine_id})"

    @property
    def url(self) -> URL:
        return self.instance.url

    @property
    def bootstrap_addr(self) -> str:
        return self.instance.spec.bootstrap_addr

    def status(self, now: float) -> dict[str, Any]:
        state = {"dp_rank": self.dp_rank, "engine_id": self.engine_id, "in_flight": self.in_flight}
        return state | self.routing_status(now)


def in_rotation(backends: Sequence[B]) -> tuple[B, ...]:
    """The usable ones, but those leaving only while no other is: a reload never opens a gap."""
    usable = tuple(backend for backend in backends if backend.usable)
    return tuple(backend for backend in usable if not backend.leaving) or usable


def panic_takes(backends: Sequence[B], usable: Sequence[B], threshold: float) -> tuple[B, ...]:
    """The instances of a routing group that take requests only in its panic, as Envoy's panic
    threshold has it: those out only because their checks timed out, while fewer than
    ``threshold`` of the group (``usable`` of ``backends``), or none, are usable; () when it
    is not in one. When most of a fleet fails its checks at once it is more often loaded (or
    the checks' path is) than down, and taking it all out would turn a slowdown into an
    outage."""
    slow = tuple(b for b in backends if not b.usable and b.timed_out and not b.leaving)
    if slow and (not usable or len(usable) < threshold * len(backends)):
        return slow
    return ()


def say_panic(role: str, model: str | None, slow: Sequence[Backend]) -> None:
    """Log a panic's start (``slow``: who takes requests in it) or end (none); ``model``: the
    group's, where the role's instances run several."""
    which = f"{role} panic" if model is None else f"{role} panic (model {model or 'not known'})"
    if slow:
        names = ", ".join(str(backend.url) for backend in slow)
        log.warning("%s: too few usable; sending to those that are slow: %s", which, names)
    else:
        log.warning("%s over", which)


def choose_index(
    candidates: Sequence[T], turn: Iterator[int], policy: Policy, load: Callable[[T], int]
) -> int:
    """Round robin, or the least loaded with ties broken round robin.

    The rotation advances on every pick either way, so requests arriving together spread
    over equally loaded targets instead of piling onto the first.
    """
    count = len(candidates)
    best = next(turn) % count
    if policy is Policy.ROUND_ROBIN:
        return best
    best_load = load(candidates[best])
    for offset in range(1, count):
        if best_load == 0:
            break
        candidate = (best + offset) % count
        if (candidate_load := load(candidates[candidate])) < best_load:
            best, best_load = candidate, candidate_load
    return best


def largest_group(backends: Iterable[Backend]) -> str:
    """The model most of ``backends`` run (Backend.model), the first one's on a tie."""
    counts = collections.Counter(backend.model for backend in backends)
    return max(counts, key=counts.__getitem__) if counts else ""


def unknown_model(model: str, known: Iterable[str]) -> ProxyError:
    """vLLM's own answer to a model it does not serve (its _check_model), for the fleet."""
    message = f"The model `{model}` does not exist. Valid aliases: {', '.join(known)}."
    # Written as vLLM writes it (Starlette's compact JSON): a client sees the same bytes.
    body = json.dumps(error_body(404, message, "model"), separators=(",", ":"), ensure_ascii=False)
    return ProxyError(404, message, param="model", body=body.encode(), reason="unknown_model")


class Backend:
    """An upstream instance's place in the rotation, moved by health checks and refusals.

    It leaves at once when a live request finds its port refused, or after ``unhealthy_after``
    failed checks in a row; it comes back after ``healthy_after`` good checks.
    """

    role: ClassVar[str]

    def __init__(self, url: URL) -> None:
        self.url = url
        self.routes = route_urls(url)
        self.usable = False
        self.since = time.time()
        self.last_error: str | None = None
        self.failures = 0
        self.passes = 0
        self.in_flight = 0
        # Set to check this instance now instead of at the next interval; ``checked`` is set,
        # and replaced, as each check ends (a retry waits for one: KvLoadFailed).
        self.recheck = asyncio.Event()
        self.checked = asyncio.Event()
        # Its last failure was a check that got no answer in time (connected, not refused): a
        # sign of load, maybe. Such an instance takes requests in a panic (Fleet.refresh).
        self.timed_out = False
        # Checks in a row that failed the same way: the checks back off while it lasts.
        self.same_failures = 0
        # When the last check began and the last request on it succeeded (monotonic): a check
        # that times out while requests succeed is a sign of load, not of failure.
        self.checked_at = 0.0
        self.last_success = 0.0
        self.slow = False
        # Why its /metrics gave no load (routing then counts this proxy's own requests).
        self.load_error: str | None = None
        # Where it was named (--prefill, the file, a DNS name), and whether it was since
        # dropped from there: it then takes no new requests once another is usable.
        self.origin = ""
        self.leaving = False
        # Told why, when what it held is lost (it went down, or restarted): decodes waiting
        # for a prefill's KV there.
        self.down_watchers: set[Callable[[str], None]] = set()
        # What it serves (learn_models); None until its /v1/models was read: it then serves
        # whatever a request names, as every instance did before the proxy knew models.
        self.served: Served | None = None
        self.models_error: str | None = None  # why its /v1/models could not be read

    @property
    def model(self) -> str:
        """Its routing group: the model it runs, "" while that is not known."""
        return self.served.model if self.served is not None else ""

    def serves(self, model: str) -> bool:
        return self.served is None or model in self.served

    @property
    def named(self) -> tuple[str, URL, str]:
        """Role, URL and origin, for log lines."""
        return self.role, self.url, self.origin or "configured"

    def check_passed(self, healthy_after: int) -> bool:
        """Count a good check; True if that brought the instance back into the rotation."""
        self.failures = 0
        self.passes += 1
        if self.usable or self.passes < healthy_after:
            return False
        self.usable, self.since = True, time.time()
        return True

    def check_failed(self, error: str, unhealthy_after: int) -> bool:
        """Count a failed check; True if that took the instance out of the rotation."""
        self.passes = 0
        self.failures += 1
        self.last_error = error
        self.slow = False
        if not self.usable or self.failures < unhealthy_after:
            return False
        self.went_down()
        return True

    def connection_refused(self, error: str) -> bool:
        """A live request could not connect: out at once, and checked again right away; True
        if that took it out of the rotation."""
        self.passes = self.same_failures = 0
        self.timed_out = False
        self.last_error = error
        self.recheck.set()
        if not self.usable:
            return False
        self.went_down()
        return True

    def went_down(self) -> None:
        self.usable, self.since = False, time.time()
        self.lost_all(f"went down ({self.last_error})")

    def lost_all(self, why: str) -> None:
        for watcher in list(self.down_watchers):
            watcher(why)

    def status(self) -> dict[str, Any]:
        return {
            "url": str(self.url),
            "usable": self.usable,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds"),
            "slow": self.slow,
            "timed_out": self.timed_out,  # its last failed check: no answer in time
            "last_error": self.last_error,
            "load_error": self.load_error,
            "in_flight": self.in_flight,
            "origin": self.origin,
            "leaving": self.leaving,
        }


# How long a decode judged recomputing is passed over (--avoid-recomputing) before a PD
# request may go to it again: its next window with PD answers judges it anew.
RECOMPUTE_HOLD: Final = 60.0


def pulled_whole(prompt_tokens: int, cached_tokens: int) -> bool:
    """Whether an answer's usage says its prompt was cached whole when it came (pulled, or
    held), but for the one token vLLM may compute."""
    return prompt_tokens - cached_tokens <= 1


class TransferProof:
    """Whether a decode pulls the KV of the PD requests sent to it or computes their prompts
    itself: a pull that fails under kv_load_failure_policy "recompute", or a connector that
    does not pull, gives the right answers at twice the cost, and only the decode's counters
    tell (PROTOCOL.md). Judged per scrape of its /metrics, over the window since the last
    one in which PD answers began there: the prompt tokens it pulled, against those it
    computed less what this process sent it to compute alone (estimated)."""

    def __init__(self) -> None:
        self.totals: tuple[float, float] | None = None  # pulled, computed at the last scrape
        self.answered = 0  # PD answers that began there (the decode had their prompt), ever
        self.sent_alone = 0.0  # prompt tokens it was sent to compute alone (estimated), ever
        self.asked_at = (0, 0.0)  # answered, sent_alone as the last scrape was asked for
        self.pulled_share: float | None = None  # in the last window that had PD answers
        self.recomputing = False
        self.since: float | None = None  # wall time it started recomputing
        self.judged_at = -math.inf  # monotonic: the last window that had PD answers
        # Its PD answers' own word (usage.prompt_tokens_details.cached_tokens): None until
        # one was read, False where it gives none (vLLM without --enable-prompt-tokens-details)
        self.cached_reported: bool | None = None
        self.answers: collections.Counter[str] = collections.Counter()  # pulled, recomputed

    def asked(self) -> tuple[int, float]:
        """What it had been sent (answered, sent_alone) as its /metrics are asked for: what
        the counters it serves then include, as vLLM records a step's counts before that
        step's tokens go out. Read at the scrape's end instead, answers that began while a
        busy vLLM's page was on its way counted against counters without them, and were
        lost to the window after (on CPU vLLM, a healthy pair was never judged)."""
        return self.answered, self.sent_alone

    def take(self, pulled: float, computed: float, asked: tuple[int, float]) -> bool | None:
        """One scrape's counters, and what it had been sent when that scrape was asked for;
        True if by them it started recomputing, False if it stopped, else None."""
        before, self.totals = self.totals, (pulled, computed)
        (answered_at, alone_at), self.asked_at = self.asked_at, asked
        answered, alone = asked[0] - answered_at, asked[1] - alone_at
        if before is None or pulled < before[0] or computed < before[1] or not answered:
            return None  # the first scrape, the counters went back (a restart), or no PD
        moved = pulled - before[0]
        recomputed = max(0.0, computed - before[1] - alone)
        if moved + recomputed <= 0:
            return None  # every prompt found in its prefix cache: neither
        self.pulled_share = moved / (moved + recomputed)
        self.judged_at = time.monotonic()
        if (self.pulled_share < 0.5) == self.recomputing:
            return None
        self.recomputing = not self.recomputing
        self.since = time.time() if self.recomputing else None
        return self.recomputing

    def take_answer(self, prompt_tokens: int, cached_tokens: int | None) -> str | None:
        """One PD answer's usage: where its prompt's KV came from ("pulled", else
        "recomputed"), or None where the decode does not say."""
        self.cached_reported = cached_tokens is not None
        if cached_tokens is None:
            return None
        source = "pulled" if pulled_whole(prompt_tokens, cached_tokens) else "recomputed"
        self.answers[source] += 1
        return source

    def answers_status(self) -> dict[str, Any] | None:
        if self.cached_reported is None:
            return None  # no PD answer with usage read yet
        return {"cached_tokens_reported": self.cached_reported, **self.answers}

    def held_out(self, now: float) -> bool:
        """With --avoid-recomputing: passed over for PD requests, as recomputing when
        last judged, less than RECOMPUTE_HOLD ago (then tried again, and judged anew)."""
        return self.recomputing and now - self.judged_at < RECOMPUTE_HOLD

    def status(self) -> dict[str, Any] | None:
        if self.pulled_share is None:
            return None  # no window with PD answers yet, or a vLLM without the counters
        since = self.since
        return {
            "pulled_share": round(self.pulled_share, 3),
            "recomputing": self.recomputing,
            "since": datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds")
            if since is not None
            else None,
        }


class DecodeInstance(Backend, Target):
    """A decode server (vLLM ``kv_consumer``); it runs no bootstrap server. Its prefix cache
    keeps the prompts it received: a decode that holds a prefix pulls only the rest."""

    role = "decode"

    def __init__(self, url: URL, capacity: int = 65536) -> None:
        Backend.__init__(self, url)
        Target.__init__(self, str(url), capacity)
        self.local_prefills = 0  # this process's requests computing their prompt here now
        self.proof = TransferProof()

    def kv_full(self, config: ProxyConfig) -> bool:
        """Its KV cache is full, as a fresh scrape of its /metrics says (as the routers read
        one): a prompt computed there would preempt its running streams."""
        fresh = time.monotonic() - self.load.scraped_at <= config.load_fresh_for
        return fresh and self.load.kv_usage >= KV_FULL

    def status(self) -> dict[str, Any]:
        status = super().status() | self.routing_status(time.monotonic())
        proof = self.proof
        return status | {
            "local_prefills": self.local_prefills,
            "kv_transfer": proof.status(),
            "kv_answers": proof.answers_status(),
        }


class PrefillInstance(Backend):
    """A prefill server (vLLM ``kv_producer``), its bootstrap server and its engines."""

    role = "prefill"

    def __init__(self, spec: PrefillSpec) -> None:
        super().__init__(spec.url)
        self.spec = spec
        self.query_url = spec.bootstrap.with_path("/query")
        # Replaced as a whole tuple, never mutated: a request sees the old set or the new one.
        self.engines: tuple[PrefillEngine, ...] = ()

    def move_bootstrap(self, spec: PrefillSpec) -> None:
        self.spec, self.query_url = spec, spec.bootstrap.with_path("/query")
        self.recheck.set()

    @property
    def engine_ids(self) -> tuple[str, ...]:
        return tuple(engine.engine_id for engine in self.engines)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            **super().status(),
            "bootstrap": self.spec.bootstrap_addr,
            "engine_ids": list(self.engine_ids),
            "engines": [engine.status(now) for engine in self.engines],
        }


# ================================================================================================
# 12. Metrics, access log and tracing
# Holds the Prometheus metrics, the access log line and OpenTelemetry tracing (optional). Uses: 1-3,
# 5, 9, 11.
# ================================================================================================


LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


# Probed every few seconds by load balancers: counted, but their access lines are DEBUG.
PROBE_ROUTES: Final = frozenset({"/health", "/healthcheck", "/metrics"})


access_log = logging.getLogger("mooncake_proxy.access")


# The ``model`` label's values: the fleet's models, as many as this, then "other"; NO_MODEL
# while the fleet's models are not known, and on routes that name none.
MODEL_LABELS: Final = 32


NO_MODEL: Final = "-"


# Label values a fresh proxy makes its series for (Metrics.start_series): the statuses PD
# requests are most often answered with, the reasons a leg fails for (beside http_<status>),
# and each policy's routing reasons.
PD_STATUSES: Final = ("200", "400", "404", "429", "499", "500", "502", "503", "504")


LEG_ERRORS: Final = {
    "prefill": ("refused", "timeout", "broken", "stopped_early", "kv_lost"),
    "decode": ("refused", "timeout", "broken", "kv_load", "in_band"),
    "client": ("client_gone",),
    "admission": ("queue_full", "queue_timeout"),
}


ROUTING_REASONS: Final = {Policy.PREFIX_AWARE: ("affinity", "spill", "cold", "session", "fallback")}


# Seconds between two SSE events: a token every few ms at the least, seconds when stalled.
TOKEN_GAP_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5,
)  # fmt: skip


class TokenGaps:
    """One stream's gaps between SSE events, counted in TOKEN_GAP_BUCKETS as they pass."""

    __slots__ = ("counts", "last", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(TOKEN_GAP_BUCKETS) + 1)  # and +Inf
        self.total = 0.0
        self.last = 0.0

    def events(self, count: int, now: float) -> None:
        """``count`` events completed in one chunk: the first after the gap since the last
        one (none before the first), the rest together with it."""
        if self.last:
            gap = now - self.last
            self.counts[bisect.bisect_left(TOKEN_GAP_BUCKETS, gap)] += 1
            self.total += gap
        self.counts[0] += count - 1
        self.last = now


METRICS_REFRESH_SECONDS: Final = 1.0  # how stale, under --workers, another worker's gauges get


async def refresh_metrics(app: web.Application) -> None:
    """Under --workers a scrape reads every worker's gauges from their files: keep this
    worker's current even while the scrapes go to the others."""
    metrics = app[STATE_KEY].metrics
    while True:
        metrics.refresh()
        await asyncio.sleep(METRICS_REFRESH_SECONDS)


def metrics_across_workers() -> Callable[[], None]:
    """Before the workers fork: prometheus_client's multiprocess mode, in the directory that
    PROMETHEUS_MULTIPROC_DIR names (emptied: counts start again with the daemon) or in a new
    one. prometheus_client picks how it stores values when imported; no metric exists yet,
    so choosing again here is what it would have chosen with the variable set before.
    Returns what to do at exit: remove a directory made here."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        os.makedirs(given, exist_ok=True)
        for stale in glob.glob(os.path.join(given, "*.db")):
            os.remove(stale)
        path = given
    else:
        path = tempfile.mkdtemp(prefix="mooncake-proxy-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    prometheus_client.values.ValueClass = prometheus_client.values.get_value_class()  # type: ignore[no-untyped-call]
    return (lambda: None) if given else functools.partial(shutil.rmtree, path, True)


def record_request(metrics: Metrics, stats: RequestStats, status: int) -> None:
    now = time.monotonic()
    metrics.of(metrics.requests, stats.route, str(status), stats.model_label).inc()
    if stats.span is not None:
        stats.span.set_attribute("http.response.status_code", status)
        stats.span.end()
    probe = stats.route in PROBE_ROUTES
    if not probe:
        metrics.of(metrics.duration, stats.route, stats.model_label).observe(now - stats.started)
        first_byte = (stats.first_byte or now) - stats.started
        metrics.of(metrics.first_byte, stats.route).observe(first_byte)
        if stats.first_token is not None:
            record_token_times(metrics, stats)
        record_outcomes(metrics, stats)
    level = logging.DEBUG if probe else logging.INFO
    if access_log.isEnabledFor(level):
        fields = stats.access_fields(status, now)
        access_log.log(
            level,
            "%(request_id)s %(method)s %(path)s %(status)d model=%(model)s "
            "prefill=%(prefill)s decode=%(decode)s ttfb=%(ttfb_s).4fs total=%(total_s).4fs "
            "bytes=%(bytes_out)d outcome=%(outcome)s trace=%(trace_id)s",
            fields,
            extra={"access": fields},
        )


def record_token_times(metrics: Metrics, stats: RequestStats) -> None:
    """The latency a client felt: its first token, the KV wait before it, the gaps after."""
    assert stats.first_token is not None
    ttft = stats.first_token - stats.started
    metrics.of(metrics.first_token, stats.route, stats.model_label).observe(ttft)
    if stats.token_gaps is not None:
        metrics.token_gaps(stats.route, stats.token_gaps)
        if stats.prefill_answered is not None:
            wait = max(0.0, stats.first_token - stats.prefill_answered)
            metrics.of(metrics.kv_wait, stats.route).observe(wait)
        for phase, seconds in ttft_phases(stats).items():
            metrics.of(metrics.phases, phase, stats.route, stats.model_label).observe(seconds)


def ttft_phases(stats: RequestStats) -> dict[str, float]:
    """A stream's time to its first token, in the phases that add up to it: queue (arrival to
    its last pair's legs sent: admission, the pool, the pairs tried before), then prefill (to
    the prefill's answer) and handoff (to the decode's first token: the KV's transfer and the
    decode's start), or, for a decode alone, decode (to its first token)."""
    sent, first = stats.legs_sent, stats.first_token
    if sent is None or first is None:
        return {}
    phases = {"queue": sent - stats.started}
    if (answered := stats.prefill_answered) is None:
        return phases | {"decode": first - sent}
    answered = min(answered, first)  # its answer may come after the decode's first token
    return phases | {"prefill": answered - sent, "handoff": first - answered}


def record_outcomes(metrics: Metrics, stats: RequestStats) -> None:
    """At a request's end: a continuation that never came (its client left, or it failed), and
    whether a request that tried several pairs before its first byte got one."""
    if stats.cut is not None:
        outcome = "client_gone" if stats.outcome == "client_gone" else "failed"
        metrics.of(metrics.migration_outcomes, outcome, stats.cut[1]).inc()
        stats.cut = None
    if stats.pairs > 1:
        outcome = "answered" if stats.first_byte is not None else "failed"
        metrics.of(metrics.first_token_retries, outcome).inc()


class Tracing:
    """The proxy's own spans (--otlp-traces-endpoint, the [tracing] extra): one per request,
    a child per leg whose context the leg's traceparent carries, so vLLM's spans hang under
    the proxy's. OpenTelemetry's SDK batches and exports them from a thread of its own."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": ID}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer(ID, str(VERSION))
        self.propagator = TraceContextTextMapPropagator()
        self.trace = trace

    def request_span(self, client_headers: Mapping[str, str], route: str) -> Any:
        """Under the client's trace context if it sent a valid one, else a new trace."""
        parent = self.propagator.extract(client_headers)
        span = self.tracer.start_span(
            f"POST {route}", context=parent, kind=self.trace.SpanKind.SERVER
        )
        span.set_attribute("http.route", route)
        return span

    def leg(self, parent: Any, name: str, headers: dict[str, str]) -> tuple[Any, dict[str, str]]:
        """A leg's span and its headers, whose traceparent names that span."""
        context = self.trace.set_span_in_context(parent)
        span = self.tracer.start_span(name, context=context, kind=self.trace.SpanKind.CLIENT)
        headers = {**headers}
        self.propagator.inject(headers, context=self.trace.set_span_in_context(span))
        return span, headers


def trace_id_of_span(span: Any) -> str:
    return f"{span.get_span_context().trace_id:032x}"


def span_error(message: str) -> Any:
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR, message)


async def tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    """With --otlp-traces-endpoint: the exporter for the app's lifetime; at exit, what it
    still holds is sent (the SDK gives that up after its own timeout)."""
    state = app[STATE_KEY]
    endpoint = state.config.otlp_traces_endpoint
    if endpoint is not None:
        try:
            state.tracing = Tracing(endpoint)
        except ImportError as missing:
            log.warning(
                "--otlp-traces-endpoint needs the tracing extra, pip install '.[tracing]' in "
                "the proxy's source tree (%s): "
                "no spans are exported; the legs still carry the trace context", missing,
            )  # fmt: skip
    yield
    if state.tracing is not None:
        await asyncio.to_thread(state.tracing.provider.shutdown)


@dataclass(eq=False)
class RequestStats:
    """What the access line and the metrics say about one client request."""

    method: str
    route: str
    path: str = "-"
    started: float = field(default_factory=time.monotonic)
    request_id: str = "-"
    model: str = "-"
    model_label: str = "-"  # the metrics' (Metrics.model_label): "-" where it names none known
    prefill: str = "-"
    decode: str = "-"
    first_byte: float | None = None
    first_token: float | None = None  # a stream's first SSE event relayed, or a whole answer
    # Before the first token: when the last pair's legs were sent, and its prefill answered
    # (the phases of a stream's TTFT: Metrics.phases); how many pairs were tried.
    legs_sent: float | None = None
    prefill_answered: float | None = None
    pairs: int = 0
    # A continuation under way: when its stream was cut, and why (Metrics.migration_outcomes).
    cut: tuple[float, str] | None = None
    token_gaps: TokenGaps | None = None  # a stream's, as relayed
    trace_id: str = "-"
    span: Any = None  # the proxy's own, with --otlp-traces-endpoint
    # The status whose headers already went out, for a client that leaves after them.
    status_sent: int | None = None
    bytes_out: int = 0
    outcome: str = "ok"

    def continued(self, metrics: Metrics) -> None:
        """A continuation's first bytes are relayed: its stream went on, after this wait."""
        if self.cut is not None:
            cut_at, reason = self.cut
            metrics.migration_gap.observe(time.monotonic() - cut_at)
            metrics.of(metrics.migration_outcomes, "continued", reason).inc()
            self.cut = None

    def access_fields(self, status: int, now: float) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "method": self.method,
            "route": self.route,
            "path": self.path,
            "model": self.model,
            "prefill": self.prefill,
            "decode": self.decode,
            "status": status,
            "ttfb_s": round((self.first_byte or now) - self.started, 6),
            "total_s": round(now - self.started, 6),
            "bytes_out": self.bytes_out,
            "outcome": self.outcome,
            "trace_id": self.trace_id,
        }


# Per request: what its access line and metrics will say.
STATS_KEY: Final = web.RequestKey("stats", RequestStats)


GaugeMode = Literal["livemin", "livemax", "livesum"]


M = TypeVar("M", Counter, Histogram, Gauge)


@dataclass(frozen=True, slots=True)
class Metric(Generic[M]):
    """One row of Metrics' table. It is not itself the metric: each Metrics makes its own
    (its own registry, for tests and workers) and puts it in the instance's __dict__, where
    it shadows this row. __get__ only tells the type checker what the attribute holds."""

    kind: type[M]
    name: str  # after "mooncake_proxy_"; a counter's gets "_total" from prometheus_client
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # histograms
    mode: GaugeMode = "livesum"  # gauges under --workers: how the workers' values combine

    def __get__(self, metrics: object, owner: type | None = None) -> M:
        raise AttributeError(f"mooncake_proxy_{self.name} is made by Metrics()")

    def make(self, registry: CollectorRegistry) -> M:
        extra: dict[str, Any] = {}
        if self.kind is Histogram:
            extra["buckets"] = self.buckets
        elif self.kind is Gauge:
            extra["multiprocess_mode"] = self.mode
        name = f"mooncake_proxy_{self.name}"
        return self.kind(name, self.doc, self.labels, registry=registry, **extra)


class Metrics:
    """Prometheus metrics. Labels are routes, statuses, stages and instances from the
    configuration, never request data. The fleet's gauges are set from its state when
    scraped, so the request path pays only for a few counter and histogram updates.

    Under --workers every worker writes its metrics to files in one directory
    (prometheus_client's multiprocess mode, metrics_across_workers) and any worker's scrape
    reads them all: counters and histograms add up, in-flight gauges too, and ``ready`` and
    ``instance_usable`` are the least of the live workers' (one worker that cannot serve shows).
    """

    # The metrics, one row each: a row is made into its prometheus_client metric per Metrics
    # (each has its own registry), which then stands in its place on the instance.
    # fmt: off
    requests = Metric(Counter, "requests",
        "Client requests by route, final HTTP status and model (MODEL_LABELS).",
        ("route", "status", "model"))
    errors = Metric(Counter, "errors",
        "Failed legs (stage prefill/decode), clients gone (stage client), first tokens that did "
        "not come in time (stage request), by reason.",
        ("stage", "reason"))
    duration = Metric(Histogram, "request_duration_seconds",
        "End-to-end time of a client request.", ("route", "model"))
    first_byte = Metric(Histogram, "time_to_first_byte_seconds",
        "Time until the first response body byte reached the client.", ("route",))
    first_token = Metric(Histogram, "time_to_first_token_seconds",
        "Arrival to the first token frame relayed to the client (a streamed answer's first SSE "
        "event); for an answer not streamed, to the whole answer.", ("route", "model"))
    inter_token = Metric(Histogram, "inter_token_latency_seconds",
        "Gaps between the SSE events of a streamed answer as they were relayed (events that "
        "arrived together count a gap of 0).", ("route",), buckets=TOKEN_GAP_BUCKETS)
    kv_wait = Metric(Histogram, "kv_wait_seconds",
        "From the prefill's answer to the decode's first token frame: the part of a streamed "
        "answer's TTFT spent moving KV and starting the decode.", ("route",))
    prefill_duration = Metric(Histogram, "prefill_duration_seconds",
        "Time of the prefill leg, sent to answered.")
    phases = Metric(Histogram, "request_phase_seconds",
        "A stream's time to first token in phases that add up to it: queue (arrival to its "
        "last pair's legs sent), prefill (to the prefill's answer), handoff (to the decode's "
        "first token), or decode (a decode alone: to its first token).",
        ("phase", "route", "model"))
    migration_outcomes = Metric(Counter, "migration_outcomes",
        "Answers cut mid-way, by what came of them: continued (the continuation's first bytes "
        "reached the client), not_continued (it could not go on, or not exactly: it ended with "
        "an error), failed (a continuation began but none came), client_gone (the client left "
        "before it came); reason: how it was cut (broken, in_band).",
        ("outcome", "reason"))
    migration_gap = Metric(Histogram, "migration_gap_seconds",
        "How long a client waited across a cut: from the stream's cut to its continuation's "
        "first bytes.")
    first_token_retries = Metric(Counter, "first_token_retries",
        "Requests that tried more than one pair before their first byte, by how they ended: "
        "answered, or failed.", ("outcome",))
    retries = Metric(Counter, "retries",
        "Legs tried again elsewhere because their upstream could not be reached.", ("stage",))
    migrations = Metric(Counter, "migrations",
        "Streams that went on on another pair after their decode failed mid-stream, by how it "
        "failed: broken (its connection was lost), in_band (it sent an error or ended short).",
        ("reason",))
    engine_id_changes = Metric(Counter, "engine_id_changes",
        "Times a prefill instance came back with other engine ids (a restart).", ("backend",))
    check_failures = Metric(Counter, "check_failures",
        "Failed health checks, discoveries and load scrapes.", ("role", "backend"))
    routing = Metric(Counter, "routing_decisions",
        "Targets picked, by stage and reason (affinity, spill, cold, session, fallback, or the "
        "policy's name for round_robin and least_loaded).", ("stage", "reason"))
    prefix_share = Metric(Histogram, "routing_prefix_share",
        "Share of the prompt's blocks the chosen target was believed to hold (prefix_aware).",
        ("stage",), buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0))
    kv_event_batches = Metric(Counter, "kv_event_batches",
        "KV event batches from the engines (--kv-events-port), by result: applied, malformed, "
        "missed (never received, not even by replay).", ("result",))
    ready = Metric(Gauge, "ready", "1 while PD requests are served.", mode="livemin")
    panic = Metric(Gauge, "panic",
        "1 while a role's instances that run a model are in a panic: too few of them usable, "
        "those that only time out take requests again (--panic-threshold); model is - while "
        "the instances' models are not known.", ("role", "model"), mode="livemax")
    # "backend", not "instance": Prometheus gives that name to the scraped target.
    usable = Metric(Gauge, "instance_usable", "1 while an instance is in the rotation.",
        ("role", "backend"), mode="livemin")
    prefill_in_flight = Metric(Gauge, "prefill_in_flight",
        "Prefill legs in flight per prefill engine (instance and DP rank).",
        ("backend", "dp_rank", "engine_id"))
    decode_in_flight = Metric(Gauge, "decode_in_flight",
        "Decode legs in flight per decode instance.", ("backend",))
    kv_pulled_ratio = Metric(Gauge, "decode_kv_pulled_ratio",
        "Share of a decode's PD prompt tokens that it pulled over Mooncake rather than "
        "computed itself, over the last scrape interval that had PD answers there (its "
        "vllm:prompt_tokens_by_source_total); absent until known.", ("backend",),
        mode="livemin")
    pd_answers = Metric(Counter, "pd_answers_by_prompt_source",
        "PD answers by where their decode says the prompt's KV came from (its usage's "
        "cached_tokens, with vLLM's --enable-prompt-tokens-details): pulled (the whole prompt "
        "was cached when it came), recomputed (the decode computed more than a token of it).",
        ("backend", "source"))
    recomputing = Metric(Gauge, "decode_recomputing",
        "1 while a decode computes the prompts it should pull (decode_kv_pulled_ratio under "
        "0.5): a failed pull under kv_load_failure_policy recompute, or a KV connector that "
        "does not pull.", ("backend",), mode="livemax")
    self_test_pair = Metric(Gauge, "self_test_pair_ok",
        "The last PD self-test (at start, or POST /admin/self-test): 1 if the prefill engine "
        "and the decode moved the prompt's KV, 0 if not (/healthcheck's self_test says why).",
        ("prefill", "dp_rank", "decode"), mode="livemin")
    client_connections = Metric(Gauge, "client_connections", "Client connections open.")
    connections_rejected = Metric(Counter, "client_connections_rejected",
        "Client connections answered 503 and closed: --max-client-connections were open.")
    admission_queue = Metric(Gauge, "admission_queue", "PD requests waiting for --max-in-flight.")
    admission_wait = Metric(Histogram, "admission_wait_seconds",
        "Time PD requests waited for --max-in-flight.")
    prefill_skipped = Metric(Counter, "prefill_skipped",
        "PD requests sent to a decode alone, which computes the prompt itself, by the field that "
        "makes vLLM split them into several requests (n, best_of, use_beam_search, prompt: a "
        "batch of prompts).", ("reason",))
    local_prefill_decisions = Metric(Counter, "local_prefill_decisions",
        "With --max-local-prefill-tokens: whether a PD request's decode computed the prompt "
        "itself (local) or pulled it (pd), and why: short (a prompt it holds nothing of, under "
        "the limit), cached (what it does not hold is under the limit), no_prefill (the model "
        "had no usable prefill engine left), long, decode_busy (--max-local-prefills "
        "reached, or its KV cache full).", ("decision", "reason"))
    prompt_tokens = Metric(Counter, "prompt_tokens",
        "Prompt tokens of PD requests by what computed them: prefill (the decode pulled them; "
        "as the prefill's answer counts them) or decode (sent to it alone by "
        "--max-local-prefill-tokens; as the proxy estimates what it did not hold).",
        ("computed_by",))
    # fmt: on

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._children: dict[tuple[Any, ...], Any] = {}  # of()
        self.across_workers = state.config.workers > 1
        own = CollectorRegistry()  # where this process's metrics live
        for attribute, row in vars(Metrics).items():
            if isinstance(row, Metric):
                self.__dict__[attribute] = row.make(own)
        self.rejected_counted = 0
        self.models_met: set[str] = set()  # model_label's
        self.engine_series: set[tuple[str, str, str]] = set()
        self.panic_series: set[tuple[str, str]] = set()  # (role, model) of each routing group
        self.start_series(state.config)
        self.registry = own
        if self.across_workers:
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]

    def start_series(self, config: ProxyConfig) -> None:
        """Make every series whose labels are known before any request, at 0 (as
        prometheus_client advises), so that dashboards and alerts find them on a proxy that
        has not met them yet instead of reading "no data"."""
        for route in PD_PATHS:
            for status in PD_STATUSES:
                self.of(self.requests, route, status, NO_MODEL)
            for histogram in (self.duration, self.first_token):
                self.of(histogram, route, NO_MODEL)
            self.of(self.first_byte, route)
            self.of(self.inter_token, route)
            self.of(self.kv_wait, route)
            for phase in ("queue", "prefill", "handoff", "decode"):
                self.of(self.phases, phase, route, NO_MODEL)
        for stage, reasons in LEG_ERRORS.items():
            for reason in reasons:
                self.errors.labels(stage, reason)
        for stage, policy in zip(("prefill", "decode"), config.policies, strict=True):
            self.retries.labels(stage)
            self.of(self.prefix_share, stage)
            for reason in ROUTING_REASONS.get(policy, (policy.value,)):
                self.of(self.routing, stage, reason)
        for result in ("applied", "malformed", "missed"):
            self.kv_event_batches.labels(result)
        for reason in ("broken", "in_band"):
            self.migrations.labels(reason)
            for outcome in MIGRATION_OUTCOMES:
                self.of(self.migration_outcomes, outcome, reason)
        for outcome in ("answered", "failed"):
            self.of(self.first_token_retries, outcome)
        for field_name in (*SAMPLE_COUNTS, "use_beam_search", "prompt"):
            self.of(self.prefill_skipped, field_name)
        for decision, reason in LOCAL_PREFILL_REASONS:
            self.of(self.local_prefill_decisions, decision, reason)
        for computed_by in ("prefill", "decode"):
            self.of(self.prompt_tokens, computed_by)

    def exposition(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

    def refresh(self) -> None:
        """Set the fleet's gauges from its state (under --workers, into this worker's file)."""
        state = self.state
        fleet, connections = state.fleet, state.connections
        self.ready.set(float(state.serving))
        self.refresh_panics(fleet)
        series = set()
        for instance in fleet.prefills:
            self.usable.labels("prefill", str(instance.url)).set(float(instance.usable))
            self.engine_id_changes.labels(str(instance.url))  # at 0 until it restarts
            self.check_failures.labels("prefill", str(instance.url))
            for engine in instance.engines:
                labels = (str(instance.url), str(engine.dp_rank), engine.engine_id)
                self.prefill_in_flight.labels(*labels).set(engine.in_flight)
                series.add(labels)
        for gone in self.engine_series - series:  # a restart gave the engine a new id
            if self.across_workers:
                self.prefill_in_flight.labels(*gone).set(0)  # files keep series: zero it
            else:
                self.prefill_in_flight.remove(*gone)
        self.engine_series = series
        for backend in fleet.decodes:
            self.usable.labels("decode", str(backend.url)).set(float(backend.usable))
            self.check_failures.labels("decode", str(backend.url))
            self.decode_in_flight.labels(str(backend.url)).set(backend.in_flight)
            self.recomputing.labels(str(backend.url)).set(float(backend.proof.recomputing))
            if (share := backend.proof.pulled_share) is not None:
                self.kv_pulled_ratio.labels(str(backend.url)).set(share)
        if state.self_test is not None:
            for pair in state.self_test.pairs:
                labels = (pair.prefill, str(pair.dp_rank), pair.decode)
                self.self_test_pair.labels(*labels).set(float(pair.ok))
        self.client_connections.set(connections.open)
        self.admission_queue.set(state.admission.queued)
        self.connections_rejected.inc(connections.rejected - self.rejected_counted)
        self.rejected_counted = connections.rejected

    def refresh_panics(self, fleet: Fleet) -> None:
        """A panic series per role and routing group there is (Fleet.unless_panic)."""
        series = set()
        for backend in (*fleet.prefills, *fleet.decodes):
            series.add((backend.role, backend.model or NO_MODEL))
            panic = backend.model in fleet.panics.get(backend.role, ())
            self.panic.labels(backend.role, backend.model or NO_MODEL).set(float(panic))
        for gone in self.panic_series - series:  # a model no instance runs any more
            if self.across_workers:
                self.panic.labels(*gone).set(0)
            else:
                self.panic.remove(*gone)
        self.panic_series = series

    def forget(self, gone: Sequence[Backend]) -> None:
        """Instances that left the fleet: their gauges go (under --workers, the files keep a
        series to the end of the process: it reads 0)."""
        for backend in gone:
            url = str(backend.url)
            series: list[tuple[Gauge, tuple[str, ...]]] = [(self.usable, (backend.role, url))]
            if isinstance(backend, DecodeInstance):
                series.append((self.decode_in_flight, (url,)))
            for gauge, labels in series:
                if self.across_workers:
                    gauge.labels(*labels).set(0)
                else:
                    with contextlib.suppress(KeyError):
                        gauge.remove(*labels)

    def of(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client checks the values and
        takes a lock on every call, several times a request. For the request path's series
        only, which are never removed."""
        key = (metric, *labels)
        if (child := self._children.get(key)) is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def model_label(self, model: str | None) -> str:
        """The ``model`` label of a request to ``model`` (a model the fleet serves, or None):
        its name, for the first MODEL_LABELS models met, "other" past them, so that a fleet of
        many LoRA adapters cannot grow the series without end."""
        if model is None:
            return NO_MODEL
        if model not in self.models_met:
            if len(self.models_met) >= MODEL_LABELS:
                return "other"
            self.models_met.add(model)
        return model

    def routed(self, stage: str, choice: Choice, key: RouteKey | None) -> None:
        self.of(self.routing, stage, choice.reason).inc()
        if key is not None and key.chain:
            self.of(self.prefix_share, stage).observe(choice.matched / len(key.chain))

    def token_gaps(self, route: str, gaps: TokenGaps) -> None:
        """Add one stream's gaps to the histogram at once: a few increments per request
        instead of a locked update per token (prometheus_client has no bulk observe, so
        this adds to its per-bucket values; a test checks the totals)."""
        child = self.of(self.inter_token, route)
        for bucket, count in zip(child._buckets, gaps.counts, strict=True):
            if count:
                bucket.inc(count)
        child._sum.inc(gaps.total)


# ================================================================================================
# 13. The application
# Holds create_app: the routes, the middleware, the background tasks (cleanup_ctx). Uses: 1-4, 8,
# 10-12, 14.
# ================================================================================================


def upstream_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """Health checks, discovery and scrapes: aiohttp's client, off the request path (the legs
    have UpstreamPool) and uncapped (--max-connections counts client traffic only)."""
    connector = aiohttp.TCPConnector(
        limit=0,
        limit_per_host=0,
        keepalive_timeout=config.keepalive_timeout,
        ssl=upstream_tls(config) if config.upstream_ca_certs else True,  # True: the system's
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=config.upstream_timeout(config.request_timeout),
        auto_decompress=False,
        skip_auto_headers=(hdrs.ACCEPT_ENCODING,),
        # One pool serves every client: a cookie one upstream answer sets must never ride
        # along on another client's request (and not keeping a jar is cheaper, too).
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={hdrs.USER_AGENT: USER_AGENT},
    )


async def pools_ctx(app: web.Application) -> AsyncIterator[None]:
    """The two connection pools, for the app's lifetime."""
    state, config = app[STATE_KEY], app[STATE_KEY].config
    state.upstreams = UpstreamPool(
        config.connect_timeout, config.keepalive_timeout, config.upstream_ca_certs
    )
    state.health_session = upstream_session(config)
    yield
    state.upstreams.close()
    await state.health_session.close()


def background(
    run: Callable[[web.Application], Coroutine[Any, Any, None]],
    *,
    when: Callable[[], bool] = lambda: True,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that runs ``run(app)`` as a task while the app runs (if ``when()``)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(run(app)) if when() else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return ctx


async def lingering_prefills_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    tasks = list(app[STATE_KEY].lingering)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def create_app(config: ProxyConfig) -> web.Application:
    app = web.Application(
        middlewares=[front_middleware],
        # Bodies are checked against --max-request-bytes in read_body, with a clear 413.
        client_max_size=config.max_request_bytes,
    )
    app[STATE_KEY] = ProxyState(config)
    app.on_response_prepare.append(cors_headers)
    # Order matters: cleanup runs in reverse, so discovery stops before the pools close.
    app.cleanup_ctx.extend(
        (
            tracing_ctx,
            pools_ctx,
            lingering_prefills_ctx,
            peers_ctx,
            background(watch_fleet),
            background(watch_dns),
            background(watch_load),
            background(self_test_at_start, when=lambda: not config.no_start_self_test),
            background(watch_kv_events, when=lambda: config.precise),
            background(watch_tokenizer, when=lambda: config.precise),
            background(report_to_systemd, when=lambda: bool(os.environ.get("NOTIFY_SOCKET"))),
            background(refresh_metrics, when=lambda: config.workers > 1),
        )
    )
    app.router.add_get("/health", handle_health)
    app.router.add_get("/livez", handle_livez)
    app.router.add_get("/healthcheck", handle_healthcheck)
    app.router.add_post("/admin/self-test", handle_self_test)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/v1/models", handle_models)
    for path in PD_PATHS:
        app.router.add_post(path, handle_completion)
    app.router.add_get(RESPONSES_PATH + "/{response_id}", handle_stored_response)
    app.router.add_post(RESPONSES_PATH + "/{response_id}/cancel", handle_stored_response)
    for method, path in PASSTHROUGH_ROUTES:
        app.router.add_route(method, path, handle_passthrough)
    for path in EVERY_INSTANCE_PATHS:
        app.router.add_post(path, handle_every_instance)
    app.router.add_route("*", "/ping", handle_health)  # vLLM's (SageMaker's) readiness
    return app


# ================================================================================================
# 14. The process
# Holds serve (signals, drain, reload), the systemd notifications, the garbage collector's tuning
# and the Supervisor behind --workers. Uses: 1-3, 5, 8, 13.
# ================================================================================================


def sd_notify(*lines: str) -> bool:
    """Tell systemd (Type=notify) how the daemon is doing; a no-op outside systemd.

    The protocol is one datagram of ``KEY=value`` lines on the unix socket in $NOTIFY_SOCKET
    (``@`` at its start means the abstract namespace).
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.connect(address)
            notify.sendall("\n".join(lines).encode())
    except OSError as error:
        log.warning("cannot notify systemd at %s: %s", os.environ["NOTIFY_SOCKET"], error)
        return False
    return True


def readiness_status(app: web.Application) -> str:
    state = app[STATE_KEY]
    fleet = state.fleet
    usable_decodes = sum(d.usable for d in fleet.decodes)
    phase = "draining" if state.draining else "ready" if state.serving else "not ready"
    return (
        f"{phase}: {fleet.engine_count} prefill engine(s), "
        f"{usable_decodes}/{len(fleet.decodes)} decode(s) usable"
    )


async def report_to_systemd(app: web.Application) -> None:
    """STATUS= on every change of readiness, and WATCHDOG=1 when the unit sets a watchdog."""
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC") or 0)
    watchdog_pid = os.environ.get("WATCHDOG_PID")
    if watchdog_pid and int(watchdog_pid) != os.getpid():
        watchdog_usec = 0  # meant for another process
    period = min(1.0, watchdog_usec / 2e6) if watchdog_usec else 1.0
    reported = ""
    while True:
        lines = ["WATCHDOG=1"] if watchdog_usec else []
        if (status := readiness_status(app)) != reported:
            lines.append(f"STATUS={status}")
            reported = status
        if lines:
            sd_notify(*lines)
        await asyncio.sleep(period)


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """Bind before the app starts, so a taken port fails at once and nothing else runs.

    With several workers each gets a socket of its own on the same port (SO_REUSEPORT): the
    kernel spreads new connections over them.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if family == socket.AF_INET and not host.replace(".", "").isdigit():
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
    reuse_port = count > 1
    first = socket.create_server(
        (host, port), family=family, backlog=LISTEN_BACKLOG, reuse_port=reuse_port
    )
    port = first.getsockname()[1]  # port 0: the others join the port the first one got
    return [first] + [
        socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG, reuse_port=True)
        for _ in range(count - 1)
    ]


class UtcFormatter(logging.Formatter):
    """Timestamps in UTC with their zone (ISO 8601), as /healthcheck gives them."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        moment = datetime.fromtimestamp(record.created, UTC)
        return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(UtcFormatter):
    """One JSON object per line; access lines carry their fields as keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,  # which --workers process said it
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "access", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        # The pid tells --workers processes apart: each logs its own health changes.
        handler.setFormatter(
            UtcFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)


LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def event_loop_factory(choice: str) -> LoopFactory | None:
    """uvloop when it is installed and not declined; None means asyncio's own loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError(
                "--loop uvloop: uvloop is not installed (pip install uvloop)"
            ) from None
        return None
    factory: LoopFactory = uvloop.new_event_loop
    return factory


# From this size on, buffers (a large prompt's body, its text, its encodings) get mappings of
# their own, given back to the system once freed. glibc otherwise raises this threshold to
# the size of the last large block freed (up to 32 MiB): the next large prompt's buffers then
# come from a heap that keeps what it once held, and a 16 MiB prompt peaked at 3.3 times its
# size instead of 2.4 (a 1 MiB one, on the heap either way, is not concerned).
LARGE_BUFFER_BYTES: Final = 4 << 20


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def glibc() -> Any:
    """The C library, where it is glibc (its malloc's knobs are glibc's own); None where it is
    another (musl, macOS)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def map_large_buffers() -> None:
    """Fix glibc's mmap threshold at LARGE_BUFFER_BYTES, and its heap's trim threshold at
    twice that, as glibc's own adjustment sets it."""
    libc = glibc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.mallopt(M_MMAP_THRESHOLD, LARGE_BUFFER_BYTES)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * LARGE_BUFFER_BYTES)


def give_back_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim). A large body that
    arrived faster than it was read sits in the heap as many reads of up to 256 KiB each, each
    under the mmap threshold; once freed, a free() returns only what ends the heap, and a
    small object allocated after them keeps them all."""
    libc = glibc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)


def ensure_file_descriptors(config: ProxyConfig) -> None:
    """Raise the soft open-file limit (often 1024) to what the connection cap needs, as Go
    programs do at start; each client stream also holds an upstream connection or two."""
    needed = 3 * config.max_client_connections + 64  # per process: each worker has its own
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except OSError:  # a seccomp filter may forbid it: then the limit is the operator's to set
        return
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        log.warning(
            "the open-file limit is %d but --max-client-connections %d needs about %d: "
            "raise it (LimitNOFILE= in the unit, ulimit -n) or lower the cap",
            *(soft, config.max_client_connections, needed),
        )


Reread = Callable[[], ProxyConfig]


# Signals the supervisor passes on to its workers, each of which acts on them itself.
PASSED_ON: Final = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def run_serve(
    config: ProxyConfig,
    sock: socket.socket,
    loop_factory: LoopFactory | None,
    reread: Reread,
    warm_up: float = 0.0,
) -> int:
    # Blocked until serve handles them, once it listens (a worker is forked so: Supervisor):
    # one that comes while the first checks run (first_checks) then waits for its handler,
    # where SIGHUP's default action would end the daemon and SIGTERM's skip the drain.
    signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(config, sock, reread, warm_up))


# A worker that dies is started again at once if it had served this long, else after a wait
# that doubles up to WORKER_BACKOFF_MAX: one that cannot start must not spin the host.
WORKER_STEADY_SECONDS: Final = 10.0


WORKER_BACKOFF_MAX: Final = 30.0


# Each worker reports to the supervisor as to systemd (READY=1, then WATCHDOG=1 every second
# from its event loop); one silent for this long is not healthy, and systemd is not told the
# daemon is.
WORKER_SILENT_SECONDS: Final = 3.0


# How long a replacement waits for a usable fleet before it takes its socket's connections.
WORKER_WARM_UP_SECONDS: Final = 10.0


@dataclass(eq=False)
class Worker:
    """One serving process as the supervisor sees it: its socket, and what it last said."""

    index: int
    sock: socket.socket  # the listener it serves, kept open here for its replacement
    inbox: socket.socket  # where it reports, as to systemd's NOTIFY_SOCKET
    address: str  # the inbox's, as NOTIFY_SOCKET names it
    pid: int = 0
    started: float = 0.0
    ready: bool = False
    heard: float = 0.0  # when it last reported (monotonic)
    restart_at: float | None = None  # dead, and started again then
    backoff: float = 0.0

    def healthy(self, now: float) -> bool:
        return self.restart_at is None and self.ready and now - self.heard < WORKER_SILENT_SECONDS


class Supervisor:
    """--workers N: one serving process per socket, each forked with the configuration the
    daemon's sources say when it starts, and started again when it dies (the parent never
    serves). Only the supervisor talks to systemd: READY=1 once every worker serves, the
    watchdog only while every worker reports, a STATUS line on each change. SIGTERM and
    SIGINT are passed on, so each worker drains its own requests (a second signal is passed on
    too); SIGHUP is passed on, and each worker reloads.
    """

    def __init__(
        self,
        config: ProxyConfig,
        sockets: list[socket.socket],
        loop_factory: LoopFactory | None,
        reread: Reread,
    ) -> None:
        self.config, self.loop_factory, self.reread = config, loop_factory, reread
        self.workers = [Worker(i, sock, *worker_inbox()) for i, sock in enumerate(sockets)]
        self.stopping = False
        self.ready_sent = False
        self.worst = 0
        self.restarts = worker_restarts_counter()

    def run(self) -> int:
        for signum in PASSED_ON:
            signal.signal(signum, self.pass_on)
        for worker in self.workers:
            if not self.stopping:
                self.start(worker)
        watchdog_usec = int(os.environ.get("WATCHDOG_USEC") or 0)
        next_watchdog = 0.0
        while any(worker.pid or self.restarting(worker) for worker in self.workers):
            self.reap()
            self.listen(timeout=0.1)
            now = time.monotonic()
            self.start_due(now)
            if watchdog_usec and now >= next_watchdog and self.healthy(now):
                sd_notify("WATCHDOG=1")
                next_watchdog = now + min(1.0, watchdog_usec / 2e6)
        sd_notify("STOPPING=1")
        for worker in self.workers:
            worker.sock.close()
            worker.inbox.close()
        return self.worst

    def start(self, worker: Worker) -> None:
        config, warm_up = self.config, 0.0
        if worker.started:  # a replacement: the configuration as its sources say now
            with contextlib.suppress(ConfigError):
                config = self.config = self.reread()
            warm_up = WORKER_WARM_UP_SECONDS
        # Forked with the signals blocked: serve() takes them once it handles them.
        before = signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
        pid = os.fork()
        if pid == 0:
            self.become(worker, config, warm_up)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        worker.pid, worker.started, worker.ready = pid, time.monotonic(), False
        worker.heard, worker.restart_at = worker.started, None

    def restarting(self, worker: Worker) -> bool:
        return worker.restart_at is not None and not self.stopping

    def become(self, worker: Worker, config: ProxyConfig, warm_up: float) -> NoReturn:
        """In the forked child: serve on the worker's socket, reporting to the supervisor."""
        code = 1
        try:
            for other in self.workers:
                other.inbox.close()
                if other is not worker:
                    other.sock.close()
            for signum in PASSED_ON:
                signal.signal(signum, signal.SIG_DFL)  # blocked until serve() handles them
            # A group of its own: a terminal's Ctrl-C reaches the supervisor alone, which
            # passes it on once (twice, a worker would exit at once instead of draining).
            os.setpgid(0, 0)
            os.environ["NOTIFY_SOCKET"] = worker.address
            os.environ["WATCHDOG_USEC"], os.environ["WATCHDOG_PID"] = "2000000", str(os.getpid())
            code = run_serve(config, worker.sock, self.loop_factory, self.reread, warm_up)
        except BaseException:
            log.exception("worker %d failed", worker.index)  # not lost in os._exit
        finally:
            os._exit(code)

    def pass_on(self, signum: int, _: object) -> None:
        if signum != signal.SIGHUP:
            self.stopping = True  # no worker is started again from now on
        for worker in self.workers:
            if worker.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signum)

    def reap(self) -> None:
        with contextlib.suppress(ChildProcessError, InterruptedError):
            while (found := os.waitpid(-1, os.WNOHANG))[0]:
                self.ended(*found)

    def ended(self, pid: int, status: int) -> None:
        worker = next((w for w in self.workers if w.pid == pid), None)
        if worker is None:
            return
        worker.pid, worker.ready = 0, False
        mark_process_dead(pid)  # type: ignore[no-untyped-call]  # its live gauges go
        code = os.waitstatus_to_exitcode(status)
        if self.stopping:
            self.worst = max(self.worst, abs(code))
            if code:
                log.warning("worker %d (pid %d) exited with %d", worker.index, pid, code)
            return
        lived = time.monotonic() - worker.started
        worker.backoff = (
            0.0 if lived >= WORKER_STEADY_SECONDS
            else min(max(2 * worker.backoff, 1.0), WORKER_BACKOFF_MAX)
        )  # fmt: skip
        worker.restart_at = time.monotonic() + worker.backoff
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        log.error(
            "worker %d (pid %d) %s after %.1f s; starting it again in %g s",
            worker.index, pid, how, lived, worker.backoff,
        )  # fmt: skip
        self.restarts.inc()
        self.report()

    def start_due(self, now: float) -> None:
        for worker in self.workers:
            if self.restarting(worker) and now >= (worker.restart_at or 0.0):
                self.start(worker)
                log.info("worker %d started again as pid %d", worker.index, worker.pid)

    def listen(self, timeout: float) -> None:
        """Take what the workers reported (READY=1, WATCHDOG=1, STATUS=...)."""
        inboxes = {worker.inbox: worker for worker in self.workers}
        # A signal (pass_on) does not interrupt it: select retries (PEP 475).
        readable, _, _ = select.select(list(inboxes), [], [], timeout)
        for inbox in readable:
            while (datagram := receive(inbox)) is not None:
                worker = inboxes[inbox]
                worker.heard = time.monotonic()
                if b"READY=1" in datagram.split(b"\n") and not worker.ready:
                    worker.ready = True
                    self.report()

    def healthy(self, now: float) -> bool:
        return all(worker.healthy(now) for worker in self.workers)

    def report(self) -> None:
        serving = sum(worker.ready for worker in self.workers)
        status = f"STATUS=serving with {serving} of {len(self.workers)} workers"
        if not self.ready_sent and serving == len(self.workers):
            self.ready_sent = True
            sd_notify("READY=1", status)
        elif self.ready_sent:
            sd_notify(status)


def receive(inbox: socket.socket) -> bytes | None:
    """One datagram waiting on ``inbox``, or None."""
    try:
        return inbox.recv(4096)
    except BlockingIOError:
        return None


def worker_inbox() -> tuple[socket.socket, str]:
    """A datagram socket in the abstract namespace, where one worker reports, and its name as
    NOTIFY_SOCKET gives it."""
    name = f"mooncake-proxy-{os.getpid()}-{os.urandom(6).hex()}"
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind("\0" + name)
    inbox.setblocking(False)
    return inbox, "@" + name


def worker_restarts_counter() -> Counter:
    """Counted by the supervisor in the workers' metrics directory, so that every worker's
    scrape shows it."""
    return Counter(
        "mooncake_proxy_worker_restarts",
        "Workers (--workers) that died and were started again.",
        registry=None,
    )


def reload_config(app: web.Application, reread: Callable[[], ProxyConfig]) -> None:
    """SIGHUP: read the configuration again and apply it, or keep the running one whole."""
    sd_notify(
        "RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
    )
    try:
        new = reread()
    except ConfigError as error:
        log.error("SIGHUP: the configuration stays as it was: %s", error)
    else:
        new.warn_shadowed()
        app[STATE_KEY].reconfigure(new)
    sd_notify("READY=1", f"STATUS={readiness_status(app)}")


# The cyclic collector's young generation: collected once this many more container objects
# were made than freed, where CPython's default is 700. The requests in flight hold thousands
# of objects between them (a few hundred each, alive until it ends), so at 700 a collection
# came every 40 requests or so at 32 concurrent, found them all alive and moved them on to
# be scanned again: 8-10 us of CPU a request there, 3% of it. At 10,000 it comes about once
# in 2,000 requests (bench/research/request-floor/gc_time.py); cyclic garbage (rare here)
# waits longer.
GC_YOUNG_THRESHOLD: Final = 10_000


def tune_gc() -> None:
    """Once the app has started: what exists now (modules, configuration, the fleet's tables)
    lives as long as the process, so the collector stops scanning it (gc.freeze); the young
    generation is collected past GC_YOUNG_THRESHOLD. Each worker does it for itself."""
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


# Where GC_YOUNG_THRESHOLD has collections come rarely, the cyclic garbage of a large request
# that failed is kept with its body: an exception's traceback holds the frames that hold the
# body, its parsed prompt and the legs' encoding, and each frame the exception or the task
# that holds it. Three refused 50 MB prompts kept 300 MiB for good (300 requests later: their
# count of objects, a hundred each, came nowhere near the threshold), where a served one
# leaves none (bench/research/refused-prompts). So a request that received at least this much is
# followed by a full collection. It walks every object of the requests in flight: 0.03 ms
# idle, 13 ms with 200 streams in flight, 245 ms with 1,000 (bench/research/refused-prompts/
# gc_cost.py); collections are kept LARGE_GARBAGE_SECONDS apart at least, and far enough
# apart to take no more than LARGE_GARBAGE_SHARE of the time. Then the heap's free pages go
# back to the system (give_back_free_heap): 1.5 ms with 200 MiB of small objects alive and
# 15 MiB just freed among them.
LARGE_GARBAGE_BYTES: Final = LARGE_BUFFER_BYTES


LARGE_GARBAGE_SECONDS: Final = 1.0


LARGE_GARBAGE_SHARE: Final = 0.01


class LargeGarbage:
    """Collects what large requests leave (LARGE_GARBAGE_BYTES), soon after each ends."""

    def __init__(self) -> None:
        self.due: asyncio.TimerHandle | None = None
        self.next_at = -math.inf  # the loop's time from which another may run

    def request_done(self, received: int) -> None:
        """A request ended, with ``received`` bytes of it: collect once its frames are done
        (the next turn of the loop), or as soon as the last collection allows."""
        if received < LARGE_GARBAGE_BYTES or self.due is not None:
            return
        loop = asyncio.get_running_loop()
        self.due = loop.call_later(max(0.0, self.next_at - loop.time()), self.collect)

    def collect(self) -> None:
        self.due = None
        started = time.perf_counter()
        gc.collect()
        give_back_free_heap()
        took = time.perf_counter() - started
        wait = max(LARGE_GARBAGE_SECONDS, took / LARGE_GARBAGE_SHARE)
        self.next_at = asyncio.get_running_loop().time() + wait


async def serve(
    config: ProxyConfig,
    sock: socket.socket,
    reread: Callable[[], ProxyConfig] | None = None,
    warm_up: float = 0.0,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain: stop accepting, let streams finish, exit 0.
    SIGHUP applies ``reread()``, the configuration as its sources say now. Connections are
    taken once the fleet's first checks have settled (first_checks); ``warm_up``: how long
    to wait on for a usable fleet (a replacement worker's)."""
    app = create_app(config)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,  # a client gone cancels its handler, and so both legs
        # The drain is over when it cleans up (drained): what is left gets a second more,
        # then is cancelled (0 would mean no limit to aiohttp).
        shutdown_timeout=1.0,
    )
    await runner.setup()
    await first_checks(app[STATE_KEY], first_checks_bound(config))
    await warmed_up(app[STATE_KEY], warm_up)
    tune_gc()
    listener = await listen(runner, sock)
    sd_notify("READY=1", f"STATUS={readiness_status(app)}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: exiting at once", signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info(
            "%s: draining; in-flight requests have %g s to finish",
            signal.Signals(signum).name,
            config.shutdown_timeout,
        )
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    if reread is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_config, app, reread)
    # Blocked until now (run_serve; a worker is forked so): one that came before its handler
    # was in place is taken now, instead of ending the process (SIGHUP's default action).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PASSED_ON)
    await stop.wait()
    state = app[STATE_KEY]
    state.draining = True
    sd_notify("STOPPING=1", f"STATUS={readiness_status(app)}")
    # Still accepting while draining: /livez says alive, /health 503, new requests get 503
    # and a closed connection, where a closed port would look like a crash to probes.
    await drained(state.admission, config.shutdown_timeout)
    listener.close()
    # Cancels what outlived the drain (their legs' connections close, so vLLM aborts them),
    # then runs the cleanups.
    await runner.cleanup()
    log.info("stopped")
    return 0


def checks_settled(state: ProxyState) -> bool:
    """Every DNS name was looked up once, and every instance named is usable or has failed a
    check: what the proxy answers now, it answers knowing its fleet."""
    dns = state.dns_answers.keys() | state.dns_errors.keys()
    fleet = state.fleet
    return all(name in dns for name in state.config.dns_names) and all(
        backend.usable or backend.failures for backend in (*fleet.prefills, *fleet.decodes)
    )


def first_checks_bound(config: ProxyConfig) -> float:
    """How long the first checks may take: a lookup, then a check that fails if a request of
    it gets no answer within --health-timeout; and a passing instance is usable after
    --healthy-after checks, the others --discovery-interval apart."""
    return 2 * config.health_timeout + (config.healthy_after - 1) * config.discovery_interval


FIRST_CHECKS_POLL_SECONDS: Final = 0.01


async def first_checks(state: ProxyState, within: float) -> None:
    """Until the fleet's first checks have settled (checks_settled), for ``within`` seconds at
    most, before the listener takes connections: the port is bound before the app starts,
    so a request that comes meanwhile waits in its backlog, and is answered by a proxy that
    knows which instances are usable, instead of 503 "not ready" from one that has not
    checked them yet (in the first second of a daemon's life, dozens of them). An instance
    that refuses, or answers not ready, fails its first check at once: the wait is short
    where the fleet is down, and 503s then say so."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            while not checks_settled(state):
                await asyncio.sleep(FIRST_CHECKS_POLL_SECONDS)


DRAIN_POLL_SECONDS: Final = 0.05


async def warmed_up(state: ProxyState, within: float) -> None:
    """Until the fleet is usable, or ``within`` seconds passed. A worker started again in a
    serving daemon waits so: meanwhile the kernel's share of new connections for its socket
    waits in its queue, instead of being answered 503 (not ready) by a fleet not yet checked."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            while not state.serving:
                await asyncio.sleep(DRAIN_POLL_SECONDS)


async def drained(admission: Admission, within: float) -> None:
    """Until no PD request is in flight or waiting, or ``within`` seconds have passed."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            while admission.running or admission.queued:
                await asyncio.sleep(DRAIN_POLL_SECONDS)


# ================================================================================================
# 15. Command line
# Holds build_parser and main. Uses: 1-2, 12, 14.
# ================================================================================================


# --help's groups, in the order an operator meets them: the name --help=GROUP takes, what the
# group is for, its settings. Every setting in one (build_parser checks, so that a new setting
# cannot be left out of --help).
FLAG_GROUPS: Final = (
    ("Fleet", "where the prefill and decode instances are",
        ("prefills", "decodes", "prefill_dns", "decode_dns", "dns_interval", "dns_server")),
    ("Serving", "where the proxy listens, and as what", ("config_file", "host", "port",
        "workers", "loop", "log_level", "log_format", "otlp_traces_endpoint",
        "shutdown_timeout")),
    ("Health", "when an instance leaves the rotation and comes back", ("health_interval",
        "discovery_interval", "health_timeout", "unhealthy_after", "healthy_after",
        "panic_threshold", "no_start_self_test")),
    ("Legs", "the proxy's requests to vLLM", ("upstream_api_key", "connect_timeout",
        "keepalive_timeout", "request_timeout", "first_token_timeout", "prefill_timeout",
        "max_retries", "migration_limit", "max_connections", "pool_timeout")),
    ("Routing", "which engine and which decode a request goes to", ("policy",
        "prefill_policy", "decode_policy", "load_interval", "prefix_index_blocks",
        "prefix_block_bytes", "balance_factor", "prefill_load_weight", "decode_load_weight",
        "peers", "max_local_prefill_tokens", "max_local_prefills",
        "avoid_recomputing")),
    ("KV-events", "routing on what each engine holds", ("kv_events_port",
        "kv_events_replay_port", "kv_events", "tokenizer")),
    ("Limits", "what clients may ask, and how long they may take", ("max_request_bytes",
        "max_in_flight", "max_queue", "queue_timeout", "header_timeout", "body_timeout",
        "body_min_rate", "max_client_connections", "client_keepalive_timeout")),
    ("Access", "who may call the proxy, and how", ("api_key", "protect_metrics",
        "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "upstream_ca_certs", "allowed_origins",
        "allowed_methods", "allowed_headers", "allow_credentials")),
)  # fmt: skip


SHORT_USAGE: Final = (
    "usage: mooncake-proxy --prefill URL [BOOTSTRAP] --decode URL [URL ...] [options]"
)


HELP_FOOTER: Final = (
    f"Every flag is also an environment variable, {ENV_PREFIX}<FLAG>, and a key of the --config "
    "file."
)


# --help on one screen (40 lines at most, test_front_door.py): what the proxy is, the command
# lines of the README, the groups (format_summary lists them between these two parts).
HELP_SUMMARY: Final = (
    (
        "A prefill/decode disaggregation proxy for vLLM's MooncakeConnector: clients see one",
        "OpenAI-compatible server, and each request's prefill and decode run on two instances.",
        "",
        "One prefill (its Mooncake bootstrap server on port 8998) and one decode:",
        "  mooncake-proxy --prefill http://10.0.0.1:8100 8998 --decode http://10.0.0.3:8200",
        "More of each, listening on every interface:",
        "  mooncake-proxy --host 0.0.0.0 --port 8000 \\",
        "      --prefill http://10.0.0.1:8100 8998 --prefill http://10.0.0.2:8100 8998 \\",
        "      --decode http://10.0.0.3:8200 http://10.0.0.4:8200",
        "From a settings file (its keys are the flags' names: deploy/mooncake-proxy.toml):",
        "  mooncake-proxy --config /etc/mooncake-proxy/proxy.toml",
        "",
        "Options, in groups: --help=GROUP shows one group's, --help=all every option.",
    ),
    (
        f"Every flag is also an environment variable, {ENV_PREFIX}<FLAG>, and a key of the",
        "--config file; the command line wins over the environment, the environment over the",
        "file. --version prints the version.",
    ),
)


class OneLineArgumentParser(argparse.ArgumentParser):
    """Bad flags end in one clear line on stderr, as a unit's journal shows it; --help is one
    screen (format_summary), --help=all every option, --help=GROUP one group's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    # argparse writes a "+" flag with two metavars as "URL [BOOTSTRAP ...]": say what it takes.
    @staticmethod
    def say_entries(text: str) -> str:
        text = text.replace("[BOOTSTRAP ...]", "[BOOTSTRAP]")
        text = text.replace("-h [GROUP], --help [GROUP]", "-h, --help[=GROUP]")
        text = text.replace("[-h [GROUP]]", "[-h | --help[=GROUP]]")
        return text.replace("[ENDPOINT ...]", "ENDPOINT [REPLAY]")

    def format_usage(self) -> str:
        return self.say_entries(super().format_usage())

    def format_help(self) -> str:
        return self.say_entries(super().format_help())

    def format_summary(self) -> str:
        """What --help shows: what the proxy is, how it is mostly started, the option groups."""
        groups = [f"  {name:<10} {about}" for name, about, _ in FLAG_GROUPS]
        return "\n".join((SHORT_USAGE, "", *HELP_SUMMARY[0], *groups, "", *HELP_SUMMARY[1], ""))

    def format_group(self, asked: str) -> str:
        """What --help=GROUP shows: the group's options as --help=all writes them."""
        names = [name for name, _, _ in FLAG_GROUPS]
        found = [name for name in names if same_group(name, asked)]
        if not found:
            self.error(
                f"--help={asked}: no such group of options; the groups are {', '.join(names)}, "
                "and all (every option)"
            )
        group = next(g for g in self._action_groups if g.title == group_title(found[0]))
        formatter = self._get_formatter()
        formatter.start_section(group.title)
        formatter.add_arguments(group._group_actions)
        formatter.end_section()
        formatter.add_text(f"{HELP_FOOTER} --help=all shows every option.")
        return f"{SHORT_USAGE}\n\n{self.say_entries(formatter.format_help())}"


class ShowHelp(argparse.Action):
    """-h and --help: one screen; --help=all: every option; --help=GROUP: one group's, group
    names matched without regard to case (as vLLM's own serve --help=all, --help=GROUP)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **options: Any) -> None:
        options.update(nargs="?", metavar="GROUP", default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **options)

    def __call__(self, parser: argparse.ArgumentParser, _: Any, asked: Any, *__: Any) -> NoReturn:
        assert isinstance(parser, OneLineArgumentParser)
        if asked is None:
            text = parser.format_summary()
        elif same_group("all", asked):
            text = parser.format_help()
        else:
            text = parser.format_group(asked)  # an unknown group: one line, exit status 2
        sys.stdout.write(text)
        parser.exit()


class PrintVersion(argparse.Action):
    """One line: the command's name and its package release (setup.cfg reads it from here)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **options: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **options)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(f"{parser.prog} {__version__}")
        parser.exit()


def same_group(name: str, asked: str) -> bool:
    """--help=GROUP names a group without regard to case, dashes, underscores or spaces."""
    return re.sub(r"[-_\s]", "", asked).lower() == re.sub(r"[-_\s]", "", name).lower()


def group_title(name: str) -> str:
    """A group's section title in --help=all and docs/reference.md."""
    return next(f"{name}: {about}" for named, about, _ in FLAG_GROUPS if named == name)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="mooncake-proxy",
        description="Prefill/decode disaggregation proxy for vLLM's MooncakeConnector.",
        epilog=(
            f"Every flag can also be given as an environment variable {ENV_PREFIX}<FLAG> "
            f"(e.g. {ENV_PREFIX}MAX_RETRIES=3, {ENV_PREFIX}PROTECT_METRICS=1) and as a key "
            "of the --config file (max-retries = 3); a flag on the command line wins over the "
            "environment, which wins over the file. Repeated flags take several values: "
            f"{ENV_PREFIX}PREFILL="
            "'http://10.0.0.1:8100 8998, http://10.0.0.2:8100' (entries separated by commas), "
            f"{ENV_PREFIX}DECODE='http://10.0.0.3:8200 http://10.0.0.4:8200'."
        ),
        add_help=False,
    )
    names = ", ".join(name for name, _, _ in FLAG_GROUPS)
    parser.add_argument(
        "-h",
        "--help",
        action=ShowHelp,
        help=f"one screen of help; --help=all: every option; --help=GROUP: one group's ({names})",
    )
    parser.add_argument("--version", action=PrintVersion, help="print the version and exit")
    grouped = [name for _, _, names in FLAG_GROUPS for name in names]
    assert sorted(grouped) == sorted(SETTINGS_BY_NAME), "FLAG_GROUPS: each setting once"
    for name, _, settings in FLAG_GROUPS:
        group = parser.add_argument_group(group_title(name))
        for setting in settings:
            SETTINGS_BY_NAME[setting].add_to(group)
    return parser


def cannot_listen(config: ProxyConfig, error: OSError) -> str:
    """Why the listen address could not be bound, and for the usual reasons what to do."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    where = f"cannot listen on {host}:{config.port}"
    if error.errno == errno.EADDRINUSE:
        return (
            f"{where}: the port is in use (another mooncake-proxy, or another server, is "
            "listening there); pass --port N for another port, or --port 0 for any free one"
        )
    if error.errno == errno.EACCES and 0 < config.port < 1024:
        return f"{where}: ports below 1024 need root (or CAP_NET_BIND_SERVICE); pass --port N"
    return f"{where}: {error.strerror or error}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    environ = dict(os.environ)  # as the process started: a reload rereads only the file
    reread = functools.partial(load_config, parser, argv, environ)
    try:
        config = reread()
        loop_factory = event_loop_factory(config.loop)
    except ConfigError as error:
        parser.error(str(error))  # one line, exit status 2
    setup_logging(config.log_level, config.log_format)
    ensure_file_descriptors(config)
    map_large_buffers()
    try:
        sockets = bind_listeners(config.host, config.port, config.workers)
    except OSError as error:
        print(f"{parser.prog}: error: {cannot_listen(config, error)}", file=sys.stderr)
        return 1
    host, port = sockets[0].getsockname()[:2]
    details = f"{config.workers} worker(s), {'uvloop' if loop_factory else 'asyncio'} loop"
    log.info(
        "%s %d listening on %s:%d (%s); %s", ID, VERSION, host, port, details, config.describe()
    )
    config.warn_shadowed()
    if os.environ.get("OPENAI_API_KEY") and not config.upstream_api_key:
        # vLLM's example proxy sends it upstream; a user switching from it, whose vLLM runs
        # with --api-key, would otherwise meet 401s with no word why.
        log.warning(
            "$OPENAI_API_KEY is set but not sent to vLLM: if vLLM runs with --api-key, give "
            "the key with --upstream-api-key or %sUPSTREAM_API_KEY",
            ENV_PREFIX,
        )
    if config.workers > 1:
        remove_metrics_dir = metrics_across_workers()
        try:
            return Supervisor(config, sockets, loop_factory, reread).run()
        finally:
            remove_metrics_dir()
    return run_serve(config, sockets[0], loop_factory, reread)


if __name__ == "__main__":
    sys.exit(main())
