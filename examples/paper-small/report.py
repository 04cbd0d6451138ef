# The tables of examples/paper-small.sh, in Markdown on stdout, from OUT/runs and OUT/eval.
# Usage: python3 report.py OUT STEPS SEED...
# Also writes OUT/curves.dat and OUT/curves.gp (held-out loss against training tokens, mean
# over seeds; `gnuplot OUT/curves.gp` makes OUT/curves.svg).
#
# Spread: mean ± sample standard deviation over the seeds, and [min, max]. A difference between
# two models is the mean of the per-seed (paired) differences ± their standard deviation; with
# t = |mean| / (sd / sqrt(n)) it is called "real" when every seed has its sign and t passes
# Student's two-sided 95 % point (4.30 for 3 seeds), "likely" when every seed has its sign and
# t > 2, and "noise" otherwise.
import json
import math
import os
import statistics
import sys

out, S, seeds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
HALF = S // 2
DOMAINS = ["english", "chinese", "poetry", "bilingual", "python", "java"]
TOK_PER_STEP = 8 * 128


def jload(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def metrics(run):
    path = os.path.join(out, "runs", run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def done(run):
    return os.path.exists(os.path.join(out, "runs", run, "summary.json"))


def final(run):  # held-out loss per domain at the end of the run
    return {d: v["loss"] for d, v in jload(os.path.join(out, "runs", run, "summary.json"))["domains"].items()}


def mean_dom(losses):
    return sum(losses[d] for d in DOMAINS) / len(DOMAINS)


def spread(xs, fmt="{:.3f}", unit="seed"):
    if not xs:
        return "—"
    if len(xs) == 1:
        return fmt.format(xs[0]) + f" (1 {unit})"
    m, sd = statistics.mean(xs), statistics.stdev(xs)
    return f"{fmt.format(m)} ± {fmt.format(sd)} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


# Student's t, two-sided 95 %, by degrees of freedom (n - 1 for n seeds).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def diff(a, b, fmt="{:+.3f}"):
    """a - b per seed (paired): mean ± sd, and whether it exceeds the noise."""
    d = [x - y for x, y in zip(a, b)]
    if len(d) < 2:
        return (fmt.format(d[0]) + " (1 seed)") if d else "—"
    m, sd = statistics.mean(d), statistics.stdev(d)
    se = sd / math.sqrt(len(d))
    agree = all(x > 0 for x in d) or all(x < 0 for x in d)
    t = abs(m) / se if se > 0 else math.inf
    verdict = "real" if agree and t > T95[len(d) - 1] else "likely" if agree and t > 2 else "noise"
    return f"{fmt.format(m)} ± {sd:.3f} ({verdict})"


def run_seeds(prefix):
    return [s for s in seeds if done(f"{prefix}-{s}")]


def clean_rate(run, step0=0):
    """tokens/s over the logging windows that held no evaluation (an eval runs inside the
    record that shows it, so it lands in the next window), the first window left out."""
    recs = metrics(run)
    t, toks = [], []
    for r in recs:
        n = (r["step"] - step0) * TOK_PER_STEP
        t.append(n / r["tokens_per_s"] if r["tokens_per_s"] > 0 else 0.0)
        toks.append(n)
    num = den = 0.0
    for i in range(1, len(recs)):
        if "held_out" in recs[i - 1]:
            continue
        num += toks[i] - toks[i - 1]
        den += t[i] - t[i - 1]
    return num / den if den > 0 else float("nan")


def curve(run, offset_steps=0):
    return [((r["step"] + offset_steps) * TOK_PER_STEP, mean_dom(r["held_out"]))
            for r in metrics(run) if "held_out" in r and all(d in r["held_out"] for d in DOMAINS)]


def first_reach(points, target):
    """Training tokens at which a curve first reaches `target` (linear between evaluations)."""
    prev = None
    for x, y in points:
        if y <= target:
            if prev is None:
                return x
            (x0, y0) = prev
            return x0 + (x - x0) * (y0 - target) / (y0 - y) if y0 != y else x
        prev = (x, y)
    return None


def load_txt(run):
    p = os.path.join(out, "runs", run, "load.txt")
    if not os.path.exists(p):
        return ""
    lines = dict(x.split(" ", 1) for x in open(p).read().splitlines() if " " in x)
    return f"{lines.get('start', '?').split()[0]} → {lines.get('end', '?').split()[0]}"


print("# Paper claims at small scale: results\n")
print("```")
print(open(os.path.join(out, "machine.txt")).read().strip())
print("```\n")

# ---- 1. routing ----------------------------------------------------------------------------
VARIANTS = [("dense", "dense (PanGu-α)"), ("rre", "RRE (PanGu-Σ)"), ("top1", "learned top-1"), ("top2", "learned top-2")]
print(f"## 1. RRE against dense and learned gates ({S} steps of {TOK_PER_STEP} tokens, from scratch)\n")
have = {v: run_seeds(v) for v, _ in VARIANTS}
common = [s for s in seeds if all(s in have[v] for v, _ in VARIANTS)]
print(f"Seeds with all four models: {', '.join(common) or 'none'}. Held-out loss (nats/token), "
      f"mean ± sd [min, max] over the seeds:\n")
print("| domain | " + " | ".join(n for _, n in VARIANTS) + " |")
print("|---|" + "---|" * len(VARIANTS))
fin = {v: {s: final(f"{v}-{s}") for s in common} for v, _ in VARIANTS}
for d in DOMAINS + ["mean"]:
    cells = []
    for v, _ in VARIANTS:
        xs = [mean_dom(fin[v][s]) if d == "mean" else fin[v][s][d] for s in common]
        cells.append(spread(xs))
    print(f"| {'**mean of 6**' if d == 'mean' else d} | " + " | ".join(cells) + " |")
print("\nPaired differences against RRE (other − RRE; negative: the other is better):\n")
print("| domain | dense − RRE | top-1 − RRE | top-2 − RRE |")
print("|---|---|---|---|")
for d in DOMAINS + ["mean"]:
    get = (lambda v: [mean_dom(fin[v][s]) if d == "mean" else fin[v][s][d] for s in common])
    print(f"| {'**mean of 6**' if d == 'mean' else d} | " + " | ".join(diff(get(v), get("rre")) for v in ["dense", "top1", "top2"]) + " |")

print("\nTraining throughput of these runs (tokens/s over the logging windows without an "
      "evaluation; the runs ran two at a time, one thread each, beside other jobs):\n")
print("| model | tokens/s | load average (1 min) at start → end, per seed |")
print("|---|---|---|")
for v, n in VARIANTS:
    rates = [clean_rate(f"{v}-{s}") for s in have[v]]
    print(f"| {n} | {spread(rates, '{:.0f}')} | {'; '.join(load_txt(f'{v}-{s}') for s in have[v])} |")

rounds = sorted({r.rsplit("-", 1)[1] for r in os.listdir(os.path.join(out, "runs")) if r.startswith("tp-")}, key=int)
rounds = [r for r in rounds if all(done(f"tp-{v}-{r}") for v, _ in VARIANTS)]
if rounds:
    print(f"\nSide by side: five runs trained at the same time (one thread each), "
          f"{len(rounds)} round(s); tokens/s over the last three quarters of each run (RRE by ECSS as train.experts = auto chooses, and with its experts in the model), and the ratio to dense in the same round:\n")
    print("| model | " + " | ".join(f"round {r}" for r in rounds) + " | ratio to dense |")
    print("|---|" + "---|" * (len(rounds) + 1))
    TPV = VARIANTS[:2] + [("rremodel", "RRE, experts in the model (train.experts = model)")] + VARIANTS[2:]
    TPV = [(v, n) for v, n in TPV if all(done(f"tp-{v}-{r}") for r in rounds)]
    rates = {v: [clean_rate(f"tp-{v}-{r}") for r in rounds] for v, _ in TPV}
    for v, n in TPV:
        ratios = [a / b for a, b in zip(rates[v], rates["dense"])]
        print(f"| {n} | " + " | ".join(f"{x:.0f}" for x in rates[v]) + f" | {spread(ratios, '{:.2f}', 'round')} |")
    print("\nLoad average at the start → end of each round: " +
          "; ".join(load_txt(f"tp-dense-{r}") for r in rounds))

ins = {k: jload(os.path.join(out, "eval", f"inspect-{k}.json"))["parameters"]
       for k in ["dense", "rre", "top1", "top2", "curriculum"] + [f"extract-{d}" for d in DOMAINS]
       if os.path.exists(os.path.join(out, "eval", f"inspect-{k}.json"))}
if ins:
    print("\nParameters (`sigma inspect`): in total and active per token:\n")
    print("| model | total | active per token | in experts |")
    print("|---|---|---|---|")
    names = dict(VARIANTS, curriculum="RRE after inherit + curriculum", **{f"extract-{d}": f"its {d} extract" for d in DOMAINS})
    for k, p in ins.items():
        print(f"| {names[k]} | {p['total']:,} | {p['active_per_token']:,} | {p['experts']:,} |")

# Expert load (first seed): the most-loaded expert's share over the fair share, worst group.
print("\nExpert load over the whole run (first seed with all four): max / mean tokens per expert "
      "inside a group, the worst group, per RRE block; tokens dropped by the gate's capacity:\n")
print("| model | block: imbalance | dropped (token, choice) pairs |")
print("|---|---|---|")
if common:
    s = common[0]
    for v, n in VARIANTS[1:]:
        sm = jload(os.path.join(out, "runs", f"{v}-{s}", "summary.json"))
        imb = ", ".join(f"{b}: {x:.2f}" for b, x in sm.get("load_imbalance", {}).items())
        print(f"| {n} | {imb} | {sm.get('dropped', '—')} |")

# ---- 2. inherit ----------------------------------------------------------------------------
print(f"\n## 2. Inheriting from the dense model against training from scratch\n")
inh = [s for s in seeds if done(f"mixed-{s}") and done(f"rre-{s}") and done(f"dense-{s}")]
print(f"Inherited: dense {HALF} steps, `sigma inherit`, then RRE {HALF} steps (one mixed stage); "
      f"scratch: RRE {S} steps; dense: {S} steps. Equal training tokens in all three "
      f"({S * TOK_PER_STEP:,}). Seeds: {', '.join(inh) or 'none'}.\n")
print("| domain | dense | RRE from scratch | RRE inherited | inherited − scratch |")
print("|---|---|---|---|---|")
fi = {k: {s: final(f"{k}-{s}") for s in inh} for k in ["dense", "rre", "mixed"]}
for d in DOMAINS + ["mean"]:
    get = (lambda k: [mean_dom(fi[k][s]) if d == "mean" else fi[k][s][d] for s in inh])
    print(f"| {'**mean of 6**' if d == 'mean' else d} | {spread(get('dense'))} | {spread(get('rre'))} | "
          f"{spread(get('mixed'))} | {diff(get('mixed'), get('rre'))} |")
print("\nTokens to reach the same held-out loss (mean of the six domains), per seed. "
      "*target*: the scratch run's loss at its end; *inherited*: the tokens the inherited run needed "
      "to reach it, counted with the dense tokens before it (total) and without them (sparse only):\n")
print("| seed | scratch at end | inherited reaches it at, total tokens | sparse tokens only | scratch reaches the inherited start (dense at half) at | scratch reaches the inherited end at | equal sparse tokens: scratch at half → inherited at end |")
print("|---|---|---|---|---|---|---|")
def half_scratch(sc):
    v = [y for x, y in sc if x == HALF * TOK_PER_STEP]
    return f"{v[0]:.3f}" if v else "—"


for s in inh:
    sc = curve(f"rre-{s}")
    dense_half = [y for x, y in curve(f"dense-{s}") if x == HALF * TOK_PER_STEP]
    ih = ([(HALF * TOK_PER_STEP, dense_half[0])] if dense_half else []) + curve(f"mixed-{s}", HALF)
    target = sc[-1][1] if sc else None
    reach = first_reach(ih, target) if target is not None else None
    back = first_reach(sc, dense_half[0]) if dense_half else None
    fmt_t = lambda x: "not reached" if x is None else f"{x:,.0f}"
    print(f"| {s} | {target:.3f} | {fmt_t(reach)} | {fmt_t(None if reach is None else reach - HALF * TOK_PER_STEP)} | "
          f"{fmt_t(back)} | {fmt_t(first_reach(sc, ih[-1][1]))} | {half_scratch(sc)} → {ih[-1][1]:.3f} |")

hs = [s for s in inh if done(f"rrehalf-{s}")]
if hs:
    print(f"\nAt equal sparse tokens ({HALF} RRE steps each, each with its own full learning-rate "
          f"schedule): RRE from scratch against RRE inherited from the dense model at {HALF} steps. "
          f"Seeds: {', '.join(hs)}.\n")
    print("| domain | RRE from scratch, half | RRE inherited | inherited − scratch |")
    print("|---|---|---|---|")
    fh = {s: final(f"rrehalf-{s}") for s in hs}
    for d in DOMAINS + ["mean"]:
        a = [mean_dom(fh[s]) if d == "mean" else fh[s][d] for s in hs]
        b = [mean_dom(fi["mixed"][s]) if d == "mean" else fi["mixed"][s][d] for s in hs]
        print(f"| {'**mean of 6**' if d == 'mean' else d} | {spread(a)} | {spread(b)} | {diff(b, a)} |")

# ---- 3. curriculum -------------------------------------------------------------------------
cur = [s for s in seeds if done(f"curriculum-{s}") and done(f"mixed-{s}")]
print(f"\n## 3. Two-stage curriculum against one mixed stage (after inheriting; {HALF} steps)\n")
print(f"Stage 1 ({HALF // 3} steps): english, chinese, bilingual, python, java; stage 2: all six "
      f"(poetry joins). Seeds: {', '.join(cur) or 'none'}.\n")
print("| domain | one mixed stage | curriculum | curriculum − mixed |")
print("|---|---|---|---|")
fc = {k: {s: final(f"{k}-{s}") for s in cur} for k in ["mixed", "curriculum"]}
for d in DOMAINS + ["mean"]:
    get = (lambda k: [mean_dom(fc[k][s]) if d == "mean" else fc[k][s][d] for s in cur])
    print(f"| {'**mean of 6**' if d == 'mean' else d} | {spread(get('mixed'))} | {spread(get('curriculum'))} | "
          f"{diff(get('curriculum'), get('mixed'))} |")

curpg = [s for s in seeds if done(f"curriculumpg-{s}") and done(f"mixedpg-{s}")]
if curpg:
    print(f"\nThe same with poetry in its own expert group (2 experts per block, "
          f"`examples/paper-small/sparse-poetry.json`), whose experts stage 1 leaves untrained, as "
          f"the paper's stage 1 does the other domains' experts. Seeds: {', '.join(curpg)}.\n")
    print("| domain | one mixed stage | curriculum | curriculum − mixed |")
    print("|---|---|---|---|")
    fp = {k: {s: final(f"{k}-{s}") for s in curpg} for k in ["mixedpg", "curriculumpg"]}
    for d in DOMAINS + ["mean"]:
        get = (lambda k: [mean_dom(fp[k][s]) if d == "mean" else fp[k][s][d] for s in curpg])
        print(f"| {'**mean of 6**' if d == 'mean' else d} | {spread(get('mixedpg'))} | {spread(get('curriculumpg'))} | "
              f"{diff(get('curriculumpg'), get('mixedpg'))} |")

# ---- 4. extract ----------------------------------------------------------------------------
print("\n## 4. Extraction loss-free\n")
print("Each domain's sub-model of each curriculum model against the full model on that domain's "
      "held-out windows (`sigma eval --json`: the shortest decimal that reads back to the same "
      "double, so equal here is equal bits):\n")
print("| seed | domain | full model | extract | tokens | bit-identical |")
print("|---|---|---|---|---|---|")
n_eq = n_all = 0
for s in seeds:
    for d in DOMAINS:
        pf, pe = os.path.join(out, "eval", f"full-{s}-{d}.json"), os.path.join(out, "eval", f"extract-{s}-{d}.json")
        if not (os.path.exists(pf) and os.path.exists(pe)):
            continue
        f, e = jload(pf)["domains"][d], jload(pe)["domains"][d]
        same = f["loss"] == e["loss"] and f["tokens"] == e["tokens"]
        n_all += 1
        n_eq += same
        print(f"| {s} | {d} | {f['loss']!r} | {e['loss']!r} | {f['tokens']} | {'yes' if same else 'NO'} |")
print(f"\n{n_eq} of {n_all} bit-identical.")

# ---- curves for gnuplot --------------------------------------------------------------------
series = [("dense", "dense", 0), ("rre", "RRE, scratch", 0), ("rrehalf", "RRE, scratch, half the steps", 0), ("top1", "top-1 gate", 0), ("top2", "top-2 gate", 0),
          ("mixed", "RRE inherited at half", HALF), ("curriculum", "RRE inherited + curriculum", HALF)]
with open(os.path.join(out, "curves.dat"), "w") as f:
    for i, (k, title, off) in enumerate(series):
        cs = [curve(f"{k}-{s}", off) for s in seeds if done(f"{k}-{s}")]
        if not cs:
            cs = [[]]
        f.write(f'# "{title}" ({len([c for c in cs if c])} seeds)\n')
        n = min(len(c) for c in cs)
        for j in range(n):
            ys = [c[j][1] for c in cs]
            sd = statistics.stdev(ys) if len(ys) > 1 else 0.0
            f.write(f"{cs[0][j][0] / 1e3:.1f} {statistics.mean(ys):.5f} {sd:.5f}\n")
        f.write("\n\n")
with open(os.path.join(out, "curves.gp"), "w") as f:
    f.write(f"""set terminal svg size 800,480 dynamic font "sans,11"
set output "{out}/curves.svg"
set xlabel "training tokens (thousands; inherited runs include the dense half)"
set ylabel "held-out loss, mean of 6 domains (nats/token)"
set key top right
set grid
plot """ + ", \\\n     ".join(f'"{out}/curves.dat" index {i} using 1:2:3 with yerrorlines title "{t}"'
                             for i, (_, t, _) in enumerate(series)) + "\n")
