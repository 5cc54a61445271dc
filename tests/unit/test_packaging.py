"""The package as pip builds it (the container images run ``pip install .``):
every module and data file shipped, and no build warning on the way."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_every_module_and_data_file_and_builds_without_warnings(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates the pyproject's build requirement (>=77)")
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "appliance"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"  # the tracked files, so the build's build/ and egg-info folders stay out of the checkout
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Warning" not in r.stdout + r.stderr, r.stdout + r.stderr  # setuptools' BuildBackendWarning and kin
    (wheel,) = (tmp_path / "dist").glob("appliance-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert {name for name in tracked if name.startswith("appliance/")} - shipped == set()
    assert {"appliance/kernels/csrc/cpu_ops.c", "appliance/bench/data/perplexity.txt"} <= shipped
