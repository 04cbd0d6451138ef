// Subcommand registry: each apps/cmd_*.cpp registers its subcommands at static-init time, so
// adding a command never touches another command's file.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/ops.h"

namespace sigma::cli {

// `add` creates the subcommand on the root app and sets its callback (which may throw sigma::Error).
using AddCommand = std::function<void(CLI::App& root)>;

std::vector<AddCommand>& commands();

struct RegisterCommand {
  explicit RegisterCommand(AddCommand add) { commands().push_back(std::move(add)); }
};

// Options given on the command line that the command's mode ignores are refused, not dropped:
// the first of `options` that `c` was given is an error naming it and `why` (the mode).
// What every --ckpt (and train's --resume) takes: resolve_checkpoint (io/checkpoint_dir.h).
inline constexpr const char* kCkptForms = "a checkpoint, a checkpoints/ root, or a run's folder (train --out)";

inline void refuse_given(const CLI::App& c, std::initializer_list<const char*> options,
                         const std::string& why) {
  for (const char* o : options)
    SIGMA_CHECK(c.count(o) == 0, "{} does not apply: {}", o, why);
}

// --backend for the commands that read a checkpoint (eval, generate, serve), as train.backend is
// for training (docs/ops.md): installed before the model loads, so its tensors are the backend's.
inline void add_backend_option(CLI::App& c, std::string& backend) {
  c.add_option("--backend", backend,
               "Kernel backend, one of " + ops::backend_names() + ": cpu (default), ref (naive "
               "loops in double: slow, a check), guard (the cpu kernels over memory host code "
               "cannot touch: proves the command device-clean)")
      ->check(CLI::IsMember(ops::backend_list()));
}

// --kv-cache for the commands that generate or score through a KV cache (eval, generate, serve):
// the type of its keys and values (Model::use_kv_cache). auto, the default, follows the
// weights, as serving systems' automatic cache type does: fp32 weights keep an fp32 cache, bf16
// and int8 weights (which already round what they multiply) get a bf16 cache, half the bytes a
// step's attention reads (docs/usage.md `generate`).
inline void add_kv_cache_option(CLI::App& c, std::string& kv_cache) {
  c.add_option("--kv-cache", kv_cache,
               "Type of the KV cache's keys and values: auto (default: fp32 with fp32 weights, "
               "bf16 with bf16 or int8 weights), fp32, or bf16: half the bytes a decode step's "
               "attention reads and a cache holds, each key and value rounded once to bf16 as it "
               "is cached (attention itself stays fp32)")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}));
}
// The cache type --kv-cache names with weights of `precision` (--precision): auto resolved.
inline std::string kv_cache_type(const std::string& kv_cache, const std::string& precision) {
  return kv_cache != "auto" ? kv_cache : precision == "fp32" ? "fp32" : "bf16";
}
inline DType kv_cache_dtype(const std::string& name) { return name == "bf16" ? DType::BF16 : DType::F32; }

}  // namespace sigma::cli
