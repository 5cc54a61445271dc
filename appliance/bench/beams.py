"""`appliance bench beams`: beam search through ``LLM.generate`` against
what it replaces and what it reproduces, in the same run: for each beam
width n, our beam search; our n sampled sequences (``n`` parallel samples,
the same number of sequences decoded); and transformers'
``generate(num_beams=n)`` on the same model and prompts (``--baseline hf``).
Every search decodes exactly ``--output-len`` tokens (the EOS ignored:
transformers masks it), so each variant does the same number of decode
steps of the same width.

Reports seconds per run and sequences x tokens per second for each (the
median of ``--repeat`` runs, the variants' runs interleaved), the ratios
(ours against HF; beam search against sampling), the KV blocks forks
copied, and the weight-streaming bandwidth of our runs against `bench
machine`'s roofline.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from appliance.bench.common import counting_steps, plot_bars, random_prompts, split_overrides, write_results
from appliance.bench.machine import load_or_measure


def _ours(llm: Any, prompts: list[list[int]], params: Any) -> tuple[float, int, int, int]:
    """(seconds, sequences x tokens, engine steps, KV blocks copied) of one run."""
    kv = llm.engine.scheduler.kv
    copies = [0]
    take = kv.take_copies

    def counted() -> list:
        c = take()
        copies[0] += len(c)
        return c

    kv.take_copies = counted
    try:
        with counting_steps(llm.engine) as counter:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
    finally:
        del kv.take_copies
    llm.engine.reset_prefix_cache()  # the next run computes its prompts
    tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    return elapsed, tokens, counter["steps"], copies[0]


def _hf(model: Any, prompts: list[list[int]], n: int, output_len: int, pad: int) -> tuple[float, int]:
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             num_beams=n, num_return_sequences=n, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - t
    return elapsed, (out.shape[1] - width) * out.shape[0]


def _median(runs: list[tuple]) -> tuple:
    return sorted(runs)[len(runs) // 2]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench beams")
    p.add_argument("--beams", default="2,4", help="beam widths (n), comma-separated")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="runs of each variant; the median run is reported")
    p.add_argument("--baseline", choices=["none", "hf"], default="hf")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM, SamplingParams
    from appliance.models.loader import resolve_model_folder

    machine = load_or_measure(a.out)
    llm = LLM(overrides=overrides)
    cfg, plan = llm.resolved.cfg, llm.deployment.plan
    prompts = random_prompts(a.num_prompts, [a.input_len] * a.num_prompts, cfg.model.vocab_size)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    hf_model, pad = None, 0
    if a.baseline == "hf":
        import torch
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(resolve_model_folder(cfg.model)),
                                                        dtype=getattr(torch, plan.dtype)).eval()
        pad = hf_model.config.pad_token_id if hf_model.config.pad_token_id is not None else 0
    result: dict[str, Any] = {"config_hash": llm.resolved.hash, "profile": cfg.profile, "model": cfg.model.name,
                              "dtype": plan.dtype, "num_prompts": a.num_prompts, "input_len": a.input_len,
                              "output_len": a.output_len, "machine": machine, "widths": {}}
    bars: dict[str, float] = {}
    for n in [int(x) for x in a.beams.split(",")]:
        beam = SamplingParams(n=n, use_beam_search=True, max_tokens=a.output_len, ignore_eos=True)
        sample = SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=a.output_len, ignore_eos=True)
        runs: dict[str, list[tuple]] = {"beam": [], "sample": [], "hf": []}
        for _ in range(a.repeat):  # interleaved: the machine's drift falls on every variant alike
            runs["beam"].append(_ours(llm, prompts, beam))
            runs["sample"].append(_ours(llm, prompts, sample))
            if hf_model is not None:
                runs["hf"].append(_hf(hf_model, prompts, n, a.output_len, pad))
        width: dict[str, Any] = {}
        for name in ("beam", "sample"):
            elapsed, tokens, steps, copies = _median(runs[name])
            gbps = steps * plan.weight_bytes_per_device / elapsed / 1e9
            width[name] = {"elapsed_s": elapsed, "runs_elapsed_s": [r[0] for r in runs[name]], "tokens": tokens,
                           "tok_s": tokens / elapsed, "steps": steps, "kv_blocks_copied": copies,
                           "weight_GBps": gbps, "bandwidth_fraction": gbps / machine["peak_bandwidth_GBps"]}
            bars[f"{name} n={n}"] = tokens / elapsed
        width["beam_vs_sample"] = width["beam"]["tok_s"] / width["sample"]["tok_s"]
        if runs["hf"]:
            elapsed, tokens = _median(runs["hf"])
            width["hf"] = {"elapsed_s": elapsed, "runs_elapsed_s": [r[0] for r in runs["hf"]], "tokens": tokens,
                           "tok_s": tokens / elapsed}
            width["ratio_vs_hf"] = width["beam"]["tok_s"] / width["hf"]["tok_s"]
            bars[f"hf beams n={n}"] = tokens / elapsed
        result["widths"][str(n)] = width
        vs = f", x{width['ratio_vs_hf']:.2f} HF's beam search" if "ratio_vs_hf" in width else ""
        print(f"n={n}: beam search {width['beam']['tok_s']:.1f} tok/s (x{width['beam_vs_sample']:.2f} {n} samples"
              f"{vs}); {width['beam']['kv_blocks_copied']} KV blocks copied; weights streamed at "
              f"{width['beam']['weight_GBps']:.1f} GB/s = {100 * width['beam']['bandwidth_fraction']:.0f}% of "
              f"{machine['peak_bandwidth_GBps']:.1f} GB/s")
    path = write_results(a.out, "beams", result)
    png = plot_bars(a.out, "beams", f"Sequences x tokens per second, {a.num_prompts} prompts x {a.output_len} tokens",
                    bars, "tok/s")
    print(f"wrote {path} and {png}")
    return 0
