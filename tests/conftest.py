import os
import subprocess
import sys

import pytest

# Token-exact tests compare fp32 runs; pin the CPU dtype choice so the suite
# behaves the same on CPUs with and without native bf16 (subprocesses inherit it).
os.environ.setdefault("APPLIANCE_CPU_BF16", "0")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, env=None, timeout=300):
    """Run `appliance ...` as a user would; returns CompletedProcess."""
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=e,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli
