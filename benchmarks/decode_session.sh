#!/usr/bin/env bash
# Issue #35's decode measurements in one device call, from the repository root of the GPU machine:
#   bash benchmarks/decode_session.sh STEP [STEP ...]      (carry .site, or SITE=.site-unsloth; .ab for the A/B steps)
# Steps:
#   ckpt        the random-weight Llama-3.1-8B checkpoint (train_step.py --prepare; once per machine)
#   new[N]      generate.py's 8b-nf4 rows of notebookkit from this tree (batch 1 and 8, profile, bound), tag newN
#   old[N]      the same from the tree in .ab/old (locally: mkdir -p .ab/old && git archive REV | tar -x -C .ab/old)
#   t4[N]       the fp16 rows under a 15 GiB cap (T4 emulation) from this tree
#   rit[N]      new[N]'s rows with NOTEBOOKKIT_NF4_ROWS_IN_THREAD=1 (the matvec's rows-in-thread body where a
#               program gets 4 rows); alternate with new[N] for an A/B in one call
#   sweep       nf4_matvec's launch configurations at the 8B shapes (generate.py --kernels --sweep), bf16, for at
#               most SWEEP_S seconds (400): each row is printed as it is measured (ROW lines of sweep.log)
#   sweep8      the same for the tl.dot kernel alone (M = 8, --kernel-batches 8): the batch-8 step's matvec
#   tests       the GPU tests of the decode path (matvec, graph replay, greedy agreement) and of the NF4 experts
# Old and new rows alternate in one call so that both see the same machine. Logs and tables go to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/${SITE:-.site}:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader | tee -a "$OUT/gpu.txt"
rows() {  # rows TREE TAG CONFIG
  (cd "$1" && timeout 300 python3 benchmarks/generate.py --only "$3" --systems notebookkit --repeats 3 \
     --timeout 280 --out "$OUT" --tag "$2") 2>&1 | tail -n 25 > "$OUT/$2.log"
  tail -n 12 "$OUT/$2.log"
}
for step in "$@"; do
  start=$SECONDS
  case "$step" in
    ckpt)  python3 benchmarks/train_step.py --system notebookkit --shape llama-3.1-8b --prepare 2>&1 | tail -n 2 ;;
    new*)  rows "$PWD" "$step" 8b-nf4 ;;
    old*)  rows "$PWD/.ab/old" "$step" 8b-nf4 ;;
    t4*)   rows "$PWD" "$step" 8b-nf4-fp16-15gib ;;
    rit*)  NOTEBOOKKIT_NF4_ROWS_IN_THREAD=1 rows "$PWD" "$step" 8b-nf4 ;;
    sweep) timeout "${SWEEP_S:-400}" python3 benchmarks/generate.py --kernels --sweep --out "$OUT" --tag sweep \
             > "$OUT/sweep.log" 2>&1; grep -c "^ROW" "$OUT/sweep.log"; grep -E "^\| " "$OUT/sweep.log" | head -n 60 ;;
    sweep8) timeout "${SWEEP_S:-400}" python3 benchmarks/generate.py --kernels --sweep --kernel-batches 8 --out "$OUT" \
             --tag sweep8 > "$OUT/sweep8.log" 2>&1
            grep -c "^ROW" "$OUT/sweep8.log"; grep -E "^\| " "$OUT/sweep8.log" | head -n 60 ;;
    tests) timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/kernels/test_nf4_matvec.py \
             tests/models/generation/test_generation_gpu.py tests/kernels/test_moe_experts_nf4.py \
             tests/models/test_moe_gpu.py 2>&1 | tail -n 15 | tee "$OUT/tests.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  echo "== $step: $((SECONDS - start)) s"
done
