// Autoregressive generation: a KV-cache decoder (one token at a time, keys and values of
// earlier positions kept per block) and sampling (greedy, temperature, top-k, top-p,
// repetition penalty), seeded through the counter RNG.
#pragma once
#include <cstdint>
#include <vector>

#include "infer/batch_decoder.h"
#include "model/activations.h"
#include "model/model.h"

namespace sigma {

struct SamplingConfig {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  float repetition_penalty = 1.0f;  // >1 discourages tokens already in the sequence (CTRL-style)
  uint64_t seed = 0;
  int max_new_tokens = 32;
  int stop_token = -1;  // generation ends after emitting this id (-1 = never)
  // OpenAI's additive penalties: logit -= frequency_penalty * count + presence_penalty * (count > 0),
  // count = occurrences of the id in the history (0 = off).
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // Throws naming the first field outside its range. NaN fails every range (a NaN
  // temperature would otherwise pass "t >= 0 && t <= 100"-style checks written as negations
  // and turn every probability into NaN).
  void validate() const;
};

// One sequence decoded a token at a time (a BatchDecoder with one slot): the same attention,
// expert and head code as training, with the keys and values of earlier positions cached.
class KVCacheDecoder {
 public:
  KVCacheDecoder(Model& model, int domain);
  // Feeds `token` at the next position; returns the logits [V] for the position after it.
  const float* step(int32_t token);
  int position() const { return dec_.position(0); }

 private:
  BatchDecoder dec_;
  int domain_;
};

// Picks the next token from logits (modified in place), given the tokens so far.
int32_t sample_next(float* logits, int64_t V, const std::vector<int32_t>& history,
                    const SamplingConfig& s, uint64_t draw_index);

// Where generate()'s time went: the prompt's pass and first token, then one decode step per
// further token (sampling included).
struct GenerateStats {
  int prompt_tokens = 0;
  double prefill_seconds = 0;
  int decode_steps = 0;
  double decode_seconds = 0;
  int64_t kv_cache_bytes = 0;  // the KV cache's keys and values (its whole context), 0 without
};

// Bytes of weights one decode step reads: every weight matrix of the blocks (one expert per
// RRE block), the tied head's V x d rows of one slot, in the model's weight precision (bf16
// copies: 2 bytes; int8: 1, plus a 4-byte scale per output channel), plus the fp32 biases and
// LayerNorms. The rows looked up in the embedding,
// position and query tables (3d values), a learned gate's weights and the KV cache are not
// counted. Divided by the memory bandwidth, the batch-1 decode time bound.
int64_t weight_bytes_per_token(const Model& model);

// Generates up to max_new_tokens after `prompt` (which must be non-empty): the prompt in one
// pass into the KV cache, then a token per step. With use_cache = false every step reruns the
// full forward pass on the prefix (the reference path).
std::vector<int32_t> generate(Model& model, int domain, const std::vector<int32_t>& prompt,
                              const SamplingConfig& s, bool use_cache = true,
                              GenerateStats* stats = nullptr);

}  // namespace sigma
