"""scripts/gpu_check.sh rehearsed on this machine (--cpu-rehearsal): the bundle
installed with no network into a fresh folder and checked complete, every case
reported (absent without a GPU, with the reason), and an exit status that fails
when any step does. The bundle here is made of stand-in wheels (the project's
real requirements, empty packages) so no network is needed."""

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

SCRIPTS = Path(REPO) / "scripts"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_bundle = _module("gpu_bundle")


def wheel(folder: Path, name: str, version: str = "1.0", requires: tuple[str, ...] = ()) -> Path:
    """A wheel holding only its metadata."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", f"{dist}.dist-info/METADATA,,\n{dist}.dist-info/WHEEL,,\n"
                                               f"{dist}.dist-info/RECORD,,\n")
    return path


@pytest.fixture
def bundle(tmp_path):
    """The project's wheel (its real requirements) and a stand-in for each requirement the image lacks."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    requires = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]["dependencies"]
    wheel(folder, "appliance", "0.1.0", tuple(requires))
    image = gpu_bundle.read_image(str(SCRIPTS / "gpu_image.txt"))
    for line in requires:
        req = Requirement(line)
        if canonicalize_name(req.name) not in image:  # the lowest version the pin admits
            bounds = [s.version for s in req.specifier if s.operator in ("==", ">=")]
            wheel(folder, canonicalize_name(req.name), bounds[0] if bounds else "99.0")
    return folder


def rehearse(bundle, out, **env):
    e = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_SECTIONS": "attention,e2e",
         "GPU_CHECK_TESTS": "tests/unit/test_collectives_device.py", **env}
    e.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--cpu-rehearsal", "--bundle", str(bundle)],
                          cwd=REPO, env=e, capture_output=True, text=True, timeout=600)


def test_rehearsal_installs_the_bundle_reports_every_case_and_passes(bundle, tmp_path):
    r = rehearse(bundle, tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 problems" in (tmp_path / "out" / "install.log").read_text()
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["rehearsal"] is True
    cases = report["cases"]
    assert {c["section"] for c in cases} == {"attention", "e2e"}
    assert {c["backend"] for c in cases if c["section"] == "e2e"} == {"triton", "flashinfer", "flash_attn3"}
    assert all(c["status"] == "absent" and c["reason"] == "no CUDA device (--cpu-rehearsal)" for c in cases)
    assert (tmp_path / "out" / "summary.txt").read_text() == "gpu_check: every step passed\n"
    assert "passed" in (tmp_path / "out" / "pytest.log").read_text()


def test_an_incomplete_bundle_or_a_failing_test_fails_the_run_and_says_which(bundle, tmp_path):
    next(bundle.glob("msgspec-*.whl")).unlink()
    r = rehearse(bundle, tmp_path / "out", GPU_CHECK_TESTS="tests/unit/test_no_such_file.py")
    assert r.returncode == 1
    assert "msgspec (needed by appliance: msgspec>=0.18) is missing" in (tmp_path / "out" / "install.log").read_text()
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert summary == ["gpu_check: failed: install (see install.log)", "gpu_check: failed: pytest (exit 4)"]
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["cases"]  # the cases still ran


def test_verify_checks_versions_and_markers(tmp_path):
    site = tmp_path / "site"
    folder = tmp_path / "w"
    folder.mkdir()
    wheel(folder, "appliance", "0.1.0", ("torch>=2.11,<2.14", "msgspec>=0.18", "gguf>=0.10",
                                         "tomli; python_version < '3.11'"))
    wheel(folder, "msgspec", "0.17")
    gpu_bundle.install_bundle(str(folder), str(site), "3.12")
    image = tmp_path / "image.txt"
    image.write_text("torch==2.10.0\ngguf\n")
    assert gpu_bundle.verify(str(site), str(image), "3.12") == 1
    image.write_text("torch==2.11.0\ngguf\n")
    wheel(folder, "msgspec", "0.18").replace(next(folder.glob("msgspec-0.17*")))
    site2 = tmp_path / "site2"
    gpu_bundle.install_bundle(str(folder), str(site2), "3.12")
    assert gpu_bundle.verify(str(site2), str(image), "3.12") == 0  # tomli is for Python < 3.11 only


def test_a_case_that_raises_or_misses_its_tolerance_fails_and_absent_is_not_a_failure(tmp_path, monkeypatch):
    gpu_check = _module("gpu_check")
    report = gpu_check.Report(str(tmp_path / "r.json"), rehearsal=True)
    report.run("x", {"case": 1}, lambda: {"ok": True, "err": 0.0}, needs_cuda=False)
    report.run("x", {"case": 2}, lambda: {"ok": False, "err": 1.0}, needs_cuda=False)
    report.run("x", {"case": 3}, lambda: 1 / 0, needs_cuda=False)
    report.run("x", {"case": 4}, lambda: {"ok": True})  # needs a GPU: absent here

    def missing():
        raise gpu_check.Absent("no such package")
    report.run("x", {"case": 5}, missing, needs_cuda=False)
    saved = json.loads((tmp_path / "r.json").read_text())["cases"]
    assert [c["status"] for c in saved] == ["passed", "failed", "failed", "absent", "absent"]
    assert saved[2]["error"] == "ZeroDivisionError('division by zero')"
    assert saved[4]["reason"] == "no such package"
    assert report.counts() == {"passed": 1, "failed": 2, "absent": 2}
