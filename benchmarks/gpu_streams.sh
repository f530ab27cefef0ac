#!/usr/bin/env bash
# Run one stream of commands per GPU at the same time, on the device machine (one device call):
#   bash benchmarks/gpu_streams.sh <seconds per stream> '<commands for GPU 0>' ['<commands for GPU 1>' ...]
# Each stream runs in its own copy of the tree (Unsloth writes its compile cache into the working
# folder) with CUDA_VISIBLE_DEVICES set to its GPU and OUT=/tmp/w<N>; its files come back as
# $OUT/g<N>.tgz, and each stream's last lines are printed at the end. The wheels are installed once,
# before the streams start. Streams share the host's CPUs, memory and PCIe: use parallel streams for
# tests and searches, and compare timed rows only within one stream of a machine that runs nothing else
# (session 6 saw a row lose 14% while the other GPU's stream compiled with inductor).
# CALL_LIMIT (seconds, default 590): the device call's own limit. Installing the wheels on a fresh machine
# takes about a minute, so each stream gets at most CALL_LIMIT - (setup time) - 25 s; the files then still
# come back before the call is cut (session 7 lost a whole call's files to a stream limit set too close).
set -u
STARTED=$SECONDS
LIMIT=$1; shift
REAL=${OUT:-gpu-out}; mkdir -p "$REAL"
bash benchmarks/gpu_session.sh tests --version > "$REAL/setup.log" 2>&1
python3 -c "import torch; print('gpus', torch.cuda.device_count())" >> "$REAL/setup.log" 2>&1
LEFT=$(( ${CALL_LIMIT:-590} - (SECONDS - STARTED) - 25 ))
if [ "$LEFT" -lt "$LIMIT" ]; then
  echo "setup took $((SECONDS - STARTED)) s: streams limited to $LEFT s (asked $LIMIT)" | tee -a "$REAL/setup.log"
  LIMIT=$LEFT
fi
tail -3 "$REAL/setup.log"
i=0
for commands in "$@"; do
  copy=/tmp/r$i; rm -rf "$copy"; mkdir -p "$copy"; cp -r . "$copy"/
  ( cd "$copy" || exit
    export CUDA_VISIBLE_DEVICES=$i OUT=/tmp/w$i PYTHONPATH=/tmp/site:$copy PYTHONUNBUFFERED=1
    mkdir -p "$OUT"; echo "stream $i: $commands" > "$OUT/stream.txt"
    timeout "$LIMIT" bash -c "$commands" > "$OUT/stream.log" 2>&1; echo "rc $?" >> "$OUT/stream.txt"
    (cd "$OUT" && tar czf "$REAL/g$i.tgz" --exclude='*.safetensors' --exclude='lora_adapter' --exclude='*trace*' .) ) &
  i=$((i + 1))
done
wait
for j in $(seq 0 $((i - 1))); do echo "== stream $j"; cat "/tmp/w$j/stream.txt"; grep -h "^| " /tmp/w$j/*.md 2>/dev/null | grep -v "^|---"; tail -5 "/tmp/w$j/stream.log"; done
