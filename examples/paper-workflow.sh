#!/usr/bin/env bash
# The PanGu-Σ paper's workflow (§3-§5) in miniature, on the real corpus of ../shared/data, with
# one command (docs/workflow.md walks through the same commands by hand):
#   0 split      every domain's train.jsonl: the first 95 % of lines to train on, the last 5 %
#                held out; bilingual (sorted by length) by a hash of the English side (tiny: a
#                prefix of each part); task files from held-out pairs
#   1 tokenizer  sigma tokenizer train: byte-level BPE with the paper's control tokens
#   2 shards     sigma prepare: one shard per domain, the paper's domain mapping (english,
#                chinese + poetry, bilingual, code = python + java; code in embedding slot 1)
#   3 dense      a dense PanGu-α (one embedding slot) pre-trained on the mixture
#   4 inherit    sigma inherit into a PanGu-Σ: the top blocks RRE, every expert the dense FFN,
#                the code slot a copy of the dense embedding (paper §3.3)
#   5 curriculum the two-stage curriculum (§4): stage 1 the four main domains (english,
#                chinese, bilingual, code), stage 2 all
#   6 extract    sigma extract of each domain; its held-out loss equals the full model's on that
#                domain to the bit (sigma eval --json, compared as doubles)
#   7 finetune   the bilingual sub-model fine-tuned on translation pairs (prompt English, answer
#     + eval     Chinese), then sigma eval: held-out loss per domain, a multiple-choice task and a
#                translation task (BLEU, chrF) made from held-out pairs, a code task (pass@k,
#                examples/paper-workflow/code-tasks.jsonl, code-tasks-java.jsonl)
#   8 serve      sigma serve of the full model and every extract, queried with the openai npm
#                client; the served log-probabilities of a held-out window against sigma eval
# Everything goes into OUT; each stage's commands and output are in OUT/logs/STAGE.log, and
# the wall time per stage is printed at the end (and kept in OUT/stages.tsv). OUT/summary.json
# holds the checks and scores; OUT/eval/rerun.sh recomputes every eval result.
#
# Usage: examples/paper-workflow.sh [--size tiny|medium|full] [--out DIR] [--sigma BIN] [--data DIR]
#                                   [--node-dir DIR]
#   --size      tiny (a prefix of the corpus, a small model: the ctest, ~1 min on 2 cores),
#               medium (the whole corpus and model, a quarter of the steps: for timing) or
#               full (the default: docs/workflow.md has the figures)
#   --out       output folder, must not exist or be empty (default: a new folder under $TMPDIR)
#   --sigma     the sigma binary (default: build/sigma of this checkout)
#   --data      the corpus (default: ../shared/data next to the repository)
#   --node-dir  where the pinned openai client is installed with npm ci when missing
#               (default: OUT/node; the npm registry must then be reachable once)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
EX=$ROOT/examples/paper-workflow
SIZE=full OUT="" SIGMA=$ROOT/build/sigma DATA=$ROOT/../shared/data NODE_DIR=""
die() { echo "paper-workflow: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --size) SIZE=${2:?--size needs tiny, medium or full}; shift 2 ;;
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --sigma) SIGMA=${2:?--sigma needs a binary}; shift 2 ;;
    --data) DATA=${2:?--data needs a folder}; shift 2 ;;
    --node-dir) NODE_DIR=${2:?--node-dir needs a folder}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
case $SIZE in
  # tiny: a prefix of each domain, a 1k vocabulary, d=32, 2 blocks: every stage runs, in minutes.
  tiny) TRAIN_KB=96 HELD_KB=24 VOCAB=1024 D=32 HEADS=2 LAYERS=2 CTX=64 RRE=1 BATCH=8 \
        DENSE_STEPS=120 SPARSE_STEPS=120 STAGE1=40 FT_STEPS=60 FT_PAIRS=2000 LOG_EVERY=10 \
        EVAL_ROWS=16 TASK_ITEMS=16 MAX_NEW=16 SAMPLES=2 KS=1,2
        EXPERT_GROUPS='[{"name":"en","experts":2},{"name":"zh","experts":2},{"name":"enzh","experts":2},{"name":"code","experts":2}]' ;;
  # full: the whole corpus, a 16k vocabulary, the configs in examples/paper-workflow/ as written.
  full) TRAIN_KB=0 HELD_KB=0 VOCAB=16384 D=128 HEADS=4 LAYERS=4 CTX=128 RRE=2 BATCH=8 \
        DENSE_STEPS=1200 SPARSE_STEPS=1200 STAGE1=400 FT_STEPS=300 FT_PAIRS=0 LOG_EVERY=100 \
        EVAL_ROWS=256 TASK_ITEMS=200 MAX_NEW=48 SAMPLES=5 KS=1,5
        EXPERT_GROUPS='[{"name":"en","experts":4},{"name":"zh","experts":4},{"name":"enzh","experts":2},{"name":"code","experts":4}]' ;;
  # medium: the whole corpus and the full model, a quarter of the steps and tasks: the stage
  # timings the full size is estimated from (docs/workflow.md).
  medium) TRAIN_KB=0 HELD_KB=0 VOCAB=16384 D=128 HEADS=4 LAYERS=4 CTX=128 RRE=2 BATCH=8 \
        DENSE_STEPS=300 SPARSE_STEPS=300 STAGE1=100 FT_STEPS=75 FT_PAIRS=0 LOG_EVERY=25 \
        EVAL_ROWS=256 TASK_ITEMS=50 MAX_NEW=48 SAMPLES=5 KS=1,5
        EXPERT_GROUPS='[{"name":"en","experts":4},{"name":"zh","experts":4},{"name":"enzh","experts":2},{"name":"code","experts":4}]' ;;
  *) die "--size must be tiny, medium or full, not '$SIZE'" ;;
esac
DOMAINS=(english chinese poetry bilingual python java)

[[ -x $SIGMA ]] || die "$SIGMA is not an executable (build it: cmake --build build --target sigma, or pass --sigma)"
SIGMA=$(cd "$(dirname "$SIGMA")" && pwd)/$(basename "$SIGMA")
for d in "${DOMAINS[@]}"; do
  [[ -r $DATA/corpus/$d/train.jsonl ]] || die "$DATA/corpus/$d/train.jsonl not found (pass --data, the folder of ../shared/data)"
done
command -v python3 >/dev/null || die "python3 is needed (the split and the checks; scripts/install-deps.sh)"
command -v node >/dev/null && command -v npm >/dev/null || die "node and npm are needed for stage 8 (scripts/install-deps.sh)"
if [[ -z $OUT ]]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/sigma-paper-workflow.XXXXXX"); fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
[[ -z $(ls -A "$OUT") ]] || die "$OUT is not empty (pass a new or empty --out folder)"
NODE_DIR=${NODE_DIR:-$OUT/node}
mkdir -p "$OUT/logs" "$OUT/eval" "$OUT/tasks"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}  # spinning OpenMP barriers collapse on shared cores

# ---- stages: a header with the elapsed time, the log, the wall time of each ----------------
T0=$(date +%s.%N) STAGE="" STAGE_T=0 NSTAGE=0
now() { date +%s.%N; }
end_stage() {
  [[ -n $STAGE ]] || return 0
  awk -v s="$STAGE" -v a="$STAGE_T" -v b="$(now)" 'BEGIN { printf "%s\t%.1f\n", s, b - a }' >> "$OUT/stages.tsv"
}
stage() {
  end_stage
  STAGE=$1 STAGE_T=$(now) NSTAGE=$((NSTAGE + 1))
  awk -v n="$NSTAGE" -v s="$1" -v w="$2" -v a="$T0" -v b="$STAGE_T" \
    'BEGIN { printf "\n== [%d/10] %s: %s (%.0f s elapsed)\n", n, s, w, b - a }'
}
LOG() { echo "$OUT/logs/$STAGE.log"; }
# run CMD...: print the command, run it with its output in the stage's log and on the terminal
run() {
  echo "\$ ${*/#$SIGMA/sigma}" | tee -a "$(LOG)"
  "$@" 2>&1 | tee -a "$(LOG)"
}
# quiet CMD...: the same, output only in the log (a last line on failure)
quiet() {
  echo "\$ ${*/#$SIGMA/sigma}" | tee -a "$(LOG)"
  "$@" >> "$(LOG)" 2>&1 || { echo "paper-workflow: failed, see $(LOG):"; tail -n 5 "$(LOG)"; return 1; }
}
on_exit() {
  local rc=$?
  [[ -z ${SERVER:-} ]] || kill "$SERVER" 2>/dev/null || true
  [[ $rc == 0 ]] || echo "paper-workflow: stage $STAGE failed (exit $rc); its log: $OUT/logs/$STAGE.log" >&2
  exit $rc
}
trap on_exit EXIT

echo "paper-workflow: size $SIZE, output $OUT"
echo "machine: $("$ROOT/bench/machine.sh"), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "corpus: $DATA (licences: $DATA/licenses, $DATA/README.md)"

# ---- 0. split ------------------------------------------------------------------------------
if [[ $TRAIN_KB == 0 ]]; then PART="the whole corpus"; else PART="the first $TRAIN_KB KiB / $HELD_KB KiB of each part"; fi
stage split "95 % / 5 % by line per domain, $PART"
python3 "$EX/split.py" "$DATA/corpus" "$OUT" "$TRAIN_KB" "$HELD_KB" "$FT_PAIRS" "$TASK_ITEMS" | tee -a "$(LOG)"
cp "$EX/code-tasks.jsonl" "$OUT/tasks/code-python.jsonl"
cp "$EX/code-tasks-java.jsonl" "$OUT/tasks/code-java.jsonl"

# ---- 1. tokenizer --------------------------------------------------------------------------
stage tokenizer "byte-level BPE, $VOCAB ids, control tokens <EOT> <Pad> <EN> <CN> <Python> <Java> ..."
run "$SIGMA" tokenizer train --corpus "$OUT/corpus-train" --vocab-size "$VOCAB" --out "$OUT/tok.json"

# ---- 2. shards -----------------------------------------------------------------------------
stage shards "one shard per domain: training, held-out, fine-tuning pairs"
python3 - "$EX/data.json" "$OUT" <<'PY'
import json, sys
reg, out = json.load(open(sys.argv[1])), sys.argv[2]
bil = [d for d in reg["domains"] if d["name"] == "bilingual"]
for name, corpus, domains in [("train", "corpus-train", reg["domains"]),
                              ("heldout", "corpus-heldout", reg["domains"]),
                              ("ft", "corpus-ft/train.jsonl", bil), ("ft-heldout", "corpus-ft/heldout.jsonl", bil)]:
    json.dump({"tokenizer": "tok.json", "corpus": [corpus], "domains": domains},
              open(f"{out}/data.{name}.json", "w"), indent=1, ensure_ascii=False)
PY
for p in train heldout ft ft-heldout; do
  run "$SIGMA" prepare --config "$OUT/data.$p.json" --out "$OUT/shards-$p"
done

# Size and data keys of every training run (the configs hold the full size).
SIZE_SET=(--set model.d_model=$D --set model.heads=$HEADS --set model.layers=$LAYERS
          --set model.context=$CTX --set "model.groups=$EXPERT_GROUPS" --set train.batch=$BATCH
          --set train.log_every=$LOG_EVERY)
DATA_SET=(--set data.path="$OUT/shards-train" --set data.eval_path="$OUT/shards-heldout")

# ---- 3. dense ------------------------------------------------------------------------------
stage dense "PanGu-α: dense, one embedding slot, $DENSE_STEPS steps of $BATCH x $CTX tokens on the mixture"
run "$SIGMA" train --config "$EX/dense.json" "${SIZE_SET[@]}" "${DATA_SET[@]}" \
  --set train.steps=$DENSE_STEPS --out "$OUT/dense"

# ---- 4. inherit ----------------------------------------------------------------------------
stage inherit "PanGu-Σ: top $RRE block(s) RRE, experts = the dense FFN, code in embedding slot 1"
run "$SIGMA" inherit --from "$OUT/dense/checkpoints" --config "$EX/sparse.json" "${SIZE_SET[@]}" \
  --set model.rre_layers=$RRE "${DATA_SET[@]}" --out "$OUT/inherited"

# ---- 5. curriculum -------------------------------------------------------------------------
stage curriculum "stage 1: $STAGE1 steps of english, chinese, bilingual, code; stage 2: all six domains"
run "$SIGMA" train --resume "$OUT/inherited" --config "$EX/curriculum.json" --set train.steps=$SPARSE_STEPS \
  --set train.log_every=$LOG_EVERY \
  --set "data.sampler={\"stages\": [{\"steps\": $STAGE1, \"domains\": [\"english\", \"chinese\", \"bilingual\", \"python\", \"java\"]}, {\"domains\": []}]}" \
  --out "$OUT/sparse"
quiet "$SIGMA" plot "$OUT/sparse"

# ---- 6. extract ----------------------------------------------------------------------------
stage extract "one sub-model per domain, checked loss-free on its held-out text"
# ev NAME ARGS...: sigma eval --json into OUT/eval/NAME.json; the line is kept in rerun.sh
cat > "$OUT/eval/rerun.sh" <<EOF
#!/usr/bin/env bash
# Every sigma eval of the workflow again, into DIR (default: this folder); equal inputs, equal scores.
set -euo pipefail
DIR=\${1:-\$(dirname "\$0")}
mkdir -p "\$DIR"
EOF
ev() {
  local name=$1; shift
  printf '"%s" eval %s --json > "$DIR/%s.json"\n' "$SIGMA" "$(printf '%q ' "$@")" "$name" >> "$OUT/eval/rerun.sh"
  echo "\$ sigma eval $* --json > eval/$name.json" | tee -a "$(LOG)"
  "$SIGMA" eval "$@" --json > "$OUT/eval/$name.json" 2>> "$(LOG)" ||
    { echo "paper-workflow: sigma eval failed, see $(LOG):"; tail -n 5 "$(LOG)"; return 1; }
}
for d in "${DOMAINS[@]}"; do
  quiet "$SIGMA" extract --ckpt "$OUT/sparse/checkpoints" --domain "$d" --out "$OUT/extract/$d"
  ev "heldout-full-$d" --ckpt "$OUT/sparse/checkpoints" --data "$OUT/shards-heldout" --domains "$d" --rows $EVAL_ROWS
  ev "heldout-extract-$d" --ckpt "$OUT/extract/$d" --data "$OUT/shards-heldout" --rows $EVAL_ROWS
done
python3 "$EX/checks.py" extract "$OUT" "${DOMAINS[@]}" | tee -a "$(LOG)"

# ---- 7. fine-tune and evaluate -------------------------------------------------------------
stage finetune "the bilingual sub-model on translation pairs (prompt English, answer Chinese, loss on the answer)"
run "$SIGMA" train --resume "$OUT/extract/bilingual" --config "$EX/finetune.json" --set train.steps=$FT_STEPS \
  --set train.log_every=$LOG_EVERY --set data.path="$OUT/shards-ft" --set data.eval_path="$OUT/shards-ft-heldout" \
  --out "$OUT/finetune"

stage eval "held-out loss per domain, multiple choice, translation (BLEU, chrF), code (pass@k)"
ev heldout-dense --ckpt "$OUT/dense/checkpoints" --data "$OUT/shards-heldout" --rows $EVAL_ROWS
ev heldout-inherited --ckpt "$OUT/inherited" --data "$OUT/shards-heldout" --rows $EVAL_ROWS
ev heldout-sparse --ckpt "$OUT/sparse/checkpoints" --data "$OUT/shards-heldout" --rows $EVAL_ROWS
ev heldout-finetune --ckpt "$OUT/finetune/checkpoints" --data "$OUT/shards-ft-heldout" --rows $EVAL_ROWS
ev heldout-before-finetune --ckpt "$OUT/extract/bilingual" --data "$OUT/shards-ft-heldout" --rows $EVAL_ROWS
for m in extract/bilingual finetune/checkpoints; do
  tag=${m%%/*}; tag=${tag/extract/before-finetune}
  ev "choice-$tag" --ckpt "$OUT/$m" --task "$OUT/tasks/choice-bilingual.jsonl"
  ev "translate-$tag" --ckpt "$OUT/$m" --task "$OUT/tasks/translate-en-zh.jsonl" --max-new $MAX_NEW
done
ev code-python --ckpt "$OUT/extract/python" --task "$OUT/tasks/code-python.jsonl" --samples $SAMPLES --k $KS \
  --temperature 0.8 --seed 1 --max-new $MAX_NEW
ev code-java --ckpt "$OUT/extract/java" --task "$OUT/tasks/code-java.jsonl" --samples $SAMPLES --k $KS \
  --temperature 0.8 --seed 1 --max-new $MAX_NEW
python3 "$EX/checks.py" eval "$OUT" | tee -a "$(LOG)"

# ---- 8. serve ------------------------------------------------------------------------------
stage serve "sigma serve of the full model and the extracts, queried with the openai npm client"
if [[ ! -d $NODE_DIR/node_modules/openai ]] || ! cmp -s "$ROOT/tests/serve_e2e/package-lock.json" "$NODE_DIR/package-lock.json"; then
  mkdir -p "$NODE_DIR"
  cp "$ROOT/tests/serve_e2e/package.json" "$ROOT/tests/serve_e2e/package-lock.json" "$NODE_DIR/"
  quiet bash -c "cd '$NODE_DIR' && npm ci --no-audit --no-fund --loglevel=error --cache '$NODE_DIR/.npm-cache'"
fi
cp "$EX/serve-check.mjs" "$NODE_DIR/"
# One window per domain (window 0 of its held-out shard): sigma eval --rows 1 --batch 1 scores
# it; served, the extract and the full model (sparse:DOMAIN) must give that loss.
for d in "${DOMAINS[@]}"; do
  ev "window-extract-$d" --ckpt "$OUT/extract/$d" --data "$OUT/shards-heldout" --rows 1 --batch 1
done
MODELS=()
for d in "${DOMAINS[@]}"; do MODELS+=(--model "$d=$OUT/extract/$d"); done
KEY=workflow-$RANDOM$RANDOM
"$SIGMA" serve --ckpt "$OUT/sparse/checkpoints" --name sparse "${MODELS[@]}" --port 0 --api-key "$KEY" \
  > "$OUT/logs/serve.out" 2> "$OUT/logs/serve.err" &
SERVER=$!
PORT=""
for _ in $(seq 600); do  # up to 60 s to load
  PORT=$(grep -om1 'listening on http://127.0.0.1:[0-9]*' "$OUT/logs/serve.out" | sed 's/.*://') || true
  [[ -n $PORT ]] && curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/logs/serve.err"; die "sigma serve exited"; }
  sleep 0.1
done
[[ -n $PORT ]] || die "sigma serve did not start in 60 s (see $OUT/logs/serve.err)"
echo "sigma serve --ckpt sparse/checkpoints --name sparse --model DOMAIN=extract/DOMAIN ... on port $PORT" | tee -a "$(LOG)"
python3 "$EX/checks.py" serve-spec "$OUT" "$CTX" "http://127.0.0.1:$PORT/v1" "$KEY" "${DOMAINS[@]}" > "$OUT/serve-checks.json"
echo "\$ node serve-check.mjs serve-checks.json > serve-result.json" | tee -a "$(LOG)"
node "$NODE_DIR/serve-check.mjs" "$OUT/serve-checks.json" > "$OUT/serve-result.json" 2>> "$(LOG)"
kill -TERM $SERVER; wait $SERVER || true; SERVER=""
python3 "$EX/checks.py" serve "$OUT" | tee -a "$(LOG)"
end_stage
STAGE=""

python3 "$EX/checks.py" summary "$OUT" "$SIZE" | tee "$OUT/summary.txt"
