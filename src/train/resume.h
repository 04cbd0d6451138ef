// Starting and continuing a run (`sigma train`, `--resume`): paths fixed when a run starts, and
// what a resumed run's changed config changes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "run/checkpoint.h"
#include "run/config.h"
#include "run/data_source.h"

namespace sigma {

// The config of `train --resume`: the checkpoint's, then the keys of `config_file` (if any:
// data, train and optim keys; a model key must equal the checkpoint's, since the model comes
// from it, and the error names the key), then each --set.
Config resume_config(const Config& checkpoint, const std::string& config_file,
                     const std::vector<std::string>& sets);

// "" when `now` has the model config of the checkpoint `was`; else a short line naming the
// first differing keys with both values ("model.d_model is 32 here but 16 in the checkpoint"),
// for the refusal of a resumed run whose model changed.
std::string model_difference(const Config& was, const Config& now);

// Makes a relative train.expert_store absolute against the current directory (the config and
// so every checkpoint store it that way, and a resumed run opens the same file from any
// directory). Returns whether it was relative.
bool make_store_path_absolute(Config& c);
// The same for the data paths (data.path, data.eval_path, data.tokenizer), so that a resumed
// run reads the same shards from any directory.
void make_data_paths_absolute(Config& c);

// Steps the learning-rate schedule spans: optim.schedule_steps, else train.steps.
int64_t schedule_total(const Config& c);

// "" when a run resumed at `step` keeps its learning-rate schedule (or has not started: step 0,
// e.g. a surgery output); else one line saying what changes (schedule length, optim.lr,
// optim.warmup, optim.min_lr_ratio), the next step's lr under each, and, when the length
// changed, how to keep the original schedule (optim.schedule_steps).
std::string schedule_change(const Config& before, const Config& after, int64_t step);

// `train --resume`: refuses training data whose token ids come from another tokenizer than the
// checkpoint's (the same check as `sigma eval`, run/data_source.h), a `data.path` pointed at
// other shards or the old shards of a checkpoint whose vocabulary `sigma inherit --tokenizer`
// grew, naming both tokenizers and the commands that prepare shards the checkpoint can read.
void check_resume_tokenizer(const CheckpointInfo& ck, const DataSource& data, const Config& cfg);

}  // namespace sigma
