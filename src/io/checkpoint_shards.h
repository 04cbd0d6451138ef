// Sharded checkpoints (docs/checkpoints.md, "Sharded checkpoints"): each rank of a multi-rank
// run writes its own pieces of the tensors, and readers assemble them whole.
//
// A sharded checkpoint's manifest has version 2 and "layout": "sharded". Rank i (i = data rank
// * tp + tp rank) writes shard-IIII.model.safetensors (weights) and shard-IIII.adam.safetensors
// (Adam state). Every tensor is stored under its in-model name; a piece of a larger tensor is
// described in the file's metadata ("sigma.pieces": {name: [dim, parts, tp, rank, first,
// count, experts]}):
//   - a tensor-parallel slice: the whole tensor's dimension `dim` is `parts` equal blocks, each
//     cut into `tp` slices, and the piece holds slice `rank` of every block (model/
//     tensor_parallel.h's TpSplit; dim = -1: not split);
//   - a range of experts: the piece holds experts [first, first + count) of `experts` along
//     dimension 0 (experts = 0: all of them).
// The geometry is data, so this layer assembles any piece without the model's tables; the
// writer (train/checkpoint.h) takes it from them.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace sigma {

inline constexpr int kShardedManifestVersion = 2;
inline constexpr const char* kPiecesKey = "sigma.pieces";

struct TensorPiece {
  int dim = -1, parts = 1, tp = 1, rank = 0;  // tensor-parallel slice (dim < 0: none)
  int64_t first = 0, count = 0, experts = 0;  // expert range along dim 0 (experts = 0: none)
};

// What one rank writes into its two shard files: views of its tensors (whole ones or pieces)
// and the pieces' geometry; `keep` holds bytes the views point into (copies, downloads).
struct ShardContents {
  std::vector<TensorRef> model, adam;
  std::map<std::string, TensorPiece> model_pieces, adam_pieces;
  std::deque<Tensor> keep;  // stable addresses as it grows
};

// "shard-IIII.model.safetensors" / "shard-IIII.adam.safetensors".
std::string shard_file(int index, bool adam);
// The "sigma.pieces" metadata value for a file's pieces.
std::string pieces_metadata(const std::map<std::string, TensorPiece>& pieces);

// True when `dir`'s manifest says the checkpoint is sharded.
bool is_sharded_checkpoint(const std::string& dir);
// The shard files of `dir` (weights or Adam), from its manifest, in rank order.
std::vector<std::string> sharded_files(const std::string& dir, bool adam);

// Every tensor of a sharded checkpoint's weights (or Adam state) as one file would hold it:
// `index` has every tensor's whole shape, `tensors` the wanted ones assembled whole. Throws
// naming the tensor, the piece and the files when a piece is missing, repeated or does not
// fit the others.
Safetensors read_sharded(const std::string& dir, bool adam,
                         const std::function<bool(const std::string&)>& want = nullptr);

// Where a reader takes tensors from: one file (`path`), or a sharded checkpoint's weights or
// Adam shards assembled (`sharded_dir`). The expert loaders read either.
struct TensorSource {
  std::string path{};         // a file; or
  std::string sharded_dir{};  // a sharded checkpoint
  bool adam = false;
  std::string label() const;  // for messages: the file, or "DIR/shard-*.{model,adam}.safetensors"
  bool exists() const;        // the file exists, or the checkpoint has such shards
  Safetensors read(const std::function<bool(const std::string&)>& want = nullptr) const;
};

}  // namespace sigma
