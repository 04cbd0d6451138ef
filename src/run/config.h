// The whole run's configuration: one typed struct per concern, registered in one Options
// table (JSON file, --set, help and the copy stored in checkpoints all come from it).
#pragma once
#include <string>
#include <vector>

#include "core/options.h"
#include "model/config.h"
#include "optim/adamw.h"

namespace sigma {

struct TrainConfig {
  int64_t steps = 3000;
  int batch = 24;          // rows per micro-batch
  int accum = 1;           // micro-batches per optimizer step
  int global_batch = 0;    // rows per optimizer step over all ranks (0 = batch x accum)
  uint64_t seed = 1;
  int log_every = 50;
  int eval_rows = 240;     // held-out rows per domain at evaluation
  int64_t eval_every = 0;  // steps between held-out evaluations during the run (0 = only at the end)
  int64_t ckpt_every = 0;  // 0 = only at the end (when an output directory is given)
  int64_t keep_checkpoints = 0;  // newest step checkpoints kept (0 = all)
  int64_t keep_every = 0;        // also kept: those whose step is a multiple of this (0 = none)
  bool ckpt_async = true;  // checkpoints written by a background thread from a snapshot
  int threads = 0;         // 0 = every core (more than the machine has are capped to it)
  float max_minutes = 0;  // stop with a checkpoint after the step that passes it (0 = none)
  int max_nonfinite_steps = 10;  // consecutive skipped non-finite steps before the run stops
  std::string experts = "auto";  // where RRE experts train: auto, ecss, vanilla, model
  std::string expert_store;      // ECSS store file ("" = RAM)
  std::string expert_memory = "auto";  // ECSS compute buffers: bytes ("6GiB") or auto
  std::vector<std::string> freeze;  // parameter sets not to update (src/train/freeze.h)
  std::string backend = "cpu";   // ops backend (kernels/ops.h): cpu or ref
  std::string precision = "fp32";  // GEMM precision (ops::use_precision): fp32 or bf16
  std::string remat = "none";      // what backward recomputes (model/activations.h, Remat)
  void describe(Options& o, const std::string& prefix);
};

struct DataConfig {
  std::string source = "synthetic";  // "synthetic" (built in) or "shards"
  std::string path;                  // directory made by `sigma prepare` (source = shards)
  std::string eval_path;             // held-out directory made by `sigma prepare` (optional)
  std::string tokenizer;             // tokenizer file; default: the one the shards name
  bool finetune = false;             // one sample per row (padded) instead of packed windows
  bool mask_prompt = false;          // fine-tuning: no loss on prompt tokens
  std::vector<std::string> domains;  // synthetic source: train on these domains only (empty = all)
  nlohmann::json sampler = nlohmann::json::object();  // data::SamplerConfig (weights, stages)
  void describe(Options& o, const std::string& prefix);
};

// Distributed runs (mpirun -np R sigma train; docs/distributed.md).
struct DistConfig {
  float timeout_s = 300;  // a collective that waits longer ends the run: a rank died or hangs
  int ckpt_writers = 4;   // ranks writing their checkpoint files at the same time
  std::string ckpt_layout = "sharded";  // sharded: each rank's pieces; whole: tensors assembled whole
                                        // (a one-process run always writes whole: nothing to shard)
  std::string placement = "spread";  // expert groups over ranks (train.experts = parallel)
  int tp = 1;  // tensor-parallel ranks per group (adjacent ranks; parallel/grid.h)
  int zero = 1;  // ZeRO stage over the data group: 1 shards the Adam state, 2 the gradients too, 3 the values too
  bool overlap = true;  // ZeRO's exchanges hidden behind backward and the next forward
  float overlap_mib = 0;  // exchange buffers in flight with overlap, per rank (0 = the stage's default)
  void describe(Options& o, const std::string& prefix);
};

struct Config {
  ModelConfig model;
  OptimConfig optim;
  TrainConfig train;
  DataConfig data;
  DistConfig dist;

  // The defaults are the no-argument main job: a mixed PanGu-Σ model on the synthetic data,
  // one shared block under two RRE blocks, one expert group per synthetic domain.
  Config();
  Config(const Config&) = default;
  Config& operator=(const Config&) = default;

  // The option table over this object's fields (valid while this object lives, unmoved).
  Options options();
  nlohmann::json to_json();
  // Applies a JSON config file (if path non-empty) then each key=value, in order.
  void load(const std::string& path, const std::vector<std::string>& sets);
  void apply(const nlohmann::json& j, const std::string& source);
};

}  // namespace sigma
