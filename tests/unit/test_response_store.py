"""The Responses API's store: per tenant, bounded by count and bytes, least recently used dropped first."""

from appliance.server.response_store import ResponseStore


def response(rid, text="x"):
    return {"id": rid, "output": text}


def test_tenants_are_apart_and_the_least_recently_used_goes_first():
    s = ResponseStore(max_responses=2, max_bytes=1 << 20)
    s.put(0, response("a"), [])
    s.put(1, response("a"), [{"role": "user", "content": "b's"}])
    assert s.get(0, "a").conversation == [] and s.get(1, "a").conversation[0]["content"] == "b's"
    assert s.get(2, "a") is None and not s.delete(2, "a")
    s.get(0, "a")  # now the most recently used
    s.put(0, response("c"), [])
    assert s.get(1, "a") is None and s.get(0, "a") is not None and len(s) == 2


def test_bytes_bound_the_store_and_an_oversized_response_is_not_kept():
    s = ResponseStore(max_responses=100, max_bytes=300)
    for i in range(5):
        s.put(None, response(f"r{i}", "y" * 80), [])
    assert 0 < s.bytes <= 300 and s.get(None, "r4") is not None and s.get(None, "r0") is None
    s.put(None, response("big", "z" * 400), [])
    assert s.get(None, "big") is None
    assert s.delete(None, "r4") and s.get(None, "r4") is None
    s.put(None, response("r3", "w"), [])  # stored again: replaced, counted once
    assert s.bytes == sum(x.size for x in s._items.values())
    assert ResponseStore(0, 1 << 20).put(None, response("n"), []) is None and len(ResponseStore(0, 1)) == 0
