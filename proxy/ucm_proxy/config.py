"""Proxy configuration: flags and/or a YAML file, validated with errors naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from ucm.config import ConfigError, StrictModel
from ucm.kv_events import KV_EVENTS_TOPIC, ipc_event_endpoints

Policy = Literal["round_robin", "least_outstanding", "prefix_affinity", "kv_aware"]


class EventEndpoint(StrictModel):
    """One backend's KV event endpoints; its key in ``endpoints`` is that backend's base URL, written as
    in prefill/decode."""

    events: str = Field(description="The engine's KV event publisher, tcp://HOST:PORT or ipc://PATH")
    replay: str | None = Field(None, description="Its replay endpoint (vLLM's replay_endpoint), the same forms")

    @field_validator("events", "replay")
    @classmethod
    def _zmq(cls, value: str | None) -> str | None:
        if value is not None:
            check_endpoint(value)
        return value


class KVEventsConfig(StrictModel):
    """Where the engines publish their KV events (vLLM ``--kv-events-config``), for ``kv_aware``."""

    port: int | None = Field(
        None, ge=1, le=65535, description="The publisher's port on every backend's host (pods: the same port each)"
    )
    replay_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="The replay port on every backend's host: the index is rebuilt from the engine's recent "
        "events after a proxy restart or a lost batch (without it, from what comes next)",
    )
    endpoints: dict[str, EventEndpoint] = Field(
        default_factory=dict,
        description="Per backend URL, for engines that share a host: its publisher and replay endpoints",
    )
    ipc_name: str | None = Field(
        None,
        min_length=1,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="ucm up: the deployment's name; each engine on this machine publishes on abstract sockets "
        "named by it and the engine's HTTP port",
    )
    topic: str = Field(KV_EVENTS_TOPIC, description="The engines' event topic (vLLM's kv_events_config.topic)")
    max_blocks_per_engine: int = Field(
        262_144, ge=1, description="Blocks remembered per engine (~250 bytes each), the oldest forgotten first"
    )
    max_message_bytes: int = Field(
        16 << 20, ge=1 << 16, description="A larger event message is refused (the connection is dropped and redone)"
    )

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, endpoints: dict[str, EventEndpoint]) -> dict[str, EventEndpoint]:
        return dict(zip(checked_urls(list(endpoints)), endpoints.values(), strict=True))

    @model_validator(mode="after")
    def _one_way(self) -> KVEventsConfig:
        if sum((self.port is not None, bool(self.endpoints), self.ipc_name is not None)) != 1:
            raise ValueError(
                "kv_events: give port (every backend's host), endpoints (per backend URL) or ipc_name (ucm up), "
                "one of them"
            )
        if self.replay_port is not None and self.port is None:
            raise ValueError("kv_events.replay_port: needs port (with endpoints, give each one's replay)")
        return self

    def endpoint(self, url: str) -> EventEndpoint | None:
        """The publisher of the backend at ``url`` (None: not known)."""
        if self.endpoints:
            return self.endpoints.get(url)
        parts = urlsplit(url)
        host = parts.hostname
        if host is None:
            return None
        if self.ipc_name is not None:
            events, replay = ipc_event_endpoints(self.ipc_name, parts.port or 80)
            return EventEndpoint(events=events, replay=replay)
        assert self.port is not None
        host = f"[{host}]" if ":" in host else host
        replay = f"tcp://{host}:{self.replay_port}" if self.replay_port is not None else None
        return EventEndpoint(events=f"tcp://{host}:{self.port}", replay=replay)


class RoutingConfig(StrictModel):
    """How each pool chooses the backend for a request (``ucm_proxy.backends``)."""

    prefill: Policy = Field("prefix_affinity", description="How a prefill backend is chosen")
    decode: Policy = Field("least_outstanding", description="How a decode (or mixed) backend is chosen")
    prefix_chars: int = Field(512, ge=16, description="Leading prompt characters that prefix affinity hashes")
    load_factor: float = Field(
        1.25,
        ge=1,
        description="prefix_affinity: a prefix stays on its backend while that one's load is at most this times "
        "the pool's average (consistent hashing with bounded load); past it, the next backend in the prefix's "
        "order takes it",
    )
    kv_events: KVEventsConfig | None = Field(
        None, description="The engines' KV events: with them, kv_aware is the default policy of the pools that compute"
    )
    kv_aware_load_tokens: int = Field(
        256,
        ge=0,
        description="kv_aware: cached prompt tokens one outstanding request on an engine is worth; an engine is "
        "chosen for its cached prefix only while that outweighs its extra load (and its load stays within "
        "load_factor of the pool's average, as for prefix_affinity)",
    )
    kv_aware_store_weight: float = Field(
        0.5,
        ge=0,
        le=1,
        description="kv_aware: what a prompt token the shared store holds (an engine would load it) counts for, "
        "against 1 for one in the engine's own cache (the connector announces the store's blocks)",
    )
    engine_metrics_interval_s: float = Field(
        2.0,
        ge=0,
        description="How often the proxy reads each engine's /metrics (vLLM's running and waiting requests, KV "
        "cache usage) to weigh load, so several proxy replicas see each other's requests; 0: only its own counts",
    )

    @model_validator(mode="before")
    @classmethod
    def _kv_aware_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kv_events") is not None and "prefill" not in data:
            return {**data, "prefill": "kv_aware"}
        return data

    @model_validator(mode="after")
    def _events_for_kv_aware(self) -> RoutingConfig:
        for role in ("prefill", "decode"):
            if getattr(self, role) == "kv_aware" and self.kv_events is None:
                raise ValueError(f"routing.{role}: kv_aware needs routing.kv_events (where the engines publish)")
        return self


class TimeoutsConfig(StrictModel):
    """Time limits, in seconds."""

    connect_s: float = Field(
        5.0,
        gt=0,
        description="Opening a connection to a backend; also the whole of each request of a health check "
        "(/health, /v1/models), each /metrics reading and each kv_aware /tokenize call to an engine",
    )
    header_s: float = Field(
        10.0, gt=0, description="Until a request's line and headers are in, from its first byte (slower: 408)"
    )
    body_s: float = Field(30.0, gt=0, description="Until the client's request body is read (slower: 408)")
    prefill_s: float = Field(600.0, gt=0, description="Whole prefill request")
    first_byte_s: float = Field(600.0, gt=0, description="Until the decode backend's response starts")
    idle_s: float = Field(600.0, gt=0, description="Longest silence inside a streamed response")
    queue_s: float = Field(
        5.0,
        ge=0,
        description="How long a request waits for a backend while its pool has none available (an engine "
        "restarting) before 503 with Retry-After; 0: answer at once",
    )


class HealthConfig(StrictModel):
    """Active checks of every backend (a GET of ``path``), and ejection of a backend whose requests fail
    in a row (passive)."""

    interval_s: float = Field(5.0, gt=0, description="Active health check period")
    unhealthy_interval_s: float = Field(0.5, gt=0, description="The period while some backend fails its check")
    path: str = Field("/health", description="The path each check GETs on a backend; anything but 200 fails")
    eject_after: int = Field(3, ge=1, description="Consecutive failures that eject a backend")
    backoff_s: float = Field(1.0, gt=0, description="First ejection length; doubles each time, up to backoff_max_s")
    backoff_max_s: float = Field(60.0, gt=0, description="The longest ejection, however often a backend fails")


class PDCheckConfig(StrictModel):
    """The check through prefill → store → decode (``ucm_proxy.pdpath``)."""

    interval_s: float = Field(
        30.0, ge=0, description="How often a small request checks the PD path (every 5 s while it fails); 0: never"
    )
    prompt_words: int = Field(
        200, ge=16, le=4096, description="The check's prompt length in words: it must fill at least one KV block"
    )
    timeout_s: float = Field(30.0, gt=0, description="Each of the check's two requests")


class DisaggregationConfig(StrictModel):
    """Mode pd: which requests go through prefill and which straight to decode (``ucm_proxy.decider``)."""

    min_prefill_tokens: int = Field(
        256,
        ge=0,
        description="Prefill remotely only when about this many prompt tokens are not in the store yet: shorter "
        "prompts, and prompts whose prefix earlier requests stored, go straight to decode (it computes a few "
        "tokens, or loads the prefix, faster than a prefill round trip); 0: every request through prefill",
    )
    chars_per_token: float = Field(
        4.0, gt=0, le=64, description="How the proxy estimates a text prompt's tokens (it has no tokenizer)"
    )
    remembered_chunks: int = Field(
        200_000,
        ge=0,
        description="Prompt chunks (64 estimated tokens each, ~100 bytes of memory) remembered as stored, the "
        "least recently used forgotten first; 0: only a prompt's length decides",
    )
    balance_gap: float = Field(
        2.0,
        ge=0,
        description="A cold prompt goes straight to decode while the least loaded prefill engine has this many "
        "more requests (running + waiting) than the least loaded decode engine, so a burst is split across both "
        "pools instead of queueing on prefill; 0: cold prompts always through prefill",
    )


class DiscoveryConfig(StrictModel):
    """Backends from Kubernetes EndpointSlices (the proxy's ServiceAccount may list/watch them)."""

    namespace: str = Field(description="The namespace of prefill_service, decode_service and resource")
    prefill_service: str | None = Field(None, description="Service whose EndpointSlices are prefill backends")
    decode_service: str = Field(description="Service whose EndpointSlices are decode backends")
    port_name: str = Field("http", description="EndpointSlice port name of the vLLM server")
    api_server: str | None = Field(None, description="Default: the in-cluster API server")
    token_path: Path = Field(
        Path("/var/run/secrets/kubernetes.io/serviceaccount/token"),
        description="Bearer token for the API server, re-read for every request (a missing file: none sent)",
    )
    ca_path: Path | None = Field(
        Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"),
        description="CA bundle that verifies the API server's certificate; null or a missing file: the system's CAs",
    )
    resource: str | None = Field(
        None, description="The UCMDeployment whose status.pdPath this proxy writes (the PD path check's result)"
    )


class ProxyConfig(StrictModel):
    host: str = Field("127.0.0.1", description="The address the proxy listens on (0.0.0.0: every IPv4 interface)")
    port: int = Field(8000, ge=0, le=65535, description="The port the proxy listens on")
    mode: Literal["pd", "mixed"] = Field("pd", description="pd: prefill then decode; mixed: whole requests")
    prefill: list[str] = Field(default_factory=list, description="Prefill backend base URLs")
    decode: list[str] = Field(default_factory=list, description="Decode (or mixed) backend base URLs")
    discovery: DiscoveryConfig | None = None
    backends_file: Path | None = Field(
        None,
        description='A JSON file {"prefill": [URLs], "decode": [URLs]} re-read whenever it changes, instead of '
        "prefill/decode (ucm up rewrites it to roll a pool)",
    )
    routing: RoutingConfig = RoutingConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    pd_check: PDCheckConfig = PDCheckConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    retries: int = Field(1, ge=0, le=10, description="Extra attempts on another backend per request phase")
    fallback_to_decode: bool = Field(False, description="pd: with no prefill backend, let decode do it all")
    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer tokens; empty: no auth")
    api_keys_file: Path | None = Field(None, description="File with one accepted key per line (a Secret)")
    backend_api_key_file: Path | None = Field(
        None,
        description="File with the key the engines require (vLLM's --api-key / VLLM_API_KEY), sent to every "
        "backend; a client's own Authorization is never forwarded",
    )
    metrics_token_file: Path | None = Field(
        None,
        description="File with the bearer token that /metrics and /pd-path then require (a Secret; re-read when it "
        "changes, one token per line during a rotation); none: they are open to whoever reaches the proxy",
    )
    cache_salt: Literal["client", "per_key", "none"] = Field(
        "client",
        description="A request's cache_salt: the client's own; per_key: derived from its API key (tenants "
        "cannot probe each other's cached prefixes; needs api_keys); none: removed",
    )
    max_body_bytes: int = Field(4 << 20, gt=0, description="Larger request bodies get 413")
    max_response_bytes: int = Field(
        64 << 20,
        ge=1 << 20,
        description="A non-streamed answer is held whole before it is sent: one larger than this gets 502 "
        "(ask with stream: true, which is relayed as it comes)",
    )
    max_in_flight: int = Field(
        1024, ge=1, description="Client requests handled at once (streams until they end); more get 429"
    )
    max_in_flight_bytes: int = Field(
        64 << 20,
        gt=0,
        description="Request body bytes held at once (what has arrived); a body that would pass it gets 429 as it "
        "arrives. A body costs up to ~8x its size while handled (token ids parsed into Python ints)",
    )
    max_client_bytes: int | None = Field(
        None,
        gt=0,
        description="Of max_in_flight_bytes, what one client (an IPv4 address, an IPv6 /64) may hold at once; more "
        "from it get 429, so a few idle uploads cannot hold the whole budget. Default: a quarter of "
        "max_in_flight_bytes, at least max_body_bytes. Behind a load balancer every client has its address: raise "
        "it to max_in_flight_bytes to turn it off",
    )
    max_header_bytes: int = Field(
        64 << 10,
        ge=1024,
        description="A request's line and headers together; larger heads get 431 and the connection closes",
    )
    max_header_count: int = Field(100, ge=16, description="Headers in a request; more get 431")

    @model_validator(mode="before")
    @classmethod
    def _kv_aware_mixed_pool(cls, data: Any) -> Any:
        """In mixed mode the decode pool computes prompts: with events, kv_aware is its default."""
        routing = data.get("routing") if isinstance(data, dict) and data.get("mode") == "mixed" else None
        if isinstance(routing, dict) and routing.get("kv_events") is not None and "decode" not in routing:
            return {**data, "routing": {**routing, "decode": "kv_aware"}}
        return data

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return checked_urls(urls)

    @model_validator(mode="after")
    def _enough_backends(self) -> ProxyConfig:
        sources = [
            s
            for s, given in (
                ("prefill/decode", self.prefill or self.decode),
                ("discovery", self.discovery),
                ("backends_file", self.backends_file),
            )
            if given
        ]
        if len(sources) > 1:
            raise ValueError(f"{' and '.join(sources)}: give one source of backends")
        if self.backends_file is not None:
            read_backends_file(self.backends_file)  # a missing or malformed file is a startup error
        elif self.discovery is None:
            if not self.decode and not (self.mode == "mixed" and self.prefill):
                raise ValueError("decode: at least one backend URL is needed (or discovery)")
            if self.mode == "pd" and not self.prefill and not self.fallback_to_decode:
                raise ValueError("prefill: mode pd needs prefill backends (or fallback_to_decode: true)")
        return self

    @model_validator(mode="after")
    def _keys_for_salts(self) -> ProxyConfig:
        if self.cache_salt == "per_key" and not self.api_keys and self.api_keys_file is None:
            raise ValueError("cache_salt: per_key needs api_keys or api_keys_file (the salt comes from the key)")
        return self

    @model_validator(mode="after")
    def _room_for_a_body(self) -> ProxyConfig:
        if self.max_in_flight_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_in_flight_bytes: {self.max_in_flight_bytes} is below max_body_bytes ({self.max_body_bytes}); "
                "the largest accepted body could never be admitted"
            )
        if self.max_client_bytes is not None and self.max_client_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_client_bytes: {self.max_client_bytes} is below max_body_bytes ({self.max_body_bytes}); "
                "the largest accepted body could never be admitted"
            )
        if self.max_client_bytes is not None and self.max_client_bytes > self.max_in_flight_bytes:
            raise ValueError(
                f"max_client_bytes: {self.max_client_bytes} is above max_in_flight_bytes "
                f"({self.max_in_flight_bytes}); set it equal to give one client the whole budget"
            )
        return self

    @property
    def client_bytes(self) -> int:
        """What one client may hold of the body budget (``max_client_bytes``, or its default)."""
        if self.max_client_bytes is not None:
            return self.max_client_bytes
        return max(self.max_in_flight_bytes // 4, self.max_body_bytes)

    def backend_key(self) -> str | None:
        """The engines' key; an unreadable or empty file is a startup error."""
        if self.backend_api_key_file is None:
            return None
        key = self.backend_api_key_file.read_text().strip()
        if not key:
            raise ConfigError(f"backend_api_key_file: {self.backend_api_key_file} is empty")
        if not (key.isascii() and key.isprintable()):
            raise ConfigError(
                f"backend_api_key_file: {self.backend_api_key_file} must hold one line of printable ASCII (the key "
                "itself): it goes into an HTTP header"
            )
        return key


def check_endpoint(endpoint: str) -> None:
    """A ZMQ endpoint the proxy can connect to: tcp://HOST:PORT or ipc://PATH (or @NAME, abstract)."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path:
        raise ValueError(f"{endpoint!r} is not a tcp://HOST:PORT or ipc://PATH endpoint")


def checked_urls(urls: list[str]) -> list[str]:
    for u in urls:
        if not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0:
            raise ValueError(f"{u!r} is not an http(s):// URL")
    return [u.rstrip("/") for u in urls]


def read_backends_file(path: Path) -> dict[str, list[str]]:
    """The prefill and decode URLs of a backends file, checked like the config's own lists."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"backends_file: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"backends_file: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"prefill", "decode"}:
        raise ConfigError(f'backends_file: {path} must be an object with "prefill" and "decode" lists of URLs')
    out = {}
    for role in ("prefill", "decode"):
        urls = data.get(role, [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ConfigError(f"backends_file: {path}: {role} must be a list of URLs")
        try:
            out[role] = checked_urls(urls)
        except ValueError as exc:
            raise ConfigError(f"backends_file: {path}: {role}: {exc}") from None
    return out
