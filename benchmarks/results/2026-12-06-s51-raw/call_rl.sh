#!/usr/bin/env bash
# Session 51 (carry .site-unsloth): #35's GRPO and DPO tables, notebookkit-lean beside Unsloth, two rounds a call.
# TAG names the call (rl-1, rl-2). Unsloth's first import on a fresh machine compiles (~100-160 s): its rows get 300 s.
set -uo pipefail
OUT=${OUT:-gpu-out}; TAG=${TAG:-rl}; mkdir -p "$OUT/$TAG"
export PYTHONPATH=$PWD/.site-unsloth:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
git log --oneline -1 2>/dev/null || true
start=$SECONDS
timeout 575 python3 benchmarks/rl_step.py --tasks grpo,dpo --systems notebookkit-lean,unsloth --repeats 2 \
  --budget-s 560 --timeout 300 --unsloth-site $PWD/.site-unsloth --out "$OUT/$TAG" --tag "s51-$TAG" \
  > "$OUT/$TAG/rl.log" 2>&1
echo "== rc $? after $((SECONDS - start)) s"
tail -n 40 "$OUT/$TAG/rl.log"
rm -rf ~/.cache/notebookkit/bench
