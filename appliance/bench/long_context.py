"""`appliance bench long-context`: decode at long contexts, and the rate it reads the KV cache at.

For each context length (``--contexts``) and stream count (``--streams``): that many distinct prompts
of that length are each prefilled alone (the prefill rate of one prompt), then decode together from the
prefix cache for ``--steps`` timed steps (the inter-token latency, ITL, and tokens a second). A decode
step reads every stream's whole context of KV, ``streams x context x kv bytes a token``, besides the
weights; between two context lengths the ITL grows by the time that many more KV bytes take, so the
achieved KV read rate is the extra bytes over the extra ITL, set against the machine's measured read
bandwidth (``bench machine``).

Each ``--also "OVERRIDES"`` runs the same prompts again in the same session on a deployment with those
overrides too (a KV dtype, ``cache.kv_cache_dtype=fp8_e4m3`` halving the bytes; another attention backend,
``attention.backend=torch_sdpa``, the torch layer path), with its ITL against the first deployment's.

    appliance bench long-context model=tiny_random model.hidden_size=896 model.num_layers=24 \\
        model.num_heads=14 model.num_kv_heads=2 model.head_dim=64 model.intermediate_size=4864 \\
        model.vocab_size=151936 model.max_model_len=32768 model.dtype=bfloat16 \\
        cache.kv_cache_dtype=bfloat16 cache.kv_cache_memory_gib=4 --contexts 512,2048,8192,32768

With ``--base-url URL`` the same scenario runs against any OpenAI-compatible server (vLLM's own, say),
over HTTP with the load client of `appliance bench serve`; ``--served`` starts `appliance run` with the
overrides for it. Each prompt is sent alone for one token (its time to that token is the prefill), then
the streams ask for ``--steps`` more tokens together, greedy and past EOS: their ITL is the mean of the
streams' time per output token (from each stream's first token to its end), and the slowest stream's
first token is recorded too (a prompt in the prefix cache should answer at once). The overrides name the
model for its vocabulary and KV bytes a token (``bench machine``'s bandwidth is this host's). Writes
``long_context-LABEL.json``, which `python -m appliance.bench.compare` sets beside a baseline's.

    appliance bench long-context --base-url http://127.0.0.1:8000 --label vllm +profile=cpu quantization=none
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Optional

from tqdm import tqdm

from appliance.bench.common import (plot_lines, random_prompts, result_name, server_under_test, split_overrides,
                                    write_results)
from appliance.bench.latency import decode_ms
from appliance.bench.machine import kernel_variants, load_or_measure


def prefill_alone(engine, prompts: list[list[int]]) -> float:
    """Each prompt prefilled by itself (one token generated); seconds of the first, which ran on a pool that
    held none of them. Their blocks stay in the prefix cache for the decode that follows."""
    from appliance import SamplingParams

    first = 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{len(prompt)}-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        first = first or time.perf_counter() - t
    return first


def kv_read_rates(rows: list[dict], kv_bytes_per_token: int) -> None:
    """Per row past the first context of its stream count: the KV read rate from the growth of the ITL
    since the previous context, in place (``kv_GBps``). Rows of one deployment, contexts ascending."""
    last: dict[int, dict] = {}
    for r in rows:
        prev = last.get(r["streams"])
        if prev is not None and r["itl_ms"] > prev["itl_ms"]:
            extra = r["streams"] * (r["context"] - prev["context"]) * kv_bytes_per_token
            r["kv_GBps"] = extra / ((r["itl_ms"] - prev["itl_ms"]) / 1e3) / 1e9
        last[r["streams"]] = r


def run(engine, vocab: int, contexts: list[int], streams: list[int], steps: int) -> list[dict]:
    rows = []
    warm = random_prompts(1, [min(contexts)], vocab, seed=1)
    prefill_alone(engine, warm)  # the first step's one-time costs (kernel builds, allocations) before any timing
    decode_ms(engine, warm, 2)
    for context in contexts:
        for c in streams:
            prompts = random_prompts(c, [context] * c, vocab, seed=context * 1000 + c)
            prefill_s = prefill_alone(engine, prompts)
            ms = decode_ms(engine, prompts, steps)  # from the prefix cache the prefills left
            rows.append({"context": context, "streams": c, "prefill_s": prefill_s,
                         "prefill_tok_s": context / prefill_s, "itl_ms": ms, "decode_tok_s": c / ms * 1e3})
    return rows


def deployment(overrides: list[str], contexts: list[int], streams: list[int], steps: int, bandwidth: float
               ) -> dict:
    """One deployment's runs: its facts and rows, the KV read rates against ``bandwidth``."""
    import gc

    from appliance import LLM

    llm = LLM(overrides=overrides)
    engine, cfg, plan = llm.engine, llm.resolved.cfg, llm.deployment.plan
    rows = run(engine, cfg.model.vocab_size, contexts, streams, steps)
    kv_read_rates(rows, plan.kv_bytes_per_token)
    for r in rows:
        if "kv_GBps" in r:
            r["kv_bandwidth_fraction"] = r["kv_GBps"] / bandwidth
    facts = {"config_hash": llm.resolved.hash, "model": cfg.model.name, "dtype": plan.dtype,
             "kv_cache_dtype": str(engine.runner.kv_caches[0].dtype).removeprefix("torch."),
             "attention_backend": llm.execution.backend, "kv_bytes_per_token": plan.kv_bytes_per_token, "rows": rows}
    del llm, engine
    gc.collect()  # one deployment's weights and KV pool at a time
    return facts


async def served_rows(url: str, model: Optional[str], headers: dict, vocab: int, contexts: list[int],
                      streams: list[int], steps: int) -> list[dict]:
    """``run`` over HTTP: the same prompts (the same seeds), each alone for one token, then together for
    ``steps`` more. Raises on a failed request."""
    import httpx

    from appliance.bench.serve import one_request

    async def ask(client, prompts: list[list[int]], tokens: int) -> list[dict]:
        results = await asyncio.gather(*(one_request(client, url, model, p, tokens, headers) for p in prompts))
        failed = [r["error"] for r in results if not r["ok"]]
        if failed:
            raise RuntimeError(f"requests to {url} failed: {failed[:3]}")
        return results

    rows = []
    limits = httpx.Limits(max_connections=max(streams) + 4, max_keepalive_connections=max(streams) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        await ask(client, random_prompts(1, [min(contexts)], vocab, seed=1), 2)  # the first request's one-time costs
        for context in contexts:
            for c in streams:
                prompts = random_prompts(c, [context] * c, vocab, seed=context * 1000 + c)
                alone = [(await ask(client, [p], 1))[0] for p in prompts]
                together = await ask(client, prompts, steps + 1)
                itl = statistics.mean(r["tpot"] for r in together)
                rows.append({"context": context, "streams": c, "prefill_s": alone[0]["ttft"],
                             "prefill_tok_s": context / alone[0]["ttft"], "itl_ms": itl * 1e3,
                             "decode_tok_s": c / itl, "ttft_max_ms": max(r["ttft"] for r in together) * 1e3})
    return rows


def served(url: str, label: str, model: Optional[str], headers: dict, overrides: list[str], contexts: list[int],
           streams: list[int], steps: int, bandwidth: float) -> dict:
    """A server's runs (``served_rows``), the model's facts from ``overrides`` (its vocabulary and KV bytes a
    token, as the appliance would plan them), the KV read rates against ``bandwidth``."""
    import httpx

    from appliance.config.compose import resolve
    from appliance.config.plan import make_plan

    cfg = resolve(overrides or ["+profile=cpu"], check=False).cfg
    kv_bytes = make_plan(cfg).kv_bytes_per_token
    model = model or httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    rows = asyncio.run(served_rows(url, model, headers, cfg.model.vocab_size, contexts, streams, steps))
    kv_read_rates(rows, kv_bytes)
    for r in rows:
        if "kv_GBps" in r:
            r["kv_bandwidth_fraction"] = r["kv_GBps"] / bandwidth
    return {"server": label, "url": url, "model": model, "kv_bytes_per_token": kv_bytes, "rows": rows}


def _report(runs: dict, bandwidth: float) -> None:
    for label, run_ in runs.items():
        how = (f"{run_['attention_backend']}, {run_['kv_cache_dtype']} KV" if "attention_backend" in run_
               else f"served at {run_['url']}, {run_['model']}")
        print(f"{label} ({how}, {run_['kv_bytes_per_token']} bytes a token):")
        for r in run_["rows"]:
            rate = (f", KV read {r['kv_GBps']:.1f} GB/s ({100 * r['kv_bandwidth_fraction']:.0f}% of {bandwidth:.1f})"
                    if "kv_GBps" in r else "")
            vs = f", ITL x{r['itl_vs_first']:.2f} the first" if "itl_vs_first" in r else ""
            late = f", the last stream's first token {r['ttft_max_ms']:.0f} ms" if "ttft_max_ms" in r else ""
            print(f"  context {r['context']:>6} x {r['streams']}: prefill {r['prefill_tok_s']:7.0f} tok/s, "
                  f"ITL {r['itl_ms']:7.2f} ms, decode {r['decode_tok_s']:7.1f} tok/s{rate}{vs}{late}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench long-context")
    p.add_argument("--contexts", default="512,2048,6000", help="prompt lengths in tokens")
    p.add_argument("--streams", default="1,4", help="streams decoding together")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--also", action="append", default=[], metavar="OVERRIDES",
                   help="run again with these extra overrides (space-separated), e.g. cache.kv_cache_dtype=fp8_e4m3")
    p.add_argument("--base-url", default=None, help="run over HTTP against this OpenAI-compatible server")
    p.add_argument("--served", action="store_true", help="run over HTTP against `appliance run` with the overrides")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--label", default=None, help="name of the server under test (served runs)")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    over_http = a.served or a.base_url is not None
    if over_http and a.also:
        p.error("--also compares deployments in one process; a served run measures one server")
    machine = load_or_measure(a.out)
    bandwidth = machine["peak_bandwidth_GBps"]
    contexts = sorted(int(x) for x in a.contexts.split(","))
    streams = [int(x) for x in a.streams.split(",")]
    if over_http:
        url, own = server_under_test(a.base_url, overrides)
        label = a.label or ("appliance" if own else url)
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        try:
            runs = {label: served(url, label, a.model, headers, overrides, contexts, streams, a.steps, bandwidth)}
        finally:
            if own:
                own.stop()
        name = result_name("long_context", label)
    else:
        runs = {"appliance": deployment(overrides, contexts, streams, a.steps, bandwidth)}
        for extra in tqdm(a.also, desc="bench long-context: --also"):
            runs[extra] = deployment(overrides + extra.split(), contexts, streams, a.steps, bandwidth)
            for r, base in zip(runs[extra]["rows"], runs["appliance"]["rows"]):
                r["itl_vs_first"] = r["itl_ms"] / base["itl_ms"]
        name = "long_context"
    path = write_results(a.out, name, {"contexts": contexts, "streams": streams, "steps": a.steps,
                                       "machine": machine, "deployments": runs,
                                       # this host's native kernels, where the appliance ran here
                                       **({} if a.base_url else {"kernel_variants": kernel_variants()})})
    series: dict[str, tuple[list, list]] = {}
    for label, run_ in runs.items():
        for r in run_["rows"]:
            xs, ys = series.setdefault(f"{label}, {r['streams']} stream(s)", ([], []))
            xs.append(r["context"])
            ys.append(r["itl_ms"])
    png = plot_lines(a.out, name, "Decode ITL by context", "context (tokens)", "ms per step", series, logx=True)
    _report(runs, bandwidth)
    print(f"wrote {path} and {png}")
    return 0
