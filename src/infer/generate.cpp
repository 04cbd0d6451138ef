#include "infer/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/rng.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "model/ffn.h"

namespace sigma {

KVCacheDecoder::KVCacheDecoder(const Model& model, int domain) : model_(model) {
  const ModelConfig& c = model.config();
  SIGMA_CHECK(domain >= 0 && size_t(domain) < c.domains.size(), "domain index {} out of range",
              domain);
  slot_base_ = int64_t(c.domains[domain].slot) * c.vocab;
  group_ = model.domain_group(domain);
  model.check_routing_ready();
  const size_t d = c.d_model, f = c.ffn();
  k_.assign(c.layers, std::vector<float>(size_t(c.context) * d));
  v_.assign(c.layers, std::vector<float>(size_t(c.context) * d));
  x_.resize(d), a_.resize(d), qkv_.resize(3 * d), q_.resize(d), att_.resize(d), mid_.resize(d);
  pre_.resize(f), act_.resize(f), hf_.resize(d), logits_.resize(c.vocab), probs_.resize(c.context);
}

const float* KVCacheDecoder::step(int32_t token) {
  const ModelConfig& c = model_.config();
  const ModelWeights& w = model_.weights();
  const int64_t d = c.d_model, f = c.ffn(), V = c.vocab, H = c.heads, hd = c.head_dim();
  SIGMA_CHECK(pos_ < c.context, "generation reached the model's context length ({})", c.context);
  SIGMA_CHECK(token >= 0 && token < V, "token id {} out of range [0, {})", token, V);
  const int p = pos_;
  const float* e = w.tokens.v + (slot_base_ + token) * d;
  for (int64_t i = 0; i < d; ++i) x_[i] = e[i] + w.positions.v[p * d + i];
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int l = 0; l < c.layers; ++l) {
    const BlockWeights& b = w.blocks[l];
    cpu::layernorm_forward(a_.data(), &mean_, &rstd_, x_.data(), b.ln1_w.v, b.ln1_b.v, 1, d);
    cpu::linear_forward(qkv_.data(), a_.data(), b.qkv_w.v, b.qkv_b.v, 1, d, 3 * d);
    const float* q = qkv_.data();
    if (l == c.layers - 1) {  // query layer: the query comes from the learned position table
      cpu::linear_forward(q_.data(), b.query.v + p * d, b.qkv_w.v, b.qkv_b.v, 1, d, d, false,
                          {d, 3 * d, d});
      q = q_.data();
    }
    std::copy(qkv_.begin() + d, qkv_.begin() + 2 * d, k_[l].begin() + p * d);
    std::copy(qkv_.begin() + 2 * d, qkv_.end(), v_[l].begin() + p * d);
    for (int64_t h = 0; h < H; ++h) {
      float mx = -INFINITY;
      for (int j = 0; j <= p; ++j) {
        float s = 0;
        for (int64_t t = 0; t < hd; ++t) s += q[h * hd + t] * k_[l][j * d + h * hd + t];
        probs_[j] = s * scale;
        mx = std::max(mx, probs_[j]);
      }
      float z = 0;
      for (int j = 0; j <= p; ++j) z += probs_[j] = std::exp(probs_[j] - mx);
      for (int64_t t = 0; t < hd; ++t) {
        float acc = 0;
        for (int j = 0; j <= p; ++j) acc += probs_[j] * v_[l][j * d + h * hd + t];
        att_[h * hd + t] = acc / z;
      }
    }
    mid_ = x_;
    cpu::linear_forward(mid_.data(), att_.data(), b.out_w.v, b.out_b.v, 1, d, d, true);
    cpu::layernorm_forward(a_.data(), &mean_, &rstd_, mid_.data(), b.ln2_w.v, b.ln2_b.v, 1, d);
    x_ = mid_;
    if (!b.is_rre()) {
      ffn_forward(x_.data(), pre_.data(), act_.data(), a_.data(), b.ffn(), 1, d, f);
    } else if (b.gate.empty()) {
      // RRE block: the token goes through the expert its (group, id) routes to (DESIGN §2).
      ffn_forward(x_.data(), pre_.data(), act_.data(), a_.data(),
                  b.rre.expert[size_t(b.rre.route(group_, token))], 1, d, f);
    } else {
      gated_ffn(b, f);
    }
  }
  cpu::layernorm_forward(hf_.data(), &mean_, &rstd_, x_.data(), w.lnf_w.v, w.lnf_b.v, 1, d);
  cpu::gemm(false, true, 1, V, d, 1.0f, hf_.data(), d, w.tokens.v + slot_base_ * d, d, 0.0f,
            logits_.data(), V);
  ++pos_;
  return logits_.data();
}

// The learned-gate baseline for one token (no capacity limit for a single token): the same
// softmax, top-k choice and combine weights as gate_forward.
void KVCacheDecoder::gated_ffn(const BlockWeights& b, int64_t f) {
  const int64_t d = model_.config().d_model;
  const int o = b.rre.offset[size_t(group_)], K = b.rre.offset[size_t(group_) + 1] - o;
  std::vector<float> z(static_cast<size_t>(K));
  cpu::linear_forward(z.data(), a_.data(), b.gate[size_t(group_)].v, nullptr, 1, d, K);
  const float mx = *std::max_element(z.begin(), z.end());
  float sum = 0;
  for (float& v : z) sum += v = std::exp(v - mx);
  for (float& v : z) v /= sum;
  int e1 = 0;
  for (int e = 1; e < K; ++e)
    if (z[size_t(e)] > z[size_t(e1)]) e1 = e;
  std::vector<std::pair<int, float>> use;
  if (model_.config().experts_per_token() == 1 || K == 1) {
    use.push_back({e1, model_.config().experts_per_token() == 1 ? z[size_t(e1)] : 1.0f});
  } else {
    int e2 = e1 == 0 ? 1 : 0;
    for (int e = 0; e < K; ++e)
      if (e != e1 && z[size_t(e)] > z[size_t(e2)]) e2 = e;
    const float s = z[size_t(e1)] + z[size_t(e2)];
    use = {{e1, z[size_t(e1)] / s}, {e2, z[size_t(e2)] / s}};
  }
  std::vector<float> y(static_cast<size_t>(d));
  for (auto [e, g] : use) {
    std::fill(y.begin(), y.end(), 0.0f);
    ffn_forward(y.data(), pre_.data(), act_.data(), a_.data(), b.rre.expert[size_t(o + e)], 1, d, f);
    for (int64_t i = 0; i < d; ++i) x_[size_t(i)] += g * y[size_t(i)];
  }
}

int32_t sample_next(float* logits, int64_t V, const std::vector<int32_t>& history,
                    const SamplingConfig& s, uint64_t draw_index) {
  if (s.repetition_penalty != 1.0f) {
    std::vector<bool> seen(static_cast<size_t>(V), false);
    for (int32_t t : history) seen[size_t(t)] = true;
    for (int64_t i = 0; i < V; ++i)
      if (seen[size_t(i)])
        logits[i] = logits[i] > 0 ? logits[i] / s.repetition_penalty : logits[i] * s.repetition_penalty;
  }
  if (s.temperature <= 0.0f) return int32_t(std::max_element(logits, logits + V) - logits);
  // Candidates sorted by logit (ties by id, so the order is deterministic).
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = s.top_k > 0 ? std::min<size_t>(size_t(s.top_k), idx.size()) : idx.size();
  std::vector<double> p(keep);
  const double mx = logits[idx[0]];
  double z = 0;
  for (size_t i = 0; i < keep; ++i) z += p[i] = std::exp((logits[idx[i]] - mx) / s.temperature);
  if (s.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
    double c = 0;
    size_t n = 0;
    while (n < keep && c < s.top_p * z) c += p[n++];
    keep = std::max<size_t>(1, n);
    z = c;
  }
  const double u = double(rng_u64(s.seed, 0x6e6e, draw_index) >> 11) * (1.0 / 9007199254740992.0) * z;
  double c = 0;
  for (size_t i = 0; i < keep; ++i)
    if ((c += p[i]) > u) return idx[i];
  return idx[keep - 1];
}

std::vector<int32_t> generate(Model& model, int domain, const std::vector<int32_t>& prompt,
                              const SamplingConfig& s, bool use_cache) {
  SIGMA_CHECK(!prompt.empty(), "generation needs a non-empty prompt");
  const ModelConfig& c = model.config();
  const int64_t V = c.vocab;
  std::vector<int32_t> seq = prompt;
  std::vector<float> logits(static_cast<size_t>(V));
  const int budget = std::min<int>(s.max_new_tokens, c.context - int(prompt.size()) + 1);
  SIGMA_CHECK(int(prompt.size()) <= c.context, "prompt of {} tokens exceeds the context ({})",
              prompt.size(), c.context);
  std::unique_ptr<KVCacheDecoder> dec;
  if (use_cache) {
    dec = std::make_unique<KVCacheDecoder>(model, domain);
    for (size_t i = 0; i + 1 < prompt.size(); ++i) dec->step(prompt[i]);
  }
  std::vector<float> loss;
  for (int n = 0; n < budget; ++n) {
    if (use_cache) {
      const float* l = dec->step(seq.back());
      std::copy(l, l + V, logits.begin());
    } else {
      Batch b;
      b.resize(1, int(seq.size()));
      b.tokens = seq;
      b.domain[0] = domain;
      loss.resize(seq.size());
      model.forward(b, loss.data());
      const float* l = model.logits() + (seq.size() - 1) * V;
      std::copy(l, l + V, logits.begin());
    }
    const int32_t next = sample_next(logits.data(), V, seq, s, uint64_t(n));
    seq.push_back(next);
    if (next == s.stop_token || int(seq.size()) > c.context) break;
  }
  return std::vector<int32_t>(seq.begin() + prompt.size(), seq.end());
}

}  // namespace sigma
