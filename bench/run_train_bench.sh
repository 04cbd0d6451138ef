#!/usr/bin/env bash
# Training-throughput benchmark (issues 2 and 14), side by side in one run (docs/benchmarks.md,
# "Training throughput"):
#   1. machine limits   gemm_peak (oneDNN fp32 sgemm and bf16 matmul GFLOP/s, the best over the
#                       benchmark's shapes) and fma_peak (fp32 FMA and bf16 dot-product peak)
#   2. ROUNDS rounds of, in turn: PyTorch fp32, PyTorch bf16 (torch.autocast on the CPU, its best
#      mode), Sigma fp32, Sigma bf16 (train.precision=bf16): the same dense PanGu-alpha, same
#      shapes, same thread count; alternating, so that a busy spell on the shared machine hits
#      every contender rather than one
#   3. the machine limits again (each denominator is the higher of its two runs: conservative,
#      and the pair shows how much the machine drifted)
# then prints, per contender, the median over rounds of each run's median step (tokens/s), every
# run's figure (the noise), peak resident memory, FLOP rates by the convention and as executed,
# their fractions of the GEMM peak and of the FMA peak of the contender's dtype, the ratios, and
# one JSON line.
#
# Usage: bench/run_train_bench.sh [--build DIR] [--out DIR] [--steps N] [--warmup W]
#                                 [--threads N] [--rounds R] [--T N] [--batch N] [--small]
#                                 [--skip-torch] [--skip-sigma] [--only LIST] [--sigma-set K=V]
#                                 [--check] [--wait-quiet SECS] [--nice N]
#   --build DIR  build tree holding `sigma`, `gemm_peak` and `fma_peak` (default: build)
#   --out DIR    also write every run's JSON, sigma-*.log and result.json there
#   --rounds R   rounds of the four contenders (default 3; medians over rounds)
#   --only LIST  comma-separated contenders to run: torch-fp32,torch-bf16,sigma-fp32,sigma-bf16
#   --T N, --batch N  context and rows per step (default 512 and 8: the benchmark size)
#   --sigma-set K=V   extra `--set` for every Sigma run (repeatable)
#   --small      a tiny model for a smoke test of this script (not a benchmark)
#   --check      exit 1 unless Sigma bf16 reaches issue 14's minimum (1.5x PyTorch bf16 and
#                60 % of the bf16 GEMM peak)
#   --wait-quiet SECS  before each phase wait (up to SECS) until the CPUs are >= 90 % idle
#   --nice N     run each measured program in its own session under `nice -n N`, with that
#                session's scheduler autogroup niced alike (with autogroups, plain nice only
#                ranks a session's own processes); N < 0 needs root. Every phase alike.
#   Both the median step and the fastest step are reported (interference only adds time).
#
# FLOPs. The convention (PaLM's MFU): 6 * N_nonembed + 6 * V * d + 12 * L * T * d per token,
# attention not discounted for the causal mask. Executed: what the kernels actually multiply:
# PyTorch computes the full T x T scores; Sigma's attention skips the key blocks past each
# 128-row block's last query (a fraction of 12 * L * T * d the script computes) but computes the
# scores twice (forward, and again in backward: it keeps no T x T probabilities).
#
# The peer's BLAS: Debian's torch calls libblas.so.3 for fp32 matmuls. With only the reference
# BLAS (libblas3, what `apt-get install --no-install-recommends python3-torch` leaves) its
# matmuls run at ~5 GFLOP/s and the peer is meaningless; Debian's default install brings
# OpenBLAS (the libopenblas0 Recommends). The driver runs the peer on OpenBLAS through
# LD_LIBRARY_PATH from the first of: $PEER_BLAS_DIR, /usr/lib/x86_64-linux-gnu/openblas-{pthread,
# openmp}, and a private unpacked copy in build-bench/peer-blas (docs/benchmarks.md); it refuses
# to run the peer on the reference BLAS unless PEER_BLAS_DIR=system. OPENBLAS_CORETYPE is left
# as the environment has it. (Under autocast the bf16 matmuls run on torch's bundled oneDNN.)
#
# ---------------------------------------------------------------------------------------------
# Interface expected from the Sigma side
#   The command (SIGMA_TRAIN_CMD below, overridable from the environment; it may use the shell
#   variables D LAYERS HEADS T BATCH VOCAB STEPS WARMUP THREADS SIGMA BUILD SIGMA_OUT PRECISION
#   SIGMA_SETS) must train the model of DESIGN.md section 1 at that size in PRECISION (fp32 or
#   bf16) on THREADS threads for WARMUP + STEPS optimizer steps of BATCH x T tokens each. The
#   driver reads its result from the first of:
#   (a) a stdout line that is a JSON object
#         {"impl":"sigma","tokens_per_s":<float>,"step_ms":<float>, ...optional fields}
#       tokens_per_s = BATCH*T*1000/step_ms, step_ms the MEDIAN wall time of the last STEPS
#       steps, warm-up steps untimed; optional "step_ms_min" (fastest timed step).
#   (b) SIGMA_OUT/metrics.jsonl written by `sigma train --out SIGMA_OUT --set train.log_every=1`:
#       one record per step with "step", "tokens" and "tokens_per_s" (the run's cumulative
#       average); the driver recovers each step's wall time from consecutive records and takes
#       the median (and the minimum) over the steps after WARMUP.
#   (c) SIGMA_OUT/summary.json's "tokens_per_s" (whole-run average incl. warm-up; flagged).
# ---------------------------------------------------------------------------------------------
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=/usr/bin/python3   # Debian's python3 with python3-torch; not the pyenv python3 on PATH
BUILD=build OUT="" STEPS=5 WARMUP=2 THREADS=2 SMALL=0 SKIP_TORCH=0 SKIP_SIGMA=0 CHECK=0 QUIET=0 NICE=0
ROUNDS=3 ONLY="torch-fp32,torch-bf16,sigma-fp32,sigma-bf16" T_ARG="" BATCH_ARG="" SIGMA_SETS=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --small) SMALL=1; shift ;;
    --skip-torch) SKIP_TORCH=1; shift ;;
    --skip-sigma) SKIP_SIGMA=1; shift ;;
    --check) CHECK=1; shift ;;
    --wait-quiet) QUIET=$2; shift 2 ;;
    --nice) NICE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --T) T_ARG=$2; shift 2 ;;
    --batch) BATCH_ARG=$2; shift 2 ;;
    --sigma-set) SIGMA_SETS+=" --set $2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run_train_bench.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$ROOT"

# The benchmark size of issue 2.
D=512 LAYERS=8 HEADS=8 T=512 BATCH=8 VOCAB=16384
if [[ $SMALL == 1 ]]; then D=128 LAYERS=2 HEADS=4 T=128 BATCH=4 VOCAB=2048; fi
[[ -n $T_ARG ]] && T=$T_ARG
[[ -n $BATCH_ARG ]] && BATCH=$BATCH_ARG
[[ $SKIP_TORCH == 1 ]] && ONLY=$(echo "$ONLY" | tr ',' '\n' | grep -v '^torch' | paste -sd, -)
[[ $SKIP_SIGMA == 1 ]] && ONLY=$(echo "$ONLY" | tr ',' '\n' | grep -v '^sigma' | paste -sd, -)
wants() { [[ ",$ONLY," == *",$1,"* ]]; }

WORK=${OUT:-$(mktemp -d /tmp/sigma-train-bench.XXXXXX)}
mkdir -p "$WORK"
SIGMA_OUT=$WORK/sigma-run
SIGMA=$BUILD/sigma

GEMM=$BUILD/gemm_peak FMA=$BUILD/fma_peak
[[ -x $GEMM && -x $FMA ]] || { echo "run_train_bench.sh: no gemm_peak or fma_peak in $BUILD (build it first)" >&2; exit 1; }
[[ -x $PY ]] || { echo "run_train_bench.sh: $PY missing (Debian python3 + python3-torch)" >&2; exit 1; }

PEER_LD=""
if [[ $ONLY == *torch* && ${PEER_BLAS_DIR:-} != system ]]; then
  for cand in ${PEER_BLAS_DIR:-} /usr/lib/x86_64-linux-gnu/openblas-pthread \
              /usr/lib/x86_64-linux-gnu/openblas-openmp \
              build-bench/peer-blas/root/usr/lib/x86_64-linux-gnu/openblas-pthread; do
    if [[ -e $cand/libblas.so.3 ]]; then PEER_LD=$(cd "$cand" && pwd); break; fi
  done
  if [[ -z $PEER_LD ]]; then
    echo "run_train_bench.sh: no OpenBLAS for the PyTorch peer (install libopenblas0, or unpack" \
         "it as docs/benchmarks.md shows, or set PEER_BLAS_DIR; PEER_BLAS_DIR=system runs the" \
         "peer on whatever libblas.so.3 is, e.g. the ~20x slower reference BLAS)" >&2
    exit 1
  fi
fi

# Wait (up to QUIET seconds) until the CPUs are >= 90 % idle over 3 s: others share this machine.
wait_quiet() {
  [[ $QUIET -gt 0 ]] || return 0
  local t0=$SECONDS a b tot idle i
  while :; do
    read -ra a < /proc/stat; sleep 3; read -ra b < /proc/stat
    tot=0; for i in 1 2 3 4 5 6 7 8; do tot=$((tot + b[i] - a[i])); done
    idle=$(( (b[4] - a[4] + b[5] - a[5]) * 100 / (tot > 0 ? tot : 1) ))
    (( idle >= 90 )) && return 0
    if (( SECONDS - t0 >= QUIET )); then
      echo "== still busy (${idle}% idle) after ${QUIET}s; measuring anyway" >&2; return 0
    fi
  done
}

# The Sigma invocation: the ordinary trainer on its built-in synthetic data at the benchmark
# size, dense (rre_layers=0, one slot), one metrics record per step (route (b) above).
# SIGMA_TRAIN_CMD in the environment overrides it, e.g. the model-only step benchmark:
#   SIGMA_TRAIN_CMD='"$BUILD/bench_train" --d $D --layers $LAYERS --heads $HEADS --T $T
#     --batch $BATCH --vocab $VOCAB --steps $STEPS --warmup $WARMUP --threads $THREADS'
if [[ -z ${SIGMA_TRAIN_CMD:-} ]]; then
  # single-quoted on purpose: expanded by `eval` below
  SIGMA_TRAIN_CMD='"$SIGMA" train --quiet --out "$SIGMA_OUT"
    --set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS
    --set model.context=$T --set model.vocab=$VOCAB --set train.batch=$BATCH
    --set model.rre_layers=0 --set model.slots=1
    --set train.accum=1 --set train.steps=$((WARMUP + STEPS)) --set train.log_every=1
    --set train.eval_rows=1 --set train.threads=$THREADS --set train.ckpt_every=1000000
    --set train.precision=$PRECISION $SIGMA_SETS'
fi

MACHINE=$("$ROOT/bench/machine.sh")
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
     "$MACHINE; load $LOAD_BEFORE; OPENBLAS_CORETYPE='${OPENBLAS_CORETYPE:-}'" >&2
echo "== model: d=$D layers=$LAYERS heads=$HEADS T=$T batch=$BATCH vocab=$VOCAB;" \
     "warmup $WARMUP + timed $STEPS steps; $THREADS threads; $ROUNDS rounds of $ONLY" >&2

# Runs "$@" at priority NICE (see --nice), else plainly.
run_prio() {
  if [[ $NICE == 0 ]]; then "$@"; return; fi
  setsid -w bash -c 'echo "$0" > /proc/self/autogroup 2>/dev/null || true; exec nice -n "$0" "$@"' \
    "$NICE" "$@"
}
# Runs "$@" at priority NICE and writes its peak resident set (MiB) to file $1.
with_rss() {
  local out=$1; shift
  run_prio "$PY" -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write("%.1f\n" % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024))
sys.exit(rc)' "$out" "$@"
}

probes() {  # machine limits, run $1 of 2
  wait_quiet
  echo "== gemm_peak and fma_peak ($1/2)" >&2
  run_prio "$GEMM" --threads "$THREADS" > "$WORK/gemm_$1.json"
  run_prio "$FMA" --threads "$THREADS" > "$WORK/fma_$1.json"
}

run_torch() {  # $1 = fp32 | bf16, $2 = round
  local flag=""; [[ $1 == bf16 ]] && flag=--bf16
  wait_quiet
  echo "== round $2: PyTorch $1 (fp32 BLAS from ${PEER_LD:-the system libblas.so.3})" >&2
  local peer_ld=$PEER_LD${LD_LIBRARY_PATH:+${PEER_LD:+:}$LD_LIBRARY_PATH}
  LD_LIBRARY_PATH=$peer_ld OPENBLAS_NUM_THREADS=$THREADS \
  run_prio "$PY" bench/torch_peer.py --d $D --layers $LAYERS --heads $HEADS --T $T --batch $BATCH \
      --vocab $VOCAB --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" $flag --verbose \
      > "$WORK/torch-$1-$2.json" || echo "== PyTorch $1 failed (out of memory?)" >&2
}

run_sigma() {  # $1 = fp32 | bf16, $2 = round
  local PRECISION=$1
  wait_quiet
  SIGMA_OUT=$WORK/sigma-run-$1-$2
  echo "== round $2: Sigma $1: $(eval "echo ${SIGMA_TRAIN_CMD//$'\n'/ }")" >&2
  rm -rf "$SIGMA_OUT"
  if ! (export OMP_NUM_THREADS=$THREADS; eval "with_rss \"$WORK/sigma-$1-$2.rss\" \
        ${SIGMA_TRAIN_CMD//$'\n'/ }") > "$WORK/sigma-$1-$2.log" 2>&1; then
    echo "== Sigma $1 failed; last lines of $WORK/sigma-$1-$2.log:" >&2
    tail -n 5 "$WORK/sigma-$1-$2.log" >&2
  fi
  grep -E '^\s*\{.*"impl"\s*:\s*"sigma"' "$WORK/sigma-$1-$2.log" | tail -n 1 > "$WORK/sigma-$1-$2.json" || true
  rm -rf "$SIGMA_OUT/checkpoints"   # hundreds of MB at the benchmark size; not needed
}

probes 1
for r in $(seq 1 "$ROUNDS"); do
  for p in fp32 bf16; do wants "torch-$p" && run_torch $p $r; done
  for p in fp32 bf16; do wants "sigma-$p" && run_sigma $p $r; done
done
probes 2

BENCH_NICE=$NICE BENCH_MACHINE=$MACHINE BENCH_LOAD="$LOAD_BEFORE -> $(cut -d' ' -f1-3 /proc/loadavg)" \
"$PY" - "$WORK" "$CHECK" "$D" "$LAYERS" "$T" "$VOCAB" "$WARMUP" "$ROUNDS" <<'PYEOF'
import glob, json, os, statistics, sys
work, check = sys.argv[1], sys.argv[2] == "1"
d, layers, T, vocab, warmup, rounds = map(int, sys.argv[3:9])
machine = os.environ.get("BENCH_MACHINE", "?")
tag = f"[{machine}]"  # beside every figure (issue 40)
print(f"machine: {machine}; load average {os.environ.get('BENCH_LOAD', '?')}")

def load(path):
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])

def sigma_from_metrics(run_dir):
    """Route (b): each step's wall time from the cumulative tokens_per_s of metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        recs = [r for r in (json.loads(l) for l in f if l.strip()) if r.get("tokens_per_s")]
    if len(recs) <= warmup + 1:
        return None
    el = [r["tokens"] / r["tokens_per_s"] for r in recs]
    dts = sorted((el[k] - el[k - 1]) / (recs[k]["step"] - recs[k - 1]["step"])
                 for k in range(max(warmup, 1), len(recs)))
    step_s = dts[len(dts) // 2]
    tok = (recs[-1]["tokens"] - recs[0]["tokens"]) / (recs[-1]["step"] - recs[0]["step"])
    return {"tokens_per_s": tok / step_s, "step_ms": step_s * 1e3, "step_ms_min": dts[0] * 1e3}

# Machine limits: the higher of the two runs of each.
probes = [(load(f"{work}/gemm_{i}.json") or {}) | (load(f"{work}/fma_{i}.json") or {}) for i in (1, 2)]
def limit(key):
    vals = [p.get(key, 0) for p in probes]
    return max(vals), [round(v, 1) for v in vals]
peak = {"fp32": {"gemm": limit("gemm_peak_gflops"), "fma": limit("fma_peak_gflops")},
        "bf16": {"gemm": limit("bf16_peak_gflops"), "fma": limit("bf16_dot_peak_gflops")}}

# FLOPs per token. Convention: 6*N_nonembed + 6*V*d + 12*L*T*d. Executed attention: PyTorch the
# full T x T; Sigma per 128-row block of queries [i0, i1) the keys 0..i1-1, and 7 products where
# the convention counts 6 (its backward recomputes the scores: flash attention).
f = 4 * d
block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
dense = 6 * (layers * block + 2 * d) + 6 * vocab * d
attn = 12 * layers * T * d
fpt = dense + attn
blocks = [min(T, i + 128) for i in range(0, T, 128)]
sigma_attn_frac = sum(i1 * (i1 - i0) for i0, i1 in zip([0] + blocks[:-1], blocks)) / (T * T)
executed = {"torch": fpt, "sigma": dense + attn * sigma_attn_frac * 7 / 6}

res = {"machine": machine, "nice": int(os.environ.get("BENCH_NICE", "0")), "rounds": rounds,
       "flops_per_token": fpt, "flops_per_token_executed": {k: round(v) for k, v in executed.items()},
       "limits_gflops": {dt: {k: {"max": round(v[0], 1), "runs": v[1]} for k, v in p.items()}
                         for dt, p in peak.items()}}
print(f"\n{'contender':11} {'tok/s':>7} {'runs (tok/s)':>22} {'RSS MiB':>8} {'GFLOP/s':>8}"
      f" {'exec':>6} {'/GEMM':>6} {'/FMA':>6} {'exec/GEMM':>9}  machine")
for name in ("torch-fp32", "torch-bf16", "sigma-fp32", "sigma-bf16"):
    impl, dt = name.split("-")
    runs, rss = [], []
    for r in range(1, rounds + 1):
        x = load(f"{work}/{name}-{r}.json")
        if impl == "sigma" and x is None:
            x = sigma_from_metrics(f"{work}/sigma-run-{dt}-{r}")
        if x is None:
            continue
        runs.append(x["tokens_per_s"])
        rss_file = f"{work}/{name}-{r}.rss"
        if x.get("peak_rss_mib"):
            rss.append(x["peak_rss_mib"])
        elif os.path.exists(rss_file):
            rss.append(float(open(rss_file).read()))
    if not runs:
        continue
    tps = statistics.median(runs)
    gf, gfx = fpt * tps / 1e9, executed[impl] * tps / 1e9
    g, fm = peak[dt]["gemm"][0], peak[dt]["fma"][0]
    e = {"tokens_per_s": round(tps, 1), "runs": [round(v, 1) for v in runs],
         "peak_rss_mib": max(rss) if rss else None, "gflops": round(gf, 1),
         "gflops_executed": round(gfx, 1),
         "of_gemm_peak": round(gf / g, 4) if g else None, "of_fma_peak": round(gf / fm, 4) if fm else None,
         "executed_of_gemm_peak": round(gfx / g, 4) if g else None,
         "executed_of_fma_peak": round(gfx / fm, 4) if fm else None}
    res[name] = e
    pct = lambda v: f"{100 * v:5.1f}%" if v is not None else "    -"
    print(f"{name:11} {tps:7.1f} {' '.join(f'{v:.0f}' for v in runs):>22} "
          f"{(e['peak_rss_mib'] or 0):8.0f} {gf:8.1f} {gfx:6.1f} {pct(e['of_gemm_peak'])} "
          f"{pct(e['of_fma_peak'])} {pct(e['executed_of_gemm_peak']):>9}  {tag}")
bf16_native = all(p.get("bf16_native", True) for p in probes)
res["bf16_native"] = bf16_native
for dt in ("fp32", "bf16"):
    note = ("" if dt == "fp32" or bf16_native else
            " (oneDNN has no bf16 matmul on this CPU: Sigma's bf16 products widen to fp32, so the"
            " GEMM limit is sgemm's and there is no bf16 dot product)")
    print(f"{dt} limits (max of 2 runs): GEMM {peak[dt]['gemm'][0]:.1f} GFLOP/s "
          f"(runs {peak[dt]['gemm'][1]}), FMA/dot {peak[dt]['fma'][0]:.1f} (runs {peak[dt]['fma'][1]}){note} {tag}")
print(f"flops/token: convention {fpt / 1e6:.2f} M; executed: PyTorch {executed['torch'] / 1e6:.2f} M,"
      f" Sigma {executed['sigma'] / 1e6:.2f} M (masked key blocks skipped, scores recomputed in backward)")
ratios = {}
for a, b in (("sigma-bf16", "torch-bf16"), ("sigma-bf16", "torch-fp32"),
             ("sigma-fp32", "torch-fp32"), ("sigma-fp32", "torch-bf16")):
    if a in res and b in res:
        ratios[f"{a}/{b}"] = round(res[a]["tokens_per_s"] / res[b]["tokens_per_s"], 3)
res["ratios"] = ratios
for k, v in ratios.items():
    print(f"{k}: {v:.2f}x {tag}")
ok = None
if "sigma-bf16/torch-bf16" in ratios:
    ok = ratios["sigma-bf16/torch-bf16"] >= 1.5 and (res["sigma-bf16"]["of_gemm_peak"] or 0) >= 0.6
    res["meets_issue14_minimum"] = ok
    print(f"issue 14 minimum (Sigma bf16 >= 1.5x PyTorch bf16 and >= 60 % of the bf16 GEMM peak): "
          f"{'met' if ok else 'NOT met'} {tag}")
with open(os.path.join(work, "result.json"), "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res))
if check and not ok:
    sys.exit(1)
PYEOF
