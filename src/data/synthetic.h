// Built-in synthetic multi-domain data for the main job: three domains of clearly different
// structure, each with an exactly computable optimal loss, so training can be judged against
// the best possible model rather than against a guess.
//   markov: a first-order Markov chain over 24 symbols (start drawn from its stationary law);
//   copy:   8 uniform symbols out of 16, then repeated with period 8 (recall);
//   arith:  x1 uniform mod 16, a step uniform in 1..15, then x_{t+1} = x_t + step (mod 16).
// Every sample starts with its domain's tag token; targets are the next tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/batch.h"

namespace sigma {

class SyntheticData {
 public:
  explicit SyntheticData(uint64_t seed);

  int vocab() const { return kVocab; }
  const std::vector<std::string>& domains() const { return names_; }

  // Writes one sample of domain d (T inputs, T targets), a pure function of (d, stream, index).
  void sample(int d, uint64_t stream, uint64_t index, int T, int32_t* tokens,
              int32_t* targets) const;
  // Exact expected optimal cross-entropy (nats) per target of a T-target sample of domain d.
  double optimum(int d, int T) const;
  // Rows dealt round-robin over the domains; sample index = row_offset + b, so batches drawn
  // from distinct offsets never repeat a sample.
  void fill_batch(Batch& b, int T, uint64_t stream, uint64_t row_offset) const;

  static constexpr int kTags = 3, kMarkovSymbols = 24, kCopyAlphabet = 16, kCopyPeriod = 8,
                       kModulus = 16, kVocab = 32;

 private:
  uint64_t seed_;
  std::vector<std::string> names_{"markov", "copy", "arith"};
  std::vector<double> transition_;  // [24,24] row-stochastic
  std::vector<double> stationary_;  // [24]
  std::vector<double> cumulative_;  // [24,24] row-wise CDF, for sampling
  std::vector<double> stationary_cdf_;
};

}  // namespace sigma
