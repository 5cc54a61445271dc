"""`appliance bench spec`: speculative decoding against plain decoding in
the same run, on two workloads: an extractive one (the answer repeats text
the prompt holds: rewrite a function with a variable renamed, quote a
paragraph) and a free-form one (stories, explanations), at 1 and 8
concurrent requests (chat prompts through ``LLM.chat``, greedy).

Reports output tok/s with and without (``--spec``, default
``speculative=ngram``), their ratio (each variant run ``--repeat`` times,
its runs interleaved with the other's, the median run counting), the drafts' acceptance rate and mean
acceptance length (1 + accepted / drafts: tokens per verifying step of a
drafting request), and the weight-streaming bandwidth of each run against
`bench machine`'s roofline. Speculation speeds decoding only, so each run
also times the same batches' prefills alone (one output token each, the
prefix cache emptied first) and reports decode tok/s: the tokens after
the first over the time after the prefills.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from appliance.bench.common import counting_steps, plot_bars, split_overrides, write_results
from appliance.bench.machine import load_or_measure

CODE = '''def moving_average(values, window):
    total = 0.0
    result = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result
'''

PARAGRAPHS = [
    "The harbour was quiet before dawn. Fishing boats rocked against the pier, their ropes creaking, while gulls "
    "waited on the posts for the first catch of the day.",
    "By noon the market square had filled with traders. Sellers of cloth and spice called out their prices, and "
    "children ran between the stalls chasing a stray dog.",
    "In the evening the lamplighter walked the length of the main street. One by one the lamps came on, and the "
    "shops closed their shutters against the cold wind from the sea.",
]

EXTRACTIVE = [
    f"Rewrite this Python function with the variable `total` renamed to `running_sum`. Reply with the code only."
    f"\n\n```python\n{CODE}```",
    f"Rewrite this Python function with the variable `result` renamed to `averages` and `window` renamed to "
    f"`size`. Reply with the code only.\n\n```python\n{CODE}```",
    "Here are three paragraphs.\n\n" + "\n\n".join(PARAGRAPHS)
    + "\n\nQuote, word for word, the paragraph that mentions the market square.",
    "Here are three paragraphs.\n\n" + "\n\n".join(PARAGRAPHS)
    + "\n\nRepeat the first and the last paragraph exactly as written.",
]

FREE_FORM = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a rainy weekend, with a sentence about each.",
    "Describe a walk through a forest in autumn.",
]

WORKLOADS = {"extractive": EXTRACTIVE, "free_form": FREE_FORM}


def _timed(llm: Any, prompts: list[str], concurrency: int, params: Any) -> tuple[float, int, int]:
    """(seconds, output tokens, requests) for the prompts, ``concurrency`` at a time, prefix cache emptied first."""
    llm.engine.reset_prefix_cache()
    n_out = 0
    t = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = [[{"role": "user", "content": p}] for p in prompts[i : i + concurrency]]
        outs = llm.chat(batch, params, use_tqdm=False)
        n_out += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - t, n_out, len(prompts)


def run(llm: Any, prompts: list[str], concurrency: int, output_len: int) -> dict:
    """Every prompt once, ``concurrency`` at a time; tok/s (all, and decode
    alone) and acceptance."""
    from appliance import SamplingParams

    prefill_s, _, _ = _timed(llm, prompts, concurrency, SamplingParams(max_tokens=1, temperature=0))
    llm.engine.reset_stats()
    with counting_steps(llm.engine) as counter:
        elapsed, n_out, n_req = _timed(llm, prompts, concurrency, SamplingParams(max_tokens=output_len, temperature=0))
    s = llm.engine.stats()
    res: dict[str, Any] = {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed, "steps": counter["steps"],
           "prefill_s": prefill_s, "decode_tok_s": (n_out - n_req) / max(1e-9, elapsed - prefill_s)}
    if s.spec_drafts:
        res.update({"drafts": s.spec_drafts, "draft_tokens": s.spec_draft_tokens, "accepted": s.spec_accepted_tokens,
                    "acceptance_rate": s.spec_accepted_tokens / max(1, s.spec_draft_tokens),
                    "mean_acceptance_length": 1 + s.spec_accepted_tokens / s.spec_drafts,
                    "accepted_per_pos": list(s.spec_accepted_per_pos)})
    return res


def _median_run(runs: list[dict]) -> dict:
    """The run with the median output tok/s, with every run's tok/s beside it."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    return {**ranked[len(ranked) // 2], "repeats_output_tok_s": [r["output_tok_s"] for r in runs]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench spec")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,8", help="comma-separated request counts run at once")
    p.add_argument("--spec", default="speculative=ngram", metavar="OVERRIDES",
                   help="overrides (space-separated) that turn speculation on")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each variant per case, interleaved with the other's; the median counts")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM

    machine = load_or_measure(a.out)
    levels = [int(c) for c in a.concurrency.split(",")]
    variants = {"plain": overrides, "spec": overrides + a.spec.split()}
    result: dict[str, Any] = {"output_len": a.output_len, "spec_overrides": a.spec, "repeat": a.repeat,
                              "machine": machine, "runs": {}}
    llms = {}
    for name, ov in variants.items():  # both built first: their runs interleave, so drift hits both alike
        llm = llms[name] = LLM(overrides=ov)
        plan = llm.deployment.plan
        result.setdefault("profile", llm.resolved.cfg.profile)
        result["model"], result["dtype"] = llm.resolved.cfg.model.name, plan.dtype
        result[f"{name}_config_hash"] = llm.resolved.hash
        llm.chat([[{"role": "user", "content": "Hi"}]], None, use_tqdm=False)  # warm-up
    for workload, prompts in WORKLOADS.items():
        for c in levels:
            # every level runs each prompt at least once and fills its batches
            reps = -(-max(c, len(prompts)) // len(prompts))
            chosen = (prompts * reps)[: max(c, len(prompts))]
            runs: dict[str, list[dict]] = {name: [] for name in llms}
            for rep in range(a.repeat):
                for name in (list(llms) if rep % 2 == 0 else list(reversed(llms))):
                    res = run(llms[name], chosen, c, a.output_len)
                    res["weight_GBps"] = (res["steps"] * llms[name].deployment.plan.weight_bytes_per_device
                                          / res["elapsed_s"] / 1e9)
                    res["bandwidth_fraction"] = res["weight_GBps"] / machine["peak_bandwidth_GBps"]
                    runs[name].append(res)
            result["runs"][f"{workload} c={c}"] = {name: _median_run(r) for name, r in runs.items()}
    bars = {}
    for key, both in result["runs"].items():
        both["speedup"] = both["spec"]["output_tok_s"] / both["plain"]["output_tok_s"]
        both["decode_speedup"] = both["spec"]["decode_tok_s"] / both["plain"]["decode_tok_s"]
        bars[f"{key} plain"] = both["plain"]["output_tok_s"]
        bars[f"{key} spec"] = both["spec"]["output_tok_s"]
        s = both["spec"]
        acc = (f", acceptance {s['acceptance_rate']:.0%}, mean length {s['mean_acceptance_length']:.2f}"
               if "drafts" in s else ", no drafts")
        print(f"{key:16} plain {both['plain']['output_tok_s']:7.1f} tok/s, spec {s['output_tok_s']:7.1f} tok/s "
              f"(x{both['speedup']:.2f}; decode x{both['decode_speedup']:.2f}{acc})")
    path = write_results(a.out, "spec", result)
    png = plot_bars(a.out, "spec", f"Output tok/s with and without {a.spec}", bars, "tok/s")
    print(f"wrote {path} and {png}")
    return 0
