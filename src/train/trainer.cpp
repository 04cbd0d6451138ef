#include "train/trainer.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <optional>
#include <cstdio>
#include <filesystem>

#include "core/progress.h"
#include "data/sampler.h"
#include "dist/communicator.h"
#include "parallel/grid.h"
#include "io/checkpoint_dir.h"
#include "kernels/ops.h"
#include "model/names.h"
#include "model/routing.h"
#include "optim/adamw.h"
#include "parallel/expert_parallel.h"
#include "run/heldout.h"
#include "train/agreement.h"
#include "train/checkpoint.h"
#include "train/checkpoint_sharded_async.h"
#include "train/freeze.h"
#include "train/nonfinite.h"
#include "train/preflight.h"
#include "train/resume.h"
#include "train/run_dir.h"
#include "train/stop_signals.h"
#include "train/train_step.h"

namespace sigma {

namespace {

using Clock = std::chrono::steady_clock;

void check_same_model(const Config& now, const Config& checkpoint) {
  const std::string diff = model_difference(checkpoint, now);
  SIGMA_CHECK(diff.empty(), "the model config differs from the checkpoint's: {}; a resumed run "
              "keeps the checkpoint's model (drop the model.* --set, or give it the checkpoint's "
              "value)", diff);
}

// Frequency-balanced routing tables come from the training data's token counts per group (a
// resumed run takes its tables from the checkpoint instead). Empty when not needed.
TokenCounts routing_counts(const Config& cfg, const DataSource& data, bool resuming) {
  TokenCounts group_counts;
  if (cfg.model.rre_layers == 0 || cfg.model.routing != "frequency" || resuming) return group_counts;
  const auto per_domain = data.domain_token_counts(cfg.model.vocab);
  SIGMA_CHECK(!per_domain.empty(), "model.routing = 'frequency' needs token counts, which "
              "data.source = '{}' does not provide; use model.routing = random", cfg.data.source);
  for (const auto& [name, counts] : per_domain) {
    auto& g = group_counts[cfg.model.domains[cfg.model.domain_index(name)].group];
    g.resize(counts.size(), 0);
    for (size_t i = 0; i < counts.size(); ++i) g[i] += counts[i];
  }
  return group_counts;
}

// Tokens per expert summed over the ranks (each counted its own micro-batches).
void sum_over_ranks(Communicator& comm, std::vector<BlockLoad>& load) {
  if (comm.size() == 1) return;
  std::vector<double> v;
  for (const BlockLoad& b : load) {
    for (const auto& g : b.tokens) v.insert(v.end(), g.begin(), g.end());
    v.push_back(double(b.dropped));
  }
  comm.all_reduce_sum(v.data(), int64_t(v.size()));  // integers below 2^53: exact
  size_t i = 0;
  for (BlockLoad& b : load) {
    for (auto& g : b.tokens)
      for (int64_t& x : g) x = int64_t(v[i++]);
    b.dropped = int64_t(v[i++]);
  }
}

// One training run: set-up, the loop of TrainSteps, metrics, checkpoints, final evaluation.
class RunLoop {
 public:
  RunLoop(Config cfg, const RunOptions& run);
  TrainSummary run();

 private:
  std::unique_ptr<RankGrid> open_data_and_agree();
  void claim_out_dir();
  void build();
  void build_expert_parallel();
  ExpertFiles* expert_files();  // the executor whose experts live outside the model, or null
  void restore();
  void open_outputs();
  void fetch(std::vector<Batch>& micro, int64_t step);
  void one_step(int64_t step, const StopSignals& signals);
  void log(double grad_norm, float lr, bool eval_now);
  bool eval_due(int64_t steps_done) const {
    return cfg_.train.eval_every > 0 && steps_done % cfg_.train.eval_every == 0;
  }
  std::vector<DomainLoss> held_out_losses();
  nlohmann::json exchange_since_last(int64_t steps);
  void checkpoint();
  bool save_in_flight() const {
    return (saver_ && saver_->in_flight()) || (sharded_saver_ && sharded_saver_->in_flight());
  }
  void collect_save(bool wait);
  void after_save();
  TrainSummary finish();
  void write_summary(const TrainSummary& sum);

  Config cfg_;
  RunOptions run_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<EcssExperts> experts_;  // ECSS / vanilla offload; null: experts in the model
  std::unique_ptr<ExpertParallel> parallel_;  // expert parallel: this rank's share of the experts
  ExpertMode mode_ = ExpertMode::InModel;
  SingleProcess one_process_;
  Communicator& world_;
  // The rank grid (parallel/grid.h): comm_ is this rank's data group (data and expert
  // parallelism), the world itself at dist.tp = 1; the model meets its tp group.
  std::unique_ptr<RankGrid> grid_;
  Communicator& comm_;
  bool lead_ = true;  // world rank 0: prints, writes metrics and the summary
  ShardPlan plan_;
  std::unique_ptr<TrainStep> step_;
  std::optional<CheckpointInfo> ck_;
  FreezePlan freeze_;
  TrainerState state_;
  int64_t last_ = 0;
  std::vector<std::string> names_;      // model domains (training losses are kept per these)
  std::vector<int32_t> data_to_model_;  // data domain index -> model domain index
  std::unique_ptr<RunDir> run_dir_;  // locked for the whole run
  NonfiniteGuard guard_{0};
  int stopped_by_ = 0;  // the signal that stopped the run after a step (its checkpoint saved)
  std::string ckpt_root_;
  bool tty_ = false;
  // ECSS reads step t+1's batches during step t to prefetch its experts.
  std::vector<Batch> micro_, next_;
  bool have_next_ = false;
  bool group_order_ = false;  // a step's micro-batches sorted by expert group (fetch)
  nlohmann::json cursor_after_step_;  // the data cursor before step t+1's batches were read
  double exchanged_[2] = {0, 0};      // expert exchange calls and bytes at the last log
  nlohmann::json exchange_summary_;   // the whole run's, for summary.json
  nlohmann::json tp_exchange_;        // tensor parallelism: rank 0's tp traffic per step
  // The logging window and this run's totals.
  DomainSums window_{0};
  double aux_window_ = 0;
  int64_t tokens_this_run_ = 0, steps_this_run_ = 0, steps_in_window_ = 0;
  std::vector<BlockLoad> run_load_;
  Clock::time_point t_start_;
  Clock::time_point t_created_ = Clock::now();  // train.max_minutes counts from here
  std::vector<double> peak_rss_;  // MiB, per rank (finish)
  std::unique_ptr<DataSource> held_out_;  // data.eval_path's windows (null: the data's own)
  std::optional<std::pair<int64_t, std::vector<DomainLoss>>> last_eval_;  // step and losses
  double eval_s_ = 0;  // wall time of held-out evaluations, kept out of training tokens/s
  // train.ckpt_async: the writer of background saves. Last: it waits for a save in flight
  // before the store and model it may read go.
  std::unique_ptr<BackgroundSaver> saver_;
  // train.ckpt_async on several ranks (sharded layout): each rank's writer; the ranks agree
  // at step boundaries (train/checkpoint_sharded_async.h).
  std::unique_ptr<ShardedBackgroundSaver> sharded_saver_;
  // Background saves of this run: started, steps begun while one was in flight, saves that
  // had to wait for the one before (train.ckpt_every shorter than a save) and the time waited.
  int64_t bg_saves_ = 0, bg_overlapped_ = 0, bg_waits_ = 0;
  double bg_wait_s_ = 0;
  double save_stall_s_ = 0;  // the training thread's time in saves between steps (summary.json)
};

// OpenMP threads per rank: train.threads, else the cores shared among the ranks on this node.
int threads_per_rank(int configured) {
  if (configured > 0) return configured;
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks_here = local ? std::max(1, std::atoi(local)) : 1;
  return std::max(1, omp_get_num_procs() / ranks_here);
}

// train.experts over the data group's ranks. With tp > 1, auto keeps the experts expert
// parallel even on one data rank (where it would pick ECSS): a per-process store cannot serve
// the ranks of a tp group.
ExpertMode expert_mode_of(const Config& cfg, int data_ranks, int tp) {
  const bool auto_parallel = tp > 1 && cfg.train.experts == "auto";
  return resolve_expert_mode(cfg.train.experts, cfg.model, auto_parallel ? 2 : data_ranks);
}

// The rank grid of dist.tp, checked against the run first (the tp-specific refusals name keys;
// the expert mode is resolved as build() will, over the data group's ranks).
std::unique_ptr<RankGrid> make_grid(const Config& cfg, Communicator& world) {
  const int tp = std::max(1, cfg.dist.tp);
  // A collective: every rank gathers the hosts, whatever its config says.
  const std::vector<std::string> hosts =
      world.size() > 1 ? hosts_of_ranks(world) : std::vector<std::string>{};
  if (world.size() % tp == 0) {
    check_tensor_parallel(cfg, world.size(),
                          expert_mode_name(expert_mode_of(cfg, world.size() / tp, tp)));
    if (!hosts.empty()) check_tp_within_hosts(hosts, tp);  // tp traffic stays inside a host
  }
  return std::make_unique<RankGrid>(world, tp);
}

RunLoop::RunLoop(Config cfg, const RunOptions& run)
    : cfg_(std::move(cfg)), run_(run), world_(run.comm ? *run.comm : one_process_),
      grid_(open_data_and_agree()), comm_(grid_->data()) {
  lead_ = world_.rank() == 0;  // (after the members' initialisers, which set it true)
  guard_ = NonfiniteGuard(cfg_.train.max_nonfinite_steps);
  // Each rank's share of the global batch, checked before anything is written.
  const std::string share = resolve_batch(cfg_.train, comm_.size());
  if (!share.empty() && lead_ && run_.progress) fmt::print(stderr, "sigma train: {}\n", share);
  // Rank 0's data group's hosts and its sums' path across them (dist/host_first.h), if any.
  const std::string hosts = comm_.host_layout();
  if (!hosts.empty() && lead_ && run_.progress) fmt::print(stderr, "sigma train: data group: {}\n", hosts);
  data_->start_training(cfg_);  // the stream's micro-batch shape is this rank's share
  cfg_.model.validate();
  if (lead_) claim_out_dir();  // rank 0 owns the directory; the others write only checkpoints
  check_ranks_see_dir(world_, run_.out_dir);  // every rank writes checkpoints into it
  build();
  restore();
  // --overwrite: the new run is built and checked; only now does the old run move aside (and it
  // comes back if the new run fails before its first checkpoint: train/run_dir.h).
  if (run_dir_ && run_.overwrite && run_.resume.empty()) run_dir_->set_old_run_aside();
  open_outputs();
}

// The constructor's first part, run before the grid exists: the data opened (model.vocab may
// come from it) and every rank's config, data and binary compared on the world, before any
// split or anything is written. Ranks started with different dist.tp would otherwise split the
// world differently and wait in each other's splits until dist.timeout_s. Then the grid, whose
// tp refusals see the vocabulary the data gave (checked before rank 0 locks --out).
std::unique_ptr<RankGrid> RunLoop::open_data_and_agree() {
  const bool lead = world_.rank() == 0;
  if (!lead) run_.progress = false;
  ops::use_backend(cfg_.train.backend);
  ops::use_precision(cfg_.train.precision);
  std::string capped;
  omp_set_num_threads(usable_threads(threads_per_rank(cfg_.train.threads), &capped));
  if (!capped.empty() && lead) fmt::print(stderr, "sigma train: warning: {}\n", capped);
  data_ = make_data_source(cfg_, /*start_training=*/false);
  bind_model_to_data(cfg_.model, *data_);
  if (world_.size() > 1) check_ranks_agree(world_, start_up_record(cfg_, *data_));
  return make_grid(cfg_, world_);
}

// Locks the output directory before anything is written into it (train/run_dir.h).
void RunLoop::claim_out_dir() {
  if (run_.out_dir.empty()) return;
  const RunDirMode mode = !run_.resume.empty() ? RunDirMode::Resume
                          : run_.overwrite     ? RunDirMode::Overwrite
                                               : RunDirMode::Fresh;
  run_dir_ = std::make_unique<RunDir>(run_.out_dir, mode);
}

// Model, optimizer, expert executor and the step (the data is open); nothing written yet.
void RunLoop::build() {
  if (!run_.resume.empty()) {  // checked before the expert store is opened
    ck_ = open_checkpoint(run_.resume);
    check_same_model(cfg_, ck_->cfg);
    check_resume_tokenizer(*ck_, *data_, cfg_);
  }
  check_memory(cfg_);  // a sized error instead of bad_alloc for a model too big for the machine
  mode_ = expert_mode_of(cfg_, comm_.size(), grid_->tp());
  refuse_inapplicable_options(cfg_, expert_mode_name(mode_), comm_.size(), !run_.out_dir.empty());
  const TokenCounts counts = routing_counts(cfg_, *data_, ck_.has_value());
  // ZeRO-3: each rank initialises only the values it owns (the plan depends on the registered
  // tensors and the rank count alone); the others are gathered when first read.
  // Under tp a split tensor is the rank's slice: ZeRO owns it whole (its rows are not the
  // tensor's), a replicated one may be cut into row runs.
  auto plan = [this](const ParamSet& ps) {
    const int tp = grid_->tp();
    return plan_shards(ps, comm_.size(), kNormSlabElements, [&ps, tp, this](size_t i) {
      return tp == 1 || tp_split(cfg_.model, ps.all()[i].name).replicated();
    });
  };
  Model::InitOnly init_only;
  if (cfg_.dist.zero >= 3 && comm_.size() > 1)
    init_only = [&](const ParamSet& ps) { return plan(ps).owned_by(comm_.rank()); };
  model_ = std::make_unique<Model>(cfg_.model, cfg_.train.seed, counts.empty() ? nullptr : &counts,
                                   mode_ != ExpertMode::InModel, grid_->tp_group(), init_only);
  model_->set_remat(remat_from_name(cfg_.train.remat));
  plan_ = plan(model_->params());
  opt_ = std::make_unique<AdamW>(cfg_.optim, model_->params(),
                                 comm_.size() > 1 ? plan_.owned_by(comm_.rank()) : std::vector<ParamPiece>{});
  // Checked before the store is created: a bad selector leaves no store file behind.
  freeze_ = plan_freeze(cfg_.train.freeze, cfg_.model, model_->params(),
                        model_->external_experts(), data_->domains());
  if (grid_->tp() > 1)  // a vocabulary-parallel table: the trained slots' rows this rank holds
    for (size_t i = 0; i < freeze_.mask.rows.size(); ++i)
      if (model_->params().all()[i].name == names::kTokens && !freeze_.mask.rows[i].empty())
        freeze_.mask.rows[i] = tp_local_rows(freeze_.mask.rows[i], cfg_.model.vocab, grid_->tp(),
                                             grid_->tensor().rank());
  // ECSS: the experts and their Adam state live in the store, not in the model and optimizer.
  if (mode_ == ExpertMode::Ecss || mode_ == ExpertMode::Vanilla)
    experts_ = std::make_unique<EcssExperts>(*model_, mode_, cfg_.optim, cfg_.train.expert_store,
                                             ck_.has_value(), expert_memory_bytes(cfg_.train));
  step_ = std::make_unique<TrainStep>(*model_, *opt_, comm_, cfg_.optim, plan_);
  if (grid_->tp() > 1) step_->set_tensor_parallel(&grid_->tensor());
  step_->set_zero_stage(cfg_.dist.zero);
  // settle() below wherever params are read; dist.overlap_mib in fp32 elements (0: the default)
  const double in_flight = std::ceil(double(cfg_.dist.overlap_mib) * double(1 << 20) / sizeof(float));
  step_->set_overlap(cfg_.dist.overlap, true, size_t(in_flight));
  names_ = cfg_.model.domains.names();
  for (const auto& n : data_->domains()) data_to_model_.push_back(cfg_.model.domain_index(n));
  SIGMA_CHECK(cfg_.dist.placement == "spread" || mode_ == ExpertMode::Parallel, "dist.placement = "
              "{} places expert groups on ranks, which needs train.experts = parallel (or auto "
              "with several ranks); this run has train.experts = {}", cfg_.dist.placement,
              expert_mode_name(mode_));
  if (mode_ == ExpertMode::Parallel) build_expert_parallel();
  micro_.resize(size_t(cfg_.train.accum));
  next_.resize(size_t(cfg_.train.accum));
  group_order_ = cfg_.train.accum > 1 && !cfg_.model.groups.empty() &&
                 cfg_.dist.placement != "by_group" &&
                 data::SamplerConfig::from_json(cfg_.data.sampler, "data.sampler").one_domain_per_batch;
}

// Expert parallelism: each rank's share of every group in a store of its own (a file store
// gets the rank in its name).
void RunLoop::build_expert_parallel() {
  SIGMA_CHECK(std::none_of(freeze_.frozen_experts.begin(), freeze_.frozen_experts.end(),
                           [](uint8_t f) { return f != 0; }),
              "train.freeze of expert groups is not supported with train.experts = parallel yet; "
              "use train.experts = ecss (one rank) or model");
  const int R = comm_.size();
  const int G = int(cfg_.model.groups.size());
  GroupPlacement placement = GroupPlacement::everywhere(G, R);
  if (cfg_.dist.placement == "by_group") {
    placement = GroupPlacement::by_group(G, cfg_.train.accum, R);
    // Micro-batch i of every step draws from the data domains of its group only.
    std::vector<std::vector<uint32_t>> allowed(size_t(cfg_.train.accum));
    for (int i = 0; i < cfg_.train.accum; ++i) {
      const int g = GroupPlacement::micro_batch_group(i, G, cfg_.train.accum);
      for (size_t d = 0; d < data_to_model_.size(); ++d)
        if (model_->domain_group(data_to_model_[d]) == g) allowed[size_t(i)].push_back(uint32_t(d));
      SIGMA_CHECK(!allowed[size_t(i)].empty(), "dist.placement = by_group: expert group '{}' has "
                  "no domain in the training data, so its micro-batches would be empty",
                  cfg_.model.groups[size_t(g)].name);
    }
    data_->restrict_batches(std::move(allowed));
  }
  // A collective: every rank names its host; rank 0 says where the groups' exchange goes.
  if (R > 1) {
    std::vector<std::string> names;
    for (const auto& g : cfg_.model.groups) names.push_back(g.name);
    const std::string by_host = describe_groups_by_host(placement, names, hosts_of_ranks(comm_));
    if (!by_host.empty() && lead_ && run_.progress) fmt::print(stderr, "sigma train: {}\n", by_host);
  }
  std::string store = cfg_.train.expert_store;
  // A store per rank, named for the rank count too: a resume on another count starts new ones.
  // By world rank: with tp > 1 the ranks of a tp group hold different slices of one expert.
  if (!store.empty() && world_.size() > 1)
    store += fmt::format(".rank-{:04d}-of-{:04d}", world_.rank(), world_.size());
  parallel_ = std::make_unique<ExpertParallel>(*model_, comm_, std::move(placement), cfg_.optim,
                                               store, ck_.has_value());
  if (grid_->tp() > 1) parallel_->set_tensor_parallel(&grid_->tensor());
}

ExpertFiles* RunLoop::expert_files() {
  return experts_ ? static_cast<ExpertFiles*>(experts_.get()) : parallel_.get();
}

void RunLoop::restore() {
  if (ck_) {
    load_model(*model_, ck_->dir);
    step_->values_written();
    load_optimizer(*opt_, *model_, ck_->dir);
    if (expert_files()) expert_files()->load(ck_->dir);
    state_ = ck_->state;
    if (!state_.data_cursor.is_null()) {
      data_->restore(state_.data_cursor);
      // The cursor counts micro-batches of the checkpoint's run; this run may cut its steps
      // into others (another rank count, train.batch or train.accum): same step, new count.
      const uint64_t next = uint64_t(state_.step) * uint64_t(cfg_.train.accum);
      const uint64_t was = data_->continue_at(next);
      if (was != next && lead_)
        fmt::print(stderr, "sigma train: the data stream continues after step {} in micro-batches "
                   "of {} rows ({} a step; the checkpoint's run read {} micro-batches in {} "
                   "steps): the same items in order, the domain of each row drawn anew\n",
                   state_.step, cfg_.train.batch, cfg_.train.accum, was, state_.step);
    }
  }
  if (experts_) experts_->set_frozen(freeze_.frozen_experts);
  last_ = run_.stop_at >= 0 ? std::min(run_.stop_at, cfg_.train.steps) : cfg_.train.steps;
}

// metrics.jsonl, the checkpoint root and the banner.
void RunLoop::open_outputs() {
  if (!run_.out_dir.empty()) ckpt_root_ = run_.out_dir + "/checkpoints";
  else if (lead_)  // said once the run is checked and about to train (usage.md's first example)
    fmt::print(stderr, "sigma train: no --out: this run saves nothing (no checkpoint, "
               "metrics.jsonl or summary.json); to keep it, pass --out DIR\n");
  // Background saves in one process, and on several ranks in the sharded layout (each rank
  // copies its own pieces; the collectives of a save stay on the training thread). The whole
  // layout's gathers of tensors assembled whole keep the foreground.
  const bool sharded = saves_sharded(cfg_, comm_.size() * grid_->tensor().size(), expert_files());
  if (!ckpt_root_.empty() && cfg_.train.ckpt_async && world_.size() == 1 && !parallel_)
    saver_ = std::make_unique<BackgroundSaver>();
  else if (!ckpt_root_.empty() && cfg_.train.ckpt_async && world_.size() > 1 && sharded)
    sharded_saver_ = std::make_unique<ShardedBackgroundSaver>(comm_, grid_->tensor());
  // metrics.jsonl is created with the first record (RunDir::append_metrics).
  if (run_dir_ && ck_) run_dir_->drop_metrics_after(state_.step);  // the dead run's steps are redone
  tty_ = isatty(STDERR_FILENO);
  std::vector<double> shares(2 * size_t(comm_.size()), 0.0);  // every rank's experts and bytes
  if (parallel_) {
    const double mine[2] = {double(parallel_->owned_experts()), double(parallel_->store_bytes())};
    comm_.all_gather(shares.data(), mine, 2);
  }
  if (!run_.progress) return;
  fmt::print(stderr, "sigma train: {} parameters, {} domains, steps {}..{}, batch {}x{}x{}, {} threads\n",
             model_->params().numel() + (experts_ ? experts_->params() : 0) +
                 (parallel_ ? parallel_->all_expert_params() : 0), names_.size(),
             state_.step, last_, cfg_.train.accum, cfg_.train.batch, cfg_.model.context,
             omp_get_max_threads());
  if (experts_) {
    const ExpertStore& st = experts_->store();
    const double GiB = double(1ull << 30);
    fmt::print(stderr, "experts: {} ({} experts, {:.2f} GiB with Adam state, {})\n",
               expert_mode_name(mode_), st.num_experts(), double(st.data_bytes()) / GiB,
               st.file_backed() ? "file " + st.path() : "in RAM");
    fmt::print(stderr, "memory plan: dense part ~{:.2f} GiB (shared weights, gradients, Adam, "
               "activations); expert compute buffers {:.2f} GiB (train.expert_memory = {}) hold "
               "{} experts of {:.1f} MiB (weights and a pass's gradients); a step activating more runs "
               "each RRE pass in slices; "
               "gradients accumulate {}\n",
               double(dense_training_bytes(cfg_)) / GiB,
               double(experts_->budget_experts() * experts_->expert_bytes()) / GiB,
               cfg_.train.expert_memory, experts_->budget_experts(),
               double(experts_->expert_bytes()) / (1 << 20),
               experts_->grads_in_file() ? "in a temporary file beside the store (page cache)"
                                         : "in RAM");
  }
  if (parallel_) {
    std::string per_rank;
    for (int r = 0; r < comm_.size(); ++r)
      per_rank += fmt::format("{}{:.0f} ({:.1f} MiB)", r ? ", " : "", shares[2 * size_t(r)],
                              shares[2 * size_t(r) + 1] / (1 << 20));
    fmt::print(stderr, "experts: parallel, dist.placement = {}; experts with Adam state per rank: "
               "{}; stores {}\n", cfg_.dist.placement, per_rank,
               cfg_.train.expert_store.empty() ? "in RAM" : cfg_.train.expert_store + "[.rank-NNNN-of-RRRR]");
  }
  if (saver_)  // the copy of the weights and Adam moments (and Adam's row step counts)
    fmt::print(stderr, "checkpoints: written in the background (train.ckpt_async) from a copy of "
               "{:.2f} GiB taken after the step{}\n",
               double(model_->params().numel()) * 12 / double(1 << 30),
               experts_ ? "; the experts are read from the store, whose next update waits for it"
                        : "");
  if (sharded_saver_) {  // the copy is memory on top of training's (ZeRO-3 users count it)
    double most = 0;  // bytes: values and Adam moments of the rank's own tensors, its experts
    for (int64_t e : plan_.elements) most = std::max(most, double(e) * 12);
    double experts = 0;
    for (int r = 0; parallel_ && r < comm_.size(); ++r)
      experts = std::max(experts, shares[2 * size_t(r) + 1]);
    fmt::print(stderr, "checkpoints: written in the background (train.ckpt_async): after the "
               "step each of the {} ranks copies the pieces it writes (its shard of the weights "
               "and Adam state, {:.1f} MiB on the most loaded rank{}; train.ckpt_async = false "
               "saves that memory by writing in the foreground), a writer thread per rank writes "
               "them, and rank 0 commits once every rank's files are written (agreed at a step "
               "boundary)\n", world_.size(), (most + experts) / double(1 << 20),
               parallel_ ? " with its experts" : "");
  }
  if (!ckpt_root_.empty() && cfg_.train.ckpt_async && !saver_ && !sharded_saver_)  // said, not ignored
    fmt::print(stderr, "checkpoints: written in the foreground: {}\n",
               world_.size() == 1 ? "train.ckpt_async does not apply to train.experts = parallel in one process"
               : cfg_.dist.ckpt_layout != "sharded"
                   ? "dist.ckpt_layout = whole assembles tensors over the ranks while it writes "
                     "(the sharded layout, the default, saves in the background)"
                   : "these experts are not written as pieces, which background saves need");
  if (!cfg_.train.freeze.empty()) fmt::print(stderr, "{}\n", freeze_.summary);
  if (comm_.size() > 1) {
    const int64_t most = *std::max_element(plan_.elements.begin(), plan_.elements.end());
    std::string cut;  // tensors larger than half a rank's share, owned as row runs
    for (size_t i = 0; i < plan_.cuts.size(); ++i)
      if (!plan_.whole(i)) cut += (cut.empty() ? "" : ", ") + model_->params().all()[i].name;
    fmt::print(stderr, "data parallel: {} ranks x {} micro-batches each; Adam state{} sharded "
               "(ZeRO-{}): {:.1f} MiB on the most loaded rank, {:.1f} MiB unsharded{}\n",
               comm_.size(), cfg_.train.accum / comm_.size(),
               cfg_.dist.zero == 3 ? ", gradients and values" : cfg_.dist.zero == 2 ? " and gradients" : "",
               cfg_.dist.zero, double(most) * (4 + 4 * cfg_.dist.zero) / (1 << 20),
               double(model_->params().numel()) * (4 + 4 * cfg_.dist.zero) / (1 << 20),
               cut.empty() ? "" : "; cut into row runs over the ranks (each larger than half a "
                                  "rank's share): " + cut);
  }
}

// The micro-batches of `step` in the model's domain indices.
void RunLoop::fetch(std::vector<Batch>& micro, int64_t step) {
  for (int m = 0; m < cfg_.train.accum; ++m) {
    data_->train_batch(micro[size_t(m)], cfg_.train.batch, cfg_.model.context,
                       uint64_t(step) * cfg_.train.accum + m);
    for (auto& d : micro[size_t(m)].domain) d = data_to_model_[size_t(d)];
  }
  // One domain per micro-batch: the step's micro-batches in expert-group order (stable), so that
  // consecutive ones run the same experts and ECSS's compute buffers keep them from one to the
  // next instead of gathering them again (docs/ecss.md). Only the order of the sum of the
  // micro-batches' gradients changes. (dist.placement = by_group fixes each slot's group.)
  if (group_order_)
    std::stable_sort(micro.begin(), micro.end(), [&](const Batch& a, const Batch& b) {
      return model_->domain_group(a.domain[0]) < model_->domain_group(b.domain[0]);
    });
}

TrainSummary RunLoop::run() {
  window_ = DomainSums(names_.size());
  run_load_ = model_->expert_load();  // zero counts, summed at each log
  model_->reset_expert_load();
  t_start_ = Clock::now();
  const StopSignals signals(!ckpt_root_.empty());  // without --out there is nothing to save
  try {
    for (int64_t step = state_.step; step < last_ && !stopped_by_; ++step) one_step(step, signals);
  } catch (...) {
    // A background save in flight is of an earlier, good step: it completes (committed, the
    // old run of an --overwrite dropped) before the error ends the run.
    // On several ranks the commit needs every rank's agreement, which a failed run cannot
    // count on: the save in flight is dropped uncommitted (the last committed one stands).
    try {
      if (sharded_saver_) {
        const std::string name = sharded_saver_->abandon();
        if (!name.empty())
          fmt::print(stderr, "sigma train: checkpoint {} (written in the background) was not "
                     "committed: the run failed before the ranks agreed on it; the checkpoints "
                     "committed before it are intact\n", name);
      } else {
        collect_save(true);
      }
    } catch (const std::exception& e) {
      fmt::print(stderr, "sigma train: {}\n", e.what());
    }
    throw;
  }
  if (tty_ && run_.progress) fmt::print(stderr, "\n");
  return finish();
}

void RunLoop::one_step(int64_t step, const StopSignals& signals) {
  const Clock::time_point t_collect = Clock::now();
  collect_save(false);  // a background save that has finished: its error, retention
  save_stall_s_ += std::chrono::duration<double>(Clock::now() - t_collect).count();
  if (save_in_flight()) ++bg_overlapped_;
  if (have_next_) {
    std::swap(micro_, next_);
    have_next_ = false;
  } else {
    fetch(micro_, step);
  }
  const bool ckpt_now = !ckpt_root_.empty() &&
                        ((cfg_.train.ckpt_every > 0 && (step + 1) % cfg_.train.ckpt_every == 0) ||
                         step + 1 == last_);
  step_->prepare(micro_);
  // Overlap the next step's expert prefetch with this one (not before a held-out evaluation,
  // which binds experts of its own).
  if (experts_ && step + 1 < last_ && !eval_due(step + 1)) {
    cursor_after_step_ = data_->cursor();  // a checkpoint after this step resumes from here
    fetch(next_, step + 1);
    have_next_ = true;
    experts_->prefetch(next_);
  }
  UpdateMask mask = freeze_.mask;
  if (cfg_.optim.sparse_embeddings) limit_to_batch_rows(mask, model_->params(), cfg_.model, micro_);
  const float lr = lr_at(cfg_.optim, step, cfg_.train.steps);
  if (run_.before_step) {
    step_->settle();
    run_.before_step(step, micro_);
  }
  if (run_.after_backward) step_->set_after_backward([&](ParamSet& ps) { run_.after_backward(step, ps); });
  const StepResult r = step_->run(micro_, lr, mask);
  window_.add(r.domain_loss, r.domain_tokens);
  guard_.record(step + 1, r.skipped, r.loss, r.grad_norm);  // throws after too many in a row
  aux_window_ += r.aux_loss;
  const int64_t tokens = int64_t(cfg_.train.accum) * cfg_.train.batch * cfg_.model.context;
  state_.step = step + 1;
  state_.tokens += tokens;
  tokens_this_run_ += tokens;
  steps_this_run_ += 1;
  steps_in_window_ += 1;
  if (state_.step < last_) {
    const double limit_s = 60.0 * cfg_.train.max_minutes, elapsed_s =
        std::chrono::duration<double>(Clock::now() - t_created_).count();
    stopped_by_ = signals.requested(world_, limit_s > 0, limit_s > 0 && elapsed_s >= limit_s);
  }
  const bool eval_now = eval_due(state_.step);
  if (state_.step % cfg_.train.log_every == 0 || state_.step == last_ || stopped_by_ || eval_now)
    log(r.grad_norm, lr, eval_now);
  if (ckpt_now || (stopped_by_ && !ckpt_root_.empty())) {
    const Clock::time_point t0 = Clock::now();
    checkpoint();
    save_stall_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  }
}

// The held-out loss per domain: data.eval_path's windows, else the data's own held-out side.
// Every rank calls it (the forward passes may be collective).
// Its wall time goes to eval_s_, not to the training's tokens/s.
std::vector<DomainLoss> RunLoop::held_out_losses() {
  const Clock::time_point t0 = Clock::now();
  if (!held_out_ && !cfg_.data.eval_path.empty())
    held_out_ = make_eval_source(cfg_.data.eval_path, data_->tokenizer_hash());
  std::vector<DomainLoss> out;
  // The data ranks share the batches (each rank runs 1/R of them; the same bits as one), except
  // with experts parallel, whose exchange is planned from every rank's batch of a step (a
  // forward here is given its rank's alone): there every rank runs every batch.
  const EvalRanks ranks{comm_.rank(), parallel_ ? 1 : comm_.size(),
                        [this](float* all, const float* mine, size_t n) {
                          comm_.all_gather(all, mine, n);
                        }};
  // The step's activations and, under dist.zero = 3, its per-stage gathers: nothing whole.
  step_->forward_only([&](Activations& acts) {
    out = evaluate(*model_, held_out_ ? *held_out_ : *data_, cfg_.train.batch,
                   cfg_.model.context, cfg_.train.eval_rows, {}, {}, &acts, &ranks);
  });
  eval_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

// A progress line, a metrics.jsonl record, and the window's expert load into the run's; with
// `eval_now` (train.eval_every), the held-out losses in both.
void RunLoop::log(double grad_norm, float lr, bool eval_now) {
  // Tokens/s of the training alone; the ETA includes the evaluations still to come.
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start_).count();
  const double tps = tokens_this_run_ / std::max(elapsed - eval_s_, 1e-9);
  const double eta = elapsed / steps_this_run_ * double(last_ - state_.step);
  std::vector<BlockLoad> load = model_->expert_load();  // before evaluation adds to it
  sum_over_ranks(comm_, load);
  const nlohmann::json exchange = exchange_since_last(steps_in_window_);  // every rank
  nlohmann::json held = nlohmann::json::object();
  std::string held_note;
  if (eval_now) {
    last_eval_.emplace(state_.step, held_out_losses());
    for (const DomainLoss& d : last_eval_->second) {
      held[d.name] = d.loss;
      held_note += fmt::format(" {} {:.3f}", d.name, d.loss);
    }
    held_note = " | held-out" + held_note;
  }
  if (run_.progress)  // a line with held-out losses stays on a terminal
    fmt::print(stderr, "{}step {:>6}/{} | loss {:.4f} | lr {:.2e} | |g| {:.3f} | {:.0f} tok/s | ETA {}{}{}{}",
               tty_ ? "\r" : "", state_.step, last_, window_.total_mean(), lr, grad_norm, tps,
               format_duration(eta), guard_.progress_note(), held_note,
               tty_ && state_.step != last_ && !eval_now ? "   " : "\n");
  if (run_dir_) {
    nlohmann::json dom = nlohmann::json::object();
    for (size_t d = 0; d < names_.size(); ++d)
      if (window_.count[d]) dom[names_[d]] = window_.loss[d] / double(window_.count[d]);
    nlohmann::json rec{{"step", state_.step}, {"loss", window_.total_mean()}, {"lr", lr},
                       {"grad_norm", grad_norm}, {"tokens", state_.tokens},
                       {"tokens_per_s", tps}, {"domains", dom},
                       {"skipped_steps", guard_.skipped_total()}};
    if (eval_now) rec["held_out"] = held;  // per domain, on the held-out windows
    if (!load.empty()) {  // tokens per expert over the logging window
      rec["expert_load"] = expert_load_json(load, cfg_.model);
      rec["load_imbalance"] = load_imbalance_json(load);
    }
    if (experts_) rec["ecss"] = offload_json(experts_->stats(), experts_->stats().steps);
    if (parallel_) rec["expert_exchange"] = exchange;
    if (cfg_.model.gated()) {  // the baseline's extra loss and its capacity drops
      rec["aux_loss"] = aux_window_ / double(steps_in_window_);
      nlohmann::json dropped = nlohmann::json::object();
      for (const BlockLoad& b : load) dropped[std::to_string(b.block)] = b.dropped;
      rec["dropped"] = dropped;
    }
    run_dir_->append_metrics(rec.dump());  // checked: a failed write stops the run
  }
  window_ = DomainSums(names_.size());
  for (size_t b = 0; b < run_load_.size(); ++b) {
    for (size_t g = 0; g < run_load_[b].tokens.size(); ++g)
      for (size_t e = 0; e < run_load_[b].tokens[g].size(); ++e)
        run_load_[b].tokens[g][e] += load[b].tokens[g][e];
    run_load_[b].dropped += load[b].dropped;
  }
  aux_window_ = 0;
  steps_in_window_ = 0;
  model_->reset_expert_load();
}

// Expert parallelism: all-to-all-v calls per rank and bytes between ranks (summed over every
// rank, self excluded) per step since the last call. Collective.
nlohmann::json RunLoop::exchange_since_last(int64_t steps) {
  if (!parallel_) return nullptr;
  double now[2] = {0, 0};
  for (const CommStats& s : parallel_->group_traffic()) {
    now[0] += double(s.calls);
    for (size_t r = 0; r < s.bytes_to.size(); ++r)
      if (int(r) != world_.rank()) now[1] += double(s.bytes_to[r]);  // process-wide ranks
  }
  double delta[2] = {now[0] - exchanged_[0], now[1] - exchanged_[1]};
  exchanged_[0] = now[0], exchanged_[1] = now[1];
  comm_.all_reduce_sum(delta, 2);  // integers below 2^53: exact
  const double per = double(std::max<int64_t>(steps, 1));
  return {{"calls_per_rank_step", delta[0] / per / comm_.size()},
          {"mib_per_step", delta[1] / per / double(1 << 20)}};
}

// Between steps: the store holds exactly this step's experts.
void RunLoop::checkpoint() {
  // Under dist.zero = 3 the sharded layout writes each rank's own values: none gathered whole.
  if (!saver_ && saves_sharded(cfg_, comm_.size() * grid_->tensor().size(), expert_files()))
    step_->settle_owned();
  else
    step_->settle();
  state_.data_cursor = have_next_ ? cursor_after_step_ : data_->cursor();
  if (run_dir_) run_dir_->sync_metrics();  // the records up to it as durable as the checkpoint
  if (save_in_flight()) {  // one save in flight at most: this one waits for the last one
    const Clock::time_point t0 = Clock::now();
    collect_save(true);  // the last one's error surfaces here
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    ++bg_waits_, bg_wait_s_ += waited;
    if (run_.progress)  // rank 0's; summary.json counts them either way
      fmt::print(stderr, "{}checkpoints: the save of step {} waited {:.2f} s for the previous "
                 "background save to finish (train.ckpt_every is shorter than a save)\n",
                 tty_ && run_.progress ? "\n" : "", state_.step, waited);
  }
  if (sharded_saver_) {
    std::function<void()> hook;
    if (run_.saving) hook = [f = run_.saving, step = state_.step] { f(step); };
    sharded_saver_->start(ckpt_root_, cfg_, *model_, opt_.get(), state_, data_->tokenizer_path(),
                          expert_files(), std::move(hook));
    ++bg_saves_;
    return;
  }
  if (!saver_) {
    if (run_.saving) run_.saving(state_.step);
    save_checkpoint(ckpt_root_, cfg_, *model_, opt_.get(), state_, data_->tokenizer_path(),
                    expert_files(), &comm_, &grid_->tensor());
    after_save();
    return;
  }
  SaveSnapshot files = saver_->snapshot();
  if (run_.saving)
    files.add_first([f = run_.saving, step = state_.step](CheckpointWriter&) { f(step); });
  snapshot_checkpoint(files, cfg_, *model_, opt_.get(), state_, data_->tokenizer_path(),
                      experts_.get());
  saver_->start(ckpt_root_, checkpoint_name(state_.step), std::move(files));
  ++bg_saves_;
}

// A background save in flight: when it has finished (or at once, waiting, with `wait`) its
// commit is taken in, or its error thrown.
void RunLoop::collect_save(bool wait) {
  if (sharded_saver_ && sharded_saver_->in_flight()) {  // collective: every rank, same step
    if (!sharded_saver_->collect(wait, world_).empty()) after_save();
    return;
  }
  if (!saver_ || !saver_->in_flight() || (!wait && !saver_->finished())) return;
  const std::string dir = saver_->wait();
  if (experts_) experts_->link_from(dir);  // the next save may link its unchanged groups
  after_save();
}

// A checkpoint is committed.
void RunLoop::after_save() {
  if (!run_dir_) return;
  run_dir_->drop_old_run();  // --overwrite: the new run has a checkpoint now
  prune_checkpoints(ckpt_root_, cfg_.train.keep_checkpoints, cfg_.train.keep_every);
}

TrainSummary RunLoop::finish() {
  step_->settle_owned();  // the evaluation below gathers what it reads (forward_only)
  collect_save(true);  // the last checkpoint is committed before the run reports its end
  TrainSummary sum;
  sum.stopped_by = stopped_by_;
  sum.steps = state_.step;
  sum.tokens = state_.tokens;
  sum.skipped_steps = guard_.skipped_total();
  // The training steps' wall time: the run's less its train.eval_every evaluations.
  const double elapsed =
      std::chrono::duration<double>(Clock::now() - t_start_).count() - eval_s_;
  sum.tokens_per_s = steps_this_run_ ? tokens_this_run_ / std::max(elapsed, 1e-9) : 0.0;
  sum.expert_load = run_load_;
  if (experts_) {
    sum.expert_mode = expert_mode_name(mode_);
    sum.offload = experts_->stats();
  }
  sum.seconds = elapsed;
  if (parallel_) {  // the run's exchange: reset the counters' base to the run's start
    exchanged_[0] = exchanged_[1] = 0;
    exchange_summary_ = exchange_since_last(steps_this_run_);
    exchange_summary_["placement"] = cfg_.dist.placement;
  }
  if (grid_->tp() > 1) {  // the tp group's all-reduces of the training steps (before evaluation's)
    const CommStats& t = grid_->tensor().stats();
    const double per = double(std::max<int64_t>(steps_this_run_, 1));
    const size_t me = size_t(world_.rank());
    const int64_t to_self = me < t.bytes_to.size() ? t.bytes_to[me] : 0;
    tp_exchange_ = {{"tp", grid_->tp()}, {"calls_per_step", double(t.calls) / per},
                    {"mib_per_step_per_rank", double(t.bytes() - to_self) / per / double(1 << 20)}};
  }
  if (stopped_by_) return sum;  // stopped early: no evaluation, no summary of an unfinished run
  if (run_dir_) run_dir_->drop_old_run();  // finished (a run of no steps saves no checkpoint)
  // The last step's train.eval_every evaluation, when there was one, is the same computation.
  sum.domains = last_eval_ && last_eval_->first == state_.step ? last_eval_->second
                                                                 : held_out_losses();
  sum.eval_seconds = eval_s_;
  // Each rank's peak resident memory (the high-water mark of the whole process), for summary.json.
  const double peak = peak_rss_mib();
  peak_rss_.assign(size_t(world_.size()), 0.0);
  world_.all_gather(peak_rss_.data(), &peak, 1);
  // A resumed run that had no step left to train keeps the summary its training wrote (this
  // process trained nothing: its throughput and expert load would be zeros).
  std::error_code ec;
  if (run_dir_ && steps_this_run_ == 0 && std::filesystem::exists(run_dir_->path() + "/summary.json", ec))
    fmt::print(stderr, "sigma train: no step left to train; {}/summary.json kept\n", run_.out_dir);
  else if (run_dir_)
    write_summary(sum);
  return sum;
}

void RunLoop::write_summary(const TrainSummary& sum) {
  nlohmann::json dom = nlohmann::json::object();
  for (const auto& d : sum.domains) {
    dom[d.name] = {{"loss", d.loss}, {"tokens", d.tokens}};
    dom[d.name]["optimum"] = d.optimum ? nlohmann::json(*d.optimum) : nlohmann::json(nullptr);
  }
  nlohmann::json summary{{"steps", sum.steps}, {"tokens", sum.tokens},
                         {"skipped_steps", sum.skipped_steps},
                         {"tokens_per_s", sum.tokens_per_s}, {"train_s", sum.seconds},
                         {"eval_s", sum.eval_seconds}, {"domains", dom},
                         {"peak_rss_mib_per_rank", peak_rss_}};
  if (experts_) {
    const OffloadStats& o = sum.offload;
    summary["ecss"] = offload_json(o, o.steps);
    summary["ecss"]["mode"] = sum.expert_mode;
    summary["ecss"]["store"] = cfg_.train.expert_store;
    summary["ecss"]["train_s"] = sum.seconds;
    summary["ecss"]["experts_per_step"] = o.steps ? double(o.experts_updated) / o.steps : 0.0;
  }
  if (parallel_) summary["expert_exchange"] = exchange_summary_;
  if (!tp_exchange_.is_null()) summary["tp_exchange"] = tp_exchange_;
  if (const double b = step_->overlap_blocked_s(); b > 0)  // rank 0's wait: what overlap left exposed
    summary["dp_overlap"] = {{"blocked_ms_per_step", b * 1e3 / double(std::max<int64_t>(steps_this_run_, 1))},
                             {"peak_in_flight_mib", double(step_->overlap_peak_in_flight()) * sizeof(float) / double(1 << 20)}};
  // Wall time the training thread spent on saves between steps: the whole save in the
  // foreground; the copy, waits, agreement and commit in the background (the end's wait aside).
  summary["checkpoint_stall_s"] = save_stall_s_;
  if (saver_ || sharded_saver_)  // train.ckpt_async: how the background saves went
    summary["background_saves"] = {{"saves", bg_saves_}, {"steps_overlapped", bg_overlapped_},
                                   {"waits", bg_waits_}, {"wait_s", bg_wait_s_}};
  if (!sum.expert_load.empty()) {
    summary["expert_load"] = expert_load_json(sum.expert_load, cfg_.model);
    summary["load_imbalance"] = load_imbalance_json(sum.expert_load);
    if (cfg_.model.gated()) {  // the baseline's (token, choice) pairs over capacity, whole run
      nlohmann::json dropped = nlohmann::json::object();
      for (const BlockLoad& b : sum.expert_load) dropped[std::to_string(b.block)] = b.dropped;
      summary["dropped"] = dropped;
    }
  }
  run_dir_->write_summary(summary.dump(2) + "\n");  // durable: temp + fsync + rename
}

}  // namespace

TrainSummary train(Config cfg, const RunOptions& run) { return RunLoop(std::move(cfg), run).run(); }

}  // namespace sigma
