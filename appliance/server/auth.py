"""API keys: where they come from, how a request is checked, and the
per-tenant prefix-cache salt.

Keys come from ``server.api_key``, the file ``server.api_key_file`` (one
key per line: each line is a tenant) and the ``APPLIANCE_API_KEY``
environment variable, so a key need not appear in argv. No key is ever part
of the config hash, a metric label, a log line or an endpoint (the config
shows ``"***"``). Comparison is constant-time.

With ``server.tenant_isolation=true`` every request's ``cache_salt`` is
derived from the key it presented (plus its own ``cache_salt``), so one
tenant's prompts can never hit, and so never probe, another tenant's cached
prefixes.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

from appliance.errors import ConfigError

if TYPE_CHECKING:
    from appliance.config.schema import ServerConfig

ENV_KEY = "APPLIANCE_API_KEY"


def load_api_keys(server: ServerConfig, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Every accepted key, in a stable order; empty when the server is open."""
    keys = []
    if server.api_key:
        keys.append(server.api_key)
    if server.api_key_file:
        path = Path(os.path.expanduser(server.api_key_file))
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"server.api_key_file={server.api_key_file}: cannot read it ({e.strerror})") from None
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not file_keys:
            raise ConfigError(f"server.api_key_file={server.api_key_file} holds no key")
        keys += file_keys
    if environ.get(ENV_KEY):
        keys.append(environ[ENV_KEY])
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(server: ServerConfig, keys: tuple[str, ...]) -> None:
    """Refuse to listen beyond this machine without a key, unless asked to, and
    tenant isolation without keys to tell tenants apart."""
    if server.tenant_isolation and not keys:
        raise ConfigError(f"server.tenant_isolation=true needs API keys to tell tenants apart; set {ENV_KEY}, "
                          "server.api_key_file=PATH or server.api_key")
    if keys or is_loopback(server.host) or server.allow_unauthenticated:
        return
    raise ConfigError(
        f"server.host={server.host} accepts connections from other machines but no API key is set; "
        f"set {ENV_KEY}, server.api_key_file=PATH or server.api_key, "
        "or server.allow_unauthenticated=true to serve without authentication"
    )


def match_key(authorization: str, keys: tuple[str, ...]) -> Optional[int]:
    """Index of the key an ``Authorization: Bearer ...`` header presents, or
    None. Every key is compared, each in constant time over fixed-size
    digests, so neither a key's bytes nor its length show in the timing."""
    scheme, _, token = authorization.partition(" ")
    presented = hashlib.sha256(token.strip().encode() if scheme.lower() == "bearer" else b"").digest()
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(presented, hashlib.sha256(key.encode()).digest()) and found is None:
            found = i
    return found


def tenant_salt(key: str, cache_salt: Optional[str]) -> str:
    """The prefix-cache salt of a tenant's request: its key's digest, then the
    request's own salt (so a tenant can still partition its own cache)."""
    digest = hashlib.sha256(b"appliance-tenant:" + key.encode()).hexdigest()[:32]
    return digest if cache_salt is None else f"{digest}:{cache_salt}"
