# The checks and tables of examples/paper-workflow.sh (each prints a table; a failed check exits 1).
# Usage: python3 checks.py extract OUT DOMAIN...        extract loss-free, to the bit
#        python3 checks.py eval OUT                      scores of stage 7
#        python3 checks.py serve-spec OUT CTX URL KEY DOMAIN...   the requests of stage 8
#        python3 checks.py serve OUT                     served log-probabilities against sigma eval
#        python3 checks.py summary OUT SIZE              wall time per stage, OUT/summary.json
import json
import os
import struct
import sys

cmd, out = sys.argv[1], sys.argv[2]


def load(name):
    with open(os.path.join(out, name), encoding="utf-8") as f:
        return json.load(f)


def save(name, obj):
    os.makedirs(os.path.join(out, "checks"), exist_ok=True)
    with open(os.path.join(out, "checks", name), "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)


def fail(msg):
    print(f"paper-workflow: CHECK FAILED: {msg}")
    sys.exit(1)


if cmd == "extract":
    rows = []
    print("| domain | full model, held-out loss | extract, held-out loss | tokens | bit-identical |")
    print("|---|---|---|---|---|")
    for d in sys.argv[3:]:
        full = load(f"eval/heldout-full-{d}.json")["domains"][d]
        ext = load(f"eval/heldout-extract-{d}.json")["domains"][d]
        # sigma eval prints the shortest decimal that reads back to the same double: equal
        # doubles here are equal bits there.
        same = full["loss"] == ext["loss"] and full["tokens"] == ext["tokens"]
        rows.append({"domain": d, "full": full["loss"], "extract": ext["loss"], "tokens": ext["tokens"], "equal": same})
        print(f"| {d} | {full['loss']!r} | {ext['loss']!r} | {ext['tokens']} | {'yes' if same else 'NO'} |")
    save("extract.json", rows)
    bad = [r["domain"] for r in rows if not r["equal"]]
    if bad:
        fail(f"the extract's held-out loss differs from the full model's on {bad}")

elif cmd == "eval":
    dense, sparse = load("eval/heldout-dense.json")["domains"], load("eval/heldout-sparse.json")["domains"]
    inherited = load("eval/heldout-inherited.json")["domains"]
    print("held-out loss per domain (nats/token):")
    print("| domain | dense PanGu-α | PanGu-Σ inherited (step 0) | PanGu-Σ after the curriculum | tokens |")
    print("|---|---|---|---|---|")
    for d in sparse:
        print(f"| {d} | {dense[d]['loss']:.4f} | {inherited[d]['loss']:.4f} | {sparse[d]['loss']:.4f} | {sparse[d]['tokens']} |")
    before, after = load("eval/heldout-before-finetune.json")["domains"], load("eval/heldout-finetune.json")["domains"]
    print(f"held-out translation pairs, loss per token of packed windows, prompts included (sigma eval --data "
          f"does not mask prompts as fine-tuning did): bilingual extract "
          f"{before['bilingual']['loss']:.4f}, fine-tuned {after['bilingual']['loss']:.4f}")
    print("tasks (± bootstrap standard error; eval/*.json has every figure):")
    print("| task | model | items | scores |")
    print("|---|---|---|---|")
    for tag, model in [("before-finetune", "bilingual extract"), ("finetune", "fine-tuned")]:
        c = load(f"eval/choice-{tag}.json")["choice"]
        print(f"| multiple choice (4 choices) | {model} | {c['items']} | acc {c['acc']:.3f} ± {c['acc_stderr']:.3f}, "
              f"acc_norm {c['acc_norm']:.3f} ± {c['acc_norm_stderr']:.3f} |")
    for tag, model in [("before-finetune", "bilingual extract"), ("finetune", "fine-tuned")]:
        g = load(f"eval/translate-{tag}.json")["generate"]
        b = g["bleu"]["zh"]
        print(f"| translation en→zh | {model} | {g['items']} | BLEU {b['score']:.2f} ± {b['stderr']:.2f} "
              f"({b['sys_len']} hypothesis / {b['ref_len']} reference tokens), chrF {g['chrf']['score']:.2f} ± {g['chrf']['stderr']:.2f} |")
    k = load("eval/code-python.json")["code"]
    ks = ", ".join(f"{m} {k[m]:.3f}" for m in sorted(x for x in k if x.startswith("pass@") and not x.endswith("stderr")))
    print(f"| code (python) | python extract | {k['items']} x {k['samples']} samples | {ks} |")
    k = load("eval/code-java.json")["code"]
    ks = ", ".join(f"{m} {k[m]:.3f}" for m in sorted(x for x in k if x.startswith("pass@") and not x.endswith("stderr")))
    print(f"| code (java) | java extract | {k['items']} x {k['samples']} samples | {ks} |")

elif cmd == "serve-spec":
    ctx, url, key, domains = int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:]
    checks, prompts = [], []
    for d in domains:
        # window 0 of the domain's held-out shard: tokens [0, T] (docs/data.md, "Shards")
        with open(os.path.join(out, "shards-heldout", f"{d}.shard"), "rb") as f:
            head = f.read(128)
            token_bytes, n_tokens = struct.unpack_from("<I", head, 12)[0], struct.unpack_from("<Q", head, 32)[0]
            if n_tokens < ctx + 1:
                fail(f"{d}: held-out shard of {n_tokens} tokens, less than one window of {ctx + 1}")
            ids = list(struct.unpack(f"<{ctx + 1}{'H' if token_bytes == 2 else 'I'}", f.read((ctx + 1) * token_bytes)))
        ext = load(f"eval/window-extract-{d}.json")["domains"][d]
        if ext["tokens"] != ctx:
            fail(f"{d}: sigma eval of window 0 scored {ext['tokens']} tokens, not {ctx}")
        checks.append({"model": d, "domain": d, "ids": ids, "eval_loss": ext["loss"]})
        checks.append({"model": f"sparse:{d}", "domain": d, "ids": ids, "eval_loss": ext["loss"]})
        with open(os.path.join(out, "corpus-heldout", d, "heldout.jsonl"), encoding="utf-8") as f:
            text = json.loads(f.readline())["text"]
        prompts.append({"model": d, "prompt": text[:12]})
    json.dump({"base_url": url, "api_key": key, "checks": checks, "prompts": prompts}, sys.stdout)

elif cmd == "serve":
    r = load("serve-result.json")
    print(f"served models: {', '.join(r['models'])}")
    # sigma serve scores a prompt with its fast kernels, sigma eval inside ops::BatchInvariant;
    # an RRE block's experts meet other row counts in the two, which round differently
    # (docs/serving.md, "Scoring against sigma eval"): a relative 1e-6 is allowed at any context
    # (the tiny size's context-64 windows agreed to the bit on AVX-512 machines, not on Zen 3's
    # AVX2 kernels: 7e-9 to 1.5e-8 nats there).
    print("| model | tokens | served: -mean log p | sigma eval loss | difference | equal |")
    print("|---|---|---|---|---|---|")
    for c in r["checks"]:
        c["ok"] = c["equal"] or abs(c["diff"]) <= 1e-6 * abs(c["eval_loss"])
        print(f"| {c['model']} | {c['tokens']} | {c['served_loss']!r} | {c['eval_loss']!r} | {c['diff']:.3g} | "
              f"{'to the bit' if c['equal'] else 'within 1e-6 (kernel rounding)' if c['ok'] else 'NO'} |")
    for c in r["completions"]:
        print(f"  {c['model']}: {c['prompt']!r} -> {c['text']!r} ({c['finish_reason']})")
    save("serve.json", r["checks"])
    bad = [c["model"] for c in r["checks"] if not c["ok"]]
    if bad:
        fail(f"served log-probabilities differ from sigma eval's for {bad}")

elif cmd == "summary":
    size = sys.argv[3]
    stages = [line.rstrip("\n").split("\t") for line in open(os.path.join(out, "stages.tsv"))]
    total = sum(float(s) for _, s in stages)
    print(f"\nwall time per stage ({size}):")
    print("| stage | s |")
    print("|---|---|")
    for name, s in stages:
        print(f"| {name} | {float(s):.1f} |")
    print(f"| total | {total:.1f} |")
    summary = {"size": size, "stages_s": {n: float(s) for n, s in stages}, "total_s": total}
    for name in ["extract", "serve"]:
        p = os.path.join(out, "checks", f"{name}.json")
        if os.path.exists(p):
            summary[name] = json.load(open(p))
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    print(f"everything is in {out} (logs/, eval/, checks/, summary.json)")

else:
    fail(f"unknown command {cmd}")
