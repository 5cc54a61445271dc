import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Models and kernels the suite generates go to a temporary cache, never the
# user's ~/.cache/appliance (subprocesses inherit it). APPLIANCE_TEST_CACHE_DIR
# names a cache to keep between runs instead.
_KEEP = os.environ.get("APPLIANCE_TEST_CACHE_DIR")
TEST_CACHE = _KEEP or tempfile.mkdtemp(prefix="appliance-test-cache-")
os.environ["APPLIANCE_CACHE_DIR"] = TEST_CACHE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionfinish(session, exitstatus):
    if not _KEEP:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


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
