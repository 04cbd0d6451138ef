// Background checkpoints (train.ckpt_async, issue 37 item 10): the next steps run while a save
// is written; the files are those of a foreground save; a failed background write is an error
// that keeps every committed checkpoint; an error of the training thread lets the save in
// flight commit first. The kill campaign is tests/test_async_checkpoint_kills.sh.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli_util.h"
#include "core/error.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "run/checkpoint.h"
#include "train/trainer.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

// The main job's model (ECSS experts on one rank), small.
Config small_config(bool async, const std::string& experts = "auto") {
  Config c;
  c.model.d_model = 32;
  c.model.heads = 2;
  c.model.context = 16;
  c.train.steps = 8;
  c.train.batch = 2;
  c.train.log_every = 1000;
  c.train.eval_rows = 4;
  c.train.ckpt_every = 2;
  c.train.experts = experts;
  c.train.ckpt_async = async;
  return c;
}

RunOptions quiet(const std::string& out) {
  RunOptions r;
  r.out_dir = out;
  r.progress = false;
  return r;
}

// Waits up to `limit` for `ready`.
bool wait_for(const std::atomic<bool>& ready, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!ready.load() && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return ready.load();
}

// The run's saves that saw the next step start before they were written. The step after a
// save at step s has index s (0-based).
int saves_overlapping_a_step(Config c, const std::string& out, std::chrono::milliseconds limit) {
  std::atomic<int64_t> started{-1};
  std::atomic<int> overlapped{0};
  RunOptions r = quiet(out);
  r.before_step = [&](int64_t step, std::vector<Batch>&) { started = step; };
  r.saving = [&](int64_t step) {
    if (step == c.train.steps) return;  // the last save: no step after it
    std::atomic<bool> seen{false};
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end && !(seen = started.load() >= step))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    overlapped += seen ? 1 : 0;
  };
  train(c, r);
  return overlapped;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A saved config without the keys that legitimately differ between the runs compared.
nlohmann::json normalised(nlohmann::json cfg) {
  cfg["train"].erase("ckpt_async");
  cfg["train"].erase("expert_store");
  return cfg;
}

// Checkpoint directories a and b hold the same files with the same bytes, but for the config
// the runs were given (compared without ckpt_async and expert_store), and the same hard links.
void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  std::vector<std::string> fa, fb;
  for (const auto& e : fs::directory_iterator(a)) fa.push_back(e.path().filename());
  for (const auto& e : fs::directory_iterator(b)) fb.push_back(e.path().filename());
  std::sort(fa.begin(), fa.end()), std::sort(fb.begin(), fb.end());
  ASSERT_EQ(fa, fb) << a << " vs " << b;
  const auto ma = read_manifest(a.string()), mb = read_manifest(b.string());
  for (const std::string& f : fa) {
    const std::string pa = (a / f).string(), pb = (b / f).string();
    struct stat sa {}, sb {};
    ::stat(pa.c_str(), &sa), ::stat(pb.c_str(), &sb);
    EXPECT_EQ(sa.st_nlink, sb.st_nlink) << pa << ": hard-linked in one run only";
    if (f == kManifestFile) continue;
    if (f == kTrainerFile) {
      auto ja = nlohmann::json::parse(slurp(pa)), jb = nlohmann::json::parse(slurp(pb));
      ja["config"] = normalised(ja["config"]), jb["config"] = normalised(jb["config"]);
      EXPECT_EQ(ja, jb) << pa;
    } else if (f == kModelFile) {  // the config is in its metadata
      const Safetensors sa = read_safetensors(pa), sb = read_safetensors(pb);
      ASSERT_EQ(sa.tensors.size(), sb.tensors.size()) << pa;
      for (const auto& [name, t] : sa.tensors) {
        const Tensor& u = sb.tensors.at(name);
        ASSERT_EQ(t.nbytes(), u.nbytes()) << pa << ": " << name;
        EXPECT_EQ(std::memcmp(t.bytes(), u.bytes(), t.nbytes()), 0) << pa << ": " << name;
      }
      EXPECT_EQ(normalised(nlohmann::json::parse(sa.metadata.at("config"))),
                normalised(nlohmann::json::parse(sb.metadata.at("config"))));
    } else {  // everything else: byte for byte, as the manifests record
      EXPECT_EQ(ma.at(f).xxh3, mb.at(f).xxh3) << pa;
      EXPECT_EQ(slurp(pa), slurp(pb)) << pa;
    }
  }
}

std::vector<std::string> checkpoints_of(const std::string& root) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory()) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

void expect_same_tensors(const TensorMap& a, const TensorMap& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    const Tensor& u = b.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(t.bytes(), u.bytes(), t.nbytes()), 0) << what << ": " << name;
  }
}

// A small tmpfs (a full disk on demand), unmounted when the object dies.
struct SmallDisk {
  std::string path;
  bool mounted = false;
  SmallDisk(const std::string& dir, const std::string& size) : path(dir) {
    fs::create_directories(path);
    mounted = ::mount("tmpfs", path.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
  }
  ~SmallDisk() {
    if (mounted) ::umount2(path.c_str(), MNT_DETACH);
  }
};

}  // namespace

// The step after a save starts before the save's files are written (in the foreground, the
// save holds the training thread: no step starts while it is written).
TEST(AsyncCheckpoint, TheNextStepRunsWhileASaveIsWritten) {
  TempDir tmp("async-overlap");
  for (const std::string experts : {"auto", "model"}) {  // ECSS (store read late) and in-model
    EXPECT_EQ(saves_overlapping_a_step(small_config(true, experts), tmp / ("bg-" + experts),
                                       std::chrono::seconds(20)), 3) << experts;
  }
  EXPECT_EQ(saves_overlapping_a_step(small_config(false), tmp / "fg", std::chrono::milliseconds(200)), 0);
}

// Every checkpoint of a run saving in the background equals the foreground run's (ECSS with
// the RAM and the file store, experts in the model), hard links of unchanged expert groups
// included; a resume from a background checkpoint ends bit-identical to the uninterrupted run.
TEST(AsyncCheckpoint, TheFilesAreThoseOfAForegroundSaveAndResumeIsExact) {
  TempDir tmp("async-same");
  for (const std::string mode : {"ram", "file", "model"}) {
    SCOPED_TRACE(mode);
    auto config = [&](bool async, const std::string& tag) {
      Config c = small_config(async, mode == "model" ? "model" : "auto");
      if (mode == "file") c.train.expert_store = tmp / (mode + tag + ".store");
      // A group no step updates (its domain is not in the data): linked, not written again.
      c.model.groups.push_back({"extra", 2});
      c.model.domains = {{"markov", "markov", 0}, {"copy", "copy", 0}, {"arith", "arith", 0},
                         {"extra", "extra", 0}};
      return c;
    };
    const std::string bg = tmp / (mode + "-bg"), fg = tmp / (mode + "-fg");
    train(config(true, "bg"), quiet(bg));
    train(config(false, "fg"), quiet(fg));
    const auto names = checkpoints_of(bg + "/checkpoints");
    ASSERT_EQ(names, checkpoints_of(fg + "/checkpoints"));
    ASSERT_EQ(names.size(), 4u);
    for (const std::string& n : names)
      expect_same_checkpoint(fs::path(bg) / "checkpoints" / n, fs::path(fg) / "checkpoints" / n);
    EXPECT_EQ(slurp(bg + "/checkpoints/latest"), slurp(fg + "/checkpoints/latest"));

    const std::string resumed = tmp / (mode + "-resumed");
    RunOptions r = quiet(resumed);
    r.resume = bg + "/checkpoints/step-00000004";
    train(config(true, "resumed"), r);
    const std::string end = "/checkpoints/step-00000008";
    expect_same_tensors(read_model_tensors(bg + end), read_model_tensors(resumed + end), "model");
    expect_same_tensors(read_optimizer_tensors(bg + end), read_optimizer_tensors(resumed + end),
                        "optimizer");
  }
}

// A background write that fails (the disk fills) stops the run with an error naming the
// checkpoint and the cause; the checkpoint committed before it is intact, nothing half-written
// is left, and the run resumes from it exactly.
TEST(AsyncCheckpoint, AFailedBackgroundWriteIsAnErrorAndKeepsTheLastCheckpoint) {
  TempDir tmp("async-full");
  SmallDisk disk(tmp / "disk", "3m");  // one checkpoint (~2 MiB) fits, not two
  if (!disk.mounted) GTEST_SKIP() << "cannot mount a tmpfs here";
  const std::string args =
      "train --quiet --set model.d_model=32 --set model.heads=2 --set model.context=16 "
      "--set train.steps=8 --set train.batch=2 --set train.log_every=1000 --set train.eval_rows=4 "
      "--set train.ckpt_every=2 ";
  const std::string out = disk.path + "/out";
  auto r = sigma_cmd(args + "--out " + out);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sigma: error: checkpoint step-00000004 was not saved (written in the "
                       "background"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("No space left on device"), std::string::npos) << r.out;
  const std::string ckpt = resolve_checkpoint(out + "/checkpoints");
  EXPECT_EQ(fs::path(ckpt).filename(), "step-00000002");
  EXPECT_NO_THROW(verify_checkpoint(ckpt));
  EXPECT_EQ(checkpoints_of(out + "/checkpoints"), std::vector<std::string>{"step-00000002"});

  fs::copy(out, tmp / "moved", fs::copy_options::recursive);
  fs::remove(tmp / "moved/.lock");
  r = sigma_cmd(fmt::format("train --quiet --resume {} --out {}", tmp / "moved/checkpoints/step-00000002",
                            tmp / "moved"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd(args + "--out " + tmp / "straight");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string end = "/checkpoints/step-00000008";
  expect_same_tensors(read_model_tensors(tmp / "straight" + end),
                      read_model_tensors(tmp / "moved" + end), "model");
}

// The training thread fails while a save is in flight: the save commits before the error ends
// the run (it is of an earlier, good step), and the error is the training thread's.
TEST(AsyncCheckpoint, AnErrorDuringABackgroundSaveLetsItCommitFirst) {
  TempDir tmp("async-error");
  std::atomic<bool> thrown{false};
  RunOptions r = quiet(tmp / "run");
  r.before_step = [&](int64_t step, std::vector<Batch>&) {
    if (step == 4) {  // the step right after the save of step 4 (ECSS: before its update waits)
      thrown = true;
      fail("injected failure at step {}", step);
    }
  };
  r.saving = [&](int64_t step) {
    if (step == 4) {
      EXPECT_TRUE(wait_for(thrown, std::chrono::seconds(20)));
    }
  };
  const std::string e = error_of([&] { train(small_config(true), r); });
  EXPECT_EQ(e, "injected failure at step 4");
  const std::string ckpt = resolve_checkpoint(tmp / "run/checkpoints");
  EXPECT_EQ(fs::path(ckpt).filename(), "step-00000004");
  EXPECT_NO_THROW(verify_checkpoint(ckpt));
}
