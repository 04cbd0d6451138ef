#!/usr/bin/env bash
# Peak resident memory per rank with ZeRO stages 1, 2 and 3 (issue 38): bench/dp_memory.sh's
# runs (the default model with experts in the model, accum = ranks, 2 steps, each rank's VmHWM
# from /usr/bin/time) at R = 1 once (nothing to shard: every stage is the same run) and at
# R = 4 per stage.
#   [ZEROS="1 2 3"] [RANKS=4] bench/zero_mem.sh [path/to/sigma] [extra --set ...]
# e.g. bench/zero_mem.sh build/sigma --set model.d_model=512
set -euo pipefail
here=$(dirname "$0")
RANKS=1 ZERO=1 "$here/dp_memory.sh" "$@"
for z in ${ZEROS:-1 2 3}; do
  echo "dist.zero=$z"
  RANKS=${RANKS:-4} ZERO=$z "$here/dp_memory.sh" "$@"
done
