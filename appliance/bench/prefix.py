"""`appliance bench prefix`: prefix caching on N requests sharing a P-token prefix.

Reports the measured hit rate against the block-aligned ideal, time to
first token with and without caching (requests one at a time), and the
throughput cost of caching when nothing hits (distinct prompts, caching on
versus off).
"""

from __future__ import annotations

import argparse
import time

from appliance.bench.common import plot_bars, random_prompts, split_overrides, write_results


def _ttft_ms(llm, prompts) -> list[float]:
    from appliance import SamplingParams

    out = []
    for p in prompts:
        t = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _throughput(llm, prompts, output_len) -> float:
    from appliance import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    return len(prompts) * output_len / (time.perf_counter() - t)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench prefix")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM

    n, plen, slen = a.num_prompts, a.prefix_len, a.suffix_len
    results = {}
    for caching in (True, False):
        llm = LLM(overrides=[*overrides, f"cache.enable_prefix_caching={str(caching).lower()}"])
        cfg = llm.resolved.cfg
        vocab, bs = cfg.model.vocab_size, cfg.cache.block_size
        shared = random_prompts(n, [plen + slen] * n, vocab, seed=1, shared_prefix=plen)
        distinct = random_prompts(n, [plen + slen] * n, vocab, seed=2)
        _ttft_ms(llm, [shared[0][:8]])  # warm-up
        llm.engine.reset_stats()
        ttft = _ttft_ms(llm, shared)
        stats = llm.engine.stats()
        hit_rate = stats.prefix_hits / max(1, stats.prefix_queries)
        llm.engine.reset_prefix_cache()
        tput = _throughput(llm, distinct, a.output_len)
        results["on" if caching else "off"] = {
            "ttft_first_ms": ttft[0], "ttft_rest_mean_ms": sum(ttft[1:]) / max(1, n - 1),
            "hit_rate": hit_rate, "zero_hit_output_tok_s": tput}
        del llm
    ideal_tokens = min(plen // bs, (plen + slen - 1) // bs) * bs
    ideal = (n - 1) * ideal_tokens / (n * (plen + slen))
    on, off = results["on"], results["off"]
    summary = {"block_size": bs, "ideal_hit_rate": ideal, "hit_rate": on["hit_rate"],
               "hit_rate_vs_ideal": on["hit_rate"] / ideal if ideal else 0.0,
               "ttft_speedup": off["ttft_rest_mean_ms"] / on["ttft_rest_mean_ms"],
               "zero_hit_throughput_ratio": on["zero_hit_output_tok_s"] / off["zero_hit_output_tok_s"]}
    path = write_results(a.out, "prefix", {"num_prompts": n, "prefix_len": plen, "suffix_len": slen, **results,
                                            "summary": summary})
    png = plot_bars(a.out, "prefix", "TTFT of requests 2..N (ms)", {"caching on": on["ttft_rest_mean_ms"],
                                                                    "caching off": off["ttft_rest_mean_ms"]}, "ms")
    print(f"hit rate {on['hit_rate']:.3f} vs block-aligned ideal {ideal:.3f} ({100 * summary['hit_rate_vs_ideal']:.0f}%)")
    print(f"TTFT (requests 2..{n}): {on['ttft_rest_mean_ms']:.1f} ms cached vs {off['ttft_rest_mean_ms']:.1f} ms "
          f"uncached (x{summary['ttft_speedup']:.2f})")
    print(f"0% hits: {on['zero_hit_output_tok_s']:.1f} tok/s with caching vs {off['zero_hit_output_tok_s']:.1f} without "
          f"(ratio {summary['zero_hit_throughput_ratio']:.3f})")
    print(f"wrote {path} and {png}")
    return 0
