"""The slow marker's bounded form (tests/conftest.py): a case marked slow is
skipped while another case of its test runs, and runs under APPLIANCE_SLOW=full
or when it is all that was selected."""

from pathlib import Path

pytest_plugins = ["pytester"]

CASES = """
import pytest

@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two(x):
    pass

@pytest.mark.parametrize("x", [pytest.param(3, marks=pytest.mark.slow)])
def test_only_slow(x):
    pass
"""


def _run(pytester, monkeypatch, *args, slow=None):
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: a long case\n")
    pytester.makepyfile(test_cases=CASES)
    if slow is None:
        monkeypatch.delenv("APPLIANCE_SLOW", raising=False)
    else:
        monkeypatch.setenv("APPLIANCE_SLOW", slow)
    return pytester.runpytest_subprocess("-rs", *args)


def test_a_slow_case_is_skipped_while_another_case_of_its_test_runs(pytester, monkeypatch):
    r = _run(pytester, monkeypatch)
    r.assert_outcomes(passed=2, skipped=1)  # test_two[1] and test_only_slow[3] run
    r.stdout.fnmatch_lines(["*slow case: the bounded run keeps the test's other cases*"])


def test_every_case_runs_under_appliance_slow_full(pytester, monkeypatch):
    _run(pytester, monkeypatch, slow="full").assert_outcomes(passed=3)


def test_a_slow_case_selected_alone_runs(pytester, monkeypatch):
    _run(pytester, monkeypatch, "-k", "test_two and 2").assert_outcomes(passed=1)


def test_an_unknown_appliance_slow_is_refused(pytester, monkeypatch):
    r = _run(pytester, monkeypatch, slow="sometimes")
    assert r.ret != 0
    r.stderr.fnmatch_lines(["*APPLIANCE_SLOW=sometimes: use bounded (the default) or full*"])
