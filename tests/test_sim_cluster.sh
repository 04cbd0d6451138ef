#!/usr/bin/env bash
# The simulated cluster (scripts/sim-cluster.sh, docs/distributed.md): 2 hosts x 2 ranks,
# tp 2 inside a host and dp 2 across, train the same bits as 4 ranks on one host, dense and
# RRE; the hosts' traffic crossed the veths; and nothing of the cluster is left after a run or
# after a SIGKILL of the script mid-run; `--mtu` reaches both ends of a link. Needs root and network namespaces: skipped (exit 77,
# with the reason) where they are missing.
#   tests/test_sim_cluster.sh SIGMA_BINARY SOURCE_DIR
set -euo pipefail
sigma=$1 src=$2
sim=$src/scripts/sim-cluster.sh

source "$src/tests/sim_cluster_preamble.sh"  # skip(), fail(); skips where no cluster can start

tmp=$(mktemp -d /tmp/sim-cluster-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

train() {  # ARGS...: a tiny tp 2 x dp 2 run, one thread per rank
  echo "train --config $src/configs/tiny.json --set train.steps=10 --set train.batch=4"\
       "--set train.accum=4 --set train.threads=1 --set train.log_every=1 --set dist.tp=2"\
       "--quiet $*"
}
# metrics.jsonl without its wall-clock fields.
metrics() { sed -E 's/"tokens_per_s":[^,}]*,?//g; s/"step_s":[^,}]*,?//g' "$1"; }

# Nothing of run sigma-sim-$1 left: namespaces, files, processes (its ranks and daemons carry
# SIM_CLUSTER_RUN in their environment), the watchdog.
leftovers() {
  local run=sigma-sim-$1
  ip netns list | grep -q "^$run-" && echo "namespace $(ip netns list | grep "^$run-" | head -1)"
  for f in "/tmp/$run" "/dev/shm/$run"; do [[ -e "$f" ]] && echo "file $f"; done
  # One grep each over every process (a loop of forks takes seconds on a busy machine).
  grep -lsz "^SIM_CLUSTER_RUN=$run\$" /proc/[0-9]*/environ | sed 's|^|process |'
  grep -lsz "^$run\$" /proc/[0-9]*/cmdline | sed 's|^|watchdog |'
  return 0
}

start=$(date +%s)
for model in "model.rre_layers=0" "model.rre_layers=1"; do
  name=${model//[^a-z0-9]/_}
  local_out=$tmp/local-$name sim_out=$tmp/sim-$name
  # shellcheck disable=SC2046
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 "$sigma" $(train --set "$model" --out "$local_out") \
    >"$tmp/local.log" 2>&1 || { cat "$tmp/local.log"; fail "$model: 4 local ranks"; }
  # shellcheck disable=SC2046
  "$sim" --hosts 2 --slots 2 --bandwidth 2gbit --timeout 120 --stats "$tmp/stats" -- \
    "$sigma" $(train --set "$model" --out "$sim_out") >"$tmp/sim.log" 2>&1 &
  pid=$!
  wait "$pid" || { cat "$tmp/sim.log"; fail "$model: the simulated cluster's run"; }
  cat "$tmp/sim.log"
  # Every tensor, assembled whole (the runs save sharded: each rank its pieces).
  ck=checkpoints/step-00000010
  "$sigma" inspect --tensors --ckpt "$local_out/$ck" >"$tmp/local.tensors" &&
    "$sigma" inspect --tensors --ckpt "$sim_out/$ck" >"$tmp/sim.tensors" || fail "$model: inspect --tensors failed"
  cmp -s "$tmp/local.tensors" "$tmp/sim.tensors" || fail "$model: 2 hosts x 2 ranks' weights differ from 4 local ranks'"
  [[ "$(metrics "$local_out/metrics.jsonl")" == "$(metrics "$sim_out/metrics.jsonl")" ]] ||
    fail "$model: 2 hosts x 2 ranks' losses differ from 4 local ranks'"
  grep -q '"step":10' "$sim_out/metrics.jsonl" || fail "$model: no step 10 in metrics.jsonl"
  for h in h0 h1; do
    tx=$(sed -n "s/^$h.eth0.tx_bytes=//p" "$tmp/stats") lo=$(sed -n "s/^$h.lo.bytes=//p" "$tmp/stats")
    ((tx > 100000)) || fail "$model: $h sent ${tx:-no} bytes on eth0: the ranks' traffic did not cross the veths"
    # The tp pairs' traffic (inside a host) is 12x the dp traffic across: over TCP it would
    # show on lo (15 MB here with --mca btl self,tcp); through shared memory, lo has ~20 KB of
    # the daemons' own messages.
    ((lo * 4 < tx)) || fail "$model: $h's lo carried $lo bytes: the ranks inside a host did not use shared memory"
  done
  left=$(leftovers "$pid")
  [[ -z "$left" ]] || fail "$model: left behind after the run: $left"
  echo "ok: $model: bit-identical to 4 local ranks; $(grep eth0 "$tmp/stats" | tr '\n' ' ')"
done

# --mtu out of range: refused before anything is made.
if "$sim" --mtu 100 -- true >"$tmp/mtu.log" 2>&1; then fail "--mtu 100 was accepted"; fi
grep -q -- "--mtu 100: expected 576 to 9000" "$tmp/mtu.log" || { cat "$tmp/mtu.log"; fail "--mtu 100: no clear refusal"; }

# SIGKILL of the script mid-run: its watchdog ends the ranks and removes everything. The run
# has jumbo frames (--mtu 9000), checked on both ends of h0's link while it runs.
# shellcheck disable=SC2046
"$sim" --hosts 2 --slots 2 --mtu 9000 --timeout 120 -- "$sigma" $(train --set model.rre_layers=0 --set train.steps=100000 --out "$tmp/killed") \
  >"$tmp/kill.log" 2>&1 &
pid=$!
for ((i = 0; i < 600; i++)); do
  [[ -s "$tmp/killed/metrics.jsonl" ]] && break
  kill -0 "$pid" 2>/dev/null || { cat "$tmp/kill.log"; fail "the run to be killed ended by itself"; }
  sleep 0.1
done
[[ -s "$tmp/killed/metrics.jsonl" ]] || { cat "$tmp/kill.log"; fail "the run to be killed never logged a step"; }
for end in "sigma-sim-$pid-h0 eth0" "sigma-sim-$pid-br h0"; do
  read -r ns dev <<<"$end"
  ip -n "$ns" link show "$dev" | grep -q " mtu 9000 " || fail "--mtu 9000: $dev in $ns has $(ip -n "$ns" link show "$dev" | grep -o 'mtu [0-9]*')"
done
echo "ok: --mtu 9000 set on both ends of a host's link; --mtu 100 refused"
kill -KILL "$pid"
wait "$pid" 2>/dev/null || true
for ((i = 0; i < 150; i++)); do
  left=$(leftovers "$pid")
  [[ -z "$left" ]] && break
  sleep 0.2
done
[[ -z "$left" ]] || fail "30 s after a SIGKILL of the script, left behind: $left"
echo "ok: a SIGKILL of the script mid-run left nothing behind"
echo "passed in $(($(date +%s) - start)) s"
