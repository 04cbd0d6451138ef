#!/usr/bin/env bash
# A simulated cluster on one machine: N "hosts" as Linux network namespaces (each with its own
# UTS hostname h0..hN-1), joined by veth pairs to a bridge that lives in a namespace of its own,
# each host's link shaped with tc, and Open MPI launching the command after `--` into them
# (mpirun runs in h0; a plm_rsh_agent enters the other hosts' namespaces: no ssh). Between hosts
# the ranks talk TCP over the veths, inside a host shared memory (vader). docs/distributed.md,
# "A simulated cluster", describes the interface. Needs root, ip, tc, unshare and Open MPI.
#
#   scripts/sim-cluster.sh --hosts 2 --slots 2 --bandwidth 2gbit -- ./build/sigma train ...
#
# Everything it creates is named sigma-sim-<pid of this script>-*: namespaces, /tmp/<run> (the
# hostfile, the hosts' /etc/hosts, Open MPI's session files) and /dev/shm/<run> (shared
# memory). It is removed at exit, on a signal, at the --timeout, and by a watchdog process
# when this script is killed with SIGKILL; a run whose script and watchdog both died is swept
# by the next run's start.
set -euo pipefail

prog=sim-cluster
die() { echo "$prog: error: $*" >&2; exit 2; }
say() { echo "$prog: $*" >&2; }

base=sigma-sim
subnet_prefix=10.231.0          # only inside the namespaces this script creates
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
self="$here/$(basename "${BASH_SOURCE[0]}")"

# Processes in namespace $1 (as `ip netns pids`), then the namespace, for every namespace of
# run $2; the run's files last. Only what the run's own names select.
sweep_run() {
  local run=$1 ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$run-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$run-" || true); do
    # A process just killed may hold the namespace for a moment; deleting it anyway is fine
    # (the kernel frees it with its last process), but its veths go only then.
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "/tmp/$run" "/dev/shm/$run"
}

# The watchdog: waits for the script (pid $1) to end or the deadline ($3, epoch seconds) to
# pass, then removes run $2. Started detached, so a SIGKILL of the script leaves it running.
if [[ "${1:-}" == --watchdog ]]; then
  owner=$2 run=$3 deadline=$4
  while kill -0 "$owner" 2>/dev/null && (( $(date +%s) < deadline )); do sleep 0.3; done
  kill -KILL "$owner" 2>/dev/null || true  # past the deadline: the script too
  sweep_run "$run"
  exit 0
fi

# Runs `sh -c SCRIPT` as host $1 of run $2: in its network namespace, under its own hostname
# (a UTS namespace) and with the cluster's /etc/hosts (bind-mounted inside the mount namespace
# that `ip netns exec` makes, so the machine's own /etc is not touched).
as_host() {
  local host=$1 run=$2
  shift 2
  ip netns exec "$run-$host" unshare --uts sh -c "echo $host > /proc/sys/kernel/hostname &&
    mount --bind /tmp/$run/hosts /etc/hosts && $*"
}

# The rsh agent Open MPI calls as `AGENT HOST COMMAND...`: runs the command as HOST, as ssh
# would. SIM_CLUSTER_RUN names the run.
if [[ "${1:-}" == --agent ]]; then
  shift
  host=$1
  shift
  [[ "$host" =~ ^h[0-9]+$ ]] || die "agent: unknown host '$host'"
  as_host "$host" "$SIM_CLUSTER_RUN" "$*"
  exit
fi

usage() {
  cat >&2 <<'EOF'
usage: scripts/sim-cluster.sh [options] -- COMMAND [ARG...]
  --hosts N          hosts (network namespaces h0..hN-1), default 2
  --slots S          ranks per host, default 2 (mpirun -np N*S, by slot: ranks 0..S-1 on h0)
  --bandwidth RATE   each host link shaped to RATE in both directions (tc tbf; e.g. 2gbit,
                     200mbit); default: not shaped
  --latency TIME     one-way delay per direction (tc netem, e.g. 50us); refused where the
                     kernel has no netem (no latency is injected otherwise)
  --mtu BYTES        the links' MTU (576 to 9000), default 1500; 9000 gives jumbo frames as
                     cluster networks use (fewer packets for the kernel and the shaper to move)
  --timeout SEC      the whole run's bound (default 600): then every rank is killed, exit 124
  --probe            measure the RTT and bandwidth h0 -> h1 before the run (python3)
  --stats FILE       write per-host byte counters of the run (key=value lines)
  --mpirun-args STR  more arguments for mpirun (word-split)
EOF
  exit 2
}

hosts=2 slots=2 mtu=1500 rate="" latency="" timeout_s=600 probe=0 stats="" extra=""
while (($#)); do
  case $1 in
    --hosts) hosts=${2:?}; shift 2 ;;
    --slots) slots=${2:?}; shift 2 ;;
    --bandwidth) rate=${2:?}; shift 2 ;;
    --latency) latency=${2:?}; shift 2 ;;
    --mtu) mtu=${2:?}; shift 2 ;;
    --timeout) timeout_s=${2:?}; shift 2 ;;
    --probe) probe=1; shift ;;
    --stats) stats=${2:?}; shift 2 ;;
    --mpirun-args) extra=${2:?}; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) say "unknown option '$1'"; usage ;;
  esac
done
(($#)) || { say "no command after --"; usage; }
[[ "$hosts" =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 64)) || die "--hosts $hosts: expected 1 to 64"
[[ "$slots" =~ ^[0-9]+$ ]] && ((slots >= 1 && slots <= 256)) || die "--slots $slots: expected 1 to 256"
[[ "$mtu" =~ ^[0-9]+$ ]] && ((mtu >= 576 && mtu <= 9000)) || die "--mtu $mtu: expected 576 to 9000 bytes"
[[ "$timeout_s" =~ ^[0-9]+$ ]] && ((timeout_s >= 1)) || die "--timeout $timeout_s: expected seconds"
[[ -z "$rate" || "$rate" =~ ^[0-9]+(\.[0-9]+)?([kmg]?bit|[kmg]?bps)$ ]] ||
  die "--bandwidth $rate: expected a tc rate such as 2gbit, 200mbit or 100mbps"
((EUID == 0)) || die "needs root (network namespaces, veth pairs and tc)"
for tool in ip tc unshare mpirun timeout setsid; do
  command -v "$tool" >/dev/null || die "'$tool' not found (packages iproute2, util-linux, openmpi-bin)"
done
# `ip netns exec` makes / a slave mount: impossible where / is not a mount point (a chroot).
mountpoint -q / || die "/ is not a mount point here (a chroot?): ip netns exec needs it to be one"

# Stale runs first: namespaces and files of a run whose script is gone.
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$base-[0-9]+-" || true); do
  pid=${ns#"$base-"}; pid=${pid%%-*}
  ip netns list | grep -q "^$ns\b" || continue  # swept with an earlier namespace of its run
  if ! kill -0 "$pid" 2>/dev/null || ! grep -q sim-cluster "/proc/$pid/cmdline" 2>/dev/null; then
    say "removing $base-$pid (a run whose script is gone)"
    sweep_run "$base-$pid"
  fi
done
for d in /tmp/$base-* /dev/shm/$base-*; do
  [[ -e "$d" ]] || continue
  pid=${d##*/"$base-"}; pid=${pid%%-*}
  kill -0 "$pid" 2>/dev/null && grep -q sim-cluster "/proc/$pid/cmdline" 2>/dev/null || rm -rf "$d"
done

run=$base-$$
tmp=/tmp/$run
deadline=$(($(date +%s) + timeout_s + 20))
setsid "$self" --watchdog $$ "$run" "$deadline" </dev/null >/dev/null 2>&1 &
watchdog=$!
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  sweep_run "$run"
  # Swept already, so the watchdog has nothing left to do: killed and reaped before the exit,
  # so that no process of the run outlives the script (a TERM alone left it alive for a moment
  # under load, and a caller that looks right after the exit found it).
  kill -KILL "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

mkdir -p "$tmp" "/dev/shm/$run"
ns() { echo "$run-$1"; }
in_ns() { local n=$1; shift; ip netns exec "$(ns "$n")" "$@"; }

# The bridge in a namespace of its own: the root namespace gets no interface.
ip netns add "$(ns br)"
ip -n "$(ns br)" link add br0 type bridge
ip -n "$(ns br)" link set br0 mtu "$mtu" up
{
  echo "127.0.0.1 localhost"
  for ((h = 0; h < hosts; h++)); do echo "$subnet_prefix.$((h + 1)) h$h"; done
} >"$tmp/hosts"

# tc's rate in bytes per second, for the bucket: 1 ms of traffic, at least 32 KiB.
burst=32768
if [[ -n "$rate" ]]; then
  bytes_per_s=$(awk -v r="$rate" 'BEGIN {
    n = r + 0; u = substr(r, length(n "") + 1)
    m = (u ~ /^k/) ? 1e3 : (u ~ /^m/) ? 1e6 : (u ~ /^g/) ? 1e9 : 1
    printf "%d", (u ~ /bps$/) ? n * m : n * m / 8 }')
  ((bytes_per_s / 1000 > burst)) && burst=$((bytes_per_s / 1000))
fi
# Egress of device $2 in namespace $1: netem's delay (if asked) with tbf's rate below it.
shape() {
  local n=$1 dev=$2 parent=root
  if [[ -n "$latency" ]]; then
    tc -n "$n" qdisc add dev "$dev" root handle 1: netem delay "$latency" limit 100000 2>/dev/null ||
      die "--latency $latency: tc netem is not available in this kernel, so no latency can be injected (drop --latency; docs/distributed.md)"
    parent="parent 1:"
  fi
  [[ -z "$rate" ]] && return 0
  # limit: 50 ms of traffic queued before drops (TCP backs off well before).
  # shellcheck disable=SC2086
  tc -n "$n" qdisc add dev "$dev" $parent handle 2: tbf rate "$rate" burst "$burst" \
    limit $((bytes_per_s / 20 + burst))
}

for ((h = 0; h < hosts; h++)); do
  n=$(ns h$h)
  ip netns add "$n"
  ip -n "$n" link set lo up
  # Both ends made in namespaces of the run: eth0 in the host, h<k> on the bridge.
  ip -n "$n" link add eth0 mtu "$mtu" type veth peer name "h$h" mtu "$mtu" netns "$(ns br)"
  ip -n "$n" addr add "$subnet_prefix.$((h + 1))/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$(ns br)" link set "h$h" master br0 up
  shape "$n" eth0
  shape "$(ns br)" "h$h"
done

counters() {  # "rx tx" bytes of eth0 and of lo in host $1
  in_ns "h$1" sh -c 'cd /sys/class/net && echo $(cat eth0/statistics/rx_bytes eth0/statistics/tx_bytes lo/statistics/rx_bytes lo/statistics/tx_bytes)'
}

if ((probe)); then
  if ((hosts < 2)); then
    say "probe: one host, no link to measure"
  elif ! command -v /usr/bin/python3 >/dev/null; then
    say "probe: /usr/bin/python3 not found, link not measured"
  else
    in_ns h1 /usr/bin/python3 "$here/sim-cluster-probe.py" serve "$subnet_prefix.2" &
    server=$!
    in_ns h0 /usr/bin/python3 "$here/sim-cluster-probe.py" measure "$subnet_prefix.2" ||
      say "probe failed"
    wait "$server" 2>/dev/null || true
  fi
fi

hostfile=$tmp/hostfile
for ((h = 0; h < hosts; h++)); do echo "h$h slots=$slots"; done >"$hostfile"
declare -a before
for ((h = 0; h < hosts; h++)); do before[h]=$(counters "$h"); done
say "$hosts hosts x $slots slots, links ${rate:-unshaped}, mtu $mtu${latency:+, latency $latency}, run $run"

export SIM_CLUSTER_RUN=$run
# The transports, from the environment so that --mpirun-args "--mca btl self,tcp" can replace
# them (Open MPI refuses a parameter given twice on the command line).
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader,tcp}
mpirun_cmd=(mpirun --allow-run-as-root --oversubscribe --bind-to none
  -np $((hosts * slots)) --hostfile "$hostfile" --map-by slot
  --mca plm_rsh_agent "$self --agent"
  --mca btl_tcp_if_include "$subnet_prefix.0/24" --mca oob_tcp_if_include "$subnet_prefix.0/24"
  --mca btl_vader_backing_directory "/dev/shm/$run" --mca orte_tmpdir_base "$tmp"
  -x SIM_CLUSTER_RUN)
# shellcheck disable=SC2206
[[ -n "$extra" ]] && mpirun_cmd+=($extra)
# mpirun in h0 as as_host runs the daemons (so it knows itself as h0); timeout bounds the run. In the
# background, so that a signal to this script runs its trap at once (bash defers traps until a
# foreground child ends); the sweep then ends every process in the namespaces.
in_ns h0 unshare --uts sh -c 'echo h0 > /proc/sys/kernel/hostname &&
  mount --bind "$0" /etc/hosts && exec "$@"' "$tmp/hosts" \
  timeout --kill-after=10 "$timeout_s" "${mpirun_cmd[@]}" "$@" &
rc=0
wait $! || rc=$?
((rc == 124 || rc == 137)) && say "the run passed --timeout $timeout_s s and was killed"

# Inter-host traffic: what each host's eth0 carried during the run; lo carries a host's own
# TCP (the daemons' out-of-band messages), and would carry the ranks' traffic if shared
# memory were not used between them.
report=""
for ((h = 0; h < hosts; h++)); do
  read -r r0 t0 _ lt0 <<<"${before[h]}"
  read -r r1 t1 _ lt1 <<<"$(counters "$h")"
  report+="h$h.eth0.rx_bytes=$((r1 - r0))"$'\n'"h$h.eth0.tx_bytes=$((t1 - t0))"$'\n'
  report+="h$h.lo.bytes=$((lt1 - lt0))"$'\n'
  say "h$h: eth0 received $((r1 - r0)) and sent $((t1 - t0)) bytes, lo $((lt1 - lt0)) bytes"
done
if [[ -n "$stats" ]]; then
  { printf '%s' "$report"; echo "rc=$rc"; } >"$stats"
fi
exit "$rc"
