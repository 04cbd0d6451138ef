# Shared by the benchmarks that time training runs on the simulated cluster
# (bench/overlap_bench.sh, bench/step_model_check.sh); sourced, not run. The caller sets
# `sigma`, `root`, `tmp`, `WARM`, `model` (the --set arguments of every run), `TP`, `DP`, `K`
# and `mpi_x` (mpirun -x arguments); `SLOTS` (ranks per host, 2 unless set); optionally `ref_set`
# (an array of more arguments for the reference runs only) and `REF_UPDATE_KEEP` (ref_step_ms).

declare -p ref_set >/dev/null 2>&1 || ref_set=()
# Median step time in ms of a metrics.jsonl, over the steps after the first WARM.
step_ms() {
  python3 - "$1" "$WARM" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tok = [r["tokens"] for r in recs]
per = [(tok[i] - (tok[i - 1] if i else 0)) / r["tokens_per_s"] for i, r in enumerate(recs)]
print(f"{statistics.median(per[int(sys.argv[2]):]) * 1e3:.1f}")
PY
}

median() { printf '%s\n' "$@" | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

# The compute reference: DP independent copies of one tp group, at the same time, so that the
# machine's cores are shared as in the cluster runs; each runs the same micro-batches per rank.
# Prints the median of their step times (ms).
reference() {
  local pids=() i
  rm -rf "$tmp"/ref*
  for ((i = 0; i < DP; i++)); do
    if ((TP == 1)); then
      OMP_WAIT_POLICY=passive "$sigma" train $model "${ref_set[@]}" --set train.accum=$K --out "$tmp/ref$i" \
        >"$tmp/ref$i.log" 2>&1 &
    else
      # Its own session directory: concurrent mpiruns sharing one race to create and remove it.
      mkdir -p "$tmp/ref$i.ompi"
      mpirun --allow-run-as-root --oversubscribe --bind-to none $mpi_x -np $TP \
        --mca orte_tmpdir_base "$tmp/ref$i.ompi" "$sigma" train \
        $model "${ref_set[@]}" --set train.accum=$K --out "$tmp/ref$i" >"$tmp/ref$i.log" 2>&1 &
    fi
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || { cat "$tmp/ref$i.log" >&2; exit 1; }; done
  local t=()
  for ((i = 0; i < DP; i++)); do t+=("$(ref_step_ms "$tmp/ref$i")"); done
  median "${t[@]}"
}

# A reference run's step time, as a rank of the DP-rank run would spend it: a single process
# updates the experts of every token it saw (ECSS, summary.json's ecss.update_s), where an
# experts-parallel rank updates only its share, so the rest of that update is taken out: the
# share kept is REF_UPDATE_KEEP (default 1/DP: a reference holding every expert).
ref_step_ms() {
  python3 - "$(step_ms "$1/metrics.jsonl")" "$1/summary.json" "${REF_UPDATE_KEEP:-$(python3 -c "print(1 / $DP)")}" <<'PY'
import json, sys
ms, path, keep = float(sys.argv[1]), sys.argv[2], float(sys.argv[3])
s = json.load(open(path))
update_ms = s.get("ecss", {}).get("update_s", 0.0) / max(s["steps"], 1) * 1e3
print(f"{ms - update_ms * (1 - keep):.1f}")
PY
}

# cluster RATE OVERLAP OUT [STATS]: a 2 hosts x SLOTS ranks run (RATE "none": links not shaped),
# its log in OUT.log, per-host byte counters in STATS; prints its step time (ms).
cluster() {
  local rate=()
  [[ "$1" == none ]] || rate=(--bandwidth "$1")
  "$root/scripts/sim-cluster.sh" --hosts 2 --slots "${SLOTS:-2}" "${rate[@]}" ${LATENCY:+--latency "$LATENCY"} \
    ${MTU:+--mtu "$MTU"} \
    ${4:+--stats "$4"} --timeout 900 --mpirun-args "$mpi_x ${MPI_ARGS:-}" -- "$sigma" train $model \
    --set train.accum=$((DP * K)) --set dist.overlap="$2" --out "$3" >"$3.log" 2>&1 ||
    { cat "$3.log" >&2; exit 1; }
  step_ms "$3/metrics.jsonl"
}
