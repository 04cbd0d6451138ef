// Rolling log-likelihood (issue 39 item 11): a "rolling" task item's text scored token by token
// in disjoint windows, reported as nats, bits per byte and byte / word / token perplexity. The
// figures are checked exactly against a sum made by hand from the same windows scored as
// multiple-choice items; the byte count is the text's, whatever the tokenizer. And several
// --task files in one run, each result as self-describing as a single task's.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>

#include "cli_util.h"
#include "data/shards.h"
#include "data/tokenizer.h"
#include "data/windows.h"
#include "test_util.h"

using namespace sigma::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Digits never occur in the tokenizer's corpus, so each is a token of its own and no merge
// joins them: the windows' token boundaries are known (one per character).
const std::string kDigits = "01234567890123456789012345678901234567890123456789012345678901234567890123456789";
const std::string kMixed = "The cat sleeps. 猫在睡觉。\nThe dog runs fast.";

class Rolling : public ::testing::Test {
 public:
  // Two tiny models (context 32) on the same text with tokenizers of 320 and 290 entries.
  static void SetUpTestSuite() {
    dir = new TempDir("rolling");
    std::ofstream c(*dir / "corpus.jsonl");
    for (int i = 0; i < 6; ++i) {
      c << json{{"domain", "prose"}, {"text", "the cat is sleeping and the dog runs fast. 猫在睡觉，狗跑得很快。"}}.dump() << "\n";
      c << json{{"domain", "python"}, {"text", "def add(a, b):\n    return a + b\n"}}.dump() << "\n";
    }
    c.close();
    for (const char* v : {"320", "290"}) {
      const std::string tag = std::string("v") + v;
      auto r = sigma_cmd("tokenizer train --corpus " + *dir / "corpus.jsonl" + " --vocab-size " + v +
                         " --out " + *dir / (tag + "-tok.json"));
      ASSERT_EQ(r.code, 0) << r.out;
      std::ofstream(*dir / (tag + "-data.json")) << json{
          {"tokenizer", tag + "-tok.json"}, {"corpus", {"corpus.jsonl"}},
          {"domains", {{{"name", "prose"}}, {{"name", "python"}, {"prefix", {"<Python>"}}}}}}.dump();
      r = sigma_cmd("prepare --config " + *dir / (tag + "-data.json") + " --out " + *dir / (tag + "-shards"));
      ASSERT_EQ(r.code, 0) << r.out;
      r = sigma_cmd("train --quiet --set data.source=shards --set data.path=" + *dir / (tag + "-shards") +
                    " --set model.d_model=32 --set model.heads=2 --set model.layers=2 --set model.context=32"
                    " --set model.rre_layers=1 --set 'model.groups=[{\"name\":\"prose\",\"experts\":1},"
                    "{\"name\":\"python\",\"experts\":1}]' --set train.batch=4 --set train.steps=3"
                    " --set train.eval_rows=2 --out " + *dir / tag);
      ASSERT_EQ(r.code, 0) << r.out;
    }
  }
  static void TearDownTestSuite() { delete dir; }
  static std::string ckpt(const std::string& tag = "v320") { return *dir / (tag + "/checkpoints"); }
  static TempDir* dir;
};
TempDir* Rolling::dir = nullptr;

json last_json(const CmdResult& r) { return json::parse(r.out.substr(r.out.rfind("\n{") + 1)); }

void write_lines(const std::string& path, const std::vector<json>& lines) {
  std::ofstream out(path);
  for (const json& l : lines) out << l.dump() << "\n";
}

}  // namespace

// 80 digits after the start-of-text <EOT> at context 32: windows predict digits [0, 32) from
// <EOT>, [32, 64) from digit 31, and [64, 80) from digits 47..63 (the last window takes as much
// context as fits). The same three windows as choice items give the log-likelihoods the
// rolling figures must be made of, to the bit.
TEST_F(Rolling, BitsPerByteIsTheHandMadeSumOfItsWindows) {
  const std::string rolling = *dir / "digits.jsonl", choice = *dir / "digit-windows.jsonl";
  write_lines(rolling, {json{{"type", "rolling"}, {"domain", "prose"}, {"text", kDigits}}});
  const std::string d = kDigits;
  write_lines(choice, {json{{"domain", "prose"}, {"context", ""}, {"choices", {d.substr(0, 32)}}, {"answer", 0}},
                       json{{"domain", "prose"}, {"context", d.substr(31, 1)}, {"choices", {d.substr(32, 32)}}, {"answer", 0}},
                       json{{"domain", "prose"}, {"context", d.substr(47, 17)}, {"choices", {d.substr(64, 16)}}, {"answer", 0}}});
  auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + rolling + " --json --log-samples " + *dir / "digits.log");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = last_json(r)["rolling"];
  r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + choice + " --json --log-samples " + *dir / "windows.log");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto windows = read_json_lines(*dir / "windows.log");
  ASSERT_EQ(windows.size(), 3u);
  std::vector<double> by_hand;
  std::vector<int64_t> tokens;
  for (const json& w : windows) {
    by_hand.push_back(w["loglik"][0].get<double>());
    tokens.push_back(w["tokens"][0].get<int64_t>());
  }
  EXPECT_EQ(tokens, (std::vector<int64_t>{32, 32, 16}));  // one token per digit, as assumed
  const json doc = read_json_lines(*dir / "digits.log").at(0);
  EXPECT_EQ(doc["loglik"].get<std::vector<double>>(), by_hand) << doc.dump();
  EXPECT_EQ(doc["tokens"].get<std::vector<int64_t>>(), tokens);
  double nats = 0;
  for (double l : by_hand) nats -= l;
  EXPECT_EQ(j["nats"].get<double>(), nats);
  EXPECT_EQ(j["bytes"], 80);
  EXPECT_EQ(j["tokens"], 80);
  EXPECT_EQ(j["words"], 1);
  EXPECT_EQ(j["items"], 1);
  EXPECT_EQ(j["bits_per_byte"].get<double>(), nats / (std::numbers::ln2 * 80));
  EXPECT_EQ(j["byte_perplexity"].get<double>(), std::exp(nats / 80));
  EXPECT_EQ(j["token_perplexity"].get<double>(), std::exp(nats / 80));
  EXPECT_EQ(j["word_perplexity"].get<double>(), std::exp(nats));
  EXPECT_EQ(j["domains"]["prose"]["bits_per_byte"], j["bits_per_byte"]);
  // A random model is near ln(vocab) nats per token; the sum is a real one.
  EXPECT_GT(nats / 80, 3.0);
  EXPECT_LT(nats / 80, 8.0);
}

// Bits per byte divides by the text's UTF-8 bytes: two tokenizers cut the same texts into
// different numbers of tokens, and the byte (and word) counts stay those of the texts.
TEST_F(Rolling, TheByteCountIsTheTextsWhateverTheTokenizer) {
  const std::string rolling = *dir / "mixed.jsonl";
  const std::string code = "def add(a, b):\n    return a + b\n";
  write_lines(rolling, {json{{"domain", "prose"}, {"text", kMixed}},
                        json{{"type", "rolling"}, {"domain", "python"}, {"text", code}}});
  json res[2];
  for (int k = 0; k < 2; ++k) {
    const auto r = sigma_cmd("eval --ckpt " + ckpt(k ? "v290" : "v320") + " --task " + rolling + " --json");
    ASSERT_EQ(r.code, 0) << r.out;
    res[k] = last_json(r)["rolling"];
  }
  const size_t bytes = kMixed.size() + code.size();
  EXPECT_EQ(kMixed.size(), 50u);  // 35 ASCII bytes and 5 CJK characters of 3 bytes each
  for (const json& j : res) {
    EXPECT_EQ(j["bytes"], bytes) << j.dump();
    EXPECT_EQ(j["words"], 8 + 7) << j.dump();  // blank-separated
    EXPECT_EQ(j["domains"]["prose"]["bytes"], kMixed.size());
    EXPECT_EQ(j["domains"]["python"]["bytes"], code.size());
    EXPECT_EQ(j["bits_per_byte"].get<double>(),
              j["nats"].get<double>() / (std::numbers::ln2 * double(bytes)));
  }
  EXPECT_NE(res[0]["tokens"], res[1]["tokens"]) << "the two tokenizers should cut differently";
  EXPECT_LT(res[0]["tokens"].get<int64_t>(), res[1]["tokens"].get<int64_t>());  // more merges
}

// Several --task files in one run: {"tasks": [...]} in command-line order, each result the one
// a run of that task alone prints (scores to the bit, file hash, settings), and --log-samples
// a folder of one file per task.
TEST_F(Rolling, SeveralTasksInOneRunEachDescribingItself) {
  const std::string a = *dir / "choice.jsonl", b = *dir / "text.jsonl";
  write_lines(a, {json{{"domain", "prose"}, {"context", "the cat"}, {"choices", {" is sleeping", " runs fast"}}, {"answer", 0}},
                  json{{"domain", "prose"}, {"context", "the dog"}, {"choices", {" is sleeping", " runs fast"}}, {"answer", 1}}});
  write_lines(b, {json{{"domain", "prose"}, {"text", kMixed}}, json{{"domain", "prose"}, {"text", kDigits}}});
  const std::string opts = " --bootstrap 20 --json";
  auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + a + " --task " + b + opts +
                     " --log-samples " + *dir / "logs");
  ASSERT_EQ(r.code, 0) << r.out;
  const json both = last_json(r);
  ASSERT_TRUE(both.contains("tasks")) << both.dump();
  ASSERT_EQ(both["tasks"].size(), 2u);
  EXPECT_FALSE(both["sigma"]["git"].get<std::string>().empty());
  EXPECT_TRUE(both.contains("date"));
  const std::string files[2] = {a, b};
  for (int t = 0; t < 2; ++t) {
    const json& got = both["tasks"][size_t(t)];
    r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + files[t] + opts);
    ASSERT_EQ(r.code, 0) << r.out;
    json alone = last_json(r);
    EXPECT_EQ(got["task"], files[t]);
    std::ifstream in(files[t], std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    EXPECT_EQ(got["task_xxh3_64"], fmt::format("{:016x}", XXH3_64bits(text.data(), text.size())));
    for (const char* key : {"settings", "sigma", "checkpoint", "context", "items"}) EXPECT_EQ(got[key], alone[key]) << key;
    const char* kind = t == 0 ? "choice" : "rolling";
    EXPECT_EQ(got[kind], alone[kind]) << kind;
    EXPECT_EQ(read_json_lines(got["log_samples"].get<std::string>()).size(), 2u);
  }
  EXPECT_TRUE(fs::exists(*dir / "logs/1-choice.jsonl"));
  EXPECT_TRUE(fs::exists(*dir / "logs/2-text.jsonl"));
  // The table (without --json) names both.
  r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + a + " --task " + b);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("task " + a), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rolling   bits_per_byte"), std::string::npos) << r.out;
}

// A rolling log scores again without the model (--score-generations) to the same figures;
// a rolling item takes no few-shot examples and an empty text is refused.
TEST_F(Rolling, RollingLogsScoreAgainAndMistakesAreClear) {
  const std::string t = *dir / "again.jsonl";
  write_lines(t, {json{{"domain", "prose"}, {"text", kMixed}}, json{{"domain", "python"}, {"text", kDigits}}});
  auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + t + " --json --log-samples " + *dir / "again.log");
  ASSERT_EQ(r.code, 0) << r.out;
  const json first = last_json(r)["rolling"];
  r = sigma_cmd("eval --score-generations " + *dir / "again.log" + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_json(r)["rolling"], first);
  r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + t + " --num-fewshot 1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("rolling items take no shots"), std::string::npos) << r.out;
  write_lines(t, {json{{"domain", "prose"}, {"text", ""}}});
  r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + t);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(t + ":1: \"text\" is empty"), std::string::npos) << r.out;
}

// Held-out loss on prepared shards shows progress like the other long steps (issue 39 item 8).
TEST_F(Rolling, HeldOutEvaluationShowsProgress) {
  const auto r = run_cmd("SIGMA_PROGRESS_SECONDS=0 " + std::string(SIGMA_BINARY) + " eval --ckpt " + ckpt() +
                         " --data " + *dir / "v320-shards" + " --rows 4 --batch 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sigma eval: held-out: "), std::string::npos) << r.out;
}

// Held-out loss on shards of token ids reports bits per byte too (issue 39): each scored
// target counts the UTF-8 bytes its token decodes to (controls none), so models with different
// tokenizers compare. Checked against the shards read here: every window's targets (tokens 1 to
// windows × context of each domain's stream) decoded by the tokenizer, controls left out.
TEST_F(Rolling, HeldOutShardsGiveBitsPerByteOverTheTargetsDecodedBytes) {
  for (const char* tag : {"v320", "v290"}) {
    const std::string shards = *dir / (std::string(tag) + "-shards");
    auto r = sigma_cmd("eval --ckpt " + ckpt(tag) + " --data " + shards + " --rows 100000 --json");
    ASSERT_EQ(r.code, 0) << r.out;
    const json doms = last_json(r)["domains"];
    const sigma::data::Tokenizer tok = sigma::data::Tokenizer::load(*dir / (std::string(tag) + "-tok.json"));
    const sigma::data::ShardSet set = sigma::data::ShardSet::open(shards, 0);
    ASSERT_EQ(doms.size(), set.shards.size()) << doms.dump();
    for (size_t d = 0; d < set.shards.size(); ++d) {
      const sigma::data::Shard& s = *set.shards[d];
      const uint64_t windows = sigma::data::window_count(s.n_tokens(), 32);
      std::vector<uint32_t> text;
      int64_t controls = 0;
      for (uint64_t i = 1; i <= windows * 32; ++i)
        if (tok.is_control(s.token(i))) ++controls;
        else text.push_back(s.token(i));
      const json& got = doms[set.domains[d].name];
      SCOPED_TRACE(std::string(tag) + " " + set.domains[d].name + ": " + got.dump());
      EXPECT_GT(controls, 0);  // <EOT> between documents (and <Python> before code) add no bytes
      EXPECT_EQ(got["tokens"], int64_t(windows * 32));
      EXPECT_EQ(got["bytes"], int64_t(tok.decode(text).size()));
      EXPECT_EQ(got["nats"].get<double>() / got["tokens"].get<double>(), got["loss"].get<double>());
      EXPECT_EQ(got["bits_per_byte"].get<double>(),
                got["nats"].get<double>() / (std::numbers::ln2 * got["bytes"].get<double>()));
    }
    // The table has the column.
    r = sigma_cmd("eval --ckpt " + ckpt(tag) + " --data " + shards + " --rows 100000 2>/dev/null");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("bits/byte"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(fmt::format("{:.4f}", doms["prose"]["bits_per_byte"].get<double>())),
              std::string::npos) << r.out;
  }
}
