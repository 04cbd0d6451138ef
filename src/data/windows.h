// Batches for the trainer (DESIGN.md §5).
// Pre-training: a domain's samples are one token stream; window w is tokens [w*T, w*T + T]
// (T+1 tokens: inputs are the first T, targets the last T). Consecutive windows share one
// token, so every token after the first is a target exactly once; the tail that does not fill
// a window is left out (tail_tokens()).
// Fine-tuning: one sample per row, truncated to T+1 tokens or padded with <Pad>; the loss mask
// is 0 on padding and, when asked, on targets inside the prompt.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include "data/sampler.h"
#include "data/shards.h"

namespace sigma::data {

struct Batch {
  uint32_t B = 0, T = 0;
  std::vector<int32_t> inputs;   // [B*T] token ids
  std::vector<int32_t> targets;  // [B*T] next token of each input
  std::vector<float> mask;       // [B*T] 1 = this target counts in the loss
  std::vector<int32_t> domain;   // [B]   Domain::id of each row
};

uint64_t window_count(uint64_t n_tokens, uint32_t T);  // floor((n - 1) / T), 0 when n < T + 1
inline uint64_t tail_tokens(uint64_t n_tokens, uint32_t T) {
  return n_tokens == 0 ? 0 : n_tokens - 1 - window_count(n_tokens, T) * T;
}

// Writes window w of the shard: in[T], tgt[T], mask[T] (all ones).
void fill_window(const Shard& s, uint64_t w, uint32_t T, int32_t* in, int32_t* tgt, float* mask);

// Writes one fine-tuning row from a whole sample's tokens (prefix ... <EOT>).
void fill_row(std::span<const int32_t> sample, uint32_t prompt_len, uint32_t T, bool mask_prompt,
              int32_t* in, int32_t* tgt, float* mask);

struct BatchConfig {
  uint32_t batch = 8;    // B rows
  uint32_t seq = 1024;   // T
  bool finetune = false;
  bool mask_prompt = false;
};

// Draws rows through the Sampler and fills batches; cursor() / restore() resume exactly.
class BatchSource {
 public:
  BatchSource(ShardSet shards, BatchConfig bc, SamplerConfig sc);
  void next(Batch& b);
  nlohmann::json cursor() const { return sampler_.cursor(); }
  void restore(const nlohmann::json& c) { sampler_.restore(c); }
  void continue_at(uint64_t batch) { sampler_.continue_at(batch); }
  const Sampler& sampler() const { return sampler_; }
  void restrict_batches(std::vector<std::vector<uint32_t>> allowed) { sampler_.restrict_batches(std::move(allowed)); }
  const ShardSet& shards() const { return shards_; }

 private:
  static Sampler make_sampler(const ShardSet& s, const BatchConfig& bc, SamplerConfig sc);
  ShardSet shards_;
  BatchConfig bc_;
  Sampler sampler_;
  std::vector<Sampler::Pick> picks_;
  std::vector<int32_t> scratch_;
};

}  // namespace sigma::data
