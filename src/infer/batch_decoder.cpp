#include "infer/batch_decoder.h"

#include "kernels/ops.h"

#include <algorithm>
#include <cmath>

namespace sigma {

BatchDecoder::BatchDecoder(Model& model, int slots)
    : model_(model), step_acts_(static_cast<size_t>(slots)) {
  SIGMA_CHECK(slots >= 1, "a batch decoder needs at least one slot, not {}", slots);
  model.check_routing_ready();
  cache_.reset(model.config(), slots, model.kv_cache_dtype());
}

void BatchDecoder::run_prompt(int slot, int domain, std::span<const int32_t> inputs,
                              const int32_t* next) {
  const ModelConfig& c = model_.config();
  SIGMA_CHECK(slot >= 0 && slot < slots(), "slot {} out of range [0, {})", slot, slots());
  SIGMA_CHECK(!inputs.empty() && int64_t(inputs.size()) <= c.context,
              "a prompt needs 1 to {} tokens, not {}", c.context, inputs.size());
  const int T = int(inputs.size());
  batch_.resize(1, T);
  std::copy(inputs.begin(), inputs.end(), batch_.tokens.begin());
  std::copy(next, next + T, batch_.targets.begin());
  batch_.domain[0] = domain;
  loss_.resize(size_t(T));
  cache_.clear(slot);
  model_.forward_cached(batch_, cache_, prefill_acts_, loss_.data(), &slot);
  last_ = &prefill_acts_;
}

const float* BatchDecoder::prefill(int slot, int domain, std::span<const int32_t> tokens,
                                   float* prompt_logprobs, int reuse) {
  const ModelConfig& c = model_.config();
  const int T = int(tokens.size());
  SIGMA_CHECK(slot >= 0 && slot < slots(), "slot {} out of range [0, {})", slot, slots());
  SIGMA_CHECK(T >= 1 && T <= c.context, "a prompt needs 1 to {} tokens, not {}", c.context, T);
  SIGMA_CHECK(reuse >= 0 && reuse % kPrefillChunk == 0 && reuse < T && (reuse == 0 || !prompt_logprobs),
              "cannot reuse {} positions of a {}-token prompt", reuse, T);
  loss_.assign(size_t(T), 0.0f);
  cache_.length[size_t(slot)] = reuse;
  int len = 0;
  for (int at = reuse; at < T; at += len) {
    len = std::min(kPrefillChunk, T - at);
    batch_.resize(1, len);
    std::copy(tokens.begin() + at, tokens.begin() + at + len, batch_.tokens.begin());
    for (int t = 0; t < len; ++t)  // the position after the prompt has no target
      batch_.targets[size_t(t)] = at + t + 1 < T ? tokens[size_t(at + t + 1)] : 0;
    batch_.domain[0] = domain;
    if (prompt_logprobs)
      model_.forward_cached(batch_, cache_, prefill_acts_, loss_.data() + at, &slot);
    else if (at + len < T)  // no output of this chunk is read
      model_.fill_cache(batch_, cache_, prefill_acts_, &slot);
    else  // the last position's logits alone
      model_.forward_cached_last(batch_, cache_, prefill_acts_, &slot);
  }
  last_ = &prefill_acts_;
  if (prompt_logprobs)
    for (int t = 0; t + 1 < T; ++t) prompt_logprobs[t] = -loss_[size_t(t)];
  // The last chunk's last position, to the host.
  const int64_t V = c.vocab;
  logits_.resize(size_t(V));
  ops::download(logits_.data(), prefill_acts_.logits, size_t(V) * sizeof(float),
                prompt_logprobs ? size_t(len - 1) * size_t(V) * sizeof(float) : 0);
  return logits_.data();
}

void BatchDecoder::copy_prefix(int from, int to, int n) {
  SIGMA_CHECK(from >= 0 && from < slots() && to >= 0 && to < slots() && n >= 0 &&
                  n <= cache_.length[size_t(from)] && n <= model_.config().context,
              "cannot copy {} cached positions from slot {} to slot {}", n, from, to);
  cache_.copy_prefix(from, to, n);
}

void BatchDecoder::score(int slot, int domain, std::span<const int32_t> tokens, float* logprobs) {
  SIGMA_CHECK(tokens.size() >= 2, "scoring needs at least 2 tokens, not {}", tokens.size());
  run_prompt(slot, domain, tokens.first(tokens.size() - 1), tokens.data() + 1);
  for (size_t t = 0; t + 1 < tokens.size(); ++t) logprobs[t] = -loss_[t];
}

void BatchDecoder::step(std::span<const int> slots, std::span<const int> domains,
                        std::span<const int32_t> tokens) {
  const int B = int(slots.size());
  SIGMA_CHECK(B >= 1 && B <= this->slots() && domains.size() == slots.size() &&
                  tokens.size() == slots.size(),
              "a decode step needs 1 to {} slots with one domain and token each", this->slots());
  batch_.resize(B, 1);
  std::copy(tokens.begin(), tokens.end(), batch_.tokens.begin());
  std::copy(domains.begin(), domains.end(), batch_.domain.begin());
  Activations& acts = step_acts_[size_t(B) - 1];
  model_.forward_cached(batch_, cache_, acts, nullptr, slots.data());  // the logits alone
  last_ = &acts;
  logits_.resize(size_t(B) * size_t(model_.config().vocab));  // every row's, to the host
  ops::download(logits_.data(), acts.logits, logits_.size() * sizeof(float));
}

const float* BatchDecoder::logits(int i) const {
  SIGMA_CHECK(last_ && last_ != &prefill_acts_ && i >= 0 && i < last_->B,
              "no logits for decode row {}", i);
  return logits_.data() + int64_t(i) * model_.config().vocab;
}

double token_logprob(const float* logits, int64_t V, int32_t id) {
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(double(logits[j]) - mx);
  return double(logits[id]) - mx - std::log(sum);
}

}  // namespace sigma
