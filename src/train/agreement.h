// Agreement at start-up (mpirun -np R sigma train): every rank must run the same config on
// the same data with the same binary, or the ranks train a silent mixture (a dense model) or
// die in a collective of mismatched sizes. Before the first step the ranks compare digests of
// all three; on a mismatch every rank stops, and rank 0 prints one line naming the first key
// that differs and which ranks hold which value.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "run/config.h"
#include "run/data_source.h"

namespace sigma {

// What the ranks compare, in order: (key, value). "sigma binary" (a hash of this executable),
// "data manifest" (the data's domains, tokenizer and, for shards, each file's name, size and
// a hash of its head), then every resolved config key.
std::vector<std::pair<std::string, std::string>> start_up_record(Config& cfg, const DataSource& data);

// Collective: compares `record` over the ranks. Returns when they agree; otherwise rank 0
// throws sigma::Error with the one line and the other ranks wait for its abort (the caller's
// error path ends every rank: apps/sigma.cpp).
void check_ranks_agree(Communicator& comm, const std::vector<std::pair<std::string, std::string>>& record);

// Collective, after rank 0 created `dir` (--out): every rank must see it, since every rank
// writes its checkpoint files into it (a filesystem all hosts share). Rank 0 writes a file
// with a fresh token there; every rank reads it back. Throws Refusal (printed once) on every
// rank, naming the ranks and hosts that cannot see it.
void check_ranks_see_dir(Communicator& world, const std::string& dir);

// The one line for the first key where `values` (one per rank) differ, "" if none differ.
std::string disagreement(const std::string& key, const std::vector<std::string>& values);

}  // namespace sigma
