// The shipped two-stage curriculum (configs/curriculum.train.json) through `sigma train`: the
// domains a step trains on follow the stages, the mix within a stage follows its weights, and a
// run stopped before the stage boundary and resumed after it is bit-identical to one that ran
// straight through.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "cli_util.h"
#include "test_util.h"
#include "data/sampler.h"
#include "data/shards.h"
#include "data/windows.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

using namespace sigma;
using namespace sigma::testing;
using nlohmann::json;

namespace {

const std::string kRoot = SIGMA_SOURCE_DIR;

std::vector<json> read_metrics(const std::string& p) {
  std::ifstream in(p);
  std::vector<json> out;
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

// Six small domains named as in configs/shared-data.prepare.json, prepared with its registry.
class Curriculum : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir = new TempDir("curriculum");
    std::ofstream c(*dir / "corpus.jsonl");
    const std::map<std::string, std::string> text = {
        {"english", "the quick brown fox jumps over the lazy dog "},
        {"chinese", "我们今天去公园散步，天气很好。"},
        {"poetry", "床前明月光，疑是地上霜。"},
        {"bilingual", "Good morning.\n早上好。"},
        {"python", "def f(x):\n    return x * 2\n"},
        {"java", "int f(int x) { return x * 2; }\n"}};
    for (int i = 0; i < 60; ++i)
      for (const auto& [d, t] : text)
        c << json{{"domain", d}, {"text", t + std::to_string(i % 11)}}.dump() << "\n";
    c.close();
    auto r = sigma_cmd("tokenizer train --corpus " + *dir / "corpus.jsonl" + " --vocab-size 400 --out " +
                       *dir / "tok.json");
    ASSERT_EQ(r.code, 0) << r.out;
    json prep = read_json(kRoot + "/configs/shared-data.prepare.json");
    prep["tokenizer"] = *dir / "tok.json";
    prep["corpus"] = {*dir / "corpus.jsonl"};
    std::ofstream(*dir / "data.json") << prep.dump();
    r = sigma_cmd("prepare --config " + *dir / "data.json" + " --out " + *dir / "shards");
    ASSERT_EQ(r.code, 0) << r.out;
    // The shipped stages, with stage 1 shortened to 6 steps for the test.
    sampler = read_json(kRoot + "/configs/curriculum.train.json")["data"]["sampler"];
    sampler["stages"][0]["steps"] = 6u;
  }
  static void TearDownTestSuite() { delete dir; }
  static std::string train_args() {
    return "train --quiet --config " + kRoot + "/configs/curriculum.train.json --set data.path=" +
           *dir / "shards" + " --set data.eval_path=" + *dir / "shards" +
           " --set 'data.sampler=" + sampler.dump() + "'" +
           " --set model.d_model=32 --set model.heads=2 --set model.layers=2 --set model.context=16"
           " --set train.batch=8 --set train.log_every=1 --set train.eval_rows=4 --set optim.warmup=2"
           " --set train.steps=14 ";
  }
  static TempDir* dir;
  static json sampler;
};
TempDir* Curriculum::dir = nullptr;
json Curriculum::sampler;

// Stage 1 of the paper (§4, "Pretraining settings"): "we activate four main domains' experts to
// consume data from all the four main domains including bilingual, Chinese, English and codes"
// (code: python and java); stage 2 adds the rest (poetry).
const std::set<std::string> kStage1 = {"english", "chinese", "bilingual", "python", "java"};

TEST_F(Curriculum, TheDomainsEachStepTrainsOnFollowTheStages) {
  auto r = sigma_cmd(train_args() + "--out " + *dir / "mix");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto metrics = read_metrics(*dir / "mix/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 14u);
  std::set<std::string> seen1, seen2;
  for (const json& m : metrics) {
    const int64_t step = m["step"].get<int64_t>();
    for (const auto& [d, loss] : m["domains"].items()) (step <= 6 ? seen1 : seen2).insert(d);
  }
  EXPECT_EQ(seen1, kStage1);  // stage 1: the main domains only, and each of them
  EXPECT_EQ(seen2.size(), 6u) << json(seen2).dump();  // stage 2: every domain
}

// Stage lengths count optimizer steps whatever the micro-batches per step: train.accum = 2 on
// one process, and mpirun -np 2 (which shares the step's 8 rows as 2 micro-batches of 4), keep
// stage 1 for 6 steps (they used to end it after 3: the sampler counted micro-batches).
TEST_F(Curriculum, StageLengthsCountOptimizerStepsAtAnyRankCount) {
  const std::string mpirun = "mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 ";
  for (const std::string& launch : {std::string("accum"), std::string("mpirun")}) {
    if (launch == "mpirun" && !SIGMA_HAS_MPI) GTEST_SKIP() << "built with SIGMA_MPI=OFF";
    const std::string out = *dir / ("stages-" + launch);
    const auto r = launch == "accum"
                       ? sigma_cmd(train_args() + "--set train.accum=2 --set train.batch=4 --out " + out)
                       : run_cmd(mpirun + SIGMA_BINARY + " " + train_args() +
                                 "--set train.threads=1 --out " + out);
    ASSERT_EQ(r.code, 0) << launch << ": " << r.out;
    const auto metrics = read_metrics(out + "/metrics.jsonl");
    ASSERT_EQ(metrics.size(), 14u) << launch;
    std::set<std::string> seen1, seen2;
    for (const json& m : metrics)
      for (const auto& [d, loss] : m["domains"].items()) (m["step"] <= 6 ? seen1 : seen2).insert(d);
    EXPECT_EQ(seen1, kStage1) << launch;
    EXPECT_EQ(seen2.size(), 6u) << launch << ": " << json(seen2).dump();
  }
}

// Within a stage, rows are drawn in proportion to the domains' token counts (the sampler the
// trainer uses, run over many steps of the same data).
TEST_F(Curriculum, TheMixWithinEachStageFollowsTokenCounts) {
  data::ShardSet set = data::ShardSet::open(*dir / "shards", 0);
  data::BatchSource src(std::move(set), {.batch = 64, .seq = 16},
                        data::SamplerConfig::from_json(sampler, "sampler"));
  const data::ShardSet check = data::ShardSet::open(*dir / "shards", 0);
  std::map<std::string, double> tokens;
  double all = 0, main = 0;
  for (size_t d = 0; d < check.domains.size(); ++d) {
    tokens[check.domains[d].name] = double(check.shards[d]->n_tokens());
    all += tokens[check.domains[d].name];
    if (kStage1.count(check.domains[d].name)) main += tokens[check.domains[d].name];
  }
  std::map<uint32_t, std::string> name_of;
  for (const auto& d : check.domains) name_of[d.id] = d.name;
  std::map<std::string, double> rows1, rows2;
  data::Batch b;
  for (int step = 0; step < 6 + 200; ++step) {
    src.next(b);
    for (int32_t d : b.domain) (step < 6 ? rows1 : rows2)[name_of[uint32_t(d)]] += 1;
  }
  for (const auto& [name, n] : tokens) {
    const double p1 = kStage1.count(name) ? n / main : 0.0, p2 = n / all;
    EXPECT_NEAR(rows1[name] / (6 * 64), p1, 0.08) << name;    // 384 draws
    EXPECT_NEAR(rows2[name] / (200 * 64), p2, 0.015) << name;  // 12,800 draws
  }
}

TEST_F(Curriculum, ResumeAcrossTheStageBoundaryIsExact) {
  auto r = sigma_cmd(train_args() + "--out " + *dir / "straight");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(train_args() + "--stop-at 4 --out " + *dir / "split");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train --quiet --resume " + *dir / "split/checkpoints --out " + *dir / "split");
  ASSERT_EQ(r.code, 0) << r.out;
  const TensorMap x = read_model_tensors(*dir / "straight/checkpoints/step-00000014");
  const TensorMap y = read_model_tensors(*dir / "split/checkpoints/step-00000014");
  ASSERT_EQ(x.size(), y.size());
  for (const auto& [name, t] : x)
    EXPECT_EQ(0, std::memcmp(t.bytes(), y.at(name).bytes(), t.nbytes())) << name;
  // Every step's losses, per domain, are the same numbers (steps 5..14 ran after the resume).
  const auto a = read_metrics(*dir / "straight/metrics.jsonl");
  const auto b = read_metrics(*dir / "split/metrics.jsonl");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["domains"], b[i]["domains"]) << "step " << a[i]["step"];
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << a[i]["step"];
  }
}

}  // namespace
