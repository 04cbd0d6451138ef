#include "ecss/ecss_experts.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/error.h"
#include "io/checkpoint_dir.h"
#include "model/names.h"
#include "optim/grad_norm.h"

namespace sigma {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Step counts in an optimizer file: per-expert "steps" (ECSS) or per-tensor "step" (in-model).
bool is_step(const std::string& n) { return n.ends_with(".steps") || n.ends_with(".step"); }

// The tensor `name` of file `path` (its index) must exist with this dtype and shape.
void check_tensor(const std::map<std::string, TensorInfo>& index, const std::string& path,
                  const std::string& name, DType dt, const Shape& shape) {
  auto it = index.find(name);
  SIGMA_CHECK(it != index.end(), "{}: expert tensor '{}' is missing", path, name);
  SIGMA_CHECK(it->second.dtype == dt && it->second.shape == shape,
              "{}: expert tensor '{}' is {} {} but the store expects {} {}", path, name,
              dtype_name(it->second.dtype), shape_str(it->second.shape), dtype_name(dt),
              shape_str(shape));
}

// load(), pass 1, for group gs (named `name` in the config): checks every expert tensor's name,
// dtype and shape in both files and returns the experts' step counts. Takes no store, so it
// cannot change it.
std::vector<int64_t> check_group(const ExpertGroupSpec& gs, const std::string& name,
                                 const std::string& model_path, const std::string& opt_path) {
  const Safetensors model_index = read_safetensors(model_path, [](const std::string&) { return false; });
  const Safetensors steps_file = read_safetensors(opt_path, is_step);
  for (size_t t = 0; t < gs.tensors.size(); ++t) {
    const std::string base = names::expert(gs.block, name, names::kExpertLeaves[t]);
    Shape shape{gs.experts};
    for (int64_t x : gs.tensors[t].shape) shape.push_back(x);
    check_tensor(model_index.index, model_path, base, DType::F32, shape);
    check_tensor(steps_file.index, opt_path, base + ".m", DType::F32, shape);
    check_tensor(steps_file.index, opt_path, base + ".v", DType::F32, shape);
  }
  const std::string per_expert = names::expert(gs.block, name, "steps");
  std::vector<int64_t> s;
  if (steps_file.index.count(per_expert)) {
    check_tensor(steps_file.index, opt_path, per_expert, DType::I64, {gs.experts});
    const int64_t* v = steps_file.tensors.at(per_expert).data<int64_t>();
    s.assign(v, v + gs.experts);
  } else {  // written by an in-model run or by surgery: one step per tensor
    const std::string one = names::expert(gs.block, name, names::kWIn) + ".step";
    check_tensor(steps_file.index, opt_path, one, DType::I64, {});
    s.assign(size_t(gs.experts), *steps_file.tensors.at(one).data<int64_t>());
  }
  for (int64_t x : s)
    SIGMA_CHECK(x >= 0, "{}: negative step count {} in group '{}'", opt_path, x, name);
  return s;
}

// load(), pass 2: reads group gs's weights and moments and stores every expert with its step
// count. w, m and v are scratch of one expert's floats each, kept across groups.
void load_group(ExpertStore& store, const ExpertGroupSpec& gs, const std::string& name,
                const std::string& model_path, const std::string& opt_path,
                const std::vector<int64_t>& steps, std::vector<float>& w, std::vector<float>& m,
                std::vector<float>& v) {
  const std::string prefix = names::expert_prefix(gs.block, name) + ".";
  // Names under the group's prefix: "w_in" (weights), "w_in.m" / "w_in.v" (moments).
  auto rest = [&](const std::string& n) {
    return n.starts_with(prefix) ? n.substr(prefix.size()) : std::string(".");
  };
  const Safetensors weights = read_safetensors(model_path, [&](const std::string& n) {
    return rest(n).find('.') == std::string::npos;
  });
  const Safetensors moments = read_safetensors(opt_path, [&](const std::string& n) {
    const std::string r = rest(n);
    return r.find('.') == r.size() - 2 && (r.ends_with(".m") || r.ends_with(".v"));
  });
  // Checked before this group reaches the store (earlier groups may already be there: a failed
  // resume leaves a store that only another resume, which replaces it all, will open).
  for (const auto& [n, t] : weights.tensors) check_finite(t, n, model_path);
  for (const auto& [n, t] : moments.tensors) check_finite(t, n, opt_path);
  for (int32_t k = 0; k < gs.experts; ++k) {
    for (size_t t = 0; t < gs.tensors.size(); ++t) {
      const std::string base = prefix + names::kExpertLeaves[t];
      const int64_t n = shape_numel(gs.tensors[t].shape), off = gs.offset(t);
      std::memcpy(w.data() + off, weights.tensors.at(base).f() + k * n, size_t(n) * 4);
      std::memcpy(m.data() + off, moments.tensors.at(base + ".m").f() + k * n, size_t(n) * 4);
      std::memcpy(v.data() + off, moments.tensors.at(base + ".v").f() + k * n, size_t(n) * 4);
    }
    const ExpertId id{gs.block, gs.group, k};
    store.set_weights(id, w.data());
    store.set_state(id, m.data(), v.data(), steps[size_t(k)]);
  }
}

}  // namespace

ExpertMode resolve_expert_mode(const std::string& setting, const ModelConfig& cfg) {
  const bool routed = cfg.rre_layers > 0 && !cfg.gated();
  if (setting == "model") return ExpertMode::InModel;
  if (setting == "auto") return routed ? ExpertMode::Ecss : ExpertMode::InModel;
  SIGMA_CHECK(setting == "ecss" || setting == "vanilla", "train.experts = '{}': expected auto, "
              "ecss, vanilla or model", setting);
  SIGMA_CHECK(routed, "train.experts = '{}' needs experts routed by tables (model.rre_layers > 0 "
              "and model.router = rre); this model has rre_layers = {}, router = {}", setting,
              cfg.rre_layers, cfg.router);
  return setting == "ecss" ? ExpertMode::Ecss : ExpertMode::Vanilla;
}

const char* expert_mode_name(ExpertMode m) {
  return m == ExpertMode::Ecss ? "ecss" : m == ExpertMode::Vanilla ? "vanilla" : "model";
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
  SIGMA_CHECK(model.external_experts() && mode != ExpertMode::InModel,
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
  budget_experts_ = (memory_budget - (store_.file_backed() && !grads_in_file ? area : 0)) / (stride_ * 4);
  SIGMA_CHECK(budget_experts_ >= 1, "train.expert_memory = {} bytes cannot hold one expert's "
              "weights ({} bytes); give it at least that", memory_budget, stride_ * 4);
  grads_ = GradientArea(store_.num_experts(), P_, grads_in_file ? store_path : "");
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
  model_.set_expert_executor(nullptr);
}

int64_t EcssExperts::params() const { return store_.num_experts() * P_; }

std::vector<ExpertId> EcssExperts::active_ids(std::span<const Batch> micro) const {
  const ModelConfig& cfg = model_.config();
  const int first = cfg.first_rre_block(), E = first_.back();
  std::vector<std::vector<std::vector<int>>> active;  // [micro][RRE block] -> experts
  if (mode_ == ExpertMode::Ecss)
    for (const Batch& b : micro) active.push_back(model_.active_experts(b));
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

void EcssExperts::gather_and_bind(std::span<const ExpertId> ids) {
  const int64_t n = int64_t(ids.size());
  if (w_.numel() < n * stride_) {  // grows to the largest set seen (slicing: to the budget)
    const int64_t slots = whole_step_ ? n : budget_experts_;
    w_ = Tensor();  // freed first: old and new together could be twice the budget
    w_ = Tensor::f32({slots, stride_});
    stats_.compute_bytes = w_.numel() * 4;
  }
  std::vector<float*> dst(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) dst[size_t(i)] = w_.f() + i * stride_;
  const auto t = Clock::now();
  store_.gather(ids, dst);
  stats_.gather_s += since(t);
  step_pieces_ += 1;  // counted when the step is applied (an evaluation's gathers are not)
  step_gathered_ += n * P_ * 4;
  for (int64_t i = 0; i < n; ++i) {
    const ExpertId id = ids[size_t(i)];
    model_.bind_expert(id.block, first_[size_t(id.group)] + id.expert, dst[size_t(i)], grad_of(id));
  }
  bound_.assign(ids.begin(), ids.end());
}

void EcssExperts::unbind(std::span<const ExpertId> ids) {
  for (ExpertId id : ids) model_.bind_expert(id.block, first_[size_t(id.group)] + id.expert, nullptr, nullptr);
}

void EcssExperts::release_grads() {
  std::vector<int64_t> slots;
  for (ExpertId id : ids_) slots.push_back(store_.ordinal(id));
  grads_.release(slots);
  grads_pending_ = false;
}

void EcssExperts::begin_step(std::span<const Batch> micro) {
  join_prefetch();
  if (grads_pending_) release_grads();  // the last step was not applied: its gradients go
  unbind(bound_);
  bound_.clear();
  ids_ = active_ids(micro);
  step_pieces_ = step_gathered_ = 0;
  whole_step_ = int64_t(ids_.size()) <= budget_experts_;
  if (whole_step_) gather_and_bind(ids_);
  grads_pending_ = true;
}

template <class Pass>
void EcssExperts::by_slices(int block, const RrePlan& p, Pass pass) {
  const ExpertSlice whole = whole_plan(p);
  int e = whole.begin;
  while (e < whole.end) {
    // The next slice: up to budget_experts_ experts with rows, from e on.
    std::vector<ExpertId> ids;
    int end = e;
    for (; end < whole.end && int64_t(ids.size()) < budget_experts_; ++end) {
      if (p.rows(end) == 0) continue;
      const int32_t g = int32_t(std::upper_bound(first_.begin(), first_.end(), end) - first_.begin()) - 1;
      ids.push_back({block, g, end - first_[size_t(g)]});
    }
    if (!ids.empty()) {
      gather_and_bind(ids);
      pass(ExpertSlice{e, end, whole.side_by_side});
      unbind(ids);
      bound_.clear();
    }
    e = end;
  }
}

void EcssExperts::forward(int block, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                          float* y, const float* x, int64_t N, int64_t d, int64_t f) {
  if (whole_step_) return LocalExperts::forward(block, w, p, b, y, x, N, d, f);
  by_slices(block, p, [&](const ExpertSlice& s) {
    rre_forward(y, b.pre, b.act, b.gx, b.gy, x, w, p, s, N, d, f);
  });
}

void EcssExperts::backward(int block, const RreWeights& w, const RrePlan& p,
                           const ExpertBuffers& b, float* dx, const float* dy, const float* x,
                           int64_t N, int64_t d, int64_t f) {
  if (whole_step_) return LocalExperts::backward(block, w, p, b, dx, dy, x, N, d, f);
  by_slices(block, p, [&](const ExpertSlice& s) {
    rre_backward(dx, b.scratch, b.gx, b.gy, b.gdx, dy, x, b.pre, b.act, w, p, s, N, d, f);
  });
}

void EcssExperts::prefetch(std::span<const Batch> next) {
  if (!store_.file_backed()) return;
  join_prefetch();
  std::vector<ExpertId> ids = active_ids(next);
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

std::string EcssExperts::group_file(size_t gi, bool adam) const {
  const ExpertGroupSpec& gs = store_.spec().groups[gi];
  return fmt::format("experts.{}.{}{}.safetensors", gs.block,
                     model_.config().groups[size_t(gs.group)].name, adam ? ".adam" : "");
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
    const float* g = grad_of(ids_[size_t(i)]);
    for (size_t t = 0; t < leaves; ++t)
      parts[first + size_t(i) * leaves + t] = sum_sq(g + gs.offset(t), shape_numel(gs.tensors[t].shape));
  }
}

void EcssExperts::update(float lr, float grad_scale) {
  join_prefetch();
  AdamStepArgs a;
  a.lr = lr;
  a.beta1 = optim_.beta1;
  a.beta2 = optim_.beta2;
  a.eps = optim_.eps_rre;
  a.weight_decay = optim_.weight_decay;
  a.grad_scale = grad_scale;
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
}

void EcssExperts::add_checkpoint_files(CheckpointWriter& w) const {
  const ModelConfig& cfg = model_.config();
  groups_written_ = groups_linked_ = 0;
  for (size_t gi = 0; gi < store_.spec().groups.size(); ++gi) {
    const ExpertGroupSpec& gs = store_.spec().groups[gi];
    const bool reuse = !changed_[gi] && !last_checkpoint_.empty();
    const std::string name = cfg.groups[size_t(gs.group)].name;
    auto stacked = [&](const std::string& tensor, size_t t, auto part_of) {
      TensorRef r{tensor, DType::F32, {gs.experts}, nullptr};
      for (int64_t s : gs.tensors[t].shape) r.shape.push_back(s);
      for (int32_t k = 0; k < gs.experts; ++k) r.parts.push_back(part_of(ExpertId{gs.block, gs.group, k}) + gs.offset(t));
      return r;
    };
    bool linked = true;
    const std::string weights_file = group_file(gi, false), adam_file = group_file(gi, true);
    if (!reuse || !w.add_link(weights_file, last_checkpoint_)) {
      std::vector<TensorRef> refs;
      for (size_t t = 0; t < gs.tensors.size(); ++t)
        refs.push_back(stacked(names::expert(gs.block, name, names::kExpertLeaves[t]), t,
                               [&](ExpertId id) { return store_.weights(id); }));
      w.add_safetensors(weights_file, refs, {{"format", "sigma-experts"}, {"version", "1"}});
      linked = false;
    }
    if (!reuse || !w.add_link(adam_file, last_checkpoint_)) {
      std::vector<TensorRef> refs;
      std::vector<Tensor> keep;  // step counts, alive until written
      keep.emplace_back(DType::I64, Shape{gs.experts});
      int64_t most = 0;
      for (int32_t k = 0; k < gs.experts; ++k) {
        keep.back().data<int64_t>()[k] = store_.step({gs.block, gs.group, k});
        most = std::max(most, keep.back().data<int64_t>()[k]);
      }
      refs.push_back(tensor_ref(names::expert(gs.block, name, "steps"), keep.back()));
      for (size_t t = 0; t < gs.tensors.size(); ++t) {
        const std::string base = names::expert(gs.block, name, names::kExpertLeaves[t]);
        refs.push_back(stacked(base + ".m", t, [&](ExpertId id) { return store_.m(id); }));
        refs.push_back(stacked(base + ".v", t, [&](ExpertId id) { return store_.v(id); }));
        keep.emplace_back(DType::I64, Shape{});
        *keep.back().data<int64_t>() = most;
        refs.push_back(tensor_ref(base + ".step", keep.back()));
      }
      w.add_safetensors(adam_file, refs, {{"format", "sigma-experts-adam"}, {"version", "1"}});
      linked = false;
    }
    (linked ? groups_linked_ : groups_written_) += 1;
  }
}

void EcssExperts::checkpoint_written(const std::string& dir) {
  last_checkpoint_ = dir;
  std::fill(changed_.begin(), changed_.end(), 0);
}

void EcssExperts::load(const std::string& dir) {
  const ModelConfig& cfg = model_.config();
  // An ECSS checkpoint has a pair of files per group; an in-model one (or a surgery output)
  // keeps every expert in model.safetensors and optimizer.safetensors.
  const bool per_group = !expert_group_files(dir, false).empty();
  auto paths = [&](size_t gi) -> std::pair<std::string, std::string> {
    if (per_group) return {dir + "/" + group_file(gi, false), dir + "/" + group_file(gi, true)};
    return {dir + "/model.safetensors", dir + "/optimizer.safetensors"};
  };
  // Pass 1: the files' indexes and every step count; nothing changes yet.
  std::vector<std::vector<int64_t>> steps;  // per store group, per expert
  for (size_t gi = 0; gi < store_.spec().groups.size(); ++gi) {
    const ExpertGroupSpec& gs = store_.spec().groups[gi];
    const auto [model_path, opt_path] = paths(gi);
    steps.push_back(check_group(gs, cfg.groups[size_t(gs.group)].name, model_path, opt_path));
  }
  // Pass 2: one group at a time.
  const size_t P = static_cast<size_t>(P_);
  std::vector<float> w(P), m(P), v(P);
  for (size_t gi = 0; gi < store_.spec().groups.size(); ++gi) {
    const ExpertGroupSpec& gs = store_.spec().groups[gi];
    const auto [model_path, opt_path] = paths(gi);
    load_group(store_, gs, cfg.groups[size_t(gs.group)].name, model_path, opt_path, steps[gi], w, m, v);
  }
  store_.flush();
  // The store now equals the checkpoint: unchanged groups can be linked from it.
  last_checkpoint_ = per_group ? dir : "";
  std::fill(changed_.begin(), changed_.end(), per_group ? 0 : 1);
}

}  // namespace sigma
