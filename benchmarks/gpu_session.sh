#!/usr/bin/env bash
# What the lead runs on the GPU machine (device tool), in one call:
#   bash benchmarks/gpu_session.sh tests|kernels|train|tune|profile|host|maxctx|moe [extra args]
# Installs carried wheels (.whl/, .whl2/, .whl3/) into /tmp/site once per machine, then runs the step,
# writing logs and results under $OUT (or ./gpu-out when OUT is unset). TAG names the log of a step
# that runs more than once in a call (train, profile).
# A/B of two commits in one call (session 7): locally `mkdir -p .ab/old && git archive <rev> | tar -x -C .ab/old`,
# carry `.ab`, run this script from the tree's root first (it installs the wheels), then
# `(cd .ab/old && OUT=$OUT/old TAG=old1 bash benchmarks/gpu_session.sh train ...)`, interleaving the rows.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for d in .whl .whl2 .whl3; do
  if [ -d "$d" ] && [ ! -f "/tmp/site/.$d-done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl \
      && touch "/tmp/site/.$d-done"
  fi
done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
step=${1:-tests}; shift || true
case "$step" in
  tests)   python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 300 "$@" 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40 ;;
  kernels) python3 benchmarks/kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/kernels.log" | tail -60 ;;
  train)   python3 benchmarks/run.py --out "$OUT" ${TAG:+--tag "$TAG"} "$@" 2>&1 | tee "$OUT/train${TAG:+-$TAG}.log" | tail -40 ;;
  tune)    python3 benchmarks/tune_rms_norm.py --out "$OUT" "$@" 2>&1 | tee "$OUT/tune.log" | grep -E "BEST|copy" ;;
  profile) python3 benchmarks/profile_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/profile${TAG:+-$TAG}.log" | tail -40 ;;
  host)    python3 benchmarks/host_profile.py --out "$OUT" "$@" 2>&1 | tee "$OUT/host${TAG:+-$TAG}.log" | tail -20 ;;
  maxctx)  python3 benchmarks/max_context.py --out "$OUT" "$@" 2>&1 | tee "$OUT/maxctx.log" | tail -20 ;;
  # the MoE step tables (benchmarks/moe_session.sh runs them alone); Unsloth's site, when carried, goes first
  moe)     PYTHONPATH=${PWD}/.site-unsloth:$PYTHONPATH python3 benchmarks/moe_step.py --out "$OUT" "$@" 2>&1 \
             | tee "$OUT/moe${TAG:+-$TAG}.log" | grep -v '^{' | tail -80 ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
