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
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(TEST_CACHE, "triton"))  # kernels compiled ahead of time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The slow marker, on cases of a parametrized test (pytest.param(..., marks=pytest.mark.slow)):
# APPLIANCE_SLOW=full runs every case; the default bounded form (make test, CI) skips a slow case
# when another case of the same test runs, so every test still runs in the bounded form.
SLOW = os.environ.get("APPLIANCE_SLOW", "bounded")
if SLOW not in ("bounded", "full"):
    raise pytest.UsageError(f"APPLIANCE_SLOW={SLOW}: use bounded (the default) or full")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if SLOW == "full":
        return
    skip = pytest.mark.skip(reason="slow case: the bounded run keeps the test's other cases (APPLIANCE_SLOW=full "
                                   "runs it)")
    tests = {}
    for item in items:
        tests.setdefault(item.nodeid.partition("[")[0], []).append(item)
    for cases in tests.values():
        slow = [c for c in cases if c.get_closest_marker("slow") is not None]
        if len(slow) < len(cases):
            for case in slow:
                case.add_marker(skip)


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
