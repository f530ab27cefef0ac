#!/usr/bin/env bash
# Session 51, the last call (carry .site), with too little device time left for the suite's halves: first every GPU
# test of the code the library changed since the last whole-suite pass (bade340): the decode path
# (tests/models/generation), its attention kernel (tests/kernels/test_decode_attention.py) and generation's memory
# (tests/memory/test_generation_memory.py); then, until LIMIT s into the call, tests/train's GPU cases (GRPO and DPO
# generate and train) and the T4-emulation notebook cases but the vision one (197 s alone).
set -uo pipefail
OUT=${OUT:-gpu-out}; LIMIT=${LIMIT:-300}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
start=$SECONDS
export PYTHONPATH=$PWD/.site:$PWD
timeout $((LIMIT - 10 - SECONDS)) python3 -m pytest -m gpu -n 8 -p no:cacheprovider -q -rfEs --durations=10 \
  tests/kernels/test_decode_attention.py tests/models/generation tests/memory/test_generation_memory.py \
  > "$OUT/generation-gpu.log" 2>&1
echo "== generation GPU tests rc $? after $((SECONDS - start)) s"; tail -n 25 "$OUT/generation-gpu.log"
timeout $((LIMIT - SECONDS)) python3 -m pytest -m gpu -n 6 -p no:cacheprovider -q -rfEs --durations=10 \
  tests/train tests/notebooks/test_notebooks_gpu.py -k "t4_emulation_fp16 and (grpo or dpo) or chat_sft_t4 or test_gpu or cuda" \
  > "$OUT/train-t4-gpu.log" 2>&1
echo "== train and T4 cases rc $? after $((SECONDS - start)) s"; tail -n 20 "$OUT/train-t4-gpu.log"
rm -rf ~/.cache/notebookkit/bench
