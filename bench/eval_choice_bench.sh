#!/usr/bin/env bash
# Multiple-choice scoring speed (issue 28; docs/benchmarks.md "Evaluation: multiple choice"):
# ITEMS two-choice items scored by `sigma eval --task` twice: the reference (REF_SIGMA, default
# the same binary, at --score-batch 1) and batched (--score-batch BATCH: items sorted by length,
# each context once into a KV-cache row, the choices from it). To compare with an older build
# (before issue 28's batched scoring: one full forward pass per choice) set REF_SIGMA to it.
# Reports both wall and CPU times, the ratio, whether the printed scores are equal, and how many
# of the 2 x ITEMS log-likelihoods are equal to the last bit (from --log-samples), with the
# largest difference.
#
# Model: a small sparse model (d=128, 4 blocks, 2 of them RRE, context 128) trained 30 steps
# on a generated corpus; the items are generated sentences of 6-20 words with continuations of
# 1-4 words (speed does not depend on the weights). The tokenizer is nearly byte-level (300
# tokens), so an item is up to ~120 tokens: context 128 holds every item, as a real
# evaluation's model would. EVAL_BENCH_CONTEXT=64 cuts most items, each choice's window where
# its own length allows, so that the two choices share no context: the worst case, where
# batching is all that is gained.
#
#   bench/eval_choice_bench.sh [BUILD_DIR=build] [ITEMS=100000] [BATCH=32]
# Environment: EVAL_BENCH_DIR (work folder, default /tmp/sigma-eval-bench), EVAL_BENCH_CONTEXT
# (the model's context, default 128), PYTHON.
set -euo pipefail
build=${1:-build}
items=${2:-100000}
batch=${3:-32}
sigma="$(cd "$build" && pwd)/sigma"
ref_sigma=${REF_SIGMA:-$sigma}
python=${PYTHON:-/usr/bin/python3}
work=${EVAL_BENCH_DIR:-/tmp/sigma-eval-bench}
context=${EVAL_BENCH_CONTEXT:-128}
export OMP_WAIT_POLICY=passive
[ -x "$sigma" ] || { echo "eval_choice_bench: $sigma not found" >&2; exit 2; }
mkdir -p "$work"
cd "$work"
"$python" - "$items" <<'PY'
import json, random, sys
n = int(sys.argv[1])
rnd = random.Random(28)
words = ("the a cat dog sky sea red blue green runs sleeps eats reads writes quickly slowly "
         "house tree river stone light dark over under with without morning evening king "
         "queen small large old new bright quiet loud warm cold").split()
def sentence(lo, hi):
    return " ".join(rnd.choice(words) for _ in range(rnd.randint(lo, hi)))
with open("corpus.jsonl", "w") as f:
    for _ in range(4000):
        f.write(json.dumps({"domain": "english", "text": sentence(8, 30) + "."}) + "\n")
with open("items.jsonl", "w") as f:
    for _ in range(n):
        f.write(json.dumps({"domain": "english", "context": sentence(6, 20),
                            "choices": [" " + sentence(1, 4), " " + sentence(1, 4)],
                            "answer": rnd.randint(0, 1)}) + "\n")
PY
# Trained with the reference binary, so that an older one can read the checkpoint.
if [ ! -d run/checkpoints ]; then
  "$ref_sigma" tokenizer train --corpus corpus.jsonl --vocab-size 300 --out tok.json >/dev/null
  echo '{"tokenizer": "tok.json", "corpus": ["corpus.jsonl"], "domains": [{"name": "english"}]}' > data.json
  "$ref_sigma" prepare --config data.json --out shards >/dev/null
  "$ref_sigma" train --quiet --set data.source=shards --set data.path=shards --set model.d_model=128 \
    --set model.heads=4 --set model.layers=4 --set model.context="$context" --set model.rre_layers=2 \
    --set 'model.groups=[{"name":"english","experts":2}]' --set train.batch=8 \
    --set train.steps=30 --set train.eval_rows=2 --out run >/dev/null
fi
run() {  # $1 = binary, $2 = --score-batch, $3 = name; prints wall seconds, CPU to $3.cpu
  local t0 t1
  t0=$(date +%s.%N)
  /usr/bin/time -f "%U + %S" -o "$3.cpu" "$1" eval --ckpt run/checkpoints --task items.jsonl \
    --score-batch "$2" --bootstrap 0 --json --log-samples "log-$3.jsonl" > "scores-$3.json"
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
ref=$(run "$ref_sigma" 1 ref)
fast=$(run "$sigma" "$batch" batched)
echo "CPU (user + sys): reference $(cat ref.cpu) s, batched $(cat batched.cpu) s"
"$python" - "$items" "$batch" "$ref" "$fast" <<'PY'
import json, sys
n, batch, ref, fast = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
a = json.load(open("scores-ref.json"))["choice"]
b = json.load(open("scores-batched.json"))["choice"]
same = all(a[k] == b[k] for k in ("acc", "acc_norm", "acc_bytes"))
equal = total = 0
worst = 0.0
for la, lb in zip(open("log-ref.jsonl"), open("log-batched.jsonl")):
    x, y = json.loads(la)["loglik"], json.loads(lb)["loglik"]
    for u, v in zip(x, y):
        total += 1
        equal += u == v
        worst = max(worst, abs(u - v))
print(f"items {n}: reference (--score-batch 1) {ref:.1f} s wall, batched (--score-batch {batch}) "
      f"{fast:.1f} s, {ref / fast:.2f}x")
print(f"scores equal: {same} (acc {a['acc']} / {b['acc']}, acc_norm {a['acc_norm']} / "
      f"{b['acc_norm']}, acc_bytes {a['acc_bytes']} / {b['acc_bytes']})")
print(f"log-likelihoods equal to the last bit: {equal} of {total}; largest difference {worst:.3g}")
PY
