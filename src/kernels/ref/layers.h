// ref: layernorm, FastGelu, softmax cross-entropy, embedding (see ref/io.h for the rules).
// The formulas are written in the order the cpu kernels evaluate them, so that the tests' error
// bound of this order bounds the cpu's rounding.
#pragma once
#include <map>
#include <vector>

#include "core/bf16.h"
#include "kernels/ref/io.h"

namespace sigma::ref {

// out = (x - mean) * rstd * w + b per row, mean and rstd saved; rstd = 1/sqrt(var + eps).
template <class T>
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C) {
  using std::sqrt;
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x + i * C;
    T s = 0;
    for (int64_t j = 0; j < C; ++j) s += T(xi[j]);
    const T m = s / T(C);
    T v = 0;
    for (int64_t j = 0; j < C; ++j) v += (T(xi[j]) - m) * (T(xi[j]) - m);
    const T r = T(1) / sqrt(v / T(C) + T(kLayerNormEps));
    for (int64_t j = 0; j < C; ++j) store<T>(out + i * C + j, (T(xi[j]) - m) * r * T(w[j]) + T(b[j]));
    store<T>(mean + i, m);
    store<T>(rstd + i, r);
  }
}

// With n = (x - mean) * rstd and g = dout * w (mean, rstd: the saved values):
//   dx += rstd * (g - mean_j(g) - n * mean_j(g n)),  dw += sum_i dout n,  db += sum_i dout.
template <class T>
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* mean, const float* rstd, const float* w, int64_t N,
                        int64_t C) {
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x + i * C;
    const float* di = dout + i * C;
    const T m = T(mean[i]), r = T(rstd[i]);
    T sum_g = 0, sum_gn = 0;
    for (int64_t j = 0; j < C; ++j) {
      const T g = T(di[j]) * T(w[j]);
      sum_g += g;
      sum_gn += g * ((T(xi[j]) - m) * r);
    }
    const T mg = sum_g / T(C), mgn = sum_gn / T(C);
    for (int64_t j = 0; j < C; ++j) {
      const T n = (T(xi[j]) - m) * r;
      store<T>(dx + i * C + j, T(dx[i * C + j]) + r * (T(di[j]) * T(w[j]) - mg - n * mgn));
    }
  }
  for (int64_t j = 0; j < C; ++j) {
    T sw = T(dw[j]), sb = T(db[j]);
    for (int64_t i = 0; i < N; ++i) {
      const T d = T(dout[i * C + j]);
      sw += d * (T(x[i * C + j]) - T(mean[i])) * T(rstd[i]);
      sb += d;
    }
    store<T>(dw + j, sw);
    store<T>(db + j, sb);
  }
}

constexpr float kGeluAlpha = 1.702f;  // FastGelu (PanGu-α): x * sigmoid(1.702 x)

template <class T>
T sigmoid_scaled(float x) {
  using std::exp;
  return T(1) / (T(1) + exp(T(-kGeluAlpha) * T(x)));
}

template <class T>
void fast_gelu_forward(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store<T>(y + i, T(x[i]) * sigmoid_scaled<T>(x[i]));
}

// dx = dy * (s + 1.702 x s (1 - s)), s = sigmoid(1.702 x); dx may be dy.
template <class T>
void fast_gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T s = sigmoid_scaled<T>(x[i]);
    const T d = T(dy[i]) * (s + T(kGeluAlpha) * T(x[i]) * s * (T(1) - s));
    store<T>(dx + i, d);
  }
}

// loss[i] = max + log(sum_j exp(l_j - max)) - l_target; with grad_scale, logits become
// (softmax - onehot) * grad_scale[i].
template <class T>
void softmax_xent(float* logits, float* loss, const int32_t* targets, const float* grad_scale,
                  int64_t N, int64_t V) {
  using std::exp;
  using std::log;
  std::vector<T> e{};
  e.resize(size_t(V));
  for (int64_t i = 0; i < N; ++i) {
    const float* row = logits + i * V;
    T mx = T(row[0]);
    for (int64_t j = 1; j < V; ++j)
      if (T(row[j]) > mx) mx = T(row[j]);
    T sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += (e[size_t(j)] = exp(T(row[j]) - mx));
    const T target = T(row[targets[i]]);
    store<T>(loss + i, mx + log(sum) - target);
    if (!grad_scale) continue;
    const T g = T(grad_scale[i]), f = g / sum;
    for (int64_t j = 0; j < V; ++j) {
      T d = e[size_t(j)] * f;
      if (j == targets[i]) d = d - g;
      store<T>(logits + i * V + j, d);
    }
  }
}

// Vocabulary-parallel cross-entropy in two parts (kernels/cpu/xent.h states them).
template <class T>
void xent_partial(float* stats, const float* logits, const int32_t* targets, int64_t v0,
                  int64_t N, int64_t V) {
  using std::exp;
  for (int64_t i = 0; i < N; ++i) {
    const float* row = logits + i * V;
    float mx = row[0];
    for (int64_t j = 1; j < V; ++j) mx = std::max(mx, row[j]);
    T sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += exp(T(row[j]) - T(mx));
    const int64_t t = int64_t(targets[i]) - v0;
    store<T>(stats + i * 3, T(mx));
    store<T>(stats + i * 3 + 1, sum);
    store<T>(stats + i * 3 + 2, T(t >= 0 && t < V ? row[t] : 0.0f));
  }
}
template <class T>
void xent_combine(float* logits, float* loss, const float* stats, const int32_t* targets,
                  const float* grad_scale, int64_t v0, int64_t P, int64_t N, int64_t V) {
  using std::exp;
  using std::log;
  for (int64_t i = 0; i < N; ++i) {
    float M = stats[i * 3];
    for (int64_t r = 1; r < P; ++r) M = std::max(M, stats[(r * N + i) * 3]);
    T S = 0, target = 0;
    for (int64_t r = 0; r < P; ++r) {
      S += T(stats[(r * N + i) * 3 + 1]) * exp(T(stats[(r * N + i) * 3]) - T(M));
      target += T(stats[(r * N + i) * 3 + 2]);
    }
    store<T>(loss + i, T(M) + log(S) - target);
    if (!grad_scale) continue;
    const T g = T(grad_scale[i]);
    for (int64_t j = 0; j < V; ++j) {
      T d = exp(T(logits[i * V + j]) - T(M)) * (g / S);
      if (j == int64_t(targets[i]) - v0) d = d - g;
      store<T>(logits + i * V + j, d);
    }
  }
}

// out[b,t,:] = table[rows[b*T+t], :] + pos[t, :]; a row < 0 reads as zeros, pos may be null.
template <class T>
void embedding_forward(float* out, const int32_t* rows, const float* table, const float* pos,
                       int64_t B, int64_t T_, int64_t d) {
  for (int64_t i = 0; i < B * T_; ++i)
    for (int64_t c = 0; c < d; ++c)
      store<T>(out + i * d + c, (rows[i] < 0 ? T(0) : T(table[int64_t(rows[i]) * d + c])) +
                                    (pos ? T(pos[(i % T_) * d + c]) : T(0)));
}

// The lookups on a bf16 table (widened exactly) and on an int8 table with a scale per row.
template <class T>
void embedding_forward_w16(float* out, const int32_t* rows, const uint16_t* table,
                           const float* pos, int64_t B, int64_t T_, int64_t d) {
  for (int64_t i = 0; i < B * T_; ++i)
    for (int64_t c = 0; c < d; ++c)
      store<T>(out + i * d + c,
               T(from_bf16(table[int64_t(rows[i]) * d + c])) + T(pos[(i % T_) * d + c]));
}
template <class T>
void embedding_forward_i8(float* out, const int32_t* rows, const int8_t* q, const float* scale,
                          const float* pos, int64_t B, int64_t T_, int64_t d) {
  for (int64_t i = 0; i < B * T_; ++i)
    for (int64_t c = 0; c < d; ++c)
      store<T>(out + i * d + c, T(scale[rows[i]]) * T(float(q[int64_t(rows[i]) * d + c])) +
                                    T(pos[(i % T_) * d + c]));
}

// dtable[rows[i]] += dout[i] (rows < 0 skipped); dpos[t] += sum_b dout[b,t].
template <class T>
void embedding_backward(float* dtable, float* dpos, const float* dout, const int32_t* rows,
                        int64_t B, int64_t T_, int64_t d) {
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t c = 0; c < d; ++c) {
      T s = T(dpos[t * d + c]);
      for (int64_t b = 0; b < B; ++b) s += T(dout[(b * T_ + t) * d + c]);
      store<T>(dpos + t * d + c, s);
    }
  std::map<int32_t, std::vector<T>> acc;  // the rows the batch touches, in row order
  for (int64_t i = 0; i < B * T_; ++i) {
    if (rows[i] < 0) continue;
    auto [it, fresh] = acc.try_emplace(rows[i]);
    if (fresh)
      for (int64_t c = 0; c < d; ++c) it->second.push_back(T(dtable[int64_t(rows[i]) * d + c]));
    for (int64_t c = 0; c < d; ++c) it->second[size_t(c)] += T(dout[i * d + c]);
  }
  for (auto& [r, s] : acc)
    for (int64_t c = 0; c < d; ++c) store<T>(dtable + int64_t(r) * d + c, s[size_t(c)]);
}

}  // namespace sigma::ref
