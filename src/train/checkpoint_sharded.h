// Sharded checkpoints (dist.ckpt_layout = sharded, docs/checkpoints.md): each rank of a
// multi-rank run writes its own pieces (io/checkpoint_shards.h) instead of a tp group's rank 0
// writing tensors assembled whole.
#pragma once
#include <string>

#include "dist/communicator.h"
#include "ecss/expert_files.h"
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

}  // namespace sigma
