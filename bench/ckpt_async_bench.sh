#!/usr/bin/env bash
# Background checkpoints against foreground ones (train.ckpt_async, issue 37 item 10).
# A dense model whose checkpoint takes seconds to write trains STEPS steps, saving every EVERY
# steps, with foreground and with background saves, alternating (A/B, B/A, ...). Each progress
# line (one a step) is time-stamped; per run:
#   loop    the training loop from step 1's line to the last step's (the saves before the last
#           one inside it; start-up, the last save and evaluation outside),
#   step    the median time between two lines without a save between them,
#   window  a save window: from the line of a saving step to the line EVERY steps later (the
#           save and the steps it overlaps), its median; minus EVERY x step = the save's cost
#           to the loop,
#   stall   summary.json's checkpoint_stall_s over the run's saves: the training thread's own
#           wall time per save (foreground: the whole save; background: the copy, any wait, the
#           ranks' agreement and the commit), less sensitive to the steps' varying time.
# Each run's checkpoints are deleted after it.
# NP=R in the environment runs each training under `mpirun -np R` (data parallel: the sharded
# layout, each rank writing its shard; rank 0's progress lines are timed), issue 38.
# Usage: [NP=2] bench/ckpt_async_bench.sh SIGMA [ROUNDS=3] [STEPS=48] [EVERY=12] [--set model.KEY=V ...]
set -euo pipefail
SIGMA=$(realpath "$1")
ROUNDS=${2:-3} STEPS=${3:-48} EVERY=${4:-12}
shift $(($# < 4 ? $# : 4))
W=$(mktemp -d "${CKPT_BENCH_DIR:-/var/tmp}/sigma-ckpt-bench-XXXXXX")
trap 'rm -rf "$W"' EXIT
export OMP_WAIT_POLICY=passive
model=(--set model.d_model=1024 --set model.layers=8 --set model.heads=16 --set model.rre_layers=0
       --set model.context=32 --set train.batch=2 --set train.eval_rows=2 "$@")
((STEPS / EVERY >= 2)) || { echo "STEPS / EVERY must be at least 2"; exit 1; }
NP=${NP:-1}
launch=()
if ((NP > 1)); then  # each rank a share of the cores (train.threads = 0 divides them)
  launch=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP")
fi
"$(dirname "$0")/machine.sh" 2>/dev/null || true
echo "load: $(cut -d' ' -f1-3 /proc/loadavg); saves every $EVERY of $STEPS steps; $NP rank(s)"

# One run: prints "loop step window cost stall" (seconds).
run() {
  rm -rf "$W/out"
  "${launch[@]}" "$SIGMA" train "${model[@]}" --set train.steps="$STEPS" --set train.log_every=1 \
    --set train.ckpt_every="$EVERY" --set train.ckpt_async="$1" --out "$W/out" 2>&1 |
    while IFS= read -r line; do  # a line a step (stderr is not a terminal), unbuffered
      if [[ $line =~ ^step\ +([0-9]+)/ ]]; then echo "${BASH_REMATCH[1]} $(date +%s.%N)"; fi
    done >"$W/times"
  python3 - "$W/times" "$EVERY" "$W/out/summary.json" <<'EOF'
import json, statistics, sys
t = {int(s): float(x) for s, x in (l.split() for l in open(sys.argv[1]))}
stall = json.load(open(sys.argv[3])).get("checkpoint_stall_s", float("nan"))
every = int(sys.argv[2]); last = max(t)
plain = [t[s + 1] - t[s] for s in range(1, last) if s % every != 0]
windows = [t[s + every] - t[s] for s in range(every, last - every + 1, every)]
step = statistics.median(plain)
print(f"{t[last] - t[1]:.2f} {step:.3f} {statistics.median(windows):.2f} "
      f"{statistics.median(windows) - every * step:.2f} {stall / (last // every):.2f}")
EOF
  rm -rf "$W/out"
}

printf "%-6s %-10s %8s %8s %9s %10s %8s\n" round saves loop_s step_s window_s save_cost_s stall_s
for ((r = 1; r <= ROUNDS; r++)); do
  order=(false true)
  ((r % 2)) || order=(true false)
  for async in "${order[@]}"; do
    read -r loop step window cost stall < <(run "$async")
    printf "%-6s %-10s %8s %8s %9s %10s %8s\n" "$r" "$([[ $async == true ]] && echo background || echo foreground)" \
      "$loop" "$step" "$window" "$cost" "$stall"
  done
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
