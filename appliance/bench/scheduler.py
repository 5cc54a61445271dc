"""`appliance bench scheduler`: cost of the engine core alone.

A null model runner samples a fixed token, so every microsecond measured is
scheduler + KV manager + bookkeeping. Reports µs per ``schedule()`` +
``update_from_output()`` step and per scheduled token at several running
counts, with and without prefix hits, and the KV waste ratio
(1 - tokens stored / (blocks held x block_size)) of a mixed-length workload.
"""

from __future__ import annotations

import argparse
import random
import time

from tqdm import tqdm

from appliance.bench.common import plot_lines, write_results
from appliance.engine.kv_cache.manager import KVCacheManager
from appliance.engine.request import Request
from appliance.engine.scheduler import Scheduler
from appliance.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _null_step(s: Scheduler) -> int:
    out = s.schedule()
    sampled = {
        rid: [1] for rid in out.num_scheduled_tokens if s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens
    }
    s.update_from_output(out, sampled)
    return out.total_num_scheduled_tokens


def run_point(num_running: int, prompt_len: int, decode_steps: int, shared_prefix: bool) -> dict:
    blocks_per_req = -(-(prompt_len + decode_steps + 2) // BLOCK_SIZE)
    kv = KVCacheManager(num_running * blocks_per_req + 2, BLOCK_SIZE, enable_caching=True, hash_algo="sha256")
    s = Scheduler(kv, max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running,
                  max_model_len=prompt_len + decode_steps + 64)
    sp = SamplingParams(max_tokens=decode_steps + 10_000, ignore_eos=True)
    prefix = list(range(1, prompt_len * 3 // 4 + 1)) if shared_prefix else []
    for i in range(num_running):
        own = [50_000 + i * prompt_len + j for j in range(prompt_len - len(prefix))]
        s.add_request(Request(f"r{i}", prefix + own, sp, arrival_time=float(i)))
    t0 = time.perf_counter()
    prefill_tokens = prefill_steps = 0
    while len(s.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        prefill_tokens += _null_step(s)
        prefill_steps += 1
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    decode_tokens = 0
    for _ in range(decode_steps):
        decode_tokens += _null_step(s)
    t_decode = time.perf_counter() - t0
    return {
        "num_running": num_running,
        "shared_prefix": shared_prefix,
        "prefill_steps": prefill_steps,
        "prefill_us_per_token": 1e6 * t_prefill / max(1, prefill_tokens),
        "prefix_hit_rate": kv.stats.hit_rate,
        "decode_us_per_step": 1e6 * t_decode / decode_steps,
        "decode_us_per_token": 1e6 * t_decode / max(1, decode_tokens),
    }


def kv_waste(num_requests: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    kv = KVCacheManager(num_requests * 20 + 2, BLOCK_SIZE, enable_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=1 << 20, max_num_seqs=num_requests, max_model_len=4096)
    sp = SamplingParams(max_tokens=1000, ignore_eos=True)
    for i in range(num_requests):
        s.add_request(Request(f"w{i}", [1] * rng.randint(1, 300), sp, arrival_time=float(i)))
    for _ in range(rng.randint(1, 40)):
        _null_step(s)
    held = sum(len(b) for g in kv.groups for b in g.req_to_blocks.values())
    stored = sum(r.num_computed_tokens for r in s.running)
    return {"requests": num_requests, "blocks_held": held, "tokens_stored": stored,
            "kv_waste_ratio": 1 - stored / (held * BLOCK_SIZE)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench scheduler")
    p.add_argument("--sizes", default="1,64,256,1024", help="running-request counts")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per point")
    p.add_argument("--out", default="bench-results")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    points = []
    for n in tqdm(sizes, desc="bench scheduler"):
        for shared in (False, True):
            points.append(run_point(n, a.prompt_len, a.steps, shared))
    waste = kv_waste(max(sizes))
    path = write_results(a.out, "scheduler", {"block_size": BLOCK_SIZE, "prompt_len": a.prompt_len,
                                               "points": points, "kv_waste": waste})
    series = {
        f"decode µs/step ({'shared prefix' if sh else 'no prefix hits'})": (
            [pt["num_running"] for pt in points if pt["shared_prefix"] == sh],
            [pt["decode_us_per_step"] for pt in points if pt["shared_prefix"] == sh],
        )
        for sh in (False, True)
    }
    png = plot_lines(a.out, "scheduler", "Engine core cost per step (null model)", "running requests",
                     "µs per schedule()+update()", series, logx=True)
    print(f"{'running':>8} {'prefix':>7} {'hit rate':>8} {'prefill µs/tok':>15} {'decode µs/step':>15} {'µs/tok':>8}")
    for pt in points:
        print(f"{pt['num_running']:>8} {str(pt['shared_prefix']):>7} {pt['prefix_hit_rate']:>8.2f} "
              f"{pt['prefill_us_per_token']:>15.2f} {pt['decode_us_per_step']:>15.1f} {pt['decode_us_per_token']:>8.2f}")
    print(f"kv waste ratio (mixed lengths, block {BLOCK_SIZE}): {waste['kv_waste_ratio']:.4f}")
    print(f"wrote {path} and {png}")
    return 0
