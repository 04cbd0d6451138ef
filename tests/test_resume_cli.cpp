// `sigma train --resume` from the command line: what a changed config changes is said, and the
// documented ways of continuing a run work.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "io/checkpoint_dir.h"
#include "optim/adamw.h"
#include "train/checkpoint.h"
#include "train/resume.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

const std::string kTiny =
    "--set model.d_model=32 --set model.layers=2 --set model.heads=2 --set model.context=16 "
    "--set train.batch=6 --set train.log_every=5 --set train.eval_rows=12 --set optim.warmup=3 ";

// The lr metrics.jsonl recorded at `step` (1-based, as logged).
double logged_lr(const std::string& out, int64_t step) {
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["step"] == step) return j["lr"].get<double>();
  }
  ADD_FAILURE() << "no metrics record of step " << step << " in " << out;
  return -1;
}

void expect_same_model(const std::string& a, const std::string& b) {
  const TensorMap x = read_model_tensors(resolve_checkpoint(a)), y = read_model_tensors(resolve_checkpoint(b));
  ASSERT_EQ(x.size(), y.size());
  for (const auto& [name, t] : x)
    EXPECT_EQ(0, std::memcmp(t.bytes(), y.at(name).bytes(), t.nbytes())) << name;
}

Config tiny_config(int64_t steps) {
  Config c;
  c.optim.warmup = 3;
  c.train.steps = steps;
  return c;
}

TEST(ResumeCli, ScheduleChangeNamesWhatChanges) {
  const Config a = tiny_config(20);
  EXPECT_EQ(schedule_change(a, a, 10), "");
  EXPECT_EQ(schedule_change(a, tiny_config(40), 0), "") << "nothing trained yet: no change";
  const std::string longer = schedule_change(a, tiny_config(40), 20);
  EXPECT_NE(longer.find("cosine over 40 steps instead of 20 (train.steps)"), std::string::npos) << longer;
  EXPECT_NE(longer.find("optim.schedule_steps=20"), std::string::npos) << longer;
  Config kept = tiny_config(40);
  kept.optim.schedule_steps = 20;
  EXPECT_EQ(schedule_change(a, kept, 20), "");
  Config hotter = a;
  hotter.optim.lr = 1e-2f;
  const std::string lr = schedule_change(a, hotter, 10);
  EXPECT_NE(lr.find("optim.lr"), std::string::npos) << lr;
  EXPECT_EQ(lr.find("schedule_steps"), std::string::npos) << lr;
  // Inside the warmup (3 steps) the next step's lr does not depend on the schedule's length.
  const std::string warm = schedule_change(tiny_config(4), tiny_config(6), 1);
  EXPECT_NE(warm.find(fmt::format("step 2 trains at lr {:.4g} as before, later steps differ",
                                  lr_at(tiny_config(6).optim, 1, 6))), std::string::npos) << warm;
}

// Extending a finished run: by default the cosine stretches over the new train.steps (and the
// run says so, with the lr before and after); optim.schedule_steps keeps the original schedule
// exactly: the extension equals one run of that schedule from the start.
TEST(ResumeCli, ExtendingARunWarnsOfTheNewScheduleOrKeepsTheOldOne) {
  TempDir tmp("resume-lr");
  auto r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=20 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  fs::copy(tmp / "a", tmp / "b", fs::copy_options::recursive);

  r = sigma_cmd("train --quiet --resume " + tmp / "a/checkpoints --set train.steps=40 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  const float now = lr_at(tiny_config(40).optim, 20, 40), was = lr_at(tiny_config(20).optim, 20, 20);
  EXPECT_NE(r.out.find("warning: resuming after step 20, the learning-rate schedule changes: "
                       "cosine over 40 steps instead of 20 (train.steps)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(fmt::format("step 21 trains at lr {:.4g} instead of {:.4g}", now, was)),
            std::string::npos) << r.out;
  EXPECT_EQ(logged_lr(tmp / "a", 25), double(lr_at(tiny_config(40).optim, 24, 40)));

  r = sigma_cmd("train --quiet --resume " + tmp / "b/checkpoints --set train.steps=40 "
                "--set optim.schedule_steps=20 --out " + tmp / "b");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  EXPECT_EQ(logged_lr(tmp / "b", 25), double(lr_at(tiny_config(20).optim, 24, 20)));  // the floor
  r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=40 --set optim.schedule_steps=20 --out " +
                tmp / "straight");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_model(tmp / "b/checkpoints", tmp / "straight/checkpoints");

  // Stopping and resuming the same run changes nothing and says nothing.
  r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=20 --stop-at 10 --out " + tmp / "c");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train --quiet --resume " + tmp / "c/checkpoints --out " + tmp / "c");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
}

// A relative --expert-store is fixed when the run starts: resuming from another directory opens
// the same store file (it used to create a new one in the current directory).
TEST(ResumeCli, RelativeExpertStoreIsTheSameFileFromAnotherDirectory) {
  TempDir tmp("resume-store");
  fs::create_directories(tmp / "A");
  fs::create_directories(tmp / "B");
  const std::string sigma = SIGMA_BINARY;
  auto r = run_cmd("cd " + tmp / "A" + " && " + sigma + " train --quiet " + kTiny +
                   "--set train.steps=12 --stop-at 6 --expert-store store.bin --out run");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string saved = open_checkpoint(tmp / "A/run/checkpoints").cfg.train.expert_store;
  EXPECT_TRUE(fs::path(saved).is_absolute()) << saved;
  EXPECT_TRUE(fs::equivalent(saved, tmp / "A/store.bin")) << saved;
  r = run_cmd("cd " + tmp / "B" + " && " + sigma + " train --quiet --resume ../A/run/checkpoints "
              "--out ../A/run");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::is_empty(tmp / "B")) << "the resumed run made a store of its own";
  r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=12 --out " + tmp / "straight");
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_model(tmp / "A/run/checkpoints", tmp / "straight/checkpoints");
}

// docs/surgery.md's workflow as written: a new domain trained alone from a config file that
// names its data, over the resumed checkpoint's config; a model key in the file must match.
TEST(ResumeCli, ConfigFileOnResumeSetsDataAndTrainingKeys) {
  TempDir tmp("resume-config");
  auto r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=6 --out " + tmp / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("domains remove --ckpt " + tmp / "run/checkpoints --name arith --out " + tmp / "removed");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("domains add --ckpt " + tmp / "removed --name arith --init-from markov --out " +
                tmp / "added");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ofstream(tmp / "arith-only.json") << R"({"data": {"domains": ["arith"]}, "train": {"steps": 4}})";
  r = sigma_cmd("train --quiet --resume " + tmp / "added --freeze shared --config " +
                tmp / "arith-only.json --out " + tmp / "arith");
  ASSERT_EQ(r.code, 0) << r.out;
  const CheckpointInfo ck = open_checkpoint(tmp / "arith/checkpoints");
  EXPECT_EQ(ck.state.step, 4);
  EXPECT_EQ(ck.cfg.data.domains, std::vector<std::string>{"arith"});
  EXPECT_EQ(ck.cfg.train.freeze, std::vector<std::string>{"shared"});
  const TensorMap before = read_model_tensors(resolve_checkpoint(tmp / "added"));
  const TensorMap after = read_model_tensors(ck.dir);
  const Tensor &q0 = before.at("blocks.0.attn.qkv.w"), &q1 = after.at("blocks.0.attn.qkv.w");
  EXPECT_EQ(0, std::memcmp(q0.bytes(), q1.bytes(), q0.nbytes())) << "a frozen tensor moved";
  const Tensor &e0 = before.at("blocks.1.rre.arith.w_in"), &e1 = after.at("blocks.1.rre.arith.w_in");
  EXPECT_NE(0, std::memcmp(e0.bytes(), e1.bytes(), e0.nbytes())) << "the new domain did not train";

  // Model keys equal to the checkpoint's are accepted; another value is refused by name.
  std::ofstream(tmp / "same.json") << R"({"model": {"d_model": 32}, "train": {"steps": 9}})";
  r = sigma_cmd("train --resume " + tmp / "added --config " + tmp / "same.json --print-config");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"steps\": 9"), std::string::npos) << r.out;
  std::ofstream(tmp / "wide.json") << R"({"model": {"d_model": 64}})";
  r = sigma_cmd("train --resume " + tmp / "added --config " + tmp / "wide.json --out " + tmp / "wide");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("model.d_model is 64 here but 32 in the checkpoint"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "wide"));
}

// A resume whose --set changes the model is refused in one short line naming the keys (it
// dumped both whole configs, ~950 characters, naming none: issue 37).
TEST(ResumeCli, AChangedModelIsRefusedNamingTheKeys) {
  TempDir tmp("resume-model");
  auto r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=2 --out " + tmp / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("train --quiet --resume " + tmp / "run/checkpoints --set model.d_model=64 "
                "--set model.heads=4 --out " + tmp / "wide");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("model.d_model is 64 here but 32 in the checkpoint (also model.heads)"),
            std::string::npos) << r.out;
  EXPECT_LT(r.out.size(), 300u) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "wide/checkpoints"));
}

TEST(ResumeCli, ModelDifferenceNamesNestedKeysAndCountsTheRest) {
  Config a;
  a.model.groups = {{"prose", 2}, {"code", 1}};
  EXPECT_EQ(model_difference(a, a), "");
  Config b = a;
  b.model.groups[0].experts = 3;
  EXPECT_EQ(model_difference(a, b), "model.groups[0].experts is 3 here but 2 in the checkpoint");
  b.model.layers += 1;
  b.model.d_model *= 2;
  b.model.heads *= 2;
  b.model.context *= 2;
  b.model.slots += 1;
  // Six keys: the first with both values, three more by name, the rest counted.
  const std::string d = model_difference(a, b);
  EXPECT_NE(d.find(" (also model."), std::string::npos) << d;
  EXPECT_NE(d.find(", 2 more)"), std::string::npos) << d;
  EXPECT_LT(d.size(), 200u) << d;
}

}  // namespace
