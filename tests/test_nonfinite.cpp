// The non-finite guard (issue 15): a NaN/Inf loss or gradient norm skips the update with no
// change to weights, Adam moments or step counts, is counted, and stops the run after
// train.max_nonfinite_steps skips in a row with the last checkpoint intact; weights holding
// NaN/Inf are refused on load, naming the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "device_access.h"
#include "cli_util.h"
#include "core/rng.h"
#include "dist/communicator.h"
#include "io/checkpoint_dir.h"
#include "train/checkpoint.h"
#include "train/nonfinite.h"
#include "train/train_step.h"
#include "train/trainer.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(Nonfinite, AStepIsFiniteOnlyWhenLossAndNormAre) {
  EXPECT_TRUE(finite_step(2.5, 0.1));
  EXPECT_FALSE(finite_step(kNaN, 0.1));
  EXPECT_FALSE(finite_step(kInf, 0.1));
  EXPECT_FALSE(finite_step(2.5, kNaN));
  EXPECT_FALSE(finite_step(2.5, -kInf));
}

TEST(Nonfinite, TheGuardStopsAfterTheLimitOfSkipsInARow) {
  NonfiniteGuard g(2);
  g.record(1, true, kNaN, 1.0);
  g.record(2, true, 1.0, kInf);
  g.record(3, false, 1.0, 1.0);  // a good step resets the run
  g.record(4, true, kNaN, kNaN);
  g.record(5, true, kNaN, kNaN);
  EXPECT_EQ(g.skipped_total(), 4);
  EXPECT_EQ(g.progress_note(), " | skipped 4 non-finite");
  const std::string e = error_of([&] { g.record(6, true, kNaN, kNaN); });
  EXPECT_NE(e.find("3 consecutive steps (4..6)"), std::string::npos) << e;
  EXPECT_NE(e.find("train.max_nonfinite_steps = 2"), std::string::npos) << e;
  EXPECT_EQ(error_of([] { NonfiniteGuard(0).record(1, false, 1, 1); }), "");
}

// TrainStep level: both injections leave every weight, moment and step count bit-identical.
struct StepRig {
  ModelConfig c;
  std::unique_ptr<Model> m;
  OptimConfig oc;
  std::unique_ptr<AdamW> opt;
  SingleProcess comm;
  std::unique_ptr<TrainStep> step;
  StepRig() {
    c.vocab = 17;
    c.d_model = 16;
    c.heads = 2;
    c.context = 8;
    c.layers = 2;
    c.domains = {{"a", "a", 0}};
    m = std::make_unique<Model>(c, 5);
    oc.lr = 1e-2f;
    opt = std::make_unique<AdamW>(oc, m->params());
    step = std::make_unique<TrainStep>(*m, *opt, comm, oc, plan_shards(m->params(), 1));
  }
  std::vector<Batch> batch(uint64_t seed) const {
    std::vector<Batch> out(1);
    Rng r(seed, 1);
    out[0].resize(3, c.context);
    for (auto& t : out[0].tokens) t = int32_t(r.below(uint64_t(c.vocab)));
    for (auto& t : out[0].targets) t = int32_t(r.below(uint64_t(c.vocab)));
    return out;
  }
  StepResult run(std::vector<Batch> micro, std::function<void(ParamSet&)> poison = nullptr) {
    step->set_after_backward(std::move(poison));
    step->prepare(micro);
    return step->run(micro, oc.lr, UpdateMask{});
  }
  // Every weight, moment and step count, as bytes.
  std::string snapshot() const {
    std::string s;
    const auto& ps = m->params().all();
    for (size_t i = 0; i < ps.size(); ++i) {
      const auto& st = opt->state()[i];
      for (const Tensor* t : {&ps[i].value, &st.m, &st.v}) {
        const Tensor h = ops::to_host(*t);
        s.append(reinterpret_cast<const char*>(h.bytes()), h.nbytes());
      }
      s.append(reinterpret_cast<const char*>(&st.step), sizeof st.step);
    }
    return s;
  }
};

TEST(Nonfinite, ANaNLossSkipsTheUpdateAndChangesNothing) {
  StepRig rig;
  ASSERT_FALSE(rig.run(rig.batch(1)).skipped);
  const std::string before = rig.snapshot();
  auto poisoned = rig.batch(2);
  // An infinite loss weight: the step's mask total is Inf, that token's weight Inf/Inf = NaN.
  poisoned[0].mask[4] = std::numeric_limits<float>::infinity();
  const StepResult r = rig.run(poisoned);
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(std::isnan(r.loss)) << r.loss;
  EXPECT_TRUE(rig.snapshot() == before) << "a skipped step changed weights, moments or steps";
  const StepResult next = rig.run(rig.batch(3));  // training goes on from the same state
  EXPECT_FALSE(next.skipped);
  EXPECT_TRUE(std::isfinite(next.loss) && next.loss > 0) << next.loss;
  EXPECT_FALSE(rig.snapshot() == before);
}

TEST(Nonfinite, AnInfiniteGradientSkipsTheUpdateAndChangesNothing) {
  StepRig rig;
  ASSERT_FALSE(rig.run(rig.batch(1)).skipped);
  const std::string before = rig.snapshot();
  const StepResult r = rig.run(rig.batch(2), [&](ParamSet& ps) {
    set_element(ps.all()[3].grad, 1, std::numeric_limits<float>::infinity());
  });
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(std::isfinite(r.loss)) << "only the gradient was poisoned";
  EXPECT_TRUE(std::isinf(r.grad_norm)) << r.grad_norm;
  EXPECT_TRUE(rig.snapshot() == before) << "a skipped step changed weights, moments or steps";
}

Config tiny_run(int64_t steps) {
  Config c;
  c.model.d_model = 16;
  c.model.layers = 2;
  c.model.heads = 2;
  c.model.context = 8;
  c.train.batch = 2;
  c.train.steps = steps;
  c.train.log_every = 2;
  c.train.eval_rows = 4;
  c.train.ckpt_every = 4;
  return c;
}

std::vector<nlohmann::json> metrics(const std::string& out) {
  std::vector<nlohmann::json> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) v.push_back(nlohmann::json::parse(line));
  return v;
}

// Run-loop level: a poisoned batch at step 4 is skipped, counted in metrics and the progress
// line, and the run finishes.
TEST(Nonfinite, TheRunSkipsAPoisonedStepCountsItAndGoesOn) {
  TempDir tmp("nonfinite-run");
  RunOptions run{tmp / "out", "", -1, true};
  run.before_step = [](int64_t step, std::vector<Batch>& micro) {
    if (step == 3) micro[0].mask[0] = std::numeric_limits<float>::infinity();  // NaN loss
  };
  ::testing::internal::CaptureStderr();
  const TrainSummary s = train(tiny_run(8), run);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.steps, 8);
  EXPECT_EQ(s.skipped_steps, 1);
  EXPECT_NE(err.find("skipped 1 non-finite"), std::string::npos) << err;
  const auto recs = metrics(tmp / "out");
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(recs[0]["skipped_steps"], 0);
  EXPECT_EQ(recs[1]["skipped_steps"], 1);  // step 4, a logged one
  EXPECT_TRUE(recs[1]["grad_norm"].is_null()) << "its NaN norm is JSON null, not a bare nan";
  EXPECT_TRUE(recs[1]["loss"].is_number()) << "the tokens' own losses stay finite";
  EXPECT_EQ(recs[3]["skipped_steps"], 1);
  EXPECT_TRUE(recs[3]["grad_norm"].is_number()) << recs[3];
  // The checkpoint after the skip holds finite weights and loads.
  EXPECT_NO_THROW(load_checkpoint_model(tmp / "out/checkpoints"));
}

// Gradients that stay infinite: the run stops after train.max_nonfinite_steps skips in a row,
// and the checkpoint written before is intact.
TEST(Nonfinite, TheRunStopsAfterTooManySkipsInARowWithTheLastCheckpointIntact) {
  TempDir tmp("nonfinite-stop");
  Config cfg = tiny_run(20);
  cfg.train.max_nonfinite_steps = 3;
  RunOptions run{tmp / "out", "", -1, false};
  run.after_backward = [](int64_t step, ParamSet& ps) {
    if (step >= 5) set_element(ps.all()[0].grad, 0, std::numeric_limits<float>::infinity());
  };
  const std::string e = error_of([&] { train(cfg, run); });
  EXPECT_NE(e.find("4 consecutive steps (6..9)"), std::string::npos) << e;
  EXPECT_NE(e.find("last checkpoint is intact"), std::string::npos) << e;
  const std::string ck = resolve_checkpoint(tmp / "out/checkpoints");
  EXPECT_EQ(fs::path(ck).filename(), "step-00000008");  // weights of step 5: finite
  EXPECT_TRUE(fs::exists(tmp / "out/checkpoints/step-00000004"));
  EXPECT_NO_THROW(verify_checkpoint(ck));
  EXPECT_NO_THROW(load_checkpoint_model(ck));
}

// A checkpoint whose weights hold a NaN (its manifest consistent: written so) is refused by
// resume, eval and generate, naming the tensor; eval --json never prints a bare nan.
TEST(Nonfinite, WeightsHoldingNaNAreRefusedOnLoadNamingTheTensor) {
  TempDir tmp("nonfinite-load");
  Config cfg = tiny_run(4);
  cfg.train.experts = "model";
  ASSERT_NO_THROW(train(cfg, RunOptions{tmp / "out", "", -1, false}));
  {  // the same checkpoint again, one weight NaN, written (and checksummed) by the writer
    CheckpointInfo info;
    auto m = load_checkpoint_model(tmp / "out/checkpoints", &info);
    AdamW opt(info.cfg.optim, m->params());
    load_optimizer(opt, m->params(), info.dir);
    set_element(m->params().at("blocks.0.ln1.b").value, 2, std::numeric_limits<float>::quiet_NaN());
    save_checkpoint(tmp / "bad", info.cfg, *m, &opt, info.state);
  }
  const std::string bad = resolve_checkpoint(tmp / "bad");
  EXPECT_NO_THROW(verify_checkpoint(bad)) << "the manifest matches: only the values are bad";
  const std::string e = error_of([&] { load_checkpoint_model(bad); });
  EXPECT_NE(e.find("tensor 'blocks.0.ln1.b' holds a non-finite value (nan at element 2"),
            std::string::npos) << e;
  auto r = sigma_cmd("eval --json --ckpt " + bad);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("blocks.0.ln1.b"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(": nan"), std::string::npos) << r.out;
  r = sigma_cmd("train --quiet --resume " + bad + " --set train.steps=6 --out " + tmp / "resumed");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("blocks.0.ln1.b"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "resumed/checkpoints/step-00000006")) << "a NaN checkpoint was written";
}

// The same for an ECSS resume: the experts go to the store, not through load_model, and a NaN
// in one is refused naming it before its group reaches the store.
TEST(Nonfinite, ExpertWeightsHoldingNaNAreRefusedByAnEcssResume) {
  TempDir tmp("nonfinite-ecss");
  Config cfg = tiny_run(4);
  cfg.train.experts = "model";  // every expert in model.safetensors
  ASSERT_NO_THROW(train(cfg, RunOptions{tmp / "out", "", -1, false}));
  const std::string expert = "blocks.1.rre.copy.w_in";
  {
    CheckpointInfo info;
    auto m = load_checkpoint_model(tmp / "out/checkpoints", &info);
    AdamW opt(info.cfg.optim, m->params());
    load_optimizer(opt, m->params(), info.dir);
    set_element(m->params().at(expert).value, 7, std::numeric_limits<float>::infinity());
    save_checkpoint(tmp / "bad", info.cfg, *m, &opt, info.state);
  }
  const auto r = sigma_cmd("train --quiet --resume " + tmp / "bad" + " --set train.steps=6 --set "
                           "train.experts=ecss --out " + tmp / "resumed");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("'" + expert + "' holds a non-finite value (inf at element 7"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "resumed/checkpoints/step-00000006")) << "a checkpoint was written";
}

}  // namespace
