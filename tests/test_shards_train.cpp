// Training, resuming, evaluating and generating on prepared shards: the path from raw text.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "io/safetensors.h"

using namespace sigma;
using namespace sigma::testing;

namespace {

class ShardsTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir = new TempDir("shards");
    std::ofstream c(*dir / "corpus.jsonl");
    for (int i = 0; i < 120; ++i) {
      c << nlohmann::json{{"domain", "prose"},
                          {"text", "the cat sat on the mat number " + std::to_string(i % 17) +
                                       " and the dog ran."}}.dump() << "\n";
      c << nlohmann::json{{"domain", "code"},
                          {"text", "def f" + std::to_string(i % 13) + "(x):\n    return x + " +
                                       std::to_string(i % 7) + "\n"}}.dump() << "\n";
    }
    c.close();
    auto r = sigma_cmd("tokenizer train --corpus " + *dir / "corpus.jsonl" + " --vocab-size 320 --out " +
                       *dir / "tok.json");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream(*dir / "data.json") << nlohmann::json{
        {"tokenizer", "tok.json"},
        {"corpus", {"corpus.jsonl"}},
        {"domains", {{{"name", "prose"}, {"slot", 0}}, {{"name", "code"}, {"slot", 1}, {"prefix", {"<Python>"}}}}}}.dump();
    r = sigma_cmd("prepare --config " + *dir / "data.json" + " --out " + *dir / "shards");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { delete dir; }
  static std::string train_args() {
    return "train --quiet --set data.source=shards --set data.path=" + *dir / "shards" +
           " --set model.d_model=32 --set model.heads=2 --set model.layers=2 --set model.context=24"
           " --set train.batch=4 --set train.log_every=4 --set train.eval_rows=8 --set optim.warmup=2"
           " --set model.rre_layers=1 --set 'model.groups=[{\"name\":\"prose\",\"experts\":2},"
           "{\"name\":\"code\",\"experts\":3}]' ";
  }
  static TempDir* dir;
};
TempDir* ShardsTrain::dir = nullptr;

TEST_F(ShardsTrain, ResumeRestoresTheSamplerCursorExactly) {
  auto r = sigma_cmd(train_args() + "--set train.steps=12 --out " + *dir / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  // Resumed from a checkpoint taken mid-run (step 5 of a run stopped at 7): ECSS has already
  // read step 6's batches ahead by then, and the cursor saved must be the one before them.
  r = sigma_cmd(train_args() + "--set train.steps=12 --set train.ckpt_every=5 --stop-at 7 --out " +
                *dir / "b");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train --quiet --resume " + *dir / "b/checkpoints/step-00000005 --out " + *dir / "b");
  ASSERT_EQ(r.code, 0) << r.out;
  const TensorMap x = read_model_tensors(*dir / "a/checkpoints/step-00000012");
  const TensorMap y = read_model_tensors(*dir / "b/checkpoints/step-00000012");
  ASSERT_EQ(x.size(), y.size());
  for (const auto& [name, t] : x)
    EXPECT_EQ(0, std::memcmp(t.bytes(), y.at(name).bytes(), t.nbytes())) << name;
  // The vocabulary and slots came from the shards: two slots of 320 rows.
  EXPECT_EQ(x.at("embed.tokens").dim(0), 2 * 320);
}

TEST_F(ShardsTrain, EvalPrintsPerDomainLossWithFullPrecisionAndGenerateTakesText) {
  auto r = sigma_cmd(train_args() + "--set train.steps=30 --out " + *dir / "e");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "e/checkpoints --data " + *dir / "shards --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  for (const char* d : {"prose", "code"}) {
    const double loss = j["domains"][d]["loss"].get<double>();
    EXPECT_TRUE(std::isfinite(loss) && loss > 0 && loss < std::log(320.0)) << d << " " << loss;
    EXPECT_NEAR(j["domains"][d]["ppl"].get<double>(), std::exp(loss), 1e-9 * std::exp(loss));
    EXPECT_GT(j["domains"][d]["tokens"].get<int64_t>(), 0);
  }
  EXPECT_NE(r.out.find(fmt::format("{:.17g}", j["domains"]["code"]["loss"].get<double>())),
            std::string::npos) << r.out;
  r = sigma_cmd("generate --ckpt " + *dir / "e/checkpoints --domain code --prompt 'def f' --max-new 6");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("def f", 0), 0u) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "e/checkpoints --data " + *dir / "nowhere");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("nowhere"), std::string::npos) << r.out;
}

TEST_F(ShardsTrain, EvalWithoutDataUsesTheRunsEvalPathOrAsksForIt) {
  auto r = sigma_cmd(train_args() + "--set train.steps=3 --set data.eval_path=" + *dir / "shards" +
                     " --out " + *dir / "with-eval");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "with-eval/checkpoints --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["data"], *dir / "shards");
  EXPECT_TRUE(j["domains"].contains("prose") && j["domains"].contains("code")) << r.out;
  r = sigma_cmd(train_args() + "--set train.steps=3 --out " + *dir / "no-eval");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "no-eval/checkpoints");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("pass --data"), std::string::npos) << r.out;
}

// An extract evaluated on a held-out folder that also holds other domains: those are skipped
// with a note (stderr and --json), --domains picks, and an unknown request names the known ones.
TEST_F(ShardsTrain, EvalOfAnExtractSkipsTheDomainsItDoesNotKnow) {
  auto r = sigma_cmd(train_args() + "--set train.steps=4 --out " + *dir / "full");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("extract --ckpt " + *dir / "full/checkpoints --domain code --out " + *dir / "code");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string err = *dir / "eval-code.err";
  r = run_cmd("(" + std::string(SIGMA_BINARY) + " eval --ckpt " + *dir / "code --data " +
              *dir / "shards --json 2>" + err + ")");
  ASSERT_EQ(r.code, 0) << r.out << slurp(err);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["domains"].size(), 1u);
  EXPECT_TRUE(j["domains"].contains("code")) << r.out;
  EXPECT_EQ(j["skipped"]["prose"], "not a domain of the model") << r.out;
  const std::string note = slurp(err);
  EXPECT_NE(note.find("skipped prose (not a domain of the model)"), std::string::npos) << note;
  EXPECT_EQ(std::count(note.begin(), note.end(), '\n'), 1) << note;
  // The full model on the same rows of code computes bit for bit what the extract computes.
  r = sigma_cmd("eval --ckpt " + *dir / "full/checkpoints --data " + *dir / "shards --domains code --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto f = nlohmann::json::parse(r.out);
  EXPECT_EQ(f["domains"].size(), 1u) << r.out;
  EXPECT_EQ(f["domains"]["code"]["loss"].get<double>(), j["domains"]["code"]["loss"].get<double>());
  EXPECT_EQ(f["skipped"].size(), 0u) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "code --data " + *dir / "shards --domains prose");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("no domain 'prose'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("code"), std::string::npos) << r.out;
  r = sigma_cmd("eval --ckpt " + *dir / "full/checkpoints --data " + *dir / "shards --domains poems");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("no domain 'poems'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prose, code"), std::string::npos) << r.out;
}

TEST_F(ShardsTrain, DataMayHoldASubsetOfTheModelsDomains) {
  // The model also knows 'poems'; the data has only prose and code. Rows are routed by name.
  const std::string domains =
      " --set 'model.domains=[{\"name\":\"code\",\"group\":\"code\",\"slot\":1},"
      "{\"name\":\"poems\",\"group\":\"prose\",\"slot\":0},"
      "{\"name\":\"prose\",\"group\":\"prose\",\"slot\":0}]' --set model.slots=2 ";
  auto r = sigma_cmd(train_args() + domains + "--set train.steps=3 --out " + *dir / "sub");
  ASSERT_EQ(r.code, 0) << r.out;
  auto s = nlohmann::json::parse(std::ifstream(*dir / "sub/summary.json"));
  EXPECT_TRUE(s["domains"].contains("prose") && s["domains"].contains("code"));
  EXPECT_FALSE(s["domains"].contains("poems"));
  const std::string missing =
      " --set 'model.domains=[{\"name\":\"prose\",\"group\":\"prose\",\"slot\":0}]' ";
  r = sigma_cmd(train_args() + missing + "--set train.steps=3");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unknown domain 'code'"), std::string::npos) << r.out;
}

TEST_F(ShardsTrain, FrequencyRoutingTablesComeFromTheShardsTokenCounts) {
  auto r = sigma_cmd(train_args() + "--set model.routing=frequency --set train.steps=2 --out " +
                     *dir / "freq");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(train_args() + "--set train.steps=2 --out " + *dir / "rand");
  ASSERT_EQ(r.code, 0) << r.out;
  auto f = read_safetensors(*dir / "freq/checkpoints/step-00000002/model.safetensors");
  auto a = read_safetensors(*dir / "rand/checkpoints/step-00000002/model.safetensors");
  const Tensor& tf = f.tensors.at("routing.1.code");
  const Tensor& ta = a.tensors.at("routing.1.code");
  ASSERT_EQ(tf.numel(), ta.numel());
  EXPECT_NE(0, std::memcmp(tf.bytes(), ta.bytes(), tf.nbytes()));
  // The synthetic source cannot count tokens: a clear error, not random tables in disguise.
  r = sigma_cmd("train --quiet --set model.routing=frequency");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("needs token counts"), std::string::npos) << r.out;
}

}  // namespace

// A relative data.path is made absolute when the run starts (like --expert-store): a resumed
// run reads the same shards from any directory.
TEST_F(ShardsTrain, RelativeDataPathResumesFromAnotherDirectory) {
  std::filesystem::create_directories(*dir / "elsewhere");
  std::string args = train_args();
  const std::string abs_path = "data.path=" + *dir / "shards";
  args.replace(args.find(abs_path), abs_path.size(), "data.path=shards");
  auto r = run_cmd("cd " + dir->str() + " && " + SIGMA_BINARY + " " + args +
                   "--set train.steps=6 --stop-at 3 --out rel");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(open_checkpoint(*dir / "rel/checkpoints").cfg.data.path, *dir / "shards");
  r = run_cmd("cd " + *dir / "elsewhere" + " && " + SIGMA_BINARY +
              " train --quiet --resume ../rel/checkpoints --out ../rel");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(open_checkpoint(*dir / "rel/checkpoints").state.step, 6);
}

// A resume that cuts each step's rows into other micro-batches than the checkpoint's run did
// (here 4-row micro-batches, then 2 of 2 rows: what a resume on twice the ranks does when
// train.batch must shrink) continues the data stream at the same step, counted in the new
// micro-batches, and says so; the saved cursor's count of 4-row micro-batches was refused.
TEST_F(ShardsTrain, ResumeMayCutTheStepsIntoOtherMicroBatches) {
  auto r = sigma_cmd(train_args() + "--set train.steps=6 --stop-at 3 --out " + *dir / "cut");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train --resume " + *dir / "cut/checkpoints --out " + *dir / "cut" +
                " --set train.batch=2 --set train.accum=2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("the data stream continues after step 3 in micro-batches of 2 rows (2 a "
                       "step; the checkpoint's run read 3 micro-batches in 3 steps)"),
            std::string::npos) << r.out;
  const CheckpointInfo ck = open_checkpoint(*dir / "cut/checkpoints");
  EXPECT_EQ(ck.state.step, 6);
  EXPECT_EQ(ck.state.data_cursor.at("index").get<uint64_t>(), 12u) << ck.state.data_cursor.dump();
  EXPECT_EQ(ck.state.data_cursor.at("sampler").at("step").get<uint64_t>(), 12u);
}

// One domain per micro-batch: `sigma train` runs a step's micro-batches in expert-group order,
// so under a memory budget that holds one group's experts (3 of the 5) but not both groups',
// ECSS gathers each active expert once a step, as a budget that holds the whole step does,
// and needs one piece per group. In the order drawn (groups alternating) it gathered 1.8x that.
TEST_F(ShardsTrain, OneDomainMicroBatchesRunInGroupOrderAndGatherEachExpertOnce) {
  const int64_t d = 32, f = 4 * d, expert_floats = d * f + f + f * d + d;
  auto ecss_of = [&](const std::string& budget) {
    const std::string out = *dir / ("order-" + budget);
    auto r = sigma_cmd(train_args() + "--set train.experts=ecss --set train.accum=8 "
                       "--set train.steps=4 --set 'data.sampler={\"one_domain_per_batch\": true}' "
                       "--set train.expert_memory=" + budget + " --out " + out);
    EXPECT_EQ(r.code, 0) << r.out;
    std::ifstream in(out + "/summary.json");
    return nlohmann::json::parse(in).at("ecss");
  };
  // An expert's compute buffers: its weights and its backward pass's gradients.
  const int64_t expert_bytes = 2 * 4 * expert_floats;
  const auto whole = ecss_of("auto"), small = ecss_of(std::to_string(3 * expert_bytes + 1000));
  EXPECT_EQ(small["compute_buffer_mib"].get<double>() * (1 << 20), 3.0 * expert_bytes)
      << small.dump();
  EXPECT_EQ(small["gathered_gib_per_step"], whole["gathered_gib_per_step"]) << small.dump();
  EXPECT_EQ(small["pieces_per_step"].get<double>(), 2.0) << small.dump();
  EXPECT_EQ(small["records_gib_per_step"], whole["records_gib_per_step"]);
}
