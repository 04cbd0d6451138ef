// Per-kernel checks: finite-difference gradients on sizes that are not multiples of the SIMD
// width, and forward values against plain reference formulas.
#include <gtest/gtest.h>

#include <cmath>

#include "avx512_where.h"
#include "gradcheck.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/vexp.h"
#include "kernels/cpu/xent.h"

using namespace sigma;
using namespace sigma::testing;

TEST(Gemm, MatchesNaiveForAllTransposes) {
  const int64_t M = 7, N = 19, K = 13;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      auto A = random_vec(M * K, 1), B = random_vec(K * N, 2), C = random_vec(M * N, 3);
      auto ref = C;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k)
            s += double(ta ? A[k * M + i] : A[i * K + k]) * (tb ? B[j * K + k] : B[k * N + j]);
          ref[i * N + j] = float(0.5 * s + 2.0 * C[i * N + j]);
        }
      cpu::gemm(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 2.0f,
                C.data(), N);
      for (int64_t i = 0; i < M * N; ++i) EXPECT_NEAR(C[i], ref[i], 1e-4) << ta << tb << i;
    }
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  const int64_t N = 5, in = 17, out = 11;
  auto x = random_vec(N * in, 1), w = random_vec(in * out, 2), b = random_vec(out, 3);
  auto r = random_vec(N * out, 4);
  std::vector<float> y(N * out);
  auto loss = [&] {
    cpu::linear_forward(y.data(), x.data(), w.data(), b.data(), N, in, out);
    return dot(r, y.data());
  };
  std::vector<float> dx(N * in, 0), dw(in * out, 0), db(out, 0);
  cpu::linear_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(), N, in, out);
  expect_grad_matches("dx", x.data(), x.size(), dx, loss);
  expect_grad_matches("dw", w.data(), w.size(), dw, loss);
  expect_grad_matches("db", b.data(), b.size(), db, loss);
}

TEST(LayerNorm, ForwardNormalisesAndGradientsMatch) {
  const int64_t N = 6, C = 37;
  auto x = random_vec(N * C, 1, 2.0f), w = random_vec(C, 2), b = random_vec(C, 3);
  auto r = random_vec(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  for (int64_t i = 0; i < N; ++i) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < C; ++j) m += x[i * C + j];
    m /= C;
    for (int64_t j = 0; j < C; ++j) v += (x[i * C + j] - m) * (x[i * C + j] - m);
    v /= C;
    for (int64_t j = 0; j < C; ++j)
      EXPECT_NEAR(out[i * C + j], (x[i * C + j] - m) / std::sqrt(v + 1e-5) * w[j] + b[j], 1e-4);
  }
  auto loss = [&] {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N,
                           C);
    return dot(r, out.data());
  };
  loss();
  std::vector<float> dx(N * C, 0), dw(C, 0), db(C, 0);
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), mean.data(),
                          rstd.data(), w.data(), N, C);
  expect_grad_matches("dx", x.data(), x.size(), dx, loss, 1e-2, 2e-3, 2e-2);
  expect_grad_matches("dw", w.data(), w.size(), dw, loss);
  expect_grad_matches("db", b.data(), b.size(), db, loss);
}

TEST(FastGelu, ValuesAndGradient) {
  const int64_t n = 37;
  auto x = random_vec(n, 1, 3.0f), r = random_vec(n, 2);
  std::vector<float> y(n);
  cpu::fast_gelu_forward(y.data(), x.data(), n);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(y[i], x[i] / (1.0 + std::exp(-1.702 * x[i])), 1e-5);
  auto loss = [&] {
    cpu::fast_gelu_forward(y.data(), x.data(), n);
    return dot(r, y.data());
  };
  std::vector<float> dx(n, 7.0f);  // written, not added to
  cpu::fast_gelu_backward(dx.data(), r.data(), x.data(), n);
  expect_grad_matches("dx", x.data(), n, dx, loss, 1e-3);
}

// Reference attention in double, one (b, h) at a time.
static void naive_attention(std::vector<double>& out, const std::vector<float>& q, int64_t qbs,
                            const std::vector<float>& kv, int64_t B, int64_t T, int64_t H,
                            int64_t hd, int64_t ldq) {
  const int64_t d = H * hd;
  out.assign(B * T * d, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < hd; ++c)
            dot += double(q[b * qbs + i * ldq + h * hd + c]) * kv[(b * T + j) * 2 * d + h * hd + c];
          s[j] = dot / std::sqrt(double(hd));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (auto& v : s) z += (v = std::exp(v - mx));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t c = 0; c < hd; ++c)
            out[(b * T + i) * d + h * hd + c] += s[j] / z * kv[(b * T + j) * 2 * d + d + h * hd + c];
      }
}

// Covers both the ordinary layout (q per row) and the query layer's (one q table shared by the
// batch, batch stride 0); T > 128 exercises several causal row blocks.
class AttentionTest : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(AttentionTest, ForwardMatchesReferenceAndGradientsMatch) {
  const auto [shared_q, T_] = GetParam();
  const int64_t B = 2, T = T_, H = 3, hd = 5, d = H * hd;
  const float scale = 1.0f / std::sqrt(float(hd));
  const int64_t qbs = shared_q ? 0 : T * d;
  auto q = random_vec(shared_q ? T * d : B * T * d, 1);
  auto kv = random_vec(B * T * 2 * d, 2);  // rows of [k | v]
  auto r = random_vec(B * T * d, 3);
  std::vector<float> out(B * T * d), probs(B * H * T * T);
  const cpu::AttnShape s{B, T, T, H, hd};
  auto run = [&] {
    cpu::attention_forward(out.data(), probs.data(), {q.data(), d, qbs}, {kv.data(), 2 * d, T * 2 * d},
                           {kv.data() + d, 2 * d, T * 2 * d}, s, scale);
    return dot(r, out.data());
  };
  run();
  std::vector<double> ref;
  naive_attention(ref, q, qbs, kv, B, T, H, hd, d);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-4) << i;

  std::vector<float> dq(B * T * d, 0), dkv(B * T * 2 * d, 0);
  cpu::attention_backward({dq.data(), d, T * d}, {dkv.data(), 2 * d, T * 2 * d},
                          {dkv.data() + d, 2 * d, T * 2 * d}, r.data(), out.data(), probs.data(),
                          {q.data(), d, qbs}, {kv.data(), 2 * d, T * 2 * d},
                          {kv.data() + d, 2 * d, T * 2 * d}, s, scale);
  std::vector<float> dq_param(q.size(), 0);  // shared q: the batch's rows sum
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < T * d; ++i) dq_param[(shared_q ? 0 : b * T * d) + i] += dq[b * T * d + i];
  std::vector<size_t> sample;  // every element for small T, a spread sample for large T
  for (size_t i = 0; i < q.size(); i += (T > 16 ? 37 : 1)) sample.push_back(i);
  expect_grad_matches("dq", q.data(), q.size(), dq_param, run, 1e-2, 1e-3, 1e-2, sample);
  sample.clear();
  for (size_t i = 0; i < kv.size(); i += (T > 16 ? 41 : 1)) sample.push_back(i);
  expect_grad_matches("dkv", kv.data(), kv.size(), dkv, run, 1e-2, 1e-3, 1e-2, sample);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AttentionTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(7, 131)));

TEST(SoftmaxXent, LossAndGradient) {
  const int64_t N = 5, V = 23;
  auto logits = random_vec(N * V, 1, 2.0f);
  std::vector<int32_t> tgt = {0, 22, 5, 17, 3};
  std::vector<float> scale = {0.5f, 1.0f, 0.0f, 2.0f, 1.0f}, loss(N);
  auto work = logits;
  cpu::softmax_xent(work.data(), loss.data(), tgt.data(), nullptr, N, V);
  for (int64_t i = 0; i < N; ++i) {
    double z = 0;
    for (int64_t j = 0; j < V; ++j) z += std::exp(double(logits[i * V + j]));
    EXPECT_NEAR(loss[i], std::log(z) - logits[i * V + tgt[i]], 1e-5);
  }
  auto total = [&] {
    auto w = logits;
    cpu::softmax_xent(w.data(), loss.data(), tgt.data(), nullptr, N, V);
    double s = 0;
    for (int64_t i = 0; i < N; ++i) s += scale[i] * loss[i];
    return s;
  };
  auto grad = logits;
  cpu::softmax_xent(grad.data(), loss.data(), tgt.data(), scale.data(), N, V);
  expect_grad_matches("dlogits", logits.data(), logits.size(), grad, total, 1e-3);
}

TEST(Embedding, ForwardAndGradient) {
  const int64_t B = 2, T = 3, d = 19, rows = 7;
  auto table = random_vec(rows * d, 1), pos = random_vec(T * d, 2), r = random_vec(B * T * d, 3);
  std::vector<int32_t> ids = {4, 0, 4, 6, 1, 4};  // a repeated row accumulates
  std::vector<float> out(B * T * d);
  auto run = [&] {
    cpu::embedding_forward(out.data(), ids.data(), table.data(), pos.data(), B, T, d);
    return dot(r, out.data());
  };
  run();
  EXPECT_FLOAT_EQ(out[d + 3], table[0 * d + 3] + pos[1 * d + 3]);
  std::vector<float> dt(rows * d, 0), dp(T * d, 0);
  cpu::embedding_backward(dt.data(), dp.data(), r.data(), ids.data(), B, T, d);
  expect_grad_matches("dtable", table.data(), table.size(), dt, run);
  expect_grad_matches("dpos", pos.data(), pos.size(), dp, run);
  for (int64_t c = 0; c < d; ++c) EXPECT_EQ(dt[2 * d + c], 0.0f);  // unused row stays zero
}

TEST(VectorExp, MatchesStdExpAcrossTheRangeIncludingTails) {
  std::printf("vector exp, max and sum loops: %s%s\n", cpu::kVectorExpPath,
              std::string_view(cpu::kVectorExpPath) == "avx512" ? sigma::testing::kAvx512Where : "");
  ::testing::Test::RecordProperty("vector_exp_path", cpu::kVectorExpPath);
  // 1003 values (not a multiple of 16) from deep underflow to e^80 (so the sum fits in fp32).
  const int64_t n = 1003;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = -100.0f + 180.0f * float(i) / float(n - 1);
  auto y = x;
  const float sum = cpu::exp_shift_sum(y.data(), n, 0.0f);
  double ref_sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::exp(double(x[i]));
    ref_sum += e;
    ASSERT_NEAR(y[i], e, 4e-7 * e + 1e-38) << "x = " << x[i];
  }
  EXPECT_NEAR(sum, ref_sum, 1e-5 * ref_sum);
  EXPECT_EQ(cpu::max_of(x.data(), n), x[n - 1]);
  // The largest value in every lane of the vector loop and in the tail.
  std::vector<float> m(40);
  for (size_t p = 0; p < m.size(); ++p) {
    for (size_t i = 0; i < m.size(); ++i) m[i] = -1.0f - float((i * 7) % 13);
    m[p] = 3.0f;
    EXPECT_EQ(cpu::max_of(m.data(), int64_t(m.size())), 3.0f) << "largest at " << p;
  }
  std::vector<float> s(n);
  cpu::sigmoid_scaled(s.data(), x.data(), n, 0.05f);
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(s[i], 1.0 / (1.0 + std::exp(-0.05 * x[i])), 1e-6);
}
