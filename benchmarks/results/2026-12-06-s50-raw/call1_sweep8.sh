#!/usr/bin/env bash
# Session 50, call 1 (carry .site): the tl.dot NF4 matvec's batch-8 sweep with the split-K configurations
# (d56b6c1), then the matvec's GPU tests (the split-K case among them).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
SWEEP_S=${SWEEP_S:-300} OUT=$OUT bash benchmarks/decode_session.sh sweep8
PYTHONPATH=$PWD/.site:$PWD timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 \
  tests/kernels/test_nf4_matvec.py 2>&1 | tail -n 8 | tee "$OUT/matvec-tests.log"
