"""Side-by-side table of `appliance bench serve` runs against one baseline
server (``scripts/bench_vs_llamacpp.sh``, ``scripts/bench_vs_peers.sh``):
per concurrency level, each server's output tok/s and TTFT p50 and its
same-run ratios to the baseline; a long prompt alone (its TTFT and the
speed-up over the baseline's); the mixed load; the request mix (`appliance
bench mix`, ``mix-LABEL.json`` where a server has one: its requests, prompt
and generated tokens against the baseline's in the same time); the host they
ran on; decode at long context (`appliance bench long-context --base-url`,
``long_context-LABEL.json`` where a server has one: ITL and prefill at each
context and stream count against the baseline's, and the ITL's growth from
the shortest context).

    python -m appliance.bench.compare OUT_DIR BASELINE_LABEL LABEL...

reads ``OUT_DIR/serve-LABEL.json`` and writes ``OUT_DIR/compare.json`` and
``OUT_DIR/compare.md``.

    python -m appliance.bench.compare merge OUT_DIR LABEL PART...

folds the runs ``serve-PART.json`` of one server into ``serve-LABEL.json``:
their levels, and a run of the long prompt with no streams as the prompt
alone (``prefill_alone``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from appliance.bench.common import result_name


def _file(label: str, bench: str = "serve") -> str:
    return f"{result_name(bench, label)}.json"


def request_mix(out_dir: Path, baseline: str, labels: list[str]) -> list[dict]:
    """Each server's `bench mix` totals (where it ran one) and their ratios to the baseline's."""
    runs = {lb: json.loads((out_dir / _file(lb, "mix")).read_text()) for lb in [baseline, *labels]
            if (out_dir / _file(lb, "mix")).exists()}
    base = runs.get(baseline, {}).get("totals")
    rows = []
    for lb, run in runs.items():
        t = run["totals"]
        ratio = {k: t[k] / base[k] if base and base[k] else None
                 for k in ("requests", "prompt_tokens", "generated_tokens")}
        verify = run.get("verify") or {}
        rows.append({"server": lb, "duration_s": run["duration_s"], "clients": run["clients"],
                     **{k: t[k] for k in ("requests", "prompt_tokens", "generated_tokens", "errors")},
                     "ratio": ratio, "answers_checked": verify.get("checked"), "answers_equal": verify.get("equal")})
    return rows


def long_context(out_dir: Path, baseline: str, labels: list[str]) -> list[dict]:
    """Each server's `bench long-context` rows (where it ran one) beside the baseline's at the same context and
    stream count: their ITL and prefill against the baseline's (speed-ups: the baseline's time over the
    server's), and the ITL over the server's own at its shortest context with as many streams."""
    runs = {}
    for lb in [baseline, *labels]:
        path = out_dir / _file(lb, "long_context")
        if path.exists():
            runs[lb] = next(iter(json.loads(path.read_text())["deployments"].values()))["rows"]
    base = {(r["context"], r["streams"]): r for r in runs.get(baseline, [])}
    out = []
    for lb, rows in runs.items():
        shortest: dict[int, dict] = {}
        for r in sorted(rows, key=lambda r: r["context"]):
            first = shortest.setdefault(r["streams"], r)
            b = base.get((r["context"], r["streams"]))
            out.append({"server": lb, "context": r["context"], "streams": r["streams"], "itl_ms": r["itl_ms"],
                        "decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"],
                        "ttft_max_ms": r.get("ttft_max_ms"), "kv_GBps": r.get("kv_GBps"),
                        "itl_over_shortest": r["itl_ms"] / first["itl_ms"],
                        "decode_speedup": b["itl_ms"] / r["itl_ms"] if b else None,
                        "prefill_speedup": r["prefill_tok_s"] / b["prefill_tok_s"] if b else None})
    return out


def _long_context_host(out_dir: Path, label: str) -> Optional[dict]:
    """The host of a server's `bench long-context` run, where it has one."""
    path = out_dir / _file(label, "long_context")
    return json.loads(path.read_text()).get("host") if path.exists() else None


def merge(out_dir: Path, label: str, parts: list[str]) -> dict:
    """``serve-LABEL.json`` with the levels of each part, and a part's long prompt run alone (no streams)
    as ``prefill_alone``; written back."""
    path = out_dir / _file(label)
    run = json.loads(path.read_text())
    for part in parts:
        p = json.loads((out_dir / _file(part)).read_text())
        run["levels"] = sorted(run.get("levels", []) + p.get("levels", []), key=lambda lv: lv["max_concurrency"])
        mixed = p.get("mixed_load")
        if mixed is not None and mixed.get("streams") == 0:
            run["prefill_alone"] = mixed
    path.write_text(json.dumps(run, indent=2))
    return run


def _alone(run: dict) -> Optional[dict]:
    alone = run.get("prefill_alone")
    return None if alone is None or "error" in alone else alone


def compare(out_dir: Path, baseline: str, labels: list[str]) -> dict:
    # `bench serve`'s runs where a server has one (a sitting may have run only `bench long-context`)
    runs = {lb: json.loads((out_dir / _file(lb)).read_text()) for lb in [baseline, *labels]
            if (out_dir / _file(lb)).exists()}
    base = {lv["max_concurrency"]: lv for lv in runs.get(baseline, {}).get("levels", [])}
    rows = []
    for lb in labels:
        for lv in runs.get(lb, {}).get("levels", []):
            b = base.get(lv["max_concurrency"])
            if b is None:
                continue
            rows.append({
                "server": lb, "max_concurrency": lv["max_concurrency"],
                "output_tok_s": lv["output_tok_s"], "baseline_output_tok_s": b["output_tok_s"],
                "tok_s_ratio": lv["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else None,
                "ttft_p50_ms": lv["ttft_ms"]["p50"], "baseline_ttft_p50_ms": b["ttft_ms"]["p50"],
                "ttft_ratio": lv["ttft_ms"]["p50"] / b["ttft_ms"]["p50"] if b["ttft_ms"]["p50"] else None,
                "failed": lv["failed"], "baseline_failed": b["failed"],
            })
    mixed = [{"server": lb, **run["mixed_load"]} for lb, run in runs.items()  # beside streams (none: alone)
             if "error" not in run.get("mixed_load", {"error": None}) and run["mixed_load"].get("streams")]
    prefill = []
    base_alone = _alone(runs.get(baseline, {}))
    for lb, run in runs.items():
        a = _alone(run)
        if a is not None:
            ratio = base_alone["long_prompt_ttft_ms"] / a["long_prompt_ttft_ms"] if base_alone else None
            itl, base_itl = a.get("long_prompt_itl_p50_ms"), (base_alone or {}).get("long_prompt_itl_p50_ms")
            prefill.append({"server": lb, "prompt_tokens": a["long_prompt_len"], "ttft_ms": a["long_prompt_ttft_ms"],
                            "prompt_tok_s": a["long_prompt_len"] / a["long_prompt_ttft_ms"] * 1e3,
                            "speedup_over_baseline": ratio, "itl_ms": itl,
                            "itl_speedup_over_baseline": base_itl / itl if itl and base_itl else None})
    first: dict = runs.get(baseline) or next(iter(runs.values()), {})
    return {"baseline": baseline, "host": first.get("host") or _long_context_host(out_dir, baseline),
            "input_len": first.get("input_len"), "output_len": first.get("output_len"), "rows": rows,
            "prefill_alone": prefill,
            "mixed_load": mixed, "request_mix": request_mix(out_dir, baseline, labels),
            "long_context": long_context(out_dir, baseline, labels)}


def markdown(result: dict) -> str:
    host = result.get("host") or {}
    lines = [f"Host: {host.get('cpu', '?')} ({host.get('cpus', '?')} CPUs), flags {' '.join(host.get('cpu_isa', []))}; "
             + (f"{result['input_len']}-token prompts, {result['output_len']} output tokens; "
                if result.get("input_len") else "") + f"baseline {result['baseline']}."]
    if result["rows"]:
        lines += ["", f"| server | concurrency | out tok/s | {result['baseline']} tok/s | ratio | TTFT p50 ms | "
                  f"{result['baseline']} TTFT p50 ms | TTFT ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['server']} | {r['max_concurrency']} | {r['output_tok_s']:.1f} | "
                     f"{r['baseline_output_tok_s']:.1f} | {r['tok_s_ratio']:.2f}x | {r['ttft_p50_ms']:.0f} | "
                     f"{r['baseline_ttft_p50_ms']:.0f} | {r['ttft_ratio']:.2f} |")
    if result.get("prefill_alone"):
        lines += ["", "A long prompt alone (`bench serve --long-prompt N --long-streams 0`; its decode after it, at that "
                  "context, where it asked for more than one token: `--long-prompt-tokens`):", "",
                  "| server | prompt tokens | TTFT ms | prompt tok/s | speed-up over the baseline | its ITL p50 ms | "
                  "decode speed-up |", "|---|---|---|---|---|---|---|"]
        for a in result["prefill_alone"]:
            ratio = f"{a['speedup_over_baseline']:.2f}x" if a["speedup_over_baseline"] else "-"
            itl = f"{a['itl_ms']:.1f}" if a.get("itl_ms") else "-"
            dec = f"{a['itl_speedup_over_baseline']:.2f}x" if a.get("itl_speedup_over_baseline") else "-"
            lines.append(f"| {a['server']} | {a['prompt_tokens']} | {a['ttft_ms']:.0f} | {a['prompt_tok_s']:.0f} | "
                         f"{ratio} | {itl} | {dec} |")
    if result.get("mixed_load"):
        lines += ["", "A long prompt arriving while streams decode (`bench serve --long-prompt`):", "",
                  "| server | long prompt tokens | its TTFT ms | streams | their ITL p50 ms | worst gap ms | "
                  "gap / ITL | their tokens meanwhile |", "|---|---|---|---|---|---|---|---|"]
        for m in result["mixed_load"]:
            lines.append(f"| {m['server']} | {m['long_prompt_len']} | {m['long_prompt_ttft_ms']:.0f} | {m['streams']} | "
                         f"{m['stream_itl_p50_ms_before'] or 0:.1f} | {m['worst_stream_gap_ms']:.0f} | "
                         f"{m['worst_gap_over_itl'] or 0:.1f}x | {m['stream_tokens_during_prefill']} |")
    if result.get("request_mix"):
        lines += ["", "The request mix (`bench mix`; ratios to the baseline in the same time):", "",
                  "| server | clients x seconds | requests | prompt tokens | generated tokens | errors | "
                  "answers equal alone |", "|---|---|---|---|---|---|---|"]

        def cell(n: int, ratio: Optional[float]) -> str:
            return f"{n} ({ratio:.2f}x)" if ratio is not None else str(n)

        for m in result["request_mix"]:
            checked = f"{m['answers_equal']} of {m['answers_checked']}" if m["answers_checked"] else "-"
            lines.append(f"| {m['server']} | {m['clients']} x {m['duration_s']:g} | "
                         f"{cell(m['requests'], m['ratio']['requests'])} | "
                         f"{cell(m['prompt_tokens'], m['ratio']['prompt_tokens'])} | "
                         f"{cell(m['generated_tokens'], m['ratio']['generated_tokens'])} | {m['errors']} | "
                         f"{checked} |")
    if result.get("long_context"):
        lines += ["", "Decode at long context (`bench long-context --base-url`: each prompt prefilled alone, then the "
                  "streams decode together from the prefix cache; speed-ups: the baseline's time over the server's):",
                  "", "| server | context | streams | prefill tok/s | speed-up | ITL ms | decode speed-up | "
                  "ITL / its shortest context's | KV read GB/s | last stream's first token ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]

        def times(x: Optional[float]) -> str:
            return f"{x:.2f}x" if x is not None else "-"

        for m in result["long_context"]:
            kv = f"{m['kv_GBps']:.1f}" if m.get("kv_GBps") else "-"
            late = f"{m['ttft_max_ms']:.0f}" if m.get("ttft_max_ms") is not None else "-"
            lines.append(f"| {m['server']} | {m['context']} | {m['streams']} | {m['prefill_tok_s']:.0f} | "
                         f"{times(m['prefill_speedup'])} | {m['itl_ms']:.2f} | {times(m['decode_speedup'])} | "
                         f"{m['itl_over_shortest']:.2f}x | {kv} | {late} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "merge":
        merge(Path(argv[1]), argv[2], argv[3:])
        return 0
    out_dir = Path(argv[0])
    result = compare(out_dir, argv[1], argv[2:])
    (out_dir / "compare.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (out_dir / "compare.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
