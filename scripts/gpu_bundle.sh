#!/usr/bin/env bash
# Fill DIR (default .gpu-bundle) with every wheel the lent GPU machine needs beyond its
# image (CPython 3.12, manylinux x86_64; at most 64 MiB), with the network, here:
#   scripts/gpu_bundle.sh [DIR]
# then carry DIR to the GPU machine and run scripts/gpu_check.sh there (it installs from DIR
# with no network). scripts/gpu_image.txt lists what the image already holds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PYTHON" scripts/gpu_bundle.py build "${1:-.gpu-bundle}"
