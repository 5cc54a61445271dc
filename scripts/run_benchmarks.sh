#!/usr/bin/env bash
# The full benchmark run behind docs/benchmarks.md: cpu profile, SmolLM2-135M,
# 100-token prompts, 128 output tokens, ignore_eos. Results: bench-results/full/.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${APPLIANCE:-.venv/bin/appliance}
OUT=${OUT:-bench-results/full}
M="+profile=cpu cache.kv_cache_memory_gib=1.0 model.max_model_len=2048"
mkdir -p "$OUT"
$A bench machine --out "$OUT"
for n in 1 8 32; do
  mkdir -p "$OUT/throughput-$n"; cp "$OUT/machine.json" "$OUT/throughput-$n/"
  $A bench throughput --num-prompts $n --input-len 100 --output-len 128 --baseline hf --out "$OUT/throughput-$n" $M
done
mkdir -p "$OUT/serve-c1" "$OUT/serve-c8-32"
$A bench serve --max-concurrency 1 --num-prompts 4 --input-len 100 --output-len 128 --out "$OUT/serve-c1" $M
$A bench serve --max-concurrency 8,32 --num-prompts 32 --input-len 100 --output-len 128 --out "$OUT/serve-c8-32" $M
cp "$OUT/machine.json" "$OUT/serve-c1/" 2>/dev/null || true
$A bench latency --out "$OUT" $M
$A bench prefix --out "$OUT" $M
$A bench scheduler --out "$OUT"
