// ZeRO's bucketed streams (parallel/shard_plan.cpp and parallel/zero_overlap.cpp share them).
#pragma once
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "model/params.h"
#include "parallel/shard_plan.h"

namespace sigma::zero_detail {

// Owner o's stream: the elements it owns (of every tensor, or of the pieces that `only`
// names), in parameter order. Buckets walk every owner's stream at once, S elements of each
// per round, so that a round moves at most R * S elements per rank and no buffer grows with
// the model (ZeRO's bucketed exchange).
class OwnerStreams {
 public:
  OwnerStreams(const ShardPlan& plan, std::vector<Param>& all, bool grads,
               const ParamStage* only = nullptr)
      : plan_(plan), lengths_(size_t(plan.ranks), 0) {
    tensors_.resize(size_t(plan.ranks));
    auto add = [&](size_t i, int64_t begin, int64_t end) {  // each owner's part of [begin, end)
      Tensor& t = grads ? all[i].grad : all[i].value;
      for (int o = 0; o < plan.ranks; ++o) {
        const ParamPiece mine = plan.owned(i, o);
        const int64_t b = std::max(begin, mine.begin), e = std::min(end, mine.end);
        if (b >= e) continue;
        tensors_[size_t(o)].push_back({t.dev_f() + b, size_t(e - b)});
        lengths_[size_t(o)] += size_t(e - b);
      }
    };
    if (only)
      for (const ParamPiece& p : *only) add(p.param, p.begin, p.end);
    else
      for (size_t i = 0; i < all.size(); ++i) add(i, 0, all[i].value.numel());
  }
  size_t length(int o) const { return lengths_[size_t(o)]; }
  // Calls fn(pointer, n) over owner o's stream elements [begin, end) in order.
  template <class Fn>
  void spans(int o, size_t begin, size_t end, Fn&& fn) const {
    size_t at = 0;
    for (const auto& [p, n] : tensors_[size_t(o)]) {
      const size_t b = std::max(begin, at), e = std::min(end, at + n);
      if (b < e) fn(p + (b - at), e - b);
      at += n;
      if (at >= end) break;
    }
  }
  // The tensors live on the backend's device; the exchange buffers are host memory.
  void pack(int o, size_t begin, size_t end, float* out) const {
    spans(o, begin, end, [&](const float* p, size_t n) {
      ops::download(out, p, n * sizeof(float));
      out += n;
    });
  }
  void unpack(int o, size_t begin, size_t end, const float* in) const {
    spans(o, begin, end, [&](float* p, size_t n) {
      ops::upload(p, in, n * sizeof(float));
      in += n;
    });
  }
  // Owner o's share of round k: [begin, end) of its stream.
  std::pair<size_t, size_t> slice(int o, size_t k, size_t S) const {
    const size_t b = std::min(length(o), k * S);
    return {b, std::min(length(o), b + S)};
  }
  // Elements of each owner's stream per round: R of them make a bucket (no more than the
  // longest stream: a small set of tensors gets small buffers).
  size_t slice_elements(size_t bucket) const {
    size_t most = 1;
    for (int o = 0; o < plan_.ranks; ++o) most = std::max(most, length(o));
    return std::min(most, std::max<size_t>(1, bucket / size_t(plan_.ranks)));
  }
  size_t rounds(size_t S) const {
    size_t most = 0;
    for (int o = 0; o < plan_.ranks; ++o) most = std::max(most, length(o));
    return (most + S - 1) / S;
  }

 private:
  const ShardPlan& plan_;
  std::vector<size_t> lengths_;                                  // per owner
  std::vector<std::vector<std::pair<float*, size_t>>> tensors_;  // per owner
};


}  // namespace sigma::zero_detail
