#!/usr/bin/env bash
# The paper's workflow at small scale on ../shared/data (issue 6, docs/surgery.md):
#   1. split every domain 95/5 (last 5 % of lines held out), an 8k tokenizer on the training
#      part, shards for the training part, the held-out part and the held-out python alone
#   2. dense      train configs/workflow.dense.json (d=128, 4 blocks, 2 embedding slots)
#   3. inherit    sigma inherit into configs/workflow.sparse.json (top 2 blocks RRE, 4 groups)
#   4. sparse     continue training the sparse model (train --resume on the inherited root)
#   5. extract    sigma extract --domain python
#   6. matched    a dense model of the extract's parameter count (configs/workflow.matched.json:
#                 d=128, 8 blocks, 1 slot), trained from scratch on the same data for the
#                 tokens of phases 2 + 4 together
#   7. eval       held-out python loss of the full sparse model, the extract and the matched
#                 dense model on every held-out python window; sizes of the full model and the
#                 extract (parameters, model.safetensors bytes, checkpoint directory bytes)
# and prints a summary table (markdown) at the end.
#
# Usage: bench/surgery_workflow.sh [SIGMA [OUT]]
#   SIGMA         the sigma binary (default: build/sigma)
#   OUT           output folder, created; its previous contents are replaced (default: runs/workflow)
# Environment:    DATA (default: ../shared/data next to the repository), VOCAB (8192),
#                 STEPS_DENSE (800), STEPS_SPARSE (800), THREADS (2)
# Run it under `nice -n 10` on a shared machine; it prints how long each phase took.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SIGMA=${1:-${SIGMA:-build/sigma}}
OUT=${2:-${OUT:-runs/workflow}}
DATA=${DATA:-$ROOT/../shared/data}
VOCAB=${VOCAB:-8192}
STEPS_DENSE=${STEPS_DENSE:-800}
STEPS_SPARSE=${STEPS_SPARSE:-800}
THREADS=${THREADS:-2}
STEPS_MATCHED=$((STEPS_DENSE + STEPS_SPARSE))
SIGMA=$(cd "$(dirname "$SIGMA")" && pwd)/$(basename "$SIGMA")
[ -x "$SIGMA" ] || { echo "surgery_workflow: $SIGMA is not an executable" >&2; exit 2; }
[ -d "$DATA/corpus" ] || { echo "surgery_workflow: $DATA/corpus not found (set DATA)" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -rf "${OUT:?}"/*
T0=$(date +%s)
phase() { echo "== $1 ($(( $(date +%s) - T0 )) s)" >&2; echo "$1 $(( $(date +%s) - T0 ))" >> "$OUT/phases.txt"; }

phase data
for d in english chinese poetry bilingual python java; do
  f=$DATA/corpus/$d/train.jsonl
  mkdir -p "$OUT/corpus-train/$d" "$OUT/corpus-heldout/$d"
  n=$(wc -l < "$f"); h=$((n / 20))
  head -n $((n - h)) "$f" > "$OUT/corpus-train/$d/train.jsonl"
  tail -n "$h" "$f" > "$OUT/corpus-heldout/$d/heldout.jsonl"
done
"$SIGMA" tokenizer train --corpus "$OUT/corpus-train" --vocab-size "$VOCAB" --out "$OUT/tok.json" \
  > "$OUT/tokenizer.log" 2>&1
# data configs: the domain registry of configs/workflow.data.json with this run's paths
python3 - "$ROOT/configs/workflow.data.json" "$OUT" <<'PY'
import json, sys
template, out = sys.argv[1], sys.argv[2]
base = json.load(open(template))
for name, corpus, keep in [("train", "corpus-train", None), ("heldout", "corpus-heldout", None),
                           ("heldout-python", "corpus-heldout/python", "python")]:
    c = dict(base, tokenizer=f"{out}/tok.json", corpus=[f"{out}/{corpus}"])
    if keep:
        c["domains"] = [d for d in base["domains"] if d["name"] == keep]
    json.dump(c, open(f"{out}/data.{name}.json", "w"), indent=1)
PY
for p in train heldout heldout-python; do
  "$SIGMA" prepare --config "$OUT/data.$p.json" --out "$OUT/shards-$p" > "$OUT/prepare-$p.log" 2>&1
done
DATA_ARGS=(--set data.path="$OUT/shards-train" --set data.eval_path="$OUT/shards-heldout"
           --set train.threads="$THREADS")

phase dense
"$SIGMA" train --quiet --config "$ROOT/configs/workflow.dense.json" "${DATA_ARGS[@]}" \
  --set train.steps="$STEPS_DENSE" --out "$OUT/dense" > "$OUT/dense.log" 2>&1

phase inherit
"$SIGMA" inherit --from "$OUT/dense/checkpoints" --config "$ROOT/configs/workflow.sparse.json" \
  "${DATA_ARGS[@]}" --out "$OUT/inherited" > "$OUT/inherit.log" 2>&1

phase sparse
"$SIGMA" train --quiet --resume "$OUT/inherited" --set train.steps="$STEPS_SPARSE" \
  --set train.threads="$THREADS" --out "$OUT/sparse" > "$OUT/sparse.log" 2>&1

phase extract
"$SIGMA" extract --ckpt "$OUT/sparse/checkpoints" --domain python --out "$OUT/python" \
  > "$OUT/extract.log" 2>&1

phase matched
"$SIGMA" train --quiet --config "$ROOT/configs/workflow.matched.json" "${DATA_ARGS[@]}" \
  --set train.steps="$STEPS_MATCHED" --out "$OUT/matched" > "$OUT/matched.log" 2>&1

phase eval
ev() {  # ev NAME CKPT DATA ROWS: ROWS windows per domain spread through the held-out shards
  "$SIGMA" eval --ckpt "$2" --data "$3" --rows "$4" --batch 32 --json > "$OUT/eval-$1.json"
}
ALL=16777216  # above the window count: every window of the held-out python shard
ev dense "$OUT/dense/checkpoints" "$OUT/shards-heldout-python" $ALL
ev inherited "$OUT/inherited" "$OUT/shards-heldout-python" $ALL
ev sparse "$OUT/sparse/checkpoints" "$OUT/shards-heldout-python" $ALL
ev extract "$OUT/python" "$OUT/shards-heldout-python" $ALL
ev matched "$OUT/matched/checkpoints" "$OUT/shards-heldout-python" $ALL
ev sparse-all "$OUT/sparse/checkpoints" "$OUT/shards-heldout" 128
ev matched-all "$OUT/matched/checkpoints" "$OUT/shards-heldout" 128
for c in dense/checkpoints inherited sparse/checkpoints python matched/checkpoints; do
  "$SIGMA" inspect --ckpt "$OUT/$c" --json > "$OUT/inspect-${c%%/*}.json"
done
phase done

python3 - "$OUT" "$STEPS_DENSE" "$STEPS_SPARSE" "$STEPS_MATCHED" <<'PY'
import json, os, sys
out, n_dense, n_sparse, n_matched = sys.argv[1], *map(int, sys.argv[2:])
def load(p): return json.load(open(os.path.join(out, p)))
def latest(root):
    root = os.path.join(out, root)
    return os.path.join(root, open(os.path.join(root, "latest")).read().strip())
def dir_bytes(d): return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
def raw(name):  # the loss exactly as eval printed it (a decimal that round-trips the double)
    text = open(os.path.join(out, f"eval-{name}.json")).read()
    i = text.index('"python"'); i = text.index('"loss": ', i) + 8
    return text[i:text.index(",", i)]
summ = {k: load(f"{k}/summary.json") for k in ("dense", "sparse", "matched")}
rows = [
    ("dense, end of phase 1", "eval-dense", "inspect-dense", "dense/checkpoints", summ["dense"]["tokens"]),
    ("inherited sparse, step 0", "eval-inherited", "inspect-inherited", "inherited", summ["dense"]["tokens"]),
    ("**full sparse model**", "eval-sparse", "inspect-sparse", "sparse/checkpoints",
     summ["dense"]["tokens"] + summ["sparse"]["tokens"]),
    ("**python extract**", "eval-extract", "inspect-python", "python",
     summ["dense"]["tokens"] + summ["sparse"]["tokens"]),
    ("**size-matched dense**", "eval-matched", "inspect-matched", "matched/checkpoints", summ["matched"]["tokens"]),
]
ev = load("eval-sparse.json")["domains"]["python"]
print(f"\nheld-out python: {ev['tokens']} tokens (every window of {ev['tokens'] // 128} x 128); "
      f"steps: dense {n_dense} + sparse {n_sparse}, matched {n_matched}, 8 x 128 tokens each\n")
print("| model | held-out python loss | ppl | parameters | active / token | model.safetensors bytes | checkpoint dir bytes | training tokens |")
print("|---|---|---|---|---|---|---|---|")
for label, e, i, ck, tok in rows:
    p = load(f"{e}.json")["domains"]["python"]; par = load(f"{i}.json")["parameters"]
    d = latest(ck) if os.path.exists(os.path.join(out, ck, "latest")) else os.path.join(out, ck)
    print(f"| {label} | {p['loss']:.4f} | {p['ppl']:.1f} | {par['total']:,} | {par['active_per_token']:,} | "
          f"{os.path.getsize(os.path.join(d, 'model.safetensors')):,} | {dir_bytes(d):,} | {tok:,} |")
full, ext = raw("sparse"), raw("extract")
print(f"\nextract vs full sparse model, held-out python loss: {ext} vs {full}: "
      + ("bit-identical (the same double: eval prints a decimal that round-trips it)" if full == ext
         else f"DIFFERENT by {float(ext) - float(full):.3e}"))
print(f"inherit: dense {raw('dense')} -> sparse at step 0 {raw('inherited')} "
      f"(difference {float(raw('inherited')) - float(raw('dense')):.2e})")
m = float(raw("matched"))
print(f"size-matched dense - extract: {m - float(ext):+.4f} nats/token "
      f"(parameters {load('inspect-matched.json')['parameters']['total'] / load('inspect-python.json')['parameters']['total']:.4f} x the extract's)")
sa, ma = load("eval-sparse-all.json")["domains"], load("eval-matched-all.json")["domains"]
print("\nevery held-out domain, 128 windows of 128 tokens each (full sparse model / size-matched dense):")
print("| domain | " + " | ".join(sa) + " |")
print("|---|" + "---|" * len(sa))
print("| full sparse | " + " | ".join(f"{sa[d]['loss']:.3f}" for d in sa) + " |")
print("| size-matched dense | " + " | ".join(f"{ma[d]['loss']:.3f}" for d in sa) + " |")
phases = [l.split() for l in open(os.path.join(out, "phases.txt"))]
print("\nwall time per phase (s): " + ", ".join(
    f"{a[0]} {int(b[1]) - int(a[1])}" for a, b in zip(phases, phases[1:]))
    + f"; total {phases[-1][1]} s")
print(f"tokens/s: dense {summ['dense']['tokens_per_s']:.0f}, sparse {summ['sparse']['tokens_per_s']:.0f}, "
      f"matched {summ['matched']['tokens_per_s']:.0f}")
PY
