"""`appliance bench offload`: the KV offload tier (``kv_transfer=offload``)
on a long shared prefix.

Time to first token of a ``--prefix-len``-token prefix plus a short
question, one request at a time: cold (nothing cached anywhere), a block
pool hit (the prefix still in the pool), the tier warm with the pool
cleared (``reset_prefix_cache``), and after a restart (a new engine over
the same tier folder). The tier lives in a fresh folder under ``--out``
unless the overrides name one. Ratios are against the cold run; the JSON
records the tokens each run took from a cache and the host's CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

from appliance.bench.common import plot_bars, random_prompts, split_overrides, write_results


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from appliance import SamplingParams

    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - t) * 1e3, out[0].num_cached_tokens


def _settle(llm) -> None:
    """Every queued tier write done and reported to the scheduler."""
    from appliance import SamplingParams

    llm.engine.runner.kv_connector.flush()
    llm.generate([[1]], SamplingParams(max_tokens=1), use_tqdm=False)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench offload")
    p.add_argument("--prefix-len", type=int, default=4000)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM

    overrides = ["kv_transfer=offload", *overrides]
    if not any(o.startswith("kv_transfer.offload.path=") for o in overrides):
        folder = os.path.abspath(os.path.join(a.out, f"offload-tier-{int(time.time())}"))
        overrides.append(f"kv_transfer.offload.path={folder}")
    llm = LLM(overrides=overrides)
    vocab = llm.resolved.cfg.model.vocab_size
    n = 4  # one question per run
    prompts = random_prompts(n, [a.prefix_len + a.question_len] * n, vocab, seed=3, shared_prefix=a.prefix_len)
    runs = {}
    runs["cold"] = _ttft(llm, prompts[0])
    _settle(llm)
    runs["block pool hit"] = _ttft(llm, prompts[1])
    llm.engine.reset_prefix_cache()
    runs["tier, pool cleared"] = _ttft(llm, prompts[2])
    _settle(llm)
    del llm
    gc.collect()
    llm = LLM(overrides=overrides)
    runs["tier, after a restart"] = _ttft(llm, prompts[3])
    cold = runs["cold"][0]
    results = {name: {"ttft_ms": ms, "cached_tokens": cached, "speedup_vs_cold": cold / ms}
               for name, (ms, cached) in runs.items()}
    path = write_results(a.out, "offload", {"prefix_len": a.prefix_len, "question_len": a.question_len,
                                             "runs": results})
    plot_bars(a.out, "offload", f"TTFT, {a.prefix_len}-token shared prefix (ms)",
              {name: r["ttft_ms"] for name, r in results.items()}, "ms")
    for name, r in results.items():
        print(f"{name:24s} TTFT {r['ttft_ms']:9.1f} ms  cached {r['cached_tokens']:6d} tokens  "
              f"x{r['speedup_vs_cold']:.1f} vs cold")
    print(path)
    return 0
