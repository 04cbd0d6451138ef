#!/usr/bin/env bash
# Step-time overhead of data parallelism: R ranks (1 thread each) at the same per-rank batch
# as one process with 1 thread, i.e. R times the global batch, alternating runs.
# Usage: bench/dp_overhead.sh [R=2] [repeats=3] [steps=40]   (from the repo root, after a build)
# Environment: EXPERTS=model|parallel (default model: experts replicated in the model),
# PLACEMENT=spread|by_group (with parallel), K=micro-batches per rank (default 1),
# ROUTER=rre|top1|top2 (model.router, default rre: the learned-gate baseline otherwise).
set -euo pipefail
R=${1:-2}; N=${2:-3}; STEPS=${3:-40}
EXPERTS=${EXPERTS:-model}; PLACEMENT=${PLACEMENT:-spread}; K=${K:-1}; ROUTER=${ROUTER:-rre}
S=./build/sigma
M="mpirun --allow-run-as-root --oversubscribe --bind-to none -np $R"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
common="--set model.router=$ROUTER --set train.steps=$STEPS --set train.threads=1 --set train.experts=$EXPERTS --set dist.placement=$PLACEMENT --set train.log_every=1000 --quiet"
step_ms() { python3 -c "import json,sys; s=json.load(open('$1')); print(round(s['tokens']/s['steps']/s['tokens_per_s']*1e3, 1))"; }
exchange() { python3 -c "import json,sys; e=json.load(open('$1')).get('expert_exchange'); print('' if not e else ', exchange %.1f calls/rank/step %.2f MiB/step' % (e['calls_per_rank_step'], e['mib_per_step']))"; }
dropped() { python3 -c "import json; s=json.load(open('$1')); d=s.get('dropped'); print('' if d is None else ', dropped %s' % d)"; }
for i in $(seq "$N"); do
  $S train $common --set train.accum=$K --out "$tmp/one$i" >/dev/null
  OMP_WAIT_POLICY=passive $M $S train $common --set train.accum=$((R * K)) --out "$tmp/many$i" >/dev/null
  echo "run $i: 1 rank $(step_ms $tmp/one$i/summary.json) ms/step, $R ranks $(step_ms $tmp/many$i/summary.json) ms/step$(exchange $tmp/many$i/summary.json)$(dropped $tmp/many$i/summary.json)"
done
