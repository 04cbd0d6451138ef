// bf16 compute (train.precision = bf16, kernels/ops.h): the fp32 -> bf16 conversion, the bf16
// GEMM against fp32 within the bf16 rounding bound, the precision switch of the ops front, a
// short bf16 training run against fp32, and the loss-only cross-entropy's summation.
// (cpu vs ref of the *_bf16 ops, element by element, is in tests/test_ops.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "train/config.h"
#include "train/trainer.h"

using namespace sigma;

namespace {

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  const float ulp = std::ldexp(1.0f, -7);  // bf16's spacing in [1, 2)
  EXPECT_EQ(round_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_bf16(1.0f + ulp / 2), 1.0f);                   // tie, 1.0 is even
  EXPECT_EQ(round_bf16(1.0f + 3 * ulp / 2), 1.0f + 2 * ulp);     // tie, round up to even
  EXPECT_EQ(round_bf16(std::nextafter(1.0f + ulp / 2, 2.0f)), 1.0f + ulp);  // just above a tie
  EXPECT_EQ(round_bf16(std::nextafter(1.0f + ulp / 2, 0.0f)), 1.0f);        // just below
  EXPECT_EQ(round_bf16(-1.0f - 3 * ulp / 2), -1.0f - 2 * ulp);   // sign symmetric
  // The largest bf16 and what overflows: above it by half a bf16 ulp or more rounds to infinity.
  const float top = from_bits(0x7f7f0000u);
  EXPECT_EQ(round_bf16(top), top);
  EXPECT_EQ(round_bf16(std::numeric_limits<float>::max()), INFINITY);
  // Subnormals round like any other value (bf16 has fp32's exponent range).
  EXPECT_EQ(to_bf16(from_bits(0x00008000u)), 0x0000u);  // tie to even: 0
  EXPECT_EQ(to_bf16(from_bits(0x00018000u)), 0x0002u);  // tie to even: up
}

TEST(Bf16, KeepsInfinitiesAndNaNs) {
  EXPECT_EQ(to_bf16(INFINITY), 0x7f80u);
  EXPECT_EQ(to_bf16(-INFINITY), 0xff80u);
  // NaNs whose rounding would carry into the sign or the exponent, or lose every payload bit.
  for (uint32_t nan : {0x7fffffffu, 0x7f800001u, 0x7fc00000u, 0xffffffffu, 0xff800001u}) {
    const uint16_t h = to_bf16(from_bits(nan));
    EXPECT_TRUE(std::isnan(from_bf16(h))) << std::hex << nan << " -> " << h;
    EXPECT_EQ(h >> 15, nan >> 31) << "sign of " << std::hex << nan;
  }
}

// |C_bf16 - C_fp32| <= (2 u_bf16 + u_bf16^2 + 2 K u_fp32) sum_k |a_k b_k| (each input rounded
// once, relative u_bf16 = 2^-8; each side's fp32 sum within K u_fp32), and the rounding shows:
// some element differs by more than the fp32 sums alone can explain.
void expect_bf16_gemm_bound(ops::BackendKind backend) {
  const int64_t M = 37, N = 45, K = 300;
  std::vector<float> A(M * K), B(K * N);
  for (size_t i = 0; i < A.size(); ++i) A[i] = rng_normal(1, 1, i);
  for (size_t i = 0; i < B.size(); ++i) B[i] = rng_normal(1, 2, i);
  std::vector<float> c32(M * N), c16(M * N);
  ops::use_backend(backend);
  ops::gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, c32.data(), N);
  ops::gemm_bf16(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, c16.data(), N);
  ops::use_backend(ops::BackendKind::Cpu);
  const double ub = std::ldexp(1.0, -8), u = std::ldexp(1.0, -24);
  double worst = 0, most = 0;  // the bound's use, and the largest |diff| / fp32-only bound
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double mass = 0;
      for (int64_t k = 0; k < K; ++k) mass += std::fabs(double(A[i * K + k]) * B[k * N + j]);
      const double diff = std::fabs(double(c16[i * N + j]) - c32[i * N + j]);
      worst = std::max(worst, diff / ((2 * ub + ub * ub + 2 * K * u) * mass));
      most = std::max(most, diff / (2 * K * u * mass));
    }
  EXPECT_LE(worst, 1.0);
  EXPECT_GT(most, 1.0) << "gemm_bf16 matches fp32 too well: were the inputs rounded?";
  std::printf("  %s: worst |bf16 - fp32| uses %.2f of the bf16 bound\n",
              ops::backend(backend).name, worst);
}

TEST(Bf16, GemmMatchesFp32WithinTheBf16RoundingBound) {
  expect_bf16_gemm_bound(ops::BackendKind::Cpu);
  expect_bf16_gemm_bound(ops::BackendKind::Ref);
}

// use_precision sends gemm and linear_* to the bf16 ops: bit for bit what the bf16 op gives.
TEST(Bf16, PrecisionSwitchRoutesTheFrontsGemms) {
  const int64_t N = 9, in = 20, out = 13;
  std::vector<float> x(N * in), w(in * out), y1(N * out), y2(N * out), y3(N * out);
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng_normal(2, 1, i);
  for (size_t i = 0; i < w.size(); ++i) w[i] = rng_normal(2, 2, i);
  ops::linear_forward_bf16(y1.data(), x.data(), w.data(), nullptr, N, in, out);
  ops::use_precision("bf16");
  EXPECT_EQ(ops::precision(), ops::Precision::Bf16);
  ops::linear_forward(y2.data(), x.data(), w.data(), nullptr, N, in, out);
  ops::use_precision("fp32");
  ops::linear_forward(y3.data(), x.data(), w.data(), nullptr, N, in, out);
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0);
  EXPECT_NE(std::memcmp(y1.data(), y3.data(), y1.size() * 4), 0);
  EXPECT_THROW(ops::use_precision("fp16"), Error);
  EXPECT_EQ(ops::precision(), ops::Precision::Fp32);
}

// The tiny main job in bf16 and in fp32: held-out losses within 1 % (bf16 changes the rounding,
// not the model), and not identical (train.precision was applied).
TEST(Bf16, TrainingInBf16TracksFp32) {
  auto run = [](const char* precision) {
    Config cfg;
    cfg.load("", {"model.d_model=32", "model.layers=2", "model.heads=2", "model.context=16",
                  "train.batch=4", "train.steps=20", "train.eval_rows=8", "optim.warmup=2",
                  std::string("train.precision=") + precision});
    RunOptions opts;
    opts.progress = false;
    TrainSummary s = train(cfg, opts);
    ops::use_precision(ops::Precision::Fp32);
    return s;
  };
  const TrainSummary a = run("fp32"), b = run("bf16");
  ASSERT_EQ(a.domains.size(), b.domains.size());
  bool differ = false;
  for (size_t i = 0; i < a.domains.size(); ++i) {
    differ = differ || a.domains[i].loss != b.domains[i].loss;
    EXPECT_NEAR(b.domains[i].loss, a.domains[i].loss, 0.01 * a.domains[i].loss)
        << a.domains[i].name;
  }
  EXPECT_TRUE(differ) << "bf16 gave fp32's bits: was train.precision applied?";
}

// One large logit and many small ones: summed sequentially in fp32 after the 1, each
// exp(-20) ~ 2e-9 is below half an ulp and vanishes, so the loss came out ~V * 2e-9 low.
TEST(SoftmaxXent, LossOnlyCountsSmallTerms) {
  const int64_t V = 50000;
  std::vector<float> logits(V, 0.0f);
  logits[0] = 20.0f;
  const int32_t target = 7;
  float loss = 0;
  ops::softmax_xent(logits.data(), &loss, &target, nullptr, 1, V);
  const double exact = 20.0 + std::log1p(double(V - 1) * std::exp(-20.0)) - 0.0;
  EXPECT_NEAR(loss, exact, 4e-6) << "exact " << exact;
}

}  // namespace
