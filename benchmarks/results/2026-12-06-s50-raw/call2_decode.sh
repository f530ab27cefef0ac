#!/usr/bin/env bash
# Session 50, call 2 (carry .site-unsloth): #35's 8B NF4 decode rows with the peer in the same call, then the
# fp16 rows under a 15 GiB cap (T4 emulation).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/decode"
export PYTHONPATH=$PWD/.site-unsloth:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
start=$SECONDS
python3 benchmarks/train_step.py --system notebookkit --shape llama-3.1-8b --prepare 2>&1 | tail -n 2
echo "== ckpt $((SECONDS - start)) s"
timeout 330 python3 benchmarks/generate.py --only 8b-nf4 --systems notebookkit,unsloth --batches 1,8 --repeats 3 \
  --timeout 160 --out "$OUT/decode" --tag s50-peer > "$OUT/decode/peer.log" 2>&1
tail -n 30 "$OUT/decode/peer.log"; echo "== peer $((SECONDS - start)) s"
timeout $((560 - SECONDS)) python3 benchmarks/generate.py --only 8b-nf4-fp16-15gib --systems notebookkit --batches 1,8 \
  --repeats 3 --timeout 150 --out "$OUT/decode" --tag s50-t4 > "$OUT/decode/t4.log" 2>&1
tail -n 14 "$OUT/decode/t4.log"; echo "== t4 $((SECONDS - start)) s"
