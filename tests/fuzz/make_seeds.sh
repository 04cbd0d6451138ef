#!/usr/bin/env bash
# Regenerates the binary seed inputs of tests/fuzz/corpus/ with a sigma binary (the text seeds
# are written by hand). Usage: tests/fuzz/make_seeds.sh build/sigma
set -euo pipefail
sigma=$(realpath "$1")
corpus=$(cd "$(dirname "$0")" && pwd)/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
for i in $(seq 1 30); do
  echo "{\"domain\": \"en\", \"text\": \"the cat $i sat on the mat\"}"
  echo "{\"domain\": \"py\", \"text\": \"def f$i(x):\\n    return x + $i\"}"
done > c.jsonl
"$sigma" tokenizer train --corpus c.jsonl --vocab-size 300 --out tok.json >/dev/null
cp tok.json "$corpus/tokenizer_json/small.json"
echo '{"tokenizer": "tok.json", "corpus": ["c.jsonl"], "domains": [{"name": "en"}, {"name": "py", "slot": 1, "prefix": ["<Python>"]}]}' > data.json
"$sigma" prepare --config data.json --out shards >/dev/null 2>&1
cp shards/py.shard "$corpus/shard/py.shard"
cp shards/manifest.json "$corpus/config/shards-manifest.json"
"$sigma" train --quiet --set model.d_model=8 --set model.heads=2 --set model.layers=2 \
  --set model.context=4 --set model.rre_layers=0 --set 'model.groups=[]' --set train.steps=1 \
  --set train.batch=1 --set train.eval_rows=1 --out run >/dev/null
ck=run/checkpoints/step-00000001
cp "$ck/optimizer.safetensors" "$corpus/safetensors/optimizer.safetensors"
"$sigma" train --print-config > "$corpus/config/train.json"
# A manifest valid for the fuzz target's directory, which holds model.safetensors = "0123456789".
printf '#include <xxhash.h>\n#include <cstdio>\nint main(){std::printf("%%016llx", (unsigned long long)XXH3_64bits("0123456789", 10));}\n' > h.cpp
g++ h.cpp -o h -lxxhash
printf '{"format": "sigma-checkpoint", "version": 1, "files": {"model.safetensors": {"size": 10, "xxh3_64": "%s"}}}\n' "$(./h)" \
  > "$corpus/manifest/valid.json"
cp "$ck/manifest.json" "$corpus/manifest/real.json"
