#!/usr/bin/env bash
# Training-throughput benchmark of issue 2, side by side in one run (docs/benchmarks.md,
# "Training throughput (issue 2)"):
#   1. gemm_peak        oneDNN fp32 GEMM GFLOP/s on this machine (the MFU denominator)
#   2. torch_peer.py    the same dense PanGu-alpha in PyTorch (Debian python3-torch, /usr/bin/python3)
#   3. sigma train      our trainer on the same model, same shapes, same thread count
#   4. gemm_peak again  (the denominator is the higher of the two runs: conservative, and the
#                        pair shows how much the machine drifted during the run)
# then prints tokens/s, achieved GFLOP/s, MFU and Sigma/PyTorch, and one JSON line.
#
# Usage: bench/run_train_bench.sh [--build DIR] [--out DIR] [--steps N] [--warmup W]
#                                 [--threads N] [--small] [--skip-torch] [--skip-sigma] [--check]
#                                 [--wait-quiet SECS] [--nice N]
#   --build DIR  build tree holding `sigma` and `gemm_peak` (default: build; gemm_peak is also
#                looked up in build-bench)
#   --out DIR    also write gemm_*.json, torch.json, sigma.json, sigma.log and result.json there
#   --small      a tiny model for a smoke test of this script (not a benchmark)
#   --check      exit 1 unless Sigma reaches the issue's minimum (2x PyTorch and 30 % MFU)
#   --wait-quiet SECS  before each phase wait (up to SECS) until the CPUs are >= 90 % idle
#   --nice N     run each measured program in its own session under `nice -n N`, with that
#                session's scheduler autogroup niced alike (with autogroups, plain nice only
#                ranks a session's own processes); N < 0 needs root. On a machine others keep
#                busy this gets the measured program most of the CPU; every phase alike.
#   Both the median step and the fastest step are reported (interference only adds time).
#
# The peer's BLAS: Debian's torch calls libblas.so.3. With only the reference BLAS (libblas3,
# what `apt-get install --no-install-recommends python3-torch` leaves) its matmuls run at
# ~5 GFLOP/s and the peer is meaningless; Debian's default install brings OpenBLAS (the
# libopenblas0 Recommends). The driver runs the peer on OpenBLAS through LD_LIBRARY_PATH from the
# first of: $PEER_BLAS_DIR, /usr/lib/x86_64-linux-gnu/openblas-{pthread,openmp}, and a private
# unpacked copy in build-bench/peer-blas (docs/benchmarks.md shows how to make one without
# touching the system); it refuses to run the peer on the reference BLAS unless
# PEER_BLAS_DIR=system. OPENBLAS_CORETYPE is left as the environment has it.
#
# ---------------------------------------------------------------------------------------------
# Interface expected from the Sigma side
#   The command (SIGMA_TRAIN_CMD below, overridable from the environment; it may use the shell
#   variables D LAYERS HEADS T BATCH VOCAB STEPS WARMUP THREADS SIGMA BUILD SIGMA_OUT) must train
#   the model of DESIGN.md section 1 in fp32 at that size on THREADS threads for WARMUP + STEPS
#   optimizer steps of BATCH x T tokens each. The driver reads its result from the first of:
#   (a) a stdout line that is a JSON object (preferred; what `--bench-json` should print)
#         {"impl":"sigma","tokens_per_s":<float>,"step_ms":<float>, ...optional fields}
#       tokens_per_s = BATCH*T*1000/step_ms, step_ms the MEDIAN wall time of the last STEPS
#       steps (data + forward + backward + optimizer), warm-up steps untimed. Optional fields
#       used when present: "step_ms_min" (fastest timed step), "flops_per_token", "params",
#       "loss_first", "loss_last".
#       build/bench_train (bench/bench_train.cpp) prints exactly this line.
#   (b) SIGMA_OUT/metrics.jsonl written by `sigma train --out SIGMA_OUT --set train.log_every=1`:
#       one record per step with "step", "tokens" and "tokens_per_s" (the run's cumulative
#       average); the driver recovers each step's wall time from consecutive records and takes
#       the median (and the minimum) over the steps after WARMUP.
#   (c) SIGMA_OUT/summary.json's "tokens_per_s" (whole-run average incl. warm-up; flagged).
#   Other output is kept in $OUT/sigma.log.
# ---------------------------------------------------------------------------------------------
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=/usr/bin/python3   # Debian's python3 with python3-torch; not the pyenv python3 on PATH
BUILD=build OUT="" STEPS=5 WARMUP=2 THREADS=2 SMALL=0 SKIP_TORCH=0 SKIP_SIGMA=0 CHECK=0 QUIET=0 NICE=0
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
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run_train_bench.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$ROOT"

# The benchmark size of issue 2.
D=512 LAYERS=8 HEADS=8 T=512 BATCH=8 VOCAB=16384
if [[ $SMALL == 1 ]]; then D=128 LAYERS=2 HEADS=4 T=128 BATCH=4 VOCAB=2048; fi

WORK=${OUT:-$(mktemp -d /tmp/sigma-train-bench.XXXXXX)}
mkdir -p "$WORK"
SIGMA_OUT=$WORK/sigma-run
SIGMA=$BUILD/sigma

GEMM=""
for cand in "$BUILD/gemm_peak" build-bench/gemm_peak; do
  if [[ -x $cand ]]; then GEMM=$cand; break; fi
done
[[ -n $GEMM ]] || { echo "run_train_bench.sh: no gemm_peak in $BUILD or build-bench (build it first)" >&2; exit 1; }
[[ -x $PY ]] || { echo "run_train_bench.sh: $PY missing (Debian python3 + python3-torch)" >&2; exit 1; }

PEER_LD=""
if [[ $SKIP_TORCH == 0 && ${PEER_BLAS_DIR:-} != system ]]; then
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

# ===== PLACEHOLDER: the Sigma invocation. ======================================================
# Until `sigma train` gains a bench option that prints line (a) above, this runs the ordinary
# trainer on its built-in synthetic data at the benchmark size, dense (rre_layers=0, one slot),
# with one metrics record per step (route (b)); replace it with `... --bench-json` (or whatever the option is called) when that
# exists. SIGMA_TRAIN_CMD in the environment overrides it, e.g. the model-only step benchmark:
#   SIGMA_TRAIN_CMD='"$BUILD/bench_train" --d $D --layers $LAYERS --heads $HEADS --T $T
#     --batch $BATCH --vocab $VOCAB --steps $STEPS --warmup $WARMUP --threads $THREADS'
if [[ -z ${SIGMA_TRAIN_CMD:-} ]]; then
  # single-quoted on purpose: expanded by `eval` below
  SIGMA_TRAIN_CMD='"$SIGMA" train --quiet --out "$SIGMA_OUT"
    --set model.d_model=$D --set model.layers=$LAYERS --set model.heads=$HEADS
    --set model.context=$T --set model.vocab=$VOCAB --set train.batch=$BATCH
    --set model.rre_layers=0 --set model.slots=1
    --set train.accum=1 --set train.steps=$((WARMUP + STEPS)) --set train.log_every=1
    --set train.eval_rows=1 --set train.threads=$THREADS'
fi
# ================================================================================================

echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
     "family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs)" \
     "model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs);" \
     "load $(cut -d' ' -f1-3 /proc/loadavg); OPENBLAS_CORETYPE='${OPENBLAS_CORETYPE:-}'" >&2
echo "== model: d=$D layers=$LAYERS heads=$HEADS T=$T batch=$BATCH vocab=$VOCAB;" \
     "warmup $WARMUP + timed $STEPS steps; $THREADS threads" >&2

# Runs "$@" at priority NICE (see --nice), else plainly.
run_prio() {
  if [[ $NICE == 0 ]]; then "$@"; return; fi
  setsid -w bash -c 'echo "$0" > /proc/self/autogroup 2>/dev/null || true; exec nice -n "$0" "$@"' \
    "$NICE" "$@"
}
wait_quiet
echo "== gemm_peak (1/2)" >&2
run_prio "$GEMM" --threads "$THREADS" > "$WORK/gemm_1.json"

if [[ $SKIP_TORCH == 0 ]]; then
  wait_quiet
  echo "== PyTorch peer (BLAS from ${PEER_LD:-the system libblas.so.3})" >&2
  peer_ld=$PEER_LD${LD_LIBRARY_PATH:+${PEER_LD:+:}$LD_LIBRARY_PATH}
  LD_LIBRARY_PATH=$peer_ld OPENBLAS_NUM_THREADS=$THREADS \
  run_prio "$PY" bench/torch_peer.py --d $D --layers $LAYERS --heads $HEADS --T $T --batch $BATCH \
      --vocab $VOCAB --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" --verbose \
      > "$WORK/torch.json"
fi

if [[ $SKIP_SIGMA == 0 ]]; then
  wait_quiet
  echo "== Sigma: $SIGMA_TRAIN_CMD" >&2
  rm -rf "$SIGMA_OUT"
  if ! (export OMP_NUM_THREADS=$THREADS; eval "run_prio ${SIGMA_TRAIN_CMD//$'\n'/ }") > "$WORK/sigma.log" 2>&1; then
    echo "== Sigma run failed; last lines of $WORK/sigma.log:" >&2
    tail -n 5 "$WORK/sigma.log" >&2
  fi
  grep -E '^\s*\{.*"impl"\s*:\s*"sigma"' "$WORK/sigma.log" | tail -n 1 > "$WORK/sigma.json" || true
  rm -rf "$SIGMA_OUT/checkpoints"   # hundreds of MB at the benchmark size; not needed
fi

wait_quiet
echo "== gemm_peak (2/2)" >&2
run_prio "$GEMM" --threads "$THREADS" > "$WORK/gemm_2.json"

BENCH_NICE=$NICE "$PY" - "$WORK" "$SIGMA_OUT" "$CHECK" "$D" "$LAYERS" "$T" "$VOCAB" "$WARMUP" <<'PYEOF'
import json, os, sys
work, sigma_out, check = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
d, layers, T, vocab = map(int, sys.argv[4:8])

def load(name):
    p = os.path.join(work, name)
    if not os.path.exists(p) or os.path.getsize(p) == 0:
        return None
    with open(p) as f:
        return json.loads(f.read().strip().splitlines()[-1])

g = [load("gemm_1.json"), load("gemm_2.json")]
peak = max(x["gemm_peak_gflops"] for x in g)
torch_r, sigma_r = load("torch.json"), load("sigma.json")
note = ""
warmup = int(sys.argv[8])
metrics = os.path.join(sigma_out, "metrics.jsonl")
if sigma_r is None and os.path.exists(metrics):
    with open(metrics) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    # tokens_per_s is cumulative since the run started: elapsed_k = tokens_k / tokens_per_s_k.
    recs = [r for r in recs if r.get("tokens_per_s")]
    if len(recs) > warmup + 1:
        el = [r["tokens"] / r["tokens_per_s"] for r in recs]
        dts = sorted((el[k] - el[k - 1]) / (recs[k]["step"] - recs[k - 1]["step"])
                     for k in range(max(warmup, 1), len(recs)))
        step_s = dts[len(dts) // 2]
        tok_per_step = (recs[-1]["tokens"] - recs[0]["tokens"]) / (recs[-1]["step"] - recs[0]["step"])
        sigma_r = {"impl": "sigma", "tokens_per_s": round(tok_per_step / step_s, 2),
                   "step_ms": round(step_s * 1e3, 2), "step_ms_min": round(dts[0] * 1e3, 2),
                   "tokens_per_step": tok_per_step}
        note = "sigma: median step from metrics.jsonl (no JSON line)"
if sigma_r is None and os.path.exists(os.path.join(sigma_out, "summary.json")):
    with open(os.path.join(sigma_out, "summary.json")) as f:
        s = json.load(f)
    sigma_r = {"impl": "sigma", "tokens_per_s": s["tokens_per_s"], "step_ms": None}
    note = "sigma: no JSON line or per-step metrics, used summary.json (whole-run average incl. warm-up)"

# FLOPs per token, PaLM's convention: 6*N_nonembed + 6*V*d (tied head) + 12*L*T*d (attention).
# N_nonembed from the PyTorch model's parameter count when it ran, else from the shapes.
if torch_r is not None:
    fpt = torch_r["flops_per_token"]
else:
    f = 4 * d
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    fpt = 6 * (layers * block + 2 * d) + 6 * vocab * d + 12 * layers * T * d
if sigma_r is not None and sigma_r.get("flops_per_token") and abs(sigma_r["flops_per_token"] / fpt - 1) > 1e-3:
    note += f" sigma reports flops_per_token {sigma_r['flops_per_token']} != {fpt}; using {fpt}"

res = {"nice": int(os.environ.get("BENCH_NICE", "0")), "gemm_peak_gflops": round(peak, 1),
       "gemm_peak_gflops_runs": [round(x["gemm_peak_gflops"], 1) for x in g],
       "bf16_peak_gflops": round(max(x.get("bf16_peak_gflops", 0) for x in g), 1),
       "flops_per_token": fpt}
print(f"\n{'impl':8} {'tokens/s':>10} {'step ms':>9} {'GFLOP/s':>8} {'MFU':>6}   "
      f"{'best tok/s':>10} {'best MFU':>8}   (median step | fastest step)")
for name, r in (("pytorch", torch_r), ("sigma", sigma_r)):
    if r is None:
        print(f"{name:8} {'(not run or no result)':>40}")
        continue
    tps = r["tokens_per_s"]
    gf = fpt * tps / 1e9
    res[name] = {"tokens_per_s": tps, "step_ms": r.get("step_ms"),
                 "achieved_gflops": round(gf, 2), "mfu": round(gf / peak, 4)}
    best = ""
    if r.get("step_ms_min") and r.get("step_ms"):
        tps_best = tps * r["step_ms"] / r["step_ms_min"]
        gfb = fpt * tps_best / 1e9
        res[name].update({"step_ms_min": r["step_ms_min"], "tokens_per_s_best": round(tps_best, 2),
                          "mfu_best": round(gfb / peak, 4)})
        best = f"{tps_best:10.1f} {100 * gfb / peak:7.1f}%"
    if "blas" in r:
        res[name]["blas"] = r["blas"]
    step = f"{r['step_ms']:.0f}" if r.get("step_ms") else "-"
    print(f"{name:8} {tps:10.1f} {step:>9} {gf:8.1f} {100 * gf / peak:5.1f}%   {best}")
print(f"GEMM peak (fp32, oneDNN, max of 2 runs): {peak:.1f} GFLOP/s "
      f"(runs {res['gemm_peak_gflops_runs']}); flops/token {fpt / 1e6:.2f} M")
ok = None
if "sigma" in res and "pytorch" in res:
    res["speedup_vs_pytorch"] = round(res["sigma"]["tokens_per_s"] / res["pytorch"]["tokens_per_s"], 3)
    if "tokens_per_s_best" in res["sigma"] and "tokens_per_s_best" in res["pytorch"]:
        res["speedup_vs_pytorch_best"] = round(
            res["sigma"]["tokens_per_s_best"] / res["pytorch"]["tokens_per_s_best"], 3)
    ok = res["speedup_vs_pytorch"] >= 2.0 and res["sigma"]["mfu"] >= 0.30
    res["meets_issue2_minimum"] = ok
    print(f"Sigma / PyTorch: {res['speedup_vs_pytorch']:.2f}x; "
          f"issue 2 minimum (2x and 30 % MFU): {'met' if ok else 'NOT met'}")
if note:
    res["note"] = note.strip()
    print(res["note"])
with open(os.path.join(work, "result.json"), "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res))
if check and not ok:
    sys.exit(1)
PYEOF
