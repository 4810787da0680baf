#!/usr/bin/env bash
# The end-to-end GPU check of docs/gpu.md, run from the project root on a CUDA machine with specdec's
# dependencies importable (PYTHONPATH): a random SmolLM2-135M-shaped base and its x8 growth; ready times,
# the target alone, speculation in each mode, HF's static-cache generate. Results on stdout (and $OUT/results.txt).
set -u
R=${OUT:-/tmp}/results.txt; exec > >(tee -a $R) 2>&1
S=$PWD/scripts/gpu
export PYTHONUNBUFFERED=1 SPECDEC_CACHE=${SPECDEC_CACHE:-/root/cache}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B=/root/smolrand X=/root/smolrand-x8
timeout 60 python3 $S/models.py $B $X || exit 1
gen() { timeout 60 python3 -m cli generate "Explain how a refrigerator keeps food cold." --address $1 --max-tokens 128 --json "${@:2}" 2>/dev/null | python3 -c "
import json,sys; t=sys.stdin.read(); d=json.loads(t[t.index('{'):]); s=d['stats']
print('   ', '${*:2}' or 'default', 'tokens', len(d['token_ids']), 'tok/s %.1f' % s['tokens_per_second'], 'accept %.3f' % s.get('acceptance_rate', 0), 'tok/round %.2f' % s.get('mean_accepted_length', 0))"; }
serve() {  # target, draft, extra flags
  rm -f /tmp/r.json; t0=$(date +%s.%N)
  python3 -m cli serve --target-model $1 --draft-model $2 --target-device cuda --draft-device cuda --drafter model --draft-dtype bfloat16 --port 0 --ready-file /tmp/r.json > /tmp/serve.log 2>&1 &
  SP=$!
  for i in $(seq 1 300); do [ -f /tmp/r.json ] && break; kill -0 $SP 2>/dev/null || break; sleep 0.5; done
  echo "serve target=$1: ready after $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
  A=$(python3 -c "import json;print(json.load(open('/tmp/r.json'))['address'])" 2>/dev/null)
}
echo "== grown x8 target (fp32), base draft (bf16)"
serve $X $B
gen $A --no-speculation; gen $A --no-speculation; gen $A --lookahead 4; gen $A --lookahead 8; gen $A --lookahead 8 --tree 8; gen $A --adaptive --lookahead 8; gen $A --lookahead 4 --no-overlap
grep -h "captured\|Traceback\|Error" /tmp/specdec-*/*.log 2>/dev/null | head -8
kill $SP; wait $SP 2>/dev/null; rm -rf /tmp/specdec-*
echo "== base target (fp32), base draft (bf16)"
serve $B $B
gen $A --no-speculation; gen $A --no-speculation; gen $A --lookahead 4 --temperature 0.7 --seed 1; gen $A --lookahead 4 --rule invariant --temperature 0.7 --seed 1
python3 -c "
import json,grpc; from specdec.v1 import model_pb2 as m, model_pb2_grpc as g
r=json.load(open('/tmp/r.json'))['services']
for role,St in (('draft',g.DraftServiceStub),('target',g.TargetServiceStub)):
    i=St(grpc.insecure_channel(r[role])).Describe(m.DescribeRequest()); print('   ', role,'builds_after_ready',i.builds_after_ready,'graphs',i.static_forwards.built,'in %.1f s' % i.static_forwards.seconds)"
kill $SP; wait $SP 2>/dev/null
echo "== HF generate, static cache (compiled), fp32"
timeout 150 python3 $S/hf.py $B $X
