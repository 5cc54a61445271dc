"""`appliance bench structured`: what an output constraint costs, in the same
run on the same ``LLM``.

Throughput: chat prompts asking for a person's record as JSON (``LLM.chat``,
greedy, ``--max-tokens`` each) at 1 and 8 concurrent requests (``--concurrency``;
8 = eight conversations submitted together), once unconstrained and once
constrained by a nested JSON schema (``SCHEMA``: a bounded string, an integer
range, an ``email`` format, a bounded array, a nested object with a pattern).
The schema's grammar is compiled before the timed runs (one request warms
the engine's grammar cache), so they measure decoding under a compiled
grammar: the per-step token bitmask and the matcher's advance. A grammar
ends the output when the JSON is complete, so the two runs may produce
different numbers of tokens: they are compared by rate (output tok/s = output
tokens / wall time, and time per output token), with the mean output length
of each. As in `bench spec`, each run also times its batches' prefills alone
(one output token each, the prefix cache emptied first) and reports decode
tok/s: the tokens after the first over the time after the prefills. Each
variant runs ``--repeat`` times, interleaved, and the fastest run counts.
Target: constrained tok/s within 10% of unconstrained at 8 concurrent.

Compile time: ``Grammars.grammar_for`` until the grammar is ready, for
schemas never seen before (the same schema plus a property with a fresh
random name: ``--compiles`` cold compiles) and for the cached schema again;
median and max in milliseconds (cold also as the compile thread's own time,
``StepStats.grammar_compile_seconds``).

The host (CPU model, ISA flags) is recorded with the results, and each run's
weight streaming against `bench machine`'s roofline, as in `bench spec`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from appliance.bench.common import counting_steps, plot_bars, split_overrides, write_results
from appliance.bench.machine import load_or_measure

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}

_ASK = (" Reply with one JSON object with the fields name, age, email, tags (up to four short strings) and "
        "address (city and a five-digit zip).")

PROMPTS = [
    "Describe a fictional person who runs a small bakery in Lyon." + _ASK,
    "Describe the product designer behind a new foldable electric bicycle." + _ASK,
    "Describe the organiser of a summer jazz festival by a lake." + _ASK,
    "Describe a retired sea captain who now repairs old clocks." + _ASK,
    "Describe the lead engineer of a budget smartphone launched this year." + _ASK,
    "Describe a volunteer who coordinates a city marathon." + _ASK,
    "Describe a young chess champion preparing for an international tournament." + _ASK,
    "Describe the founder of a company that sells handmade wooden toys." + _ASK,
]


def _params(max_tokens: int, schema: dict | None) -> Any:
    from appliance import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so)


@contextmanager
def observing(engine: Any) -> Iterator[dict[str, Any]]:
    """While the block runs: ``compiles``, the grammar compile times (seconds)
    reported (each step takes them into ``engine.last_stats``, so they are
    gathered there), and ``max_running``, the most requests one step ran
    (fewer than submitted together: the scheduler did not batch them)."""
    seen: dict[str, Any] = {"compiles": [], "max_running": 0}
    engine.stats()  # drop compile times finished before
    orig = engine.step

    def step():
        deltas = orig()
        seen["compiles"].extend(engine.last_stats.grammar_compile_seconds)
        seen["max_running"] = max(seen["max_running"], engine.last_stats.num_running)
        return deltas

    engine.step = step
    try:
        yield seen
    finally:
        engine.step = orig
        seen["compiles"].extend(engine.stats().grammar_compile_seconds)


def _timed(llm: Any, prompts: list[str], concurrency: int, params: Any) -> tuple[float, list[Any]]:
    """(seconds, outputs) for the prompts, ``concurrency`` submitted together, prefix cache emptied first."""
    llm.engine.reset_prefix_cache()
    outs: list[Any] = []
    t = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = [[{"role": "user", "content": p}] for p in prompts[i : i + concurrency]]
        outs += llm.chat(batch, [params] * len(batch), use_tqdm=False)
    return time.perf_counter() - t, outs


def run(llm: Any, prompts: list[str], concurrency: int, max_tokens: int, schema: dict | None) -> dict:
    """Every prompt once, ``concurrency`` at a time: tok/s (all, and decode
    alone), time per output token, output lengths; with a schema, how many
    outputs the grammar ended and how many of those parse as JSON."""
    prefill_s, _ = _timed(llm, prompts, concurrency, _params(1, schema))
    with observing(llm.engine) as seen, counting_steps(llm.engine) as counter:
        elapsed, outs = _timed(llm, prompts, concurrency, _params(max_tokens, schema))
    lens = [len(o.outputs[0].token_ids) for o in outs]
    n_out, n_req = sum(lens), len(outs)
    decode_s = elapsed - prefill_s  # None below: the prefills alone took as long (noise, or no decoding)
    res = {"elapsed_s": elapsed, "requests": n_req, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
           "ms_per_output_token": 1000 * elapsed / max(1, n_out), "mean_output_len": n_out / n_req,
           "max_output_len": max(lens), "steps": counter["steps"], "prefill_s": prefill_s,
           "decode_tok_s": (n_out - n_req) / decode_s if decode_s > 0 and n_out > n_req else None,
           "decode_ms_per_token": 1000 * decode_s / (n_out - n_req) if decode_s > 0 and n_out > n_req else None,
           "max_running": seen["max_running"], "grammar_compiles_during_run": len(seen["compiles"])}
    if schema is not None:
        ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
        res["ended_by_grammar"] = len(ended)
        res["valid_json"] = sum(1 for text in ended if _parses(text))
    return res


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _ready_ms(grammars: Any, params: Any, timeout_s: float = 120.0) -> float:
    """Milliseconds from ``grammar_for`` until the grammar is compiled."""
    t = time.perf_counter()
    g = grammars.grammar_for(params)
    while not g.ready():
        if time.perf_counter() - t > timeout_s:
            raise TimeoutError(f"a grammar did not compile in {timeout_s:.0f} s")
        grammars.wait(0.01)
    ms = 1000 * (time.perf_counter() - t)
    if g.error is not None:
        raise RuntimeError(f"the benchmark's grammar did not compile: {g.error}")
    return ms


def compile_times(llm: Any, n: int) -> dict:
    """Cold compiles (``n`` schemas never seen) and cached look-ups (the warmed schema, ``n`` times)."""
    grammars = llm.engine.grammars
    llm.engine.stats()  # drop compile times reported so far
    cold = []
    for _ in range(n):
        fresh = json.loads(json.dumps(SCHEMA))
        fresh["properties"][f"x_{uuid.uuid4().hex[:10]}"] = {"type": "string", "maxLength": 20}
        cold.append(_ready_ms(grammars, _params(1, fresh)))
    thread = [1000 * s for s in llm.engine.stats().grammar_compile_seconds]
    cached = [_ready_ms(grammars, _params(1, SCHEMA)) for _ in range(n)]
    recompiled = len(llm.engine.stats().grammar_compile_seconds)

    def summary(xs: list[float]) -> dict:
        return {"median_ms": statistics.median(xs), "max_ms": max(xs), "all_ms": xs} if xs else {}

    return {"cold": summary(cold), "cold_compile_thread": summary(thread), "cached": summary(cached),
            "cached_recompiles": recompiled}


def _level(llm: Any, prompts: list[str], c: int, max_tokens: int, repeat: int, variants: dict[str, Any], plan: Any,
           machine: dict) -> dict[str, Any]:
    """One concurrency level: each variant run ``repeat`` times, interleaved;
    the fastest run of each, and json's ratios to plain."""
    tries: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, schema in variants.items():
            tries[name].append(run(llm, prompts, c, max_tokens, schema))
    both: dict[str, Any] = {}
    for name, runs in tries.items():
        best = dict(min(runs, key=lambda r: r["elapsed_s"] / max(1, r["output_tokens"])))
        best["runs_output_tok_s"] = [r["output_tok_s"] for r in runs]
        best["weight_GBps"] = best["steps"] * plan.weight_bytes_per_device / best["elapsed_s"] / 1e9
        best["bandwidth_fraction"] = best["weight_GBps"] / machine["peak_bandwidth_GBps"]
        both[name] = best
    both["ratio"] = both["json"]["output_tok_s"] / both["plain"]["output_tok_s"]
    dj, dp = both["json"]["decode_tok_s"], both["plain"]["decode_tok_s"]
    both["decode_ratio"] = dj / dp if dj and dp else None
    both["loss"] = 1 - both["ratio"]
    return both


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="appliance bench structured")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--concurrency", default="1,8", help="comma-separated request counts submitted together")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                   help="prompts per run (at least the concurrency; the prompt list repeats)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each variant per level, interleaved; the fastest counts")
    p.add_argument("--compiles", type=int, default=5, help="cold compiles (and cached look-ups) timed")
    p.add_argument("--out", default="bench-results")
    a, overrides = split_overrides(p, argv)
    from appliance import LLM

    machine = load_or_measure(a.out)
    levels = [int(c) for c in a.concurrency.split(",")]
    llm = LLM(overrides=overrides)
    plan = llm.deployment.plan
    result: dict[str, Any] = {"max_tokens": a.max_tokens, "schema": SCHEMA, "repeat": a.repeat, "machine": machine,
                              "profile": llm.resolved.cfg.profile, "model": llm.resolved.cfg.model.name,
                              "dtype": plan.dtype, "config_hash": llm.resolved.hash,
                              "structured_output": dataclasses.asdict(llm.resolved.cfg.structured_output), "runs": {}}
    # warm-up: the model, then the schema's grammar (compiled here, cached for the timed runs)
    llm.chat([[{"role": "user", "content": "Hi"}]], None, use_tqdm=False)
    with observing(llm.engine) as first:
        t = time.perf_counter()
        llm.chat([[{"role": "user", "content": PROMPTS[0]}]], [_params(8, SCHEMA)], use_tqdm=False)
        result["warmup_with_first_compile_s"] = time.perf_counter() - t
    result["first_compile_ms"] = [1000 * s for s in first["compiles"]]
    variants = {"plain": None, "json": SCHEMA}
    for c in levels:
        n = max(c, a.num_prompts)
        prompts = (PROMPTS * -(-n // len(PROMPTS)))[:n]
        both = _level(llm, prompts, c, a.max_tokens, a.repeat, variants, plan, machine)
        result["runs"][f"c={c}"] = both
    target = result["runs"].get("c=8")
    result["target"] = {"concurrency": 8, "max_loss": 0.10,
                        "met": None if target is None else bool(target["loss"] <= 0.10)}
    result["compile"] = compile_times(llm, a.compiles)
    del llm

    bars = {}
    for key, both in result["runs"].items():
        pl, js = both["plain"], both["json"]
        bars[f"{key} plain"] = pl["output_tok_s"]
        bars[f"{key} json"] = js["output_tok_s"]
        print(f"{key:5} plain {pl['output_tok_s']:7.1f} tok/s ({pl['ms_per_output_token']:.1f} ms/token, "
              f"mean {pl['mean_output_len']:.1f} tokens), json {js['output_tok_s']:7.1f} tok/s "
              f"({js['ms_per_output_token']:.1f} ms/token, mean {js['mean_output_len']:.1f} tokens, "
              f"{js['ended_by_grammar']}/{js['requests']} ended by the grammar, {js['valid_json']} valid JSON): "
              f"x{both['ratio']:.3f} (loss {both['loss']:.1%}); decode "
              + (f"x{both['decode_ratio']:.3f}" if both["decode_ratio"] else "n/a"))
        if min(pl["max_running"], js["max_running"]) < min(int(key[2:]), pl["requests"]):
            print(f"{key:5} NOTE: at most {min(pl['max_running'], js['max_running'])} request(s) ran in one step: "
                  f"the scheduler did not batch the {key[2:]} submitted together")
    if result["target"]["met"] is not None:
        print(f"target (loss <= 10% at 8 concurrent): {'met' if result['target']['met'] else 'NOT met'}")
    comp = result["compile"]
    print(f"grammar compile: cold median {comp['cold']['median_ms']:.1f} ms, max {comp['cold']['max_ms']:.1f} ms "
          f"(compile thread median {comp['cold_compile_thread'].get('median_ms', float('nan')):.1f} ms; "
          f"n={len(comp['cold']['all_ms'])}); cached median {comp['cached']['median_ms']:.3f} ms, "
          f"max {comp['cached']['max_ms']:.3f} ms")
    path = write_results(a.out, "structured", result)
    host = json.loads(path.read_text())["host"]
    print(f"machine: {host['cpu']} ({host['cpus']} cpus; {' '.join(host['cpu_isa'])}), "
          f"model {result['model']} {result['dtype']}, profile {result['profile']}")
    png = plot_bars(a.out, "structured", "Output tok/s unconstrained and JSON-schema constrained", bars, "tok/s")
    print(f"wrote {path} and {png}")
    return 0
