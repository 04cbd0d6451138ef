// A run directory belongs to one training (issue 15): a lock, no silent reuse of an old run,
// leftovers of killed saves removed, no duplicate metrics after a resume, and a run killed
// before its first `latest` still resumes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "io/checkpoint_dir.h"
#include "train/run_dir.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

const std::string kTiny =
    "train --quiet --set model.d_model=16 --set model.layers=2 --set model.heads=2 "
    "--set model.context=8 --set train.batch=2 --set train.log_every=5 --set train.eval_rows=4 ";

std::vector<int64_t> logged_steps(const std::string& out) {
  std::vector<int64_t> steps;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line)["step"]);
  return steps;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(RunDir, ASecondOwnerIsRefusedWhileTheFirstHoldsTheLock) {
  TempDir tmp("rundir-lock");
  auto first = std::make_unique<RunDir>(tmp / "out", RunDirMode::Fresh);
  const std::string e = error_of([&] { RunDir second(tmp / "out", RunDirMode::Resume); });
  EXPECT_NE(e.find("in use by another sigma train (pid " + std::to_string(::getpid()) + ")"),
            std::string::npos) << e;
  first.reset();  // released: the next owner gets it
  EXPECT_EQ(error_of([&] { RunDir again(tmp / "out", RunDirMode::Resume); }), "");
}

// Two trainings on one --out: the second stops before writing anything.
TEST(RunDir, TrainingIntoALockedDirectoryFailsWithAClearError) {
  TempDir tmp("rundir-cli-lock");
  RunDir held(tmp / "out", RunDirMode::Fresh);  // stands for a training in progress
  const auto r = sigma_cmd(kTiny + "--set train.steps=5 --out " + tmp / "out");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("is in use by another sigma train"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "out/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(tmp / "out/checkpoints"));
}

// A run without --out says at its start that nothing will be kept, and how to keep it.
TEST(RunDir, ARunWithoutOutSaysItSavesNothing) {
  TempDir tmp("rundir-no-out");
  const std::string line = "sigma train: no --out: this run saves nothing (no checkpoint, "
                           "metrics.jsonl or summary.json); to keep it, pass --out DIR\n";
  auto r = run_cmd("cd " + tmp.str() + " && " + SIGMA_BINARY + " " + kTiny + "--set train.steps=2");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find(line), 0u) << r.out;  // the first line, before any training
  EXPECT_TRUE(entries(tmp.str()).empty());
  r = sigma_cmd(kTiny + "--set train.steps=2 --out " + tmp / "out");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("no --out"), std::string::npos) << r.out;
}

TEST(RunDir, AnExistingRunIsRefusedUnlessResumedOrOverwritten) {
  TempDir tmp("rundir-out");
  auto r = sigma_cmd(kTiny + "--set train.steps=10 --set train.ckpt_every=5 --out " + tmp / "out");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string latest_before = resolve_checkpoint(tmp / "out/checkpoints");

  r = sigma_cmd(kTiny + "--set train.steps=5 --out " + tmp / "out");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("already holds a training run"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--overwrite"), std::string::npos) << r.out;
  EXPECT_EQ(resolve_checkpoint(tmp / "out/checkpoints"), latest_before) << "latest moved";
  EXPECT_EQ(logged_steps(tmp / "out"), (std::vector<int64_t>{5, 10}));

  r = sigma_cmd(kTiny + "--set train.steps=5 --overwrite --out " + tmp / "out");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(entries(tmp / "out/checkpoints"), (std::vector<std::string>{"latest", "step-00000005"}))
      << "the old run's later checkpoints must not stay mixed in";
  EXPECT_EQ(logged_steps(tmp / "out"), (std::vector<int64_t>{5}));
}

TEST(RunDir, LeftoversOfKilledSavesAreRemoved) {
  TempDir tmp("rundir-stale");
  fs::create_directories(tmp / "out/checkpoints/step-00000005.tmp-999999");
  fs::create_directories(tmp / "out/checkpoints/step-00000010.old-999998");
  std::ofstream(tmp / "out/checkpoints/step-00000005.tmp-999999/model.safetensors") << "partial";
  fs::create_directories(tmp / "out/checkpoints/step-00000003");  // not a leftover: kept
  RunDir d(tmp / "out", RunDirMode::Resume);
  EXPECT_EQ(d.stale_removed(), 2);
  EXPECT_EQ(entries(tmp / "out/checkpoints"), (std::vector<std::string>{"step-00000003"}));
}

TEST(RunDir, ResumeDropsTheMetricsOfStepsAfterTheCheckpoint) {
  TempDir tmp("rundir-metrics");
  fs::create_directories(tmp / "out");
  std::ofstream(tmp / "out/metrics.jsonl") << "{\"step\": 5}\n{\"step\": 10}\n{\"step\": 15}\n{\"ste";
  RunDir d(tmp / "out", RunDirMode::Resume);
  d.drop_metrics_after(10);
  EXPECT_EQ(d.metrics_dropped(), 2);
  EXPECT_EQ(logged_steps(tmp / "out"), (std::vector<int64_t>{5, 10}));
}

// A run killed after logging steps 15 and 20 but before checkpointing step 20 is resumed from
// step 10: metrics.jsonl ends with each step once.
TEST(RunDir, AResumedRunLogsEachStepOnce) {
  TempDir tmp("rundir-dup");
  auto r = sigma_cmd(kTiny + "--set train.steps=20 --set train.ckpt_every=10 --out " + tmp / "out");
  ASSERT_EQ(r.code, 0) << r.out;
  fs::remove_all(tmp / "out/checkpoints/step-00000020");  // as if killed before that save
  std::ofstream(tmp / "out/checkpoints/latest") << "step-00000010\n";
  r = sigma_cmd(kTiny + "--resume " + tmp / "out/checkpoints --out " + tmp / "out");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(logged_steps(tmp / "out"), (std::vector<int64_t>{5, 10, 15, 20}));
}

// Killed between the first checkpoint's rename and the first `latest`: the root resumes from
// the complete checkpoint nothing names yet.
TEST(RunDir, AFirstCheckpointWithoutLatestStillResumes) {
  TempDir tmp("rundir-first");
  auto r = sigma_cmd(kTiny + "--set train.steps=5 --out " + tmp / "out");
  ASSERT_EQ(r.code, 0) << r.out;
  fs::remove(tmp / "out/checkpoints/latest");
  fs::create_directories(tmp / "out/checkpoints/step-00000010.tmp-999999");  // a later, dead save
  EXPECT_EQ(resolve_checkpoint(tmp / "out/checkpoints"), tmp / "out/checkpoints/step-00000005");
  r = sigma_cmd(kTiny + "--set train.steps=8 --resume " + tmp / "out/checkpoints --out " + tmp / "out");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(resolve_checkpoint(tmp / "out/checkpoints"), tmp / "out/checkpoints/step-00000008");
  // An empty root still gets the old message.
  fs::create_directories(tmp / "empty");
  EXPECT_NE(error_of([&] { resolve_checkpoint(tmp / "empty"); }).find("neither"), std::string::npos);
}

}  // namespace
