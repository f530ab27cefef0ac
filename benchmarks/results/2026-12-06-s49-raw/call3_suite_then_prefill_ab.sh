#!/usr/bin/env bash
# Session 49, the calls after the library changes (carry .site and .ab; .ab/old = this tree's benchmarks with
# ebe5eab's notebookkit: mkdir -p .ab/old && git archive HEAD benchmarks | tar -x -C .ab/old &&
# git archive ebe5eab notebookkit | tar -x -C .ab/old && rm -rf .ab/old/benchmarks/results).
#   PART=1 / PART=2: the whole GPU suite's halves;  PART=ab: the 8B NF4 decode rows, ebe5eab's library against
#   this one's, alternating (the prefill's host time: the kept LoRA views, the one-walk signature, the foreach casts)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
case "${PART:?PART=1, 2 or ab}" in
  1|2) PYTHONPATH=$PWD/.site:$PWD timeout 570 make test-gpu-$PART GPU_PY=python3 > "$OUT/suite-$PART.log" 2>&1
       echo "rc $?"; tail -n 40 "$OUT/suite-$PART.log"
       python3 scripts/pytest_failure_log.py runs/gpu-progress-$PART.log 2>&1 | tail -n 5
       cp runs/gpu-failures-$PART.log "$OUT/" 2>/dev/null ;;
  ab)  OUT=$OUT bash benchmarks/decode_session.sh ckpt ${AB_STEPS:-old1 new1 old2 new2}
       rm -rf ~/.cache/notebookkit/bench ;;
esac
