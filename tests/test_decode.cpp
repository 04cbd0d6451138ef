// Batch-1 decoding: the GEMV kernels' batch invariance, bf16 weight copies (close to fp32,
// equal to an fp32 model whose weights were rounded, and really used), the KV cache on bf16
// weights against the full forward pass, and `sigma generate --precision`.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "decode_util.h"
#include "device_access.h"
#include "cli_util.h"
#include "core/bf16.h"
#include "core/rng.h"
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

std::vector<float> randn(int64_t n, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = rng_normal(seed, 1, uint64_t(i));
  return v;
}

// w[in, out] in panels (kernels::panel_index), as Model::use_weights lays out a linear's copy:
// fp32, or rounded to bf16.
std::vector<float> f32_panels(const std::vector<float>& w, int64_t in, int64_t out) {
  std::vector<float> p(w.size());
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) p[size_t(kernels::panel_index(i, j, in, out))] = w[size_t(i * out + j)];
  return p;
}
std::vector<uint16_t> bf16_panels(const std::vector<float>& w, int64_t in, int64_t out) {
  std::vector<uint16_t> p;
  for (float v : f32_panels(w, in, out)) p.push_back(to_bf16(v));
  return p;
}

// B rows of T tokens for a model of config c: id i of the batch is (mul i + add) mod vocab, row b
// in domain domains[b].
Batch token_batch(const ModelConfig& c, int T, const std::vector<int32_t>& domains, size_t mul, size_t add) {
  Batch b;
  b.resize(int(domains.size()), T);
  for (size_t i = 0; i < b.tokens.size(); ++i) b.tokens[i] = int32_t((mul * i + add) % size_t(c.vocab));
  b.domain = domains;
  return b;
}

}  // namespace

// Each output element is one fixed sequence of FMAs and chunk sums: a row gives the same bits
// alone as among four, with one thread or two (the split is by fixed chunks of w's rows, and
// by columns when the threads outnumber the chunks: the second shape; four rows of the third
// have partials enough for their sums to share the product's spin-team job, one row's run on
// the caller after it).
class Gemv : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};
INSTANTIATE_TEST_SUITE_P(Shapes, Gemv, ::testing::Values(std::pair<int64_t, int64_t>{257, 301},
                                                         std::pair<int64_t, int64_t>{40, 2000},
                                                         std::pair<int64_t, int64_t>{1100, 1000}));
TEST_P(Gemv, RowsAreBitIdenticalWhateverTheBatchAndThreads) {
  const auto [in, out] = GetParam();  // past the threading threshold, odd tails
  const auto x = randn(4 * in, 1), w = randn(in * out, 2), b = randn(out, 3);
  const std::vector<uint16_t> p16 = bf16_panels(w, in, out);
  const std::vector<float> p32 = f32_panels(w, in, out);
  const size_t n4 = size_t(4 * out), n1 = size_t(out);
  std::vector<float> four(n4), one(n1), nt4(n4), nt1(n1), four16(n4), one16(n1), four32(n4), one32(n1);
  cpu::gemv_nn(four.data(), x.data(), w.data(), b.data(), 4, in, out, false, {});
  cpu::gemv_nt(nt4.data(), x.data(), w.data(), 4, in, out, in, in, out);  // w read as [out, in]
  cpu::gemv_nn(four16.data(), x.data(), p16.data(), b.data(), 4, in, out, false, {});
  cpu::gemv_nn_panels(four32.data(), x.data(), p32.data(), b.data(), 4, in, out, false, {});
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (int r = 0; r < 4; ++r) {
      cpu::gemv_nn(one.data(), x.data() + r * in, w.data(), b.data(), 1, in, out, false, {});
      EXPECT_EQ(0, std::memcmp(one.data(), four.data() + r * out, one.size() * 4)) << "row " << r;
      cpu::gemv_nt(nt1.data(), x.data() + r * in, w.data(), 1, in, out, in, in, out);
      EXPECT_EQ(0, std::memcmp(nt1.data(), nt4.data() + r * out, nt1.size() * 4)) << "row " << r;
      cpu::gemv_nn(one16.data(), x.data() + r * in, p16.data(), b.data(), 1, in, out, false, {});
      EXPECT_EQ(0, std::memcmp(one16.data(), four16.data() + r * out, one16.size() * 4)) << "bf16 row " << r;
      cpu::gemv_nn_panels(one32.data(), x.data() + r * in, p32.data(), b.data(), 1, in, out, false, {});
      EXPECT_EQ(0, std::memcmp(one32.data(), four32.data() + r * out, one32.size() * 4)) << "fp32 panels row " << r;
    }
  }
  omp_set_num_threads(2);
  // And the kernels on panels (kernels::panel_index) are the fp32 kernel on the same (for bf16,
  // widened) weights in rows, bit for bit.
  std::vector<float> widened;
  for (float v : w) widened.push_back(from_bf16(to_bf16(v)));
  const auto y0 = randn(4 * out, 8);
  for (bool acc : {false, true}) {
    std::vector<float> a = y0, c = y0, a32 = y0, c32 = y0;
    cpu::gemv_nn(a.data(), x.data(), p16.data(), acc ? b.data() : nullptr, 4, in, out, acc, {});
    cpu::gemv_nn(c.data(), x.data(), widened.data(), acc ? b.data() : nullptr, 4, in, out, acc, {});
    EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * 4)) << "bf16, accumulate " << acc;
    cpu::gemv_nn_panels(a32.data(), x.data(), p32.data(), acc ? b.data() : nullptr, 4, in, out, acc, {});
    cpu::gemv_nn(c32.data(), x.data(), w.data(), acc ? b.data() : nullptr, 4, in, out, acc, {});
    EXPECT_EQ(0, std::memcmp(a32.data(), c32.data(), a32.size() * 4)) << "fp32, accumulate " << acc;
  }
}

// A prompt's chunk (more rows than the GEMVs take, inside a decode step) multiplies fp32 panels
// in place and bf16 ones widened as panels on oneDNN's matmul; eval (outside) puts them back in
// rows for sgemm. Each within the rounding bound of the exact product, |y - exact| <=
// (in + 2) u (sum_k |x_k w_k| + |b| + |y0|) (Higham (3.5); bf16: the exact product of the rounded
// weights): panels of 64, 64 and 22 columns, row strides on x and y, bias and accumulation. A
// wrong panel's offset, width or column slice of y breaks it by orders of magnitude; the columns
// between out and y's row stride stay untouched.
TEST(Panels, APromptsProductsStayWithinTheRoundingBound) {
  constexpr double kU = 1.0 / 16777216.0;
  const int64_t in = 70, out = 150, ldx = 75, ldy = 160, rows = 64;
  const auto w = randn(in * out, 21), x = randn(rows * ldx, 22), b = randn(out, 23), y0 = randn(rows * ldy, 24);
  const std::vector<float> p32 = f32_panels(w, in, out);
  const std::vector<uint16_t> p16 = bf16_panels(w, in, out);
  for (int64_t N : {5, 33, 64})
    for (bool prompt : {true, false})
      for (bool bf16 : {false, true})
        for (bool acc : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "N " << N << (prompt ? ", prompt" : ", eval") << (bf16 ? ", bf16" : ", fp32")
                                            << (acc ? ", accumulate" : ""));
          std::vector<float> y = y0;
          {
            std::unique_ptr<ops::FewRowKernels> scope(prompt ? new ops::FewRowKernels : nullptr);
            if (bf16)
              cpu::linear_forward_w16(y.data(), x.data(), p16.data(), b.data(), N, in, out, acc, {ldx, 0, ldy});
            else
              cpu::linear_forward_f32_panels(y.data(), x.data(), p32.data(), b.data(), N, in, out, acc, {ldx, 0, ldy});
          }
          for (int64_t r = 0; r < N; ++r) {
            for (int64_t j = 0; j < out; ++j) {
              const double start = acc ? y0[size_t(r * ldy + j)] : 0.0;
              double exact = start + b[size_t(j)], mass = std::fabs(start) + std::fabs(b[size_t(j)]);
              for (int64_t k = 0; k < in; ++k) {
                const double wk = bf16 ? double(round_bf16(w[size_t(k * out + j)])) : double(w[size_t(k * out + j)]);
                exact += double(x[size_t(r * ldx + k)]) * wk;
                mass += std::fabs(double(x[size_t(r * ldx + k)]) * wk);
              }
              ASSERT_LE(std::fabs(double(y[size_t(r * ldy + j)]) - exact), double(in + 2) * kU * mass)
                  << "row " << r << " column " << j;
            }
            for (int64_t j = out; j < ldy; ++j) ASSERT_EQ(y[size_t(r * ldy + j)], y0[size_t(r * ldy + j)]) << "row " << r << " gap " << j;
          }
          EXPECT_TRUE(std::equal(y.begin() + N * ldy, y.end(), y0.begin() + N * ldy)) << "rows past N written";
        }
}

// A linear's fp32 and bf16 copies in panels (kernels::panel_index), from rows with a stride, as
// each backend lays them out; and a row stride for panels is refused by name.
TEST(Panels, EachBackendLaysOutWhatTheKernelsRead) {
  const int64_t in = 70, out = 150, ld = 160;  // panels of 64, 64, 22 columns
  const auto w = randn(in * ld, 11);
  std::vector<float> want(size_t(in * out));
  std::vector<uint16_t> want16(want.size());
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) {
      const int64_t p = j / 64, width = std::min<int64_t>(64, out - 64 * p);
      want[size_t(64 * p * in + i * width + j % 64)] = w[size_t(i * ld + j)];
      want16[size_t(64 * p * in + i * width + j % 64)] = to_bf16(w[size_t(i * ld + j)]);
    }
  for (ops::BackendKind kind : {ops::BackendKind::Cpu, ops::BackendKind::Ref}) {
    std::vector<float> got(want.size());
    ops::backend(kind).convert_f32_panels(got.data(), w.data(), in, out, ld);
    EXPECT_EQ(got, want) << ops::backend(kind).name;
    std::vector<uint16_t> got16(want.size());
    ops::backend(kind).convert_bf16_panels(got16.data(), w.data(), in, out, ld);
    EXPECT_EQ(got16, want16) << ops::backend(kind).name;
  }
  std::vector<float> x(size_t(5 * in)), y(size_t(5 * out));
  auto refused = [&](const char* what, auto&& run) {
    for (int64_t N : {1, 5})  // the GEMV (a decode step's), and a prompt's panels in rows
      try {
        const ops::FewRowKernels decode;
        run(N);
        ADD_FAILURE() << what << ": a row stride of " << ld << " was taken at N = " << N;
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("no row stride"), std::string::npos) << what << ": " << e.what();
      }
  };
  refused("bf16", [&](int64_t N) {
    cpu::linear_forward_w16(y.data(), x.data(), want16.data(), nullptr, N, in, out, false, {0, ld, 0});
  });
  refused("fp32", [&](int64_t N) {
    cpu::linear_forward_f32_panels(y.data(), x.data(), want.data(), nullptr, N, in, out, false, {0, ld, 0});
  });
}

// Every SIMD path the CPU has (AVX-512 with VNNI, AVX-512, AVX2) gives the portable path's bits, fp32 and bf16
// weights, nn and nt, 1 to 4 rows, with tails (int8: test_int8).
TEST_P(Gemv, EverySimdPathMatchesThePortablePathBitForBit) {
  const auto [in, out] = GetParam();
  const auto x = randn(4 * in, 4), w = randn(in * out, 5), b = randn(out, 6), y0 = randn(4 * out, 7);
  std::vector<uint16_t> w16;  // rows: the head's [out, in]
  for (float v : w) w16.push_back(to_bf16(v));
  const std::vector<uint16_t> p16 = bf16_panels(w, in, out);
  const std::vector<float> p32 = f32_panels(w, in, out);
  auto run = [&](cpu::GemvIsa isa, int64_t M) {
    cpu::gemv_use_isa(isa);
    std::vector<float> a = y0, h = y0, h2 = y0, f = y0, f2 = y0, t(size_t(M * out)), t16(size_t(M * out));
    cpu::gemv_nn(a.data(), x.data(), w.data(), b.data(), M, in, out, true, {});
    cpu::gemv_nn(h.data(), x.data(), p16.data(), nullptr, M, in, out, false, {});
    cpu::gemv_nn(h2.data(), x.data(), p16.data(), b.data(), M, in, out, true, {});
    cpu::gemv_nn_panels(f.data(), x.data(), p32.data(), nullptr, M, in, out, false, {});
    cpu::gemv_nn_panels(f2.data(), x.data(), p32.data(), b.data(), M, in, out, true, {});
    for (const auto* v : {&h2, &f, &f2}) h.insert(h.end(), v->begin(), v->end());
    cpu::gemv_nt(t.data(), x.data(), w.data(), M, in, out, in, in, out);
    cpu::gemv_nt(t16.data(), x.data(), w16.data(), M, in, out, in, in, out);
    cpu::gemv_use_isa(cpu::GemvIsa::Best);
    for (const auto* v : {&h, &t, &t16}) a.insert(a.end(), v->begin(), v->end());
    return a;
  };
  std::vector<std::vector<float>> want;
  for (int64_t M = 1; M <= 4; ++M) want.push_back(run(cpu::GemvIsa::Portable, M));
  sigma::testing::for_each_simd_isa([&](cpu::GemvIsa isa) {
    for (int64_t M = 1; M <= 4; ++M) {
      const std::vector<float> got = run(isa, M);
      EXPECT_EQ(0, std::memcmp(got.data(), want[size_t(M - 1)].data(), got.size() * 4))
          << cpu::gemv_isa_name(isa) << " M " << M;
    }
  });
}

// The weight matrices a decode step streams (Model::use_weights converts these).
bool is_matrix(const std::string& n) {
  return n == names::kTokens || n.find(".w_in") != std::string::npos ||
         n.find(".w_out") != std::string::npos || n.find("attn.qkv.w") != std::string::npos ||
         n.find("attn.out.w") != std::string::npos;
}

void round_to_bf16(Model& m, bool tokens_only) {
  for (Param& p : m.params().all()) {
    if (!is_matrix(p.name) || (tokens_only && p.name != names::kTokens)) continue;
    sigma::testing::edit_floats(p.value, [](float* v, int64_t n) { for (int64_t i = 0; i < n; ++i) v[i] = round_bf16(v[i]); });
  }
}

// bf16 weights: the logits equal (to fp32 rounding) those of an fp32 model whose weight
// matrices were rounded to bf16, and stay within a bound of the fp32 model's. (The token
// table is rounded in all three, since the embedding lookup reads the fp32 table.)
TEST(Bf16Weights, DecodeMatchesTheRoundedModelAndStaysNearFp32) {
  const ModelConfig c = decode_config();
  Model fp32(c, 9), bf16(c, 9), rounded(c, 9);
  round_to_bf16(fp32, true);
  round_to_bf16(bf16, true);
  bf16.use_weights(WeightFormat::Bf16);
  ASSERT_EQ(bf16.weight_format(), WeightFormat::Bf16);
  round_to_bf16(rounded, false);
  const auto tokens = some_tokens(c, c.context);
  for (int domain : {0, 1}) {
    const auto l16 = cached_logits(bf16, domain, tokens);
    const auto lr = cached_logits(rounded, domain, tokens);
    const auto l32 = cached_logits(fp32, domain, tokens);
    double worst_rounded = 0, worst_fp32 = 0, scale = 0;
    for (size_t i = 0; i < l16.size(); ++i) {
      worst_rounded = std::max(worst_rounded, double(std::fabs(l16[i] - lr[i])));
      worst_fp32 = std::max(worst_fp32, double(std::fabs(l16[i] - l32[i])));
      scale = std::max(scale, double(std::fabs(l32[i])));
    }
    // fp32 rounding of sums of ~100 O(1) terms: ~1e-6 of the scale; bf16's own rounding
    // (2^-9 relative per weight) moves the logits by ~1e-3 of it.
    EXPECT_LT(worst_rounded, 1e-5 * scale) << "domain " << domain;
    EXPECT_GT(worst_fp32, 1e-4 * scale) << "domain " << domain << ": bf16 gave fp32's logits";
    EXPECT_LT(worst_fp32, 2e-2 * scale) << "domain " << domain;
  }
}

// After the copies are made the fp32 matrices are gone (Model::use_weights frees them; the
// byte accounting is in test_int8.cpp), so a decode step cannot read them.
TEST(Bf16Weights, DecodeReadsOnlyTheCopies) {
  const ModelConfig c = decode_config();
  Model m(c, 10);
  m.use_weights(WeightFormat::Bf16);
  for (const Param& p : m.params().all())
    EXPECT_EQ(p.value.empty(), is_matrix(p.name)) << p.name;
  const std::vector<int32_t> tokens = {3, 4, 5, 6, 7, 8};
  const auto logits = cached_logits(m, 1, tokens);
  for (float l : logits) ASSERT_TRUE(std::isfinite(l));
}

// fp32 inference weights: the linears move into panels (Model::use_weights), whose GEMVs give
// the kernels' bits on rows, so a decode gives the training model's logits bit for bit; a
// prompt's rows (panels put back in rows, oneDNN) stay within fp32 rounding of them; only the
// copies are read (the rows are freed; the embedding table stays).
TEST(Fp32Weights, DecodeOnPanelsIsTheModelInRowsBitForBit) {
  const ModelConfig c = decode_config();
  Model rows(c, 9), panels(c, 9);
  panels.use_weights(WeightFormat::F32);
  for (const Param& p : panels.params().all())
    EXPECT_EQ(p.value.empty(), is_matrix(p.name) && p.name != names::kTokens) << p.name;
  const auto tokens = some_tokens(c, c.context);
  for (int domain : {0, 1}) {
    const auto want = cached_logits(rows, domain, tokens), got = cached_logits(panels, domain, tokens);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << "domain " << domain;
    Batch b;
    b.resize(1, c.context);
    b.tokens = tokens;
    b.domain[0] = domain;
    std::vector<float> loss(size_t(c.context));
    rows.forward(b, loss.data());
    const std::vector<float> full = rows.logits();
    panels.forward(b, loss.data());
    const std::vector<float> prompt = panels.logits();
    for (size_t i = 0; i < full.size(); ++i)
      ASSERT_NEAR(prompt[i], full[i], 1e-5 * (1 + std::fabs(full[i]))) << "domain " << domain << " at " << i;
  }
}

// The KV cache on bf16 weights (GEMV kernels, one row) computes the full forward pass's logits
// on them (a prompt of many rows: weights widened, oneDNN).
TEST(Bf16Weights, CachedDecodeMatchesTheFullForward) {
  const ModelConfig c = decode_config();
  Model m(c, 11);
  m.use_weights(WeightFormat::Bf16);
  const auto tokens = some_tokens(c, c.context);
  Batch b;
  b.resize(1, c.context);
  b.tokens = tokens;
  b.domain[0] = 1;
  std::vector<float> loss(size_t(c.context));
  m.forward(b, loss.data());
  const std::vector<float> full = m.logits();
  const auto cached = cached_logits(m, 1, tokens);
  for (size_t i = 0; i < full.size(); ++i)
    ASSERT_NEAR(cached[i], full[i], 1e-4) << "position " << i / size_t(c.vocab);
}

TEST(Bf16Weights, RefusesBackward) {
  const ModelConfig c = decode_config();
  Model m(c, 12);
  m.use_weights(WeightFormat::Bf16);
  Batch b;
  b.resize(1, 4);
  b.tokens = some_tokens(c, 4);
  std::vector<float> loss(4), weight(4, 1.0f);
  m.forward(b, loss.data(), weight.data());
  EXPECT_THROW(m.backward(b), Error);
}

// generate() reports its prompt pass and one decode step per further token.
TEST(Generate, StatsCountThePromptAndEachStep) {
  const ModelConfig c = decode_config();
  Model m(c, 13);
  SamplingConfig s;
  s.max_new_tokens = 9;
  GenerateStats st;
  const auto out = generate(m, 0, some_tokens(c, 5), s, true, &st);
  ASSERT_EQ(out.size(), 9u);
  EXPECT_EQ(st.prompt_tokens, 5);
  EXPECT_EQ(st.decode_steps, 8);
  EXPECT_GT(st.decode_seconds, 0.0);
  EXPECT_GT(st.prefill_seconds, 0.0);
}

// From the command line: --precision bf16 decodes (tokens/s reported on stderr), a wrong
// value is refused before anything loads.
TEST(GenerateCli, PrecisionFlag) {
  TempDir dir("gen16");
  const auto train = sigma_cmd("train --quiet --set train.steps=2 --set train.eval_rows=2 --out " +
                               dir.str());
  ASSERT_EQ(train.code, 0) << train.out;
  const std::string ckpt = dir / "checkpoints";
  const auto r = sigma_cmd("generate --ckpt " + ckpt + " --prompt '1 2 3' --max-new 5 --precision bf16");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("4 more tokens in"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tokens/s, bf16 weights"), std::string::npos) << r.out;
  const auto bad = sigma_cmd("generate --ckpt " + ckpt + " --prompt 1 --precision fp16");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--precision"), std::string::npos) << bad.out;
}

// --kv-cache bf16 decodes through a cache of half the bytes (reported on stderr); the default,
// auto, follows the weights (fp32 with fp32, bf16 with bf16 and int8), and --kv-cache fp32 keeps
// an fp32 cache on int8 weights; a wrong value is refused before anything loads (with
// --no-cache: RefusedOptions).
TEST(GenerateCli, KvCacheFlag) {
  TempDir dir("genkv");
  const auto train = sigma_cmd("train --quiet --set train.steps=2 --set train.eval_rows=2 --out " +
                               dir.str());
  ASSERT_EQ(train.code, 0) << train.out;
  const std::string ckpt = dir / "checkpoints", gen = "generate --ckpt " + ckpt + " --prompt '1 2 3' --max-new 5";
  const auto f32 = sigma_cmd(gen), bf16 = sigma_cmd(gen + " --kv-cache bf16 --precision int8");
  ASSERT_EQ(f32.code, 0) << f32.out;
  ASSERT_EQ(bf16.code, 0) << bf16.out;
  auto cache_mb = [](const std::string& out, const char* type) {
    const size_t at = out.find(std::string(type) + " KV cache: ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + std::strlen(type) + 11));
  };
  EXPECT_GT(cache_mb(f32.out, "fp32"), 0.0) << f32.out;
  EXPECT_NEAR(cache_mb(bf16.out, "bf16"), cache_mb(f32.out, "fp32") / 2, 1e-3) << bf16.out;
  for (const char* precision : {"bf16", "int8"}) {
    const auto automatic = sigma_cmd(gen + " --precision " + precision);
    EXPECT_NEAR(cache_mb(automatic.out, "bf16"), cache_mb(f32.out, "fp32") / 2, 1e-3) << automatic.out;
    const auto wide = sigma_cmd(gen + " --kv-cache fp32 --precision " + precision);
    EXPECT_EQ(cache_mb(wide.out, "fp32"), cache_mb(f32.out, "fp32")) << wide.out;
  }
  const auto bad = sigma_cmd(gen + " --kv-cache fp16");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--kv-cache"), std::string::npos) << bad.out;
}

// The bytes a decode step reads, from the parameter registry: everything but the looked-up
// tables (positions, query table), the other slots' embedding rows and the experts a token
// does not run (one of K per group and block; here one group is used, K = 2).
TEST(Generate, WeightBytesPerTokenCountsWhatAStepReads) {
  ModelConfig c = decode_config();
  c.groups = {{"g0", 2}};
  c.domains = {{"a", "g0", 0}};
  c.slots = 1;
  Model m(c, 14);
  const int64_t d = c.d_model, f = c.ffn();
  int64_t params = 0;
  for (const Param& p : m.params().all()) params += p.value.numel();
  const int64_t tables = 2 * int64_t(c.context) * d;              // positions, query table
  const int64_t idle_expert = c.rre_layers * (2 * d * f + f + d);  // the second expert
  EXPECT_EQ(weight_bytes_per_token(m), 4 * (params - tables - idle_expert));
  const int64_t matrices = c.layers * (4 * d * d + 2 * d * f) + int64_t(c.vocab) * d;
  m.use_weights(WeightFormat::Bf16);
  EXPECT_EQ(weight_bytes_per_token(m), 4 * (params - tables - idle_expert) - 2 * matrices);
}

// Up to kGemvMaxRows slots, a decode step gives each sequence the same logits, bit for bit, as
// that sequence decoded alone (docs/serving.md), on fp32 and on bf16 weights, dense and RRE.
TEST(Decode, StepsOfUpToFourRowsAreBatchInvariantBitForBit) {
  const ModelConfig c = decode_config();
  for (bool bf16 : {false, true}) {
    Model m(c, 15);
    if (bf16) m.use_weights(WeightFormat::Bf16);
    expect_steps_batch_invariant(m, 6, bf16 ? "bf16" : "fp32");
  }
}

// fill_cache appends the keys and values forward_cached appends, to the bit, in every block
// (the top block's too, though it stops before its attention), and a pass continuing from
// either cache gives the same losses and logits: a scored context or a prompt's first chunks
// can skip the outputs nobody reads.
TEST(Decode, FillCacheWritesTheCacheForwardCachedWrites) {
  const ModelConfig c = decode_config();
  Model m(c, 21);
  auto batch_of = [&](int T, int seed) {
    Batch b;
    b.resize(2, T);
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      b.tokens[i] = int32_t((7 * i + size_t(seed)) % size_t(c.vocab));
      b.targets[i] = int32_t((3 * i + size_t(seed)) % size_t(c.vocab));
    }
    b.domain = {0, 1};
    return b;
  };
  const Batch context = batch_of(9, 1), next = batch_of(5, 2);
  const int rows[2] = {2, 0};  // rows out of order, one left empty
  for (DType t : {DType::F32, DType::BF16}) {
  SCOPED_TRACE(dtype_name(t));
  KvCache full, filled;
  full.reset(c, 3, t);
  filled.reset(c, 3, t);
  Activations a1, a2;
  std::vector<float> loss(size_t(2 * 9)), loss_full(size_t(2 * 5)), loss_filled(size_t(2 * 5));
  m.forward_cached(context, full, a1, loss.data(), rows);
  m.fill_cache(context, filled, a2, rows);
  EXPECT_EQ(filled.length, full.length);
  for (int l = 0; l < c.layers; ++l) {
    EXPECT_EQ(sigma::testing::host_bytes(full.kv[size_t(l)]), sigma::testing::host_bytes(filled.kv[size_t(l)]))
        << "block " << l;
  }
  m.forward_cached(next, full, a1, loss_full.data(), rows);
  m.forward_cached(next, filled, a2, loss_filled.data(), rows);
  EXPECT_EQ(0, std::memcmp(loss_full.data(), loss_filled.data(), loss_full.size() * 4));
  const std::vector<float> l1 = sigma::testing::host_floats(a1.logits), l2 = sigma::testing::host_floats(a2.logits);
  EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4));
  }
}

// A pass that returns no loss (a decode step: BatchDecoder::step) computes the same logits to
// the bit and no cross-entropy: its per-row losses are never written (a pass over every logit
// with an exp each, ~30 % of a decode token on a 16,384-id model at d = 128).
TEST(Decode, APassWithoutALossComputesTheLogitsAlone) {
  const ModelConfig c = decode_config();
  Model m(c, 22);
  const Batch b = token_batch(c, 3, {1, 0}, 5, 1);
  KvCache with_loss, without;
  Activations a1, a2;
  std::vector<float> loss(b.tokens.size());
  m.forward_cached(b, with_loss, a1, loss.data());
  m.forward_cached(b, without, a2, loss.data());  // a2's buffers exist: mark the losses
  ops::fill(a2.loss_d.dev_f(), -1.0f, a2.loss_d.numel());
  without.reset(c, 2);
  m.forward_cached(b, without, a2, nullptr);
  const std::vector<float> l1 = sigma::testing::host_floats(a1.logits), l2 = sigma::testing::host_floats(a2.logits);
  EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4));
  for (float v : sigma::testing::host_floats(a2.loss_d)) ASSERT_EQ(v, -1.0f) << "a loss was computed";
}

// forward_cached_last (a prompt's last chunk) appends the cache forward_cached appends and gives
// each row's last position's logits, in row b, its top block's rest and the head run on those
// positions alone: inside ops::BatchInvariant (no product's bits depend on its row count) the
// same bits as forward_cached's row b T + T - 1. The top block is an RRE block: the rows' experts
// follow their last tokens and their domains' groups; the cache rows are not the batch rows.
TEST(Decode, TheLastPositionsLogitsAloneAreTheFullPassesLastRows) {
  const ModelConfig c = decode_config();
  Model m(c, 23);
  const Batch b = token_batch(c, 6, {1, 0, 1}, 11, 4);
  const int64_t V = c.vocab;
  for (auto [invariant, kv] : {std::pair{true, DType::F32}, {false, DType::F32}, {true, DType::BF16}}) {
    SCOPED_TRACE(std::string(invariant ? "BatchInvariant" : "default kernels") + ", cache " + dtype_name(kv));
    m.use_kv_cache(kv);
    std::unique_ptr<ops::BatchInvariant> scope(invariant ? new ops::BatchInvariant : nullptr);
    KvCache all, last;
    Activations a1, a2;
    const int rows[3] = {1, 2, 0};
    all.reset(c, 3, kv);
    last.reset(c, 3, kv);
    m.forward_cached(b, all, a1, nullptr, rows);
    m.forward_cached_last(b, last, a2, rows);
    EXPECT_EQ(all.length, last.length);
    for (int l = 0; l < c.layers; ++l)
      EXPECT_EQ(sigma::testing::host_bytes(all.kv[size_t(l)]), sigma::testing::host_bytes(last.kv[size_t(l)]));
    const std::vector<float> l1 = sigma::testing::host_floats(a1.logits), l2 = sigma::testing::host_floats(a2.logits);
    for (int r = 0; r < b.B; ++r) {
      const float* want = l1.data() + (int64_t(r) * b.T + b.T - 1) * V;
      const float* got = l2.data() + r * V;
      for (int64_t j = 0; j < V; ++j) {
        if (invariant)
          ASSERT_EQ(0, std::memcmp(want + j, got + j, 4)) << "row " << r << " id " << j;
        else
          ASSERT_NEAR(want[j], got[j], 1e-4f * (1.0f + std::fabs(want[j]))) << "row " << r << " id " << j;
      }
    }
  }
}

// A bf16 KV cache (Model::use_kv_cache) holds half the bytes of an fp32 one, and decoding through
// it stays near the fp32 cache's logits (keys and values rounded once to bf16: a relative
// 2^-9 each) on fp32 and int8 weights, without being the same computation (the rounding is
// there). The bits of its attention against the widened values: Attention.Bf16Cache* (test_ops).
TEST(Decode, Bf16KvCacheHalvesTheCacheAndStaysNearTheFp32Cache) {
  const ModelConfig c = decode_config();
  const auto tokens = some_tokens(c, c.context);
  for (WeightFormat f : {WeightFormat::F32, WeightFormat::Int8}) {
    Model m(c, 31);
    m.use_weights(f);
    const std::vector<float> want = cached_logits(m, 1, tokens);
    m.use_kv_cache(DType::BF16);
    const std::vector<float> got = cached_logits(m, 1, tokens);
    ASSERT_EQ(got.size(), want.size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << i;
      worst = std::max(worst, double(std::fabs(got[i] - want[i])));
      scale = std::max(scale, double(std::fabs(want[i])));
    }
    EXPECT_GT(worst, 0.0) << "the bf16 cache computed the fp32 cache's logits: nothing rounded";
    EXPECT_LT(worst, 2e-2 * scale) << weight_format_name(f);
    const BatchDecoder half(m, 2);  // a decoder's cache takes the model's type when it is made
    m.use_kv_cache(DType::F32);
    const BatchDecoder full(m, 2);
    EXPECT_EQ(2 * half.cache_bytes(), full.cache_bytes());
    EXPECT_EQ(full.cache_bytes(), int64_t(c.layers) * 2 * 2 * c.context * c.d_model * 4);
  }
  Model m(c, 32);
  EXPECT_THROW(m.use_kv_cache(DType::I32), Error);
}

// The serving guarantees hold on a bf16 cache as on an fp32 one: a sequence's logits are the
// same bits decoded alone or with three others, fill_cache writes what forward_cached writes,
// and a prompt continuing a copied prefix (the prefix cache) computes what the whole prompt does.
TEST(Decode, Bf16KvCacheKeepsTheServingGuaranteesBitForBit) {
  ModelConfig c = decode_config();
  Model m(c, 33);
  m.use_kv_cache(DType::BF16);
  expect_steps_batch_invariant(m, 6, "bf16 KV cache");

  c.context = 3 * BatchDecoder::kPrefillChunk;
  Model long_model(c, 34);
  long_model.use_kv_cache(DType::BF16);
  const auto prompt = some_tokens(c, 2 * BatchDecoder::kPrefillChunk + 9);
  BatchDecoder fresh(long_model, 1), reuse(long_model, 2);
  const float* want = fresh.prefill(0, 1, prompt);
  reuse.prefill(0, 1, prompt);
  reuse.copy_prefix(0, 1, 2 * BatchDecoder::kPrefillChunk);
  const float* got = reuse.prefill(1, 1, prompt, nullptr, 2 * BatchDecoder::kPrefillChunk);
  EXPECT_EQ(0, std::memcmp(got, want, size_t(c.vocab) * 4));
  const int zero = 0, one = 1, domain = 1;
  const int32_t next = 3;
  fresh.step({&zero, 1}, {&domain, 1}, {&next, 1});
  reuse.step({&one, 1}, {&domain, 1}, {&next, 1});
  EXPECT_EQ(0, std::memcmp(reuse.logits(0), fresh.logits(0), size_t(c.vocab) * 4));
}

// A checkpoint that does not load stops `sigma serve` with its error and exit status 1 (it used
// to abort with std::terminate: the signal-waiting thread was still running).
TEST(ServeCli, ACheckpointThatDoesNotLoadIsAnErrorNotAnAbort) {
  TempDir dir("serve-bad");
  const auto r = sigma_cmd("serve --ckpt " + dir.str() + " --port 0");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("is not a checkpoint"), std::string::npos) << r.out;
}
