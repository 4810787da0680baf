#!/usr/bin/env bash
# Greedy tokens/s of `specdec generate` with speculation vs --no-speculation on the default
# pair: 3 prompts x 3 runs, 128 tokens, against one running `specdec serve` (startup excluded).
# Prints every run, then the medians and their ratio. Usage: scripts/generate_speed.sh [PORT]
set -euo pipefail
port=${1:-50191}
specdec serve --port "$port" >/tmp/specdec-speed-serve.log 2>&1 &
serve=$!
trap 'kill $serve 2>/dev/null; wait $serve 2>/dev/null' EXIT
until grep -q "orchestrator ready" /tmp/specdec-speed-serve.log; do
  kill -0 $serve 2>/dev/null || { cat /tmp/specdec-speed-serve.log; exit 1; }
  sleep 1
done
prompts=("Write a short story about a robot learning to paint."
         "Explain how a refrigerator works."
         "List ten tips for staying productive when working from home.")
for mode in spec off; do
  flag=""; [ "$mode" = off ] && flag="--no-speculation"
  for p in "${prompts[@]}"; do
    for run in 1 2 3; do
      specdec generate "$p" --address "127.0.0.1:$port" --max-tokens 128 --json $flag |
        python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print('$mode', round(s['tokens_per_second'],2), round(s['acceptance_rate'],3), s['rounds'])"
    done
  done
done | tee /tmp/specdec-speed.txt
python3 - <<'PY'
import statistics
rows = [line.split() for line in open("/tmp/specdec-speed.txt")]
med = {m: statistics.median(float(r[1]) for r in rows if r[0] == m) for m in ("spec", "off")}
acc = statistics.median(float(r[2]) for r in rows if r[0] == "spec")
print(f"median tok/s: speculation {med['spec']:.2f}, --no-speculation {med['off']:.2f}, "
      f"ratio {med['spec'] / med['off']:.2f}x (median acceptance {acc:.3f})")
PY
