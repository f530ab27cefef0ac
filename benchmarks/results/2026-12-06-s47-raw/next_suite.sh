#!/bin/bash
# call 2: the pinned-allocation probes, then both halves of the GPU suite in one call (each ~165 s on an H100)
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
rm -rf ~/.cache/notebookkit/bench /tmp/pytest-of-*
mkdir -p $OUT
timeout 40 python3 scratch/host_alloc_micro.py 2>&1 | tail -12
for k in keep free; do timeout 60 python3 scratch/grpo_pinned_probe.py $k > $OUT/probe-$k.log 2>&1; echo "probe $k rc $?"
  grep -E "^STEP" $OUT/probe-$k.log; grep -E "^ALLOC" $OUT/probe-$k.log | sort | uniq -c | head -12; done
for half in 1 2; do
  start=$(date +%s)
  timeout 240 make test-gpu-$half GPU_PY=python3 > $OUT/half$half.log 2>&1; echo "half $half rc $? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|error" $OUT/half$half.log | tail -3
  grep -E "^(FAILED|ERROR)" $OUT/half$half.log | head -20
  cp runs/gpu-failures-$half.log $OUT/ 2>/dev/null
done
echo "=== decode A/B, second call"
mkdir -p $OUT/ab
for tag in all no-rank; do
  case $tag in all) d="";; no-rank) d="add_rms_norm_low_rank,gated_low_rank";; esac
  NOTEBOOKKIT_DISABLE_KERNELS=$d timeout 60 python3 benchmarks/generate.py --only 1b-bf16 --systems notebookkit \
    --batches 1 --tag $tag-2 --out $OUT/ab > $OUT/ab/$tag.log 2>&1; echo "$tag rc $?"
  grep -E "^\| 1b-bf16 \| notebookkit" $OUT/ab/$tag.log | head -2
done
