#!/usr/bin/env bash
# The full benchmark run behind docs/benchmarks.md: SmolLM2-135M, 100-token
# prompts, 128 output tokens, ignore_eos; the cpu profile (fp32) and the
# cpu_int8 profile (= cpu + quantization=int8_wo + cache.kv_cache_dtype=bfloat16).
# Results: bench-results/full/.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${APPLIANCE:-.venv/bin/appliance}
OUT=${OUT:-bench-results/full}
L="cache.kv_cache_memory_gib=1.0 model.max_model_len=2048"
M="+profile=cpu $L"
mkdir -p "$OUT"
$A bench machine --out "$OUT"
for n in 1 8 32; do
  mkdir -p "$OUT/throughput-$n"; cp "$OUT/machine.json" "$OUT/throughput-$n/"
  $A bench throughput --num-prompts $n --input-len 100 --output-len 128 --baseline hf --repeat 3 \
    --also "quantization=int8_wo cache.kv_cache_dtype=bfloat16" --out "$OUT/throughput-$n" $M
done
for p in cpu cpu_int8; do
  B="+profile=$p $L"
  mkdir -p "$OUT/serve-$p-c1" "$OUT/serve-$p-c8-32" "$OUT/latency-$p"
  $A bench serve --max-concurrency 1 --num-prompts 4 --input-len 100 --output-len 128 --out "$OUT/serve-$p-c1" $B
  $A bench serve --max-concurrency 8,32 --num-prompts 32 --input-len 100 --output-len 128 --out "$OUT/serve-$p-c8-32" $B
  cp "$OUT/machine.json" "$OUT/latency-$p/"
  $A bench latency --out "$OUT/latency-$p" $B
done
$A bench prefix --out "$OUT" $M
$A bench scheduler --out "$OUT"
