// Weight-only int8 decoding (Model::use_weights, kernels/cpu/int8.h, the int8 GEMVs of gemv.h)
// and inference weights without their fp32 copies: the quantisation's round trip, the GEMVs
// against the portable scalar path (bit for bit) and against the dequantised product (a
// rounding bound), the bytes a converted model holds, bf16 outputs equal to a rounded fp32
// model's, and the held-out loss of a trained model within 0.02 nats of fp32 (`sigma eval
// --precision int8`).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <memory>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cli_util.h"
#include "core/bf16.h"
#include "core/rng.h"
#include "decode_util.h"
#include "device_access.h"
#include "infer/generate.h"
#include "kernels/cpu/gemv.h"
#include "kernels/ops.h"
#include "model/names.h"

using namespace sigma;
using sigma::testing::sigma_cmd;
using sigma::testing::TempDir;
using sigma::testing::cached_logits;
using sigma::testing::decode_config;
using sigma::testing::expect_steps_batch_invariant;
using sigma::testing::some_tokens;

namespace {

constexpr double kU = 1.0 / 16777216.0;  // fp32 unit roundoff

std::vector<float> randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = scale * rng_normal(seed, 3, uint64_t(i));
  return v;
}

// Weights whose channels differ in scale by 1000x, as trained matrices' columns do.
std::vector<float> channel_weights(int64_t rows, int64_t cols, uint64_t seed, bool per_row) {
  std::vector<float> w = randn(rows * cols, seed);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      w[size_t(i * cols + j)] *= std::pow(10.0f, float((per_row ? i : j) % 4) - 1.5f);
  return w;
}

struct Quantised {
  std::vector<int8_t> q;
  std::vector<float> s;
  int64_t bad = 0;
};
Quantised quantise(const std::vector<float>& w, int64_t rows, int64_t cols, bool per_row,
                   ops::BackendKind b = ops::BackendKind::Cpu) {
  Quantised r;
  r.q.resize(per_row ? w.size() : size_t(ops::i8_elements(rows, cols)));  // per column: panels
  r.s.resize(size_t(per_row ? rows : cols));
  ops::use_backend(b);
  r.bad = ops::quantize_i8(r.q.data(), r.s.data(), w.data(), rows, cols, cols, per_row);
  ops::use_backend(ops::BackendKind::Cpu);
  return r;
}

}  // namespace

// Per channel: |w - s q| <= s/2 (plus the rounding of w / s in fp32, 127 u of a step), q in
// [-127, 127] with the channel's largest weight at +-127, a channel of zeros at scale 0, and
// quantising the dequantised values again gives the same q and s back. The cpu kernel and the
// ref backend's definition agree bit for bit; non-finite weights are counted.
TEST(Int8Quantise, RoundTripsWithinHalfAStep) {
  const int64_t rows = 67, cols = 45;
  for (bool per_row : {false, true}) {
    std::vector<float> w = channel_weights(rows, cols, 1, per_row);
    for (int64_t i = 0; i < (per_row ? cols : rows); ++i)  // channel 3: all zeros
      w[size_t(per_row ? 3 * cols + i : i * cols + 3)] = 0.0f;
    const Quantised a = quantise(w, rows, cols, per_row);
    EXPECT_EQ(a.bad, 0);
    const int64_t channels = per_row ? rows : cols, n = per_row ? cols : rows;
    for (int64_t c = 0; c < channels; ++c) {
      auto at = [&](int64_t i) { return size_t(per_row ? c * cols + i : i * cols + c); };
      auto qat = [&](int64_t i) { return size_t(per_row ? c * cols + i : ops::i8_index(i, c, rows, cols)); };
      int most = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float s = a.s[size_t(c)];
        const int q = a.q[qat(i)];
        ASSERT_LE(std::abs(q), 127);
        most = std::max(most, std::abs(q));
        EXPECT_LE(std::fabs(double(w[at(i)]) - double(s) * q), double(s) * (0.5 + 127 * 2 * kU))
            << (per_row ? "row " : "column ") << c << " element " << i;
      }
      if (c == 3) {
        EXPECT_EQ(a.s[size_t(c)], 0.0f);
        EXPECT_EQ(most, 0);
      } else {
        EXPECT_EQ(most, 127) << "channel " << c << ": its largest weight is not at +-127";
      }
    }
    // Dequantised and quantised again: the same scales and values.
    std::vector<float> back(w.size());
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t i = 0; i < n; ++i) {
        const size_t k = size_t(per_row ? c * cols + i : i * cols + c);
        back[k] = a.s[size_t(c)] * float(a.q[size_t(per_row ? k : ops::i8_index(i, c, rows, cols))]);
      }
    const Quantised b = quantise(back, rows, cols, per_row);
    EXPECT_EQ(a.q, b.q);
    for (size_t c = 0; c < a.s.size(); ++c)
      EXPECT_NEAR(b.s[c], a.s[c], 2 * kU * a.s[c]) << "channel " << c;
    const Quantised r = quantise(w, rows, cols, per_row, ops::BackendKind::Ref);
    EXPECT_EQ(a.q, r.q);
    EXPECT_EQ(0, std::memcmp(a.s.data(), r.s.data(), a.s.size() * 4));
  }
  std::vector<float> w = randn(6, 2);
  w[4] = std::nanf("");
  const Quantised n = quantise(w, 3, 2, false);
  EXPECT_EQ(n.bad, 1);
  EXPECT_EQ(n.s[0], 0.0f);  // the NaN's column
  EXPECT_GT(n.s[1], 0.0f);
}

// A part of the columns quantised in place of the wider matrix it sits in (rows ld apart; the
// query layer's K|V part of QKV, Model::use_weights) is the part copied out and quantised, on
// each backend; a per-row table's rows likewise.
TEST(Int8Quantise, APartOfTheColumnsIsQuantisedAsAMatrixOfItsOwn) {
  const int64_t rows = 67, cols = 150, c0 = 45, n = 100;  // panels of 64 and 36 columns
  const std::vector<float> w = channel_weights(rows, cols, 9, false);
  std::vector<float> part;
  for (int64_t i = 0; i < rows; ++i) part.insert(part.end(), w.begin() + i * cols + c0, w.begin() + i * cols + c0 + n);
  for (bool per_row : {false, true}) {
    const Quantised want = quantise(part, rows, n, per_row);
    for (ops::BackendKind kind : {ops::BackendKind::Cpu, ops::BackendKind::Ref}) {
      Quantised got;
      got.q.resize(want.q.size());
      got.s.resize(want.s.size());
      ops::use_backend(kind);
      got.bad = ops::quantize_i8(got.q.data(), got.s.data(), w.data() + c0, rows, n, cols, per_row);
      ops::use_backend(ops::BackendKind::Cpu);
      EXPECT_EQ(got.q, want.q) << ops::backend(kind).name << (per_row ? " per row" : " per column");
      EXPECT_EQ(0, std::memcmp(got.s.data(), want.s.data(), got.s.size() * 4)) << ops::backend(kind).name;
    }
  }
}

// The SIMD kernels (AVX-512 with VNNI, AVX-512 and AVX2, each where the CPU has it) and the portable scalar path
// run the same operations per element, so they agree bit for bit: 1 to 4 rows, column and row
// tails, bias and accumulation, past the size where the spin team splits the work.
TEST(Int8Gemv, EverySimdPathMatchesThePortablePathBitForBit) {
  struct Shape {
    int64_t in, out;
  };
  struct Case {
    Shape sh;
    int64_t M;
    std::vector<float> want;
  };
  std::vector<Case> cases;
  for (const Shape sh : {Shape{33, 131}, Shape{257, 301}, Shape{512, 1536}})
    for (int64_t M = 1; M <= 4; ++M) cases.push_back({sh, M, {}});
  auto run = [&](cpu::GemvIsa isa, Shape sh, int64_t M) {
    const auto w = channel_weights(sh.in, sh.out, 3, false);
    const Quantised nn = quantise(w, sh.in, sh.out, false);
    const Quantised nt = quantise(w, sh.out, sh.in, true);  // the same floats read as [out, in]
    const auto x = randn(4 * sh.in, 4), b = randn(sh.out, 5), y0 = randn(4 * sh.out, 6);
    cpu::gemv_use_isa(isa);
    std::vector<float> a = y0, c = y0, t(size_t(M * sh.out));
    cpu::gemv_nn(a.data(), x.data(), nn.q.data(), nn.s.data(), b.data(), M, sh.in, sh.out, true, {});
    cpu::gemv_nn(c.data(), x.data(), nn.q.data(), nn.s.data(), nullptr, M, sh.in, sh.out, false, {});
    cpu::gemv_nt(t.data(), x.data(), nt.q.data(), nt.s.data(), M, sh.in, sh.out, sh.in, sh.in, sh.out);
    cpu::gemv_use_isa(cpu::GemvIsa::Best);
    a.insert(a.end(), c.begin(), c.end());
    a.insert(a.end(), t.begin(), t.end());
    return a;
  };
  for (Case& k : cases) k.want = run(cpu::GemvIsa::Portable, k.sh, k.M);
  sigma::testing::for_each_simd_isa([&](cpu::GemvIsa isa) {
    for (const Case& k : cases) {
      const std::vector<float> got = run(isa, k.sh, k.M);
      EXPECT_EQ(0, std::memcmp(got.data(), k.want.data(), got.size() * 4))
          << cpu::gemv_isa_name(isa) << ": in " << k.sh.in << " out " << k.sh.out << " M " << k.M;
    }
  });
}

// A row gives the same bits alone as among four, on two threads.
TEST(Int8Gemv, RowsAreBitIdenticalAloneAndAmongFour) {
  const int64_t in = 1100, out = 3300;  // past kParallelWeights, a narrower last panel
  const auto w = channel_weights(in, out, 11, false);
  const Quantised qn = quantise(w, in, out, false);
  const auto x = randn(4 * in, 12), b = randn(out, 13);
  omp_set_num_threads(2);
  std::vector<float> four(static_cast<size_t>(4 * out)), one(static_cast<size_t>(out));
  for (int k = 0; k < 10; ++k) {  // the threads' timing differs between calls
    cpu::gemv_nn(four.data(), x.data(), qn.q.data(), qn.s.data(), b.data(), 4, in, out, false, {});
    for (int64_t r = 0; r < 4; ++r) {
      cpu::gemv_nn(one.data(), x.data() + r * in, qn.q.data(), qn.s.data(), b.data(), 1, in, out,
                   false, {});
      ASSERT_EQ(0, std::memcmp(one.data(), four.data() + r * out, one.size() * 4)) << "row " << r;
    }
  }
}

// An int8 product's panels are shared by the threads as they claim them: with one thread or two,
// over several calls, the outputs are the same bits; at full scale (every product +127 * 32767)
// a panel's 2,048 rows sum in pieces whose int32 lanes do not overflow (a piece of more than
// 516 rows would).
TEST(Int8Gemv, HowThePanelsAreSharedChangesNoBit) {
  struct Shape {
    int64_t in, out, M;
    bool full_scale;
  };
  for (const Shape sh : {Shape{512, 1536, 1, false}, Shape{2048, 512, 1, false},
                         Shape{1100, 3300, 4, false}, Shape{2048, 64, 1, true}, Shape{2048, 70, 3, true}}) {
    auto w = channel_weights(sh.in, sh.out, 21, false);
    auto x = randn(4 * sh.in, 22);
    const auto b = randn(sh.out, 23);
    if (sh.full_scale)
      for (int64_t k = 0; k < sh.in; ++k) {
        for (int64_t r = 0; r < sh.M; ++r) x[size_t(r * sh.in + k)] = k % 3 ? 2.5f : -2.5f;
        for (int64_t j = 0; j < sh.out; ++j) w[size_t(k * sh.out + j)] = (k % 3 ? 0.75f : -0.75f) * float(j + 1);
      }
    const Quantised qn = quantise(w, sh.in, sh.out, false);
    omp_set_num_threads(1);
    std::vector<float> want(size_t(sh.M * sh.out)), got(want.size());
    cpu::gemv_nn(want.data(), x.data(), qn.q.data(), qn.s.data(), b.data(), sh.M, sh.in, sh.out,
                 false, {});
    omp_set_num_threads(2);
    for (int call = 0; call < 4; ++call) {
      cpu::gemv_nn(got.data(), x.data(), qn.q.data(), qn.s.data(), b.data(), sh.M, sh.in, sh.out,
                   false, {});
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << "in " << sh.in << " out " << sh.out << " call " << call;
    }
    if (sh.full_scale)
      for (int64_t r = 0; r < sh.M; ++r)
        for (int64_t j : {int64_t(0), sh.out - 1}) {
          const double exact = b[size_t(j)] + 2.5 * 0.75 * double(j + 1) * double(sh.in);
          EXPECT_NEAR(got[size_t(r * sh.out + j)], exact, 1e-5 * std::fabs(exact)) << "row " << r << " column " << j;
        }
  }
}

// Against the exact product of the dequantised weights (double). Each x_k first moves by at most
// h = 0.505 max|x| / 32767 (16-bit fixed point), which adds at most h sum_k |s q_k|; the decode
// path (1 to 4 rows) then sums exactly, the prompt and eval paths (7 or 33 rows: dequantised
// panels, oneDNN's matmul on them inside a decode step, sgemm on rows outside) sum `in` fp32
// products rounded at most once each, then one product with the scale and one addition:
// |y - exact| <= (in + 2) u (sum_k |x_k s q_k| + |b|) (Higham (3.5)). A wrong scale, a wrong
// channel's scale, a wrong pair of rows or truncation in the product breaks it by orders of
// magnitude.
TEST(Int8Gemv, StaysWithinTheRoundingBoundOfTheDequantisedProduct) {
  const int64_t in = 300, out = 170;
  const auto w = channel_weights(in, out, 7, false);
  const Quantised qn = quantise(w, in, out, false);
  const Quantised qt = quantise(w, out, in, true);
  const auto x = randn(33 * in, 8), b = randn(out, 9);
  for (auto [N, prompt] : {std::pair<int64_t, bool>{1, false}, {3, false}, {7, false}, {7, true}, {33, true}}) {
    SCOPED_TRACE(prompt ? "inside a decode step" : "outside");
    std::vector<float> y(size_t(N * out)), t(size_t(N * out));
    std::unique_ptr<ops::FewRowKernels> scope(prompt ? new ops::FewRowKernels : nullptr);
    ops::linear_forward_i8(y.data(), x.data(), qn.q.data(), qn.s.data(), b.data(), N, in, out);
    ops::gemm_nt_i8(t.data(), x.data(), qt.q.data(), qt.s.data(), N, in, out, in, in, out);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t j = 0; j < out; ++j) {
        double exact = b[size_t(j)], mass = std::fabs(b[size_t(j)]);
        double exact_t = 0, mass_t = 0, wsum = 0, wsum_t = 0, amax = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double xk = x[size_t(r * in + k)];
          const double wn = double(qn.s[size_t(j)]) * qn.q[size_t(ops::i8_index(k, j, in, out))];
          const double wt = double(qt.s[size_t(j)]) * qt.q[size_t(j * in + k)];
          exact += xk * wn, mass += std::fabs(xk * wn);
          exact_t += xk * wt, mass_t += std::fabs(xk * wt);
          wsum += std::fabs(wn), wsum_t += std::fabs(wt), amax = std::max(amax, std::fabs(xk));
        }
        const double h = 0.505 * amax / 32767;
        ASSERT_LE(std::fabs(y[size_t(r * out + j)] - exact), double(in + 2) * kU * mass + h * wsum + 1e-30)
            << "linear N " << N << " row " << r << " column " << j;
        ASSERT_LE(std::fabs(t[size_t(r * out + j)] - exact_t), double(in + 2) * kU * mass_t + h * wsum_t + 1e-30)
            << "head N " << N << " row " << r << " output " << j;
      }
  }
}

// The integer sums cannot overflow: every product at its largest (|q| = 127, |xq| = 32767, signs
// aligned) over 9,000 inputs (past the head's 4,096-input int32 blocks, 141 of the linear's
// 64-row chunks) gives scale * max|x| * 127 * in to fp32 rounding, on every ISA.
// The int8 products' exact sums become floats through kernels::exact_to_float, which must
// round as float(v) does over the whole range the sums reach (|v| < 2^51): exact below 2^24,
// ties to even above (2^25 + 1 is halfway), both signs, and random magnitudes at every scale.
TEST(Int8Gemv, SumsConvertToFloatAsTheConversionRounds) {
  std::vector<int64_t> v = {0, 1, -1, (1 << 24) - 1, 1 << 24, (1 << 24) + 1, (1 << 25) + 1,
                            (1 << 25) + 3, (int64_t(1) << 51) - 1, -((int64_t(1) << 51) - 1),
                            int64_t(1) << 40, (int64_t(1) << 40) + (int64_t(1) << 16)};
  std::mt19937_64 rng(7);
  for (int bits = 1; bits <= 51; ++bits)
    for (int k = 0; k < 200; ++k) {
      const int64_t m = int64_t(rng() >> (64 - bits));
      v.push_back(k % 2 ? m : -m);
    }
  for (const int64_t x : v) {
    ASSERT_EQ(std::bit_cast<uint32_t>(kernels::exact_to_float(x)), std::bit_cast<uint32_t>(float(x))) << x;
  }
}

// x's 16-bit rounding (kernels::round_row16, which finds max |x| on the bits) against its plain
// definition: step = max |x| / 32767 over a row of finite values (0 below 1e-30), NaN for a row
// holding a NaN or an infinity of either sign, xq 0 there; signed zeros, subnormals, the
// largest finite value, the specials at every position of rows of every length up to 40 (the
// vector loops' bodies and tails), and random rows.
TEST(Int8Quantise, XRoundsToSixteenBitsAsItsPlainDefinition) {
  auto plain_step = [](const std::vector<float>& x) {
    float amax = 0;
    for (float v : x) {
      if (!std::isfinite(v)) return NAN;
      amax = std::max(amax, std::fabs(v));
    }
    return amax >= 1e-30f ? amax / 32767.0f : 0.0f;
  };
  auto check = [&](const std::vector<float>& x) {
    std::vector<int16_t> q(x.size(), 77);
    const float step = kernels::round_row16(q.data(), x.data(), int64_t(x.size()));
    const float want = plain_step(x);
    ASSERT_EQ(std::isnan(step), std::isnan(want)) << "a row of " << x.size();
    if (std::isnan(want)) {
      for (int16_t v : q) ASSERT_EQ(v, 0);
      return;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(step), std::bit_cast<uint32_t>(want)) << "a row of " << x.size();
    const float inv = step > 0 ? 1.0f / step : 0.0f;
    for (size_t k = 0; k < x.size(); ++k)
      ASSERT_EQ(q[k], int16_t(std::clamp(std::nearbyint(x[k] * inv), -32767.0f, 32767.0f))) << k;
  };
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY};
  const float values[] = {0.0f, -0.0f, 1e-40f, -1e-38f, 1e-31f, 2e-30f, -3.5f, 7.25f, FLT_MAX, -FLT_MAX};
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int n = 1; n <= 40; ++n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float v : values) {  // one value everywhere, then at each position among small ones
      std::fill(x.begin(), x.end(), v);
      check(x);
      for (int at = 0; at < n; ++at) {
        for (int k = 0; k < n; ++k) x[size_t(k)] = 1e-3f * float(k % 5) * (k % 2 ? -1.0f : 1.0f);
        x[size_t(at)] = v;
        check(x);
      }
    }
    for (float v : specials)
      for (int at = 0; at < n; ++at) {
        for (float& e : x) e = normal(rng);
        x[size_t(at)] = v;
        check(x);
      }
    for (int k = 0; k < 20; ++k) {
      for (float& e : x) e = normal(rng) * std::ldexp(1.0f, int(rng() % 60) - 30);
      check(x);
    }
  }
}

TEST(Int8Gemv, LongSumsAtFullScaleDoNotOverflow) {
  const int64_t in = 9000, out = 37;
  std::vector<float> w(static_cast<size_t>(in * out)), x(static_cast<size_t>(in));
  for (int64_t k = 0; k < in; ++k) {
    x[size_t(k)] = k % 3 ? 2.5f : -2.5f;
    for (int64_t j = 0; j < out; ++j) w[size_t(k * out + j)] = (k % 3 ? 0.75f : -0.75f) * float(j + 1);
  }
  const Quantised qn = quantise(w, in, out, false);
  std::vector<float> wt(w.size());  // the same weights as the head's [out, in]
  for (int64_t k = 0; k < in; ++k)
    for (int64_t j = 0; j < out; ++j) wt[size_t(j * in + k)] = w[size_t(k * out + j)];
  const Quantised qt = quantise(wt, out, in, true);
  for (cpu::GemvIsa isa : {cpu::GemvIsa::Portable, cpu::GemvIsa::Avx2, cpu::GemvIsa::Avx512,
                           cpu::GemvIsa::Avx512Vnni}) {
    if (!cpu::gemv_isa_available(isa)) continue;
    cpu::gemv_use_isa(isa);
    std::vector<float> y(static_cast<size_t>(out)), t(static_cast<size_t>(out));
    cpu::gemv_nn(y.data(), x.data(), qn.q.data(), qn.s.data(), nullptr, 1, in, out, false, {});
    cpu::gemv_nt(t.data(), x.data(), qt.q.data(), qt.s.data(), 1, in, out, in, in, out);
    cpu::gemv_use_isa(cpu::GemvIsa::Best);
    for (int64_t j = 0; j < out; ++j) {
      const double want = 2.5 * 0.75 * double(j + 1) * double(in);
      EXPECT_NEAR(y[size_t(j)], want, 1e-5 * want) << cpu::gemv_isa_name(isa) << " linear column " << j;
      EXPECT_NEAR(t[size_t(j)], want, 1e-5 * want) << cpu::gemv_isa_name(isa) << " head row " << j;
    }
  }
}

namespace {

bool streamed(const Param& p) {
  return p.name == names::kTokens || (p.decay && !names::is_gate(p.name));
}

}  // namespace

// What a converted model holds, to the byte: fp32 values of everything that is not a streamed
// matrix, the routing tables, and per matrix 2 bytes a weight (bf16) or 1 byte a weight plus a
// 4-byte scale per output channel (int8); no gradient and no fp32 matrix. At the decode
// benchmark's proportions (d = 512, 8 blocks, a vocabulary of 32) int8 holds under 0.3x of fp32.
TEST(Int8Weights, HeldBytesAreTheFormatsBytes) {
  const ModelConfig c = decode_config();
  int64_t params = 0, matrices = 0, scales = 0, buffers = 0;
  {
    Model m(c, 1);
    for (const Param& p : m.params().all()) {
      params += p.value.numel();
      if (!streamed(p)) continue;
      matrices += p.value.numel();
      const int64_t cols = p.value.shape().back();
      scales += p.name == names::kTokens ? p.value.numel() / cols
                                         : (p.value.shape().size() == 3 ? p.value.dim(0) : 1) * cols;
    }
    for (const Buffer& b : m.buffers().all()) buffers += int64_t(b.value.nbytes());
    EXPECT_EQ(m.held_bytes(), 8 * params + buffers);  // values and gradients
  }
  const int64_t d = c.d_model, f = c.ffn(), V = c.vocab, L = c.layers;
  // Scales by hand: QKV 3d, out d, w_in f, w_out d per expert (2 + 3 experts in RRE blocks),
  // one per embedding row.
  EXPECT_EQ(scales, (L - c.rre_layers) * (3 * d + d + f + d) +
                        c.rre_layers * (3 * d + d + 5 * (f + d)) + c.slots * V);
  for (WeightFormat fmt : {WeightFormat::F32, WeightFormat::Bf16, WeightFormat::Int8}) {
    Model m(c, 1);
    m.use_weights(fmt);
    const int64_t rest = 4 * (params - matrices) + buffers;
    const int64_t want = fmt == WeightFormat::F32    ? 4 * params + buffers
                         : fmt == WeightFormat::Bf16 ? rest + 2 * matrices
                                                     : rest + matrices + 4 * scales;
    EXPECT_EQ(m.held_bytes(), want) << weight_format_name(fmt);
    for (const Param& p : m.params().all()) {
      EXPECT_TRUE(p.grad.empty()) << p.name;
      // Every streamed matrix is replaced by its copy (fp32: the linears' panels), but fp32's
      // embedding table, read in place.
      EXPECT_EQ(p.value.empty(), streamed(p) && !(fmt == WeightFormat::F32 && p.name == names::kTokens)) << p.name;
    }
  }
  // The benchmark's dense model, by the same formula (no model built: 100 MB).
  const int64_t D = 512, F = 4 * D, T = 256, LL = 8, VV = 32;
  const int64_t mats = LL * (4 * D * D + 2 * D * F) + VV * D;
  const int64_t vecs = LL * (3 * D + D + 4 * D + F + D) + 2 * D + 2 * T * D;
  const int64_t sc = LL * (3 * D + D + F + D) + VV;
  EXPECT_LT(double(mats + 4 * sc + 4 * vecs) / double(4 * (mats + vecs)), 0.3);
}

// int8 logits stay near fp32's (the quantisation moves each weight by at most half a step of
// its channel) but are not fp32's; decode steps of up to 4 rows stay batch-invariant bit for
// bit; the cached decode (GEMVs, exact integer sums) matches the full forward pass (dequantised
// panels, oneDNN).
TEST(Int8Weights, DecodeIsNearFp32AndBatchInvariant) {
  const ModelConfig c = decode_config();
  Model fp32(c, 9), i8(c, 9);
  i8.use_weights(WeightFormat::Int8);
  const auto tokens = some_tokens(c, c.context);
  for (int domain : {0, 1}) {
    const auto a = cached_logits(i8, domain, tokens), r = cached_logits(fp32, domain, tokens);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, double(std::fabs(a[i] - r[i])));
      scale = std::max(scale, double(std::fabs(r[i])));
    }
    EXPECT_GT(worst, 1e-5 * scale) << "domain " << domain << ": int8 gave fp32's logits";
    EXPECT_LT(worst, 5e-2 * scale) << "domain " << domain;
  }
  Batch b;
  b.resize(1, c.context);
  b.tokens = tokens;
  b.domain[0] = 1;
  std::vector<float> loss(size_t(c.context));
  i8.forward(b, loss.data());
  const std::vector<float> full = i8.logits();
  const auto cached = cached_logits(i8, 1, tokens);
  // Not to fp32's 1e-4: both paths round x to 16-bit fixed point, and where their fp32
  // roundings upstream put an element on either side of a rounding boundary the two differ by
  // a whole step (1.5e-5 of the row's largest value); measured 3.3e-4 here (logits up to ~3).
  for (size_t i = 0; i < full.size(); ++i)
    ASSERT_NEAR(cached[i], full[i], 2e-3) << "position " << i / size_t(c.vocab);

  expect_steps_batch_invariant(i8, 4, "int8");
}

// bf16 without its fp32 copy gives, bit for bit, the logits of an fp32 model whose every
// streamed matrix (the embedding table too: the lookup now reads the bf16 rows) was rounded to
// bf16: the GEMVs widen bf16 exactly and run the fp32 kernels' operations.
TEST(Bf16Weights, WithoutTheFp32CopyTheOutputsAreTheRoundedModels) {
  const ModelConfig c = decode_config();
  Model bf16(c, 10), rounded(c, 10);
  for (Param& p : rounded.params().all())
    if (streamed(p))
      sigma::testing::edit_floats(p.value, [](float* v, int64_t n) {
        for (int64_t i = 0; i < n; ++i) v[i] = round_bf16(v[i]);
      });
  bf16.use_weights(WeightFormat::Bf16);
  rounded.use_weights(WeightFormat::F32);
  const auto tokens = some_tokens(c, c.context);
  for (int domain : {0, 1}) {
    const auto a = cached_logits(bf16, domain, tokens), r = cached_logits(rounded, domain, tokens);
    EXPECT_EQ(0, std::memcmp(a.data(), r.data(), a.size() * 4)) << "domain " << domain;
  }
}

TEST(Int8Weights, RefusesBackwardAndASecondConversion) {
  const ModelConfig c = decode_config();
  Model m(c, 12);
  m.use_weights(WeightFormat::Int8);
  Batch b;
  b.resize(1, 4);
  b.tokens = some_tokens(c, 4);
  std::vector<float> loss(4), weight(4, 1.0f);
  m.forward(b, loss.data(), weight.data());
  EXPECT_THROW(m.backward(b), Error);
  EXPECT_THROW(m.use_weights(WeightFormat::Bf16), Error);
  EXPECT_THROW(weight_format_from_name("int4"), Error);
}

// The copies lie in one arena whose start is 2 MiB-aligned (huge pages: Model::use_weights),
// each 64-byte aligned, one after another without overlap, every int8 matrix's scales after it.
TEST(Int8Weights, CopiesLieInOneAlignedArena) {
  for (WeightFormat fmt : {WeightFormat::Bf16, WeightFormat::Int8}) {
    Model m(decode_config(), 1);
    m.use_weights(fmt);
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end) of each copy and scale
    auto add = [&](const PV& pv, int64_t n, int64_t scales) {
      const uintptr_t b = fmt == WeightFormat::Bf16 ? uintptr_t(pv.h) : uintptr_t(pv.q);
      spans.push_back({b, b + uintptr_t(fmt == WeightFormat::Bf16 ? 2 * n : n)});
      if (fmt == WeightFormat::Int8) spans.push_back({uintptr_t(pv.s), uintptr_t(pv.s + scales)});
    };
    const ModelConfig& c = m.config();
    const ModelWeights& w = m.weights();
    const int64_t d = c.d_model;
    add(w.tokens, int64_t(c.slots) * c.vocab * d, int64_t(c.slots) * c.vocab);
    for (const BlockWeights& b : w.blocks) {
      add(b.qkv_w, ops::i8_elements(d, 3 * d), 3 * d);
      add(b.out_w, ops::i8_elements(d, d), d);
    }
    ASSERT_FALSE(spans.empty());
    std::sort(spans.begin(), spans.end());
    EXPECT_EQ(spans.front().first % (uintptr_t(2) << 20), 0u) << weight_format_name(fmt);
    for (size_t i = 0; i < spans.size(); ++i) {
      EXPECT_EQ(spans[i].first % 64, 0u) << weight_format_name(fmt) << " copy " << i;
      if (i > 0) {
        EXPECT_LE(spans[i - 1].second, spans[i].first) << weight_format_name(fmt);
      }
    }
  }
}

// The huge-page hint keeps the bytes, and where the system grants transparent huge pages
// (not "[never]") and collapses the pages (MADV_COLLAPSE: the kernel may refuse for a while), it
// reports every whole 2 MiB range of a host tensor.
TEST(Int8Weights, HugePageHintKeepsTheBytes) {
  const int64_t n = int64_t(7) << 20;
  Tensor t(DType::U8, {n}, Device::Host);
  for (int64_t i = 0; i < n; ++i) t.bytes()[i] = std::byte(i * 131 % 251);
  const size_t got = ops::advise_huge_pages(t);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.bytes()[i], std::byte(i * 131 % 251)) << i;
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(f, mode);
  if (mode.empty() || mode.find("[never]") != std::string::npos)
    GTEST_SKIP() << "transparent huge pages are off here (" << mode << "): the hint gave " << got;
  if (got == 0) GTEST_SKIP() << "the system granted no huge page just now (a hint may fail)";
  const uintptr_t b = uintptr_t(t.bytes()), huge = uintptr_t(2) << 20;
  EXPECT_EQ(got, ((b + uintptr_t(n)) & ~(huge - 1)) - ((b + huge - 1) & ~(huge - 1)));
}

// The acceptance bound on a trained model, through the command line a user runs: `sigma eval
// --precision int8` is within 0.02 nats of fp32 on every domain (and not equal to it), and
// `sigma generate --precision int8` decodes and reports the bytes it holds.
TEST(Int8Cli, HeldOutLossWithinTwoHundredthsOfANatOfFp32) {
  TempDir dir("int8cli");
  const auto train = sigma_cmd("train --quiet --set model.d_model=64 --set model.layers=3 "
                               "--set model.rre_layers=1 --set train.steps=60 --set train.eval_rows=16 --out " +
                               dir.str());
  ASSERT_EQ(train.code, 0) << train.out;
  const std::string ckpt = dir / "checkpoints";
  auto losses = [&](const std::string& precision) {
    const auto r = sigma_cmd("eval --ckpt " + ckpt + " --json --precision " + precision);
    EXPECT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    std::map<std::string, double> out;
    for (const auto& [name, v] : j["domains"].items()) out[name] = v["loss"].get<double>();
    return out;
  };
  const auto l32 = losses("fp32"), l8 = losses("int8");
  ASSERT_FALSE(l32.empty());
  ASSERT_EQ(l32.size(), l8.size());
  for (const auto& [name, loss] : l32) {
    EXPECT_LT(std::fabs(l8.at(name) - loss), 0.02) << name << ": fp32 " << loss << ", int8 " << l8.at(name);
    EXPECT_NE(l8.at(name), loss) << name << ": int8 gave fp32's loss";
  }
  const auto g = sigma_cmd("generate --ckpt " + ckpt + " --prompt '1 2 3' --max-new 5 --precision int8");
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_NE(g.out.find("tokens/s, int8 weights"), std::string::npos) << g.out;
  EXPECT_NE(g.out.find("MB of weights held"), std::string::npos) << g.out;
}
