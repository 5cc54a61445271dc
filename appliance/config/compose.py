"""Compose, type-check and validate the config tree.

``resolve(overrides)`` is the one entry: Hydra composes ``conf/`` (with
``profiles/`` reachable as the ``profile`` group), a local checkpoint named by
``model.path`` supplies the model's architecture keys (``checkpoint.py``), the
typed schema rejects unknown keys and bad values, ``+profile=auto`` (or no
profile) is replaced by the detected machine's profile, and the cross-field
rules run. The result is a frozen, hashable ``ResolvedConfig``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Sequence, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from appliance.config import schema
from appliance.config.checkpoint import apply_checkpoint
from appliance.config.paths import REPO_ROOT, conf_dir  # noqa: F401 (REPO_ROOT: imported from here)
from appliance.errors import ConfigError



def profiles_dir() -> Path:
    return conf_dir() / "profile"


def list_profiles() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def list_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


SECRET_KEYS = ("server.api_key", "server.internal_key")
REDACTED = "***"


def _redact(obj: Any) -> Any:
    """``obj`` with every secret replaced by ``***``: what the YAML, the hash and
    every endpoint see, so no secret can be read or guessed from them."""
    from dataclasses import replace

    for path in SECRET_KEYS:
        group, key = path.split(".")
        section = getattr(obj, group)
        if getattr(section, key) is not None:
            obj = replace(obj, **{group: replace(section, **{key: REDACTED})})
    return obj


def _plain_values(obj: Any) -> Any:
    """The typed tree with every enum member replaced by its string, once:
    nothing downstream unwraps a value (the schema's enums only check them)."""
    from dataclasses import fields, is_dataclass, replace

    if isinstance(obj, Enum):
        return obj.value
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _plain_values(getattr(obj, f.name)) for f in fields(obj) if f.init})
    if isinstance(obj, list):
        return [_plain_values(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _plain_values(v) for k, v in obj.items()}
    return obj


def _redact_override(o: str) -> str:
    key, sep, value = o.partition("=")
    return f"{key}={REDACTED}" if sep and value and key.lstrip("+~") in SECRET_KEYS else o


@dataclass(frozen=True)
class ResolvedConfig:
    cfg: schema.ApplianceConfig  # plain values; secrets included (the server needs them)
    yaml: str  # canonical YAML of the whole tree, secrets redacted
    overrides: tuple[str, ...]  # secrets redacted
    profile_reason: Optional[str] = None

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.yaml.encode()).hexdigest()[:16]

    def as_dict(self) -> dict:
        return cast(dict, OmegaConf.to_container(OmegaConf.create(self.yaml)))


def _profile_override(overrides: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """Split out ``+profile=NAME`` / ``profile=NAME``; return (name, rest)."""
    name, rest = None, []
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key.lstrip("+~") == "profile":
            name = value
        else:
            rest.append(o)
    return name, rest


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    schema.register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return compose(config_name="appliance", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain_compose_error(e, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def _explain_compose_error(e: BaseException, overrides: list[str]) -> str:
    # Hydra wraps the OmegaConf error that names the key; read the whole chain.
    chain = []
    link: Optional[BaseException] = e
    while link is not None:
        chain.append(str(link).strip())
        link = link.__cause__ or link.__context__
    text = "\n".join(chain)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    if "Could not find 'profile/" in text:
        return f"unknown profile; available profiles: {', '.join(list_profiles())} (or auto)"
    if "Could not find" in text or "Could not load" in text:
        first = next(ln for ln in lines if "Could not" in ln)
        for group in ("model", "quantization", "parallel", "scheduler", "cache", "hardware", "server", "speculative",
                      "structured_output"):
            if f"'{group}/" in first:
                return f"{first}; available {group} options: {', '.join(list_options(group))}"
        return first
    for ln in lines:
        if ln.startswith("Key '") and " not in " in ln:
            where = full_key or ln
            parent = where.rsplit(".", 1)[0] if "." in where else ""
            allowed = _allowed_keys(parent)
            hint = f"; allowed keys under {parent or 'the top level'}: {', '.join(allowed)}" if allowed else ""
            return f"unknown config key {where}{hint}"
        if ln.startswith("Invalid value") or "could not be converted" in ln or ln.startswith("Value '"):
            return f"{full_key}: {ln}" if full_key else ln
    return lines[0] + (f" (key {full_key})" if full_key else "") if lines else "invalid config"


def _allowed_keys(path: str) -> list[str]:
    node: Any = OmegaConf.structured(schema.ApplianceConfig)
    for part in [p for p in path.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return []
        node = node[part]
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


NGRAM_LOOKUP_DEFAULT = 5  # prompt_lookup_min and _max when neither is set (vLLM's)


def _fill_prompt_lookup(plain: dict) -> None:
    """n-gram lookup lengths: both 5 when neither is set, else the one set for both."""
    spec = plain.get("speculative") or {}
    if spec.get("method") != "ngram":
        return
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = NGRAM_LOOKUP_DEFAULT
    spec["prompt_lookup_min"] = hi if lo is None else lo
    spec["prompt_lookup_max"] = lo if hi is None else hi


def resolve(overrides: Sequence[str] = (), *, check: bool = True, device: Any = None) -> ResolvedConfig:
    """Compose ``conf/`` with Hydra-style overrides into a validated config.

    ``device`` is a ``DeviceDescription`` for ``+profile=auto``; detected
    from torch when omitted.
    """
    profile, rest = _profile_override(overrides)
    reason = None
    if profile is None or profile == "auto":
        from appliance.config.detect import detect_device, pick_profile

        profile, reason = pick_profile(device or detect_device())
    if profile not in list_profiles():
        raise ConfigError(f"unknown profile {profile!r}; available profiles: {', '.join(list_profiles())} (or auto)")
    composed = _compose([f"+profile={profile}", *rest])
    try:
        # `+key=value` can add keys past struct mode; a fresh typed merge
        # rejects them like any other unknown key.
        plain = cast(dict, OmegaConf.to_container(composed, resolve=True))
        # A local checkpoint's own facts replace the model option's numbers.
        checkpoint_problems = apply_checkpoint(plain, rest)
        _fill_prompt_lookup(plain)
        obj = _plain_values(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema.ApplianceConfig), plain)))
    except OmegaConfBaseException as e:
        raise ConfigError(_explain_compose_error(e, rest)) from None
    if check and checkpoint_problems:
        raise ConfigError("the checkpoint at model.path cannot be used as configured:\n"
                          + "\n".join(f"  - {p}" for p in checkpoint_problems))
    canonical = OmegaConf.to_yaml(OmegaConf.structured(_redact(obj)), sort_keys=True)
    resolved = ResolvedConfig(cfg=obj, yaml=canonical, profile_reason=reason,
                              overrides=tuple(_redact_override(o) for o in [f"+profile={profile}", *rest]))
    if check:
        from appliance.config.validate import validate

        problems = validate(obj)
        if problems:
            raise ConfigError(
                f"the deployment (profile {profile}) is invalid:\n" + "\n".join(f"  - {p}" for p in problems)
            )
    return resolved
