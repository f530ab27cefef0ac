#!/usr/bin/env bash
# Session 50, call 3 (carry .site-unsloth): #35's batch-8 row beside Unsloth with the split along K (bade340).
# Call 2's Unsloth rows timed out at 160 s on a fresh machine (its first import compiles); 300 s here, Unsloth first.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/decode"
export PYTHONPATH=$PWD/.site-unsloth:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
start=$SECONDS
python3 benchmarks/train_step.py --system notebookkit --shape llama-3.1-8b --prepare 2>&1 | tail -n 1
echo "== ckpt $((SECONDS - start)) s"
timeout 500 python3 benchmarks/generate.py --only 8b-nf4 --systems unsloth,notebookkit --batches 8 --repeats 3 \
  --timeout 300 --out "$OUT/decode" --tag s50-peer-b8 > "$OUT/decode/peer-b8.log" 2>&1
tail -n 22 "$OUT/decode/peer-b8.log"; echo "== peer $((SECONDS - start)) s"
rm -rf ~/.cache/notebookkit/bench
