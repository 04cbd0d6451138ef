// Distributed training through the CLI (DESIGN §9, docs/distributed.md): each test starts its
// own `mpirun -np R sigma train`. Data parallel + ZeRO-1 must be bit-identical to one process
// at the same global batch and threads per rank, checkpoints must reshard across rank counts,
// and a rank that dies or hangs must end the run within the timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "train/checkpoint.h"

using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

const std::string kMpirun = "mpirun --allow-run-as-root --oversubscribe --bind-to none -np ";

std::string train_args(const std::string& model, int steps, int accum) {
  return fmt::format("train --config {}/configs/tiny.json {} --set train.steps={} --set "
                     "train.accum={} --set train.batch=4 --set train.threads=1 --set "
                     "train.log_every=10 --set train.experts=model --quiet",
                     SIGMA_SOURCE_DIR, model, steps, accum);
}

CmdResult train_on(int ranks, const std::string& args) {
  if (ranks == 1) return sigma_cmd(args);
  return run_cmd(kMpirun + std::to_string(ranks) + " " + SIGMA_BINARY + " " + args);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// metrics.jsonl without the wall-clock field and the expert exchange's traffic (which depends
// on the rank count by nature).
std::string metrics_without_speed(const std::string& path) {
  std::string out, line;
  std::ifstream in(path);
  while (std::getline(in, line)) {
    size_t at = line.find("\"tokens_per_s\":");
    if (at != std::string::npos) line.erase(at, line.find_first_of(",}", at) - at);
    at = line.find("\"expert_exchange\":{");
    if (at != std::string::npos) line.erase(at, line.find('}', at) + 2 - at);  // and its comma
    out += line + "\n";
  }
  return out;
}

// The last record of a metrics.jsonl.
nlohmann::json last_metrics(const std::string& path) {
  std::string line, last;
  std::ifstream in(path);
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return nlohmann::json::parse(last);
}

const char* kDense = "--set model.rre_layers=0";

// A build configured with SIGMA_MPI=OFF (an old build directory keeps that cache entry) has no
// distributed training to test; CI configures afresh, where it is on.
#define SKIP_WITHOUT_MPI() \
  if (!SIGMA_HAS_MPI) GTEST_SKIP() << "built with SIGMA_MPI=OFF: reconfigure with -DSIGMA_MPI=ON"
const char* kSparse = "--set model.rre_layers=1";

}  // namespace

TEST(Distributed, OneTwoAndFourRanksTrainBitIdenticallyFor100Steps) {
  SKIP_WITHOUT_MPI();
  for (const char* model : {kDense, kSparse}) {
    TempDir t("dist");
    std::string first_model, first_metrics;
    for (int R : {1, 2, 4}) {
      const std::string out = t / ("r" + std::to_string(R));
      const CmdResult r = train_on(R, train_args(model, 100, 4) + " --out " + out);
      ASSERT_EQ(r.code, 0) << R << " ranks: " << r.out;
      const std::string weights = read_file(out + "/checkpoints/step-00000100/model.safetensors");
      const std::string metrics = metrics_without_speed(out + "/metrics.jsonl");
      ASSERT_FALSE(weights.empty());
      ASSERT_NE(metrics.find("\"step\":100"), std::string::npos);
      if (R == 1) {
        first_model = weights, first_metrics = metrics;
        continue;
      }
      EXPECT_TRUE(weights == first_model) << model << ": " << R << " ranks' weights differ";
      EXPECT_EQ(metrics, first_metrics) << model << ": " << R << " ranks' losses differ";
      // Each rank wrote its own optimizer shard under the one manifest.
      for (int r = 1; r < R; ++r)
        EXPECT_TRUE(fs::exists(fmt::format("{}/checkpoints/step-00000100/optimizer.rank-{:04d}.safetensors", out, r)));
    }
  }
}

TEST(Distributed, ACheckpointResumesOnAnyRankCountBitIdentically) {
  SKIP_WITHOUT_MPI();
  TempDir t("reshard");
  const std::string whole = t / "whole", split = t / "split";
  ASSERT_EQ(sigma_cmd(train_args(kSparse, 60, 4) + " --out " + whole).code, 0);
  CmdResult r = train_on(2, train_args(kSparse, 60, 4) + " --out " + split + " --stop-at 20");
  ASSERT_EQ(r.code, 0) << r.out;
  r = train_on(4, "train --resume " + split + "/checkpoints --out " + split + " --stop-at 40 --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  r = train_on(1, "train --resume " + split + "/checkpoints --out " + split + " --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(read_file(whole + "/checkpoints/step-00000060/model.safetensors") ==
              read_file(split + "/checkpoints/step-00000060/model.safetensors"));
  EXPECT_EQ(metrics_without_speed(whole + "/metrics.jsonl"), metrics_without_speed(split + "/metrics.jsonl"));
  // The 4-rank checkpoint is an ordinary checkpoint to every other command.
  const std::string ck = split + "/checkpoints/step-00000040";
  for (const std::string cmd : {"eval --ckpt " + ck, "inspect --ckpt " + ck,
                                "generate --ckpt " + ck + " --prompt '1 2 3' --max-new 4"}) {
    const CmdResult c = sigma_cmd(cmd);
    EXPECT_EQ(c.code, 0) << cmd << ": " << c.out;
  }
}

// Expert parallelism (train.experts = parallel, what auto picks with several ranks): each rank
// holds a share of every group's experts (dist.placement = spread), or each group lives on the
// ranks that run its micro-batches (by_group: with 4 ranks and 3 groups, groups on {0, 1}, {2}
// and {3}). 1, 2 and 4 ranks train the same bits for 100 steps; per-rank file stores train like
// RAM; and a checkpoint resumes on any rank count (2 -> 4 -> 1) bit-identically.
std::string ep_args(const std::string& placement, int steps) {
  return fmt::format("train --config {}/configs/tiny.json --set model.rre_layers=1 --set "
                     "train.steps={} --set train.accum=4 --set train.batch=4 --set "
                     "train.threads=1 --set train.log_every=10 --set train.experts=parallel "
                     "--set dist.placement={} --quiet", SIGMA_SOURCE_DIR, steps, placement);
}

// The weights of a run's checkpoint: model.safetensors and every expert group's files.
std::map<std::string, std::string> checkpoint_weights(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "model.safetensors" || name.starts_with("experts.")) files[name] = read_file(e.path());
  }
  return files;
}

TEST(Distributed, ExpertParallelRanksTrainBitIdenticallyAndReshard) {
  SKIP_WITHOUT_MPI();
  for (const std::string placement : {"spread", "by_group"}) {
    TempDir t("ep");
    std::map<std::string, std::string> first_weights;
    std::string first_metrics;
    for (int R : {1, 2, 4}) {
      const std::string out = t / ("r" + std::to_string(R));
      const CmdResult r = train_on(R, ep_args(placement, 100) + " --out " + out);
      ASSERT_EQ(r.code, 0) << placement << ", " << R << " ranks: " << r.out;
      const auto weights = checkpoint_weights(out + "/checkpoints/step-00000100");
      EXPECT_EQ(weights.size(), 1u + 2u * 3u) << "model + a weight and an Adam file per group";
      const std::string metrics = metrics_without_speed(out + "/metrics.jsonl");
      if (R == 1) {
        first_weights = weights, first_metrics = metrics;
        continue;
      }
      for (const auto& [name, bytes] : first_weights)
        EXPECT_TRUE(weights.at(name) == bytes) << placement << ", " << R << " ranks: " << name;
      EXPECT_EQ(metrics, first_metrics) << placement << ", " << R << " ranks";
    }
    if (placement == "spread") continue;
    // Per-rank store files, and a resume across rank counts, against the 100-step run above.
    const std::string split = t / "split", store = t / "experts.store";
    const std::string with_store = ep_args(placement, 100) + " --set train.expert_store=" + store;
    CmdResult r = train_on(2, with_store + " --out " + split + " --stop-at 40");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(fs::exists(store + ".rank-0000-of-0002") && fs::exists(store + ".rank-0001-of-0002"));
    r = train_on(4, "train --resume " + split + "/checkpoints --out " + split + " --stop-at 70 --quiet");
    ASSERT_EQ(r.code, 0) << r.out;
    r = train_on(1, "train --resume " + split + "/checkpoints --out " + split + " --quiet");
    ASSERT_EQ(r.code, 0) << r.out;
    // Compared tensor by tensor: model.safetensors embeds the config, which names the store.
    const sigma::TensorMap whole = sigma::read_model_tensors(t / "r1/checkpoints/step-00000100"),
                           resumed = sigma::read_model_tensors(split + "/checkpoints/step-00000100");
    ASSERT_EQ(whole.size(), resumed.size());
    for (const auto& [name, tensor] : whole)
      EXPECT_TRUE(std::memcmp(tensor.bytes(), resumed.at(name).bytes(), tensor.nbytes()) == 0)
          << "resumed: " << name;
    EXPECT_EQ(metrics_without_speed(split + "/metrics.jsonl"), first_metrics);
    // An ordinary checkpoint to every other command.
    const std::string ck = split + "/checkpoints/step-00000070";
    for (const std::string cmd : {"eval --ckpt " + ck, "inspect --ckpt " + ck,
                                  "generate --ckpt " + ck + " --prompt '1 2 3' --max-new 4"}) {
      const CmdResult c = sigma_cmd(cmd);
      EXPECT_EQ(c.code, 0) << cmd << ": " << c.out;
    }
  }
}

// The learned top-2 gate's expert-parallel path through `sigma train` (groups of 2, 3 and 4
// experts, capacity 1.25: choices are dropped): 1, 2 and 4 ranks write the same weights and
// metrics, a 2-rank run resumed on 1 rank ends where the uninterrupted run ends, and the gate's
// count exchange shows as one more collective per group and micro-batch than RRE's four.
TEST(Distributed, TheLearnedGateTrainsExpertParallelThroughSigma) {
  SKIP_WITHOUT_MPI();
  TempDir t("gate-ep");
  const std::string gate = ep_args("spread", 20) +
                           " --set model.router=top2 --set 'model.groups=[{\"name\":\"markov\","
                           "\"experts\":2},{\"name\":\"copy\",\"experts\":3},{\"name\":"
                           "\"arith\",\"experts\":4}]'";
  std::map<std::string, std::string> first;
  std::string first_metrics;
  for (int R : {1, 2, 4}) {
    const std::string out = t / ("r" + std::to_string(R));
    const CmdResult r = train_on(R, gate + " --out " + out);
    ASSERT_EQ(r.code, 0) << R << " ranks: " << r.out;
    const auto weights = checkpoint_weights(out + "/checkpoints/step-00000020");
    const std::string metrics = metrics_without_speed(out + "/metrics.jsonl");
    if (R == 1) {
      first = weights, first_metrics = metrics;
      EXPECT_NE(metrics.find("\"dropped\":{\"1\":"), std::string::npos) << metrics;
      continue;
    }
    for (const auto& [name, bytes] : first)
      EXPECT_TRUE(weights.at(name) == bytes) << R << " ranks: " << name;
    EXPECT_EQ(metrics, first_metrics) << R << " ranks";
  }
  const std::string split = t / "split";
  ASSERT_EQ(train_on(2, gate + " --out " + split + " --stop-at 10").code, 0);
  const CmdResult r = train_on(1, "train --resume " + split + "/checkpoints --out " + split + " --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(checkpoint_weights(split + "/checkpoints/step-00000020") == first) << "resumed 2 -> 1";
  // Calls per rank and step at 2 ranks: 2 micro-batches x 3 groups x 5 (the gate) against 4 (RRE).
  const nlohmann::json last = last_metrics(t / "r2/metrics.jsonl");
  EXPECT_EQ(last["expert_exchange"]["calls_per_rank_step"].get<double>(), 2 * 3 * 5) << last.dump();
}

// One rank fails at start-up (its store file is not a store) while the others go on into the
// first collective: every rank ends at once with that rank's error, not at dist.timeout_s.
TEST(Distributed, AnErrorOnOneRankEndsEveryRankAtOnce) {
  SKIP_WITHOUT_MPI();
  TempDir t("one-fails");
  const std::string store = t / "experts.store";
  std::ofstream(store + ".rank-0001-of-0002") << "not an expert store";
  const auto start = std::chrono::steady_clock::now();
  const CmdResult r = train_on(2, ep_args("spread", 10) + " --set train.expert_store=" + store +
                                      " --out " + (t / "o"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(store + ".rank-0001-of-0002"), std::string::npos) << r.out;
  EXPECT_LT(seconds, 60.0) << "dist.timeout_s is 300: the other rank waited for it";
}

TEST(Distributed, ABatchTheRanksCannotSplitIsRefusedClearly) {
  SKIP_WITHOUT_MPI();
  TempDir t("split");
  const CmdResult r = train_on(2, train_args(kDense, 5, 3) + " --out " + (t / "o"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("train.accum must be the number of ranks times a power of two"), std::string::npos) << r.out;
}

// Starts a long 2-rank run, waits for its first checkpoint, sends `signal` to rank 1 and
// returns the run's exit code, output and seconds from the signal to the end.
struct Fault {
  int code;
  std::string out;
  double seconds;
};
Fault fault_run(const TempDir& t, const std::string& signal) {
  const std::string out = t / "run", log = t / "log";
  const std::string cmd = fmt::format(
      "cd {} && ( {}2 {} {} --out {} --set train.ckpt_every=20 --set dist.timeout_s=5 > {} 2>&1; "
      "echo $? > {}/rc ) & "
      "for i in $(seq 1 1200); do [ -f {}/checkpoints/latest ] && break; sleep 0.05; done; "
      "m=$(pgrep -f 'mpirun.*--out {}' | head -1); victim=$(pgrep -P $m | tail -1); "
      "date +%s.%N > {}/t0; kill -{} $victim; wait; date +%s.%N > {}/t1",
      t.str(), kMpirun, SIGMA_BINARY, train_args(kDense, 1000000, 2), out, log, t.str(), out, out,
      t.str(), signal, t.str());
  const std::string script = t / "fault.sh";
  std::ofstream(script) << cmd << "\n";
  const CmdResult r = run_cmd("bash " + script);
  Fault f{-1, read_file(log) + r.out, 1e9};
  const std::string rc = read_file(t / "rc");
  if (!rc.empty()) f.code = std::stoi(rc);
  const std::string t0 = read_file(t / "t0"), t1 = read_file(t / "t1");
  if (!t0.empty() && !t1.empty()) f.seconds = std::stod(t1) - std::stod(t0);
  return f;
}

TEST(Distributed, AKilledRankEndsTheRunAndTheLastCheckpointResumes) {
  SKIP_WITHOUT_MPI();
  TempDir t("kill");
  const Fault f = fault_run(t, "9");
  EXPECT_NE(f.code, 0) << f.out;
  EXPECT_LT(f.seconds, 30.0) << f.out;
  EXPECT_NE(f.out.find("signal 9"), std::string::npos) << f.out;  // mpirun names the dead rank
  // The newest checkpoint verifies (its manifest's checksums) and training resumes from it.
  const std::string latest = read_file(t / "run/checkpoints/latest");
  ASSERT_GT(latest.size(), 5u);
  const int step = std::stoi(latest.substr(5));
  const CmdResult r = train_on(2, fmt::format("train --resume {}/checkpoints --out {} --set "
                               "train.steps={} --quiet", t / "run", t / "run", step + 10));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(fmt::format("{}/checkpoints/step-{:08d}/manifest.json", t / "run", step + 10)));
}

TEST(Distributed, AHungRankEndsTheRunAfterTheTimeout) {
  SKIP_WITHOUT_MPI();
  TempDir t("hang");
  const Fault f = fault_run(t, "STOP");
  EXPECT_NE(f.code, 0) << f.out;
  EXPECT_GT(f.seconds, 4.0) << f.out;   // dist.timeout_s = 5
  EXPECT_LT(f.seconds, 60.0) << f.out;
  EXPECT_NE(f.out.find("a rank died or hangs"), std::string::npos) << f.out;
  EXPECT_EQ(sigma_cmd("inspect --ckpt " + (t / "run") + "/checkpoints").code, 0);
}
