#include "data/synthetic.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace sigma {

namespace {
constexpr int kS = SyntheticData::kMarkovSymbols;

double entropy(const double* p, int n) {
  double h = 0;
  for (int i = 0; i < n; ++i)
    if (p[i] > 0) h -= p[i] * std::log(p[i]);
  return h;
}

int draw(const double* cdf, int n, double u) {
  int i = int(std::upper_bound(cdf, cdf + n, u) - cdf);
  return std::min(i, n - 1);
}

double unit(Rng& r) { return double(r.next_u64() >> 11) * (1.0 / 9007199254740992.0); }
}  // namespace

SyntheticData::SyntheticData(uint64_t seed) : seed_(seed) {
  // Peaked random rows (softmax of 2.5 * N(0,1)) give an entropy rate well below log(24).
  transition_.resize(kS * kS);
  for (int i = 0; i < kS; ++i) {
    double z = 0;
    for (int j = 0; j < kS; ++j)
      z += transition_[i * kS + j] = std::exp(2.5 * rng_normal(seed, 11, i * kS + j));
    for (int j = 0; j < kS; ++j) transition_[i * kS + j] /= z;
  }
  stationary_.assign(kS, 1.0 / kS);
  for (int it = 0; it < 10000; ++it) {  // power iteration; the chain is dense, so it converges
    std::vector<double> next(kS, 0.0);
    for (int i = 0; i < kS; ++i)
      for (int j = 0; j < kS; ++j) next[j] += stationary_[i] * transition_[i * kS + j];
    stationary_ = next;
  }
  cumulative_.resize(kS * kS);
  for (int i = 0; i < kS; ++i) {
    double c = 0;
    for (int j = 0; j < kS; ++j) cumulative_[i * kS + j] = c += transition_[i * kS + j];
  }
  double c = 0;
  for (int j = 0; j < kS; ++j) stationary_cdf_.push_back(c += stationary_[j]);
}

void SyntheticData::sample(int d, uint64_t stream, uint64_t index, int T, int32_t* tokens,
                           int32_t* targets) const {
  SIGMA_CHECK(d >= 0 && d < 3, "synthetic domain index {} out of range", d);
  // seq[0] = tag, seq[1..T] = content; inputs seq[0..T-1], targets seq[1..T].
  std::vector<int32_t> seq(size_t(T) + 1);
  seq[0] = d;
  Rng r(seed_ ^ mix64(stream), index * 4 + uint64_t(d));
  if (d == 0) {
    int x = draw(stationary_cdf_.data(), kS, unit(r));
    for (int t = 1; t <= T; ++t) {
      seq[t] = kTags + x;
      x = draw(&cumulative_[size_t(x) * kS], kS, unit(r));
    }
  } else if (d == 1) {
    for (int t = 1; t <= T; ++t)
      seq[t] = t <= kCopyPeriod ? kTags + int32_t(r.below(kCopyAlphabet)) : seq[t - kCopyPeriod];
  } else {
    int x = int(r.below(kModulus)), step = 1 + int(r.below(kModulus - 1));
    for (int t = 1; t <= T; ++t, x = (x + step) % kModulus) seq[t] = kTags + x;
  }
  std::copy(seq.begin(), seq.end() - 1, tokens);
  std::copy(seq.begin() + 1, seq.end(), targets);
}

double SyntheticData::optimum(int d, int T) const {
  double total = 0;
  if (d == 0) {
    // First target: the stationary law (only the tag is known); then the entropy rate.
    double rate = 0;
    for (int i = 0; i < kS; ++i) rate += stationary_[i] * entropy(&transition_[size_t(i) * kS], kS);
    total = entropy(stationary_.data(), kS) + (T - 1) * rate;
  } else if (d == 1) {
    total = std::min(T, kCopyPeriod) * std::log(double(kCopyAlphabet));
  } else {
    total = std::log(double(kModulus)) + (T > 1 ? std::log(double(kModulus - 1)) : 0.0);
  }
  return total / T;
}

void SyntheticData::fill_batch(Batch& b, int T, uint64_t stream, uint64_t row_offset) const {
  const int B = b.B;
  b.resize(B, T);
  for (int i = 0; i < B; ++i) {
    const int d = int((row_offset + i) % 3);
    b.domain[i] = d;
    sample(d, stream, row_offset + i, T, &b.tokens[size_t(i) * T], &b.targets[size_t(i) * T]);
  }
}

}  // namespace sigma
