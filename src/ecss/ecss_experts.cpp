#include "ecss/ecss_experts.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <tuple>

#include "core/error.h"
#include "ecss/expert_files.h"
#include "io/checkpoint_dir.h"
#include "kernels/ops.h"
#include "model/names.h"
#include "optim/grad_norm.h"

namespace sigma {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

ExpertMode resolve_expert_mode(const std::string& setting, const ModelConfig& cfg, int ranks) {
  const bool sparse = cfg.rre_layers > 0, routed = sparse && !cfg.gated();
  if (setting == "model") return ExpertMode::InModel;
  if (setting == "auto")  // a learned gate's experts are known only inside the pass: no ECSS
    return !sparse ? ExpertMode::InModel
           : ranks > 1 ? ExpertMode::Parallel
           : routed    ? ExpertMode::Ecss
                       : ExpertMode::InModel;
  SIGMA_CHECK(setting == "ecss" || setting == "vanilla" || setting == "parallel", "train.experts "
              "= '{}': expected auto, ecss, vanilla, parallel or model", setting);
  SIGMA_CHECK(sparse, "train.experts = '{}' needs expert blocks (model.rre_layers > 0); this "
              "model has none", setting);
  if (setting == "parallel") return ExpertMode::Parallel;
  SIGMA_CHECK(routed, "train.experts = '{}' needs experts routed by tables (model.router = rre): "
              "ECSS gathers a step's experts before its forward pass, and a learned gate (router "
              "= {}) picks them inside it; use parallel or model", setting, cfg.router);
  SIGMA_CHECK(ranks == 1, "train.experts = {} with {} ranks: a distributed run keeps its experts "
              "in per-rank stores (train.experts = parallel or auto) or in the model (model)",
              setting, ranks);
  return setting == "ecss" ? ExpertMode::Ecss : ExpertMode::Vanilla;
}

const char* expert_mode_name(ExpertMode m) {
  switch (m) {
    case ExpertMode::Ecss: return "ecss";
    case ExpertMode::Vanilla: return "vanilla";
    case ExpertMode::Parallel: return "parallel";
    default: return "model";
  }
}

ExpertStoreSpec expert_store_spec(const ModelConfig& cfg) {
  ExpertStoreSpec spec;
  for (int l = cfg.first_rre_block(); l < cfg.layers; ++l)
    for (size_t g = 0; g < cfg.groups.size(); ++g)
      spec.groups.push_back(rre_group_spec(l, int32_t(g), cfg.groups[g].experts, cfg.d_model, cfg.ffn()));
  return spec;
}

EcssExperts::EcssExperts(Model& model, ExpertMode mode, const OptimConfig& optim,
                         const std::string& store_path, bool resuming, int64_t memory_budget)
    : model_(model), mode_(mode), optim_(optim),
      store_(store_path.empty() ? ExpertStore::in_ram(expert_store_spec(model.config()))
                                : ExpertStore::open(store_path, expert_store_spec(model.config()))) {
  const ModelConfig& cfg = model.config();
  SIGMA_CHECK(model.external_experts() && (mode == ExpertMode::Ecss || mode == ExpertMode::Vanilla),
              "EcssExperts needs a model built with external experts");
  SIGMA_CHECK(!store_.file_backed() || store_.created() || resuming,
              "expert store {} already exists and holds the experts of an earlier run; continue "
              "that run with --resume CHECKPOINT, or remove the file (or choose another "
              "train.expert_store) to start a new one", store_path);
  first_.push_back(0);
  for (const GroupSpec& g : cfg.groups) first_.push_back(first_.back() + g.experts);
  P_ = store_.spec().groups.front().params();
  stride_ = (P_ + 15) / 16 * 16;
  // Gradients beside a file store: in RAM, out of the budget, while they take at most half
  // of it; else in a file (page cache). Beside a RAM store: in RAM, as store-side memory.
  memory_budget_ = memory_budget;
  const int64_t area = int64_t(GradientArea::bytes_for(store_.num_experts(), P_));
  const bool grads_in_file = store_.file_backed() && area > memory_budget / 2;
  budget_experts_ = (memory_budget - (store_.file_backed() && !grads_in_file ? area : 0)) / expert_bytes();
  SIGMA_CHECK(budget_experts_ >= 1, "train.expert_memory = {} bytes cannot hold one expert's "
              "weights and gradients ({} bytes); give it at least that", memory_budget, expert_bytes());
  // No more buffers than there are experts (a step activates at most all of them): the budget
  // of a small model is its expert count, and the trainer's memory plan shows what is used.
  budget_experts_ = std::min<int64_t>(budget_experts_, store_.num_experts());
  grads_ = GradientArea(store_.num_experts(), P_, grads_in_file ? store_path : "");
  grad_slot_.assign(size_t(store_.num_experts()), -1);
  changed_.assign(store_.spec().groups.size(), 1);
  model_.set_expert_executor(this);
  if (resuming) return;  // load() fills the store
  // Fresh run: the experts start where in-model training would start them.
  const std::vector<ExpertId> all = [&] {
    std::vector<ExpertId> v;
    for (const ExpertGroupSpec& g : store_.spec().groups)
      for (int32_t k = 0; k < g.experts; ++k) v.push_back({g.block, g.group, k});
    return v;
  }();
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(P_));
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < all.size(); ++i) {
      model_.init_expert(all[i].block, all[i].group, all[i].expert, buf.data());
      store_.set_weights(all[i], buf.data());
    }
  }
}

EcssExperts::~EcssExperts() {
  join_prefetch();
  join_store_reader();
  model_.set_expert_executor(nullptr);
}

int64_t EcssExperts::params() const { return store_.num_experts() * P_; }

std::vector<EcssExperts::Active> EcssExperts::active_of(std::span<const Batch> micro) const {
  std::vector<Active> active;
  for (const Batch& b : micro) active.push_back(model_.active_experts(b));
  return active;
}

std::vector<ExpertId> EcssExperts::active_ids(const std::vector<Active>& active) const {
  const ModelConfig& cfg = model_.config();
  const int first = cfg.first_rre_block(), E = first_.back();
  std::vector<ExpertId> ids;
  std::vector<uint8_t> used;
  for (int l = first; l < cfg.layers; ++l) {
    used.assign(size_t(E), mode_ == ExpertMode::Vanilla ? 1 : 0);
    for (const auto& a : active)
      for (int e : a[size_t(l - first)]) used[size_t(e)] = 1;
    for (size_t g = 0; g + 1 < first_.size(); ++g)
      for (int e = first_[g]; e < first_[g + 1]; ++e)
        if (used[size_t(e)]) ids.push_back({l, int32_t(g), e - first_[g]});
  }
  return ids;
}

void EcssExperts::join_prefetch() {
  if (!prefetcher_.joinable()) return;
  const auto t = Clock::now();
  prefetcher_.join();
  stats_.wait_s += since(t);
}

void EcssExperts::reset_pool(int64_t slots) {
  for (size_t i = 0; i < slot_id_.size(); ++i)
    if (slot_full_[i]) {
      const ExpertId id = slot_id_[i];
      model_.bind_expert(id.block, first_[size_t(id.group)] + id.expert, nullptr, nullptr);
    }
  if (w_.numel() < slots * stride_) {
    w_ = Tensor();  // freed first: old and new together could be twice the budget
    g_ = Tensor();
    w_ = ops::empty(DType::F32, {slots, stride_});  // the compute pool, on the device
    g_ = ops::empty(DType::F32, {slots, stride_});
    stats_.compute_bytes = (w_.numel() + g_.numel()) * 4;
  }
  slot_id_.assign(size_t(slots), ExpertId{});
  slot_full_.assign(size_t(slots), 0);
  slot_used_.assign(size_t(slots), 0);
  slot_of_.assign(size_t(store_.num_experts()), -1);
  uses_ = 0;
}

void EcssExperts::gather_and_bind(std::span<const ExpertId> ids) {
  const size_t n = ids.size();
  SIGMA_CHECK(n <= slot_id_.size(), "ECSS: {} experts for a pool of {} slots", n, slot_id_.size());
  // The n slots to refill: empty ones, then those whose expert's next use in the step is
  // farthest (never again first), then the least recently used; ties by slot number.
  std::vector<int32_t> victims(slot_id_.size());
  std::vector<int64_t> next(slot_id_.size(), INT64_MAX);
  for (size_t i = 0; i < victims.size(); ++i) {
    victims[i] = int32_t(i);
    if (slot_full_[i] && micro_ >= 0) next[i] = next_use(slot_id_[i]);
  }
  std::partial_sort(victims.begin(), victims.begin() + std::ptrdiff_t(n), victims.end(),
                    [&](int32_t a, int32_t b) {
                      const auto key = [&](int32_t s) {
                        return std::tuple(slot_full_[size_t(s)], -next[size_t(s)], slot_used_[size_t(s)], s);
                      };
                      return key(a) < key(b);
                    });
  std::vector<float*> dst(n);  // device addresses: the store's gather uploads to them
  for (size_t i = 0; i < n; ++i) dst[i] = w_.dev_f() + int64_t(victims[i]) * stride_;
  const auto t = Clock::now();
  store_.gather(ids, dst);
  stats_.gather_s += since(t);
  step_pieces_ += 1;  // counted when the step is applied (an evaluation's gathers are not)
  step_gathered_ += int64_t(n) * P_ * 4;
  for (size_t i = 0; i < n; ++i) {
    const size_t s = size_t(victims[i]);
    if (slot_full_[s]) {
      const ExpertId old = slot_id_[s];
      model_.bind_expert(old.block, first_[size_t(old.group)] + old.expert, nullptr, nullptr);
      slot_of_[size_t(store_.ordinal(old))] = -1;
    }
    const ExpertId id = ids[i];
    model_.bind_expert(id.block, first_[size_t(id.group)] + id.expert, dst[i], g_.dev_f() + int64_t(s) * stride_);
    slot_id_[s] = id;
    slot_full_[s] = 1;
    slot_used_[s] = ++uses_;
    slot_of_[size_t(store_.ordinal(id))] = int32_t(s);
  }
}

// A training step's passes in order: per micro-batch j, the RRE blocks forward, then backward
// in reverse (a Remat::Blocks recompute counts as its block's backward).
int64_t EcssExperts::pass_position(int block, bool backward) const {
  const ModelConfig& cfg = model_.config();
  const int64_t L = cfg.rre_layers, l = block - cfg.first_rre_block();
  return micro_ * 2 * L + (backward ? 2 * L - 1 - l : l);
}

int64_t EcssExperts::next_use(ExpertId id) const {
  const int64_t o = store_.ordinal(id);
  const int64_t L = model_.config().rre_layers, l = id.block - model_.config().first_rre_block();
  for (int64_t j = micro_; j < int64_t(used_in_.size()); ++j) {
    if (!used_in_[size_t(j)][size_t(o)]) continue;
    for (const int64_t at : {j * 2 * L + l, j * 2 * L + 2 * L - 1 - l})
      if (at > pass_at_) return at;
  }
  return INT64_MAX;
}

ExpertId EcssExperts::expert_id(int block, int e) const {
  const int32_t g = int32_t(std::upper_bound(first_.begin(), first_.end(), e) - first_.begin()) - 1;
  return {block, g, e - first_[size_t(g)]};
}

void EcssExperts::release_grads() {
  grads_.zero(0, int64_t(ids_.size()));
  for (ExpertId id : ids_) grad_slot_[size_t(store_.ordinal(id))] = -1;
  grads_pending_ = false;
}

float* EcssExperts::grad_of(ExpertId id) const {
  const int32_t s = grad_slot_[size_t(store_.ordinal(id))];
  SIGMA_CHECK(s >= 0, "expert (block {}, group {}, expert {}) has no gradient slot: it is not one "
              "of this step's experts", id.block, id.group, id.expert);
  return grads_.slot(s);
}

void EcssExperts::begin_step(std::span<const Batch> micro) {
  join_prefetch();
  if (grads_pending_) release_grads();  // the last step was not applied: its gradients go
  const std::vector<Active> active = active_of(micro);
  ids_ = active_ids(active);
  for (size_t i = 0; i < ids_.size(); ++i) grad_slot_[size_t(store_.ordinal(ids_[i]))] = int32_t(i);
  step_pieces_ = step_gathered_ = step_reused_ = 0;
  whole_step_ = int64_t(ids_.size()) <= budget_experts_;
  reset_pool(whole_step_ ? int64_t(ids_.size()) : budget_experts_);
  used_in_.clear();
  micro_ = -1;
  const int first = model_.config().first_rre_block();
  for (size_t j = 0; !whole_step_ && j < active.size(); ++j) {  // for the eviction rule
    std::vector<uint8_t>& used = used_in_.emplace_back(size_t(store_.num_experts()), 0);
    for (size_t bi = 0; bi < active[j].size(); ++bi)
      for (int e : active[j][bi]) used[size_t(store_.ordinal(expert_id(first + int(bi), e)))] = 1;
  }
  if (whole_step_) gather_and_bind(ids_);
  grads_pending_ = true;
}

template <class Pass>
void EcssExperts::by_slices(int block, const RrePlan& p, Pass pass) {
  const ExpertSlice whole = whole_plan(p);
  // The experts with rows, each tagged with its piece: 0 = in the pool already, k = the k-th
  // pool-full to gather.
  std::vector<int> busy, piece;
  std::vector<ExpertId> ids;  // [busy]
  int pieces = 0, in_piece = 0;
  for (int e = whole.begin; e < whole.end; ++e) {
    if (p.rows(e) == 0) continue;
    const ExpertId id = expert_id(block, e);
    const int32_t s = slot_of_[size_t(store_.ordinal(id))];
    if (s >= 0) {
      slot_used_[size_t(s)] = ++uses_;  // the pool-fulls below evict these last
      step_reused_ += P_ * 4;
    } else if (in_piece++ % budget_experts_ == 0) {
      ++pieces;
    }
    busy.push_back(e);
    piece.push_back(s >= 0 ? 0 : pieces);
    ids.push_back(id);
  }
  for (int k = 0; k <= pieces; ++k) {
    if (k > 0) {
      std::vector<ExpertId> load;
      for (size_t i = 0; i < busy.size(); ++i)
        if (piece[i] == k) load.push_back(ids[i]);
      gather_and_bind(load);
    }
    // One call per run of piece k's experts that no other busy expert interrupts: the bits do
    // not depend on how a pass is cut (each expert writes only its own rows and gradients).
    for (size_t i = 0; i < busy.size();) {
      if (piece[i] != k) { ++i; continue; }
      size_t j = i;
      while (j + 1 < busy.size() && piece[j + 1] == k) ++j;
      pass(ExpertSlice{busy[i], busy[j] + 1, whole.side_by_side});
      i = j + 1;
    }
  }
}

void EcssExperts::forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                          float* y, const float* x, int64_t N, int64_t d, int64_t f) {
  if (whole_step_) return LocalExperts::forward(block, w, p, b, y, x, N, d, f);
  if (micro_ >= 0) pass_at_ = pass_position(block, false);
  by_slices(block, p, [&](const ExpertSlice& s) {
    rre_forward(y, b.pre, b.act, b.gx, b.gy, x, w, p, s, N, d, f);
  });
}

template <class Pass>
void EcssExperts::backward_pass(int block, const RrePlan& p, const ExpertSlice& s, Pass pass) {
  std::vector<int> busy;
  for (int e = s.begin; e < s.end; ++e)
    if (p.rows(e) > 0) busy.push_back(e);
  auto grads = [&](int e) {  // the device gradient buffer of expert e's slot
    return g_.dev_f() + int64_t(slot_of_[size_t(store_.ordinal(expert_id(block, e)))]) * stride_;
  };
  for (int e : busy) ops::fill(grads(e), 0.0f, P_);
  pass();
  const int64_t n = int64_t(busy.size());
  // Looked up before the threads: grad_of's error must not be thrown inside them.
  std::vector<float*> areas;
  for (int e : busy) areas.push_back(grad_of(expert_id(block, e)));
#pragma omp parallel if (n > 1)
  {
    std::vector<float> h(static_cast<size_t>(P_));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int e = busy[size_t(i)];
      ops::download(h.data(), grads(e), size_t(P_) * sizeof(float));
      float* area = areas[size_t(i)];  // host memory
      for (int64_t k = 0; k < P_; ++k) area[k] += h[size_t(k)];
    }
  }
}

void EcssExperts::backward(int block, const RreWeights& w, const RrePlan& p,
                           const ExpertBuffers& b, float* dx, const float* dy, const float* x,
                           int64_t N, int64_t d, int64_t f) {
  if (whole_step_) {
    return backward_pass(block, p, whole_plan(p),
                         [&] { LocalExperts::backward(block, w, p, b, dx, dy, x, N, d, f); });
  }
  if (micro_ >= 0) pass_at_ = pass_position(block, true);
  by_slices(block, p, [&](const ExpertSlice& s) {
    backward_pass(block, p, s, [&] {
      rre_backward(dx, b.gx, b.gy, b.gdx, dy, x, b.pre, b.act, w, p, s, N, d, f);
    });
  });
}

void EcssExperts::prefetch(std::span<const Batch> next) {
  if (!store_.file_backed()) return;
  join_prefetch();
  std::vector<ExpertId> ids = active_ids(active_of(next));
  // Records that outgrow the budget would only evict this step's pages (and each other)
  // before they are used: a 27 GB prefetch through a 16 GB page cache read everything twice.
  uint64_t bytes = 0;
  for (ExpertId id : ids) bytes += store_.record_bytes(id);
  if (bytes > uint64_t(memory_budget_)) {
    stats_.prefetches_skipped += 1;
    return;
  }
  prefetcher_ = std::thread([this, ids = std::move(ids)] { store_.prefetch(ids, /*fault_in=*/true); });
}

size_t EcssExperts::group_slot(ExpertId id) const {
  const ModelConfig& cfg = model_.config();
  return size_t(id.block - cfg.first_rre_block()) * cfg.groups.size() + size_t(id.group);
}

bool EcssExperts::is_frozen(ExpertId id) const {
  return !frozen_.empty() && frozen_[group_slot(id)] != 0;
}

void EcssExperts::append_grad_sq_parts(std::vector<double>& parts) const {
  // The canonical order of optim/grad_norm.h: experts in (block, group, expert) order (ids_),
  // each expert's tensors in record order, each summed by sum_sq exactly as in the model.
  const int64_t n = int64_t(ids_.size());
  const ExpertGroupSpec& gs = store_.spec().groups.front();  // every group: the same layout
  const size_t leaves = gs.tensors.size(), first = parts.size();
  parts.resize(first + size_t(n) * leaves, 0.0);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    if (is_frozen(ids_[size_t(i)])) continue;
    const float* g = grads_.slot(i);  // ids_[i]'s slot (grad_of)
    for (size_t t = 0; t < leaves; ++t)
      parts[first + size_t(i) * leaves + t] = host_sum_sq(g + gs.offset(t), shape_numel(gs.tensors[t].shape));
  }
}

void EcssExperts::update(float lr, float grad_scale) {
  join_prefetch();
  join_store_reader();  // a background save still reading the records this step changes
  const AdamStepArgs a = expert_adam_args(optim_, lr, grad_scale);
  std::vector<ExpertId> update;
  std::vector<const float*> grads;
  for (ExpertId id : ids_)
    if (!is_frozen(id)) {
      update.push_back(id);
      grads.push_back(grad_of(id));
      stats_.record_bytes += int64_t(store_.record_bytes(id));
    }
  const auto t = Clock::now();
  store_.apply_grads(update, grads, a);
  release_grads();
  stats_.update_s += since(t);
  for (ExpertId id : update) changed_[group_slot(id)] = 1;
  stats_.steps += 1;
  stats_.experts_updated += int64_t(update.size());
  stats_.pieces += step_pieces_;
  stats_.gathered_bytes += step_gathered_;
  stats_.reused_bytes += step_reused_;
  reset_pool(0);  // the copies are stale now
}

void EcssExperts::write_groups(CheckpointWriter& w, const std::vector<uint8_t>& changed,
                               const std::string& base) const {
  const ModelConfig& cfg = model_.config();
  for (size_t gi = 0; gi < store_.spec().groups.size(); ++gi) {
    const ExpertGroupSpec& gs = store_.spec().groups[gi];
    const bool reuse = !changed[gi] && !base.empty();
    const std::string name = cfg.groups[size_t(gs.group)].name;
    auto id = [&](int32_t k) { return ExpertId{gs.block, gs.group, k}; };
    const ExpertViews views{[&](int32_t k) { return store_.weights(id(k)); },
                            [&](int32_t k) { return store_.m(id(k)); },
                            [&](int32_t k) { return store_.v(id(k)); },
                            [&](int32_t k) { return store_.step(id(k)); }};
    if (!reuse || !w.add_link(expert_group_file(gs.block, name, false), base))
      add_expert_weights_file(w, gs, name, views);
    if (!reuse || !w.add_link(expert_group_file(gs.block, name, true), base))
      add_expert_adam_file(w, gs, name, views);
  }
}

void EcssExperts::add_checkpoint_files(CheckpointWriter& w) const {
  write_groups(w, changed_, last_checkpoint_);
}

void EcssExperts::checkpoint_written(const std::string& dir) {
  last_checkpoint_ = dir;
  std::fill(changed_.begin(), changed_.end(), 0);
}

std::function<void(CheckpointWriter&)> EcssExperts::checkpoint_later() {
  join_store_reader();  // one save at a time
  auto read = std::make_shared<std::promise<void>>();
  store_read_ = read->get_future().share();
  std::vector<uint8_t> changed = changed_;
  std::string base = last_checkpoint_;
  std::fill(changed_.begin(), changed_.end(), 0);  // updates from now on go into the next one
  last_checkpoint_.clear();  // no links until this one is committed (link_from)
  return [this, read, changed = std::move(changed), base = std::move(base)](CheckpointWriter& w) {
    struct Done {  // the store is free again however the write ends
      std::promise<void>& p;
      ~Done() { p.set_value(); }
    } done{*read};
    write_groups(w, changed, base);
  };
}

void EcssExperts::join_store_reader() {
  if (store_read_.valid()) store_read_.wait();  // a job dropped unrun counts as done too
  store_read_ = {};
}

void EcssExperts::load(const std::string& dir) {
  const ModelConfig& cfg = model_.config();
  const bool per_group = !expert_group_files(dir, false).empty();
  auto paths = [&](const ExpertGroupSpec& gs) {
    return expert_group_paths(dir, per_group, gs.block, cfg.groups[size_t(gs.group)].name);
  };
  // Pass 1: the files' indexes and every step count; nothing changes yet.
  std::vector<std::vector<int64_t>> steps;  // per store group, per expert
  for (const ExpertGroupSpec& gs : store_.spec().groups) {
    const auto [model_path, opt_path] = paths(gs);
    steps.push_back(check_expert_group(gs, cfg.groups[size_t(gs.group)].name, model_path, opt_path));
  }
  // Pass 2: one group at a time.
  for (size_t gi = 0; gi < store_.spec().groups.size(); ++gi) {
    const ExpertGroupSpec& gs = store_.spec().groups[gi];
    const auto [model_path, opt_path] = paths(gs);
    load_expert_group(store_, gs, 0, gs.experts, cfg.groups[size_t(gs.group)].name, model_path,
                      opt_path, steps[gi]);
  }
  store_.flush();
  // The store now equals the checkpoint: unchanged groups can be linked from it.
  last_checkpoint_ = per_group ? dir : "";
  std::fill(changed_.begin(), changed_.end(), per_group ? 0 : 1);
}

}  // namespace sigma
