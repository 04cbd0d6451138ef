// ECSS in the trainer (issue 5): experts trained from an expert store, RAM or file, against
// the in-model path; resume and crash recovery; bad store files.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "device_access.h"
#include "cli_util.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/communicator.h"
#include "ecss/ecss_experts.h"
#include "model/names.h"
#include "step_config.h"
#include "test_util.h"
#include "train/train_step.h"
#include "train/checkpoint.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "train/trainer.h"

namespace sigma {
namespace {

using testing::TempDir;
using testing::append_floats;
using testing::same_bits;
using testing::slurp;
namespace fs = std::filesystem;

// The main job's model, small and fast; batch 2 so that most steps leave some groups idle.
Config small_config(const std::string& experts, int steps = 24) {
  Config c;
  c.model.d_model = 32;
  c.model.heads = 2;
  c.model.context = 32;
  c.train.steps = steps;
  c.train.batch = 2;
  c.train.log_every = 1000;
  c.train.eval_rows = 8;
  c.optim.warmup = 4;
  c.train.experts = experts;
  return c;
}

// The main job's domains plus "extra", a domain with its own group that the synthetic data
// never has: its experts are never active.
Config with_extra_domain(Config c) {
  c.model.groups.push_back({"extra", 3});
  c.model.domains = {{"markov", "markov", 0}, {"copy", "copy", 0}, {"arith", "arith", 0},
                     {"extra", "extra", 0}};
  return c;
}

TrainSummary run(Config c, const std::string& out, const std::string& resume = "",
                 int64_t stop_at = -1) {
  RunOptions r;
  r.out_dir = out;
  r.resume = resume;
  r.stop_at = stop_at;
  r.progress = false;
  return train(c, r);
}

TensorMap model_tensors(const std::string& out) {
  return read_model_tensors(resolve_checkpoint(out + "/checkpoints"));
}
TensorMap optimizer_tensors(const std::string& out) {
  return read_optimizer_tensors(resolve_checkpoint(out + "/checkpoints"));
}

// Every tensor of `a` is in `b` with the same bits.
void expect_same_tensors(const TensorMap& a, const TensorMap& b, const std::string& what) {
  EXPECT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << what << ": " << name;
    EXPECT_TRUE(same_bits(t, it->second)) << what << ": " << name;
  }
}

TEST(EcssTrain, ModeResolution) {
  Config c;
  EXPECT_EQ(resolve_expert_mode("auto", c.model), ExpertMode::Ecss);
  EXPECT_EQ(resolve_expert_mode("model", c.model), ExpertMode::InModel);
  // Several ranks: expert parallel by default; one store holding every expert is refused.
  EXPECT_EQ(resolve_expert_mode("auto", c.model, 4), ExpertMode::Parallel);
  EXPECT_EQ(resolve_expert_mode("parallel", c.model, 1), ExpertMode::Parallel);
  EXPECT_EQ(resolve_expert_mode("model", c.model, 4), ExpertMode::InModel);
  EXPECT_THROW(resolve_expert_mode("ecss", c.model, 2), Error);
  c.model.rre_layers = 0;
  EXPECT_EQ(resolve_expert_mode("auto", c.model, 4), ExpertMode::InModel);
  EXPECT_THROW(resolve_expert_mode("parallel", c.model), Error);
  EXPECT_EQ(resolve_expert_mode("auto", c.model), ExpertMode::InModel);
  try {
    resolve_expert_mode("ecss", c.model);
    FAIL() << "a dense model cannot train its experts from a store";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rre_layers"), std::string::npos) << e.what();
  }
  Config g;
  g.model.router = "top1";
  EXPECT_EQ(resolve_expert_mode("auto", g.model), ExpertMode::InModel);
  EXPECT_THROW(resolve_expert_mode("vanilla", g.model), Error);
}

// Vanilla offload updates every expert every step: the same math as the in-model AdamW, the
// same Adam kernel (ops::adam_step is the store's cpu::adam_step) and the same gradient norm
// (optim/grad_norm.h's canonical order), so the same bits — also when every step clips
// (grad_clip 1e-3) and the clipping factor depends on the norm. With several micro-batches a
// step the in-model experts' gradients are summed in the rank-invariant tree order and the
// store's in micro-batch order (ECSS experts never cross ranks): equal to rounding.
TEST(EcssTrain, VanillaMatchesInModelTrainingBitForBit) {
  for (auto [clip, accum] : {std::pair{1.0f, 1}, std::pair{1e-3f, 1}, std::pair{1e-3f, 4}}) {
    TempDir dir("ecss");
    Config vanilla = small_config("vanilla"), in_model = small_config("model");
    vanilla.optim.grad_clip = in_model.optim.grad_clip = clip;
    vanilla.train.accum = in_model.train.accum = accum;
    vanilla.train.log_every = in_model.train.log_every = 1;
    const TrainSummary a = run(vanilla, dir / "vanilla");
    const TrainSummary b = run(in_model, dir / "model");
    const bool exact = accum == 1;
    const std::string what = fmt::format("vanilla vs in-model, grad_clip {}, accum {}", clip, accum);
    if (exact) {
      expect_same_tensors(model_tensors(dir / "model"), model_tensors(dir / "vanilla"), what);
    } else {
      const TensorMap ma = model_tensors(dir / "vanilla"), mb = model_tensors(dir / "model");
      double worst = 0;
      for (const auto& [name, t] : ma)
        for (int64_t i = 0; i < t.numel(); ++i)
          worst = std::max(worst, double(std::abs(t.f()[i] - mb.at(name).f()[i])));
      EXPECT_LT(worst, 1e-4) << what;
    }
    for (size_t d = 0; d < a.domains.size(); ++d) {
      if (exact) {
        EXPECT_EQ(a.domains[d].loss, b.domains[d].loss) << what << ": " << a.domains[d].name;
      } else {
        EXPECT_NEAR(a.domains[d].loss, b.domains[d].loss, 1e-4) << what;
      }
    }
    EXPECT_EQ(a.offload.experts_updated, a.offload.steps * 18);  // 2 blocks x (2 + 3 + 4) experts
    // The gradient norm itself, every step, to the last bit (one fold over the same pieces).
    std::ifstream ma(dir / "vanilla/metrics.jsonl"), mb(dir / "model/metrics.jsonl");
    std::string la, lb;
    int steps = 0;
    while (std::getline(ma, la) && std::getline(mb, lb)) {
      const auto ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
      const double na = ja["grad_norm"].get<double>(), nb = jb["grad_norm"].get<double>();
      if (exact) {
        EXPECT_EQ(na, nb) << what << " step " << ja["step"];
      } else {
        EXPECT_NEAR(na, nb, 1e-5 * nb) << what << " step " << ja["step"];
      }
      ++steps;
    }
    EXPECT_EQ(steps, 24) << what;
  }
}

// train.expert_memory (issue 16): a budget too small for a step's experts runs every RRE pass
// in slices, gathering, running and dropping a few experts at a time, with the gradients in the
// GradientArea. The bits do not depend on the budget: one expert at a time, a few, or the whole
// step at once; in RAM or beside a file store (gradients then in a file); with several
// micro-batches of mixed domains a step; with remat recomputing the passes; and vanilla too.
TEST(EcssTrain, AMemoryBudgetSlicesTheStepWithoutChangingABit) {
  TempDir dir("ecss");
  Config base = with_extra_domain(small_config("ecss", 10));
  base.model.groups[0].experts = 6;  // unequal groups: slices cross group boundaries
  base.train.accum = 4;
  base.train.batch = 3;
  const int64_t weights = (2 * 32 * 128 + 128 + 32) * 4;  // P floats of d=32, f=128 (16-aligned)
  const int64_t expert = 2 * weights;  // an expert's compute buffers: weights and gradients
  struct Case {
    std::string name, budget, store, remat, mode;
  };
  const std::vector<Case> cases = {
      {"whole", "auto", "", "none", "ecss"},
      {"one", std::to_string(expert), "", "none", "ecss"},
      {"three-file", std::to_string(3 * expert + 100), "file.bin", "none", "ecss"},
      {"two-remat", std::to_string(2 * expert), "", "blocks", "ecss"},
  };
  std::map<std::string, TrainSummary> sums;
  for (const Case& k : cases) {
    Config c = base;
    c.train.expert_memory = k.budget;
    c.train.remat = k.remat;
    c.train.experts = k.mode;
    if (!k.store.empty()) c.train.expert_store = dir / k.store;
    sums[k.name] = run(c, dir / k.name);
    if (k.name == "whole") continue;
    expect_same_tensors(model_tensors(dir / "whole"), model_tensors(dir / k.name), k.name);
    expect_same_tensors(optimizer_tensors(dir / "whole"), optimizer_tensors(dir / k.name), k.name);
    for (size_t d = 0; d < sums[k.name].domains.size(); ++d)
      EXPECT_EQ(sums["whole"].domains[d].loss, sums[k.name].domains[d].loss) << k.name;
  }
  const OffloadStats &whole = sums["whole"].offload, &one = sums["one"].offload;
  EXPECT_EQ(one.experts_updated, whole.experts_updated);
  EXPECT_EQ(one.record_bytes, whole.record_bytes);
  // Sliced: many more, smaller gathers, each within its budget. Every active expert is copied
  // at least once a step (exactly once when the step fits); under a budget some passes reuse
  // what an earlier pass of the step left in the buffers.
  EXPECT_GT(one.pieces, 4 * whole.pieces);
  EXPECT_EQ(whole.gathered_bytes, whole.experts_updated * weights);
  for (const auto& [name, sum] : sums) {
    EXPECT_GE(sum.offload.gathered_bytes, sum.offload.experts_updated * weights) << name;
    if (name != "whole") {
      EXPECT_GT(sum.offload.reused_bytes, 0) << name;
    }
  }
  EXPECT_EQ(one.compute_bytes, expert);
  EXPECT_LE(sums["three-file"].offload.compute_bytes, 3 * expert);
  EXPECT_GT(whole.compute_bytes, 8 * expert);
  // Vanilla under a budget matches vanilla without one.
  for (const std::string& budget : {std::string("auto"), std::to_string(expert)}) {
    Config c = base;
    c.train.experts = "vanilla";
    c.train.expert_memory = budget;
    run(c, dir / ("vanilla-" + budget));
  }
  expect_same_tensors(model_tensors(dir / "vanilla-auto"),
                      model_tensors(dir / ("vanilla-" + std::to_string(expert))), "vanilla");
  // A budget below one expert, or not a size, is an error naming the key.
  for (const std::string& bad : {std::string("100"), std::string("lots"), std::string("-5GiB")}) {
    Config c = base;
    c.train.expert_memory = bad;
    try {
      run(c, dir / ("bad-" + bad));
      ADD_FAILURE() << "train.expert_memory = " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("train.expert_memory"), std::string::npos) << e.what();
    }
  }
}

// The pool under a budget (issue 16), driven step by step: a pass reuses the copies that
// earlier passes of the step left in the compute buffers. Checked against counts the executor
// does not make: the store's own count of the records it copied, and the experts each pass
// runs (from the model's routing). The trained bits equal a run whose steps fit the budget.
struct PoolRun {
  std::vector<float> dense, experts;  // model parameters; every expert's weights, m and v
  int64_t copied = 0, minimum = 0, passes = 0;  // records: copied, the steps' active, run by passes
};

// steps of 4 micro-batches of 3 rows x 8 tokens; domains[j]: micro-batch j's row domains
// (-1: drawn at random). Budget: `slots` experts.
PoolRun run_pool(int64_t slots, const std::vector<std::vector<int>>& domains, int steps) {
  const ModelConfig c = sigma::testing::step_config(2);  // groups of 3 and 2 experts, 2 RRE blocks
  Model m(c, 5, nullptr, /*external_experts=*/true);
  OptimConfig oc;
  oc.lr = 1e-2f;
  const int64_t P = 2 * 16 * 64 + 64 + 16, bytes = P * 4;  // one expert of d=16, f=64
  EcssExperts ex(m, ExpertMode::Ecss, oc, "", false, slots * 2 * bytes);  // weights + gradients
  EXPECT_EQ(ex.budget_experts(), slots);
  AdamW opt(oc, m.params());
  SingleProcess comm;
  TrainStep step(m, opt, comm, oc, plan_shards(m.params(), 1));
  PoolRun out;
  Rng r(11, 1);
  for (int s = 0; s < steps; ++s) {
    std::vector<Batch> micro(domains.size());
    for (size_t j = 0; j < micro.size(); ++j) {
      Batch& b = micro[j];
      b.resize(3, c.context);
      for (auto& t : b.tokens) t = int32_t(r.below(uint64_t(c.vocab)));
      for (auto& t : b.targets) t = int32_t(r.below(uint64_t(c.vocab)));
      for (int i = 0; i < b.B; ++i)
        b.domain[size_t(i)] = domains[j][size_t(i)] >= 0 ? domains[j][size_t(i)] : int32_t(r.below(2));
    }
    // Independent counts from the routing: the step's distinct (block, expert), and the
    // experts each forward and each backward pass runs.
    std::set<std::pair<size_t, int>> active;
    int64_t passes = 0;
    for (const Batch& b : micro) {
      const auto a = m.active_experts(b);
      for (size_t l = 0; l < a.size(); ++l) {
        passes += 2 * int64_t(a[l].size());
        for (int e : a[l]) active.insert({l, e});
      }
    }
    const int64_t records0 = ex.store().records_gathered(), gathers0 = ex.store().gathers();
    const OffloadStats before = ex.stats();
    step.prepare(micro);
    step.run(micro, oc.lr, UpdateMask{});
    const int64_t copied = ex.store().records_gathered() - records0;
    const OffloadStats& after = ex.stats();
    EXPECT_EQ(after.gathered_bytes - before.gathered_bytes, copied * bytes) << "step " << s;
    EXPECT_EQ(after.pieces - before.pieces, ex.store().gathers() - gathers0) << "step " << s;
    EXPECT_EQ(after.experts_updated - before.experts_updated, int64_t(active.size()));
    if (int64_t(active.size()) > slots) {  // sliced: every pass's expert copied or reused
      EXPECT_EQ(after.gathered_bytes + after.reused_bytes - before.gathered_bytes - before.reused_bytes,
                passes * bytes) << "step " << s;
    }
    EXPECT_LE(after.compute_bytes, slots * 2 * bytes);  // the pool never outgrows the budget
    out.copied += copied;
    out.minimum += int64_t(active.size());
    out.passes += passes;
  }
  for (const Param& p : m.params().all())
    append_floats(out.dense, p.value);
  for (const ExpertGroupSpec& g : ex.store().spec().groups)
    for (int32_t k = 0; k < g.experts; ++k) {
      const ExpertId id{g.block, g.group, k};
      for (const float* v : {ex.store().weights(id), ex.store().m(id), ex.store().v(id)})
        out.experts.insert(out.experts.end(), v, v + P);
      out.experts.push_back(float(ex.store().step(id)));
    }
  return out;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST(EcssTrain, ThePoolReusesCopiesWithinAStepAndCountsWhatItCopies) {
  const int steps = 3;
  // Domain-homogeneous micro-batches a, a, b, b: a pool of 6 holds a micro-batch's experts
  // (3 of group a in each of 2 blocks), so each expert of a step is copied exactly once.
  const std::vector<std::vector<int>> by_domain = {{0, 0, 0}, {0, 0, 0}, {1, 1, 1}, {1, 1, 1}};
  const PoolRun whole = run_pool(10, by_domain, steps);
  const PoolRun six = run_pool(6, by_domain, steps);
  EXPECT_EQ(whole.copied, whole.minimum);
  EXPECT_EQ(six.copied, six.minimum);
  EXPECT_TRUE(same_floats(whole.dense, six.dense));
  EXPECT_TRUE(same_floats(whole.experts, six.experts));
  // Mixed micro-batches under pools of 1 and 2 experts, smaller than a pass: between the
  // minimum and a copy per pass, strictly below the latter (a backward pass starts with what
  // the forward pass of its block left), and the same bits.
  const std::vector<std::vector<int>> mixed(4, std::vector<int>{-1, -1, -1});
  const PoolRun ref = run_pool(10, mixed, steps);
  for (int64_t slots : {1, 2}) {
    const PoolRun small = run_pool(slots, mixed, steps);
    EXPECT_GE(small.copied, small.minimum) << slots;
    EXPECT_LT(small.copied, small.passes) << slots;
    EXPECT_TRUE(same_floats(ref.dense, small.dense)) << slots;
    EXPECT_TRUE(same_floats(ref.experts, small.experts)) << slots;
  }
}

// A step skipped as non-finite drops its experts' gradients: under a budget (gradients in the
// area, not zeroed by the next gather) vanilla still matches the in-model run, which zeroes its
// gradients every step.
TEST(EcssTrain, ASkippedStepLeavesNoGradientBehind) {
  TempDir dir("ecss");
  auto poisoned = [&](const std::string& mode, const std::string& budget) {
    Config c = small_config(mode, 8);
    c.train.expert_memory = budget;
    RunOptions r;
    r.out_dir = dir / (mode + budget);
    r.progress = false;
    r.before_step = [](int64_t step, std::vector<Batch>& micro) {
      if (step == 3) micro[0].mask[0] = std::numeric_limits<float>::infinity();  // NaN loss
    };
    return train(c, r);
  };
  const TrainSummary a = poisoned("vanilla", "80000"), b = poisoned("model", "auto");
  EXPECT_EQ(a.skipped_steps, 1);
  expect_same_tensors(model_tensors(dir / "modelauto"), model_tensors(dir / "vanilla80000"),
                      "after a skipped step");
}

// Experts of a domain that never appears are never read or written by ECSS (lazy Adam): bit
// for bit their initial values, with zero moments and steps, in RAM and in a file store. The
// in-model optimizer moves them (weight decay on zero gradients), which this test tells apart.
TEST(EcssTrain, InactiveExpertsStayBitIdentical) {
  TempDir dir("ecss");
  const Config cfg = with_extra_domain(small_config("ecss"));
  run(cfg, dir / "ram");
  // The in-model initial values, from the run's own (data-bound) config.
  const Config bound = open_checkpoint(dir / "ram/checkpoints").cfg;
  Model init(bound.model, bound.train.seed);
  auto check = [&](const std::string& out, bool expect_untouched) {
    const TensorMap m = model_tensors(out), o = optimizer_tensors(out);
    for (int l : {1, 2})
      for (const char* leaf : {"w_in", "b_in", "w_out", "b_out"}) {
        const std::string name = names::expert(l, "extra", leaf);
        const bool same = same_bits(m.at(name), ops::to_host(init.params().at(name).value));
        if (!expect_untouched) {
          if (leaf[0] == 'w') {
            EXPECT_FALSE(same) << out << ": " << name;
          }
          continue;
        }
        EXPECT_TRUE(same) << out << ": " << name;
        for (const char* s : {".m", ".v"}) {
          const Tensor& t = o.at(name + s);
          for (int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.f()[i], 0.0f) << name << s;
        }
      }
    if (!expect_untouched) return;
    for (int l : {1, 2}) {
      const Tensor& steps = o.at(fmt::format("blocks.{}.rre.extra.steps", l));
      for (int k = 0; k < 3; ++k) EXPECT_EQ(steps.data<int64_t>()[k], 0);
      const Tensor& active = o.at(fmt::format("blocks.{}.rre.markov.steps", l));
      EXPECT_GT(active.data<int64_t>()[0], 0);
      EXPECT_LE(active.data<int64_t>()[0], cfg.train.steps);
    }
  };
  check(dir / "ram", true);
  Config file = cfg;
  file.train.expert_store = dir / "experts.bin";
  run(file, dir / "file");
  check(dir / "file", true);
  Config model = cfg;
  model.train.experts = "model";
  run(model, dir / "model");
  check(dir / "model", false);
}

// RAM- and file-backed stores train bit-identically (batches of 2 rows: lazy updates matter).
TEST(EcssTrain, RamAndFileStoresTrainBitIdentically) {
  TempDir dir("ecss");
  Config ram = small_config("ecss");
  Config file = ram;
  file.train.expert_store = dir / "experts.bin";
  const TrainSummary a = run(ram, dir / "ram"), b = run(file, dir / "file");
  expect_same_tensors(model_tensors(dir / "ram"), model_tensors(dir / "file"), "model");
  expect_same_tensors(optimizer_tensors(dir / "ram"), optimizer_tensors(dir / "file"), "optimizer");
  for (size_t d = 0; d < a.domains.size(); ++d) EXPECT_EQ(a.domains[d].loss, b.domains[d].loss);
  // Lazy updates: some steps left some experts idle.
  EXPECT_LT(a.offload.experts_updated, a.offload.steps * 18);
  EXPECT_TRUE(fs::exists(dir / "experts.bin"));
}

// A file-backed run stopped and resumed in a new process equals the uninterrupted run.
TEST(EcssTrain, FileStoreResumeIsExact) {
  TempDir dir("ecss");
  Config c = small_config("ecss");
  c.train.expert_store = dir / "straight.bin";
  const TrainSummary straight = run(c, dir / "straight");
  Config p = small_config("ecss");
  p.train.expert_store = dir / "parts.bin";
  const std::string cmd = fmt::format(
      "train --quiet --set train.steps=24 --set train.batch=2 --set model.d_model=32 "
      "--set model.heads=2 --set model.context=32 --set optim.warmup=4 --set train.eval_rows=8 "
      "--set train.log_every=1000 --expert-store {} --out {}",
      dir / "parts.bin", dir / "parts");
  auto r = testing::sigma_cmd(cmd + " --stop-at 11");
  ASSERT_EQ(r.code, 0) << r.out;
  r = testing::sigma_cmd(fmt::format("train --quiet --resume {} --out {}", dir / "parts/checkpoints",
                                     dir / "parts"));
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_tensors(model_tensors(dir / "straight"), model_tensors(dir / "parts"), "model");
  expect_same_tensors(optimizer_tensors(dir / "straight"), optimizer_tensors(dir / "parts"),
                      "optimizer");
}

// A process killed mid-run leaves its store unclean and its checkpoints intact; resuming
// from the last checkpoint restores the store and continues exactly.
TEST(EcssTrain, KilledRunResumesExactly) {
  TempDir dir("ecss");
  const std::string common =
      "--quiet --set train.steps=600 --set train.batch=4 --set model.d_model=32 --set model.heads=2 "
      "--set model.context=32 --set train.eval_rows=8 --set train.ckpt_every=20 ";
  auto r = testing::sigma_cmd("train " + common + "--out " + dir / "straight");
  ASSERT_EQ(r.code, 0) << r.out;

  const std::string store = dir / "experts.bin";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string cmd = std::string("exec ") + SIGMA_BINARY + " train " + common +
                            "--expert-store " + store + " --out " + dir / "killed" + " >/dev/null 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  // Kill it once it has written a checkpoint and trained on (mid-step, or mid-checkpoint).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(dir / "killed/checkpoints/step-00000040") &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(fs::exists(dir / "killed/checkpoints/step-00000040")) << "the run never checkpointed";
  if (WIFEXITED(status)) GTEST_SKIP() << "the run finished before it could be killed";
  EXPECT_FALSE(ExpertStore::open(store, expert_store_spec(small_config("ecss").model)).clean_on_open())
      << "a store killed mid-run must say it may mix steps";

  r = testing::sigma_cmd(fmt::format("train --quiet --resume {} --out {}", dir / "killed/checkpoints",
                                     dir / "killed"));
  ASSERT_EQ(r.code, 0) << r.out;
  const TensorMap a = model_tensors(dir / "straight"), b = model_tensors(dir / "killed");
  expect_same_tensors(a, b, "model after kill and resume");
}

TEST(EcssTrain, BadStoreIsRefusedAndCheckpointsSurvive) {
  TempDir dir("ecss");
  Config c = small_config("ecss", 6);
  c.train.expert_store = dir / "experts.bin";
  run(c, dir / "first");
  const std::string before = slurp(dir / "experts.bin");
  const std::string ckpt = resolve_checkpoint(dir / "first/checkpoints");

  // A fresh run must not continue from, or overwrite, another run's store.
  try {
    run(c, dir / "second");
    FAIL() << "a fresh run reused an existing store";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("experts.bin"), std::string::npos) << m;
    EXPECT_NE(m.find("--resume"), std::string::npos) << m;
  }
  EXPECT_EQ(slurp(dir / "experts.bin"), before);

  // The store of another model config: resuming with it names the file; nothing changes.
  Config other = small_config("ecss", 6);
  other.model.groups[0].experts = 5;
  other.train.expert_store = dir / "other.bin";
  run(other, dir / "other");
  const std::string other_bytes = slurp(dir / "other.bin");
  auto r = testing::sigma_cmd(fmt::format("train --quiet --resume {} --set train.steps=8 "
                                          "--expert-store {} --out {}",
                                          ckpt, dir / "other.bin", dir / "first"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("other.bin"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(dir / "other.bin"), other_bytes);
  EXPECT_NO_THROW(open_checkpoint(ckpt));  // the last good checkpoint is intact
  EXPECT_EQ(resolve_checkpoint(dir / "first/checkpoints"), ckpt);

  // A store in a directory that cannot be written (not as root: root writes anywhere).
  if (geteuid() != 0) {
    fs::create_directories(dir / "ro");
    fs::permissions(dir / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    Config ro = small_config("ecss", 6);
    ro.train.expert_store = dir / "ro/experts.bin";
    try {
      run(ro, dir / "ro-run");
      FAIL() << "a read-only store path was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ro/experts.bin"), std::string::npos) << e.what();
    }
  }
  // A missing directory.
  Config missing = small_config("ecss", 6);
  missing.train.expert_store = dir / "no/such/dir/experts.bin";
  EXPECT_THROW(run(missing, dir / "missing"), Error);
}

// A disk that fills while a checkpoint is written (a file-size limit here): a clear error, no
// temporary directory left, the previous checkpoint still `latest` and whole; resuming from it
// once there is room again ends where an uninterrupted run does.
TEST(EcssTrain, FullDiskDuringACheckpointKeepsTheLastOne) {
  TempDir dir("ecss");
  const std::string args = fmt::format(
      "--quiet --set train.steps=12 --set train.batch=2 --set model.d_model=32 --set model.heads=2 "
      "--set model.context=32 --set train.eval_rows=8 --set train.ckpt_every=6 --expert-store {} ",
      dir / "experts.bin");
  auto r = testing::sigma_cmd("train " + args + "--stop-at 6 --out " + dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string ckpt = resolve_checkpoint(dir / "run/checkpoints");
  // SIGXFSZ ignored, so the write fails with EFBIG instead of killing the process.
  r = testing::run_cmd(fmt::format("bash -c \"trap '' XFSZ; ulimit -f 24; exec {} train --quiet --resume {} "
                                   "--out {}\"", SIGMA_BINARY, ckpt, dir / "run"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sigma: error:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("File too large"), std::string::npos) << r.out;
  EXPECT_EQ(resolve_checkpoint(dir / "run/checkpoints"), ckpt);
  EXPECT_NO_THROW(verify_checkpoint(ckpt));
  for (const auto& e : fs::directory_iterator(dir / "run/checkpoints"))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();

  r = testing::sigma_cmd(fmt::format("train --quiet --resume {} --out {}", ckpt, dir / "run"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = testing::sigma_cmd("train " + fmt::format(
      "--quiet --set train.steps=12 --set train.batch=2 --set model.d_model=32 --set model.heads=2 "
      "--set model.context=32 --set train.eval_rows=8 --out {}", dir / "straight"));
  ASSERT_EQ(r.code, 0) << r.out;
  expect_same_tensors(model_tensors(dir / "straight"), model_tensors(dir / "run"), "model");
}

// An ECSS checkpoint is an ordinary checkpoint: loaded in-model it scores the held-out data
// exactly as the ECSS run did, and an in-model run resumes from it (and an ECSS run from an
// in-model one).
TEST(EcssTrain, CheckpointsCrossBetweenModes) {
  TempDir dir("ecss");
  Config c = small_config("ecss", 8);
  const TrainSummary s = run(c, dir / "ecss");
  CheckpointInfo info;
  auto model = load_checkpoint_model(dir / "ecss/checkpoints", &info);
  ASSERT_FALSE(model->external_experts());
  auto data = make_data_source(info.cfg);
  const auto losses = evaluate(*model, *data, info.cfg.train.batch, info.cfg.model.context,
                               info.cfg.train.eval_rows);
  ASSERT_EQ(losses.size(), s.domains.size());
  for (size_t d = 0; d < losses.size(); ++d) EXPECT_EQ(losses[d].loss, s.domains[d].loss);
  testing::CmdResult r;
  r = testing::sigma_cmd(fmt::format("train --quiet --resume {} --set train.steps=10 "
                                     "--set train.experts=model --out {}",
                                     dir / "ecss/checkpoints", dir / "ecss"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = testing::sigma_cmd(fmt::format("train --quiet --resume {} --set train.steps=12 "
                                     "--set train.experts=ecss --out {}",
                                     dir / "ecss/checkpoints", dir / "ecss"));
  ASSERT_EQ(r.code, 0) << r.out;
  const TensorMap o = optimizer_tensors(dir / "ecss");
  EXPECT_EQ(o.at("blocks.1.rre.markov.steps").data<int64_t>()[0] > 0, true);
}

// A checkpoint writes only the expert groups updated since the previous one and hard-links the
// others; deleting the older checkpoint leaves the newer one whole; resume is still exact.
TEST(EcssTrain, CheckpointsLinkUnchangedExpertGroups) {
  TempDir dir("ecss");
  Config c = with_extra_domain(small_config("ecss", 16));
  c.train.ckpt_every = 4;
  run(c, dir / "run", "", /*stop_at=*/12);
  auto inode = [](const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 ? std::pair{st.st_ino, st.st_nlink} : std::pair{ino_t(0), nlink_t(0)};
  };
  const std::string s4 = dir / "run/checkpoints/step-00000004", s8 = dir / "run/checkpoints/step-00000008",
                    s12 = dir / "run/checkpoints/step-00000012";
  for (const char* f : {"experts.1.extra.safetensors", "experts.2.extra.adam.safetensors"}) {
    EXPECT_EQ(inode(s4 + "/" + f).first, inode(s8 + "/" + f).first) << f << " was written again";
    EXPECT_EQ(inode(s8 + "/" + f).first, inode(s12 + "/" + f).first) << f;
    EXPECT_GE(inode(s12 + "/" + f).second, 3u) << f;
  }
  for (const char* f : {"experts.1.markov.safetensors", "experts.1.markov.adam.safetensors"})
    EXPECT_NE(inode(s4 + "/" + f).first, inode(s8 + "/" + f).first) << f << " changed but was linked";

  // The older checkpoints can go; the newest verifies and resumes exactly.
  fs::remove_all(s4);
  fs::remove_all(s8);
  EXPECT_NO_THROW(open_checkpoint(s12));
  run(c, dir / "straight");
  run(c, dir / "run", s12);
  expect_same_tensors(model_tensors(dir / "straight"), model_tensors(dir / "run"), "model");
  expect_same_tensors(optimizer_tensors(dir / "straight"), optimizer_tensors(dir / "run"), "optimizer");
  // Resumed from s12, the next checkpoint links the idle group from it.
  EXPECT_EQ(inode(s12 + "/experts.1.extra.safetensors").first,
            inode(dir / "run/checkpoints/step-00000016/experts.1.extra.safetensors").first);
}

}  // namespace
}  // namespace sigma

// What `sigma train` reports of the pool (summary.json's ecss object): with a budget of about
// three experts a step gathers its experts in many pieces, reuses some copies, and gathers at
// least each active expert once (what the whole-step run gathers, reusing nothing).
TEST(EcssTrain, TheSummaryReportsGatheredAndReusedBytes) {
  sigma::testing::TempDir tmp("ecss-summary");
  auto ecss_of = [&](const std::string& budget) {
    const std::string out = tmp / budget;
    const auto r = sigma::testing::sigma_cmd("train --set train.steps=4 --set train.accum=4 --set "
                                  "train.expert_memory=" + budget + " --quiet --out " + out);
    EXPECT_EQ(r.code, 0) << r.out;
    std::ifstream in(out + "/summary.json");
    return nlohmann::json::parse(in).at("ecss");
  };
  const auto whole = ecss_of("auto"), small = ecss_of("400000");
  EXPECT_EQ(whole["reused_gib_per_step"].get<double>(), 0.0) << whole.dump();
  EXPECT_GT(small["reused_gib_per_step"].get<double>(), 0.0) << small.dump();
  EXPECT_GT(small["pieces_per_step"].get<double>(), whole["pieces_per_step"].get<double>()) << small.dump();
  EXPECT_GE(small["gathered_gib_per_step"].get<double>(), whole["gathered_gib_per_step"].get<double>());
  EXPECT_EQ(small["records_gib_per_step"], whole["records_gib_per_step"]);  // the same experts updated
}
