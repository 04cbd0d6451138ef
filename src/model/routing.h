// Routing tables of Random Routed Experts (DESIGN §2): R[l][g] maps every token id of the
// vocabulary to one of group g's K experts in RRE block l. Tables are data: built once from a
// seed (or from corpus token counts), stored in checkpoints as int32 tensors `routing.{l}.{g}`
// (names::routing).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sigma {

// Token counts [V] per group name, for frequency-balanced tables.
using TokenCounts = std::map<std::string, std::vector<int64_t>>;

// A seeded random permutation of 0..V-1, independent per (block, group) through its own RNG
// stream (Fisher-Yates on the counter RNG).
std::vector<int32_t> routing_permutation(int64_t V, uint64_t seed, int block,
                                         const std::string& group);

// Default table: the seeded permutation dealt round-robin to K experts, so every expert gets
// floor(V/K) or ceil(V/K) ids.
std::vector<int32_t> random_routing_table(int64_t V, int K, uint64_t seed, int block,
                                          const std::string& group);

// Frequency-balanced table: ids in decreasing count (ties in the order of the seeded
// permutation) each go to the expert with the least token load so far (ties: fewer ids, then
// lower index). counts has V entries.
std::vector<int32_t> frequency_routing_table(const std::vector<int64_t>& counts, int K,
                                             uint64_t seed, int block, const std::string& group);

// Expected load imbalance of a table under a token distribution: max over experts of the
// expected tokens it receives divided by the mean over experts (1 = perfect balance).
double expected_imbalance(const std::vector<int32_t>& table, int K,
                          const std::vector<int64_t>& counts);

}  // namespace sigma
