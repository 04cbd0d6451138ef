// ref: causal attention with a query offset (kernels/types.h, AttnShape), forward and backward
// (see ref/io.h for the rules). Query row i sits at position p = Tk - Tq + i and attends keys
// 0..p; probs are saved as [B,H,Tq,Tk], zero beyond p.
#pragma once
#include <algorithm>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "kernels/ref/io.h"

namespace sigma::ref {

// The bf16 variants read every product's input rounded to bf16: an fp32 input through
// round_bf16, a computed value (probabilities, dS) through bf16_rounded, which the op tests
// overload for their error-bound type (found by argument-dependent lookup).
inline double bf16_rounded(double x) { return round_bf16(float(x)); }
template <bool Bf16>
inline float attn_in(float x) {
  if constexpr (Bf16) return round_bf16(x);
  return x;
}
// A key's or value's element: fp32, or bf16 (a bf16 KV cache) widened.
inline float kv_in(float x) { return x; }
inline float kv_in(uint16_t h) { return from_bf16(h); }
template <bool Bf16, class T>
T attn_computed(const T& x) {
  if constexpr (Bf16) return bf16_rounded(x);
  return x;
}

inline void check_attention(const AttnShape& s) {
  SIGMA_CHECK(s.Tq >= 0 && s.Tq <= s.Tk && s.hd > 0 && s.H > 0,
              "attention: need 0 <= Tq <= Tk and H, hd > 0 (got B={} Tq={} Tk={} H={} hd={})",
              s.B, s.Tq, s.Tk, s.H, s.hd);
}

// out[b,i,h] = sum_j P[i,j] v[j,h],  P[i,:] = softmax_j<=p(scale * q[i,h] . k[j,h]); saves
// probs (attention_forward) or each row's lse = log sum_j<=p exp(scale q.k_j) (the flash
// variant), whichever pointer is not null.
template <class T, bool Bf16 = false, class KV = AttnOperand>
void attention_rows(float* out, float* probs, float* lse, AttnOperand q, KV k, KV v, AttnShape s,
                    float scale) {
  using std::exp;
  using std::log;
  check_attention(s);
  const int64_t Tq = s.Tq, Tk = s.Tk, hd = s.hd, d = s.H * hd, off = Tk - Tq;
  std::vector<T> S{};
  S.resize(size_t(Tk));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < Tq; ++i) {
        const float* qi = q.head(b, h, hd) + i * q.ld;
        const int64_t last = off + i;  // the last key this row sees
        T mx = 0;
        for (int64_t j = 0; j <= last; ++j) {
          const auto* kj = k.head(b, h, hd) + j * k.ld;
          T dot = 0;
          for (int64_t c = 0; c < hd; ++c) dot += T(attn_in<Bf16>(qi[c])) * T(attn_in<Bf16>(kv_in(kj[c])));
          S[size_t(j)] = T(scale) * dot;
          if (j == 0 || S[size_t(j)] > mx) mx = S[size_t(j)];
        }
        T z = 0;
        for (int64_t j = 0; j <= last; ++j) z += (S[size_t(j)] = exp(S[size_t(j)] - mx));
        const T inv = T(1) / z;
        for (int64_t j = 0; j <= last; ++j) S[size_t(j)] = S[size_t(j)] * inv;  // probabilities
        if (lse) store<T>(lse + (b * s.H + h) * Tq + i, mx + log(z));
        if (probs) {
          float* P = probs + ((b * s.H + h) * Tq + i) * Tk;
          for (int64_t j = 0; j <= last; ++j) store<T>(P + j, S[size_t(j)]);
          for (int64_t j = last + 1; j < Tk; ++j) store<T>(P + j, T(0));
        }
        for (int64_t c = 0; c < hd; ++c) {
          T o = 0;
          for (int64_t j = 0; j <= last; ++j)
            o += attn_computed<Bf16>(S[size_t(j)]) *
                 T(attn_in<Bf16>(kv_in(v.head(b, h, hd)[j * v.ld + c])));
          store<T>(out + (b * Tq + i) * d + h * hd + c, o);
        }
      }
}

template <class T>
void attention_forward(float* out, float* probs, AttnOperand q, AttnOperand k, AttnOperand v,
                       AttnShape s, float scale) {
  attention_rows<T>(out, probs, nullptr, q, k, v, s, scale);
}
template <class T>
void flash_attention_forward(float* out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                             AttnShape s, float scale) {
  attention_rows<T>(out, nullptr, lse, q, k, v, s, scale);
}
template <class T>
void attention_forward_kv16(float* out, float* lse, AttnOperand q, AttnOperand16 k, AttnOperand16 v,
                            AttnShape s, float scale) {
  attention_rows<T>(out, nullptr, lse, q, k, v, s, scale);
}
template <class T>
void flash_attention_forward_bf16(float* out, float* lse, AttnOperand q, AttnOperand k,
                                  AttnOperand v, AttnShape s, float scale) {
  attention_rows<T, true>(out, nullptr, lse, q, k, v, s, scale);
}

// With P the saved probs (or exp(scale q_i.k_j - lse_i) from the saved lse) and O the output:
//   dP = dO v^T,  dS = scale * P * (dP - <dO_i, O_i>),
//   dq += dS k,  dk += dS^T q,  dv += P^T dO   (accumulated).
// Gradient views must not alias across batches (bs != 0 when B > 1).
template <class T, bool Bf16 = false>
void attention_grads(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout, const float* out,
                     const float* probs, const float* lse, AttnOperand q, AttnOperand k,
                     AttnOperand v, AttnShape s, float scale) {
  using std::exp;
  check_attention(s);
  SIGMA_CHECK(s.B == 1 || (dq.bs != 0 && dk.bs != 0 && dv.bs != 0),
              "attention_backward: gradient views need a batch stride (they are accumulated)");
  const int64_t Tq = s.Tq, Tk = s.Tk, hd = s.hd, d = s.H * hd, off = Tk - Tq;
  std::vector<T> dS(size_t(Tq * Tk)), P(size_t(Tq * Tk)), gq(size_t(Tq * hd)),
      gk(size_t(Tk * hd)), gv(size_t(Tk * hd));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h) {
      auto at = [&](const AttnGrad& g, int64_t row, int64_t c) {
        return g.p + b * g.bs + row * g.ld + h * hd + c;
      };
      for (int64_t i = 0; i < Tq; ++i)  // the probabilities, saved or recomputed
        for (int64_t j = 0; j <= off + i; ++j) {
          if (probs) {
            P[size_t(i * Tk + j)] = T(probs[((b * s.H + h) * Tq + i) * Tk + j]);
            continue;
          }
          T dot = 0;
          for (int64_t c = 0; c < hd; ++c)
            dot += T(attn_in<Bf16>(q.head(b, h, hd)[i * q.ld + c])) *
                   T(attn_in<Bf16>(k.head(b, h, hd)[j * k.ld + c]));
          P[size_t(i * Tk + j)] = exp(T(scale) * dot - T(lse[(b * s.H + h) * Tq + i]));
        }
      for (int64_t i = 0; i < Tq; ++i) {
        const float* doi = dout + (b * Tq + i) * d + h * hd;
        const float* oi = out + (b * Tq + i) * d + h * hd;
        T dot = 0;
        for (int64_t c = 0; c < hd; ++c) dot += T(doi[c]) * T(oi[c]);
        for (int64_t j = 0; j < Tk; ++j) {
          T ds = 0;
          if (j <= off + i) {
            T dp = 0;
            for (int64_t c = 0; c < hd; ++c)
              dp += T(attn_in<Bf16>(doi[c])) *
                    T(attn_in<Bf16>(v.head(b, h, hd)[j * v.ld + c]));
            ds = T(scale) * P[size_t(i * Tk + j)] * (dp - dot);
          }
          dS[size_t(i * Tk + j)] = ds;
        }
      }
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t c = 0; c < hd; ++c) {
          T a = T(*at(dq, i, c));
          for (int64_t j = 0; j <= off + i; ++j)
            a += attn_computed<Bf16>(dS[size_t(i * Tk + j)]) *
                 T(attn_in<Bf16>(k.head(b, h, hd)[j * k.ld + c]));
          gq[size_t(i * hd + c)] = a;
        }
      for (int64_t j = 0; j < Tk; ++j)
        for (int64_t c = 0; c < hd; ++c) {
          T ak = T(*at(dk, j, c)), av = T(*at(dv, j, c));
          for (int64_t i = std::max<int64_t>(0, j - off); i < Tq; ++i) {
            ak += attn_computed<Bf16>(dS[size_t(i * Tk + j)]) *
                  T(attn_in<Bf16>(q.head(b, h, hd)[i * q.ld + c]));
            av += attn_computed<Bf16>(P[size_t(i * Tk + j)]) *
                  T(attn_in<Bf16>(dout[(b * Tq + i) * d + h * hd + c]));
          }
          gk[size_t(j * hd + c)] = ak;
          gv[size_t(j * hd + c)] = av;
        }
      for (int64_t i = 0; i < Tq; ++i)
        for (int64_t c = 0; c < hd; ++c) store<T>(at(dq, i, c), gq[size_t(i * hd + c)]);
      for (int64_t j = 0; j < Tk; ++j)
        for (int64_t c = 0; c < hd; ++c) {
          store<T>(at(dk, j, c), gk[size_t(j * hd + c)]);
          store<T>(at(dv, j, c), gv[size_t(j * hd + c)]);
        }
    }
}

template <class T>
void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                        const float* out, const float* probs, AttnOperand q, AttnOperand k,
                        AttnOperand v, AttnShape s, float scale) {
  attention_grads<T>(dq, dk, dv, dout, out, probs, nullptr, q, k, v, s, scale);
}
template <class T>
void flash_attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                              const float* out, const float* lse, AttnOperand q, AttnOperand k,
                              AttnOperand v, AttnShape s, float scale) {
  attention_grads<T>(dq, dk, dv, dout, out, nullptr, lse, q, k, v, s, scale);
}

template <class T>
void flash_attention_backward_bf16(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                                   const float* out, const float* lse, AttnOperand q,
                                   AttnOperand k, AttnOperand v, AttnShape s, float scale) {
  attention_grads<T, true>(dq, dk, dv, dout, out, nullptr, lse, q, k, v, s, scale);
}

}  // namespace sigma::ref
