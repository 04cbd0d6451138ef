# Stage 0 of examples/paper-workflow.sh: the held-out split and the task files, from the corpus.
# Usage: python3 split.py CORPUS OUT TRAIN_KB HELD_KB FT_PAIRS TASK_ITEMS
#   Per domain: the first 95 % of train.jsonl's lines to train on, the last 5 % held out (as
#   docs/data.md), except bilingual: a pair is held out when the sha1 of its English sentence
#   is 1 mod 20 (the file is sorted by length); TRAIN_KB / HELD_KB > 0 keep only a prefix of that many KiB of each part
#   (whole lines, at least one). ../shared/data's own held-out set is not in shared/, so the
#   held-out text here is the end of each domain's file.
# Writes OUT/corpus-train/D/train.jsonl, OUT/corpus-heldout/D/heldout.jsonl,
#   OUT/corpus-ft/{train,heldout}.jsonl: bilingual pairs as fine-tuning samples
#   ({"domain": "bilingual", "prompt": English, "answer": Chinese}; FT_PAIRS > 0 caps the
#   training pairs), and from the first TASK_ITEMS held-out pairs
#   OUT/tasks/choice-bilingual.jsonl (pick the Chinese translation of an English sentence among
#   4: a right one and the translations of 3 other held-out sentences) and
#   OUT/tasks/translate-en-zh.jsonl (BLEU with sacrebleu's zh tokeniser, chrF; every held-out
#   translation of the sentence is a reference). Items are TASK_ITEMS English sentences spread
#   evenly through the held-out pairs; each item's "id" is its pairs' Tatoeba attribution
#   (CC BY 2.0 FR requires it).
import hashlib
import json
import os
import sys

corpus, out, train_kb, held_kb, ft_pairs, task_items = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
DOMAINS = ["english", "chinese", "poetry", "bilingual", "python", "java"]


def prefix(lines, kb):
    if kb <= 0:
        return lines
    kept, size = [], 0
    for line in lines:
        if kept and size + len(line.encode()) > kb * 1024:
            break
        kept.append(line)
        size += len(line.encode())
    return kept


def write(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


parts = {}
for d in DOMAINS:
    with open(os.path.join(corpus, d, "train.jsonl"), encoding="utf-8") as f:
        lines = f.readlines()
    if d == "bilingual":
        # The file runs from the shortest pair to the longest: its last 5 % would be only the
        # longest sentences. A pair is held out by a hash of its English side instead, so all
        # translations of one sentence fall on one side (shared/data's own held-out rule used
        # % 10 == 0, so none of those are left here).
        out_ = [int(hashlib.sha1(json.loads(x)["text"].split("\n", 1)[0].encode()).hexdigest()[:8], 16) % 20 == 1
                for x in lines]
        train = [x for x, o in zip(lines, out_) if not o]
        held = [x for x, o in zip(lines, out_) if o]
    else:
        h = len(lines) // 20
        train, held = lines[:len(lines) - h], lines[len(lines) - h:]
    train, held = prefix(train, train_kb), prefix(held, held_kb)
    write(f"{out}/corpus-train/{d}/train.jsonl", train)
    write(f"{out}/corpus-heldout/{d}/heldout.jsonl", held)
    parts[d] = (train, held)
    mb = lambda ls: sum(len(x.encode()) for x in ls) / 1e6
    print(f"  {d:9s} train {len(train):6d} records {mb(train):6.2f} MB   held-out {len(held):5d} records {mb(held):5.2f} MB")


def pairs(lines):
    for line in lines:
        r = json.loads(line)
        en, zh = r["text"].split("\n", 1)  # every bilingual record is English\nChinese (README)
        yield en, zh, r["attribution"]


train_pairs = list(pairs(parts["bilingual"][0]))
if ft_pairs > 0:
    train_pairs = train_pairs[:ft_pairs]
held_pairs = list(pairs(parts["bilingual"][1]))
ft = lambda ps: [json.dumps({"domain": "bilingual", "prompt": en, "answer": zh}, ensure_ascii=False) + "\n"
                 for en, zh, _ in ps]
write(f"{out}/corpus-ft/train.jsonl", ft(train_pairs))
write(f"{out}/corpus-ft/heldout.jsonl", ft(held_pairs))

# One item per English sentence (its translations are its references), spread evenly
# through the held-out pairs, which run from short to long.
groups = {}
for en, zh, who in held_pairs:
    g = groups.setdefault(en, ([], []))
    g[0].append(zh)
    g[1].append(who)
groups = list(groups.items())
picked = [groups[i * len(groups) // task_items] for i in range(min(task_items, len(groups)))]
choice, translate = [], []
for i, (en, (zhs, whos)) in enumerate(picked):
    # distractors: the translations of the next picked sentences
    wrong = []
    for _, (zhs2, _) in picked[i + 1:] + picked[:i]:
        if zhs2[0] not in zhs and zhs2[0] not in wrong:
            wrong.append(zhs2[0])
        if len(wrong) == 3:
            break
    answer = i % 4
    ident = "tatoeba " + "; ".join(whos)
    choice.append({"id": ident, "type": "choice", "domain": "bilingual", "context": en,
                   "choices": wrong[:answer] + [zhs[0]] + wrong[answer:], "answer": answer})
    translate.append({"id": ident, "type": "generate", "domain": "bilingual", "prompt": en,
                      "references": zhs, "tokenize": "zh"})
write(f"{out}/tasks/choice-bilingual.jsonl", [json.dumps(x, ensure_ascii=False) + "\n" for x in choice])
write(f"{out}/tasks/translate-en-zh.jsonl", [json.dumps(x, ensure_ascii=False) + "\n" for x in translate])
print(f"  fine-tuning pairs: {len(train_pairs)} to train, {len(held_pairs)} held out; "
      f"tasks: {len(choice)} multiple-choice, {len(translate)} translation items from held-out pairs")
