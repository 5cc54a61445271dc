"""``appliance review``: what a change to the config tree does to every
deployment, between two revisions of a git checkout.

Each revision is evaluated by itself (``review_dump.py``, run in a checkout
of it: its own code when it carries the package, its own config tree and
deployment files); here the two answers are compared deployment by
deployment: the resolved keys that changed, and what that does to the plan
(dtype, backend, KV blocks and bytes per token, token budget, parallel
layout, rooflines, ...). A deployment that no longer validates at head is
reported with the validation message and makes the review fail; a change
alone never does. Markdown for a pull-request comment or a job summary, or
JSON.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from appliance.errors import ConfigError

DUMP_SOURCE = Path(__file__).with_name("review_dump.py")
DUMP_TIMEOUT_S = 600
# Plan fields left out of the comparison: prose, and what the reviewing machine probed.
PLAN_PROSE = ("summary", "notes", "execution", "attention_provider_here")
# What a new deployment's plan is summed up by.
PLAN_HEADLINE = ("profile", "model", "hardware", "dtype", "quantization", "kv_cache_dtype", "attention_backend",
                 "parallel.tensor_parallel_size", "parallel.pipeline_parallel_size", "parallel.data_parallel_size",
                 "parallel.expert_parallel_size", "weight_bytes_per_device", "kv_bytes_per_token", "num_kv_blocks",
                 "kv_tokens", "max_model_len", "token_budget", "decode_roofline_tok_s", "prefill_roofline_tok_s")


@dataclass
class Revision:
    """One side of the review: a commit, or the working tree as it is (``commit`` None; the label says
    which commit it is at and whether it holds uncommitted changes)."""

    label: str
    commit: Optional[str]
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Change:
    key: str
    base: Any
    head: Any


@dataclass
class DeploymentReview:
    name: str  # "cpu" (a profile) or the deployment file's path
    kind: str  # "profile" or "file"
    status: str  # changed, unchanged, added, removed, invalid (at head)
    keys: list[Change] = field(default_factory=list)
    plan: list[Change] = field(default_factory=list)
    head_error: Optional[str] = None
    base_error: Optional[str] = None


@dataclass
class Review:
    base: Revision
    head: Revision
    deployments: list[DeploymentReview]

    @property
    def failed(self) -> bool:
        return any(d.status == "invalid" for d in self.deployments)

    def to_dict(self) -> dict[str, Any]:
        side = lambda r: {"label": r.label, "commit": r.commit}  # noqa: E731
        return {"base": side(self.base), "head": side(self.head),
                "deployments": [asdict(d) for d in self.deployments], "failed": self.failed}


# -- the revisions ---------------------------------------------------------------------
def _git(root: Path, *args: str) -> str:
    p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError(f"git {' '.join(args)}: {p.stderr.strip() or 'failed'}")
    return p.stdout.strip()


def git_root(cwd: Path) -> Path:
    try:
        return Path(_git(cwd, "rev-parse", "--show-toplevel"))
    except (ConfigError, FileNotFoundError):
        raise ConfigError(f"appliance review compares revisions of a git checkout; {cwd} is not in one") from None


def _commit(root: Path, rev: str) -> str:
    try:
        return _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except ConfigError:
        raise ConfigError(f"no commit {rev!r} in {root} (fetch it first: the review reads both revisions "
                          f"from this checkout)") from None


def _extract(root: Path, commit: str, dest: Path) -> None:
    data = subprocess.run(["git", "archive", "--format=tar", commit], cwd=root, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def _matching(tree: Path, patterns: list[str]) -> list[str]:
    return sorted({str(p.relative_to(tree)) for pat in patterns for p in tree.glob(pat) if p.is_file()})


def _evaluate(rev: Revision, tree: Path, root: Path, patterns: list[str]) -> None:
    """Fill ``rev`` from ``review_dump`` run in ``tree`` (a checkout of it)."""
    env = dict(os.environ)
    if (tree / "appliance" / "__init__.py").is_file():  # the revision's own code
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    conf = os.environ.get("APPLIANCE_CONF_DIR")
    rel = None
    if conf:
        try:
            rel = Path(conf).resolve().relative_to(root)
        except ValueError:
            rel = None  # a tree outside the checkout: the same for both revisions
    if rel is not None or (tree / "conf" / "appliance.yaml").is_file():
        env["APPLIANCE_CONF_DIR"] = str(tree / (rel or "conf"))
    request = {"files": _matching(tree, patterns)}
    with tempfile.TemporaryDirectory(prefix="appliance-review-") as tmp:
        out = Path(tmp) / "dump.json"
        try:
            p = subprocess.run([sys.executable, "-c", DUMP_SOURCE.read_text(), json.dumps(request), str(out)],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{rev.label}: resolving its deployments took over {DUMP_TIMEOUT_S} s") from None
        if p.returncode != 0 or not out.exists():
            tail = "\n".join(p.stderr.strip().splitlines()[-5:])
            raise ConfigError(f"{rev.label}: its deployments could not be resolved:\n{tail}")
        dumped = json.loads(out.read_text())
    rev.profiles, rev.files = dumped["profiles"], dumped["files"]


def load_revisions(cwd: Path, base: str, head: Optional[str], deployments: list[str]) -> tuple[Revision, Revision]:
    root = git_root(cwd)
    revs = []
    for label, rev in ((f"base {base}", base), (f"head {head}" if head else "head (working tree)", head)):
        if rev is None:
            r = Revision(label, None)
            _evaluate(r, root, root, deployments)
            try:
                r.label += f" at {_git(root, 'rev-parse', '--short=12', 'HEAD')}"
                if _git(root, "status", "--porcelain", "--untracked-files=no"):
                    r.label += ", with uncommitted changes"
            except ConfigError:
                pass  # a repository without a commit yet
        else:
            commit = _commit(root, rev)
            r = Revision(label, commit)
            with tempfile.TemporaryDirectory(prefix="appliance-review-tree-") as tmp:
                _extract(root, commit, Path(tmp))
                _evaluate(r, Path(tmp), root, deployments)
        revs.append(r)
    return revs[0], revs[1]


# -- the comparison --------------------------------------------------------------------
def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


ABSENT = "<absent>"


def _changes(a: dict[str, Any], b: dict[str, Any]) -> list[Change]:
    keys = list(a) + [k for k in b if k not in a]
    return [Change(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in keys if a.get(k, ABSENT) != b.get(k, ABSENT)]


def _plan_fields(plan: Optional[dict[str, Any]]) -> dict[str, Any]:
    return _flatten({k: v for k, v in (plan or {}).items() if k not in PLAN_PROSE}) if plan else {}


def _config_keys(entry: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(_flatten(yaml.safe_load(entry["yaml"])).items())) if entry.get("yaml") else {}


def compare(name: str, kind: str, base: Optional[dict[str, Any]], head: Optional[dict[str, Any]]) -> DeploymentReview:
    if head is None:
        return DeploymentReview(name, kind, "removed", base_error=(base or {}).get("error"))
    head_plan = _plan_fields(head.get("plan"))
    if base is None:
        d = DeploymentReview(name, kind, "added",
                             plan=[Change(k, ABSENT, head_plan[k]) for k in PLAN_HEADLINE if k in head_plan])
    else:
        d = DeploymentReview(name, kind, "changed", keys=_changes(_config_keys(base), _config_keys(head)),
                             plan=_changes(_plan_fields(base.get("plan")), head_plan), base_error=base.get("error"))
        if not d.keys and not d.plan and d.base_error is None and head.get("error") is None:
            d.status = "unchanged"
    if head.get("error") is not None:
        d.status, d.head_error = "invalid", head["error"]
    return d


def review(base: Revision, head: Revision) -> Review:
    out = []
    for kind, attr in (("profile", "profiles"), ("file", "files")):
        a, b = getattr(base, attr), getattr(head, attr)
        for name in sorted(set(a) | set(b)):
            out.append(compare(name, kind, a.get(name), b.get(name)))
    return Review(base, head, out)


# -- the report ------------------------------------------------------------------------
def _cell(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if text else "`\"\"`"


def _side(r: Revision) -> str:
    return f"{r.label} ({r.commit[:12]})" if r.commit else r.label


def _title(d: DeploymentReview) -> str:
    return f"profile `{d.name}`" if d.kind == "profile" else f"deployment file `{d.name}`"


def _table(head: str, rows: list[str]) -> str:
    return "\n".join([head, "|" + "---|" * head.count(" | ") + "---|", *rows])


def _section(d: DeploymentReview) -> list[str]:
    """A changed deployment's paragraphs."""
    out = [f"### {_title(d)}: {d.status}"]
    if d.head_error:
        out.append(f"Does not validate at head:\n\n```\n{d.head_error}\n```")
    if d.base_error and d.status != "removed":
        out.append(f"Did not validate at base: {d.base_error.splitlines()[0]}")
    if d.status == "removed":
        out.append("The deployment is gone at head.")
    if d.keys:
        out.append(_table("| key | base | head |", [f"| `{c.key}` | {_cell(c.base)} | {_cell(c.head)} |"
                                                     for c in d.keys]))
    if d.status == "invalid":  # what changed in its keys says why; a plan of an invalid config says nothing
        return out
    if d.plan and d.status == "added":
        out += ["Its plan:", _table("| plan | head |", [f"| `{c.key}` | {_cell(c.head)} |" for c in d.plan])]
    elif d.plan:
        out += ["Effect on the plan:", _table("| plan | base | head |",
                                              [f"| `{c.key}` | {_cell(c.base)} | {_cell(c.head)} |" for c in d.plan])]
    elif d.keys:
        out.append("Effect on the plan: none.")
    return out


def markdown(rv: Review) -> str:
    changed = [d for d in rv.deployments if d.status != "unchanged"]
    unchanged = [d for d in rv.deployments if d.status == "unchanged"]
    n_invalid = sum(d.status == "invalid" for d in changed)
    invalid = f"; **{n_invalid} {'does' if n_invalid == 1 else 'do'} not validate at head**" if n_invalid else ""
    paragraphs = ["## Config review", f"{_side(rv.base)} → {_side(rv.head)}",
                  f"{len(changed)} of {len(rv.deployments)} deployments change{invalid}."]
    for d in changed:
        paragraphs += _section(d)
    if unchanged:
        paragraphs.append("Unchanged: " + ", ".join(_title(d) for d in unchanged) + ".")
    return "\n\n".join(paragraphs) + "\n"


def run_review(base: str, head: Optional[str], deployments: list[str], fmt: str, cwd: Optional[Path] = None) -> int:
    rv = review(*load_revisions(cwd or Path.cwd(), base, head, deployments))
    sys.stdout.write(json.dumps(rv.to_dict(), indent=2, default=str) + "\n" if fmt == "json" else markdown(rv))
    return 1 if rv.failed else 0
