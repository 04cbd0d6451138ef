#include "data/windows.h"

#include <algorithm>

#include "core/error.h"
#include "data/tokenizer.h"

namespace sigma::data {

uint64_t window_count(uint64_t n_tokens, uint32_t T) {
  SIGMA_CHECK(T > 0, "windows: sequence length must be positive");
  return n_tokens == 0 ? 0 : (n_tokens - 1) / T;
}

void fill_window(const Shard& s, uint64_t w, uint32_t T, int32_t* in, int32_t* tgt, float* mask) {
  SIGMA_CHECK(w < window_count(s.n_tokens(), T), "windows: window {} of {} is past the {} windows "
              "of length {}", w, s.path(), window_count(s.n_tokens(), T), T);
  s.read(w * T, T, in);
  s.read(w * T + 1, T, tgt);
  std::fill(mask, mask + T, 1.0f);
}

void fill_row(std::span<const int32_t> sample, uint32_t prompt_len, uint32_t T, bool mask_prompt,
              int32_t* in, int32_t* tgt, float* mask) {
  const size_t n = std::min<size_t>(sample.size(), size_t(T) + 1);
  for (uint32_t j = 0; j < T; ++j) {
    // Target j is token j+1: real when j+1 < n, prompt when j+1 < prompt_len.
    in[j] = j < n ? sample[j] : static_cast<int32_t>(kPadId);
    bool real = j + 1 < n;
    tgt[j] = real ? sample[j + 1] : static_cast<int32_t>(kPadId);
    mask[j] = real && !(mask_prompt && j + 1 < prompt_len) ? 1.0f : 0.0f;
  }
}

Sampler BatchSource::make_sampler(const ShardSet& s, const BatchConfig& bc, SamplerConfig sc) {
  SIGMA_CHECK(bc.batch > 0 && bc.seq > 0, "batches: batch size and sequence length must be positive");
  std::vector<uint64_t> items, tokens;
  for (auto& sh : s.shards) {
    items.push_back(bc.finetune ? sh->n_samples() : window_count(sh->n_tokens(), bc.seq));
    tokens.push_back(sh->n_tokens());
  }
  return Sampler(std::move(sc), s.domains.names(), std::move(items), std::move(tokens));
}

BatchSource::BatchSource(ShardSet shards, BatchConfig bc, SamplerConfig sc)
    : shards_(std::move(shards)), bc_(bc), sampler_(make_sampler(shards_, bc_, std::move(sc))) {}

void BatchSource::next(Batch& b) {
  const uint32_t B = bc_.batch, T = bc_.seq;
  b.B = B;
  b.T = T;
  b.inputs.resize(size_t(B) * T);
  b.targets.resize(size_t(B) * T);
  b.mask.resize(size_t(B) * T);
  b.domain.resize(B);
  sampler_.next_batch(B, picks_);
  for (uint32_t r = 0; r < B; ++r) {
    const Shard& s = *shards_.shards[picks_[r].domain];
    size_t o = size_t(r) * T;
    b.domain[r] = static_cast<int32_t>(shards_.domains[picks_[r].domain].id);
    if (!bc_.finetune) {
      fill_window(s, picks_[r].item, T, &b.inputs[o], &b.targets[o], &b.mask[o]);
      continue;
    }
    uint64_t i = picks_[r].item, begin = s.sample_begin(i);
    uint64_t len = std::min<uint64_t>(s.sample_end(i) - begin, uint64_t(T) + 1);
    scratch_.resize(len);
    s.read(begin, len, scratch_.data());
    fill_row(scratch_, s.prompt_len(i), T, bc_.mask_prompt, &b.inputs[o], &b.targets[o], &b.mask[o]);
  }
}

}  // namespace sigma::data
