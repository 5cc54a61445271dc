"""`appliance bench pd`: disaggregated prefill (``kv_transfer=p2p``) on a
long prompt, three engines in this process over loopback.

For each of ``--repeat`` fresh ``--prompt-len``-token prompts:

- colocated: one engine's time to first token, prefill included;
- producer: the prefill alone, held for a consumer
  (``do_remote_decode``);
- consumer: the time to first token of an engine given the producer's
  ``kv_transfer_params``. It fetches every block but the one the last token
  fills, writes them, runs the last token, and samples.

Reported: medians, the bytes fetched and the rate the consumer got them at
(its time to first token less a one-token step, measured on its own), and
the consumer's time against the colocated prefill. The consumer's first
token is the colocated engine's; that is checked, not assumed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from appliance.bench.common import plot_bars, random_prompts, split_overrides, write_results


def _timed(llm, prompt: list[int], params) -> tuple[float, object]:
    t = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return (time.perf_counter() - t) * 1e3, out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench pd")
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM, SamplingParams
    from appliance.worker.executor import free_port

    plain = LLM(overrides=overrides)
    producer = LLM(overrides=[*overrides, "kv_transfer=p2p", "kv_transfer.role=producer",
                              f"kv_transfer.p2p.port={free_port()}"])
    consumer = LLM(overrides=[*overrides, "kv_transfer=p2p", "kv_transfer.role=consumer"])
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                             kv_transfer_params={"do_remote_decode": True})
    vocab = plain.resolved.cfg.model.vocab_size
    prompts = random_prompts(a.repeat + 1, [a.prompt_len] * (a.repeat + 1), vocab, seed=5)
    one_token = [_timed(consumer, [7], first)[0] for _ in range(3)]  # a one-token step, warm
    runs: dict[str, list[float]] = {"colocated": [], "producer": [], "consumer": []}
    fetched = 0
    for i, prompt in enumerate(prompts):
        ms_plain, out_plain = _timed(plain, prompt, first)
        ms_prod, out_prod = _timed(producer, prompt, prefill)
        loaded = consumer.engine.scheduler.connector.loaded_tokens
        ms_cons, out_cons = _timed(consumer, prompt, SamplingParams(
            max_tokens=1, temperature=0, ignore_eos=True, kv_transfer_params=out_prod.kv_transfer_params))
        if out_cons.outputs[0].token_ids != out_plain.outputs[0].token_ids:
            raise RuntimeError("the consumer's first token differs from the colocated engine's")
        if i == 0:
            continue  # the first round warms every engine up
        fetched = consumer.engine.scheduler.connector.loaded_tokens - loaded
        for name, ms in (("colocated", ms_plain), ("producer", ms_prod), ("consumer", ms_cons)):
            runs[name].append(ms)
    if consumer.engine.scheduler.connector.failed_loads:
        raise RuntimeError("a fetch failed; see the log")
    caches = consumer.engine.runner.kv_caches
    bytes_per_token = sum(c[:, 0].numel() * c.element_size() for c in caches) // caches[0].shape[2]
    med = {name: statistics.median(v) for name, v in runs.items()}
    fetch_ms = max(med["consumer"] - statistics.median(one_token), 1e-3)
    results = {
        "prompt_len": a.prompt_len, "repeat": a.repeat, "runs_ms": runs, "median_ms": med,
        "one_token_step_ms": statistics.median(one_token), "fetched_tokens": fetched,
        "fetched_bytes": fetched * bytes_per_token, "fetch_gb_s": fetched * bytes_per_token / fetch_ms / 1e6,
        "consumer_vs_colocated": med["consumer"] / med["colocated"],
    }
    path = write_results(a.out, "pd", results)
    plot_bars(a.out, "pd", f"{a.prompt_len}-token prompt: time to first token (ms)", med, "ms")
    for name, ms in med.items():
        print(f"{name:10s} {ms:9.1f} ms")
    print(f"fetched {fetched} tokens, {results['fetched_bytes'] / 1e6:.1f} MB at {results['fetch_gb_s']:.2f} GB/s; "
          f"consumer TTFT {results['consumer_vs_colocated']:.3f}x the colocated one")
    print(path)
    return 0
