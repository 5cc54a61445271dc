"""Cross-field rules of the serving sections (``kv_events``, ``router``,
the server's tracing endpoint, the chat template file): which endpoints a
section may bind or reach unauthenticated, what each needs installed, and
that a template file is one. Part of ``validate``."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Optional

from appliance.config.architectures import chat_format
from appliance.config.schema import ApplianceConfig, KVEventsConfig


def kv_events_problems(cfg: ApplianceConfig) -> list[str]:
    ev = cfg.kv_events
    problems = []
    if not ev.enabled:
        defaults = KVEventsConfig()
        for key in (f.name for f in dataclasses.fields(KVEventsConfig) if f.name != "enabled"):
            if getattr(ev, key) != getattr(defaults, key):
                problems.append(f"kv_events.{key}={getattr(ev, key)} has no effect with kv_events.enabled=false")
        return problems
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(ev, key)
        if value is None:
            continue
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
            problems.append(f"kv_events.{key}={value} must be a ZeroMQ endpoint (tcp://host:port, ipc://path "
                            f"or inproc://name)")
        elif scheme == "tcp" and not rest.rpartition(":")[2].isdigit():
            problems.append(f"kv_events.{key}={value} needs a port (tcp://host:port)")
    if ev.replay_endpoint is not None and ev.replay_endpoint == ev.endpoint:
        problems.append("kv_events.replay_endpoint must differ from kv_events.endpoint")
    for key, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        if getattr(ev, key) < low:
            problems.append(f"kv_events.{key}={getattr(ev, key)} must be at least {low}")
    if not cfg.cache.enable_prefix_caching:
        problems.append("kv_events.enabled=true publishes the prefix cache's blocks; it needs "
                        "cache.enable_prefix_caching=true")
    if ev.include_token_ids and cfg.server.tenant_isolation and not ev.token_ids_with_tenants:
        problems.append("kv_events.include_token_ids=true with server.tenant_isolation=true hands every tenant's "
                        "prompts (as token ids) to every subscriber; set kv_events.token_ids_with_tenants=true if "
                        "that is meant")
    if ev.token_ids_with_tenants and not ev.include_token_ids:
        problems.append("kv_events.token_ids_with_tenants=true has no effect without kv_events.include_token_ids=true")
    if (ev.curve_secret_key_file is None) != (ev.curve_authorized_keys is None):
        problems.append("kv_events: CURVE needs both curve_secret_key_file (this publisher's certificate) and "
                        "curve_authorized_keys (a folder of its subscribers' public certificates)")
    exposed = [v for v in (ev.endpoint, ev.replay_endpoint) if v is not None and not _loopback_endpoint(v)]
    if exposed and ev.curve_secret_key_file is None and not ev.allow_unauthenticated:
        problems.append(f"kv_events: {exposed[0]} is reachable from other machines, and every subscriber there would "
                        f"read the cache's blocks; set kv_events.curve_secret_key_file and "
                        f"kv_events.curve_authorized_keys (CURVE), bind 127.0.0.1, or set "
                        f"kv_events.allow_unauthenticated=true")
    elif ev.allow_unauthenticated and (not exposed or ev.curve_secret_key_file is not None):
        problems.append("kv_events.allow_unauthenticated=true has no effect: "
                        + ("CURVE authenticates the subscribers" if exposed else "every endpoint is local"))
    return problems


MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def chat_format_problems(cfg: ApplianceConfig) -> list[str]:
    """A harmony model (gpt-oss) reads its reasoning and tool calls from harmony's channels and renders its
    prompts with openai-harmony: the keys of the other chat format have nothing to do there."""
    m, s = cfg.model, cfg.server
    if chat_format(m.architecture) != "harmony":
        return []
    why = f"{m.architecture} speaks harmony (openai-harmony renders its prompts and reads its channels)"
    problems = []
    if s.reasoning_parser is not None:
        problems.append(f"server.reasoning_parser={s.reasoning_parser}: {why}, its analysis channel is its "
                        f"reasoning; leave it null")
    if s.tool_parser != "auto":
        problems.append(f"server.tool_parser={s.tool_parser}: {why}, its calls are messages to functions.NAME; "
                        f"leave it auto")
    if m.chat_template is not None:
        problems.append(f"model.chat_template={m.chat_template}: {why}, not a Jinja template; leave it null")
    return problems


def chat_template_problems(path: Optional[str]) -> list[str]:
    """``model.chat_template``: a readable UTF-8 file of at most 1 MiB that
    compiles as the tokenizer compiles chat templates."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CHAT_TEMPLATE_BYTES + 1)
    except OSError as e:
        return [f"model.chat_template={path} cannot be read: {e.strerror or e}"]
    if len(raw) > MAX_CHAT_TEMPLATE_BYTES or not raw.strip():
        return [f"model.chat_template={path} must be a Jinja template of 1 to {MAX_CHAT_TEMPLATE_BYTES} bytes"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return [f"model.chat_template={path} is not UTF-8 text"]
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        return [f"model.chat_template={path} is not a valid Jinja template: {e}"]
    return []


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (localhost or a loopback address); ``*``, an interface
    or another host name is possibly reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_endpoint(endpoint: str) -> bool:
    """Whether only this machine can reach a ZeroMQ endpoint (ipc, inproc, or tcp on a loopback address)."""
    scheme, _, rest = endpoint.partition("://")
    return scheme != "tcp" or is_loopback(rest.rpartition(":")[0].strip("[]"))


ROUTER_POLICIES = ("round_robin", "least_load", "kv_aware", "pd")  # built


TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
TRACING_EXTRA = "pip install 'appliance[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"


def tracing_problems(endpoint: Optional[str]) -> list[str]:
    """server.otlp_traces_endpoint: an http(s) URL with a host, and the tracing extra installed."""
    if endpoint is None:
        return []
    from importlib.util import find_spec
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        return [f"server.otlp_traces_endpoint={endpoint!r} must be an OTLP/HTTP URL, http(s)://host:port[/v1/traces] "
                f"(gRPC collectors take OTLP/HTTP on port 4318)"]

    def missing(module: str) -> bool:
        try:
            return find_spec(module) is None
        except ModuleNotFoundError:
            return True

    absent = [m for m in TRACING_MODULES if missing(m)]
    if absent:
        return [f"server.otlp_traces_endpoint needs OpenTelemetry, which is not installed ({', '.join(absent)} "
                f"missing): {TRACING_EXTRA}"]
    return []


def router_problems(cfg: ApplianceConfig) -> list[str]:
    r = cfg.router
    problems = []
    if r.policy not in ROUTER_POLICIES:
        problems.append(f"router.policy={r.policy} is unknown; built: {', '.join(ROUTER_POLICIES)}")
    for key in ("instances", "prefill_instances"):
        for u in getattr(r, key):
            if not str(u).startswith(("http://", "https://")):
                problems.append(f"router.{key}: {u} is not an http:// or https:// base URL")
    if r.policy == "pd" and r.instances and not r.prefill_instances:
        problems.append("router.policy=pd needs router.prefill_instances: the producers' base URLs (instances with "
                        "kv_transfer=p2p kv_transfer.role=producer); router.instances are the consumers")
    if r.policy != "pd" and r.prefill_instances:
        problems.append(f"router.prefill_instances has no effect with router.policy={r.policy}")
    if r.policy == "kv_aware" and r.instances and len(r.kv_events) != len(r.instances):
        problems.append(f"router.policy=kv_aware needs one KV events endpoint per instance (router.kv_events, in the "
                        f"order of router.instances): {len(r.kv_events)} for {len(r.instances)}")
    if r.policy != "kv_aware" and r.kv_events:
        problems.append(f"router.kv_events has no effect with router.policy={r.policy}")
    if r.kv_events_replay and (r.policy != "kv_aware" or len(r.kv_events_replay) != len(r.kv_events)):
        problems.append(f"router.kv_events_replay: one replay endpoint per entry of router.kv_events, with "
                        f"router.policy=kv_aware ({len(r.kv_events_replay)} for {len(r.kv_events)}, policy "
                        f"{r.policy})")
    curve = (r.kv_events_client_key_file, r.kv_events_server_key_file)
    if (curve[0] is None) != (curve[1] is None):
        problems.append("router: CURVE subscriptions need both kv_events_client_key_file (the router's certificate) "
                        "and kv_events_server_key_file (the instances' publisher certificate)")
    elif curve[0] is not None and r.policy != "kv_aware":
        problems.append(f"router.kv_events_client_key_file has no effect with router.policy={r.policy}")
    if not 0 < r.port < 65536:
        problems.append(f"router.port={r.port} must be in 1..65535")
    for key in ("health_interval_s", "request_timeout_s"):
        if not getattr(r, key) > 0:
            problems.append(f"router.{key}={getattr(r, key)} must be positive")
    if r.kv_load_weight < 0:
        problems.append(f"router.kv_load_weight={r.kv_load_weight} must not be negative")
    if not 0 <= r.kv_match_threshold <= 1:
        problems.append(f"router.kv_match_threshold={r.kv_match_threshold} must be in [0, 1]")
    return problems
