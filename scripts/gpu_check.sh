#!/usr/bin/env bash
# The GPU check, on the machine a GPU is lent on (no network there):
#   scripts/gpu_check.sh [--bundle DIR]        the GPU run (about 5 minutes on one H200)
#   scripts/gpu_check.sh --cpu-rehearsal       the same steps on a machine without a GPU
# Steps: install the bundle (scripts/gpu_bundle.sh DIR, made beforehand with the network) into a
# fresh folder and check that it and the machine's packages hold every requirement; the cases of
# scripts/gpu_check.py (kernels against their references, end to end; absent ones with the reason);
# the GPU tests under pytest (on the rehearsal: what of them runs without one). Results in $OUT
# (default gpu-results): install.log, gpu_check.json (rewritten after every case), pytest.log,
# summary.txt. The exit status is 1 if any step failed: the install, a case, a test.
# Environment: CHECK_TIMEOUT_S, PYTEST_TIMEOUT_S (time limits), GPU_CHECK_SECTIONS (gpu_check.py's
# sections), GPU_CHECK_TESTS (the pytest arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
REHEARSAL=0
BUNDLE=.gpu-bundle
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-rehearsal) REHEARSAL=1 ;;
    --bundle) BUNDLE=$2; shift ;;
    *) echo "usage: $0 [--cpu-rehearsal] [--bundle DIR]" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
failed=()

# 1. the bundle, installed with no network into a fresh folder, and checked complete
{
  if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $BUNDLE: make them with scripts/gpu_bundle.sh $BUNDLE (where the network is)"
    false
  elif [ $REHEARSAL = 1 ]; then  # the bundle is for the GPU machine's Python: unpack it as that Python would
    "$PY" -c "import sys; sys.path.insert(0, 'scripts'); import gpu_bundle as b; b.install_bundle('$BUNDLE', '$SITE', b.PYTHON)" \
      && "$PY" scripts/gpu_bundle.py verify "$SITE" --image scripts/gpu_image.txt --python-version 3.12
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$BUNDLE"/*.whl \
      && PYTHONPATH="$SITE" "$PY" scripts/gpu_bundle.py verify "$SITE"
  fi
} > "$OUT/install.log" 2>&1 || failed+=("install (see install.log)")
cat "$OUT/install.log"
# the rehearsal runs in this machine's own environment: the bundle's compiled wheels are for another Python
[ $REHEARSAL = 0 ] && export PYTHONPATH="$SITE:."
export PYTHONPATH=${PYTHONPATH:-.}

# 2. the cases
if [ $REHEARSAL = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
  ARGS=()
else
  ARGS=(--cpu-rehearsal)
fi
PYTHONUNBUFFERED=1 timeout "${CHECK_TIMEOUT_S:-420}" "$PY" scripts/gpu_check.py "${ARGS[@]}"
rc=$?
[ $rc = 0 ] || failed+=("gpu_check.py (exit $rc$([ $rc = 124 ] && echo ': timed out'))")

# 3. the GPU tests (skipped with the reason where there is no GPU; the rest of those files runs)
read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests/unit/test_backend_metadata.py tests/unit/test_collectives_device.py tests/unit/test_chunked_attention.py}"
timeout "${PYTEST_TIMEOUT_S:-120}" "$PY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" > "$OUT/pytest.log" 2>&1
rc=$?
tail -n 15 "$OUT/pytest.log"
[ $rc = 0 ] || failed+=("pytest (exit $rc$([ $rc = 124 ] && echo ': timed out'))")

if [ ${#failed[@]} = 0 ]; then
  echo "gpu_check: every step passed" | tee "$OUT/summary.txt"
  exit 0
fi
printf 'gpu_check: failed: %s\n' "${failed[@]}" | tee "$OUT/summary.txt"
exit 1
