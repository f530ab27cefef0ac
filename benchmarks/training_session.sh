#!/usr/bin/env bash
# Issue #34's training tables, each part in one device call with the peer in the same call.
#
#   locally, once:  bash ../shared/tools/gpu_site.sh .site-unsloth --unsloth     (bitsandbytes, Unsloth, trl 1.15)
#   device call:    OUT=$OUT bash benchmarks/training_session.sh train t4          carry: [".site-unsloth"]
#                   OUT=$OUT bash benchmarks/training_session.sh vision-qwen      (a call of its own: ~6 minutes)
#                   OUT=$OUT bash benchmarks/training_session.sh vision-gemma
#
# Parts:
#   train         8B NF4 4096 x 2, exact math: offload, offload with the planner's share of the layers' gate/up
#                 parked, offload_mlp (every layer's parked), Unsloth (~3 min)
#   t4            the same model under a T4 emulated (fp16 + GradScaler, 15 GiB cap): "auto" (the planner's share of
#                 its offloaded layers parked), "auto" planned with layout="spread" (the offloaded layers among the
#                 kept ones, all of them parked), offload_mlp with the input embedding in host memory (the row
#                 under Unsloth's peak), Unsloth (~4 min); T4_SYSTEMS=a,b,... runs other rows, T4_STEPS=N times N
#                 steps. Session 36 found the slow steps (~0.35-0.42 s against ~0.30) with no host wait at any
#                 pacing point and no garbage collection to speak of: the host issued them slower, or waited where
#                 those do not look (the allocator freeing its cache under the cap). The next question:
#                 T4_STEPS=10 T4_SYSTEMS=notebookkit-spread,notebookkit-spread-14GiB,notebookkit-spread+expandable,unsloth
#                 (each step's end read and allocator counters are in the table: benchmarks/host_waits.py; a
#                 num_alloc_retries in the slow steps only says the allocator; -14GiB plans with a GiB of headroom;
#                 each step's CPU time, involuntary context switches and the machine's steal time too: a shared
#                 machine's slow window). T4_REPEATS=N runs the rows in N rounds, a process each (run.py --repeats)
#   t4-profile    two profiled steps of the T4 row: "auto", "auto" with layout="spread", and Unsloth
#                 (benchmarks/profile_step.py: where each spends its GPU time; the front plan runs 11% under its
#                 matmul ceiling, benchmarks/step_flops.py; the host link's rate a copy, per direction, tells a
#                 link that slows now and then); T4_PROFILE_STEPS=N profiles N steps
#   t4-host       the "auto" T4 row's synchronising calls and host time (benchmarks/host_profile.py)
#   vision-qwen   Qwen2.5-VL-7B NF4, 4 images of 448^2: notebookkit-lean planned under a 9 GiB cap (the fastest plan
#                 at about Unsloth's 7.76 GiB peak), Unsloth, notebookkit-lean (checkpoint built first, untimed)
#   vision-gemma  Gemma-3-4B NF4, 4 images of 896^2: the same
#                 VISION_SYSTEMS=a,b,... runs other rows; VISION_REPEATS=N runs them in N rounds, a process each (the
#                 host-bound lean step swung 0.72-1.09 s between calls): the table shows each one's median process
#                 and the round-by-round ratio to Unsloth (benchmarks/process_rounds.py)
# A part that would start after BUDGET_S seconds (default 540, under the device tool's 10 minutes a command) is
# skipped with a line saying so. Results: $OUT/<part>/ (the scripts' JSON and markdown, one log a part); copy
# them to benchmarks/results/. Remove the checkpoints with `rm -rf ~/.cache/notebookkit/bench` before the GPU suite.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/.site-unsloth:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -d .site-unsloth ] || echo "no .site-unsloth here: the Unsloth rows will read 'not installed'"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
START=$(date +%s)
left() { echo $(( ${BUDGET_S:-540} - ($(date +%s) - START) )); }
for part in "$@"; do
  if [ "$(left)" -le 60 ]; then echo "$part: skipped (budget spent)"; continue; fi
  mkdir -p "$OUT/$part"
  case "$part" in
    train)
      python3 benchmarks/train_step.py --system notebookkit --shape llama-3.1-8b --prepare >/dev/null
      timeout "$(left)" python3 benchmarks/run.py --out "$OUT/$part" --only 8b-nf4-4096x2 --steps 5 --timeout 150 \
        --systems notebookkit-offload,notebookkit-offload-mlp-card,notebookkit-offload-mlp,unsloth ;;
    t4)
      python3 benchmarks/train_step.py --system notebookkit --shape llama-3.1-8b --prepare >/dev/null
      timeout "$(left)" python3 benchmarks/run.py --out "$OUT/$part" --only 8b-nf4-4096x1-t4 --steps "${T4_STEPS:-5}" --timeout 150 \
        --systems "${T4_SYSTEMS:-notebookkit,notebookkit-spread,notebookkit-lean-mlp,unsloth}" --repeats "${T4_REPEATS:-1}" ;;
    t4-profile)
      for extra in "--system notebookkit" "--system notebookkit --spread" "--system unsloth"; do
        timeout "$(left)" python3 benchmarks/profile_step.py $extra --shape llama-3.1-8b --seq 4096 --batch 1 \
          --dtype float16 --memory-cap-gib 15 --steps "${T4_PROFILE_STEPS:-2}" --out "$OUT/$part"
      done ;;
    t4-host)
      timeout "$(left)" python3 benchmarks/host_profile.py --shape llama-3.1-8b --quant nf4 --seq 4096 --batch 1 \
        --checkpointing auto --dtype float16 --memory-cap-gib 15 --out "$OUT/$part" ;;
    vision-qwen|vision-gemma)
      shape=$([ "$part" = vision-qwen ] && echo qwen2.5-vl-7b || echo gemma-3-4b)
      python3 benchmarks/vision_step.py --shape "$shape" --prepare >/dev/null
      timeout "$(left)" python3 benchmarks/vision_step.py --shape "$shape" --steps 5 --timeout 240 --out "$OUT/$part" \
        --systems "${VISION_SYSTEMS:-notebookkit-lean-9GiB,unsloth,notebookkit-lean}" --repeats "${VISION_REPEATS:-1}" ;;
    *) echo "unknown part $part (train, t4, t4-profile, t4-host, vision-qwen, vision-gemma)"; continue ;;
  esac > "$OUT/$part/$part.log" 2>&1
  echo "$part: exit $? after $(( $(date +%s) - START )) s"; tail -12 "$OUT/$part/$part.log"
done
