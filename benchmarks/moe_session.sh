#!/usr/bin/env bash
# The mixture-of-experts step tables and the T4-emulation table (benchmarks/moe_step.py) in one device call.
#
#   locally, once:  bash ../shared/tools/gpu_site.sh .site-unsloth --unsloth     (bitsandbytes, Unsloth, trl 1.15)
#   device call:    bash benchmarks/moe_session.sh [extra moe_step.py arguments]       carry: [".site-unsloth"]
#
# Rows run gpt-oss-20b's table, then its T4 emulation, then Qwen3-30B-A3B's; a row that would start after
# BUDGET_S seconds (default 500, under the device tool's 10 minutes a command) is written as skipped, so the
# table always comes back. Split a run that does not fit: e.g. `--shapes qwen3-30b-a3b --no-t4`.
# Qwen3-30B-A3B with the same adapters in every row (Unsloth's: gate_up at r, not PEFT's 2r):
#   `--shapes qwen3-30b-a3b --no-t4 --expert-adapters stacked --tag stacked`
# Its step swings between processes (session 41: 36.8-63.2 ms): `--systems unsloth,notebookkit --repeats 3` runs
# three rounds and reports each system's median process and the round-by-round ratios; `--profile "$OUT/moe"` adds
# one profiled step a row (where the GPU waited on the host).
# Results: $OUT/moe/<date>-<gpu>-moe-step.json, .md and -logs/ (one log per row); copy them to benchmarks/results/.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/moe"
export PYTHONPATH=$PWD/.site-unsloth:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -d .site-unsloth ] || echo "no .site-unsloth here: bitsandbytes and Unsloth rows will fail or read 'not installed'"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/moe/gpu.txt"
df -h "${NOTEBOOKKIT_BENCH_CKPT:-$HOME}" | tail -1 | tee -a "$OUT/moe/gpu.txt"
python3 benchmarks/moe_step.py --out "$OUT/moe" --layers "${LAYERS:-4}" --budget-s "${BUDGET_S:-500}" "$@" 2>&1 \
  | tee "$OUT/moe/moe.log" | grep -v '^{' | tail -80
