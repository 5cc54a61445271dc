"""Side-by-side table of `appliance bench serve` runs against one baseline
server (``scripts/bench_vs_llamacpp.sh``, ``scripts/bench_vs_peers.sh``):
per concurrency level, each server's output tok/s and TTFT p50 and its
same-run ratios to the baseline; a long prompt alone (its TTFT and the
speed-up over the baseline's); the mixed load; the request mix (`appliance
bench mix`, ``mix-LABEL.json`` where a server has one: its requests, prompt
and generated tokens against the baseline's in the same time); the host they
ran on.

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


def _file(label: str, bench: str = "serve") -> str:
    return f"{bench}-{label.replace('/', '_').replace(':', '_')}.json"


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
    runs = {lb: json.loads((out_dir / _file(lb)).read_text()) for lb in [baseline, *labels]}
    base = {lv["max_concurrency"]: lv for lv in runs[baseline]["levels"]}
    rows = []
    for lb in labels:
        for lv in runs[lb]["levels"]:
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
    mixed = [{"server": lb, **runs[lb]["mixed_load"]} for lb in [baseline, *labels]  # beside streams (none: alone)
             if "error" not in runs[lb].get("mixed_load", {"error": None}) and runs[lb]["mixed_load"].get("streams")]
    prefill = []
    base_alone = _alone(runs[baseline])
    for lb in [baseline, *labels]:
        a = _alone(runs[lb])
        if a is not None:
            ratio = base_alone["long_prompt_ttft_ms"] / a["long_prompt_ttft_ms"] if base_alone else None
            itl, base_itl = a.get("long_prompt_itl_p50_ms"), (base_alone or {}).get("long_prompt_itl_p50_ms")
            prefill.append({"server": lb, "prompt_tokens": a["long_prompt_len"], "ttft_ms": a["long_prompt_ttft_ms"],
                            "prompt_tok_s": a["long_prompt_len"] / a["long_prompt_ttft_ms"] * 1e3,
                            "speedup_over_baseline": ratio, "itl_ms": itl,
                            "itl_speedup_over_baseline": base_itl / itl if itl and base_itl else None})
    return {"baseline": baseline, "host": runs[baseline].get("host"), "input_len": runs[baseline].get("input_len"),
            "output_len": runs[baseline].get("output_len"), "rows": rows, "prefill_alone": prefill,
            "mixed_load": mixed, "request_mix": request_mix(out_dir, baseline, labels)}


def markdown(result: dict) -> str:
    host = result.get("host") or {}
    lines = [f"Host: {host.get('cpu', '?')} ({host.get('cpus', '?')} CPUs), flags {' '.join(host.get('cpu_isa', []))}; "
             f"{result['input_len']}-token prompts, {result['output_len']} output tokens; baseline "
             f"{result['baseline']}.", "",
             f"| server | concurrency | out tok/s | {result['baseline']} tok/s | ratio | TTFT p50 ms | "
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
