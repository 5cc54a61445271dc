"""What one revision's tree resolves its deployments to: the half of
``appliance review`` that runs inside a revision.

``appliance review`` runs this file's source with ``python -c`` in a
checkout of each revision, with that revision's own code on the path when
the revision carries the package (else the installed one) and its config
tree as ``APPLIANCE_CONF_DIR``: a change to a default in the code shows as
plainly as one in ``conf/``. It reads a JSON request (argv[1]) and writes a
JSON answer to the file argv[2]: for every profile and every deployment file
named, the canonical resolved YAML, the plan, or why it does not validate.

It uses only the entry points every revision keeps (``resolve``,
``list_profiles``, ``make_plan``, ``load_resolved_file``, ``validate``), so
a base revision older than this file is reviewed all the same.

A deployment file is either a resolved config (the YAML ``appliance config``
prints, a mapping) or Hydra overrides, one or more a line, ``#`` comments:
what ``appliance run @FILE`` reads (``overrides_from_text``).
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable


def overrides_from_text(text: str) -> list[str]:
    """The overrides of a deployment file: shell words of each line, ``#`` to the end of a line a comment."""
    return [word for line in text.splitlines() for word in shlex.split(line, comments=True)]


def is_resolved_config(text: str) -> bool:
    """Whether a deployment file holds a resolved config (a YAML mapping) rather than overrides."""
    import yaml

    try:
        return isinstance(yaml.safe_load(text), dict)
    except yaml.YAMLError:
        return False


def _message(e: BaseException) -> str:
    return str(e).strip() or type(e).__name__


def _entry(load: Callable[[bool], Any]) -> dict[str, Any]:
    """``load(check)`` -> a ResolvedConfig. What it resolves to, validated; when it
    does not validate, why, and what it composes to unvalidated (still diffable)."""
    from appliance.config.plan import make_plan

    out: dict[str, Any] = {"yaml": None, "plan": None, "error": None}
    try:
        r = load(True)
    except Exception as e:  # noqa: BLE001 (every failure is reported, none ends the review)
        out["error"] = _message(e)
        try:
            r = load(False)
        except Exception:  # noqa: BLE001
            return out
    out["yaml"] = r.yaml
    try:
        out["plan"] = make_plan(r.cfg).to_dict()
    except Exception as e:  # noqa: BLE001
        out["error"] = out["error"] or f"no plan: {_message(e)}"
    return out


def _file_loader(path: Path) -> Callable[[bool], Any]:
    from appliance.config.compose import ConfigError, resolve

    text = path.read_text()
    if not is_resolved_config(text):
        overrides = overrides_from_text(text)
        return lambda check: resolve(overrides, check=check)

    def load(check: bool) -> Any:
        from appliance.config.lock import load_resolved_file
        from appliance.config.validate import validate

        r = load_resolved_file(path)
        problems = validate(r.cfg) if check else []
        if problems:
            raise ConfigError("the deployment is invalid:\n" + "\n".join(f"  - {p}" for p in problems))
        return r

    return load


def _resolve_profile(name: str, check: bool) -> Any:
    from appliance.config.compose import resolve

    return resolve([f"+profile={name}"], check=check)


def dump(request: dict[str, Any], root: Path) -> dict[str, Any]:
    """{"profiles": {name: entry}, "files": {path: entry}} for ``request``'s ``files`` (relative to ``root``)."""
    from appliance.config.compose import list_profiles

    profiles = {name: _entry(functools.partial(_resolve_profile, name)) for name in list_profiles()}
    files = {rel: _entry(_file_loader(root / rel)) for rel in request.get("files", [])}
    return {"profiles": profiles, "files": files}


def main() -> None:
    request, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    out.write_text(json.dumps(dump(request, Path.cwd()), default=str))


if __name__ == "__main__":
    main()
