"""`appliance bench perplexity`: how much a deployment's choices (quantization,
KV dtype, dtype, backend) cost in quality, as the perplexity of a fixed text.

The text (``data/perplexity.txt``, plain English prose shipped with the
package, or ``--text FILE``) is tokenized once and cut into windows of
``--window`` tokens; each window runs as one request with
``prompt_logprobs=0`` and every token but a window's first is scored given
those before it in its window. Perplexity is exp of the mean negative
log-likelihood over the scored tokens. The deployment given by the
overrides is the reference; each ``--also "OVERRIDES"`` runs again with those
overrides added, on the same tokens, and reports its perplexity's change
against the reference (JSON + a bar plot).
"""

from __future__ import annotations

import argparse
import gc
import math
import shlex
import sys
import time
from importlib import resources
from typing import Any

from appliance.bench.common import plot_bars, split_overrides, write_results
from appliance.errors import ConfigError


def default_text() -> str:
    return resources.files("appliance.bench").joinpath("data/perplexity.txt").read_text(encoding="utf-8")


def windows(ids: list[int], window: int) -> list[list[int]]:
    """``ids`` in consecutive windows of ``window`` tokens (the last may be
    shorter; one of a single token scores nothing and is dropped)."""
    if window < 2:
        raise ValueError(f"a window must hold at least 2 tokens, got {window}")
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids) - i >= 2]


def score(llm: Any, windows_ids: list[list[int]]) -> dict[str, float]:
    """The windows' scored tokens under ``llm``: their count, mean negative
    log-likelihood (nats) and perplexity."""
    from appliance import SamplingParams

    outs = llm.generate(windows_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    nll, n = 0.0, 0
    for ids, out in zip(windows_ids, outs):
        lps = out.prompt_logprobs
        if lps is None or len(lps) != len(ids):
            raise RuntimeError(f"request {out.request_id} came back without its prompt logprobs")
        nll -= sum(lp.logprob for lp in lps[1:])
        n += len(ids) - 1
    return {"tokens_scored": n, "mean_nll": nll / n, "perplexity": math.exp(nll / n)}


def run_variant(overrides: list[str], text: str, window: int) -> dict[str, Any]:
    from appliance import LLM

    llm = LLM(overrides=overrides)
    try:
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        plan = llm.deployment.plan
        t = time.perf_counter()
        result = score(llm, windows(ids, min(window, llm.deployment.max_model_len - 1)))
        result.update(seconds=time.perf_counter() - t, text_tokens=len(ids), dtype=llm.execution.dtype,
                      kv_cache_dtype=llm.execution.kv_cache_dtype, backend=llm.execution.selection.chosen,
                      quantization=llm.resolved.cfg.quantization.method, weight_bytes=plan.weight_bytes_per_device,
                      config_hash=llm.resolved.hash)
        return result
    finally:
        del llm
        gc.collect()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench perplexity")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the packaged prose sample)")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--also", action="append", default=[], metavar="OVERRIDES",
                   help="another variant: these overrides added to the reference's (repeatable)")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    text = open(a.text, encoding="utf-8").read() if a.text else default_text()
    ref = run_variant(overrides, text, a.window)
    result: dict[str, Any] = {"overrides": overrides, "window": a.window, "text": a.text or "packaged",
                              "reference": ref, "also": {}}
    rows = [("reference", ref)]
    for extra in a.also:
        try:
            res = run_variant(overrides + shlex.split(extra), text, a.window)
        except ConfigError as e:  # one variant that cannot run does not lose the others
            result["also"][extra] = {"error": str(e)}
            print(f"{extra}: not run: {e}", file=sys.stderr)
            continue
        res["delta_perplexity_pct"] = 100 * (res["perplexity"] / ref["perplexity"] - 1)
        res["delta_mean_nll"] = res["mean_nll"] - ref["mean_nll"]
        result["also"][extra] = res
        rows.append((extra, res))
    path = write_results(a.out, "perplexity", result)
    png = plot_bars(a.out, "perplexity", f"Perplexity over {ref['tokens_scored']} tokens ({a.window}-token windows)",
                    {name: r["perplexity"] for name, r in rows}, "perplexity")
    for name, r in rows:
        delta = f"  {r['delta_perplexity_pct']:+6.2f}%" if "delta_perplexity_pct" in r else ""
        print(f"{name:<60} ppl {r['perplexity']:8.3f}{delta}  ({r['quantization']}, {r['dtype']} weights, "
              f"{r['kv_cache_dtype']} KV, {r['weight_bytes'] / 1e6:.0f} MB, {r['seconds']:.1f} s)")
    print(f"wrote {path} and {png}")
    return 0
