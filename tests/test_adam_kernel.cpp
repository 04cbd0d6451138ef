// The one Adam kernel (cpu::adam_step, src/kernels/cpu/adam.h; ops::adam_step on the cpu
// backend) against a scalar reference in double, element by element, on sizes around the vector
// width (1, 15, 17) and one large, odd size that is split over threads (1000003); both dispatch
// paths, fp32 and bf16 gradients. And: AdamW, the ref backend and the expert store's direct call
// all update bit for bit alike.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "avx512_where.h"
#include "device_access.h"
#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/cpu/adam.h"
#include "kernels/ops.h"
#include "optim/adamw.h"

using namespace sigma;
using cpu::adam_path_available;
using cpu::adam_path_name;
using cpu::adam_step;
using cpu::AdamPath;
using cpu::kAdamParallelMin;

namespace {

constexpr double kU = 1.0 / 16777216.0;  // fp32 unit roundoff, 2^-24


struct State {
  std::vector<float> w, m, v, g;
  std::vector<uint16_t> gb;  // g rounded to bf16
};

State make_state(int64_t n, uint64_t seed) {
  State s;
  s.w.resize(n), s.m.resize(n), s.v.resize(n), s.g.resize(n), s.gb.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    s.w[i] = rng_normal(seed, 1, i);
    s.m[i] = 0.01f * rng_normal(seed, 2, i);
    s.v[i] = 1e-4f * rng_uniform(seed, 3, i) * rng_uniform(seed, 3, i + n);
    float g = 0.1f * rng_normal(seed, 4, i);
    if (i % 97 == 5) g = 0.0f;        // a zero gradient: m, v only decay
    if (i % 89 == 7) g *= 1000.0f;    // an outlier
    s.g[i] = g;
    s.gb[i] = to_bf16(g);
  }
  if (n > 3) s.v[1] = 0.0f;  // v exactly zero before the step
  return s;
}

// The update formula in double from the kernel's fp32 inputs and fp32-derived constants, with
// a bound on the fp32 kernel's rounding error for each output; returns the mismatch count.
int64_t check_step(const State& before, const std::vector<float>& gin, const float* w,
                   const float* m, const float* v, const AdamStepArgs& a, const char* what) {
  const AdamBiasCorrections bc = adam_bias_corrections(a.beta1, a.beta2, a.step);
  const double ss = float(a.lr / bc.bc1), isb2 = float(1.0f / std::sqrt(bc.bc2));
  const double dec = float(a.lr * a.weight_decay), omb1 = float(1.0f - a.beta1),
               omb2 = float(1.0f - a.beta2);
  int64_t bad = 0;
  for (size_t i = 0; i < before.w.size(); ++i) {
    const double g = double(gin[i]) * a.grad_scale;
    const double m0 = before.m[i], v0 = before.v[i], w0 = before.w[i];
    const double mr = a.beta1 * m0 + omb1 * g;
    const double vr = a.beta2 * v0 + omb2 * g * g;
    const double den = std::sqrt(vr) * isb2 + a.eps;
    const double upd = ss * mr / den;
    const double wr = w0 - (dec * w0 + upd);
    // Each fp32 operation rounds by at most u (relative); cancellation in m is bounded by the
    // magnitudes of its two terms and carried into the update through ss / den.
    const double tol_m = 4 * kU * (std::fabs(a.beta1 * m0) + std::fabs(omb1 * g)) + 1e-37;
    const double tol_v = 4 * kU * vr + 1e-37;
    const double tol_w = 2 * kU * std::fabs(wr) + 8 * kU * (std::fabs(dec * w0) + std::fabs(upd)) +
                         ss * tol_m / den + 1e-37;
    const bool ok = std::fabs(m[i] - mr) <= tol_m && std::fabs(v[i] - vr) <= tol_v &&
                    std::fabs(w[i] - wr) <= tol_w;
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << what << " i=" << i << ": w " << w[i] << " vs " << wr << " (tol " << tol_w
                    << "), m " << m[i] << " vs " << mr << ", v " << v[i] << " vs " << vr;
  }
  return bad;
}

const AdamStepArgs kSteps[] = {
    {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1},
    {3e-3f, 0.9f, 0.95f, 1e-10f, 0.0f, 0.25f, 2},   // eps_rre, clipping, no decay
    {2e-4f, 0.8f, 0.999f, 1e-6f, 0.01f, 1.0f, 37},  // other betas, a late step
};

// The paths this CPU runs; says which ran and which it skipped.
std::vector<AdamPath> paths() {
  std::vector<AdamPath> p{AdamPath::Scalar};
  const bool avx512 = adam_path_available(AdamPath::Avx512);
  if (avx512) p.push_back(AdamPath::Avx512);
  std::printf("Adam paths compared: scalar%s%s; skipped (not on this CPU): %s\n", avx512 ? ", avx512" : "",
              avx512 ? sigma::testing::kAvx512Where : "", avx512 ? "none" : "avx512");
  return p;
}

// Runs the three steps on `s` with fp32 or bf16 gradients, checking each against the reference.
void run_and_check(State& s, AdamPath path, bool bf16, const std::string& tag) {
  std::vector<float> gin(s.g.size());
  for (size_t i = 0; i < gin.size(); ++i) gin[i] = bf16 ? from_bf16(s.gb[i]) : s.g[i];
  for (const AdamStepArgs& a : kSteps) {
    State before = s;
    if (bf16)
      adam_step(s.w.data(), s.m.data(), s.v.data(), s.gb.data(), int64_t(s.w.size()), a, path);
    else
      adam_step(s.w.data(), s.m.data(), s.v.data(), s.g.data(), int64_t(s.w.size()), a, path);
    const std::string what = tag + " step " + std::to_string(a.step);
    EXPECT_EQ(check_step(before, gin, s.w.data(), s.m.data(), s.v.data(), a, what.c_str()), 0);
  }
}

class AdamKernel : public ::testing::TestWithParam<int64_t> {};

TEST_P(AdamKernel, MatchesDoubleReferenceOnBothPathsAndDtypes) {
  const int64_t n = GetParam();
  const std::vector<AdamPath> run = paths();
  for (bool bf16 : {false, true}) {
    std::vector<State> results;
    for (AdamPath p : run) {
      State s = make_state(n, 42);
      run_and_check(s, p, bf16,
                    std::string(adam_path_name(p)) + (bf16 ? " bf16" : " f32") + " n=" +
                        std::to_string(n));
      results.push_back(std::move(s));
    }
    // Every path performs the same fp32 operations: the results agree bit for bit.
    for (size_t r = 1; r < results.size(); ++r) {
      EXPECT_EQ(0, std::memcmp(results[0].w.data(), results[r].w.data(), n * 4)) << "w, bf16=" << bf16;
      EXPECT_EQ(0, std::memcmp(results[0].m.data(), results[r].m.data(), n * 4)) << "m, bf16=" << bf16;
      EXPECT_EQ(0, std::memcmp(results[0].v.data(), results[r].v.data(), n * 4)) << "v, bf16=" << bf16;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, AdamKernel, ::testing::Values(1, 15, 17, 1000003));

bool same_bits(const State& a, const State& b) {
  const size_t n = a.w.size() * 4;
  return std::memcmp(a.w.data(), b.w.data(), n) == 0 && std::memcmp(a.m.data(), b.m.data(), n) == 0 &&
         std::memcmp(a.v.data(), b.v.data(), n) == 0;
}

// One kernel: the expert store's direct call (cpu::adam_step), the front on either backend, and
// AdamW::step for a dense parameter (its weight decay on, its own step count) give the same bits.
TEST(AdamKernelIsTheOnlyKernel, AdamwAndBothBackendsMatchTheStoresCallBitForBit) {
  const int64_t n = 4099;
  OptimConfig cfg;
  cfg.beta1 = 0.9f, cfg.beta2 = 0.95f, cfg.eps = 1e-8f, cfg.weight_decay = 0.1f;
  ParamSet ps;
  Param& p = ps.add("w", {n}, /*decay=*/true);
  State init = make_state(n, 7);
  ops::upload(p.value, init.w.data(), n * 4);
  ops::upload(p.grad, init.g.data(), n * 4);
  AdamW opt(cfg, ps);
  State direct = make_state(n, 7), viaref = make_state(n, 7);
  std::fill(direct.m.begin(), direct.m.end(), 0.0f);  // AdamW's moments start at zero
  std::fill(direct.v.begin(), direct.v.end(), 0.0f);
  viaref.m = direct.m, viaref.v = direct.v;
  for (int64_t step = 1; step <= 3; ++step) {
    const float lr = 1e-3f * float(step), scale = step == 2 ? 0.5f : 1.0f;
    opt.step(ps, lr, scale);
    AdamStepArgs a{lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, scale, step};
    adam_step(direct.w.data(), direct.m.data(), direct.v.data(), direct.g.data(), n, a);
    ops::use_backend(ops::BackendKind::Ref);
    ops::adam_step(viaref.w.data(), viaref.m.data(), viaref.v.data(), viaref.g.data(), n, a);
    ops::use_backend(ops::BackendKind::Cpu);
  }
  State viaadamw = direct;
  ops::download(viaadamw.w.data(), p.value, n * 4);
  ops::download(viaadamw.m.data(), opt.state()[0].m, n * 4);
  ops::download(viaadamw.v.data(), opt.state()[0].v, n * 4);
  EXPECT_TRUE(same_bits(direct, viaadamw)) << "AdamW::step differs from cpu::adam_step";
  EXPECT_TRUE(same_bits(direct, viaref)) << "the ref backend's adam_step differs from the cpu's";
  // And the result is the formula's, within the rounding bound.
  State before = make_state(n, 7);
  std::fill(before.m.begin(), before.m.end(), 0.0f);
  std::fill(before.v.begin(), before.v.end(), 0.0f);
  State one = before;
  const AdamStepArgs a1{1e-3f, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, 1.0f, 1};
  adam_step(one.w.data(), one.m.data(), one.v.data(), one.g.data(), n, a1);
  EXPECT_EQ(check_step(before, before.g, one.w.data(), one.m.data(), one.v.data(), a1, "step 1"), 0);
}

TEST(AdamKernelThreads, SameBitsForAnyThreadCount) {
  const int64_t n = 3 * kAdamParallelMin + 5;
  State a = make_state(n, 9), b = make_state(n, 9);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  adam_step(a.w.data(), a.m.data(), a.v.data(), a.g.data(), n, kSteps[0]);
  omp_set_num_threads(3);  // more threads than cores: uneven chunks, a tail in the last
  adam_step(b.w.data(), b.m.data(), b.v.data(), b.g.data(), n, kSteps[0]);
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(a.w.data(), b.w.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(a.m.data(), b.m.data(), n * 4));
  EXPECT_EQ(0, std::memcmp(a.v.data(), b.v.data(), n * 4));
}

TEST(AdamKernelArgs, RejectsStepZeroAndAcceptsEmpty) {
  float w = 1, m = 0, v = 0, g = 1;
  AdamStepArgs a;
  a.step = 0;
  EXPECT_THROW(adam_step(&w, &m, &v, &g, 1, a), Error);
  a.step = 1;
  adam_step(&w, &m, &v, &g, 0, a);  // n = 0 touches nothing
  EXPECT_EQ(w, 1.0f);
  // First step with bias correction: m/bc1 = g and sqrt(v/bc2) = |g|, so w moves by ~lr.
  adam_step(&w, &m, &v, &g, 1, a);
  EXPECT_NEAR(w, 1.0f - a.lr, 1e-6f);
}

}  // namespace
