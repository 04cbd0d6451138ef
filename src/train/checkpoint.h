// Writing training checkpoints (DESIGN §6) on top of io/checkpoint_dir.h: which tensors go
// where. Reading them back, with every name and shape checked, is run/checkpoint.h.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "run/checkpoint.h"
#include "dist/communicator.h"
#include "ecss/ecss_experts.h"
#include "train/checkpoint_async.h"
#include "io/checkpoint_dir.h"

namespace sigma {

// Writes ROOT/step-NNNNNNNN atomically and moves ROOT/latest to it; returns its path. With
// `experts` (ECSS, expert parallel) the experts and their Adam state go into one pair of files
// per expert group (ecss/expert_files.h), under the tensor names an in-model checkpoint uses,
// plus per-expert step counts.
// With `comm` of R > 1 ranks every rank calls it: rank 0 writes the model, trainer state and
// its optimizer shard, rank r its shard (optimizer.rank-R.safetensors), at most
// dist.ckpt_writers ranks at a time; rank 0 commits one manifest over all of them.
// With a tensor-parallel group `tp` of P > 1 ranks (comm: the data group), every tensor split
// over it is written whole (gathered from the group's slices), by the group's rank 0: the
// checkpoint is the one a tp = 1 run of comm's size writes, and loads at any tp.
std::string save_checkpoint(const std::string& root, Config& cfg, const Model& model,
                            const AdamW* opt, const TrainerState& st,
                            const std::string& tokenizer_path = "",
                            ExpertFiles* experts = nullptr, Communicator* comm = nullptr,
                            Communicator* tp = nullptr);

// Whether save_checkpoint writes the sharded layout (each rank its own pieces): dist.ckpt_layout
// = sharded on more than one rank (`ranks`: data ranks times tp ranks), with experts that can
// go as pieces. Under dist.zero = 3 that save reads only each rank's own values.
bool saves_sharded(const Config& cfg, int ranks, const ExpertFiles* experts);

// trainer.json (step, tokens, config, data cursor, origin), the tokenizer and the data
// registry: the files rank 0 adds to every checkpoint, whatever its layout.
void add_run_files(CheckpointWriter& w, Config& cfg, const TrainerState& st,
                   const std::string& tokenizer_path);
// The same files taken into a background save's snapshot (written by its writer thread).
void add_run_files(SaveSnapshot& s, Config& cfg, const TrainerState& st,
                   const std::string& tokenizer_path);

// "step-NNNNNNNN", a training checkpoint's directory name.
std::string checkpoint_name(int64_t step);

// A background save (train/checkpoint_async.h) of a one-process run: the files save_checkpoint
// writes, taken into `files` now. The model's and optimizer's tensors are copied; an ECSS
// store's experts are read by the writer (EcssExperts::checkpoint_later).
void snapshot_checkpoint(SaveSnapshot& files, Config& cfg, const Model& model, const AdamW* opt,
                         const TrainerState& st, const std::string& tokenizer_path,
                         EcssExperts* experts);

}  // namespace sigma
