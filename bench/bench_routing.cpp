// Routing-table balance on real token counts (issue 4): for each expert group of a prepared
// shard folder, random tables (a seeded permutation dealt round-robin) against
// frequency-balanced tables (greedy on the training counts), by the expected token-load
// imbalance max/mean over experts. Frequency tables are built from TRAIN counts and also
// scored on HELDOUT counts, so the figure is not measured on the data that built it.
// Usage: bench_routing TRAIN_SHARDS [HELDOUT_SHARDS] [K ...]   (default K: 4 16)
#include <fmt/format.h>

#include <map>
#include <string>

#include "data/shards.h"
#include "model/routing.h"

using namespace sigma;

namespace {

// Token counts [V] per group (domains of one group summed).
std::map<std::string, std::vector<int64_t>> group_counts(const data::ShardSet& s, int64_t V) {
  std::map<std::string, std::vector<int64_t>> out;
  for (size_t i = 0; i < s.shards.size(); ++i) {
    auto& c = out[s.domains[i].group];
    c.resize(size_t(V), 0);
    const auto& sh = *s.shards[i];
    for (uint64_t t = 0; t < sh.n_tokens(); ++t) ++c[sh.token(t)];
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: bench_routing TRAIN_SHARDS [HELDOUT_SHARDS] [K ...]\n");
    return 2;
  }
  try {
    const auto train = data::ShardSet::open(argv[1], 0);
    const int64_t V = train.vocab_size;
    std::map<std::string, std::vector<int64_t>> held;
    int first_k = 2;
    if (argc > 2 && std::string(argv[2]).find_first_not_of("0123456789") != std::string::npos) {
      held = group_counts(data::ShardSet::open(argv[2], train.tokenizer_hash), V);
      first_k = 3;
    }
    std::vector<int> ks;
    for (int i = first_k; i < argc; ++i) ks.push_back(std::stoi(argv[i]));
    if (ks.empty()) ks = {4, 16};
    const auto counts = group_counts(train, V);
    fmt::print("vocab {}; expected load imbalance max/mean over experts (1 = balanced)\n", V);
    fmt::print("{:<8} {:>12} {:>4} {:>12} {:>12} {:>14} {:>14}\n", "group", "tokens", "K",
               "random", "frequency", "random(held)", "freq(held)");
    for (const auto& [group, c] : counts) {
      int64_t total = 0;
      for (int64_t n : c) total += n;
      for (int K : ks) {
        // The mean over 8 seeds for random tables (their imbalance varies with the seed).
        double rnd = 0, rnd_held = 0;
        for (uint64_t seed = 1; seed <= 8; ++seed) {
          const auto t = random_routing_table(V, K, seed, 0, group);
          rnd += expected_imbalance(t, K, c) / 8;
          if (held.count(group)) rnd_held += expected_imbalance(t, K, held[group]) / 8;
        }
        const auto f = frequency_routing_table(c, K, 1, 0, group);
        const double fr = expected_imbalance(f, K, c);
        const double fr_held = held.count(group) ? expected_imbalance(f, K, held[group]) : 0;
        fmt::print("{:<8} {:>12} {:>4} {:>12.3f} {:>12.3f} {:>14.3f} {:>14.3f}\n", group, total, K,
                   rnd, fr, rnd_held, fr_held);
      }
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_routing: {}\n", e.what());
    return 1;
  }
  return 0;
}
