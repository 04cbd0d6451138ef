// bf16 compute (train.precision = bf16, kernels/ops.h): the fp32 -> bf16 conversion, the bf16
// GEMM and the bf16 flash attention against fp32 within the bf16 rounding bound, the precision
// switch of the ops front, the bf16 weight copies (the same bits as converting per product,
// one conversion per registration, never stale after an optimizer step), a short bf16 training
// run against fp32, and the loss-only cross-entropy's summation.
// (cpu vs ref of the *_bf16 ops, element by element, is in tests/test_ops.cpp.)
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/bf16.h"
#include "device_access.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/xent.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "run/config.h"
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

// The kernels' vector conversion (cpu::to_bf16: vcvtneps2bf16 where the CPU has avx512_bf16,
// integer rounding otherwise) gives core to_bf16's bits: ties, subnormals (which the
// instruction would flush) alone and among normal values, NaN payloads, overflow, signs, tails.
TEST(Bf16, TheKernelsConversionGivesTheSameBits) {
  std::vector<uint32_t> special = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0xbf818000u,
                                   0x00008000u, 0x00018000u, 0x807fffffu, 0x00000001u,
                                   0x00800000u, 0x7f7f8000u, 0x7f7fffffu, 0x7f800000u,
                                   0xff800000u, 0x7f800001u, 0x7fffffffu, 0xffc00001u,
                                   0x80000000u, 0x00000000u, 0x3f7fffffu};
  std::vector<float> x;
  for (int rep = 0; rep < 3; ++rep)  // the specials at every offset within a 16-lane vector
    for (uint32_t b : special) x.push_back(from_bits(b));
  for (int i = 0; i < 64; ++i) x.push_back(rng_normal(7, 1, uint64_t(i)));  // normal-only vectors
  x.push_back(from_bits(0x00400000u));  // a subnormal in the scalar tail
  std::vector<uint16_t> got(x.size());
  cpu::to_bf16(got.data(), 0, x.data(), 0, 1, int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(got[i], to_bf16(x[i])) << "element " << i << ", bits " << std::hex << bits(x[i]);
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

// Causal attention with bf16 products against fp32, per element, within a first-order bound:
// rounding q and k moves score s_ij by at most a_ij = (2e + e^2) scale sum_c |q_ic k_jc|
// (e = 2^-8), which moves P_ij by at most 2 A_i P_ij (A_i = max_j a_ij); P and v are rounded
// once more. So |out_bf16 - out_fp32| <= sum_j P_ij |v_j| (2 A_i + 2 e), and dv likewise with
// dO for v; 1.5x covers second-order terms and the fp32 sums. dq and dk (through dS, a
// difference) are held to 4 % of their largest element. The bf16 results must also differ
// from fp32 by more than fp32 rounding explains (the products were rounded).
TEST(Bf16, FlashAttentionMatchesFp32WithinTheBf16Bound) {
  const int64_t B = 2, H = 2, hd = 16, d = H * hd, T = 150;
  const ops::AttnShape s{B, T, T, H, hd};
  const float scale = 1.0f / std::sqrt(float(hd));
  std::vector<float> qkv(size_t(B * T * 3 * d)), dout(size_t(B * T * d));
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = rng_normal(3, 1, i);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = rng_normal(3, 2, i);
  const ops::AttnOperand q{qkv.data(), 3 * d, T * 3 * d}, k{qkv.data() + d, 3 * d, T * 3 * d},
      v{qkv.data() + 2 * d, 3 * d, T * 3 * d};
  struct Run {
    std::vector<float> out, lse, g;
  };
  auto run = [&](bool bf16) {
    Run r{std::vector<float>(size_t(B * T * d)), std::vector<float>(size_t(B * H * T)),
          std::vector<float>(qkv.size())};
    const int64_t ld = 3 * d, bs = T * 3 * d;
    (bf16 ? ops::flash_attention_forward_bf16 : ops::flash_attention_forward)(
        r.out.data(), r.lse.data(), q, k, v, s, scale);
    (bf16 ? ops::flash_attention_backward_bf16 : ops::flash_attention_backward)(
        {r.g.data(), ld, bs}, {r.g.data() + d, ld, bs}, {r.g.data() + 2 * d, ld, bs},
        dout.data(), r.out.data(), r.lse.data(), q, k, v, s, scale);
    return r;
  };
  const Run f = run(false), h = run(true);
  const double e = std::ldexp(1.0, -8);
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t hh, int64_t c) {
    return size_t(((b * T + t) * 3 + part) * d + hh * hd + c);
  };
  double worst_out = 0, worst_dv = 0, most = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < H; ++hh) {
      std::vector<double> P(size_t(T * T), 0.0), A(size_t(T), 0.0);
      for (int64_t i = 0; i < T; ++i) {  // fp32's probabilities (from its lse) and A_i
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0, mass = 0;
          for (int64_t c = 0; c < hd; ++c) {
            const double x = double(qkv[at(b, i, 0, hh, c)]) * qkv[at(b, j, 1, hh, c)];
            dot += x, mass += std::fabs(x);
          }
          P[size_t(i * T + j)] = std::exp(scale * dot - f.lse[size_t((b * H + hh) * T + i)]);
          A[size_t(i)] = std::max(A[size_t(i)], (2 * e + e * e) * scale * mass);
        }
      }
      for (int64_t c = 0; c < hd; ++c) {
        for (int64_t i = 0; i < T; ++i) {
          double mass = 0;
          for (int64_t j = 0; j <= i; ++j)
            mass += P[size_t(i * T + j)] * std::fabs(qkv[at(b, j, 2, hh, c)]);
          const size_t o = size_t((b * T + i) * d + hh * hd + c);
          const double diff = std::fabs(double(h.out[o]) - f.out[o]);
          worst_out = std::max(worst_out, diff / (1.5 * (2 * A[size_t(i)] + 2 * e) * mass));
          most = std::max(most, diff / (1e-5 * mass + 1e-30));
        }
        for (int64_t j = 0; j < T; ++j) {
          double bound = 0;
          for (int64_t i = j; i < T; ++i)
            bound += P[size_t(i * T + j)] * std::fabs(dout[size_t((b * T + i) * d + hh * hd + c)]) *
                     (2 * A[size_t(i)] + 2 * e);
          const size_t g = at(b, j, 2, hh, c);
          worst_dv = std::max(worst_dv, std::fabs(double(h.g[g]) - f.g[g]) / (1.5 * bound));
        }
      }
    }
  EXPECT_LE(worst_out, 1.0);
  EXPECT_LE(worst_dv, 1.0);
  EXPECT_GT(most, 1.0) << "bf16 attention matches fp32 too well: were the products rounded?";
  for (int64_t part : {0, 1}) {  // dq, dk: normwise
    double top = 0, diff = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < d; ++c) {
          const size_t g = size_t(((b * T + t) * 3 + part) * d + c);
          top = std::max(top, std::fabs(double(f.g[g])));
          diff = std::max(diff, std::fabs(double(h.g[g]) - f.g[g]));
        }
    EXPECT_GT(top, 0.0);
    EXPECT_LE(diff, 0.04 * top) << (part ? "dk" : "dq");
  }
  std::printf("  out uses %.2f and dv %.2f of their bf16 bounds\n", worst_out, worst_dv);
}

// A registered matrix is read through its bf16 copy: the same bits as converting it in every
// product, one conversion however many products read it, and a fresh one after clear + add.
TEST(Bf16Mirror, CopiesGiveTheConversionsBitsAndFollowEachRegistration) {
  const int64_t M = 23, N = 31, K = 600;  // W: one 16 Ki piece of the parallel conversion + a tail
  std::vector<float> A(size_t(M * K)), W(size_t(K * N));
  for (size_t i = 0; i < A.size(); ++i) A[i] = rng_normal(4, 1, i);
  for (size_t i = 0; i < W.size(); ++i) W[i] = rng_normal(4, 2, i);
  auto product = [&](std::vector<float>& C, bool tb) {  // A W, or A (W^T)^T with W read as [N,K]
    C.assign(size_t(M * N), 0.0f);
    ops::gemm_bf16(false, tb, M, N, K, 1.0f, A.data(), K, W.data(), tb ? K : N, 0.0f, C.data(), N);
  };
  std::vector<float> plain, plain_t, mirrored, mirrored_t;
  product(plain, false);
  product(plain_t, true);
  const int64_t before = cpu::bf16_mirror_conversions(), packs = cpu::bf16_mirror_packs();
  ops::bf16_mirror_add(W.data(), int64_t(W.size()));
  product(mirrored, false);
  product(mirrored_t, true);
  product(mirrored, false);
  EXPECT_EQ(cpu::bf16_mirror_conversions() - before, 1) << "three products, one conversion";
  // As B the copy is packed once per layout (W, and W read transposed) where oneDNN multiplies
  // bf16; the widened fp32 products of an AVX2-only CPU read it plain.
  EXPECT_EQ(cpu::bf16_mirror_packs() - packs, cpu::native_bf16() ? 2 : 0);
  EXPECT_EQ(std::memcmp(plain.data(), mirrored.data(), plain.size() * 4), 0);
  EXPECT_EQ(std::memcmp(plain_t.data(), mirrored_t.data(), plain.size() * 4), 0);
  // The weights change (an optimizer step), the owner clears and registers again.
  ops::bf16_mirror_clear();
  for (float& w : W) w *= 1.5f;
  ops::bf16_mirror_add(W.data(), int64_t(W.size()));
  std::vector<float> after;
  product(after, false);
  EXPECT_EQ(cpu::bf16_mirror_packs() - packs, cpu::native_bf16() ? 3 : 0) << "packed again";
  ops::bf16_mirror_clear();
  product(plain, false);
  EXPECT_EQ(std::memcmp(plain.data(), after.data(), plain.size() * 4), 0)
      << "the product read a stale bf16 copy";
}

// A range registered every step, dropped or live at the step's clear, keeps its buffer: a fresh
// one is zeroed and faulted in (a step's activations: ~100 MB a step, on one thread).
TEST(Bf16Mirror, RangesRegisteredAgainReuseTheirBuffers) {
  std::vector<float> a(5000, 1.0f), b(7000, 2.0f);
  ops::bf16_mirror_clear();
  for (int step = 0; step < 3; ++step) {
    const int64_t before = cpu::bf16_mirror_allocations();
    cpu::bf16_mirror_add(a.data(), int64_t(a.size()));
    cpu::bf16_mirror_add(b.data(), int64_t(b.size()));
    cpu::bf16_mirror_drop(b.data());  // as the FFN drops its hidden activations in backward
    cpu::bf16_mirror_clear();
    EXPECT_EQ(cpu::bf16_mirror_allocations() - before, step == 0 ? 2 : 0) << "step " << step;
  }
  cpu::bf16_mirror_clear();  // nothing registered: the spares stay
  const int64_t before = cpu::bf16_mirror_allocations();
  cpu::bf16_mirror_add(b.data(), int64_t(b.size()));
  EXPECT_EQ(cpu::bf16_mirror_allocations(), before);
  cpu::bf16_mirror_clear();
}

// Weight gradients (A transposed, up to 2048 rows, a long reduction) run as blocks of rows, one
// product a thread: the bits must not depend on the thread count, and the product must be the
// product (blocks that miss rows or overlap would fail both).
TEST(Bf16Matmul, WeightGradientsInBlocksGiveTheSameBitsOnAnyTeam) {
  const int64_t tokens = 1024, in = 576, out = 320;  // rows not a multiple of the 64-row blocks' half
  std::vector<float> x(size_t(tokens * in)), dy(size_t(tokens * out));
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng_normal(21, 1, i);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = rng_normal(21, 2, i);
  auto dw_with = [&](int threads) {
    std::vector<float> dw(size_t(in * out), 0.25f);  // accumulated into, as a step's gradients
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    ops::gemm_bf16(true, false, in, out, tokens, 1.0f, x.data(), in, dy.data(), out, 1.0f, dw.data(), out);
    omp_set_num_threads(saved);
    return dw;
  };
  const std::vector<float> one = dw_with(1), two = dw_with(2);
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * 4), 0) << "bits depend on the team";
  int64_t far = 0;
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) {
      double ref = 0.25, mag = 0.0;
      for (int64_t t = 0; t < tokens; ++t) {
        const double p = double(round_bf16(x[size_t(t * in + i)])) * round_bf16(dy[size_t(t * out + j)]);
        ref += p;
        mag += std::abs(p);
      }
      far += std::abs(two[size_t(i * out + j)] - ref) > 1e-5 * mag + 1e-6;
    }
  EXPECT_EQ(far, 0) << "elements off the exact product of the bf16 operands";
}

// GELU's output, registered in the mirror (an FFN's hidden activations in bf16 training), gets
// its bf16 copy written by the GELU pass itself: the bits a conversion would give, and no
// conversion when a product reads it. Only a live, unconverted mirror of exactly the output
// range is claimed.
TEST(Bf16Mirror, GeluWritesTheCopyOfItsRegisteredOutput) {
  const int64_t n = 2 * 4096 + 77;  // two whole chunks of the kernel and a tail
  std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n), 0.0f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 3.0f * rng_normal(7, 1, i);
  cpu::bf16_mirror_add(y.data(), n);
  const int64_t before = cpu::bf16_mirror_conversions();
  cpu::fast_gelu_forward(y.data(), x.data(), n);
  std::vector<uint16_t> scratch;
  const cpu::Bf16View copy = cpu::bf16_operand(y.data(), 1, n, n, scratch);
  EXPECT_EQ(cpu::bf16_mirror_conversions(), before) << "the product converted the output again";
  EXPECT_TRUE(scratch.empty()) << "the product did not read the mirror";
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += copy.p[i] != to_bf16(y[size_t(i)]);
  EXPECT_EQ(wrong, 0) << "elements of the copy that are not to_bf16 of the output";
  cpu::bf16_mirror_clear();
  cpu::bf16_mirror_add(y.data(), n);
  EXPECT_EQ(cpu::bf16_mirror_claim(y.data(), n - 1), nullptr) << "a part of the range";
  EXPECT_EQ(cpu::bf16_mirror_claim(x.data(), n), nullptr) << "an unregistered range";
  cpu::bf16_operand(y.data(), 1, n, n, scratch);  // converted by a product first
  EXPECT_EQ(cpu::bf16_mirror_claim(y.data(), n), nullptr) << "an already converted copy";
  cpu::bf16_mirror_clear();
}

// LayerNorm's output and the loss's dL/dlogits, registered in the mirror (bf16 training: a
// block's a1 and a2, the final LayerNorm's output, the head's gradient) get their copies from
// the kernels that write them, as GELU's: to_bf16 of what they wrote, and no conversion when a
// product reads them. Unregistered, they write no copy and change no bits.
TEST(Bf16Mirror, LayerNormAndTheLossWriteTheCopiesOfTheirRegisteredOutputs) {
  const int64_t N = 37, C = 200, V = 1000;
  std::vector<float> x(static_cast<size_t>(N * C)), w(static_cast<size_t>(C)), b(w.size()),
      y(x.size()), plain(x.size()), mean(static_cast<size_t>(N)), rstd(mean.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = 2.0f * rng_normal(8, 1, i) + 0.5f;
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = 1.0f + 0.1f * rng_normal(8, 2, i);
    b[i] = 0.1f * rng_normal(8, 3, i);
  }
  std::vector<float> logits(static_cast<size_t>(N * V)), grads(logits.size()), loss(mean.size()),
      scale(mean.size(), 0.25f);
  std::vector<int32_t> targets(mean.size());
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 3.0f * rng_normal(8, 4, i);
  for (size_t i = 0; i < targets.size(); ++i) targets[i] = int32_t((i * 389) % V);
  cpu::layernorm_forward(plain.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  std::vector<float> plain_grads = logits;
  cpu::softmax_xent(plain_grads.data(), loss.data(), targets.data(), scale.data(), N, V);

  grads = logits;
  cpu::bf16_mirror_add(y.data(), N * C);
  cpu::bf16_mirror_add(grads.data(), N * V);
  const int64_t before = cpu::bf16_mirror_conversions();
  cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  cpu::softmax_xent(grads.data(), loss.data(), targets.data(), scale.data(), N, V);
  std::vector<uint16_t> scratch;
  const cpu::Bf16View y16 = cpu::bf16_operand(y.data(), N, C, C, scratch);
  const cpu::Bf16View g16 = cpu::bf16_operand(grads.data(), N, V, V, scratch);
  EXPECT_EQ(cpu::bf16_mirror_conversions(), before) << "a product converted an output again";
  EXPECT_TRUE(scratch.empty()) << "a product did not read the mirror";
  EXPECT_EQ(std::memcmp(y.data(), plain.data(), y.size() * 4), 0) << "LayerNorm's output changed";
  EXPECT_EQ(std::memcmp(grads.data(), plain_grads.data(), grads.size() * 4), 0)
      << "the loss's gradient changed";
  int64_t wrong_y = 0, wrong_g = 0;
  for (int64_t i = 0; i < N * C; ++i) wrong_y += y16.p[i] != to_bf16(y[size_t(i)]);
  for (int64_t i = 0; i < N * V; ++i) wrong_g += g16.p[i] != to_bf16(grads[size_t(i)]);
  EXPECT_EQ(wrong_y, 0) << "elements of LayerNorm's copy that are not to_bf16 of its output";
  EXPECT_EQ(wrong_g, 0) << "elements of the loss's copy that are not to_bf16 of its gradient";
  cpu::bf16_mirror_clear();
}

// linear_backward_bf16 sums dy's columns into db while converting dy (blocks of 256 rows, the
// blocks' sums added in order): within the fp32 summation bound of the exact sums, the same
// bits with 1 and 2 threads, and within the bound when dy sits in a mirror (column order).
TEST(Bf16, BiasGradientRidesInTheConversionOfDy) {
  const int64_t N = 600, in = 5, out = 70;  // three row blocks, the last one partial
  std::vector<float> x(size_t(N * in)), w(size_t(in * out)), dy(size_t(N * out));
  for (size_t i = 0; i < x.size(); ++i) x[i] = rng_normal(6, 1, i);
  for (size_t i = 0; i < w.size(); ++i) w[i] = rng_normal(6, 2, i);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = rng_normal(6, 3, i);
  const int threads = omp_get_max_threads();
  auto db_of = [&](int nthreads, bool mirrored) {
    std::vector<float> dw(size_t(in * out), 0.0f), db(size_t(out), 0.5f);  // accumulates
    omp_set_num_threads(nthreads);
    if (mirrored) ops::bf16_mirror_add(dy.data(), int64_t(dy.size()));
    ops::linear_backward_bf16(nullptr, dw.data(), db.data(), dy.data(), x.data(), w.data(), N, in,
                              out);
    ops::bf16_mirror_clear();
    omp_set_num_threads(threads);
    return db;
  };
  const std::vector<float> one = db_of(1, false), two = db_of(2, false), mir = db_of(2, true);
  const double u = std::ldexp(1.0, -24), gamma = (N + 1) * u / (1 - (N + 1) * u);
  for (int64_t j = 0; j < out; ++j) {
    double exact = 0.5, mag = 0.5;
    for (int64_t i = 0; i < N; ++i) exact += dy[size_t(i * out + j)], mag += std::fabs(dy[size_t(i * out + j)]);
    EXPECT_LE(std::fabs(two[size_t(j)] - exact), gamma * mag) << "column " << j;
    EXPECT_LE(std::fabs(mir[size_t(j)] - exact), gamma * mag) << "column " << j << " (mirrored dy)";
    EXPECT_EQ(bits(one[size_t(j)]), bits(two[size_t(j)])) << "column " << j << ": thread count";
  }
}

// A 2-block model and a batch of 3 rows of 12 random tokens, for the tests through the model.
ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab = 41, c.d_model = 32, c.heads = 2, c.context = 12, c.layers = 2, c.slots = 1;
  c.domains = {{"a", "a", 0}};
  return c;
}
Batch tiny_batch(const ModelConfig& c) {
  Batch b;
  b.resize(3, 12);
  Rng r(12, 1);
  for (auto& t : b.tokens) t = int32_t(r.below(uint32_t(c.vocab)));
  for (auto& t : b.targets) t = int32_t(r.below(uint32_t(c.vocab)));
  b.domain = {0, 0, 0};
  return b;
}

// Through the model: a bf16 training step, an AdamW update, and the next forward reads the
// updated weights, bit for bit what a fresh model holding them computes; not the old ones.
TEST(Bf16Mirror, TheForwardAfterAnOptimizerStepReadsTheNewWeights) {
  const ModelConfig c = tiny_config();
  const Batch b = tiny_batch(c);
  std::vector<float> w(b.tokens.size(), 1.0f / float(b.tokens.size())), loss0(w.size()),
      loss1(w.size()), loss2(w.size());
  ops::use_precision(ops::Precision::Bf16);
  Model m(c, 3);
  AdamW opt(OptimConfig{}, m.params());
  Activations acts;
  m.forward(b, acts, loss0.data(), w.data());
  m.backward(b, acts);
  opt.step(m.params(), 1e-2f, 1.0f);
  m.forward(b, acts, loss1.data(), w.data());
  Model fresh(c, 99);
  for (size_t i = 0; i < m.params().all().size(); ++i) {
    const Tensor& from = m.params().all()[i].value;
    std::memcpy(fresh.params().all()[i].value.f(), from.f(), size_t(from.numel()) * 4);
  }
  Activations acts2;
  fresh.forward(b, acts2, loss2.data(), w.data());
  ops::use_precision(ops::Precision::Fp32);
  EXPECT_NE(std::memcmp(loss0.data(), loss1.data(), loss0.size() * 4), 0) << "the step changed nothing";
  EXPECT_EQ(std::memcmp(loss1.data(), loss2.data(), loss1.size() * 4), 0)
      << "the forward after the step read stale bf16 weights";
}

// A bf16 backward gives each parameter fp32's gradient within bf16's rounding: tensor by
// tensor, the norm of the difference is a small fraction of the fp32 gradient's norm (the
// global norm clips the step, so one tensor off by a factor shows as a wrong clip).
TEST(Bf16, GradientsTrackFp32TensorByTensor) {
  const ModelConfig c = tiny_config();
  const Batch b = tiny_batch(c);
  std::vector<float> w(b.tokens.size(), 1.0f / float(b.tokens.size())), loss(w.size());
  auto grads = [&](ops::Precision p) {
    ops::use_precision(p);
    Model m(c, 3);
    Activations acts;
    m.forward(b, acts, loss.data(), w.data());
    m.backward(b, acts);
    std::vector<std::vector<float>> out;
    for (const Param& q : m.params().all()) out.push_back(sigma::testing::host_floats(q.grad));
    ops::use_precision(ops::Precision::Fp32);
    return out;
  };
  const auto f32 = grads(ops::Precision::Fp32), b16 = grads(ops::Precision::Bf16);
  Model names(c, 3);
  for (size_t i = 0; i < f32.size(); ++i) {
    double diff = 0, ref = 0;
    for (size_t k = 0; k < f32[i].size(); ++k) {
      diff += (double(b16[i][k]) - f32[i][k]) * (double(b16[i][k]) - f32[i][k]);
      ref += double(f32[i][k]) * f32[i][k];
    }
    EXPECT_LE(std::sqrt(diff), 0.05 * std::sqrt(ref) + 1e-7)
        << names.params().all()[i].name << ": |bf16 - fp32| " << std::sqrt(diff) << " against |fp32| "
        << std::sqrt(ref);
  }
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
