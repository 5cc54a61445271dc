"""Failure containment's bookkeeping (engine/failures.py): which requests a
failed step blames, and the order suspects run alone in. The engine's
behaviour around it is tested end to end in tests/integration/test_hardening.py."""

from types import SimpleNamespace

from appliance.engine.failures import Suspects


def reqs(*ids):
    return [SimpleNamespace(request_id=i) for i in ids]


def test_a_failed_batch_strikes_each_request_and_runs_them_alone_first():
    s = Suspects()
    s.order = ["old"]
    batch = reqs("a", "b")
    ended, retry = s.blame(batch, alone=False, retry_all=False)
    assert ended == [] and retry == batch and s.order == ["a", "b", "old"] and s.strikes == {"a": 1, "b": 1}
    for _ in range(Suspects.MAX_STRIKES - 1):
        ended, retry = s.blame(batch, alone=False, retry_all=False)
    assert [r.request_id for r in ended] == ["a", "b"] and retry == []


def test_one_request_that_fails_is_ended_and_no_ones_fault_strikes_nobody():
    s = Suspects()
    assert s.blame(reqs("a"), alone=False, retry_all=False)[0][0].request_id == "a"
    assert s.blame(reqs("a", "b"), alone=True, retry_all=False)[1] == [] and not s
    ended, retry = s.blame(reqs("a", "b"), alone=False, retry_all=True)
    assert ended == [] and len(retry) == 2 and s.strikes == {} and s.order == ["a", "b"]


def test_suspects_that_ended_are_skipped_and_forgotten():
    s = Suspects()
    s.order, s.strikes = ["gone", "done", "live"], {"live": 1}
    requests = {"done": SimpleNamespace(request_id="done", is_finished=True),
                "live": SimpleNamespace(request_id="live", is_finished=False)}
    assert s.next(requests) == "live" and s.order == ["live"]
    s.cleared("live")
    s.cleared("live")  # cleared twice (ran alone, then ended): no error
    s.forget("live")
    assert not s and s.strikes == {}
