#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "core/rng.h"

namespace sigma {

KVCacheDecoder::KVCacheDecoder(Model& model, int domain) : dec_(model, 1), domain_(domain) {
  const ModelConfig& c = model.config();
  SIGMA_CHECK(domain >= 0 && size_t(domain) < c.domains.size(), "domain index {} out of range",
              domain);
}

const float* KVCacheDecoder::step(int32_t token) {
  const int64_t V = dec_.config().vocab;
  SIGMA_CHECK(token >= 0 && token < V, "token id {} out of range [0, {})", token, V);
  const int slot = 0;
  dec_.step({&slot, 1}, {&domain_, 1}, {&token, 1});
  return dec_.logits(0);
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
  if (s.frequency_penalty != 0.0f || s.presence_penalty != 0.0f) {
    std::vector<int32_t> count(static_cast<size_t>(V), 0);
    for (int32_t t : history) ++count[size_t(t)];
    for (int64_t i = 0; i < V; ++i)
      if (count[size_t(i)] > 0)
        logits[i] -= s.frequency_penalty * float(count[size_t(i)]) + s.presence_penalty;
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

void SamplingConfig::validate() const {
  // Each check is written so that NaN fails it (every comparison with NaN is false).
  SIGMA_CHECK(temperature >= 0.0f && temperature <= 100.0f,
              "temperature {} is not in [0, 100] (0 = greedy)", temperature);
  SIGMA_CHECK(top_p > 0.0f && top_p <= 1.0f, "top-p {} is not in (0, 1] (1 = off)", top_p);
  SIGMA_CHECK(repetition_penalty >= 0.01f && repetition_penalty <= 100.0f,
              "repetition penalty {} is not in [0.01, 100] (1 = off)", repetition_penalty);
  SIGMA_CHECK(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f,
              "frequency penalty {} is not in [-2, 2] (0 = off)", frequency_penalty);
  SIGMA_CHECK(presence_penalty >= -2.0f && presence_penalty <= 2.0f,
              "presence penalty {} is not in [-2, 2] (0 = off)", presence_penalty);
  SIGMA_CHECK(top_k >= 0, "top-k {} is negative (0 = off)", top_k);
  SIGMA_CHECK(max_new_tokens >= 1, "max new tokens {} is not positive", max_new_tokens);
}

int64_t weight_bytes_per_token(const Model& model) {
  const ModelConfig& c = model.config();
  const int64_t d = c.d_model, f = c.ffn(), L = c.layers;
  const int64_t matrices = L * (4 * d * d + 2 * d * f) + int64_t(c.vocab) * d;
  const int64_t vectors = L * (3 * d + d + 4 * d + f + d) + 2 * d;
  switch (model.weight_format()) {
    case WeightFormat::F32: return matrices * 4 + vectors * 4;
    case WeightFormat::Bf16: return matrices * 2 + vectors * 4;
    case WeightFormat::Int8: break;
  }
  // One fp32 scale per output channel: of QKV, the attention output, the FFN's two matrices,
  // and the head's rows.
  const int64_t scales = L * (3 * d + d + f + d) + int64_t(c.vocab);
  return matrices + scales * 4 + vectors * 4;
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

std::vector<int32_t> generate(Model& model, int domain, const std::vector<int32_t>& prompt,
                              const SamplingConfig& s, bool use_cache, GenerateStats* stats) {
  s.validate();
  SIGMA_CHECK(!prompt.empty(), "generation needs a non-empty prompt");
  const ModelConfig& c = model.config();
  SIGMA_CHECK(domain >= 0 && size_t(domain) < c.domains.size(), "domain index {} out of range",
              domain);
  const int64_t V = c.vocab;
  std::vector<int32_t> seq = prompt;
  std::vector<float> logits(static_cast<size_t>(V));
  const int budget = std::min<int>(s.max_new_tokens, c.context - int(prompt.size()) + 1);
  SIGMA_CHECK(int(prompt.size()) <= c.context, "prompt of {} tokens exceeds the context ({})",
              prompt.size(), c.context);
  GenerateStats st;
  st.prompt_tokens = int(prompt.size());
  std::unique_ptr<BatchDecoder> dec;
  const int slot = 0;
  std::vector<float> loss;
  // Greedy without penalties: the first largest logit (sample_next's choice), one pass.
  const bool plain_greedy = s.temperature <= 0.0f && s.repetition_penalty == 1.0f &&
                            s.frequency_penalty == 0.0f && s.presence_penalty == 0.0f;
  for (int n = 0; n < budget; ++n) {
    const auto t0 = std::chrono::steady_clock::now();
    const float* l = nullptr;
    std::vector<float> row;
    if (use_cache && n == 0) {  // the whole prompt in one pass
      dec = std::make_unique<BatchDecoder>(model, 1);
      l = dec->prefill(slot, domain, prompt);
    } else if (use_cache) {
      dec->step({&slot, 1}, {&domain, 1}, {&seq.back(), 1});
      l = dec->logits(0);
    } else {
      Batch b;
      b.resize(1, int(seq.size()));
      b.tokens = seq;
      b.domain[0] = domain;
      loss.resize(seq.size());
      model.forward(b, loss.data());
      row = model.logits_row(int64_t(seq.size()) - 1);
      l = row.data();
    }
    int32_t next;
    if (plain_greedy) {  // sample_next's choice, read where the logits lie: no copy of them
      next = int32_t(std::max_element(l, l + V) - l);
    } else {
      std::copy(l, l + V, logits.begin());
      next = sample_next(logits.data(), V, seq, s, uint64_t(n));
    }
    seq.push_back(next);
    (n == 0 ? st.prefill_seconds : st.decode_seconds) += seconds_since(t0);
    st.decode_steps += n > 0;
    if (next == s.stop_token || int(seq.size()) > c.context) break;
  }
  if (dec) st.kv_cache_bytes = dec->cache_bytes();
  if (stats) *stats = st;
  return std::vector<int32_t>(seq.begin() + prompt.size(), seq.end());
}

}  // namespace sigma
