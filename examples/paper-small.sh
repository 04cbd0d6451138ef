#!/usr/bin/env bash
# The PanGu-Σ paper's claims measured at small scale on the real corpus of ../shared/data, with
# seeds (docs/paper-small.md has the tables, figures and what they mean):
#   1 routing     RRE against a dense model and against learned top-1 (Switch) / top-2 (GShard)
#                 gates: held-out loss per domain and tokens/s, equal training tokens, one FFN
#                 active per token (top-2: two, the gate's definition)
#   2 inherit     the sparse model inherited from the dense one (half the steps dense, half
#                 sparse) against the sparse model trained from scratch (all the steps, and
#                 half of them): held-out loss curves, tokens to reach the same loss
#   3 curriculum  after inheriting, the two-stage curriculum (§4: stage 1 english, chinese,
#                 bilingual and code; stage 2 all six domains) against one mixed stage; and
#                 again with poetry in its own expert group (its experts idle in stage 1)
#   4 extract     each domain's sub-model of every curriculum model: its held-out loss against
#                 the full model's on that domain, compared as doubles (to the bit)
#   5 throughput  dense, RRE (experts by ECSS, as train.experts = auto picks, and in the model),
#                 top-1 and top-2 trained side by side, at the same time, for a few steps,
#                 several rounds: tokens/s under the same load
# Every run is repeated for each seed (train.seed, model.routing_seed and the sampler's seed).
# Resumable: a run whose summary.json exists, an eval whose JSON exists, are skipped; an
# unfinished run is started again. OUT/report.md holds the tables (examples/paper-small/report.py).
#
# Usage: examples/paper-small.sh [--out DIR] [--sigma BIN] [--data DIR] [--seeds "1 2 3"]
#                                [--steps N] [--jobs N] [--rounds N]
#   --out     output folder, reused when it exists (default runs/paper-small)
#   --sigma   the sigma binary (default build/sigma of this checkout)
#   --data    the corpus (default ../shared/data next to the repository)
#   --seeds   the seeds (default "1 2 3")
#   --steps   S, training steps of a from-scratch run (default 320, of 8 x 128 tokens); the
#             inherited runs train S/2 dense + S/2 sparse steps
#   --jobs    runs trained at once, one thread each (default 2)
#   --rounds  throughput rounds (default 3; 0 skips stage 5)
# Runs niced (nice -n 10). The sizes are in examples/paper-small/{dense,sparse}.json.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
EX=$ROOT/examples/paper-small
OUT=$ROOT/runs/paper-small SIGMA=$ROOT/build/sigma DATA=$ROOT/../shared/data
SEEDS="1 2 3" S=320 JOBS=2 ROUNDS=3 VOCAB=4096 EVAL_ROWS=48 TP_STEPS=60
die() { echo "paper-small: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --sigma) SIGMA=${2:?--sigma needs a binary}; shift 2 ;;
    --data) DATA=${2:?--data needs a folder}; shift 2 ;;
    --seeds) SEEDS=${2:?--seeds needs a list}; shift 2 ;;
    --steps) S=${2:?--steps needs a number}; shift 2 ;;
    --jobs) JOBS=${2:?--jobs needs a number}; shift 2 ;;
    --rounds) ROUNDS=${2:?--rounds needs a number}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $S =~ ^[0-9]+$ && $S -ge 16 && $((S % 4)) == 0 ]] || die "--steps must be a multiple of 4, at least 16, not '$S'"
[[ -x $SIGMA ]] || die "$SIGMA is not an executable (build it: cmake --build build --target sigma, or pass --sigma)"
SIGMA=$(cd "$(dirname "$SIGMA")" && pwd)/$(basename "$SIGMA")
DOMAINS=(english chinese poetry bilingual python java)
for d in "${DOMAINS[@]}"; do
  [[ -r $DATA/corpus/$d/train.jsonl ]] || die "$DATA/corpus/$d/train.jsonl not found (pass --data, the folder of ../shared/data)"
done
mkdir -p "$OUT/logs" "$OUT/runs" "$OUT/eval"
OUT=$(cd "$OUT" && pwd)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}  # spinning OpenMP barriers collapse on shared cores
HALF=$((S / 2)) EVERY=$((S / 8)) LOGE=$((S / 16))
STAGE1=$((HALF / 3))
NICE=(nice -n 10)
load() { cut -d' ' -f1 /proc/loadavg; }
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s, load $(load)] $*"; }

{ echo "machine: $("$ROOT/bench/machine.sh"), $(nproc) cores"; echo "date: $(date -u +%FT%TZ)";
  echo "git: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "steps: $S, seeds: $SEEDS, jobs: $JOBS, vocab: $VOCAB"; } | tee -a "$OUT/machine.txt"

# ---- 0. data: the workflow's split, a 4k tokenizer, shards -----------------------------------
if [[ ! -f $OUT/shards-heldout/.done ]]; then
  say "data: split (95 % / 5 %), tokenizer ($VOCAB ids), shards"
  rm -rf "$OUT/corpus-train" "$OUT/corpus-heldout" "$OUT/shards-train" "$OUT/shards-heldout"
  python3 "$ROOT/examples/paper-workflow/split.py" "$DATA/corpus" "$OUT" 0 0 1 1 > "$OUT/logs/split.log"
  "${NICE[@]}" "$SIGMA" tokenizer train --corpus "$OUT/corpus-train" --vocab-size $VOCAB --out "$OUT/tok.json" \
    > "$OUT/logs/tokenizer.log" 2>&1
  python3 - "$ROOT/examples/paper-workflow/data.json" "$OUT" <<'PY'
import json, sys
reg, out = json.load(open(sys.argv[1])), sys.argv[2]
for name in ["train", "heldout"]:
    json.dump({"tokenizer": "tok.json", "corpus": [f"corpus-{name}"], "domains": reg["domains"]},
              open(f"{out}/data.{name}.json", "w"), indent=1, ensure_ascii=False)
PY
  for p in train heldout; do
    "${NICE[@]}" "$SIGMA" prepare --config "$OUT/data.$p.json" --out "$OUT/shards-$p" > "$OUT/logs/prepare-$p.log" 2>&1
  done
  touch "$OUT/shards-heldout/.done"
fi
DATA_SET=(--set data.path="$OUT/shards-train" --set data.eval_path="$OUT/shards-heldout"
          --set train.log_every=$LOGE --set train.eval_every=$EVERY --set train.eval_rows=$EVAL_ROWS
          --set train.threads=1)
# RRE runs train their experts with ECSS (train.experts = auto); their compute buffers get a
# fixed bound, so that five runs at once plan a known amount (the 28 experts need ~28 MiB).
ECSS=(--set train.expert_memory=64MiB)

# ---- runs ------------------------------------------------------------------------------------
# train_run NAME ARGS...: sigma train ARGS --out OUT/runs/NAME, its output in OUT/logs/NAME.log,
# the load average at its start and end in OUT/runs/NAME/load.txt; skipped when finished.
train_run() {
  local name=$1; shift
  local dir=$OUT/runs/$name
  [[ -f $dir/summary.json ]] && return 0
  rm -rf "$dir"
  local l0; l0=$(cut -d' ' -f1-3 /proc/loadavg)
  "${NICE[@]}" "$SIGMA" train "$@" --out "$dir" > "$OUT/logs/$name.log" 2>&1 ||
    { echo "paper-small: $name failed, see $OUT/logs/$name.log:"; tail -n 5 "$OUT/logs/$name.log"; return 1; }
  printf 'start %s\nend %s\n' "$l0" "$(cut -d' ' -f1-3 /proc/loadavg)" > "$dir/load.txt"
}
# A pool of JOBS runs: spawn starts one (waiting for a free place), drain waits for all.
PIDS=() FAILED=0
reap() { local p; for p in "${PIDS[@]}"; do wait "$p" || FAILED=1; done; PIDS=(); }
spawn() {
  if [[ ${#PIDS[@]} -ge $JOBS ]]; then reap; fi
  say "start $1"
  train_run "$@" & PIDS+=($!)
}
drain() { reap; [[ $FAILED == 0 ]] || die "a run failed (its log is named above)"; }
seed_set() {  # seed_set S: the seed of initialisation and routing tables (a dense model has none)
  echo --set train.seed=$1 --set model.routing_seed=$1
}
mixed() { echo "{\"seed\": $((1000 + $1))}"; }
curriculum() {
  echo "{\"seed\": $((1000 + $1)), \"stages\": [{\"steps\": $STAGE1, \"domains\": [\"english\", \"chinese\", \"bilingual\", \"python\", \"java\"]}, {\"domains\": []}]}"
}

for s in $SEEDS; do
  # 1 + 2: from scratch, S steps each; the dense run keeps its checkpoint at S/2 for inherit.
  spawn dense-$s --config "$EX/dense.json" "${DATA_SET[@]}" --set train.seed=$s --set train.steps=$S \
    --set data.sampler="$(mixed $s)" --set train.ckpt_every=$HALF --set train.keep_checkpoints=0
  spawn rre-$s --config "$EX/sparse.json" "${DATA_SET[@]}" "${ECSS[@]}" $(seed_set $s) --set train.steps=$S \
    --set data.sampler="$(mixed $s)"
  drain
  # 2 + 3: PanGu-Σ inherited from the dense model at S/2 steps, then S/2 steps mixed or curriculum.
  if [[ ! -f $OUT/runs/inherited-$s/.done ]]; then
    rm -rf "$OUT/runs/inherited-$s"
    "${NICE[@]}" "$SIGMA" inherit --from "$OUT/runs/dense-$s/checkpoints/$(printf 'step-%08d' $HALF)" \
      --config "$EX/sparse.json" "${DATA_SET[@]}" --set model.routing_seed=$s --out "$OUT/runs/inherited-$s" \
      > "$OUT/logs/inherited-$s.log" 2>&1 || { tail -n 5 "$OUT/logs/inherited-$s.log"; die "inherit failed"; }
    touch "$OUT/runs/inherited-$s/.done"
  fi
  spawn top1-$s --config "$EX/sparse.json" "${DATA_SET[@]}" $(seed_set $s) --set train.steps=$S \
    --set data.sampler="$(mixed $s)" --set model.router=top1
  spawn top2-$s --config "$EX/sparse.json" "${DATA_SET[@]}" $(seed_set $s) --set train.steps=$S \
    --set data.sampler="$(mixed $s)" --set model.router=top2
  drain
  spawn mixed-$s --resume "$OUT/runs/inherited-$s" "${DATA_SET[@]}" "${ECSS[@]}" --set train.seed=$s --set train.steps=$HALF \
    --set data.sampler="$(mixed $s)"
  spawn curriculum-$s --resume "$OUT/runs/inherited-$s" "${DATA_SET[@]}" "${ECSS[@]}" --set train.seed=$s --set train.steps=$HALF \
    --set data.sampler="$(curriculum $s)"
  drain

  # 4: extract each domain of the curriculum model; held-out loss against the full model's.
  for d in "${DOMAINS[@]}"; do
    e=$OUT/runs/curriculum-$s/extract-$d
    [[ -f $OUT/eval/extract-$s-$d.json ]] && continue
    rm -rf "$e"
    "${NICE[@]}" "$SIGMA" extract --ckpt "$OUT/runs/curriculum-$s/checkpoints" --domain "$d" --out "$e" \
      > "$OUT/logs/extract-$s-$d.log" 2>&1
    "${NICE[@]}" "$SIGMA" eval --ckpt "$OUT/runs/curriculum-$s/checkpoints" --data "$OUT/shards-heldout" \
      --domains "$d" --rows $EVAL_ROWS --json > "$OUT/eval/full-$s-$d.json" 2>> "$OUT/logs/extract-$s-$d.log"
    "${NICE[@]}" "$SIGMA" eval --ckpt "$e" --data "$OUT/shards-heldout" --rows $EVAL_ROWS --json \
      > "$OUT/eval/extract-$s-$d.json.tmp" 2>> "$OUT/logs/extract-$s-$d.log"
    mv "$OUT/eval/extract-$s-$d.json.tmp" "$OUT/eval/extract-$s-$d.json"
    rm -rf "$e/expert_store" 2>/dev/null || true
  done
  say "seed $s done"
done

# 2, at equal sparse tokens: RRE from scratch for S/2 steps, with its own full schedule (the
# inherited runs' sparse half has one; the scratch run's step S/2 is mid-schedule).
for s in $SEEDS; do
  spawn rrehalf-$s --config "$EX/sparse.json" "${DATA_SET[@]}" "${ECSS[@]}" $(seed_set $s) --set train.steps=$HALF \
    --set data.sampler="$(mixed $s)"
done
drain

# 3, closer to the paper: poetry in its own expert group (sparse-poetry.json), whose experts
# the curriculum's stage 1 leaves untrained, as the paper's stage 1 does its other domains'.
for s in $SEEDS; do
  if [[ ! -f $OUT/runs/inherited-pg-$s/.done ]]; then
    rm -rf "$OUT/runs/inherited-pg-$s"
    "${NICE[@]}" "$SIGMA" inherit --from "$OUT/runs/dense-$s/checkpoints/$(printf 'step-%08d' $HALF)" \
      --config "$EX/sparse-poetry.json" "${DATA_SET[@]}" --set model.routing_seed=$s --out "$OUT/runs/inherited-pg-$s" \
      > "$OUT/logs/inherited-pg-$s.log" 2>&1 || { tail -n 5 "$OUT/logs/inherited-pg-$s.log"; die "inherit failed"; }
    touch "$OUT/runs/inherited-pg-$s/.done"
  fi
  spawn mixedpg-$s --resume "$OUT/runs/inherited-pg-$s" "${DATA_SET[@]}" "${ECSS[@]}" --set train.seed=$s \
    --set train.steps=$HALF --set data.sampler="$(mixed $s)"
  spawn curriculumpg-$s --resume "$OUT/runs/inherited-pg-$s" "${DATA_SET[@]}" "${ECSS[@]}" --set train.seed=$s \
    --set train.steps=$HALF --set data.sampler="$(curriculum $s)"
done
drain

# ---- 5. throughput: the four models side by side, at the same time -------------------------
for r in $(seq 1 "$ROUNDS"); do
  JOBS_WAS=$JOBS JOBS=5
  TP=(--set train.eval_every=0 --set train.log_every=$((TP_STEPS / 4)) --set train.steps=$TP_STEPS --set train.eval_rows=1)
  spawn tp-dense-$r --config "$EX/dense.json" "${DATA_SET[@]}" "${TP[@]}"
  spawn tp-rre-$r --config "$EX/sparse.json" "${DATA_SET[@]}" "${ECSS[@]}" "${TP[@]}"
  spawn tp-rremodel-$r --config "$EX/sparse.json" "${DATA_SET[@]}" "${TP[@]}" --set train.experts=model
  spawn tp-top1-$r --config "$EX/sparse.json" "${DATA_SET[@]}" "${TP[@]}" --set model.router=top1
  spawn tp-top2-$r --config "$EX/sparse.json" "${DATA_SET[@]}" "${TP[@]}" --set model.router=top2
  drain
  JOBS=$JOBS_WAS
done

# Parameters in total and active per token (sigma inspect), first seed, and one extract.
s1=${SEEDS%% *}
for k in dense rre top1 top2 curriculum; do
  [[ -f $OUT/eval/inspect-$k.json ]] || "$SIGMA" inspect --ckpt "$OUT/runs/$k-$s1/checkpoints" --json > "$OUT/eval/inspect-$k.json"
done
for d in "${DOMAINS[@]}"; do
  if [[ ! -f $OUT/eval/inspect-extract-$d.json ]]; then
    "${NICE[@]}" "$SIGMA" extract --ckpt "$OUT/runs/curriculum-$s1/checkpoints" --domain "$d" --out "$OUT/runs/x-$d" >/dev/null 2>&1
    "$SIGMA" inspect --ckpt "$OUT/runs/x-$d" --json > "$OUT/eval/inspect-extract-$d.json"
    rm -rf "$OUT/runs/x-$d"
  fi
done

say "report: $OUT/report.md"
python3 "$EX/report.py" "$OUT" "$S" $SEEDS > "$OUT/report.md"
say "done"
