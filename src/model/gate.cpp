#include "model/gate.h"

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"
#include "model/ffn.h"

namespace sigma {

namespace {

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

// A host plan into its device twin (int32), resized when needed.
void upload_i32(Tensor& dst, const std::vector<int32_t>& v, Shape shape) {
  if (dst.shape() != shape) dst = ops::empty(DType::I32, std::move(shape));
  ops::upload(dst, v.data(), v.size() * sizeof(int32_t));
}

void ensure_f32(Tensor& t, Shape shape) {
  if (t.shape() != shape) t = ops::empty(DType::F32, std::move(shape));
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
  p.top1.assign(size_t(E), 0.0);
  p.group_rows.assign(size_t(G), 0);

  // Each row's group as (width, first expert), for the ops.
  std::vector<int32_t> width(static_cast<size_t>(N)), base(static_cast<size_t>(N));
  for (int64_t r = 0; r < N; ++r) {
    const int g = row_group[r];
    base[size_t(r)] = w.offset[size_t(g)];
    width[size_t(r)] = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
  }
  upload_i32(p.width_d, width, {N});
  upload_i32(p.base_d, base, {N});
  ensure_f32(p.probs, {N, Kmax});
  ensure_f32(p.gate, {N, 2});
  if (p.choice_d.shape() != Shape{N, 2}) p.choice_d = ops::empty(DType::I32, {N, 2});

  // Gate logits, per run of rows of one group; then softmax and top-k (fp32), on the device.
  for_each_group_run(row_group, N, [&](int64_t r0, int64_t n, int g) {
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    ops::linear_forward(z + r0 * Kmax, x + r0 * d, gate_w[size_t(g)].v, nullptr, n, d, K, false,
                        {d, K, Kmax});
    p.group_rows[size_t(g)] += n;
  });
  ops::gate_softmax_topk(p.probs.dev_f(), p.choice_d.dev<int32_t>(), p.gate.dev_f(), z,
                         p.width_d.dev<int32_t>(), p.base_d.dev<int32_t>(), k, N, Kmax);
  // The host plans from the choices (and the loss from the probabilities): small downloads.
  p.choice.resize(size_t(N) * 2);
  ops::download(p.choice.data(), p.choice_d, p.choice.size() * sizeof(int32_t));
  for (int64_t r = 0; r < N; ++r) p.top1[size_t(p.choice[size_t(r) * 2])] += 1;

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
  p.pos.assign(size_t(N) * 2, -1);
  std::vector<int64_t> next(p.start.begin(), p.start.end() - 1);
  for (int slot = 0; slot < 2; ++slot)
    for (int64_t r = 0; r < N; ++r) {
      if (!keep[size_t(r) * 2 + slot]) continue;
      const int64_t j = next[size_t(p.choice[size_t(r) * 2 + slot])]++;
      p.pos[size_t(r) * 2 + slot] = int32_t(j);
      p.row_of[size_t(j)] = int32_t(r);
    }
  upload_i32(p.pos_d, p.pos, {N, 2});
  upload_i32(p.row_of_d, p.row_of, {p.assigned});

  // Load-balancing loss.
  std::vector<float> probs(size_t(N) * Kmax);
  ops::download(probs.data(), p.probs, probs.size() * sizeof(float));
  p.aux = 0;
  for (int g = 0; g < G; ++g) {
    const int64_t n = p.group_rows[size_t(g)];
    if (n == 0) continue;
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    std::vector<double> P(size_t(K), 0.0);
    for (int64_t r = 0; r < N; ++r)
      if (row_group[r] == g)
        for (int e = 0; e < K; ++e) P[size_t(e)] += probs[size_t(r) * Kmax + e];
    double s = 0;
    for (int e = 0; e < K; ++e) s += p.top1[size_t(w.offset[size_t(g)] + e)] / double(n) * P[size_t(e)] / double(n);
    p.aux += double(n) / double(N) * K * s;
  }
}

void gate_expert_plan(RrePlan& q, const GatePlan& p) { grouped_plan(q, p.start); }

void gate_gather(float* gx, const GatePlan& p, const float* x, int64_t d) {
  ops::gather_rows(gx, x, p.row_of_d.dev<int32_t>(), p.assigned, d);
}

void gate_combine(float* y, const float* yg, const GatePlan& p, int64_t N, int64_t d) {
  ops::gate_combine(y, yg, p.gate.dev_f(), p.pos_d.dev<int32_t>(), N, d);
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
  ops::fill(yg, 0.0f, A * d);
  rre_forward(yg, pre, act, scratch, scratch + A * d, gx, w, q, whole_plan(q), A, d, f);
  gate_combine(y, yg, p, N, d);
}

void gate_expert_dy(float* gdy, float* dgate, const float* dy, const float* yg,
                    const GatePlan& p, int64_t N, int64_t d) {
  ops::gate_expert_dy(gdy, dgate, dy, yg, p.gate.dev_f(), p.pos_d.dev<int32_t>(), N, d);
}

void gate_backward_rest(float* dx, float* dz, const float* gdx, const float* dgate,
                        const float* x, const GatePlan& p, const RreWeights& w,
                        const std::vector<PV>& gate_w, const int32_t* row_group,
                        float aux_scale, int64_t N, int64_t d) {
  const int Kmax = p.Kmax;
  // d aux / d p[r][e] = K * f_e / N = K * top1_e / (N * n_g): one coefficient per expert.
  if (aux_scale != 0.0f) {
    std::vector<float> aux(size_t(w.experts()), 0.0f);
    for (size_t g = 0; g < p.group_rows.size(); ++g) {
      const int o = w.offset[g], K = w.offset[g + 1] - o;
      for (int e = 0; e < K && p.group_rows[g] > 0; ++e)
        aux[size_t(o + e)] = float(aux_scale * K * p.top1[size_t(o + e)] /
                                   (double(N) * double(p.group_rows[g])));
    }
    ensure_f32(p.aux_d, {int64_t(aux.size())});
    ops::upload(p.aux_d, aux.data(), aux.size() * sizeof(float));
  }
  ops::gate_backward_dz(dx, dz, gdx, dgate, p.probs.dev_f(), p.choice_d.dev<int32_t>(),
                        p.pos_d.dev<int32_t>(), p.width_d.dev<int32_t>(),
                        p.base_d.dev<int32_t>(), aux_scale != 0.0f ? p.aux_d.dev_f() : nullptr,
                        p.k, N, d, Kmax);
  for_each_group_run(row_group, N, [&](int64_t r0, int64_t n, int g) {
    const int K = w.offset[size_t(g) + 1] - w.offset[size_t(g)];
    ops::linear_backward(dx + r0 * d, gate_w[size_t(g)].g, nullptr, dz + r0 * Kmax, x + r0 * d,
                         gate_w[size_t(g)].v, n, d, K, {d, K, Kmax});
  });
}

}  // namespace sigma
