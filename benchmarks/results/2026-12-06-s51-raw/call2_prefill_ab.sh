#!/usr/bin/env bash
# Session 51, call 2 (carry .site and .ab; .ab/old = this tree's benchmarks with f643e03's notebookkit:
# mkdir -p .ab/old && git archive HEAD benchmarks | tar -x -C .ab/old && git archive f643e03 notebookkit |
# tar -x -C .ab/old && rm -rf .ab/old/benchmarks/results).
# The captured prefill (e48147a): the decode path's GPU tests first, then 8B NF4 decode, f643e03 against e48147a.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
start=$SECONDS
timeout 200 python3 -m pytest -q -m gpu -n 6 tests/models/generation -p no:cacheprovider > "$OUT/gen-tests.log" 2>&1
echo "== tests rc $? after $((SECONDS - start)) s"; tail -n 25 "$OUT/gen-tests.log"
OUT=$OUT timeout $((560 - SECONDS)) bash benchmarks/decode_session.sh ckpt ${AB_STEPS:-old1 new1 new2 old2}
echo "== ab after $((SECONDS - start)) s"
rm -rf ~/.cache/notebookkit/bench
