"""`appliance bench latency`: single-request prefill latency by prompt length
and decode step latency by batch size, through the engine core directly."""

from __future__ import annotations

import argparse
import time

from tqdm import tqdm

from appliance.bench.common import plot_lines, random_prompts, split_overrides, write_results
from appliance.bench.machine import load_or_measure


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def prefill_ms(engine, prompt: list[int], repeat: int) -> float:
    from appliance import SamplingParams

    best = float("inf")
    for r in range(repeat):
        engine.add_request(f"prefill-{len(prompt)}-{r}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        _drain(engine)
        best = min(best, time.perf_counter() - t)
        engine.reset_prefix_cache()
    return best * 1e3


def decode_ms(engine, prompts: list[list[int]], steps: int) -> float:
    from appliance import SamplingParams

    ids = [f"decode-{len(prompts)}-{i}" for i in range(len(prompts))]
    # no request may finish before the timed steps end: with a per-step token budget (a latency objective)
    # the first prompts decode while the last ones prefill, so a fixed max_tokens would run out early and
    # time smaller batches; they are aborted after
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(max_tokens=1 << 30, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)):
        engine.step()  # prefill everything first
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t
    running = len(engine.scheduler.running)
    engine.abort(ids)
    _drain(engine)
    engine.reset_prefix_cache()
    if running != len(prompts):
        raise RuntimeError(f"decode batch {len(prompts)}: only {running} requests ran to the end of the timed steps "
                           f"(the KV pool or scheduler.max_num_seqs is too small for this batch)")
    return elapsed / steps * 1e3


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench latency")
    p.add_argument("--input-lens", default="32,128,512")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--decode-prompt-len", type=int, default=100)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM

    machine = load_or_measure(a.out)
    llm = LLM(overrides=overrides)
    engine, cfg, plan = llm.engine, llm.resolved.cfg, llm.deployment.plan
    vocab = cfg.model.vocab_size
    prefill = []
    for n in tqdm([int(x) for x in a.input_lens.split(",")], desc="bench latency: prefill"):
        ms = prefill_ms(engine, random_prompts(1, [n], vocab, seed=n)[0], a.repeat)
        prefill.append({"input_len": n, "ms": ms, "tok_s": n / ms * 1e3})
    decode = []
    for b in tqdm([int(x) for x in a.batch_sizes.split(",")], desc="bench latency: decode"):
        ms = decode_ms(engine, random_prompts(b, [a.decode_prompt_len] * b, vocab, seed=b), a.decode_steps)
        gbps = plan.weight_bytes_per_device / (ms / 1e3) / 1e9
        decode.append({"batch_size": b, "ms_per_step": ms, "tok_s": b / ms * 1e3, "weight_GBps": gbps,
                       "bandwidth_fraction": gbps / machine["peak_bandwidth_GBps"]})
    path = write_results(a.out, "latency", {"config_hash": llm.resolved.hash, "model": cfg.model.name,
                                             "dtype": plan.dtype, "prefill": prefill, "decode": decode,
                                             "machine": machine})
    png = plot_lines(a.out, "latency", "Decode step latency by batch size", "batch size", "ms per step",
                     {"decode": ([d["batch_size"] for d in decode], [d["ms_per_step"] for d in decode])}, logx=True)
    for r in prefill:
        print(f"prefill {r['input_len']:>5} tokens: {r['ms']:8.1f} ms ({r['tok_s']:.0f} tok/s)")
    for r in decode:
        print(f"decode batch {r['batch_size']:>3}: {r['ms_per_step']:7.2f} ms/step, {r['tok_s']:7.1f} tok/s, "
              f"weights at {r['weight_GBps']:.1f} GB/s ({100 * r['bandwidth_fraction']:.0f}% of machine)")
    print(f"wrote {path} and {png}")
    return 0
