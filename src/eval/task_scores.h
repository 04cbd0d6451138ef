// Internal to the task scorers (tasks.cpp, task_scores.cpp): the metrics of each kind of item
// from the model's outputs alone, so that a --log-samples file can be scored again.
#pragma once
#include <nlohmann/json.hpp>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "eval/tasks.h"

namespace sigma::eval::scoring {

using nlohmann::json;

// The bootstrap standard error of a statistic of the items: `stat(idx)` over `n` items drawn
// with replacement, `reps` times (seeded, so a rerun prints the same figure).
template <class Stat>
double bootstrap_stderr(size_t n, int reps, Stat stat) {
  if (n < 2 || reps < 2) return 0;
  std::vector<size_t> idx(n);
  double sum = 0, sq = 0;
  for (int b = 0; b < reps; ++b) {
    for (size_t i = 0; i < n; ++i) idx[i] = size_t(rng_u64(0x28b007, uint64_t(b), i) % n);
    const double v = stat(idx);
    sum += v, sq += v * v;
  }
  const double mean = sum / reps;
  return std::sqrt(std::max(0.0, (sq - reps * mean * mean) / (reps - 1)));
}

// Each takes one kind's items with their outputs and log records (null: no --log-samples).
json score_choices(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                   const TaskOptions& opt, std::vector<json*>& log);
json score_generation(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                      const TaskOptions& opt, std::vector<json*>& log);
json score_code(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                const TaskOptions& opt, std::vector<json*>& log);
json score_rolling(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                   const TaskOptions& opt, std::vector<json*>& log);

}  // namespace sigma::eval::scoring
