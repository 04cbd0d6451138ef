// Sharded checkpoints (dist.ckpt_layout = sharded, docs/checkpoints.md): each rank writes its
// own tp slices, experts and ZeRO shard; readers assemble them whole. Under mpirun.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/checkpoint_dir.h"
#include "io/checkpoint_shards.h"
#include "run/checkpoint.h"
#include "cli_util.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

#define SKIP_WITHOUT_MPI() \
  if (!SIGMA_HAS_MPI) GTEST_SKIP() << "built with SIGMA_MPI=OFF: reconfigure with -DSIGMA_MPI=ON"

const char* kShardDense = "--set model.rre_layers=0 --set train.experts=model";
const char* kShardRre = "--set model.rre_layers=1 --set train.experts=parallel";
const char* kShardInModelRre = "--set model.rre_layers=1 --set train.experts=model";

std::string shard_args(const std::string& model, int steps, int tp, const std::string& layout) {
  return fmt::format("train --config {}/configs/tiny.json {} --set model.heads=4 --set "
                     "train.steps={} --set train.accum=4 --set train.batch=4 --set "
                     "train.threads=1 --set train.log_every=2 --set train.eval_rows=8 --set "
                     "train.ckpt_every=4 --set dist.tp={} --set dist.ckpt_layout={} --quiet",
                     SIGMA_SOURCE_DIR, model, steps, tp, layout);
}

CmdResult ranks(int R, const std::string& args) {
  return run_cmd(fmt::format("OMP_WAIT_POLICY=passive mpirun --allow-run-as-root --oversubscribe "
                             "--bind-to none -np {} {} {}", R, SIGMA_BINARY, args));
}

// Every tensor's name and bytes, in name order.
std::string bytes_of(const TensorMap& m) {
  std::string out;
  for (const auto& [name, t] : m)
    out += name + std::string(reinterpret_cast<const char*>(t.bytes()), t.nbytes());
  return out;
}

std::vector<double> losses(const std::string& metrics) {
  std::vector<double> v;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) {
      const auto j = nlohmann::json::parse(line);
      v.push_back(j["loss"].get<double>());
      v.push_back(j["grad_norm"].get<double>());
    }
  return v;
}

std::string ck(const std::string& out, int step) {
  return fmt::format("{}/checkpoints/step-{:08d}", out, step);
}

}  // namespace

// At (tp 2, dp 2) on 4 ranks each rank writes its own two shard files (no model.safetensors),
// they assemble into exactly the tensors the whole layout writes, and a run stopped at step 4
// and resumed at the same layout ends bit-identical to the uninterrupted run. Dense, RRE with
// parallel experts (each rank's store records) and RRE in the model (the stacks' tp slices).
TEST(ShardedCheckpoint, AssemblesToTheWholeTensorsAndResumesBitIdentically) {
  SKIP_WITHOUT_MPI();
  for (const char* model : {kShardDense, kShardRre, kShardInModelRre}) {
    TempDir t("shard");
    const std::string whole = t / "whole", sharded = t / "sharded", stopped = t / "stopped";
    CmdResult r = ranks(4, shard_args(model, 8, 2, "whole") + " --out " + whole);
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, shard_args(model, 8, 2, "sharded") + " --out " + sharded);
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, shard_args(model, 8, 2, "sharded") + " --out " + stopped + " --stop-at 4");
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, "train --quiet --resume " + stopped + "/checkpoints --out " + stopped);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string s8 = ck(sharded, 8), w8 = ck(whole, 8);
    EXPECT_TRUE(is_sharded_checkpoint(s8)) << model;
    EXPECT_FALSE(is_sharded_checkpoint(w8)) << model;
    EXPECT_FALSE(fs::exists(s8 + "/" + kModelFile)) << model;
    for (int i = 0; i < 4; ++i)
      for (bool adam : {false, true})
        EXPECT_TRUE(fs::exists(s8 + "/" + shard_file(i, adam))) << model << ": " << shard_file(i, adam);
    EXPECT_EQ(sharded_files(s8, false).size(), 4u) << model;
    // The layout changes only the files: the same training, the same tensors bit for bit.
    EXPECT_EQ(losses(sharded + "/metrics.jsonl"), losses(whole + "/metrics.jsonl")) << model;
    const TensorMap sm = read_model_tensors(s8), wm = read_model_tensors(w8);
    EXPECT_FALSE(sm.empty());
    EXPECT_TRUE(bytes_of(sm) == bytes_of(wm)) << model << ": the shards assemble to other weights";
    EXPECT_TRUE(bytes_of(read_optimizer_tensors(s8)) == bytes_of(read_optimizer_tensors(w8)))
        << model << ": the shards assemble to another Adam state";
    // Stopped at 4 and resumed at the same layout: the uninterrupted run's files, byte for byte.
    EXPECT_EQ(losses(stopped + "/metrics.jsonl"), losses(sharded + "/metrics.jsonl")) << model;
    for (const std::string& f : sharded_files(s8, false)) {
      std::ifstream a(s8 + "/" + f, std::ios::binary), b(ck(stopped, 8) + "/" + f, std::ios::binary);
      std::stringstream x, y;
      x << a.rdbuf(), y << b.rdbuf();
      EXPECT_TRUE(x.str() == y.str()) << model << ": " << f << " differs after the resume";
    }
    EXPECT_TRUE(bytes_of(read_optimizer_tensors(ck(stopped, 8))) == bytes_of(read_optimizer_tensors(s8))) << model;
  }
}

// train.ckpt_async on 4 ranks (tp 2, dp 2): the saves are written in the background (summary.json
// counts them) and hold the foreground run's tensors bit for bit; a run stopped at step 4 and
// resumed from its background checkpoint ends with the uninterrupted runs' files (issue 38).
TEST(ShardedCheckpoint, BackgroundSavesHoldTheForegroundTensorsAndResumeBitIdentically) {
  SKIP_WITHOUT_MPI();
  for (const char* model : {kShardDense, kShardRre}) {
    TempDir t("shard-bg");
    const std::string fg = t / "fg", bg = t / "bg", stopped = t / "stopped";
    auto args = [&](bool async) {
      return shard_args(model, 8, 2, "sharded") + fmt::format(" --set train.ckpt_async={}", async);
    };
    CmdResult r = ranks(4, args(false) + " --out " + fg);
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, args(true) + " --out " + bg);
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, args(true) + " --out " + stopped + " --stop-at 4");
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, "train --quiet --resume " + stopped + "/checkpoints --out " + stopped);
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream in(bg + "/summary.json");
    const auto summary = nlohmann::json::parse(in);
    ASSERT_TRUE(summary.contains("background_saves")) << model << ": not saved in the background";
    EXPECT_EQ(summary["background_saves"]["saves"], 2) << model;
    EXPECT_EQ(losses(bg + "/metrics.jsonl"), losses(fg + "/metrics.jsonl")) << model;
    for (int step : {4, 8}) {
      EXPECT_TRUE(bytes_of(read_model_tensors(ck(bg, step))) == bytes_of(read_model_tensors(ck(fg, step))))
          << model << ": step " << step << "'s weights differ from the foreground save's";
      EXPECT_TRUE(bytes_of(read_optimizer_tensors(ck(bg, step))) == bytes_of(read_optimizer_tensors(ck(fg, step))))
          << model << ": step " << step << "'s Adam state differs from the foreground save's";
    }
    EXPECT_EQ(losses(stopped + "/metrics.jsonl"), losses(bg + "/metrics.jsonl")) << model;
    for (bool adam : {false, true})
      for (const std::string& f : sharded_files(ck(bg, 8), adam)) {
        std::ifstream a(ck(bg, 8) + "/" + f, std::ios::binary), b(ck(stopped, 8) + "/" + f, std::ios::binary);
        std::stringstream x, y;
        x << a.rdbuf(), y << b.rdbuf();
        EXPECT_TRUE(!x.str().empty() && x.str() == y.str()) << model << ": " << f << " differs after the resume";
      }
  }
}

// A tp 4 checkpoint, sharded, resumes at tp 2 on 2 ranks, at tp 1 on 2 ranks and in one
// process exactly as the whole-layout checkpoint of the same run does (the same bits: so the
// loaded parameters are the same), and every reading command opens it.
TEST(ShardedCheckpoint, ReshardsToOtherLayoutsLikeTheWholeCheckpoint) {
  SKIP_WITHOUT_MPI();
  for (const char* model : {kShardRre, kShardInModelRre}) {
    TempDir t("reshard");
    const std::string whole = t / "whole", sharded = t / "sharded";
    CmdResult r = ranks(4, shard_args(model, 4, 4, "whole") + " --out " + whole);
    ASSERT_EQ(r.code, 0) << r.out;
    r = ranks(4, shard_args(model, 4, 4, "sharded") + " --out " + sharded);
    ASSERT_EQ(r.code, 0) << r.out;
    ASSERT_TRUE(is_sharded_checkpoint(ck(sharded, 4)));
    EXPECT_TRUE(bytes_of(read_model_tensors(ck(sharded, 4))) == bytes_of(read_model_tensors(ck(whole, 4)))) << model;
    for (const std::string& cmd : {"eval --ckpt " + ck(sharded, 4), "inspect --ckpt " + ck(sharded, 4),
                                  "generate --ckpt " + ck(sharded, 4) + " --prompt '1 2 3' --max-new 4"}) {
      const CmdResult c = sigma_cmd(cmd);
      EXPECT_EQ(c.code, 0) << cmd << ": " << c.out;
    }
    struct Layout { int ranks, tp; };
    for (const Layout l : {Layout{2, 2}, Layout{2, 1}, Layout{1, 1}}) {
      std::string got[2];
      for (int k = 0; k < 2; ++k) {
        const std::string from = k ? sharded : whole;
        const std::string out = t / fmt::format("{}-r{}tp{}", k ? "s" : "w", l.ranks, l.tp);
        fs::copy(from, out, fs::copy_options::recursive);
        r = ranks(l.ranks, fmt::format("train --resume {}/checkpoints --out {} --set dist.tp={} "
                                       "--set train.steps=6 --set dist.ckpt_layout=whole --quiet",
                                       out, out, l.tp));
        ASSERT_EQ(r.code, 0) << r.out;
        got[k] = bytes_of(read_model_tensors(ck(out, 6))) + bytes_of(read_optimizer_tensors(ck(out, 6)));
        EXPECT_FALSE(got[k].empty());
      }
      EXPECT_TRUE(got[0] == got[1]) << model << ": resumed from the sharded checkpoint at tp " << l.tp
                                    << " on " << l.ranks << " ranks, not the whole one's bits";
    }
  }
}

// Expert groups of 2, 3 and 4 experts over 4 ranks (tp 1, 2 RRE blocks): the placement gives
// the ranks 2, 6, 4 and 6 experts, so a rank writing what it holds wrote 1.28x the mean. A few
// (block, group) ranges are written by a less loaded rank instead (expert_parallel_shards.cpp):
// the largest rank's files are at most 1.2x the mean, and they still assemble to exactly the
// whole layout's tensors, which resume alike.
TEST(ShardedCheckpoint, AnUnevenExpertPlacementStillWritesEvenFiles) {
  SKIP_WITHOUT_MPI();
  TempDir t("shardeven");
  const std::string model = "--set model.rre_layers=2 --set train.experts=parallel --set "
                            "'model.groups=[{\"name\":\"markov\",\"experts\":2},{\"name\":"
                            "\"copy\",\"experts\":3},{\"name\":\"arith\",\"experts\":4}]'";
  const std::string whole = t / "whole", sharded = t / "sharded";
  CmdResult r = ranks(4, shard_args(model, 4, 1, "whole") + " --out " + whole);
  ASSERT_EQ(r.code, 0) << r.out;
  r = ranks(4, shard_args(model, 4, 1, "sharded") + " --out " + sharded);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string s4 = ck(sharded, 4), w4 = ck(whole, 4);
  ASSERT_TRUE(is_sharded_checkpoint(s4));
  std::vector<double> bytes;
  for (int i = 0; i < 4; ++i)
    bytes.push_back(double(fs::file_size(s4 + "/" + shard_file(i, false)) + fs::file_size(s4 + "/" + shard_file(i, true))));
  const double mean = (bytes[0] + bytes[1] + bytes[2] + bytes[3]) / 4;
  const double most = *std::max_element(bytes.begin(), bytes.end());
  EXPECT_LE(most, 1.2 * mean) << "per-rank bytes " << bytes[0] << ", " << bytes[1] << ", " << bytes[2] << ", " << bytes[3];
  EXPECT_TRUE(bytes_of(read_model_tensors(s4)) == bytes_of(read_model_tensors(w4)));
  EXPECT_TRUE(bytes_of(read_optimizer_tensors(s4)) == bytes_of(read_optimizer_tensors(w4)));
  // Resumed on 2 ranks from either: the same bits.
  std::string got[2];
  for (int k = 0; k < 2; ++k) {
    const std::string out = t / (k ? "s2" : "w2");
    fs::copy(k ? sharded : whole, out, fs::copy_options::recursive);
    r = ranks(2, "train --quiet --resume " + out + "/checkpoints --out " + out + " --set train.steps=6");
    ASSERT_EQ(r.code, 0) << r.out;
    got[k] = bytes_of(read_model_tensors(ck(out, 6))) + bytes_of(read_optimizer_tensors(ck(out, 6)));
  }
  EXPECT_FALSE(got[0].empty());
  EXPECT_TRUE(got[0] == got[1]) << "resumed from the sharded checkpoint: not the whole one's bits";
}

// A shard file truncated or missing: every reader names the file (the manifest lists every
// rank's files with sizes and checksums); a piece missing from an assembled tensor names the
// tensor and the slice.
TEST(ShardedCheckpoint, ATruncatedOrMissingShardIsNamed) {
  SKIP_WITHOUT_MPI();
  TempDir t("shardbad");
  const std::string out = t / "run";
  CmdResult r = ranks(2, shard_args(kShardRre, 4, 2, "sharded") + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string dir = ck(out, 4), file = shard_file(1, false);
  const auto size = fs::file_size(dir + "/" + file);
  fs::resize_file(dir + "/" + file, size / 2);
  r = sigma_cmd("inspect --ckpt " + dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(file), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("truncated"), std::string::npos) << r.out;
  fs::remove(dir + "/" + file);
  r = ranks(2, "train --quiet --resume " + dir + " --out " + (t / "again"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find(file), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("missing"), std::string::npos) << r.out;
}

// The reader alone (no run): pieces cut as tp slices of blocks (QKV's three) and as expert
// ranges assemble to the whole tensor exactly; a slice in no file is an error naming the
// tensor and the slice.
TEST(ShardedCheckpoint, PiecesAssembleExactlyAndAGapIsNamed) {
  TempDir t("pieces");
  std::vector<float> whole(2 * 6), e(4 * 2);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = float(i);
  for (size_t i = 0; i < e.size(); ++i) e[i] = float(100 + i);
  // A [2, 6] as 3 blocks of 2 columns, each cut in 2: rank r keeps columns r, 2 + r, 4 + r.
  std::vector<float> a0, a1;
  for (int row = 0; row < 2; ++row)
    for (int blk = 0; blk < 3; ++blk) {
      a0.push_back(whole[size_t(row * 6 + blk * 2)]);
      a1.push_back(whole[size_t(row * 6 + blk * 2 + 1)]);
    }
  auto save = [&](const std::string& name, bool both) {
    CheckpointWriter w(t.str(), name);
    w.set_sharded();
    std::map<std::string, TensorPiece> p0{{"A", {1, 3, 2, 0, 0, 0, 0}}, {"E", {-1, 1, 1, 0, 0, 1, 4}}};
    std::map<std::string, TensorPiece> p1{{"A", {1, 3, 2, 1, 0, 0, 0}}, {"E", {-1, 1, 1, 0, 1, 3, 4}}};
    w.add_safetensors(shard_file(0, false), {{"A", DType::F32, {2, 3}, a0.data()}, {"E", DType::F32, {1, 2}, e.data()}},
                      {{kPiecesKey, pieces_metadata(p0)}});
    if (both)
      w.add_safetensors(shard_file(1, false), {{"A", DType::F32, {2, 3}, a1.data()}, {"E", DType::F32, {3, 2}, e.data() + 2}},
                        {{kPiecesKey, pieces_metadata(p1)}});
    return w.commit();
  };
  const std::string good = save("good", true);
  const Safetensors st = read_sharded(good, false);
  ASSERT_EQ(st.tensors.at("A").shape(), (Shape{2, 6}));
  ASSERT_EQ(st.tensors.at("E").shape(), (Shape{4, 2}));
  EXPECT_EQ(std::vector<float>(st.tensors.at("A").data<float>(), st.tensors.at("A").data<float>() + 12), whole);
  EXPECT_EQ(std::vector<float>(st.tensors.at("E").data<float>(), st.tensors.at("E").data<float>() + 8), e);
  const std::string gap = save("gap", false);
  const std::string err = error_of([&] { (void)read_sharded(gap, false); });
  EXPECT_NE(err.find("'A' lacks its piece for tp slice 1 of 2"), std::string::npos) << err;
}
