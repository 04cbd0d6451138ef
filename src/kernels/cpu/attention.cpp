#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vexp.h"

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
    const float* qb = q.p + b * q.bs + h * hd;
    const float* kb = k.p + b * k.bs + h * hd;
    const float* vb = v.p + b * v.bs + h * hd;
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
  check_shape(s);
  SIGMA_CHECK(s.B == 1 || (dq.bs != 0 && dk.bs != 0 && dv.bs != 0),
              "attention_backward: gradient views need a batch stride (they are accumulated)");
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
#pragma omp parallel
  {
    std::vector<float> dS(static_cast<size_t>(kRowBlock * Tk));
#pragma omp for schedule(static)
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
// Scores of query rows [i0, i1) of one (b, h) over the keys they see, into S (row stride ld):
// S = scale * q k^T; entries past a row's last key are left for the caller.
void block_scores(float* S, int64_t ld, const float* qb, int64_t ldq, const float* kb,
                  int64_t ldk, int64_t i0, int64_t i1, int64_t off, int64_t hd, float scale) {
  gemm(false, true, i1 - i0, off + i1, hd, scale, qb + i0 * ldq, ldq, kb, ldk, 0.0f, S, ld);
}
}  // namespace

void flash_attention_forward(float* out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                             AttnShape s, float scale) {
  check_shape(s);
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
  const int64_t blocks = (Tq + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    std::vector<float> S(static_cast<size_t>(kRowBlock * Tk));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < s.B * s.H * blocks; ++task) {
      const int64_t bh = task / blocks, b = bh / s.H, h = bh % s.H;
      const int64_t i0 = (task % blocks) * kRowBlock, i1 = std::min(Tq, i0 + kRowBlock);
      const float* qb = q.p + b * q.bs + h * hd;
      block_scores(S.data(), Tk, qb, q.ld, k.p + b * k.bs + h * hd, k.ld, i0, i1, off, hd, scale);
      for (int64_t i = i0; i < i1; ++i) {
        float* row = S.data() + (i - i0) * Tk;
        const int64_t n = off + i + 1, keys = off + i1;
        const float mx = max_of(row, n), sum = exp_shift_sum(row, n, mx);
        scale_into(row, row, n, 1.0f / sum);
        for (int64_t j = n; j < keys; ++j) row[j] = 0.0f;
        lse[bh * Tq + i] = mx + std::log(sum);
      }
      gemm(false, false, i1 - i0, hd, off + i1, 1.0f, S.data(), Tk, v.p + b * v.bs + h * hd, v.ld,
           0.0f, out + (b * Tq + i0) * d + h * hd, d);
    }
  }
}

void flash_attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                              const float* out, const float* lse, AttnOperand q, AttnOperand k,
                              AttnOperand v, AttnShape s, float scale) {
  check_shape(s);
  SIGMA_CHECK(s.B == 1 || (dq.bs != 0 && dk.bs != 0 && dv.bs != 0),
              "flash_attention_backward: gradient views need a batch stride (they are accumulated)");
  const int64_t Tq = s.Tq, Tk = s.Tk, off = Tk - Tq, hd = s.hd, d = s.H * s.hd;
#pragma omp parallel
  {
    std::vector<float> P(static_cast<size_t>(kRowBlock * Tk)), dS(P.size());
#pragma omp for schedule(static)
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
