#!/usr/bin/env bash
# The main job on the embedded default: a from-scratch llama on the bundled plays,
# on CPU, a few minutes on 2 cores; the loss falls, then a sample prints.
set -euo pipefail
cd "$(dirname "$0")/.."
TOY=.venv/bin/toy
DEMO=build/demo
if [ ! -f "$DEMO/toy.toml" ]; then
  rm -rf "$DEMO"
  $TOY new "$DEMO"
fi
cd "$DEMO"
rm -rf runs/demo
../../$TOY train --recipe from-scratch --arch llama --steps "${DEMO_STEPS:-300}" --batch-size 8 --lr 2e-3 \
  --warmup 20 --eval-every 100 --run-id demo
echo
echo "--- sample (toy infer --run runs/demo --prompt 'HAMLET.' --temperature 0.8 --top-k 50) ---"
../../$TOY infer --run runs/demo --prompt "HAMLET." --max-new-tokens 120 --temperature 0.8 --top-k 50 --seed 0
