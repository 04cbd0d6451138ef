#!/usr/bin/env bash
# Host-first sums across real (simulated) hosts (dist/host_first.h, docs/distributed.md
# "Placement across hosts"): 2 hosts x 2 ranks, tp 1 x dp 4, so each data group holds 2 ranks
# of each host, aligned with tree_sum's tree ((0 1) (2 3)). The ranks learn their hosts from
# MPI_Comm_split_type (the line at start says the sums go host-first); the run trains the bits
# of 4 ranks on one host and of the direct path (SIGMA_HOST_FIRST=0), blocking and overlapped;
# and each host sends fewer bytes on eth0 than on the direct path. Needs root and network
# namespaces: skipped (exit 77, with the reason) where they are missing.
#   tests/test_sim_cluster_host_first.sh SIGMA_BINARY SOURCE_DIR
set -euo pipefail
sigma=$1 src=$2
sim=$src/scripts/sim-cluster.sh

source "$src/tests/sim_cluster_preamble.sh"  # skip(), fail(); skips where no cluster can start

tmp=$(mktemp -d /tmp/sim-host-first-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# A small dense tp 1 x dp 4 run whose ZeRO exchange dominates what crosses hosts.
train() {
  echo "train --config $src/configs/tiny.json --set model.d_model=64 --set train.steps=8"\
       "--set train.batch=4 --set train.accum=4 --set train.threads=1 --set train.log_every=1"\
       "--set train.ckpt_every=0 --set dist.ckpt_layout=sharded $*"
}
metrics() { sed -E 's/"tokens_per_s":[^,}]*,?//g; s/"step_s":[^,}]*,?//g' "$1"; }
tx() { sed -n "s/^$2.eth0.tx_bytes=//p" "$1"; }

start=$(date +%s)
# shellcheck disable=SC2046
mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4 "$sigma" $(train --out "$tmp/local") \
  >"$tmp/local.log" 2>&1 || { cat "$tmp/local.log"; fail "4 local ranks"; }
grep -q "data group:" "$tmp/local.log" && fail "one host, yet the run printed a data group's hosts: $(grep 'data group:' "$tmp/local.log")"
# name | mpirun arguments | dist.overlap
for run in "host-first||false" "host-first-overlap||true" "direct|-x SIGMA_HOST_FIRST=0|false"; do
  IFS='|' read -r name args overlap <<<"$run"
  # shellcheck disable=SC2046
  "$sim" --hosts 2 --slots 2 --timeout 180 --stats "$tmp/$name.stats" ${args:+--mpirun-args "$args"} -- \
    "$sigma" $(train --set dist.overlap="$overlap" --out "$tmp/$name") >"$tmp/$name.log" 2>&1 ||
    { cat "$tmp/$name.log"; fail "$name: the simulated cluster's run"; }
  line=$(grep "data group:" "$tmp/$name.log" || true)
  case $name in
    direct) want="sums direct (SIGMA_HOST_FIRST=0)" ;;
    *) want="4 ranks on 2 hosts (ranks 0-1 | 2-3): sums host-first" ;;
  esac
  [[ "$line" == *"$want"* ]] || { cat "$tmp/$name.log"; fail "$name: the line at start does not say '$want'"; }
  ck=checkpoints/step-00000008
  "$sigma" inspect --tensors --ckpt "$tmp/local/$ck" >"$tmp/local.tensors" &&
    "$sigma" inspect --tensors --ckpt "$tmp/$name/$ck" >"$tmp/$name.tensors" || fail "$name: inspect --tensors failed"
  cmp -s "$tmp/local.tensors" "$tmp/$name.tensors" || fail "$name: the weights differ from 4 local ranks'"
  [[ "$(metrics "$tmp/local/metrics.jsonl")" == "$(metrics "$tmp/$name/metrics.jsonl")" ]] ||
    fail "$name: the losses differ from 4 local ranks'"
  echo "ok: $name: bit-identical to 4 local ranks; $line; $(grep eth0.tx "$tmp/$name.stats" | tr '\n' ' ')"
done
for h in h0 h1; do
  first=$(tx "$tmp/host-first.stats" $h) direct=$(tx "$tmp/direct.stats" $h)
  # The ZeRO exchange halves (each host sends one partial sum per owner away, and each piece
  # once to the other host); start-up, the agreement and the metrics do not.
  ((first * 10 < direct * 7)) || fail "$h sent $first bytes host-first against $direct direct: not 30 % less"
  echo "ok: $h sent $first bytes host-first, $direct direct ($((100 * first / direct)) %)"
done
echo "passed in $(($(date +%s) - start)) s"
