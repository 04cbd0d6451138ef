// The training loop: batches from a DataSource, forward/backward with gradient accumulation,
// global-norm clipping, AdamW with warm-up + cosine, progress, metrics and checkpoints.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/model.h"
#include "run/config.h"
#include "run/data_source.h"
#include "run/heldout.h"
#include "dist/communicator.h"
#include "ecss/ecss_experts.h"

namespace sigma {

struct RunOptions {
  std::string out_dir;      // metrics.jsonl, summary.json, checkpoints/ (empty = none)
  std::string resume;       // checkpoint to continue from (empty = fresh start)
  int64_t stop_at = -1;     // stop after this step (checkpointing it) instead of train.steps
  bool progress = true;     // progress lines on stderr
  bool overwrite = false;   // a fresh run may replace a run already in out_dir (--overwrite)
  // Fault injection for tests (train/nonfinite.h): called with the 0-based step before its
  // forward passes (may poison the micro-batches) and after each micro-batch's backward (may
  // poison gradients).
  Communicator* comm = nullptr;  // the run's ranks (mpirun); null = this process alone
  std::function<void(int64_t step, std::vector<Batch>& micro)> before_step = {};
  std::function<void(int64_t step, ParamSet& params)> after_backward = {};
  // Called with the step of a checkpoint as its files start to be written, on the thread
  // writing them (the training thread, or train.ckpt_async's writer).
  std::function<void(int64_t step)> saving = {};
};

struct TrainSummary {
  int64_t steps = 0, tokens = 0;
  double tokens_per_s = 0;  // training tokens over `seconds`
  std::vector<DomainLoss> domains;  // held-out losses at the end
  int64_t skipped_steps = 0;           // non-finite steps not applied (train/nonfinite.h)
  std::vector<BlockLoad> expert_load;  // tokens per expert per RRE block over this run's steps
  double seconds = 0;                  // wall time of the training steps (no evaluation)
  double eval_seconds = 0;             // of the held-out evaluations (eval_every, the end)
  std::string expert_mode;             // "ecss" / "vanilla", empty when experts are in the model
  OffloadStats offload;                // ECSS time split (this run's steps)
  // The signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) or kStoppedByTimeLimit (train.max_minutes)
  // that stopped the run after a step with a checkpoint (no evaluation then: `domains` is
  // empty); 0 = ran to the end.
  int stopped_by = 0;
};
inline constexpr int kStoppedByTimeLimit = -1;
// "SIGTERM", ..., or "the time limit (train.max_minutes)".
std::string stop_reason(int stopped_by);

// {"<block>": {"<group>": [tokens per expert], ...}, ...} and {"<block>": imbalance, ...}.
nlohmann::json expert_load_json(const std::vector<BlockLoad>& load, const ModelConfig& cfg);
nlohmann::json load_imbalance_json(const std::vector<BlockLoad>& load);

// This process's peak resident memory so far (VmHWM), MiB; 0 where /proc does not say.
double peak_rss_mib();

// The ECSS counters per step with this process's I/O and resident memory (Linux /proc): what a
// run over an expert store larger than RAM is judged by (docs/ecss.md, "Memory budget").
nlohmann::json offload_json(const OffloadStats& o, int64_t steps);

TrainSummary train(Config cfg, const RunOptions& run);

}  // namespace sigma
