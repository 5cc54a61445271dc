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

The deployment's internal key (``server.internal_key``, the file
``server.internal_key_file`` or ``APPLIANCE_INTERNAL_KEY``) is the secret
its instances and router share: the router signs the requests it sends
with ``kv_transfer_params`` (``SIGNATURE_HEADER``: an HMAC-SHA256 of the
body), and producers and consumers sign every KV transfer message with it
(``engine/kv_p2p.py``). It is kept out of the config hash, logs and
endpoints as API keys are.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

from appliance.config.validate_serving import is_loopback
from appliance.errors import ConfigError

if TYPE_CHECKING:
    from appliance.config.schema import ServerConfig

ENV_KEY = "APPLIANCE_API_KEY"
INTERNAL_KEY_ENV = "APPLIANCE_INTERNAL_KEY"
SIGNATURE_HEADER = "x-appliance-signature"  # an internal request's HMAC of its body: "sha256=<hex>"
MIN_INTERNAL_KEY_BYTES = 16


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


def load_internal_key(server: ServerConfig, environ: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """The deployment's internal key (see the module docstring), or None when
    none is set. ``server.internal_key`` wins over the file, the file over
    the environment; a key shorter than 16 bytes is refused."""
    key, source = server.internal_key, "server.internal_key"
    if key is None and server.internal_key_file:
        path = Path(os.path.expanduser(server.internal_key_file))
        try:
            key = path.read_text().strip()
        except OSError as e:
            raise ConfigError(f"server.internal_key_file={server.internal_key_file}: cannot read it "
                              f"({e.strerror})") from None
        source = f"server.internal_key_file={server.internal_key_file}"
    if key is None and environ.get(INTERNAL_KEY_ENV):
        key, source = environ[INTERNAL_KEY_ENV].strip(), INTERNAL_KEY_ENV
    if key is None:
        return None
    if len(key.encode()) < MIN_INTERNAL_KEY_BYTES:
        raise ConfigError(f"{source}: the internal key must hold at least {MIN_INTERNAL_KEY_BYTES} bytes")
    return key.encode()


def need_internal_key(server: ServerConfig, what: str, environ: Mapping[str, str] = os.environ) -> bytes:
    """The internal key, or a ConfigError saying that ``what`` needs one."""
    key = load_internal_key(server, environ)
    if key is None:
        raise ConfigError(f"{what} needs the deployment's internal key, shared by its instances and router: set "
                          f"{INTERNAL_KEY_ENV}, server.internal_key_file=PATH or server.internal_key (at least "
                          f"{MIN_INTERNAL_KEY_BYTES} bytes; e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return key


def sign_request(key: bytes, body: bytes) -> str:
    """``SIGNATURE_HEADER``'s value for an internal request with this body."""
    return "sha256=" + hmac.new(key, b"appliance-internal-request-v1\0" + body, hashlib.sha256).hexdigest()


def verify_request(key: Optional[bytes], body: bytes, signature: Optional[str]) -> bool:
    """Whether a request's body is signed with the internal key (constant time)."""
    if key is None or not signature:
        return False
    return hmac.compare_digest(signature.strip().encode(), sign_request(key, body).encode())


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
