#!/usr/bin/env bash
# Session 49, call 1 (carry .site-unsloth): the MoE device-bounds A/B, Unsloth in the same rounds.
set -uo pipefail
OUT=${OUT:-gpu-out}
nproc; lscpu | grep -E "Model name|MHz" | head -2
BUDGET_S=470 bash benchmarks/moe_session.sh --shapes qwen3-30b-a3b --no-t4 --expert-adapters stacked \
  --systems unsloth,notebookkit,notebookkit-device-bounds --repeats 3 --tag device-bounds-ab
rm -rf ~/.cache/notebookkit/bench
