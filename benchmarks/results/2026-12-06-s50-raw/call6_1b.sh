#!/usr/bin/env bash
# Session 50, call 6 (carry .site-unsloth), the device time left after the suite: #35's 1B bf16 batch-1 row, then
# Unsloth's in the same call if its first import fits.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/decode"
export PYTHONPATH=$PWD/.site-unsloth:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$SECONDS
python3 benchmarks/train_step.py --system notebookkit --shape llama-3.2-1b --prepare 2>&1 | tail -n 1
echo "== ckpt $((SECONDS - start)) s"
timeout 230 python3 benchmarks/generate.py --only 1b-bf16 --systems notebookkit,unsloth --batches 1 --repeats 3 \
  --timeout 150 --out "$OUT/decode" --tag s50-1b > "$OUT/decode/1b.log" 2>&1
grep -E "^\| 1b|^- |^Device" "$OUT/decode/1b.log" | head -n 20; echo "== rows $((SECONDS - start)) s"
