"""Shared helpers for engine-core tests: tiny requests and a null model runner."""

from appliance.engine.kv_cache.manager import KVCacheManager
from appliance.engine.request import Request
from appliance.engine.scheduler import Scheduler
from appliance.sampling_params import SamplingParams

EOS = 0


def make_req(rid, tokens, max_tokens=4, priority=0, arrival=None, salt=None, ignore_eos=True, min_tokens=0, stop_token_ids=()):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=list(stop_token_ids))
    return Request(
        rid, list(tokens), sp, eos_token_id=EOS, arrival_time=arrival if arrival is not None else float(len(rid)),
        priority=priority, cache_salt=salt,
    )


def make_scheduler(num_blocks=10, block_size=4, budget=64, max_seqs=16, max_model_len=256, caching=True, **kw):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, hash_algo=kw.pop("hash_algo", "sha256"))
    return Scheduler(kv, budget, max_seqs, max_model_len, **kw)


def null_step(sched, token=7):
    """One engine step with a model that always samples ``token``."""
    out = sched.schedule()
    sampled = {
        rid: [token]
        for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
    }
    updates = sched.update_from_output(out, sampled)
    return out, updates
