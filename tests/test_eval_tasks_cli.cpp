// Fine-tuning formats end to end: prompt/answer pairs for dialogue, translation (<EN>/<CN>) and
// code (<Python>) are prepared, a small model is fine-tuned on them with the loss masked on
// the prompt and the padding, and `sigma eval --task` shows every task's score rising from
// the start of fine-tuning to its end: multiple-choice accuracy, exact match and BLEU, pass@1.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli_util.h"

using namespace sigma::testing;
using nlohmann::json;

namespace {

struct Pair {
  const char *q, *a;
};
const Pair kColours[] = {{"zorp", "red"}, {"blick", "blue"}, {"quan", "green"}, {"mif", "yellow"},
                         {"tove", "blue"}, {"wug", "red"},    {"dax", "yellow"}, {"fep", "green"}};
// Answers of 4+ characters: corpus BLEU needs 4-grams (under "zh" a character is a word).
const Pair kWords[] = {{"the cat is sleeping", "猫在睡觉"}, {"the dog runs fast", "狗跑得很快"},
                       {"I like to drink water", "我喜欢喝水"}, {"the moon is bright", "月亮很明亮"},
                       {"the sun is rising", "太阳升起来了"}, {"the tree is tall", "这棵树很高"},
                       {"fish swim in the river", "鱼在河里游"}, {"good morning teacher", "老师早上好"}};
const Pair kCode[] = {{"add(a, b)", "a + b"}, {"sub(a, b)", "a - b"},
                      {"mul(a, b)", "a * b"}, {"first(a, b)", "a"}};

std::string question(const Pair& p) { return std::string("Q: what colour is a ") + p.q + "?\nA:"; }
std::string def(const Pair& p) { return std::string("def ") + p.q + ":\n"; }

class FineTune : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    dir = new TempDir("finetune");
    std::ofstream c(*dir / "pairs.jsonl");
    for (const Pair& p : kColours)
      c << json{{"domain", "dialogue"}, {"prompt", question(p)}, {"answer", std::string(" ") + p.a}}.dump() << "\n";
    for (const Pair& p : kWords)  // the bilingual format tags the prompt <EN> and the answer <CN>
      c << json{{"domain", "translation"}, {"prompt", p.q}, {"answer", p.a}}.dump() << "\n";
    for (const Pair& p : kCode)
      c << json{{"domain", "python"}, {"prompt", def(p)}, {"answer", std::string("    return ") + p.a + "\n"}}.dump() << "\n";
    c.close();
    auto r = sigma_cmd("tokenizer train --corpus " + *dir / "pairs.jsonl" + " --vocab-size 400 --out " + *dir / "tok.json");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream(*dir / "data.json") << json{
        {"tokenizer", "tok.json"}, {"corpus", {"pairs.jsonl"}},
        {"domains", {{{"name", "dialogue"}},
                     {{"name", "translation"}, {"format", "bilingual"}},
                     {{"name", "python"}, {"prefix", {"<Python>"}}}}}}.dump();
    r = sigma_cmd("prepare --config " + *dir / "data.json" + " --out " + *dir / "shards");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream t(*dir / "tasks.jsonl");
    const char* colours[] = {" red", " blue", " green", " yellow"};
    for (const Pair& p : kColours) {
      int answer = 0;
      while (std::string(colours[answer]) != std::string(" ") + p.a) ++answer;
      t << json{{"type", "choice"}, {"domain", "dialogue"}, {"context", question(p)},
                {"choices", colours}, {"answer", answer}}.dump() << "\n";
    }
    for (const Pair& p : kWords)
      t << json{{"type", "generate"}, {"domain", "translation"}, {"prompt", p.q},
                {"references", {p.a}}, {"tokenize", "zh"}}.dump() << "\n";
    for (const Pair& p : kCode) {
      const std::string name = std::string(p.q).substr(0, std::string(p.q).find('('));
      t << json{{"type", "code"}, {"domain", "python"}, {"prompt", def(p)},
                {"tests", "assert " + name + "(7, 3) == " + (name == "add" ? "10" : name == "sub" ? "4" : name == "mul" ? "21" : "7")}}.dump() << "\n";
    }
  }
  static void TearDownTestSuite() { delete dir; }
  static std::string train_args() {
    return "train --quiet --set data.source=shards --set data.path=" + *dir / "shards" +
           " --set data.finetune=true --set data.mask_prompt=true --set model.d_model=64"
           " --set model.heads=2 --set model.layers=2 --set model.context=48 --set model.rre_layers=1"
           " --set 'model.groups=[{\"name\":\"dialogue\",\"experts\":2},{\"name\":\"translation\","
           "\"experts\":2},{\"name\":\"python\",\"experts\":2}]' --set train.batch=8"
           " --set train.steps=160 --set train.log_every=40 --set train.eval_rows=4"
           " --set optim.lr=0.005 --set optim.warmup=5 ";
  }
  static TempDir* dir;
};
TempDir* FineTune::dir = nullptr;

json eval_task(const std::string& ckpt, const std::string& extra = "") {
  const auto r = sigma_cmd("eval --ckpt " + ckpt + " --task " + *FineTune::dir / "tasks.jsonl" +
                           " --max-new 24 --timeout 30 --json " + extra);
  EXPECT_EQ(r.code, 0) << r.out;
  return json::parse(r.out.substr(r.out.find('{')));
}

TEST_F(FineTune, TaskScoresRiseFromTheStartOfFineTuningToItsEnd) {
  auto r = sigma_cmd(train_args() + "--stop-at 1 --out " + *dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  const json before = eval_task(*dir / "run/checkpoints/step-00000001");
  r = sigma_cmd("train --quiet --resume " + *dir / "run/checkpoints --out " + *dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  const json after = eval_task(*dir / "run/checkpoints/step-00000160");
  SCOPED_TRACE("before " + before.dump() + "\nafter " + after.dump());
  std::cout << "scores after step 1: " << before.dump() << "\nafter step 160: " << after.dump() << "\n";
  EXPECT_EQ(after["items"], 20);
  EXPECT_GT(after["choice"]["acc"].get<double>(), before["choice"]["acc"].get<double>());
  EXPECT_GE(after["choice"]["acc"].get<double>(), 0.75);
  EXPECT_GT(after["generate"]["exact_match"].get<double>(), before["generate"]["exact_match"].get<double>());
  EXPECT_GT(after["generate"]["bleu"]["zh"]["score"].get<double>(),
            before["generate"]["bleu"]["zh"]["score"].get<double>());
  EXPECT_GT(after["code"]["pass@1"].get<double>(), before["code"]["pass@1"].get<double>());
  // Sampled: n = 4 per problem, pass@k for k = 1, 2, 4 (non-decreasing in k by construction).
  const json sampled = eval_task(*dir / "run/checkpoints", "--samples 4 --k 1,2,4 --temperature 1.5 --seed 3");
  const json& code = sampled["code"];
  EXPECT_EQ(code["samples"], 4);
  EXPECT_LE(code["pass@1"].get<double>(), code["pass@2"].get<double>());
  EXPECT_LE(code["pass@2"].get<double>(), code["pass@4"].get<double>());
  r = sigma_cmd("eval --ckpt " + *dir / "run/checkpoints --task " + *dir / "tasks.jsonl --samples 2 --k 3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("pass@3 needs at least 3 samples"), std::string::npos) << r.out;
}

TEST_F(FineTune, BadTaskFilesAndCheckpointsWithoutTokenizerAreClearErrors) {
  auto r = sigma_cmd(train_args() + "--stop-at 1 --out " + *dir / "short");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ofstream(*dir / "bad.jsonl") << R"({"type":"choice","domain":"klingon","context":"c","choices":["a"],"answer":0})" << "\n";
  r = sigma_cmd("eval --ckpt " + *dir / "short/checkpoints --task " + *dir / "bad.jsonl");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(*dir / "bad.jsonl:1: unknown domain 'klingon'"), std::string::npos) << r.out;
  r = sigma_cmd("train --quiet --set train.steps=1 --set model.d_model=32 --set model.heads=2 "
                "--set model.layers=2 --out " + *dir / "synthetic");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "synthetic/checkpoints --task " + *dir / "tasks.jsonl");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("has no tokenizer"), std::string::npos) << r.out;
}

}  // namespace
