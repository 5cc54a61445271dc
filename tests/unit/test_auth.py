"""API keys: sources, constant-time matching, exposure, tenant salts, and
that no key can be read or derived from the config hash, YAML or overrides."""

from types import SimpleNamespace

import pytest

from appliance.config.compose import ConfigError, resolve
from appliance.config.execution import resolve_execution
from appliance.server.auth import check_exposure, is_loopback, load_api_keys, match_key, tenant_salt


def server(**kw):
    base = dict(api_key=None, api_key_file=None, host="127.0.0.1", allow_unauthenticated=False, tenant_isolation=False)
    return SimpleNamespace(**{**base, **kw})


def test_keys_come_from_config_file_and_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenants\nsk-a\n\n  sk-b  \nsk-a\n")
    keys = load_api_keys(server(api_key="sk-cfg", api_key_file=str(f)), {"APPLIANCE_API_KEY": "sk-env"})
    assert keys == ("sk-cfg", "sk-a", "sk-b", "sk-env")
    assert load_api_keys(server(), {}) == ()
    with pytest.raises(ConfigError, match="cannot read it"):
        load_api_keys(server(api_key_file=str(tmp_path / "missing")), {})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_api_keys(server(api_key_file=str(tmp_path / "empty")), {})


def test_match_key():
    keys = ("sk-a", "sk-b")
    assert match_key("Bearer sk-a", ("sk-a-longer", "sk-a")) == 1
    assert match_key("Bearer sk-b", keys) == 1 and match_key("bearer sk-a", keys) == 0
    for header in ("", "Bearer", "Bearer sk-", "Bearer sk-a2", "Basic sk-a", "sk-a", "Bearer  "):
        assert match_key(header, keys) is None, header


def test_no_key_beyond_loopback_unless_allowed():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    check_exposure(server(), ())
    check_exposure(server(host="0.0.0.0"), ("sk",))
    check_exposure(server(host="0.0.0.0", allow_unauthenticated=True), ())
    with pytest.raises(ConfigError, match="no API key is set; set APPLIANCE_API_KEY"):
        check_exposure(server(host="0.0.0.0"), ())
    with pytest.raises(ConfigError, match="tenant_isolation=true needs API keys"):
        check_exposure(server(tenant_isolation=True), ())
    check_exposure(server(tenant_isolation=True), ("sk-a", "sk-b"))


def test_tenant_salts_differ_per_key_and_keep_the_request_salt():
    a, b = tenant_salt("sk-a", None), tenant_salt("sk-b", None)
    assert a != b and "sk-a" not in a
    assert tenant_salt("sk-a", "mine") == f"{a}:mine"


def test_the_key_changes_nothing_a_client_can_read():
    plain = resolve(["+profile=cpu"])
    one = resolve(["+profile=cpu", "server.api_key=sk-one"])
    two = resolve(["+profile=cpu", "server.api_key=sk-two"])
    assert one.cfg.server.api_key == "sk-one"  # the server still has it
    assert one.hash == two.hash != plain.hash and one.yaml == two.yaml
    assert "sk-one" not in one.yaml and "api_key: '***'" in one.yaml
    assert one.overrides == two.overrides == ("+profile=cpu", "server.api_key=***")
    ex = resolve_execution(one.cfg)
    assert ex.fingerprint(one.hash) == resolve_execution(two.cfg).fingerprint(two.hash)


def test_run_refuses_to_listen_beyond_loopback_without_a_key(cli):
    r = cli("run", "+profile=cpu", "model=tiny_random", "server.host=0.0.0.0", env={"APPLIANCE_API_KEY": ""})
    assert r.returncode == 2
    assert "server.host=0.0.0.0 accepts connections from other machines but no API key is set" in r.stderr


def test_api_key_flag_is_never_parsed_as_an_override(cli):
    """A key with characters the override grammar rejects would be echoed in
    its error; the flag hands it over as APPLIANCE_API_KEY instead."""
    key = "sk-a#b&c=d"
    r = cli("run", "+profile=cpu", "model=tiny_random", "server.host=0.0.0.0", "model.num_layers=-1",
            "--api-key", key, env={"APPLIANCE_API_KEY": ""})
    assert r.returncode == 2 and key not in r.stderr + r.stdout
    assert "num_layers" in r.stderr
