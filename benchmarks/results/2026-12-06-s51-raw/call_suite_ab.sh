#!/usr/bin/env bash
# Session 51, the calls on the final library (carry .site and .ab; .ab/old = this tree's benchmarks with f643e03's
# notebookkit: mkdir -p .ab/old && git archive HEAD benchmarks | tar -x -C .ab/old && git archive f643e03 notebookkit |
# tar -x -C .ab/old && rm -rf .ab/old/benchmarks/results).
#   PART=1 / PART=2 / PART="1 2": the GPU suite's halves (half 2 has the T4-emulation notebook cases); then, with AB_STEPS set,
#   8B NF4 decode rows (decode_session.sh: old = f643e03's library, new = this tree's) until LIMIT s into the call
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
start=$SECONDS
for part in ${PART:?PART=1, 2 or "1 2"}; do
  PYTHONPATH=$PWD/.site:$PWD timeout 330 make test-gpu-$part GPU_PY=python3 > "$OUT/suite-$part.log" 2>&1
  echo "== suite $part rc $? after $((SECONDS - start)) s"; tail -n 12 "$OUT/suite-$part.log"
  python3 scripts/pytest_failure_log.py runs/gpu-progress-$part.log 2>&1 | tail -n 5
  cp runs/gpu-failures-$part.log "$OUT/" 2>/dev/null
done
if [ -n "${AB_STEPS:-}" ]; then
  OUT=$OUT timeout $((${LIMIT:-585} - SECONDS)) bash benchmarks/decode_session.sh ckpt $AB_STEPS
  echo "== ab after $((SECONDS - start)) s"
fi
rm -rf ~/.cache/notebookkit/bench
