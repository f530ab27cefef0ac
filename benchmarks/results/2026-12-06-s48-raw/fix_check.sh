# Session 48 call 5: the capture-stream wait (graph_runner.py) planted out and in, the stress under load, half 1.
export PYTHONPATH=$PWD/.site:$PWD
T=tests/models/generation/test_generation_gpu.py
rm -rf /tmp/planted && mkdir /tmp/planted && cp -r notebookkit tests conftest.py pyproject.toml scripts /tmp/planted/
python3 - <<'PY'
p = "/tmp/planted/notebookkit/models/generation/graph_runner.py"
s = open(p).read()
line = "        torch.cuda.current_stream(device).wait_stream(side)\n        torch.cuda.set_rng_state"
assert line in s
open(p, "w").write(s.replace(line, "        torch.cuda.set_rng_state"))
PY
echo "== planted (no wait after the capture): the new test must fail"
REPO=$PWD
(cd /tmp/planted && export PYTHONPATH=/tmp/planted:$REPO/.site && python3 -c 'import notebookkit; print(notebookkit.__file__)' &&
 python3 -m pytest -q -p no:cacheprovider -m gpu "$T::test_replays_start_after_the_capture_streams_rng_prologue" 2>&1 | tail -3)
echo "== fixed"
python3 -m pytest -q -p no:cacheprovider -m gpu "$T::test_replays_start_after_the_capture_streams_rng_prologue" "$T::test_sampling_inside_the_graph_follows_the_seed" 2>&1 | tail -2
echo "== stress, fixed"
S=benchmarks/results/2026-12-06-s48-raw/stress_seed.py
python3 $S load 50 & python3 $S load 50 &
for i in 1 2 3; do python3 $S 8 default-fixed 2>/dev/null & done
wait
