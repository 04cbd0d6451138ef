#!/usr/bin/env bash
# Runs libFuzzer targets of a -DSIGMA_FUZZ=ON build one after another (docs/reliability.md), each
# until 10 M executions or SECONDS, at the lowest priority, with a work corpus seeded from
# tests/fuzz/corpus/NAME; prints one line of figures per target and keeps the logs, new inputs
# and any crash under OUT. Merging new coverage back into the repo corpus is a separate step:
#   build-fuzz/fuzz_NAME -merge=1 tests/fuzz/corpus/NAME OUT/NAME/corpus
# Usage: tests/fuzz/campaign.sh BUILD_DIR OUT SECONDS NAME...
set -euo pipefail
build=$1 out=$2 seconds=$3
shift 3
repo=$(cd "$(dirname "$0")" && pwd)
# With the kernel's autogroup scheduling (sched_autogroup_enabled = 1) `nice` only ranks tasks
# inside one session's group: a campaign started in its own session (setsid, nohup from
# another terminal) otherwise takes a full share of the cores from everyone else's builds.
# Lower the whole group instead.
echo 19 > /proc/self/autogroup 2>/dev/null || true
for name in "$@"; do
  dir=$out/$name
  mkdir -p "$dir/corpus" "$dir/crashes"
  start=$(date +%s)
  # One worker, one thread: the campaign shares its cores. OMP_NUM_THREADS keeps the model's
  # kernels (serve_request decodes) on the fuzzer's own core.
  OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive nice -n 19 "$build/fuzz_$name" \
    -runs=10000000 -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -close_fd_mask=1 -artifact_prefix="$dir/crashes/" \
    "$dir/corpus" "$repo/corpus/$name" > "$dir/log" 2>&1 || true
  wall=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/log")
  rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$dir/log")
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$dir/log" | tail -1)
  crashes=$(ls "$dir/crashes" | wc -l)
  echo "$name: ${execs:-?} executions in ${wall} s, ${rate:-?} exec/s, ${cov:-no cov line}," \
       "peak RSS ${rss:-?} MB, ${crashes} crash/timeout/oom files"
done
