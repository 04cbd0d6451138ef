# Stage 0 of examples/paper-workflow.sh: the held-out split and the task files, from the corpus.
# Usage: python3 split.py CORPUS OUT TRAIN_KB HELD_KB FT_PAIRS TASK_ITEMS
#   Per domain: the first 95 % of train.jsonl's lines to train on, the last 5 % held out (as
#   docs/data.md); TRAIN_KB / HELD_KB > 0 keep only a prefix of that many KiB of each part
#   (whole lines, at least one). ../shared/data's own held-out set is not in shared/, so the
#   held-out text here is the end of each domain's file.
# Writes OUT/corpus-train/D/train.jsonl, OUT/corpus-heldout/D/heldout.jsonl,
#   OUT/corpus-ft/{train,heldout}.jsonl: bilingual pairs as fine-tuning samples
#   ({"domain": "bilingual", "prompt": English, "answer": Chinese}; FT_PAIRS > 0 caps the
#   training pairs), and from the first TASK_ITEMS held-out pairs
#   OUT/tasks/choice-bilingual.jsonl (pick the Chinese translation of an English sentence among
#   4: the right one and the translations of 3 other held-out sentences) and
#   OUT/tasks/translate-en-zh.jsonl (BLEU with sacrebleu's zh tokeniser, chrF). Each task item's
#   "id" is the pair's Tatoeba attribution (CC BY 2.0 FR requires it).
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
    h = len(lines) // 20
    train, held = prefix(lines[:len(lines) - h], train_kb), prefix(lines[len(lines) - h:], held_kb)
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

items = held_pairs[:task_items]
choice, translate = [], []
for i, (en, zh, who) in enumerate(items):
    # distractors: the next held-out pairs' translations of other English sentences
    wrong = []
    for en2, zh2, _ in held_pairs[i + 1:] + held_pairs[:i]:
        if en2 != en and zh2 != zh and zh2 not in wrong:
            wrong.append(zh2)
        if len(wrong) == 3:
            break
    answer = i % 4
    choices = wrong[:answer] + [zh] + wrong[answer:]
    choice.append({"id": f"tatoeba {who}", "type": "choice", "domain": "bilingual",
                   "context": en, "choices": choices, "answer": answer})
    translate.append({"id": f"tatoeba {who}", "type": "generate", "domain": "bilingual",
                      "prompt": en, "references": [zh], "tokenize": "zh"})
write(f"{out}/tasks/choice-bilingual.jsonl", [json.dumps(x, ensure_ascii=False) + "\n" for x in choice])
write(f"{out}/tasks/translate-en-zh.jsonl", [json.dumps(x, ensure_ascii=False) + "\n" for x in translate])
print(f"  fine-tuning pairs: {len(train_pairs)} to train, {len(held_pairs)} held out; "
      f"tasks: {len(choice)} multiple-choice, {len(translate)} translation items from held-out pairs")
