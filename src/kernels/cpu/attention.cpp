#include "kernels/cpu/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/bf16_vec.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/spin_team.h"
#include "kernels/cpu/vexp.h"
#include "kernels/ops.h"

namespace sigma::cpu {

// Row blocks let each block skip the key columns the causal mask removes (~40% of the work
// at T=512).
constexpr int64_t kRowBlock = 128;

namespace {
void check_shape(const AttnShape& s) {
  SIGMA_CHECK(s.Tq >= 0 && s.Tq <= s.Tk && s.hd > 0 && s.H > 0,
              "attention: need 0 <= Tq <= Tk and H, hd > 0 (got B={} Tq={} Tk={} H={} hd={})",
              s.B, s.Tq, s.Tk, s.H, s.hd);
}
// The backward kernels index heads side by side in a row (a KV cache is never trained).
void check_backward_views(const AttnOperand& q, const AttnOperand& k, const AttnOperand& v,
                          const AttnShape& s) {
  check_shape(s);
  SIGMA_CHECK(q.heads_in_rows(s.hd) && k.heads_in_rows(s.hd) && v.heads_in_rows(s.hd),
              "attention backward: views with a head stride (hs = {}, {}, {}; hd = {}) are for the "
              "forward only", q.hs, k.hs, v.hs, s.hd);
}
// A forward pass's two products; a decode step's (one query a row) run on the calling thread.
bool worth_threads(const AttnShape& s) {
  return 2 * s.B * s.H * s.Tq * s.Tk * s.hd > kParallelMacs;
}
}  // namespace

// Query row i (of Tq) attends keys 0..off+i, off = Tk - Tq; a block of rows [i0, i1) needs keys
// 0..off+i1-1.
void attention_forward(float* out, float* probs, AttnOperand q, AttnOperand k, AttnOperand v,
                       AttnShape s, float scale) {
  check_shape(s);
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < s.B * s.H; ++bh) {
    const int64_t b = bh / s.H, h = bh % s.H;
    const float* qb = q.head(b, h, hd);
    const float* kb = k.head(b, h, hd);
    const float* vb = v.head(b, h, hd);
    float* P = probs + bh * Tq * Tk;
    float* ob = out + b * Tq * d + h * hd;
    for (int64_t i0 = 0; i0 < Tq; i0 += kRowBlock) {
      const int64_t i1 = std::min(Tq, i0 + kRowBlock), keys = off + i1;
      float* Pi = P + i0 * Tk;
      gemm(false, true, i1 - i0, keys, hd, scale, qb + i0 * q.ld, q.ld, kb, k.ld, 0.0f, Pi, Tk);
      for (int64_t i = i0; i < i1; ++i) {
        float* row = P + i * Tk;
        const int64_t n = off + i + 1;  // keys this row sees
        const float sum = exp_shift_sum(row, n, max_of(row, n));
        scale_into(row, row, n, 1.0f / sum);
        for (int64_t j = n; j < Tk; ++j) row[j] = 0.0f;
      }
      gemm(false, false, i1 - i0, hd, keys, 1.0f, Pi, Tk, vb, v.ld, 0.0f, ob + i0 * d, d);
    }
  }
}

void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                        const float* out, const float* probs, AttnOperand q, AttnOperand k,
                        AttnOperand v, AttnShape s, float scale) {
  check_backward_views(q, k, v, s);
  SIGMA_CHECK(s.B == 1 || (dq.bs != 0 && dk.bs != 0 && dv.bs != 0),
              "attention_backward: gradient views need a batch stride (they are accumulated)");
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
#pragma omp parallel
  {
    std::vector<float> dS(static_cast<size_t>(kRowBlock * Tk));
#pragma omp for schedule(dynamic)  // as flash_attention_backward
    for (int64_t bh = 0; bh < s.B * s.H; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H;
      const float* qb = q.p + b * q.bs + h * hd;
      const float* kb = k.p + b * k.bs + h * hd;
      const float* vb = v.p + b * v.bs + h * hd;
      float* dqb = dq.p + b * dq.bs + h * hd;
      float* dkb = dk.p + b * dk.bs + h * hd;
      float* dvb = dv.p + b * dv.bs + h * hd;
      const float* P = probs + bh * Tq * Tk;
      const float* dob = dout + b * Tq * d + h * hd;
      const float* ob = out + b * Tq * d + h * hd;
      for (int64_t i0 = 0; i0 < Tq; i0 += kRowBlock) {
        const int64_t i1 = std::min(Tq, i0 + kRowBlock), m = i1 - i0, keys = off + i1;
        const float* Pi = P + i0 * Tk;
        // dP = dO V^T, then dS = scale * P * (dP - <dO_i, O_i>)
        gemm(false, true, m, keys, hd, 1.0f, dob + i0 * d, d, vb, v.ld, 0.0f, dS.data(), Tk);
        for (int64_t i = i0; i < i1; ++i) {
          const float* doi = dob + i * d;
          const float* oi = ob + i * d;
          float dot = 0.0f;
          for (int64_t c = 0; c < hd; ++c) dot += doi[c] * oi[c];
          float* row = dS.data() + (i - i0) * Tk;
          const float* prow = P + i * Tk;
          const int64_t n = off + i + 1;
          for (int64_t j = 0; j < n; ++j) row[j] = scale * prow[j] * (row[j] - dot);
          for (int64_t j = n; j < keys; ++j) row[j] = 0.0f;
        }
        gemm(false, false, m, hd, keys, 1.0f, dS.data(), Tk, kb, k.ld, 1.0f, dqb + i0 * dq.ld,
             dq.ld);
        gemm(true, false, keys, hd, m, 1.0f, dS.data(), Tk, qb + i0 * q.ld, q.ld, 1.0f, dkb, dk.ld);
        gemm(true, false, keys, hd, m, 1.0f, Pi, Tk, dob + i0 * d, d, 1.0f, dvb, dv.ld);
      }
    }
  }
}

namespace {
// A key's or value's element: fp32, or bf16 (a bf16 KV cache) widened exactly.
inline float kv_at(const float* p, int64_t i) { return p[i]; }
inline float kv_at(const uint16_t* p, int64_t i) { return from_bf16(p[i]); }

// <q, k> over hd elements in an order written out: 16 lane sums (element c into lane c % 16),
// then a fixed tree. An `omp simd` reduction leaves the order to the compiler, which chose
// differently for fp32 and bf16 keys on Zen 5 (-march=znver5), so a bf16 cache no longer gave
// the bits of its widened values (Attention.Bf16CacheGivesTheBitsOfItsWidenedValues, hd = 4).
template <class E>
inline float dot_fixed_order(const float* q, const E* k, int64_t hd) {
  float lane[16] = {};
  int64_t c = 0;
  for (; c + 16 <= hd; c += 16)
    for (int l = 0; l < 16; ++l) lane[l] += q[c + l] * kv_at(k, c + l);
  for (int l = 0; c + l < hd; ++l) lane[l] += q[c + l] * kv_at(k, c + l);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define SIGMA_ATTN_ROWS8 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// AVX2 and AVX-512 builds (hd a multiple of 8, at most 64): a query row's scores 8 keys at a
// time and its output with the hd / 8 column blocks in registers. Key j's dot product is one sum
// in one order wherever j falls (8 lanes over c, then lane i + i+4, i + i+2, i + i+1), and each
// output column the same fma chain over j as the plain loop, so a row's bits depend on its own
// keys only, as there. AVX-512 builds ran the plain loops until issue 40: a 64-wide dot product
// reduced across lanes for every key made a decode token's attention ~22 % of its time on Zen 5
// (int8 weights, one thread; bench/decode_breakdown.sh).
constexpr int64_t kMaxAvx2Hd = 64;

// With vb (a row's first pass over its keys: a decode step's only one), the values of each 8
// keys are prefetched into L1 as the keys are read, and the keys 16 ahead: a head's keys and
// values are two short streams from memory (the weights of a token pass through the caches
// between two steps), which the hardware prefetcher starts late. The attention jobs of a
// decode at d = 512 ran 10-30 % faster with bf16 and int8 weights (bf16 cache), fp32 no faster
// (Zen 3, 3 alternating pairs; issue 40).
template <class E>
void row_scores_avx2(float* S, const float* qi, const E* kb, int64_t ldk, int64_t n,
                     int64_t hd, float scale, const E* vb = nullptr, int64_t ldv = 0) {
  const int64_t row_bytes = hd * int64_t(sizeof(E));
  __m256 qv[kMaxAvx2Hd / 8];
  const int64_t nc = hd / 8;
  for (int64_t c = 0; c < nc; ++c) qv[c] = _mm256_loadu_ps(qi + 8 * c);
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < n; j += 8) {
    if (vb)
      for (int64_t t = j; t < std::min(n, j + 8); ++t)
        for (int64_t b = 0; b < row_bytes; b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(vb + t * ldv) + b, _MM_HINT_T0);
          if (t + 16 < n) _mm_prefetch(reinterpret_cast<const char*>(kb + (t + 16) * ldk) + b, _MM_HINT_T0);
        }
    __m256 a[8];
    for (int64_t t = 0; t < 8; ++t) {
      const E* kj = kb + std::min(j + t, n - 1) * ldk;  // past n: a repeat, not stored
      __m256 acc = _mm256_mul_ps(qv[0], load8(kj));
      for (int64_t c = 1; c < nc; ++c) acc = _mm256_fmadd_ps(qv[c], load8(kj + 8 * c), acc);
      a[t] = acc;
    }
    __m256 u[4];
    for (int t = 0; t < 4; ++t)  // [key 2t: lane i + lane i+4 | key 2t+1: the same]
      u[t] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * t], a[2 * t + 1], 0x20),
                           _mm256_permute2f128_ps(a[2 * t], a[2 * t + 1], 0x31));
    const __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
    const __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xEE));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x88), _mm256_shuffle_ps(w0, w1, 0xDD));
    const __m256 dots = _mm256_mul_ps(sc, _mm256_permutevar8x32_ps(r, order));  // keys j..j+7
    if (j + 8 <= n) {
      _mm256_storeu_ps(S + j, dots);
    } else {  // a masked store: a copy of the 1-7 tail lanes was a memmove call a query row
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      _mm256_maskstore_ps(S + j, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lanes), dots);
    }
  }
}

template <class E>
void row_output_avx2(float* o, const float* S, const E* vb, int64_t ldv, int64_t n, int64_t hd) {
  __m256 acc[kMaxAvx2Hd / 8];
  const int64_t nc = hd / 8;
  for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p = _mm256_set1_ps(S[j]);
    const E* vj = vb + j * ldv;
    for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vj + 8 * c), acc[c]);
  }
  for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// Two consecutive query rows (n and n + 1 keys) at once: each column's chain over j is
// row_output_avx2's, so the bits are its; the second row's chains hide the first's fma latency
// (with hd = 32 one row's four chains left the fma units idle half the time) and share V's loads.
template <class E>
void row_output2_avx2(float* o0, const float* S0, float* o1, const float* S1, const E* vb,
                      int64_t ldv, int64_t n, int64_t hd) {
  __m256 a0[kMaxAvx2Hd / 8], a1[kMaxAvx2Hd / 8];
  const int64_t nc = hd / 8;
  for (int64_t c = 0; c < nc; ++c) a0[c] = a1[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p0 = _mm256_set1_ps(S0[j]), p1 = _mm256_set1_ps(S1[j]);
    const E* vj = vb + j * ldv;
    for (int64_t c = 0; c < nc; ++c) {
      const __m256 vc = load8(vj + 8 * c);
      a0[c] = _mm256_fmadd_ps(p0, vc, a0[c]);
      a1[c] = _mm256_fmadd_ps(p1, vc, a1[c]);
    }
  }
  const __m256 p1 = _mm256_set1_ps(S1[n]);
  for (int64_t c = 0; c < nc; ++c) {
    _mm256_storeu_ps(o0 + 8 * c, a0[c]);
    _mm256_storeu_ps(o1 + 8 * c, _mm256_fmadd_ps(p1, load8(vb + n * ldv + 8 * c), a1[c]));
  }
}
#endif

// Scores of query rows [i0, i1) of one (b, h) over the keys they see, into S (row stride ld):
// S = scale * q k^T; entries past a row's last key are left for the caller.
void block_scores(float* S, int64_t ld, const float* qb, int64_t ldq, const float* kb,
                  int64_t ldk, int64_t i0, int64_t i1, int64_t off, int64_t hd, float scale) {
  gemm(false, true, i1 - i0, off + i1, hd, scale, qb + i0 * ldq, ldq, kb, ldk, 0.0f, S, ld);
}

// The same attention for little work (a decode step: one query a row, a few hundred keys) on
// the calling thread, without oneDNN: a product of one row is a GEMV, which oneDNN would run
// in a parallel region of its own (woken threads, and new ones when nested). Each query row is
// computed alone, in an order fixed by its own keys: inside ops::BatchInvariant every shape
// runs here (threads over (b, h) pairs when the work is worth them).
//
// A decode step's (b, h) pairs go to the spin team (kernels/cpu/spin_team.h) once they read
// enough of the KV cache: at d = 512 and a few hundred cached positions the cache is megabytes
// a token, more than one core streams in the time the GEMVs leave (issue 27). Each pair is
// computed the same way on any thread, so the bits do not change.
constexpr int64_t kSpinCacheBytes = int64_t(1) << 18;

// K: AttnOperand, or AttnOperand16 (bf16 keys and values, widened where read).
template <class K>
void attention_rows_forward(float* out, float* lse, AttnOperand q, K k, K v, AttnShape s,
                            float scale, bool threads) {
  using E = std::remove_cv_t<std::remove_pointer_t<decltype(k.p)>>;
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
  auto pair = [&](int64_t bh) {
    thread_local std::vector<float> scores;
    if (scores.size() < size_t(2 * Tk)) scores.resize(size_t(2 * Tk));
    float* S = scores.data();
    const int64_t b = bh / s.H, h = bh % s.H;
    const float* qb = q.head(b, h, hd);
    const E* kb = k.head(b, h, hd);
    const E* vb = v.head(b, h, hd);
#if defined(SIGMA_ATTN_ROWS8)
    if (hd % 8 == 0 && hd <= kMaxAvx2Hd) {
      float* S1 = scores.data() + Tk;  // the second row's probabilities
      auto probabilities = [&](float* P, int64_t i) {  // row i's, into P; returns its keys
        const int64_t n = off + i + 1;
        row_scores_avx2(P, qb + i * q.ld, kb, k.ld, n, hd, scale, i == 0 ? vb : nullptr, v.ld);
        const float mx = max_of(P, n), sum = exp_shift_sum(P, n, mx);
        lse[bh * Tq + i] = mx + std::log(sum);
        scale_into(P, P, n, 1.0f / sum);
        return n;
      };
      int64_t i = 0;
      for (; i + 2 <= Tq; i += 2) {
        const int64_t n = probabilities(S, i);
        probabilities(S1, i + 1);
        row_output2_avx2(out + (b * Tq + i) * d + h * hd, S, out + (b * Tq + i + 1) * d + h * hd,
                         S1, vb, v.ld, n, hd);
      }
      if (i < Tq) row_output_avx2(out + (b * Tq + i) * d + h * hd, S, vb, v.ld, probabilities(S, i), hd);
      return;
    }
#endif
    for (int64_t i = 0; i < Tq; ++i) {
      const float* qi = qb + i * q.ld;
      const int64_t n = off + i + 1;  // keys this row sees
      for (int64_t j = 0; j < n; ++j) S[j] = scale * dot_fixed_order(qi, kb + j * k.ld, hd);
      const float mx = max_of(S, n), sum = exp_shift_sum(S, n, mx);
      lse[bh * Tq + i] = mx + std::log(sum);
      scale_into(S, S, n, 1.0f / sum);
      float* o = out + (b * Tq + i) * d + h * hd;
      int64_t c0 = 0;
#if defined(__AVX512F__)
      // 16 columns at a time in a register (the same fused multiply-adds, in the same order
      // over j, as the loop below; without the store and reload of o each step).
      for (; c0 + 16 <= hd; c0 += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(S[j]), load16(vb + j * v.ld + c0), acc);
        _mm512_storeu_ps(o + c0, acc);
      }
#endif
      std::fill(o + c0, o + hd, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const E* vj = vb + j * v.ld;
        const float p = S[j];
#pragma omp simd
        for (int64_t c = c0; c < hd; ++c) o[c] += p * kv_at(vj, c);
      }
    }
  };
  const int64_t pairs = s.B * s.H;
  if (threads) {
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < pairs; ++bh) pair(bh);
  } else if (ops::FewRowKernels::on() && 2 * pairs * Tk * hd * int64_t(sizeof(float)) >= kSpinCacheBytes) {
    for_each_item(pairs, pair);
  } else {
    for (int64_t bh = 0; bh < pairs; ++bh) pair(bh);
  }
}
}  // namespace

namespace {
// A head's first n keys (or values) as fp32 rows of ld hd: the operand itself, or, for bf16
// ones, widened (exact) into `scratch`.
const float* head_rows(AttnOperand k, int64_t b, int64_t h, int64_t, int64_t hd, std::vector<float>&,
                       int64_t& ld) {
  ld = k.ld;
  return k.head(b, h, hd);
}
const float* head_rows(AttnOperand16 k, int64_t b, int64_t h, int64_t n, int64_t hd,
                       std::vector<float>& scratch, int64_t& ld) {
  scratch.resize(size_t(n * hd));
  const uint16_t* src = k.head(b, h, hd);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < hd; ++c) scratch[size_t(j * hd + c)] = from_bf16(src[j * k.ld + c]);
  ld = hd;
  return scratch.data();
}

// K: AttnOperand, or AttnOperand16 (each row block's keys and values widened first).
template <class K>
void flash_forward(float* out, float* lse, AttnOperand q, K k, K v, AttnShape s, float scale) {
  check_shape(s);
  if (!worth_threads(s)) return attention_rows_forward(out, lse, q, k, v, s, scale, false);
  if (ops::BatchInvariant::on()) return attention_rows_forward(out, lse, q, k, v, s, scale, true);
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
  const int64_t blocks = (Tq + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    std::vector<float> S(static_cast<size_t>(kRowBlock * Tk)), kw, vw;
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < s.B * s.H * blocks; ++task) {
      const int64_t bh = task / blocks, b = bh / s.H, h = bh % s.H;
      const int64_t i0 = (task % blocks) * kRowBlock, i1 = std::min(Tq, i0 + kRowBlock);
      int64_t ldk, ldv;
      const float* kb = head_rows(k, b, h, off + i1, hd, kw, ldk);
      const float* vb = head_rows(v, b, h, off + i1, hd, vw, ldv);
      block_scores(S.data(), Tk, q.head(b, h, hd), q.ld, kb, ldk, i0, i1, off, hd, scale);
      for (int64_t i = i0; i < i1; ++i) {
        float* row = S.data() + (i - i0) * Tk;
        const int64_t n = off + i + 1, keys = off + i1;
        const float mx = max_of(row, n), sum = exp_shift_sum(row, n, mx);
        scale_into(row, row, n, 1.0f / sum);
        for (int64_t j = n; j < keys; ++j) row[j] = 0.0f;
        lse[bh * Tq + i] = mx + std::log(sum);
      }
      gemm(false, false, i1 - i0, hd, off + i1, 1.0f, S.data(), Tk, vb, ldv, 0.0f,
           out + (b * Tq + i0) * d + h * hd, d);
    }
  }
}
}  // namespace

void flash_attention_forward(float* out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                             AttnShape s, float scale) {
  flash_forward(out, lse, q, k, v, s, scale);
}

void attention_forward_kv16(float* out, float* lse, AttnOperand q, AttnOperand16 k,
                            AttnOperand16 v, AttnShape s, float scale) {
  flash_forward(out, lse, q, k, v, s, scale);
}

void flash_attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                              const float* out, const float* lse, AttnOperand q, AttnOperand k,
                              AttnOperand v, AttnShape s, float scale) {
  check_backward_views(q, k, v, s);
  SIGMA_CHECK(s.B == 1 || (dq.bs != 0 && dk.bs != 0 && dv.bs != 0),
              "flash_attention_backward: gradient views need a batch stride (they are accumulated)");
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
#pragma omp parallel
  {
    std::vector<float> P(static_cast<size_t>(kRowBlock * Tk)), dS(P.size());
    // dynamic: (b, h) pairs cost alike, but a VM's two vCPUs need not run at one speed (Zen 5:
    // a one-thread product ran 333 and 378 GFLOP/s on its two); any thread gives the same bits.
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < s.B * s.H; ++bh) {  // dk, dv of one (b, h): one thread's
      const int64_t b = bh / s.H, h = bh % s.H;
      const float* qb = q.p + b * q.bs + h * hd;
      const float* kb = k.p + b * k.bs + h * hd;
      const float* vb = v.p + b * v.bs + h * hd;
      const float* dob = dout + b * Tq * d + h * hd;
      const float* ob = out + b * Tq * d + h * hd;
      for (int64_t i0 = 0; i0 < Tq; i0 += kRowBlock) {
        const int64_t i1 = std::min(Tq, i0 + kRowBlock), m = i1 - i0, keys = off + i1;
        block_scores(P.data(), Tk, qb, q.ld, kb, k.ld, i0, i1, off, hd, scale);
        gemm(false, true, m, keys, hd, 1.0f, dob + i0 * d, d, vb, v.ld, 0.0f, dS.data(), Tk);
        for (int64_t i = i0; i < i1; ++i) {
          float* p = P.data() + (i - i0) * Tk;
          float* ds = dS.data() + (i - i0) * Tk;
          const int64_t n = off + i + 1;
          exp_shift_sum(p, n, lse[bh * Tq + i]);  // the probabilities, from the saved lse
          float dot = 0.0f;
          for (int64_t c = 0; c < hd; ++c) dot += dob[i * d + c] * ob[i * d + c];
          for (int64_t j = 0; j < n; ++j) ds[j] = scale * p[j] * (ds[j] - dot);
          for (int64_t j = n; j < keys; ++j) p[j] = ds[j] = 0.0f;
        }
        gemm(false, false, m, hd, keys, 1.0f, dS.data(), Tk, kb, k.ld, 1.0f,
             dq.p + b * dq.bs + h * hd + i0 * dq.ld, dq.ld);
        gemm(true, false, keys, hd, m, 1.0f, dS.data(), Tk, qb + i0 * q.ld, q.ld, 1.0f,
             dk.p + b * dk.bs + h * hd, dk.ld);
        gemm(true, false, keys, hd, m, 1.0f, P.data(), Tk, dob + i0 * d, d, 1.0f,
             dv.p + b * dv.bs + h * hd, dv.ld);
      }
    }
  }
}

}  // namespace sigma::cpu

// ---- bf16 products (train.precision = bf16) ----
namespace sigma::cpu {

namespace {
// An attention operand converted to bf16, head-major: head h of batch b is the dense matrix
// [rows, hd] at p + (b * H + h) * hs (b = 0 only when the operand is shared, bs = 0). Dense
// per-head operands let oneDNN run its brgemm kernels.
struct Bf16Operand {
  const uint16_t* p;
  int64_t hs, shared;
  Bf16View head(int64_t b, int64_t h, int64_t H, int64_t hd) const {
    return {p + ((shared ? 0 : b) * H + h) * hs, hd};
  }
};

// Converted operands live in the calling thread's buffers (read by every thread of the call);
// the per-block score and probability tiles in each worker's own. Kept between calls: a fresh
// allocation of this size costs page faults every call.
struct AttnBf16Scratch {
  std::vector<uint16_t> q, k, v, dout;    // operands (calling thread)
  std::vector<float> S, dS;              // [kRowBlock, keys] fp32 tiles (worker)
  std::vector<uint16_t> Pb, dSb;         // their bf16 roundings (worker)
};
thread_local AttnBf16Scratch t_attn;

Bf16Operand convert(AttnOperand x, int64_t B, int64_t rows, int64_t H, int64_t hd,
                    std::vector<uint16_t>& buf) {
  const int64_t bs = x.bs;
  const int64_t nb = bs == 0 ? 1 : B;
  grow(buf, size_t(nb * H * rows * hd));
#pragma omp parallel for collapse(2) schedule(static) if (nb * H * rows * hd > kParallelFloats)
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < rows; ++r)
        row_to_bf16(buf.data() + ((b * H + h) * rows + r) * hd, x.head(b, h, hd) + r * x.ld, hd);
  return {buf.data(), rows * hd, bs == 0};
}

void ensure_tiles(AttnBf16Scratch& t, int64_t Tk) {
  const size_t n = size_t(kRowBlock * Tk);
  if (t.S.size() < n) t.S.resize(n), t.dS.resize(n), t.Pb.resize(n), t.dSb.resize(n);
}

// The softmax rows of the bf16 pair, each in one pass that rounds straight to bf16: the same
// fp32 values (exp16 on whole vectors, std::exp on the tail, as exp_shift_sum) and the same
// bits as computing the fp32 row and then converting it, without the fp32 row's store and
// reload.

// dst[j] = bf16(p[j] * s): scale_into then row_to_bf16.
void scaled_row_to_bf16(uint16_t* dst, const float* p, int64_t n, float s) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        bf16x16(_mm512_mul_ps(_mm512_loadu_ps(p + j), sv)));
#endif
  for (; j < n; ++j) dst[j] = sigma::to_bf16(p[j] * s);
}

// The backward's row: p = exp(S - lse) and ds = scale * p * (dP - dot), both to bf16.
void p_ds_row_to_bf16(uint16_t* pb, uint16_t* dsb, const float* S, const float* dP, int64_t n,
                      float lse, float dot, float scale) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 l = _mm512_set1_ps(lse), dv = _mm512_set1_ps(dot), sc = _mm512_set1_ps(scale);
  for (; j + 16 <= n; j += 16) {
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(S + j), l));
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(sc, p), _mm512_sub_ps(_mm512_loadu_ps(dP + j), dv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + j), bf16x16(p));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsb + j), bf16x16(ds));
  }
#endif
  for (; j < n; ++j) {
    const float p = std::exp(S[j] - lse);
    pb[j] = sigma::to_bf16(p);
    dsb[j] = sigma::to_bf16(scale * p * (dP[j] - dot));
  }
}

// S = scale * q k^T for query rows [i0, i1) of one (b, h), over the keys they see.
void block_scores_bf16(float* S, int64_t ld, Bf16View q, Bf16View k, int64_t i0, int64_t i1,
                       int64_t off, int64_t hd, float scale) {
  matmul_bf16(false, true, i1 - i0, off + i1, hd, scale, {q.p + i0 * q.ld, q.ld}, k, 0.0f, S, ld);
}
}  // namespace

// The same blocks as flash_attention_forward; the two products read bf16 operands (q, k, v
// converted once per call, the probabilities per row after the fp32 softmax).
void flash_attention_forward_bf16(float* out, float* lse, AttnOperand q, AttnOperand k,
                                  AttnOperand v, AttnShape s, float scale) {
  check_shape(s);
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, H = s.H, hd = s.hd, d = H * hd;
  const int64_t blocks = (Tq + kRowBlock - 1) / kRowBlock;
  AttnBf16Scratch& own = t_attn;
  const Bf16Operand qb = convert(q, s.B, Tq, H, hd, own.q),
                    kb = convert(k, s.B, Tk, H, hd, own.k),
                    vb = convert(v, s.B, Tk, H, hd, own.v);
#pragma omp parallel
  {
    AttnBf16Scratch& t = t_attn;
    ensure_tiles(t, Tk);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < s.B * H * blocks; ++task) {
      const int64_t bh = task / blocks, b = bh / H, h = bh % H;
      const int64_t i0 = (task % blocks) * kRowBlock, i1 = std::min(Tq, i0 + kRowBlock);
      const int64_t keys = off + i1;  // the tiles' row stride
      block_scores_bf16(t.S.data(), keys, qb.head(b, h, H, hd), kb.head(b, h, H, hd), i0, i1,
                        off, hd, scale);
      for (int64_t i = i0; i < i1; ++i) {
        float* row = t.S.data() + (i - i0) * keys;
        uint16_t* prow = t.Pb.data() + (i - i0) * keys;
        const int64_t n = off + i + 1;
        const float mx = max_of(row, n), sum = exp_shift_sum(row, n, mx);
        scaled_row_to_bf16(prow, row, n, 1.0f / sum);
        std::fill(prow + n, prow + keys, uint16_t(0));
        lse[bh * Tq + i] = mx + std::log(sum);
      }
      matmul_bf16(false, false, i1 - i0, hd, keys, 1.0f, {t.Pb.data(), keys},
                  vb.head(b, h, H, hd), 0.0f, out + (b * Tq + i0) * d + h * hd, d);
    }
  }
}

// As flash_attention_backward: P from the saved lse, dS = scale * P * (dP - <dO_i, O_i>) in
// fp32; the five products read bf16 (q, k, v, dO converted once per call; P and dS per row).
void flash_attention_backward_bf16(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                                   const float* out, const float* lse, AttnOperand q,
                                   AttnOperand k, AttnOperand v, AttnShape s, float scale) {
  check_backward_views(q, k, v, s);
  SIGMA_CHECK(s.B == 1 || (dq.bs != 0 && dk.bs != 0 && dv.bs != 0),
              "flash_attention_backward: gradient views need a batch stride (they are accumulated)");
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, H = s.H, hd = s.hd, d = H * hd;
  AttnBf16Scratch& own = t_attn;
  const Bf16Operand qb = convert(q, s.B, Tq, H, hd, own.q),
                    kb = convert(k, s.B, Tk, H, hd, own.k),
                    vb = convert(v, s.B, Tk, H, hd, own.v),
                    dob = convert({dout, d, Tq * d}, s.B, Tq, H, hd, own.dout);
#pragma omp parallel
  {
    AttnBf16Scratch& t = t_attn;
    ensure_tiles(t, Tk);
#pragma omp for schedule(dynamic)  // as flash_attention_backward
    for (int64_t bh = 0; bh < s.B * H; ++bh) {  // dk, dv of one (b, h): one thread's
      const int64_t b = bh / H, h = bh % H;
      const Bf16View qh = qb.head(b, h, H, hd), kh = kb.head(b, h, H, hd),
                     vh = vb.head(b, h, H, hd), doh = dob.head(b, h, H, hd);
      const float* dof = dout + b * Tq * d + h * hd;
      const float* of = out + b * Tq * d + h * hd;
      for (int64_t i0 = 0; i0 < Tq; i0 += kRowBlock) {
        const int64_t i1 = std::min(Tq, i0 + kRowBlock), m = i1 - i0, keys = off + i1;
        block_scores_bf16(t.S.data(), keys, qh, kh, i0, i1, off, hd, scale);
        matmul_bf16(false, true, m, keys, hd, 1.0f, {doh.p + i0 * hd, hd}, vh, 0.0f,
                    t.dS.data(), keys);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t n = off + i + 1;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < hd; ++c) dot += dof[i * d + c] * of[i * d + c];
          uint16_t* pb = t.Pb.data() + (i - i0) * keys;
          uint16_t* dsb = t.dSb.data() + (i - i0) * keys;
          // the probabilities from the saved lse, and dS
          p_ds_row_to_bf16(pb, dsb, t.S.data() + (i - i0) * keys, t.dS.data() + (i - i0) * keys,
                           n, lse[bh * Tq + i], dot, scale);
          std::fill(pb + n, pb + keys, uint16_t(0));
          std::fill(dsb + n, dsb + keys, uint16_t(0));
        }
        matmul_bf16(false, false, m, hd, keys, 1.0f, {t.dSb.data(), keys}, kh, 1.0f,
                    dq.p + b * dq.bs + h * hd + i0 * dq.ld, dq.ld);
        matmul_bf16(true, false, keys, hd, m, 1.0f, {t.dSb.data(), keys}, {qh.p + i0 * hd, hd},
                    1.0f, dk.p + b * dk.bs + h * hd, dk.ld);
        matmul_bf16(true, false, keys, hd, m, 1.0f, {t.Pb.data(), keys}, {doh.p + i0 * hd, hd},
                    1.0f, dv.p + b * dv.bs + h * hd, dv.ld);
      }
    }
  }
}

}  // namespace sigma::cpu
