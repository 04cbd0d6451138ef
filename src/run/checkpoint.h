// Reading a checkpoint (DESIGN §6): its config and trainer state, its tensors, a model ready
// for inference. Below train/ so that the commands that only read one (eval, generate, serve,
// inspect) do not link the training layer; writing is train/checkpoint.h.
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "io/safetensors.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "run/config.h"

namespace sigma {

inline constexpr const char* kModelFormat = "sigma-model";  // model.safetensors' "format"
inline constexpr const char* kTokenizerFile = "tokenizer.json";

struct TrainerState {
  int64_t step = 0;    // optimizer steps completed
  int64_t tokens = 0;  // tokens trained on so far
  nlohmann::json data_cursor;  // DataSource::cursor() (null for index-addressed data)
  // Where a surgery output came from (command, source checkpoint, its step and tokens, ...);
  // null for a model trained from scratch. Kept by the runs resumed from it.
  nlohmann::json origin;
};

// Every weight of a checkpoint under its in-model name: model.safetensors plus the expert
// group files.
TensorMap read_model_tensors(const std::string& dir);
// Every optimizer tensor: optimizer.safetensors plus the expert groups' Adam files.
TensorMap read_optimizer_tensors(const std::string& dir);
// Bytes of a checkpoint's weights (model.safetensors and the expert groups' weight files).
int64_t checkpoint_model_bytes(const std::string& dir);

// Runs read(dir) on the checkpoint `path` resolves to (io/checkpoint_dir.h) and returns that
// dir. A root's checkpoint can vanish while it is read: a live run committed a newer one and
// retention pruned this one. Then read runs again on the checkpoint the root names now (at
// most 8 times): when the checkpoint is gone, or (retention deletes file by file) the root
// names another one now. An error of the checkpoint the root still names, or of a checkpoint
// `path` names itself, is thrown as it is.
std::string read_checkpoint(const std::string& path, const std::function<void(const std::string& dir)>& read);

// Resolves `path` (a checkpoint, or a root with `latest`), verifies its checksums and reads
// its config and trainer state.
struct CheckpointInfo {
  std::string dir;
  Config cfg;
  TrainerState state;
};
CheckpointInfo open_checkpoint(const std::string& path);

// Copies the checkpoint's tensors into `model` / `opt`; every tensor must exist with the
// same shape (the error names the first that does not). A model with external experts (ECSS)
// leaves the expert tensors (blocks.*.rre.*) unread: EcssExperts::load reads them.
void load_model(Model& model, const std::string& dir);
void load_optimizer(AdamW& opt, const ParamSet& params, const std::string& dir);
// The state of `model`'s parameters: with a tensor-parallel model (Model::tp) each tensor
// split over the group is read whole and this rank's slice kept (model/tensor_parallel.h), so
// a checkpoint loads at any dist.tp.
void load_optimizer(AdamW& opt, const Model& model, const std::string& dir);

// The model of a checkpoint, ready for inference; `info` receives its config and state.
std::unique_ptr<Model> load_checkpoint_model(const std::string& path, CheckpointInfo* info = nullptr);

// The tokenizer file stored in checkpoint `dir`, or "" when it holds none.
std::string checkpoint_tokenizer_path(const std::string& dir);

// The data registry a checkpoint carries beside its tokenizer: {"domains": [...]} as the
// prepared data's manifest.json had them (prefix controls, line tags, format), so that eval
// formats text as training did after the shards are gone. Written for a run on prepared shards
// (from their manifest.json) and for a checkpoint made from one that carries it.
inline constexpr const char* kDataDomainsFile = "data_domains.json";
// Its "domains" array, or nullopt for a checkpoint without one (older, or token-id data).
std::optional<nlohmann::json> checkpoint_data_domains(const std::string& dir);

}  // namespace sigma
