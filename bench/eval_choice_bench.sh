#!/usr/bin/env bash
# Multiple-choice scoring speed (issue 28; docs/benchmarks.md "Evaluation: multiple choice"):
# ITEMS two-choice items scored by `sigma eval --task` the reference way (--score-batch 1: one
# full forward pass per choice, the context recomputed for each) and batched (--score-batch
# BATCH: items sorted by length, each context once into a KV-cache row, the choices from it).
# Reports both wall times, the ratio, whether the printed scores are equal, and how many of the
# 2 x ITEMS log-likelihoods are equal to the last bit (from --log-samples), with the largest
# difference.
#
# Model: a small sparse model (d=128, 4 blocks, 2 of them RRE, context 64) trained 30 steps on
# a generated corpus; the items are generated sentences of 6-20 words with continuations of
# 1-4 words (speed does not depend on the weights).
#
#   bench/eval_choice_bench.sh [BUILD_DIR=build] [ITEMS=100000] [BATCH=64]
# Environment: EVAL_BENCH_DIR (work folder, default /tmp/sigma-eval-bench), PYTHON.
set -euo pipefail
build=${1:-build}
items=${2:-100000}
batch=${3:-64}
sigma="$(cd "$build" && pwd)/sigma"
python=${PYTHON:-/usr/bin/python3}
work=${EVAL_BENCH_DIR:-/tmp/sigma-eval-bench}
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
if [ ! -d run/checkpoints ]; then
  "$sigma" tokenizer train --corpus corpus.jsonl --vocab-size 300 --out tok.json >/dev/null
  echo '{"tokenizer": "tok.json", "corpus": ["corpus.jsonl"], "domains": [{"name": "english"}]}' > data.json
  "$sigma" prepare --config data.json --out shards >/dev/null
  "$sigma" train --quiet --set data.source=shards --set data.path=shards --set model.d_model=128 \
    --set model.heads=4 --set model.layers=4 --set model.context=64 --set model.rre_layers=2 \
    --set 'model.groups=[{"name":"english","experts":2}]' --set train.batch=8 \
    --set train.steps=30 --set train.eval_rows=2 --out run >/dev/null
fi
run() {  # $1 = --score-batch
  local t0 t1
  t0=$(date +%s.%N)
  "$sigma" eval --ckpt run/checkpoints --task items.jsonl --score-batch "$1" --bootstrap 0 \
    --json --log-samples "log-$1.jsonl" > "scores-$1.json"
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
ref=$(run 1)
fast=$(run "$batch")
"$python" - "$items" "$batch" "$ref" "$fast" <<'PY'
import json, sys
n, batch, ref, fast = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
a = json.load(open("scores-1.json"))["choice"]
b = json.load(open(f"scores-{batch}.json"))["choice"]
same = all(a[k] == b[k] for k in ("acc", "acc_norm", "acc_bytes"))
equal = total = 0
worst = 0.0
for la, lb in zip(open("log-1.jsonl"), open(f"log-{batch}.jsonl")):
    x, y = json.loads(la)["loglik"], json.loads(lb)["loglik"]
    for u, v in zip(x, y):
        total += 1
        equal += u == v
        worst = max(worst, abs(u - v))
print(f"items {n}: reference (--score-batch 1) {ref:.1f} s, batched (--score-batch {batch}) "
      f"{fast:.1f} s, {ref / fast:.2f}x")
print(f"scores equal: {same} (acc {a['acc']} / {b['acc']}, acc_norm {a['acc_norm']} / "
      f"{b['acc_norm']}, acc_bytes {a['acc_bytes']} / {b['acc_bytes']})")
print(f"log-likelihoods equal to the last bit: {equal} of {total}; largest difference {worst:.3g}")
PY
