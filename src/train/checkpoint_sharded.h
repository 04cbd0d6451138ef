// Sharded checkpoints (dist.ckpt_layout = sharded, docs/checkpoints.md): each rank of a
// multi-rank run writes its own pieces (io/checkpoint_shards.h) instead of a tp group's rank 0
// writing tensors assembled whole.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "ecss/expert_files.h"
#include "io/checkpoint_dir.h"
#include "io/checkpoint_shards.h"
#include "optim/adamw.h"
#include "run/checkpoint.h"

namespace sigma {

// Every rank of the run calls it (collective over `data` and `tp`, the rank's data and tensor-
// parallel groups). Rank i = data rank * tp + tp rank writes shard_file(i, false/true):
//   - weights: each parameter's tp slice (a replicated one on one tp rank), the parameters
//     dealt over the data ranks largest first to the least loaded (every rank knows the deal);
//   - Adam state: the parameters this rank owns under ZeRO, sliced like the weights;
//   - experts (`experts`, expert parallel): this rank's experts' tp slices;
// and data rank 0, tp rank 0 the buffers, trainer.json, the tokenizer and data registry.
// At most dist.ckpt_writers ranks write at a time. Every rank's file sizes and checksums go to
// that rank, which records them in the manifest (version 2, "layout": "sharded") and commits
// as CheckpointWriter does: the checkpoint counts only once every rank's files are written and
// the manifest names them. A rank that fails to write makes every rank throw, and the
// temporary directory goes. Returns ROOT/step-N.
std::string save_sharded_checkpoint(const std::string& root, Config& cfg, const Model& model,
                                    const AdamW* opt, const TrainerState& st,
                                    const std::string& tokenizer_path, ExpertFiles* experts,
                                    Communicator& data, Communicator& tp);

// The same save in three parts, so that the middle one can run on a writer thread
// (train/checkpoint_sharded_async.h): begin (collective: what each rank writes, the lead's
// temporary directory to every rank), write (this rank's files, no communication), finish
// (collective: every rank's record to the lead, which commits, or every rank's error).
struct ShardedSave {
  std::string root, name;
  int index = 0, ranks = 1, tp = 1;  // this rank's shard, data ranks x tp ranks, tp ranks
  bool lead = false;                 // data rank 0, tp rank 0: commits
  bool adam = false;                 // an optimizer: the Adam shard files are written too
  ShardContents mine;                // views of what this rank writes (and copies)
  nlohmann::json config;             // the run's config, for the weight files' metadata
  std::optional<CheckpointWriter> writer;  // the lead's (from begin), a peer's (from write)
  std::string tmp;                   // the lead's temporary directory ("" when it failed)
  std::string error;                 // this rank's failure, said by it
  std::vector<double> record;        // written?, sizes and checksums of its two files
};

std::unique_ptr<ShardedSave> begin_sharded_save(const std::string& root, Config& cfg,
                                                const Model& model, const AdamW* opt,
                                                const TrainerState& st, ExpertFiles* experts,
                                                Communicator& data, Communicator& tp);
// This rank's two shard files added to `w`: a CheckpointWriter, or a SaveSnapshot
// (train/checkpoint_async.h) that copies their bytes now and writes them later.
template <class W>
void add_shard_files(W& w, const ShardedSave& s) {
  w.add_safetensors(shard_file(s.index, false), s.mine.model,
                    {{"format", kModelFormat}, {"version", "1"}, {"config", s.config.dump()},
                     {kPiecesKey, pieces_metadata(s.mine.model_pieces)}});
  if (s.adam)
    w.add_safetensors(shard_file(s.index, true), s.mine.adam,
                      {{"format", "sigma-adamw"}, {"version", "1"},
                       {kPiecesKey, pieces_metadata(s.mine.adam_pieces)}});
}

// This rank's files: `files` adds them (its two shard files; the lead's run files too) to the
// rank's writer; a failure is kept in s.error.
void write_sharded_files(ShardedSave& s, const std::function<void(CheckpointWriter&)>& files);
// Collective: commits (the lead) once every rank wrote, else throws on every rank naming the
// rank that failed; `s` goes either way (a failed save's temporary directory with it).
std::string finish_sharded_save(std::unique_ptr<ShardedSave> s, ExpertFiles* experts,
                                Communicator& data, Communicator& tp);

}  // namespace sigma
