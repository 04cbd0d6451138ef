// Distributed training through the CLI (DESIGN §9, docs/distributed.md): each test starts its
// own `mpirun -np R sigma train`. Data parallel + ZeRO-1 must be bit-identical to one process
// at the same global batch and threads per rank, checkpoints must reshard across rank counts,
// and a rank that dies or hangs must end the run within the timeout.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ckpt_compare.h"
#include "cli_util.h"
#include "dist/communicator.h"
#include "io/checkpoint_shards.h"
#include "run/checkpoint.h"
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
      const std::string weights = weight_bits(out + "/checkpoints/step-00000100");
      const std::string metrics = metrics_without_speed(out + "/metrics.jsonl");
      ASSERT_FALSE(weights.empty());
      ASSERT_NE(metrics.find("\"step\":100"), std::string::npos);
      if (R == 1) {
        first_model = weights, first_metrics = metrics;
        continue;
      }
      EXPECT_TRUE(weights == first_model) << model << ": " << R << " ranks' weights differ";
      EXPECT_EQ(metrics, first_metrics) << model << ": " << R << " ranks' losses differ";
      // Each rank wrote its own shard (dist.ckpt_layout = sharded, the default of several
      // ranks) under the one manifest.
      for (int r = 0; r < R; ++r)
        EXPECT_TRUE(fs::exists(fmt::format("{}/checkpoints/step-00000100/shard-{:04d}.adam.safetensors", out, r)));
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
  EXPECT_EQ(tensor_difference(whole + "/checkpoints/step-00000060", split + "/checkpoints/step-00000060"), "");
  EXPECT_EQ(metrics_without_speed(whole + "/metrics.jsonl"), metrics_without_speed(split + "/metrics.jsonl"));
  // The 4-rank checkpoint is an ordinary checkpoint to every other command.
  const std::string ck = split + "/checkpoints/step-00000040";
  for (const std::string& cmd : {"eval --ckpt " + ck, "inspect --ckpt " + ck,
                                "generate --ckpt " + ck + " --prompt '1 2 3' --max-new 4"}) {
    const CmdResult c = sigma_cmd(cmd);
    EXPECT_EQ(c.code, 0) << cmd << ": " << c.out;
  }
}

// Warnings about a resumed run's config come before the ranks have met: each rank used to
// print its own copy (2 lines at 2 ranks); rank 0 says it once.
TEST(Distributed, AResumeWarnsOnceNotOncePerRank) {
  SKIP_WITHOUT_MPI();
  TempDir t("warn-once");
  const std::string out = t / "run";
  CmdResult r = train_on(2, train_args(kDense, 4, 2) + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  r = train_on(2, "train --resume " + out + "/checkpoints --out " + out + " --set train.steps=6 --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  size_t said = 0;
  for (size_t at = 0; (at = r.out.find("the learning-rate schedule changes", at)) != std::string::npos; ++at)
    ++said;
  EXPECT_EQ(said, 1u) << r.out;
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

// The expert group files of a checkpoint (a one-process run's: whole layout).
int expert_group_files(const std::string& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string().starts_with("experts.");
  return n;
}

TEST(Distributed, ExpertParallelRanksTrainBitIdenticallyAndReshard) {
  SKIP_WITHOUT_MPI();
  for (const std::string placement : {"spread", "by_group"}) {
    TempDir t("ep");
    std::string first_metrics;
    for (int R : {1, 2, 4}) {
      const std::string out = t / ("r" + std::to_string(R));
      const CmdResult r = train_on(R, ep_args(placement, 100) + " --out " + out);
      ASSERT_EQ(r.code, 0) << placement << ", " << R << " ranks: " << r.out;
      const std::string metrics = metrics_without_speed(out + "/metrics.jsonl");
      if (R == 1) {
        EXPECT_EQ(expert_group_files(out + "/checkpoints/step-00000100"), 2 * 3)
            << "a weight and an Adam file per group";
        first_metrics = metrics;
        continue;
      }
      EXPECT_EQ(tensor_difference(t / "r1/checkpoints/step-00000100", out + "/checkpoints/step-00000100"), "")
          << placement << ", " << R << " ranks";
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
    for (const std::string& cmd : {"eval --ckpt " + ck, "inspect --ckpt " + ck,
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
  std::string first_metrics;
  const std::string first = t / "r1/checkpoints/step-00000020";
  for (int R : {1, 2, 4}) {
    const std::string out = t / ("r" + std::to_string(R));
    const CmdResult r = train_on(R, gate + " --out " + out);
    ASSERT_EQ(r.code, 0) << R << " ranks: " << r.out;
    const std::string metrics = metrics_without_speed(out + "/metrics.jsonl");
    if (R == 1) {
      first_metrics = metrics;
      EXPECT_NE(metrics.find("\"dropped\":{\"1\":"), std::string::npos) << metrics;
      continue;
    }
    EXPECT_EQ(tensor_difference(first, out + "/checkpoints/step-00000020"), "") << R << " ranks";
    EXPECT_EQ(metrics, first_metrics) << R << " ranks";
  }
  const std::string split = t / "split";
  ASSERT_EQ(train_on(2, gate + " --out " + split + " --stop-at 10").code, 0);
  const CmdResult r = train_on(1, "train --resume " + split + "/checkpoints --out " + split + " --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(tensor_difference(split + "/checkpoints/step-00000020", first), "") << "resumed 2 -> 1";
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

// The global batch is the setting: ranks that cannot share its micro-batches as given get
// smaller ones (the same rows), bit-identical to one rank run with those; a global batch the
// ranks cannot share at all is refused with the nearest valid values.
TEST(Distributed, RanksShareTheGlobalBatchOrAreRefusedWithTheNearestValidValues) {
  SKIP_WITHOUT_MPI();
  TempDir t("split");
  // 4 x 3 = 12 rows on 2 ranks: 3 micro-batches cannot be shared, 4 of 3 rows can.
  CmdResult r = train_on(2, train_args(kDense, 6, 3) + " --out " + (t / "two"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = train_on(1, train_args(kDense, 6, 4) + " --set train.batch=3 --out " + (t / "one"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(tensor_difference(t / "two/checkpoints/step-00000006", t / "one/checkpoints/step-00000006"), "");
  EXPECT_EQ(metrics_without_speed(t / "two/metrics.jsonl"), metrics_without_speed(t / "one/metrics.jsonl"));
  // The setting users think in: train.global_batch, train.accum derived.
  r = train_on(2, train_args(kDense, 6, 1) + " --set train.global_batch=12 --set train.batch=3 "
               "--out " + (t / "global"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(tensor_difference(t / "global/checkpoints/step-00000006", t / "one/checkpoints/step-00000006"), "");
  // 10 rows on 4 ranks cannot be shared; nothing is left behind.
  r = train_on(4, train_args(kDense, 5, 1) + " --set train.global_batch=10 --set train.batch=5 "
               "--out " + (t / "o"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("4 ranks cannot share a global batch of 10 rows"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nearest valid: train.global_batch = 8 (with train.batch = 2) or 12 (with "
                       "train.batch = 3), or mpirun -np 2 or 5"), std::string::npos) << r.out;
  // Said once, by rank 0, not by each of the 4 ranks.
  size_t said = 0;
  for (size_t at = r.out.find("cannot share a global batch"); at != std::string::npos;
       at = r.out.find("cannot share a global batch", at + 1))
    ++said;
  EXPECT_EQ(said, 1u) << r.out;
  EXPECT_FALSE(fs::exists(t / "o/metrics.jsonl"));
}

// mpirun -np 2 sigma train with nothing set: the main job's batch (1 x 24 rows) is shared.
TEST(Distributed, TheDefaultJobRunsOnTwoRanks) {
  SKIP_WITHOUT_MPI();
  const CmdResult r = train_on(2, "train --set train.steps=2 --set train.threads=1 --set "
                               "train.eval_rows=8");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("2 ranks share the global batch of 24 rows as 2 micro-batches of 12 rows"),
            std::string::npos) << r.out;
}

// Ranks started with different configs or seeds: one line naming the first differing key and
// the ranks on each side; every rank stops (mpirun exits non-zero) before any step.
TEST(Distributed, RanksStartedDifferentlyStopWithOneLine) {
  SKIP_WITHOUT_MPI();
  TempDir t("disagree");
  const std::string mpmd = "mpirun --allow-run-as-root --oversubscribe --bind-to none ";
  auto part = [&](int n, const std::string& extra) {
    return fmt::format("-np {} {} {} {}", n, SIGMA_BINARY, train_args(kDense, 3, 3), extra);
  };
  struct Case {
    std::string a, b, expect;
  };
  for (const Case& c : {Case{"--set train.seed=1", "--set train.seed=7",
                             "train.seed is 1 on ranks 0-1, 7 on rank 2"},
                        Case{"", "--set model.d_model=48",
                             "model.d_model is 32 on ranks 0-1, 48 on rank 2"}}) {
    const CmdResult r = run_cmd(mpmd + part(2, c.a + " --out " + (t / "x")) + " : " + part(1, c.b));
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("the ranks were started differently: " + c.expect), std::string::npos) << r.out;
    size_t lines = 0;
    for (size_t at = r.out.find("sigma: error:"); at != std::string::npos; at = r.out.find("sigma: error:", at + 1))
      ++lines;
    EXPECT_EQ(lines, 1u) << r.out;
    EXPECT_FALSE(fs::exists(t / "x/metrics.jsonl"));
  }
}

// A config every rank reads alike and refuses (a malformed --set value, a missing config
// file) is said once, by rank 0, and the run ends at once: each rank printed its own copy.
TEST(Distributed, ABadConfigIsSaidOnceNotOncePerRank) {
  SKIP_WITHOUT_MPI();
  for (const std::string& bad : {std::string("--set 'train.freeze=[\"shared\"'"),
                                 std::string("--config /nonexistent/sigma.json")}) {
    const CmdResult r = train_on(4, train_args(kDense, 3, 4) + " " + bad);
    EXPECT_NE(r.code, 0) << bad << ": " << r.out;
    size_t lines = 0;
    for (size_t at = r.out.find("sigma: error:"); at != std::string::npos; at = r.out.find("sigma: error:", at + 1))
      ++lines;
    EXPECT_EQ(lines, 1u) << bad << ": " << r.out;
  }
}

// Ranks given different dist.tp split the world differently: the agreement runs on the world
// before any split, so they stop at once with the key named (before, each waited in its own
// split for dist.timeout_s, 300 s by default, and blamed "rank 0 never entered it").
TEST(Distributed, RanksGivenDifferentTpStopAtOnceNamingIt) {
  SKIP_WITHOUT_MPI();
  TempDir t("disagree_tp");
  const std::string args = fmt::format("{} {} --set dist.timeout_s=25",
                                       SIGMA_BINARY, train_args(kDense, 3, 2));
  const auto t0 = std::chrono::steady_clock::now();
  const CmdResult r = run_cmd("timeout 60 mpirun --allow-run-as-root --oversubscribe --bind-to none "
                              "-np 1 " + args + " --set dist.tp=2 --out " + (t / "x") +
                              " : -np 1 " + args + " --set dist.tp=1");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(s, 15.0) << r.out;
  EXPECT_NE(r.out.find("the ranks were started differently: dist.tp is 2 on rank 0, 1 on rank 1"),
            std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("never entered"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(t / "x/metrics.jsonl"));
}

// --out must be on a filesystem every rank sees (each writes its checkpoint files there): a
// rank that cannot see it (here rank 1, under a tmpfs mounted over the test's folder in a
// mount namespace of its own, as a host without the shared filesystem would) is refused at
// start, once, naming it; before, it trained and failed at the first checkpoint.
TEST(Distributed, ARankThatCannotSeeTheRunFolderIsRefused) {
  SKIP_WITHOUT_MPI();
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (a private mount for one rank)";
  // unshare -m makes "/" private, which fails (EINVAL) where "/" is not a mount point: a chroot
  // such as scripts/check-fresh-install.sh's root.
  if (std::system("mountpoint -q /") != 0) GTEST_SKIP() << "/ is not a mount point here (a chroot?)";
  TempDir t("blind");
  const std::string wrap = t / "rank.sh";
  std::ofstream(wrap) << "#!/bin/sh\n"
                         "[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] || exec \"$@\"\n"
                         "exec unshare -m sh -c 'mount -t tmpfs none \"$0\" && exec \"$@\"' "
                      << t.str() << " \"$@\"\n";
  fs::permissions(wrap, fs::perms::owner_all);
  const CmdResult r = run_cmd(fmt::format("timeout 120 {}2 {} {} {} --out {}", kMpirun, wrap,
                                          SIGMA_BINARY, train_args(kDense, 3, 2), t / "x"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rank 1 (on "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cannot see the run folder " + (t / "x")), std::string::npos) << r.out;
  size_t lines = 0;
  for (size_t at = r.out.find("sigma: error:"); at != std::string::npos; at = r.out.find("sigma: error:", at + 1))
    ++lines;
  EXPECT_EQ(lines, 1u) << r.out;
  EXPECT_FALSE(fs::exists(t / "x/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(t / "x/.sigma-shared-check"));
}

// Collectives longer than one MPI message go in chunks (here of 5 elements; in a run, of 2^30)
// and give what one message gives. Runs as DistributedChild under mpirun -np 3.
TEST(Distributed, ChunkedCollectivesGiveTheSameResults) {
  SKIP_WITHOUT_MPI();
  const CmdResult r = run_cmd("SIGMA_TEST_CHILD=1 " + kMpirun + "3 /proc/" + std::to_string(getpid()) +
                              "/exe --gtest_color=no --gtest_filter=DistributedChild.* 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("[  PASSED  ] 1 test"), std::string::npos) << r.out;
}

TEST(DistributedChild, ChunkedCollectives) {
  if (!std::getenv("SIGMA_TEST_CHILD")) GTEST_SKIP() << "started by Distributed.ChunkedCollectives...";
  auto world = sigma::make_world(60);
  const int R = world->size(), me = world->rank();
  ASSERT_EQ(R, 3);
  auto value = [](int rank, size_t i) { return float(rank * 1000 + int(i)) * 0.37f + 1.0f / float(i + 1); };
  for (size_t chunk : {size_t(1) << 30, size_t(5)}) {
    sigma::set_max_message_elements(chunk);
    for (size_t n : {size_t(0), size_t(1), size_t(5), size_t(13)}) {
      // all_gather
      std::vector<float> in(n), out(n * 3);
      for (size_t i = 0; i < n; ++i) in[i] = value(me, i);
      world->all_gather(out.data(), in.data(), n);
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[size_t(r) * n + i], value(r, i)) << chunk << " " << n;
      // all_reduce_sum and reduce_scatter_sum: tree_sum over the ranks' parts
      std::vector<float> parts(3 * n), want(n);
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < n; ++i) parts[size_t(r) * n + i] = value(r, i);
      const float* p[3] = {parts.data(), parts.data() + n, parts.data() + 2 * n};
      sigma::tree_sum(want.data(), p, 3, int64_t(n));
      std::vector<float> sum = in;
      world->all_reduce_sum(sum.data(), n);
      ASSERT_EQ(sum, want) << chunk << " " << n;
      std::vector<float> full(3 * n), mine(n);
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < n; ++i) full[size_t(r) * n + i] = value(me, size_t(r) * n + i);
      world->reduce_scatter_sum(mine.data(), full.data(), n);
      for (int r = 0; r < R; ++r)
        for (size_t i = 0; i < n; ++i) parts[size_t(r) * n + i] = value(r, size_t(me) * n + i);
      sigma::tree_sum(want.data(), p, 3, int64_t(n));
      ASSERT_EQ(mine, want) << chunk << " " << n;
      // all_gather_v and all_to_all_v with uneven counts: rank r sends n + r + q to rank q
      std::vector<int64_t> counts{int64_t(n), int64_t(n + 4), int64_t(2 * n + 1)};
      std::vector<float> v(static_cast<size_t>(counts[size_t(me)])), gathered(4 * n + 5);
      for (size_t i = 0; i < v.size(); ++i) v[i] = value(me, i);
      world->all_gather_v(gathered.data(), v.data(), counts.data());
      size_t at = 0;
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < counts[size_t(r)]; ++i) ASSERT_EQ(gathered[at++], value(r, size_t(i)));
      std::vector<int64_t> sc(3), rc(3);
      for (int q = 0; q < R; ++q) sc[size_t(q)] = int64_t(n) + me + q, rc[size_t(q)] = int64_t(n) + q + me;
      std::vector<float> send, recv(size_t(rc[0] + rc[1] + rc[2]));
      for (int q = 0; q < R; ++q)
        for (int64_t i = 0; i < sc[size_t(q)]; ++i) send.push_back(value(me, size_t(q * 100 + i)));
      world->all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
      at = 0;
      for (int q = 0; q < R; ++q)
        for (int64_t i = 0; i < rc[size_t(q)]; ++i) ASSERT_EQ(recv[at++], value(q, size_t(me * 100 + i)));
      // The non-blocking calls (dist.overlap): two of each in flight at once, a blocking call
      // between, completed out of order, give what the blocking calls give.
      std::vector<float> recv2(recv.size()), gathered2(gathered.size());
      auto a2a = world->start_all_to_all_v(send.data(), sc.data(), recv2.data(), rc.data());
      auto agv = world->start_all_gather_v(gathered2.data(), v.data(), counts.data());
      std::vector<float> recv3(recv.size());
      auto a2a3 = world->start_all_to_all_v(send.data(), sc.data(), recv3.data(), rc.data());
      std::vector<float> sum2 = in;
      world->all_reduce_sum(sum2.data(), n);
      ASSERT_EQ(sum2, sum);
      while (!agv->test()) {
      }
      a2a3->wait();
      a2a->wait();
      ASSERT_EQ(recv2, recv) << chunk << " " << n;
      ASSERT_EQ(recv3, recv) << chunk << " " << n;
      ASSERT_EQ(gathered2, gathered) << chunk << " " << n;
      // broadcast of bytes
      std::vector<char> bytes(n * 3 + 1, char(me == 1 ? 'x' : 'y'));
      world->broadcast(bytes.data(), bytes.size(), 1);
      for (char c : bytes) ASSERT_EQ(c, 'x');
    }
  }
  world->barrier();
}

// dist.overlap (ZeRO's exchanges hidden behind compute) trains the same bits as the blocking
// exchanges, dense and RRE, ZeRO-1 and -2, with one and with two micro-batches per rank.
TEST(Distributed, OverlapOnAndOffTrainTheSameBits) {
  SKIP_WITHOUT_MPI();
  for (const char* model : {kDense, kSparse})
    for (const char* more : {"--set dist.zero=1", "--set dist.zero=2 --set train.experts=auto"})
      for (int accum : {4, 8}) {
        TempDir t("overlap");
        std::string weights[2], metrics[2];
        for (int on : {0, 1}) {
          const std::string out = t / ("o" + std::to_string(on));
          const CmdResult r = train_on(4, train_args(model, 12, accum) + " " + more +
                                              " --set dist.overlap=" + (on ? "true" : "false") +
                                              " --set train.ckpt_every=6 --set train.keep_checkpoints=0 --out " + out);
          ASSERT_EQ(r.code, 0) << r.out;
          // The step-6 checkpoint is written between steps, where a deferred gather must have
          // been completed first.
          weights[on] = weight_bits(out + "/checkpoints/step-00000006") +
                        weight_bits(out + "/checkpoints/step-00000012");
          metrics[on] = metrics_without_speed(out + "/metrics.jsonl");
          ASSERT_FALSE(weights[on].empty());
        }
        const std::string what = fmt::format("{} {} accum {}", model, more, accum);
        size_t at = 0;
        while (at < weights[0].size() && at < weights[1].size() && weights[0][at] == weights[1][at]) ++at;
        EXPECT_TRUE(weights[0] == weights[1]) << what << ": the weights differ (" << weights[0].size()
                                              << " and " << weights[1].size() << " bytes, first at " << at << ")";
        EXPECT_EQ(metrics[0], metrics[1]) << what;
      }
}

// dist.zero = 3 (each rank keeps only the values it owns between steps and gathers each stage
// before a pass reads it) trains the bits of ZeRO-1 on 4 ranks, dense and RRE, with and without
// dist.overlap, across a save and a resume: the ZeRO-3 run stops at step 6 (whole checkpoint
// layout, with a held-out evaluation at step 3 between steps) and resumes to 12 (sharded layout).
TEST(Distributed, ZeroStage3TrainsTheBitsOfStage1AcrossASaveAndResume) {
  SKIP_WITHOUT_MPI();
  for (const char* model : {kDense, kSparse})
    for (const char* overlap : {"false", "true"}) {
      TempDir t("zero3");
      const std::string one = t / "z1", three = t / "z3";
      const std::string what = fmt::format("{} overlap {}", model, overlap);
      const std::string args = train_args(model, 12, 4) + " --set dist.overlap=" + overlap +
                               " --set train.ckpt_every=6 --set train.keep_checkpoints=0 "
                               "--set train.eval_every=3 --set train.log_every=3";
      CmdResult r = train_on(4, args + " --set dist.zero=1 --out " + one);
      ASSERT_EQ(r.code, 0) << what << ": " << r.out;
      r = train_on(4, args + " --set dist.zero=3 --set dist.ckpt_layout=whole --stop-at 6 --out " + three);
      ASSERT_EQ(r.code, 0) << what << ": " << r.out;
      r = train_on(4, "train --resume " + three + "/checkpoints --out " + three + " --set dist.zero=3 "
                   "--set dist.ckpt_layout=sharded --set dist.overlap=" + overlap + " --quiet");
      ASSERT_EQ(r.code, 0) << what << ": " << r.out;
      for (const char* step : {"/checkpoints/step-00000006", "/checkpoints/step-00000012"}) {
        const auto a = sigma::read_model_tensors(one + step), b = sigma::read_model_tensors(three + step);
        ASSERT_EQ(a.size(), b.size()) << what << step;
        for (const auto& [name, tensor] : a) {
          ASSERT_TRUE(b.count(name)) << what << step << ": " << name;
          EXPECT_TRUE(tensor.nbytes() == b.at(name).nbytes() &&
                      std::memcmp(tensor.bytes(), b.at(name).bytes(), tensor.nbytes()) == 0)
              << what << step << ": " << name << " differs";
        }
      }
      EXPECT_EQ(metrics_without_speed(one + "/metrics.jsonl"), metrics_without_speed(three + "/metrics.jsonl"))
          << what;
    }
}

// A vocabulary of 16,384 makes the embedding table (16,384 rows of 32) most of the tiny model:
// ZeRO cuts it into row runs over the ranks (parallel/shard_plan.h). Each rank's files of a
// sharded ZeRO-3 checkpoint are then within 1.2x of the mean (whole tensors left one rank
// holding the table), and the run trains one process's bits across a save on 4 ranks, a
// resume on 2 with the whole layout (the cut Adam state assembled) and one on 1; with lazy
// embedding rows too, whose per-row step counts are cut alike.
TEST(Distributed, ABigEmbeddingIsCutOverTheRanksAndReshardsBitIdentically) {
  SKIP_WITHOUT_MPI();
  for (const char* sparse : {"false", "true"}) {
    TempDir t("cut");
    const std::string one = t / "one", cut = t / "cut";
    const std::string what = fmt::format("optim.sparse_embeddings={}", sparse);
    const std::string args = train_args(kSparse, 12, 4) + " --set model.vocab=16384 --set "
                             "optim.sparse_embeddings=" + sparse + " --set train.ckpt_every=4 "
                             "--set train.keep_checkpoints=0 --set train.log_every=2";
    CmdResult r = sigma_cmd(args + " --out " + one);
    ASSERT_EQ(r.code, 0) << what << ": " << r.out;
    r = train_on(4, args + " --set dist.zero=3 --stop-at 4 --out " + cut);
    ASSERT_EQ(r.code, 0) << what << ": " << r.out;
    const std::string four = cut + "/checkpoints/step-00000004";
    std::vector<double> bytes;
    for (int k = 0; k < 4; ++k)
      bytes.push_back(double(fs::file_size(four + "/" + sigma::shard_file(k, false)) +
                             fs::file_size(four + "/" + sigma::shard_file(k, true))));
    const double mean = (bytes[0] + bytes[1] + bytes[2] + bytes[3]) / 4;
    EXPECT_LE(*std::max_element(bytes.begin(), bytes.end()), 1.2 * mean)
        << what << ": " << fmt::format("{}", bytes);
    EXPECT_EQ(tensor_difference(one + "/checkpoints/step-00000004", four, true), "") << what;
    r = train_on(2, "train --resume " + cut + "/checkpoints --out " + cut +
                        " --set dist.ckpt_layout=whole --stop-at 8 --quiet");
    ASSERT_EQ(r.code, 0) << what << ": " << r.out;
    EXPECT_EQ(tensor_difference(one + "/checkpoints/step-00000008", cut + "/checkpoints/step-00000008", true), "")
        << what;
    r = train_on(1, "train --resume " + cut + "/checkpoints --out " + cut + " --quiet");
    ASSERT_EQ(r.code, 0) << what << ": " << r.out;
    EXPECT_EQ(tensor_difference(one + "/checkpoints/step-00000012", cut + "/checkpoints/step-00000012", true), "")
        << what;
    EXPECT_EQ(metrics_without_speed(one + "/metrics.jsonl"), metrics_without_speed(cut + "/metrics.jsonl"))
        << what;
  }
}

// Host-first sums and gathers (dist/host_first.h) in training: 4 ranks as 2 faked hosts of 2
// (SIGMA_TEST_HOSTS; the simulated cluster's test has real ones) send ZeRO's gradients,
// gathers and the experts' all-reduces host-first, and train the bits of the same 4 ranks on
// one host (direct): ZeRO-1 blocking, ZeRO-2 overlapped with experts parallel, ZeRO-3
// overlapped.
TEST(Distributed, HostFirstSumsOnFakedHostsTrainTheBitsOfOneHost) {
  SKIP_WITHOUT_MPI();
  for (const auto& [model, more] : std::vector<std::pair<const char*, const char*>>{
           {kDense, "--set dist.zero=1 --set dist.overlap=false"},
           {kSparse, "--set dist.zero=2 --set dist.overlap=true --set train.experts=auto"},
           {kSparse, "--set dist.zero=3 --set dist.overlap=true"}}) {
    TempDir t("host_first");
    std::string weights[2], metrics[2];
    for (int fake : {0, 1}) {
      const std::string out = t / ("h" + std::to_string(fake));
      const CmdResult r = run_cmd(std::string(fake ? "SIGMA_TEST_HOSTS=0,0,1,1 " : "") + kMpirun +
                                  "4 " + SIGMA_BINARY + " " + train_args(model, 8, 4) + " " + more +
                                  " --set train.ckpt_every=8 --out " + out);
      ASSERT_EQ(r.code, 0) << r.out;
      weights[fake] = weight_bits(out + "/checkpoints/step-00000008");
      metrics[fake] = metrics_without_speed(out + "/metrics.jsonl");
      ASSERT_FALSE(weights[fake].empty());
    }
    EXPECT_TRUE(weights[0] == weights[1]) << model << " " << more << ": the weights differ";
    EXPECT_EQ(metrics[0], metrics[1]) << model << " " << more;
  }
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
  EXPECT_NE(f.out.find("rank 1 never entered it (waiting: rank 0)"), std::string::npos) << f.out;
  EXPECT_EQ(sigma_cmd("inspect --ckpt " + (t / "run") + "/checkpoints").code, 0);
}
