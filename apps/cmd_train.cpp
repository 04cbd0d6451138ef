// sigma train: trains a model (the built-in synthetic data by default) and prints each
// domain's held-out loss beside its optimum.
#include <fmt/format.h>

#include <csignal>

#include "command.h"
#include "core/refusal.h"
#include "train/checkpoint.h"
#include "train/resume.h"
#include "train/trainer.h"

namespace sigma::cli {
namespace {

struct TrainArgs {
  std::string config, out, resume, expert_store, freeze;
  std::vector<std::string> sets;
  int64_t stop_at = -1;
  bool quiet = false, overwrite = false, print_config = false, config_help = false;
};

// Before the world communicator exists (it is made from the loaded config), Open MPI's launcher
// has told each process its rank: the config's warnings are said once, by rank 0.
bool first_rank() {
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  return !r || std::atoi(r) == 0;
}

// The run's config: a fresh run's file and --set keys, or a resumed run's checkpoint config,
// file (data and training keys) and --set keys, with a warning when its learning-rate schedule
// changes. Relative expert store and data paths are made absolute here, so a resumed run opens
// the same files from any directory.
Config load_config(const TrainArgs& a) {
  Config cfg;
  if (a.resume.empty()) {
    cfg.load(a.config, a.sets);
    make_store_path_absolute(cfg);
    make_data_paths_absolute(cfg);
    return cfg;
  }
  const CheckpointInfo ck = open_checkpoint(a.resume);
  cfg = resume_config(ck.cfg, a.config, a.sets);
  const std::string change = schedule_change(ck.cfg, cfg, ck.state.step);
  if (!change.empty() && first_rank()) fmt::print(stderr, "sigma train: warning: {}\n", change);
  const bool from_checkpoint = cfg.train.expert_store == ck.cfg.train.expert_store;
  if (make_store_path_absolute(cfg) && from_checkpoint && first_rank())  // an older sigma's
    fmt::print(stderr, "sigma train: warning: the checkpoint names its expert store by the "
               "relative path '{}'; using {} (pass --expert-store to choose)\n",
               ck.cfg.train.expert_store, cfg.train.expert_store);
  make_data_paths_absolute(cfg);  // a checkpoint of an older sigma: against this directory
  return cfg;
}

void run_train(TrainArgs a) {
  if (!a.expert_store.empty()) a.sets.push_back("train.expert_store=" + a.expert_store);
  if (!a.freeze.empty()) a.sets.push_back("train.freeze=" + nlohmann::json(a.freeze).dump());
  Config cfg;
  if (a.config_help) {
    fmt::print("Config keys (JSON file via --config, or --set key=value):\n{}", cfg.options().help());
    return;
  }
  try {  // every rank reads the same files and keys: a bad one is said once (core/refusal.h)
    cfg = load_config(a);
  } catch (const Refusal&) {
    throw;
  } catch (const Error& e) {
    throw Refusal(e.what());
  }
  if (a.print_config) {
    fmt::print("{}\n", cfg.to_json().dump(2));
    return;
  }
  // mpirun -np R sigma train: every rank runs this; rank 0 prints (docs/distributed.md).
  const std::unique_ptr<Communicator> world = make_world(cfg.dist.timeout_s);
  RunOptions run{a.out, a.resume, a.stop_at, !a.quiet, a.overwrite, world.get()};
  TrainSummary s = train(cfg, run);
  if (world->rank() != 0) return;
  if (s.stopped_by) {  // a signal or train.max_minutes: saved, not evaluated; exit 0
    fmt::print("stopped by {} after step {} with a checkpoint{}\n", stop_reason(s.stopped_by), s.steps,
               a.out.empty() ? "" : "; continue with --resume " + a.out + "/checkpoints");
    return;
  }
  // Training tokens/s: the held-out evaluations' time is counted apart.
  fmt::print("trained {} steps, {} tokens, {:.0f} tokens/s ({:.1f} s training; held-out "
             "evaluation {:.1f} s apart)\n", s.steps, s.tokens, s.tokens_per_s, s.seconds,
             s.eval_seconds);
  fmt::print("{:<12} {:>10} {:>10} {:>10}\n", "domain", "loss", "optimum", "gap");
  for (const auto& d : s.domains) {
    if (d.optimum)
      fmt::print("{:<12} {:>10.4f} {:>10.4f} {:>10.4f}\n", d.name, d.loss, *d.optimum,
                 d.loss - *d.optimum);
    else
      fmt::print("{:<12} {:>10.4f} {:>10} {:>10}\n", d.name, d.loss, "-", "-");
  }
  if (!s.expert_mode.empty()) {
    const OffloadStats& o = s.offload;
    fmt::print("experts ({}): {:.1f} per step; of {:.1f} s training, gather {:.2f} s, prefetch wait "
               "{:.2f} s, Adam {:.2f} s\n", s.expert_mode,
               o.steps ? double(o.experts_updated) / o.steps : 0.0, s.seconds, o.gather_s, o.wait_s,
               o.update_s);
  }
  if (s.expert_load.empty()) return;
  // Imbalance: most loaded expert over the mean of its group (1 = balanced), worst group.
  fmt::print("expert load (training tokens per expert)\n{:<6} {:<12} {:>9}  {}\n", "block",
             "group", "imbalance", "tokens per expert");
  for (const BlockLoad& b : s.expert_load)
    for (size_t g = 0; g < b.tokens.size(); ++g) {
      BlockLoad one{b.block, {b.tokens[g]}};
      fmt::print("{:<6} {:<12} {:>9.3f}  {}\n", b.block, cfg.model.groups[g].name,
                 one.imbalance(), fmt::join(b.tokens[g], " "));
    }
  if (cfg.model.gated())
    for (const BlockLoad& b : s.expert_load)
      fmt::print("block {}: {} (token, choice) pairs dropped over capacity\n", b.block, b.dropped);
}

const RegisterCommand reg_train([](CLI::App& root) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* c = root.add_subcommand("train", "Train a model (default: the built-in synthetic data)");
  c->add_option("--config", args->config, "JSON config file (with --resume: data and training "
                "keys over the checkpoint's config)")->check(CLI::ExistingFile);
  c->add_option("--set", args->sets, "Override a config key: key=value (repeatable)");
  c->add_option("--out", args->out, "Output directory: metrics.jsonl, summary.json, checkpoints/");
  c->add_option("--resume", args->resume, fmt::format("Continue from {}", kCkptForms));
  c->add_option("--stop-at", args->stop_at, "Stop (and checkpoint) after this step");
  c->add_option("--expert-store", args->expert_store,
                "ECSS: keep experts and their Adam state in this memory-mapped file "
                "(train.expert_store; default: RAM)");
  c->add_option("--freeze", args->freeze,
                "Parameter sets not to update, comma-separated: shared, embeddings, experts or a "
                "tensor-name prefix (train.freeze)");
  c->add_flag("--overwrite", args->overwrite, "Start afresh even when --out already holds a run "
              "(its checkpoints, metrics.jsonl and summary.json are deleted first)");
  c->add_flag("--quiet", args->quiet, "No progress lines");
  c->add_flag("--print-config", args->print_config, "Print the resolved config and exit");
  c->add_flag("--config-help", args->config_help, "List every config key and exit");
  c->callback([args] { run_train(*args); });
});

}  // namespace
}  // namespace sigma::cli
