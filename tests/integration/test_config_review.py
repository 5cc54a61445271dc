"""`appliance review` between two revisions, and the CI files that run it,
on throwaway git repositories: a pull request's branch against its target
branch, cloned from a bare "origin" as a CI job sees them."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from appliance.cli import build_parser
from appliance.config.review import ABSENT, compare
from tests.conftest import REPO

BIN = os.path.dirname(sys.executable)  # where the `appliance` the CI files call is installed
APPLIANCE = os.path.join(BIN, "appliance")
GIT = ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci"]


def git(cwd, *args):
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_CONF_DIR"}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return {**env, **extra}


@pytest.fixture
def checkout(tmp_path):
    """A deployments repository (the config tree, no code: the installed appliance reads it) pushed to a
    bare origin at `main`, and a clone of it on a branch, as a CI job checks out a pull request."""
    seed = tmp_path / "seed"
    seed.mkdir()
    shutil.copytree(os.path.join(REPO, "conf"), seed / "conf", symlinks=True)
    shutil.copytree(os.path.join(REPO, "profiles"), seed / "profiles")
    (seed / "deployments").mkdir()
    (seed / "deployments" / "chat.args").write_text("# the chat service\n+profile=cpu_int8\n"
                                                    "model.max_model_len=1024  # short prompts\n")
    (seed / "README.md").write_text("deployments\n")
    git(seed, "init", "-q", "-b", "main")
    git(seed, "add", "-A")
    git(seed, "commit", "-qm", "base")
    git(tmp_path, "clone", "-q", "--bare", str(seed), "origin.git")
    git(tmp_path, "clone", "-q", str(tmp_path / "origin.git"), "work")
    work = tmp_path / "work"
    git(work, "checkout", "-q", "-b", "change")
    return work


def _commit(work, message):
    git(work, "commit", "-qam", message)


def test_github_workflow_reviews_a_scheduler_default_change(checkout, tmp_path):
    path = checkout / "conf" / "scheduler" / "default.yaml"
    path.write_text(path.read_text().replace("max_num_batched_tokens: 2048", "max_num_batched_tokens: 1024"))
    _commit(checkout, "a smaller default token budget")
    wf = yaml.safe_load(open(os.path.join(REPO, "docs", "ci", "github-actions.yml")))
    steps = wf["jobs"]["review"]["steps"]
    run = next(s["run"] for s in steps if s.get("name") == "Review the config change")
    assert any("gh pr comment" in s.get("run", "") for s in steps)
    summary = tmp_path / "summary.md"
    # as GitHub runs a step: bash -e -o pipefail
    p = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", run], cwd=checkout,
                       env=_env(BASE_REF="main", GITHUB_STEP_SUMMARY=str(summary)),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    md = (checkout / "config-review.md").read_text()
    assert summary.read_text() == md
    assert "base origin/main" in md and "head (working tree)" in md
    assert "| `scheduler.max_num_batched_tokens` | `2048` | `1024` |" in md
    for profile in ("cpu", "cpu_int4", "cpu_int8"):  # the profiles that keep the default's budget
        assert f"### profile `{profile}`: changed" in md
    assert "### deployment file `deployments/chat.args`: changed" in md
    assert "| `activation_bytes_per_device` |" in md  # the plan effect: smaller prefill activations
    assert "Unchanged: profile `b200_fp8`" in md  # the GPU profiles set their own budget


def test_gitlab_job_shows_no_change_for_a_commit_outside_the_tree(checkout):
    (checkout / "README.md").write_text("deployments of the chat service\n")
    _commit(checkout, "words only")
    job = yaml.safe_load(open(os.path.join(REPO, "docs", "ci", "gitlab-ci.yml")))["config-review"]
    assert any("merge_requests" in line for line in job["after_script"])
    script = "\n".join(job["script"])
    p = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=checkout,
                       env=_env(CI_MERGE_REQUEST_TARGET_BRANCH_NAME="main"), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    md = (checkout / "config-review.md").read_text()
    assert "0 of 9 deployments change." in md
    assert "deployment file `deployments/chat.args`" in md.split("Unchanged:")[1]
    assert "###" not in md


def test_a_deployment_that_no_longer_validates_fails_the_review(checkout):
    """Between a commit and the working tree: an edited deployment file that no longer validates (exit 1,
    with the validation message and the keys that broke it), a new one, a removed profile."""
    (checkout / "deployments" / "chat.args").write_text("+profile=cpu_int8 model.max_model_len=1024 "
                                                        "parallel.tensor_parallel_size=2\n")
    (checkout / "deployments" / "batch.args").write_text("+profile=cpu scheduler=throughput\n")
    (checkout / "profiles" / "mi300x_bf16.yaml").unlink()
    p = subprocess.run([APPLIANCE, "review", "--base", "HEAD",
                        "--deployments", "deployments/*.args"], cwd=checkout, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1, p.stderr
    md = p.stdout
    assert "**1 does not validate at head**" in md
    chat = md.split("### deployment file `deployments/chat.args`: invalid")[1].split("###")[0]
    assert "model.num_heads=9 is not divisible by parallel.tensor_parallel_size=2" in chat
    assert "| `parallel.tensor_parallel_size` | `1` | `2` |" in chat
    batch = md.split("### deployment file `deployments/batch.args`: added")[1].split("###")[0]
    assert "| `profile` | `cpu` |" in batch and "| `token_budget` |" in batch
    assert "### profile `mi300x_bf16`: removed" in md
    j = subprocess.run([APPLIANCE, "review", "--base", "HEAD", "--format", "json",
                        "--deployments", "deployments/*.args"], cwd=checkout, env=_env(), capture_output=True,
                       text=True, timeout=600)
    out = json.loads(j.stdout)
    assert out["failed"] is True and j.returncode == 1
    status = {d["name"]: d["status"] for d in out["deployments"]}
    assert status["deployments/chat.args"] == "invalid" and status["deployments/batch.args"] == "added"
    assert status["mi300x_bf16"] == "removed" and status["cpu"] == "unchanged"


def test_review_outside_a_checkout_or_of_an_unknown_revision_says_why(tmp_path, checkout):
    p = subprocess.run([APPLIANCE, "review", "--base", "main"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "not in one" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([APPLIANCE, "review", "--base", "no-such-branch"],
                       cwd=checkout, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no commit 'no-such-branch'" in p.stderr


def test_compare_reports_plan_only_changes_and_fixed_deployments():
    base = {"yaml": "a: 1\n", "plan": {"num_kv_blocks": 10, "notes": ["x"]}, "error": None}
    head = {"yaml": "a: 1\n", "plan": {"num_kv_blocks": 12, "notes": ["y"]}, "error": None}
    d = compare("cpu", "profile", base, head)  # the code changed what the same keys plan to
    assert d.status == "changed" and d.keys == [] and [(c.key, c.base, c.head) for c in d.plan] == \
        [("num_kv_blocks", 10, 12)]
    fixed = compare("cpu", "profile", {**base, "error": "invalid"}, base)
    assert fixed.status == "changed" and fixed.base_error == "invalid"
    assert compare("cpu", "profile", base, dict(base)).status == "unchanged"
    new = compare("x", "file", None, {"yaml": "a: 1\n", "plan": {"profile": "cpu", "num_kv_blocks": 3},
                                      "error": None})
    assert new.status == "added" and [(c.key, c.base) for c in new.plan] == [("profile", ABSENT),
                                                                             ("num_kv_blocks", ABSENT)]


def test_a_deployment_file_is_what_every_verb_reads_after_at(tmp_path):
    f = tmp_path / "chat.args"
    f.write_text("# the chat service\n+profile=cpu_int8\nmodel.max_model_len=1024  # short\n"
                 "server.served_model_name='chat bot'\n\n")
    args = build_parser().parse_args(["plan", f"@{f}", "cache.block_size=32"])
    assert args.overrides == ["+profile=cpu_int8", "model.max_model_len=1024", "server.served_model_name=chat bot",
                              "cache.block_size=32"]


def test_each_revision_is_resolved_by_its_own_code(checkout):
    """A checkout that carries the package: a change to the code's planning shows though no key changed."""
    shutil.copytree(os.path.join(REPO, "appliance"), checkout / "appliance",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    (checkout / "deployments" / "tp.args").write_text("+profile=cpu parallel.tensor_parallel_size=3 "
                                                      "parallel.cpu_collectives=gloo\n")
    git(checkout, "add", "-A")
    _commit(checkout, "the package and a tensor-parallel deployment")
    plan = checkout / "appliance" / "config" / "plan.py"
    plan.write_text(plan.read_text().replace("GLOO_LOOPBACK_LATENCY_US = 1000.0", "GLOO_LOOPBACK_LATENCY_US = 4000.0"))
    p = subprocess.run([APPLIANCE, "review", "--base", "HEAD", "--format", "json",
                        "--deployments", "deployments/*"], cwd=checkout, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    tp = next(d for d in json.loads(p.stdout)["deployments"] if d["name"] == "deployments/tp.args")
    assert tp["status"] == "changed" and tp["keys"] == []
    share = next(c for c in tp["plan"] if c["key"] == "decode_comm_share")
    assert share["head"] > share["base"]
