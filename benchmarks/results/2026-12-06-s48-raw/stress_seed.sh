# Session 48 call 3, part 1: the seeded-sampling test under load, three variants side by side.
S=benchmarks/results/2026-12-06-s48-raw/stress_seed.py
python3 $S load 75 & python3 $S load 75 &
for i in 1 2 3; do
  python3 $S 12 default 2>/dev/null &
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 $S 12 cublas-ws 2>/dev/null &
  NOTEBOOKKIT_CUDA_GRAPHS=0 python3 $S 12 eager 2>/dev/null &
done
wait
