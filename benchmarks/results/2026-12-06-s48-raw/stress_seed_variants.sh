# Session 48 call 4: which change to the capture removes the first run's difference under load (3 processes a variant).
S=benchmarks/results/2026-12-06-s48-raw/stress_seed.py
python3 $S load 100 & python3 $S load 100 &
for i in 1 2 3; do
  for v in default greedy sync-capture warm-on-current no-warmup sync-every-step; do
    PROBE_VARIANT=$v python3 $S 8 $v 2>/dev/null &
  done
done
wait
