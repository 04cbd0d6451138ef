// `sigma train --resume` on shards of another tokenizer (issue 39, trap 1): refused as `sigma
// eval` refuses them, naming both tokenizers and the commands that fix it, both for a data.path
// pointed at other shards of the same vocabulary size and for a checkpoint whose vocabulary
// `sigma inherit --tokenizer` grew while its data.path still names the old shards.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "data/tokenizer.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

std::string hex(const std::string& tokenizer) {
  return fmt::format("{:016x}", data::Tokenizer::load(tokenizer).hash());
}

// Tokenizers "a" (300 ids), "b" (300 ids, trained on other text: other merges) and "big" (380
// ids, grown from "a": same corpus), shards of each, and a dense model trained on "a".
class ResumeTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir = new TempDir("resume-tok");
    const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to",
                           "house", "garden", "quickly", "slowly", "under", "over"};
    std::ofstream c(*dir / "corpus.jsonl"), o(*dir / "other.jsonl");
    for (int i = 0; i < 200; ++i) {
      std::string s;
      for (int w = 0; w < 12; ++w) s += std::string(w ? " " : "") + words[(i * 7 + w * (i % 5 + 1)) % 16];
      c << nlohmann::json{{"domain", "prose"}, {"text", s + "."}}.dump() << "\n";
      o << nlohmann::json{{"domain", "prose"}, {"text", "zebra yak quiz " + std::to_string(i) + " " + s}}.dump()
        << "\n";
    }
    c.close();
    o.close();
    for (auto [name, corpus, vocab] : {std::tuple{"a", "corpus", 300}, std::tuple{"b", "other", 300},
                                       std::tuple{"big", "corpus", 380}}) {
      auto r = sigma_cmd(fmt::format("tokenizer train --corpus {} --vocab-size {} --out {}",
                                     *dir / (std::string(corpus) + ".jsonl"), vocab,
                                     *dir / (std::string(name) + ".json")));
      ASSERT_EQ(r.code, 0) << r.out;
      std::ofstream(*dir / (std::string(name) + "-data.json")) << nlohmann::json{
          {"tokenizer", std::string(name) + ".json"},
          {"corpus", {"corpus.jsonl"}},
          {"domains", {{{"name", "prose"}, {"group", "prose"}, {"slot", 0}}}}}.dump();
      r = sigma_cmd("prepare --config " + *dir / (std::string(name) + "-data.json") + " --out " +
                    *dir / (std::string(name) + "-shards"));
      ASSERT_EQ(r.code, 0) << r.out;
    }
    ASSERT_NE(hex(*dir / "a.json"), hex(*dir / "b.json"));
    auto r = sigma_cmd("train --quiet --set data.source=shards --set data.path=" + *dir / "a-shards" +
                       " --set model.d_model=32 --set model.heads=2 --set model.layers=2"
                       " --set model.context=16 --set model.rre_layers=0 --set train.batch=4"
                       " --set train.steps=4 --set train.eval_rows=4 --out " + *dir / "dense");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { delete dir; }
  static TempDir* dir;
};
TempDir* ResumeTokenizer::dir = nullptr;

}  // namespace

// Shards of another tokenizer of the same size: eval and train both refuse, with the same
// sentence naming both tokenizers; nothing is trained or written.
TEST_F(ResumeTokenizer, OtherShardsOfTheSameSizeAreRefusedLikeEvalRefusesThem) {
  const std::string ck = *dir / "dense/checkpoints/step-00000004";
  auto r = sigma_cmd("train --quiet --resume " + *dir / "dense/checkpoints" + " --set train.steps=8"
                     " --set data.path=" + *dir / "b-shards --out " + *dir / "dense");
  EXPECT_NE(r.code, 0) << r.out;
  for (const std::string& part :
       {"the shards of " + *dir / "b-shards" + " were made by the tokenizer " + *dir / "b.json" +
            " (hash " + hex(*dir / "b.json") + ", 300 ids)",
        "its tokenizer " + ck + "/tokenizer.json (hash " + hex(*dir / "a.json") + ", 300 ids)",
        std::string("the same id is another string"), std::string("sigma prepare --config DATA.json"),
        "sigma train --resume " + ck + " --set data.path=NEW_SHARDS"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  EXPECT_FALSE(fs::exists(*dir / "dense/checkpoints/step-00000008"));

  r = sigma_cmd("eval --ckpt " + *dir / "dense/checkpoints" + " --data " + *dir / "b-shards");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("were made by the tokenizer " + *dir / "b.json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("evaluate on held-out text prepared with the checkpoint's tokenizer"),
            std::string::npos) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "dense/checkpoints" + " --data " + *dir / "a-shards");
  EXPECT_EQ(r.code, 0) << r.out;
}

// inherit --tokenizer grows the vocabulary and keeps the dense run's data.path: a plain resume
// is refused with the fix; on shards of the grown tokenizer it trains.
TEST_F(ResumeTokenizer, AGrownVocabularyIsNotTrainedOnTheOldShards) {
  auto r = sigma_cmd("inherit --from " + *dir / "dense/checkpoints" + " --tokenizer " + *dir / "big.json" +
                     " --set model.rre_layers=1 --set 'model.groups=[{\"name\":\"prose\","
                     "\"experts\":2}]' --out " + *dir / "grown");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train --quiet --resume " + *dir / "grown" + " --set train.steps=6 --out " + *dir / "g1");
  EXPECT_NE(r.code, 0) << r.out;
  for (const std::string& part :
       {fmt::format("the checkpoint's vocabulary, {} ids, was grown by sigma inherit --tokenizer",
                    data::Tokenizer::load(*dir / "big.json").vocab_size()),
        "data.path = " + *dir / "a-shards" + " still holds the old tokenizer's shards",
        "set \"tokenizer\" to (a copy of) " + *dir / "grown/step-00000000/tokenizer.json",
        "sigma train --resume " + *dir / "grown/step-00000000" + " --set data.path=NEW_SHARDS"})
    EXPECT_NE(r.out.find(part), std::string::npos) << part << "\n" << r.out;
  EXPECT_FALSE(fs::exists(*dir / "g1/checkpoints"));
  r = sigma_cmd("train --quiet --resume " + *dir / "grown" + " --set train.steps=6 --set data.path=" +
                *dir / "big-shards --out " + *dir / "g2");
  EXPECT_EQ(r.code, 0) << r.out;
}
