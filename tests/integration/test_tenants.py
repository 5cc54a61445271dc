"""Keys from a file and the environment, tenant isolation of the prefix
cache, and nothing an unauthenticated client reads depends on the key."""

import httpx
import pytest

from appliance.config.compose import resolve
from tests.integration.server_helpers import ServerProcess

TINY = ["model=tiny_random", "cache.kv_cache_memory_gib=0.05", "cache.block_size=4"]
PROMPT = "A scheduler hands out tokens under one budget every step. " * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("sk-tenant-a\nsk-tenant-b\n")
    s = ServerProcess(*TINY, f"server.api_key_file={keys}", "server.tenant_isolation=true",
                      env={"APPLIANCE_API_KEY": "sk-tenant-env"})
    yield s
    s.stop()


def complete(server, key, prompt=PROMPT, **extra):
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})


def cached(r):
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_every_key_source_is_accepted_and_others_refused(server):
    for key in ("sk-tenant-a", "sk-tenant-b", "sk-tenant-env"):
        assert complete(server, key).status_code == 200, key
    assert complete(server, "sk-tenant-c").status_code == 401


def test_tenants_cannot_see_each_others_cached_prefixes(server):
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 4  # not sent before
    assert cached(complete(server, "sk-tenant-a", prompt)) == 0
    assert cached(complete(server, "sk-tenant-a", prompt)) > 0  # a tenant still reuses its own prefixes
    assert cached(complete(server, "sk-tenant-b", prompt)) == 0
    assert cached(complete(server, "sk-tenant-env", prompt)) == 0
    assert cached(complete(server, "sk-tenant-a", prompt, cache_salt="other")) == 0  # and can partition its own


def test_unauthenticated_responses_do_not_depend_on_the_key(server):
    body = {path: httpx.get(f"{server.url}{path}", timeout=10).text for path in ("/metrics", "/version", "/health")}
    assert not any(k in text for text in body.values() for k in ("sk-tenant", "api_key"))
    version = httpx.get(f"{server.url}/version", timeout=10).json()
    # The hash a client reads is the declarative config's: the keys in the file are not part of it.
    overrides = ["+profile=cpu", *TINY, f"server.api_key_file={server_key_file(server)}", "server.tenant_isolation=true",
                 "server.host=127.0.0.1", f"server.port={server.port}"]
    assert version["config_hash"] == resolve(overrides).hash
    cfg = httpx.get(f"{server.url}/v1/appliance/config", headers={"Authorization": "Bearer sk-tenant-a"}, timeout=10)
    assert "sk-tenant" not in cfg.text


def server_key_file(server):
    return next(a.split("=", 1)[1] for a in server.proc.args if a.startswith("server.api_key_file="))


def test_one_key_never_reads_continues_or_deletes_anothers_stored_response(server):
    def call(method, path, key, **kw):
        return httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                             **kw)

    r = call("POST", "/v1/responses", "sk-tenant-a", json={"input": "Hello", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["store"] is True, r.text
    rid = r.json()["id"]
    assert call("GET", f"/v1/responses/{rid}", "sk-tenant-a").json()["id"] == rid
    for method, path, body in (("GET", f"/v1/responses/{rid}", None), ("DELETE", f"/v1/responses/{rid}", None),
                               ("POST", "/v1/responses", {"input": "More", "previous_response_id": rid})):
        assert call(method, path, "sk-tenant-b", json=body).status_code == 404, (method, path)
    assert call("GET", f"/v1/responses/{rid}", "sk-tenant-a").status_code == 200  # still there for its owner
