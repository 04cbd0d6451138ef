// A checkpoint as `sigma serve` loads it: the model, its tokenizer and its data registry, all
// three from one checkpoint directory, read under read_checkpoint's retry (run/checkpoint.h).
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "data/tokenizer.h"
#include "model/domains.h"
#include "model/model.h"
#include "run/checkpoint.h"

namespace sigma {

struct CheckpointBundle {
  CheckpointInfo info;
  std::unique_ptr<Model> model;
  std::optional<data::Tokenizer> tok;          // none: a model of token ids (synthetic data)
  std::optional<DomainRegistry> data_domains;  // text prompts get their domain's prefix
};

// `path`: a checkpoint or a checkpoints/ root. Retention pruning the checkpoint `latest` named
// while it loads makes all three parts come from the one `latest` names next, never a mix;
// any other error is thrown as it is (naming its file). `after_model(dir)`: called each time
// the model of `dir` is read, before its tokenizer and registry are (tests stage the race there).
CheckpointBundle load_checkpoint_bundle(
    const std::string& path, const std::function<void(const std::string& dir)>& after_model = {});

}  // namespace sigma
