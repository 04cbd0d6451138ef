#!/usr/bin/env bash
# Sharded checkpoints (issue 38): the bytes each rank writes into a checkpoint, and each rank's
# peak resident memory, at the benchmark model size (d = 512, 2 RRE blocks, experts parallel)
# on R ranks at dist.tp = 1, 2, 4, with dist.ckpt_layout = whole and sharded alternating (the
# same load). The run saves once, at its last step. A rank's bytes: its shard files (sharded;
# rank 0 also trainer.json, the tokenizer, the data registry), or (whole) the files it writes:
# tp rank 0 of data rank d its optimizer shard and the expert groups ExpertParallel::writer_of
# gives it, data rank 0 also the model and trainer files; other tp ranks none.
#   [R=4 TPS="1 2 4" LAYOUTS="whole sharded" STEPS=2] bench/ckpt_shards.sh [path/to/sigma] [extra --set ...]
set -euo pipefail
sigma=${1:-build/sigma}
shift || true
R=${R:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for tp in ${TPS:-1 2 4}; do
  for layout in ${LAYOUTS:-whole sharded}; do
    out="$work/tp$tp-$layout"
    start=$(date +%s.%N)
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$R" \
      bash -c '/usr/bin/time -f "%M" -o "$0.rss.$OMPI_COMM_WORLD_RANK" "$@"' "$out" \
      "$sigma" train --set model.d_model=512 --set model.rre_layers=2 --set train.experts=parallel \
      --set train.accum="$R" --set train.steps="${STEPS:-2}" --set train.threads=1 \
      --set train.eval_rows=24 --set dist.tp="$tp" --set dist.ckpt_layout="$layout" --quiet \
      --out "$out" "$@" > "$work/log" 2>&1 || { cat "$work/log"; exit 1; }
    end=$(date +%s.%N)
    rss=$(for r in $(seq 0 $((R - 1))); do echo $(( $(cat "$out.rss.$r") / 1024 )); done | paste -sd' ')
    python3 - "$out" "$tp" "$layout" "$R" "$rss" "$start" "$end" <<'PY'
import json, os, re, sys
out, tp, layout, R, rss, t0, t1 = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], float(sys.argv[6]), float(sys.argv[7])
root = out + "/checkpoints"
ck = root + "/" + open(root + "/latest").read().strip()
cfg = json.load(open(ck + "/trainer.json"))["config"]
D = R // tp
per = [0] * R  # world rank = data rank * tp + tp rank
first = cfg["model"]["layers"] - cfg["model"]["rre_layers"]
groups = [g["name"] if isinstance(g, dict) else g[0] for g in cfg["model"]["groups"]]
for f in sorted(os.listdir(ck)):
    size = os.path.getsize(ck + "/" + f)
    if f == "manifest.json":
        continue
    m = re.match(r"shard-(\d+)\.", f)
    if m:
        per[int(m.group(1))] += size
        continue
    m = re.match(r"optimizer\.rank-(\d+)\.", f)
    if m:
        per[int(m.group(1)) * tp] += size
        continue
    m = re.match(r"experts\.(\d+)\.(.+?)(\.adam)?\.safetensors$", f)
    if m:  # ExpertParallel::writer_of with dist.placement = spread: block i of group g -> (i + g) mod D
        l, g = int(m.group(1)), groups.index(m.group(2))
        per[((l - first + g) % D) * tp] += size
        continue
    per[0] += size  # model.safetensors, optimizer.safetensors, trainer.json, tokenizer, ...
mib = [p / 2**20 for p in per]
mean = sum(mib) / R
print(f"tp={tp} dp={D} {layout:7s}: MiB written per rank {' '.join(f'{x:.0f}' for x in mib)}; "
      f"largest/mean {max(mib) / mean:.2f}; total {sum(mib):.0f} MiB; peak RSS MiB per rank {rss}; "
      f"run {t1 - t0:.0f} s")
PY
  done
done
