#!/bin/bash
# the planted GRPO bug (a re-applied plan gives its pinned buffers back), then both halves of the GPU suite
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
rm -rf ~/.cache/notebookkit/bench /tmp/pytest-of-*
mkdir -p $OUT
for half in 1 2; do
  start=$(date +%s)
  timeout 215 make test-gpu-$half GPU_PY=python3 > $OUT/half$half.log 2>&1; echo "half $half rc $? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|error" $OUT/half$half.log | tail -2
  grep -E "^(FAILED|ERROR)" $OUT/half$half.log | head -20
  cp runs/gpu-failures-$half.log $OUT/ 2>/dev/null
  du -sh /tmp/pytest-of-* ~/.cache/notebookkit/bench 2>/dev/null; df -h . | tail -1
  rm -rf /tmp/pytest-of-* ~/.cache/notebookkit/bench
done
echo "=== planted"
rm -rf /tmp/plant && cp -r $PWD /tmp/plant && cd /tmp/plant && python3 - <<'PY'
p = "notebookkit/models/patching/checkpointing.py"
s = open(p).read(); a = "    if not same_plan:\n        release_host_buffers(base)"; assert s.count(a) == 1
open(p, "w").write(s.replace(a, "    if True:  # PLANTED\n        release_host_buffers(base)"))
PY
PYTHONPATH=/tmp/plant/.site:/tmp/plant timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "tests/train/test_grpo.py::test_an_offloaded_plan_keeps_its_pinned_buffers_across_steps" 2>&1 | grep -E "^E  |passed|failed" | head -6
cd - >/dev/null; rm -rf /tmp/plant
