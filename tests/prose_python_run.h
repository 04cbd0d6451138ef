// A training run on prepared shards of two tiny text domains, prose and python (python with its
// <Python> prefix, one expert group each): the serve tests that need checkpoints carrying a
// tokenizer and a data registry share it.
#pragma once
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_util.h"

namespace sigma::testing {

// Writes a corpus, trains a `vocab`-id tokenizer, prepares shards in `dir`, then runs
// `sigma train` with `train_sets` (model sizes, steps, ...) into dir/run. Returns "" on
// success, else the failing command's output.
inline std::string make_prose_python_run(const TempDir& dir, int vocab, const std::string& train_sets) {
  using nlohmann::json;
  std::ofstream c(dir / "corpus.jsonl");
  for (int i = 0; i < 6; ++i) {
    c << json{{"domain", "prose"}, {"text", "the cat is sleeping and the dog runs fast."}}.dump() << "\n";
    c << json{{"domain", "python"}, {"text", "def add(a, b):\n    return a + b\n"}}.dump() << "\n";
  }
  c.close();
  CmdResult r = sigma_cmd("tokenizer train --corpus " + dir / "corpus.jsonl" + " --vocab-size " +
                          std::to_string(vocab) + " --out " + dir / "tok.json");
  if (r.code != 0) return r.out;
  std::ofstream(dir / "data.json") << json{
      {"tokenizer", "tok.json"}, {"corpus", {"corpus.jsonl"}},
      {"domains", {{{"name", "prose"}}, {{"name", "python"}, {"prefix", {"<Python>"}}}}}}.dump();
  r = sigma_cmd("prepare --config " + dir / "data.json" + " --out " + dir / "shards");
  if (r.code != 0) return r.out;
  r = sigma_cmd("train --quiet --set data.source=shards --set data.path=" + dir / "shards" +
                " --set 'model.groups=[{\"name\":\"prose\",\"experts\":1},{\"name\":\"python\","
                "\"experts\":1}]' " + train_sets + " --out " + dir / "run");
  return r.code == 0 ? "" : r.out;
}

}  // namespace sigma::testing
