#!/usr/bin/env bash
# Every GPU test and benchmark in one run (about 5 minutes on one H200).
# Results land in $OUT: gpu_check.json, pytest-gpu.log.
#
# The GPU machine has torch and triton but not the config stack; carry it as
# wheels (pure Python) made here once:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#     hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 gguf msgspec litestar
# (antlr4-python3-runtime has no wheel for every version: build one with `pip wheel` if needed.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH=${PYTHONPATH:-.}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
timeout "${CHECK_TIMEOUT_S:-420}" python3 scripts/gpu_check.py; rc=$?
timeout "${PYTEST_TIMEOUT_S:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_backend_metadata.py tests/unit/test_collectives_device.py 2>&1 | tee "$OUT/pytest-gpu.log"
exit $rc
