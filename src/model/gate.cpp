#include "model/gate.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/parallel.h"
#include "kernels/ops.h"
#include "model/ffn.h"

namespace sigma {

namespace {

using cpu::kParallelFloats;  // row copies: only a large batch is worth an OpenMP region

// Calls fn(r0, n, g) for each run of consecutive rows of one group (a batch row is one run).
template <class Fn>
void for_each_group_run(const int32_t* row_group, int64_t N, Fn&& fn) {
  for (int64_t r0 = 0; r0 < N;) {
    int64_t r1 = r0 + 1;
    while (r1 < N && row_group[r1] == row_group[r0]) ++r1;
    fn(r0, r1 - r0, row_group[r0]);
    r0 = r1;
  }
}

// Calls fn(row, slot, j) for each kept (row, choice), j its row in the gathered buffers; rows
// in parallel (each call touches only its own row's outputs).
template <class Fn>
void for_each_kept(const GatePlan& p, int64_t N, int64_t d, Fn&& fn) {
#pragma omp parallel for schedule(static) if (N * d > kParallelFloats)
  for (int64_t r = 0; r < N; ++r)
    for (int slot = 0; slot < 2; ++slot)
      if (const int32_t j = p.pos[size_t(r) * 2 + slot]; j >= 0) fn(r, slot, int64_t(j));
}

}  // namespace

void gate_route(GatePlan& p, float* z, const float* x, const RreWeights& w,
                const std::vector<PV>& gate_w, const int32_t* row_group, int k,
                float capacity_factor, int64_t N, int64_t d) {
  const int G = int(gate_w.size()), E = w.experts();
  int Kmax = 1;
  for (int g = 0; g < G; ++g) Kmax = std::max(Kmax, w.offset[size_t(g) + 1] - w.offset[size_t(g)]);
  p.k = k;
  p.Kmax = Kmax;
  p.probs.assign(size_t(N) * Kmax, 0.0f);
  p.choice.assign(size_t(N) * 2, -1);
  p.gate.assign(size_t(N) * 2, 0.0f);
  p.pos.assign(size_t(N) * 2, -1);
  p.top1.assign(size_t(E), 0.0);
  p.group_rows.assign(size_t(G), 0);

  // Gate logits and softmax (fp32), per run of rows of one group.
  for_each_group_run(row_group, N, [&](int64_t r0, int64_t n, int g) {
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    ops::linear_forward(z + r0 * Kmax, x + r0 * d, gate_w[size_t(g)].v, nullptr, n, d, K, false,
                        {d, K, Kmax});
    p.group_rows[size_t(g)] += n;
  });
  for (int64_t r = 0; r < N; ++r) {
    const int g = row_group[r], K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    const float* zr = z + r * Kmax;
    float* pr = p.probs.data() + r * Kmax;
    const float mx = *std::max_element(zr, zr + K);
    float sum = 0;
    for (int e = 0; e < K; ++e) sum += pr[e] = std::exp(zr[e] - mx);
    for (int e = 0; e < K; ++e) pr[e] /= sum;
    // Top-k (ties: the lower index).
    int e1 = 0;
    for (int e = 1; e < K; ++e)
      if (pr[e] > pr[e1]) e1 = e;
    p.choice[size_t(r) * 2] = w.offset[size_t(g)] + e1;
    p.top1[size_t(w.offset[size_t(g)] + e1)] += 1;
    if (k == 1 || K == 1) {
      p.gate[size_t(r) * 2] = k == 1 ? pr[e1] : 1.0f;
      continue;
    }
    int e2 = e1 == 0 ? 1 : 0;
    for (int e = 0; e < K; ++e)
      if (e != e1 && pr[e] > pr[e2]) e2 = e;
    const float s = pr[e1] + pr[e2];
    p.choice[size_t(r) * 2 + 1] = w.offset[size_t(g)] + e2;
    p.gate[size_t(r) * 2] = pr[e1] / s;
    p.gate[size_t(r) * 2 + 1] = pr[e2] / s;
  }

  // Capacity: first choices in row order, then second choices.
  std::vector<int64_t> capacity(static_cast<size_t>(E), 0), taken(static_cast<size_t>(E), 0);
  for (int g = 0; g < G; ++g) {
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    const int64_t c = int64_t(std::ceil(double(capacity_factor) * std::min(k, K) *
                                        double(p.group_rows[size_t(g)]) / K));
    for (int e = w.offset[size_t(g)]; e < w.offset[size_t(g) + 1]; ++e) capacity[size_t(e)] = c;
  }
  p.dropped = 0;
  std::vector<uint8_t> keep(size_t(N) * 2, 0);
  for (int slot = 0; slot < 2; ++slot)
    for (int64_t r = 0; r < N; ++r) {
      const int e = p.choice[size_t(r) * 2 + slot];
      if (e < 0) continue;
      if (taken[size_t(e)] < capacity[size_t(e)]) {
        ++taken[size_t(e)];
        keep[size_t(r) * 2 + slot] = 1;
      } else {
        ++p.dropped;
      }
    }
  // Gathered layout: by expert, then slot, then row.
  p.start.assign(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) p.start[size_t(e) + 1] = p.start[size_t(e)] + taken[size_t(e)];
  p.assigned = p.start[size_t(E)];
  p.row_of.assign(size_t(p.assigned), 0);
  std::vector<int64_t> next(p.start.begin(), p.start.end() - 1);
  for (int slot = 0; slot < 2; ++slot)
    for (int64_t r = 0; r < N; ++r) {
      if (!keep[size_t(r) * 2 + slot]) continue;
      const int64_t j = next[size_t(p.choice[size_t(r) * 2 + slot])]++;
      p.pos[size_t(r) * 2 + slot] = int32_t(j);
      p.row_of[size_t(j)] = int32_t(r);
    }

  // Load-balancing loss.
  p.aux = 0;
  for (int g = 0; g < G; ++g) {
    const int64_t n = p.group_rows[size_t(g)];
    if (n == 0) continue;
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    std::vector<double> P(size_t(K), 0.0);
    for (int64_t r = 0; r < N; ++r)
      if (row_group[r] == g)
        for (int e = 0; e < K; ++e) P[size_t(e)] += p.probs[size_t(r) * Kmax + e];
    double s = 0;
    for (int e = 0; e < K; ++e) s += p.top1[size_t(w.offset[size_t(g)] + e)] / double(n) * P[size_t(e)] / double(n);
    p.aux += double(n) / double(N) * K * s;
  }

}

void gate_expert_plan(RrePlan& q, const GatePlan& p) { grouped_plan(q, p.start); }

void gate_gather(float* gx, const GatePlan& p, const float* x, int64_t d) {
  const int64_t A = p.assigned;
#pragma omp parallel for schedule(static) if (A * d > kParallelFloats)
  for (int64_t j = 0; j < A; ++j)
    std::memcpy(gx + j * d, x + int64_t(p.row_of[size_t(j)]) * d, size_t(d) * sizeof(float));
}

void gate_combine(float* y, const float* yg, const GatePlan& p, int64_t N, int64_t d) {
  for_each_kept(p, N, d, [&](int64_t r, int slot, int64_t j) {
    const float gv = p.gate[size_t(r) * 2 + slot];
    for (int64_t c = 0; c < d; ++c) y[r * d + c] += gv * yg[j * d + c];
  });
}

void gate_forward(float* y, float* yg, float* pre, float* act, float* gx, float* scratch,
                  float* z, GatePlan& p, const float* x, const RreWeights& w,
                  const std::vector<PV>& gate_w, const int32_t* row_group, int k,
                  float capacity_factor, int64_t N, int64_t d, int64_t f) {
  gate_route(p, z, x, w, gate_w, row_group, k, capacity_factor, N, d);
  RrePlan q;
  gate_expert_plan(q, p);
  const int64_t A = p.assigned;
  gate_gather(gx, p, x, d);
  std::fill(yg, yg + A * d, 0.0f);
  rre_forward(yg, pre, act, scratch, scratch + A * d, gx, w, q, whole_plan(q), A, d, f);
  gate_combine(y, yg, p, N, d);
}

void gate_expert_dy(float* gdy, std::vector<float>& dgate, const float* dy, const float* yg,
                    const GatePlan& p, int64_t N, int64_t d) {
  dgate.assign(size_t(N) * 2, 0.0f);
  for_each_kept(p, N, d, [&](int64_t r, int slot, int64_t j) {
    const float gv = p.gate[size_t(r) * 2 + slot];
    float acc = 0;
    for (int64_t c = 0; c < d; ++c) {
      gdy[j * d + c] = gv * dy[r * d + c];
      acc += dy[r * d + c] * yg[j * d + c];
    }
    dgate[size_t(r) * 2 + slot] = acc;
  });
}

void gate_backward_rest(float* dx, float* dz, const float* gdx, const std::vector<float>& dgate,
                        const float* x, const GatePlan& p, const RreWeights& w,
                        const std::vector<PV>& gate_w, const int32_t* row_group,
                        float aux_scale, int64_t N, int64_t d) {
  const int Kmax = p.Kmax;
  for_each_kept(p, N, d, [&](int64_t r, int, int64_t j) {
    for (int64_t c = 0; c < d; ++c) dx[r * d + c] += gdx[j * d + c];
  });
  // d(loss)/dp: the combine weights, plus aux_scale * K_g * f_e / N through P_e.
  std::fill(dz, dz + N * Kmax, 0.0f);
  for (int64_t r = 0; r < N; ++r) {
    const int g = row_group[r], o = w.offset[size_t(g)], K = w.offset[size_t(g) + 1] - o;
    const float* pr = p.probs.data() + r * Kmax;
    float* dp = dz + r * Kmax;  // dp first, turned into dz in place below
    const int e1 = p.choice[size_t(r) * 2] - o, e2 = p.choice[size_t(r) * 2 + 1];
    if (p.k == 1) {
      if (K > 1) dp[e1] += dgate[size_t(r) * 2];
    } else if (e2 >= 0) {
      const int b = e2 - o;
      const float s = pr[e1] + pr[b], s2 = s * s;
      const float d1 = dgate[size_t(r) * 2], d2 = dgate[size_t(r) * 2 + 1];
      dp[e1] += pr[b] / s2 * (d1 - d2);
      dp[b] += pr[e1] / s2 * (d2 - d1);
    }
    if (aux_scale != 0.0f)  // d aux / d p[r][e] = K * f_e / N = K * top1_e / (N * n_g)
      for (int e = 0; e < K; ++e)
        dp[e] += float(aux_scale * K * p.top1[size_t(o + e)] /
                       (double(N) * double(p.group_rows[size_t(g)])));
    float dot = 0;
    for (int e = 0; e < K; ++e) dot += pr[e] * dp[e];
    for (int e = 0; e < K; ++e) dp[e] = pr[e] * (dp[e] - dot);
  }
  for_each_group_run(row_group, N, [&](int64_t r0, int64_t n, int g) {
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    ops::linear_backward(dx + r0 * d, gate_w[size_t(g)].g, nullptr, dz + r0 * Kmax, x + r0 * d,
                         gate_w[size_t(g)].v, n, d, K, {d, K, Kmax});
  });
}

}  // namespace sigma
