#!/usr/bin/env bash
# Fetch, here, the wheels scripts/gpu_check.sh needs on the lent GPU machine that its image lacks (Python 3.12,
# x86-64, no network there): bitsandbytes (NF4 on CUDA: the offload and --count steps) and fla-core (the
# flash-linear-attention GDN kernels; einops is already there). ~45 MB into .whl/ (ignored by git), under the 64 MiB
# a device call carries. Then: run `bash scripts/gpu_check.sh` there with `.whl` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "bitsandbytes>=0.50" "fla-core>=0.6,<0.7"
# Clover Desk itself as a wheel: it installs one import name, clover_desk, with engine and ui inside (a bare
# PYTHONPATH=. finds only clover_desk/), so the GPU machine runs this checkout's code as installed. Rebuild it after
# every change: run this script right before the device call.
rm -f .whl/clover_desk-*.whl
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl . 2>/dev/null || .venv/bin/python -m pip wheel -q \
  --no-deps --no-build-isolation -w .whl .
ls -la .whl
du -sh .whl
