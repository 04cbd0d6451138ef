#!/usr/bin/env bash
# Kill campaign against `sigma prepare` and `sigma tokenizer train` (issue 29): each is SIGKILLed
# at random moments; after every kill
#  - a prepared folder that `sigma train` accepts is byte-identical to a whole preparation (the
#    old one or the new one), never a mix of the two;
#  - a tokenizer file that exists is the complete one;
#  - the rerun succeeds and leaves no temporary file behind.
# Usage: prepare_kill_campaign.sh SIGMA [KILLS]   (bounded: a few seconds per kill)
set -euo pipefail
SIGMA=$(realpath "$1")
KILLS=${2:-8}
W=$(mktemp -d "${TMPDIR:-/tmp}/sigma-prepare-kills-XXXXXX")
trap 'rm -rf "$W"' EXIT
cd "$W"
export OMP_WAIT_POLICY=passive

# Two corpora that differ in every domain (A: even numbers, B: odd), ~1.5 MB each.
python3 - <<'EOF'
import json
for name, parity in (("a", 0), ("b", 1)):
    with open(f"{name}.jsonl", "w") as f:
        for i in range(parity, 24000, 2):
            f.write(json.dumps({"domain": "prose", "text": f"the cat {i} sat on mat {i % 97} and the dog {i*7} ran far away."}) + "\n")
            f.write(json.dumps({"domain": "code", "text": f"def f{i % 131}(x):\n    return x * {i} + {i % 13}\n"}) + "\n")
EOF
mkdata() { # NAME CORPUS
  printf '{"tokenizer": "tok.json", "corpus": ["%s"], "domains": [{"name": "prose", "slot": 0}, {"name": "code", "slot": 1}]}' "$2" > "$1.json"
}
mkdata da a.jsonl
mkdata db b.jsonl

"$SIGMA" tokenizer train --corpus a.jsonl --vocab-size 400 --out tok.json 2>/dev/null
"$SIGMA" prepare --config da.json --out refA >/dev/null 2>&1
t0=$(date +%s.%N)
"$SIGMA" prepare --config db.json --out refB >/dev/null 2>&1
t1=$(date +%s.%N)
T=$(python3 -c "print(round($t1 - $t0, 3))")
echo "prepare takes ${T}s; $KILLS kills of prepare, $KILLS of tokenizer train"

same_as() { # DIR REF: manifest and every shard byte-identical
  cmp -s "$1/manifest.json" "$2/manifest.json" && cmp -s "$1/prose.shard" "$2/prose.shard" &&
    cmp -s "$1/code.shard" "$2/code.shard"
}
accepted() { # DIR: sigma train takes it
  "$SIGMA" train --quiet --set data.source=shards --set "data.path=$1" --set model.d_model=16 \
    --set model.heads=2 --set model.layers=2 --set model.context=16 --set train.batch=2 \
    --set train.steps=1 --set train.eval_rows=2 \
    --set 'model.groups=[{"name":"prose","experts":2},{"name":"code","experts":2}]' >/dev/null 2>&1
}
fail() { echo "FAIL: $*"; exit 1; }

mixed=0 refused=0
for k in $(seq "$KILLS"); do
  rm -rf dir && cp -a refA dir
  delay=$(python3 -c "import random; print(round(random.uniform(0, 1.1 * $T), 3))")
  "$SIGMA" prepare --config db.json --out dir >/dev/null 2>&1 & pid=$!
  sleep "$delay"; kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  if accepted dir; then
    same_as dir refA || same_as dir refB || { mixed=$((mixed + 1)); fail "kill $k at ${delay}s: a mixed folder was accepted"; }
  else
    refused=$((refused + 1))
  fi
  "$SIGMA" prepare --config db.json --out dir >/dev/null 2>&1 || fail "rerun of prepare after kill $k failed"
  accepted dir || fail "kill $k: the rerun's folder is refused"
  same_as dir refB || fail "kill $k: the rerun differs from a clean preparation"
  [ -z "$(ls dir | grep -e '\.tmp')" ] || fail "kill $k: temporaries left: $(ls dir)"
done
echo "prepare: $KILLS kills, $refused folders refused (mid-commit), 0 mixed folders accepted"

"$SIGMA" tokenizer train --corpus b.jsonl --vocab-size 400 --out tref.json 2>/dev/null
for k in $(seq "$KILLS"); do
  rm -f tk.json
  delay=$(python3 -c "import random; print(round(random.uniform(0, 0.5), 3))")
  "$SIGMA" tokenizer train --corpus b.jsonl --vocab-size 400 --out tk.json >/dev/null 2>&1 & pid=$!
  sleep "$delay"; kill -9 "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  if [ -e tk.json ]; then cmp -s tk.json tref.json || fail "tokenizer kill $k: a partial tokenizer"; fi
  "$SIGMA" tokenizer train --corpus b.jsonl --vocab-size 400 --out tk.json >/dev/null 2>&1 ||
    fail "tokenizer rerun after kill $k failed"
  cmp -s tk.json tref.json || fail "tokenizer kill $k: the rerun differs"
  [ -z "$(ls | grep -e '^tk\.json\.tmp')" ] || fail "tokenizer kill $k: temporaries left: $(ls)"
done
echo "tokenizer train: $KILLS kills, every rerun complete, no temporaries left"
