#!/bin/bash
# call 1: the GRPO pinned probe, the memory tests + GRPO tests on the GPU, the 1B bf16 batch-1 decode A/B
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
rm -rf ~/.cache/notebookkit/bench /tmp/pytest-of-*
mkdir -p $OUT/ab
echo "=== probe"; timeout 150 python3 scratch/grpo_pinned_probe.py > $OUT/probe.log 2>&1; echo "probe rc $?"
grep -E "^(STEP|ALLOC|total)|^       " $OUT/probe.log | head -80; tail -5 $OUT/probe.log
echo "=== pytest memory + grpo"
timeout 200 python3 -m pytest -m gpu -q -n 8 -p no:cacheprovider -p scripts.pytest_failure_log -rfEs \
  tests/memory tests/train/test_grpo.py > $OUT/pytest-mem.log 2>&1; echo "pytest rc $?"
tail -15 $OUT/pytest-mem.log
echo "=== decode A/B"
for tag in all no-rank s43; do
  case $tag in all) d="";; no-rank) d="add_rms_norm_low_rank,gated_low_rank";; s43) d="add_rms_norm_low_rank,gated_low_rank,dense_matvec";; esac
  NOTEBOOKKIT_DISABLE_KERNELS=$d timeout 150 python3 benchmarks/generate.py --only 1b-bf16 --systems notebookkit \
    --batches 1 --tag $tag --out $OUT/ab > $OUT/ab/$tag.log 2>&1; echo "$tag rc $?"
  grep -E "^\|" $OUT/ab/$tag.log | head -8
done
