#include "parallel/expert_parallel.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "io/checkpoint_dir.h"
#include "kernels/ops.h"
#include "model/rre.h"
#include "optim/grad_norm.h"

namespace sigma {

// One source rank's rows for this rank's experts of group g in one RRE block, as they arrive:
// grouped by expert, each expert's rows in the source's row order.
struct ExpertParallel::Chunk {
  int g = 0, member = 0;  // the group and the source's member index in it
  int source = 0;         // the source's rank in world_ (the data group)
  int64_t rows = 0, at = 0;  // rows, and their first row in the block's buffers
  RrePlan plan;              // over the chunk's rows
  ExpertSlice slice;         // this rank's experts of g, run as in the source's whole pass
};

struct ExpertParallel::BlockState {
  std::vector<Chunk> chunks;  // of the last forward pass, in (group, member) order
  Tensor x, pre, act;         // on the device: received rows [rows, d]; activations [rows, f]
  std::vector<RrePlan> plans;      // [world rank]: the plan of its micro-batch planned[r]
  std::vector<int64_t> planned;
};

namespace {

// The gradient pointers of an expert whose P gradients start at g (the store's record layout).
FfnGrads grads_at(float* g, const ExpertGroupSpec& gs) {
  return {g + gs.offset(0), g + gs.offset(1), g + gs.offset(2), g + gs.offset(3)};
}

constexpr int64_t kStepFloats = 2;  // an int64 step count carried in two floats' bits

// A device buffer of at least n floats whose first `keep` survive a regrowth. Buffers only
// grow (a run's steps repeat their sizes), so a steady step allocates nothing.
void reserve(Tensor& t, int64_t n, int64_t keep = 0) {
  if (t.numel() >= n) return;
  Tensor bigger = ops::empty(DType::F32, {n});
  if (keep > 0) ops::copy(bigger.dev_f(), t.dev_f(), keep);
  t = std::move(bigger);
}

// The communicator's buffers are host memory: rows cross the host boundary on either side of
// every exchange (a device-aware MPI could skip both copies).
void download_to(std::vector<float>& host, const float* src, int64_t n) {
  host.resize(size_t(n));
  if (n > 0) ops::download(host.data(), src, size_t(n) * sizeof(float));
}
void upload_from(float* dst, const std::vector<float>& host) {
  if (!host.empty()) ops::upload(dst, host.data(), host.size() * sizeof(float));
}

// Rows [r0, r0 + n) of plan p's order: gathered from src into dst, or scattered from src into
// dst. A plan whose rows all go to one expert has the identity order, not uploaded: a copy.
void gather_plan_rows(float* dst, const float* src, const RrePlan& p, int64_t r0, int64_t n,
                      int64_t d) {
  if (n == 0) return;
  if (p.single >= 0) return ops::copy(dst, src + r0 * d, n * d);
  ops::gather_rows(dst, src, p.order_d.dev<int32_t>() + r0, n, d);
}
void scatter_plan_rows(float* dst, const float* src, const RrePlan& p, int64_t r0, int64_t n,
                       int64_t d, bool accumulate) {
  if (n == 0) return;
  if (p.single >= 0)
    return accumulate ? ops::add_into(dst + r0 * d, src, n * d) : ops::copy(dst + r0 * d, src, n * d);
  ops::scatter_rows(dst, src, p.order_d.dev<int32_t>() + r0, n, d, accumulate);
}

}  // namespace

ExpertParallel::ExpertParallel(Model& model, Communicator& world, GroupPlacement placement,
                               const OptimConfig& optim, const std::string& store_path,
                               bool resuming)
    : model_(model), world_(world), placement_(std::move(placement)), optim_(optim) {
  for (int r = 0; r < world.size(); ++r) {
    const size_t p = size_t(world.world_rank(r));
    if (rank_of_process_.size() <= p) rank_of_process_.resize(p + 1, -1);
    rank_of_process_[p] = r;
  }
  const ModelConfig& cfg = model.config();
  SIGMA_CHECK(model.external_experts(), "ExpertParallel needs a model built with external experts");
  SIGMA_CHECK(cfg.rre_layers > 0, "expert parallelism needs expert blocks (model.rre_layers > 0)");
  SIGMA_CHECK(placement_.ranks.size() == cfg.groups.size(), "a placement of {} expert groups "
              "for a model of {}", placement_.ranks.size(), cfg.groups.size());
  const int R = world.size(), me = world.rank();
  f_ = cfg.ffn() / model.tp().size;  // with tp > 1 the store holds this rank's columns of each expert
  first_block_ = cfg.first_rre_block();
  blocks_ = cfg.layers - first_block_;
  source_.assign(size_t(R), 0);
  ExpertStoreSpec spec;
  for (size_t g = 0; g < cfg.groups.size(); ++g) {
    const std::vector<int>& ranks = placement_.ranks[g];
    SIGMA_CHECK(!ranks.empty() && std::is_sorted(ranks.begin(), ranks.end()) &&
                    std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end() &&
                    ranks.front() >= 0 && ranks.back() < R,
                "expert group '{}' is placed on no valid set of ranks (ascending, distinct, "
                "below {})", cfg.groups[g].name, R);
    Group& gr = groups_.emplace_back();
    gr.E0 = E_;
    gr.K = cfg.groups[g].experts;
    E_ += gr.K;
    const auto it = std::find(ranks.begin(), ranks.end(), me);
    std::unique_ptr<Communicator> c = world.split(it != ranks.end() ? 1 : 0);  // every rank calls
    if (it == ranks.end()) continue;
    const size_t m = size_t(it - ranks.begin());
    SIGMA_CHECK(c->size() == int(ranks.size()) && c->rank() == int(m),
                "group communicator of '{}' has {} ranks", cfg.groups[g].name, c->size());
    gr.comm = std::move(c);
    gr.first = GroupPlacement::first(gr.K, ranks.size(), m);
    gr.count = GroupPlacement::first(gr.K, ranks.size(), m + 1) - gr.first;
    for (int r : ranks) source_[size_t(r)] = 1;
  }
  mine_.assign(size_t(E_), 0);
  for (const Group& gr : groups_)
    for (int32_t k = gr.first; k < gr.first + gr.count; ++k) mine_[size_t(gr.E0 + k)] = 1;
  for (int l = first_block_; l < cfg.layers; ++l)
    for (size_t g = 0; g < groups_.size(); ++g)
      if (groups_[g].count > 0)
        spec.groups.push_back(rre_group_spec(l, int32_t(g), groups_[g].count, cfg.d_model, f_));
  P_ = rre_group_spec(first_block_, 0, 1, cfg.d_model, f_).params();
  stride_ = (P_ + 15) / 16 * 16;
  if (!spec.groups.empty()) {
    store_.emplace(store_path.empty() ? ExpertStore::in_ram(spec) : ExpertStore::open(store_path, spec));
    SIGMA_CHECK(!store_->file_backed() || store_->created() || resuming,
                "expert store {} already exists and holds the experts of an earlier run; continue "
                "that run with --resume CHECKPOINT, or remove the file (or choose another "
                "train.expert_store) to start a new one", store_path);
  }
  for (int b = 0; b < blocks_; ++b) {
    state_.push_back(std::make_unique<BlockState>());
    state_.back()->plans.resize(size_t(R));
    state_.back()->planned.assign(size_t(R), -1);
  }
  leaf_.resize(size_t(R));
  trees_.resize(size_t(R));
  model_.set_expert_executor(this);
  if (resuming || !store_) return;
  // A fresh run: this rank's experts start where in-model training would start them.
  std::vector<ExpertId> all;
  for (const ExpertGroupSpec& gs : store_->spec().groups)
    for (int32_t k = 0; k < gs.experts; ++k) all.push_back({gs.block, gs.group, k});
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(P_));
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < all.size(); ++i) {
      const ExpertId id = all[i];
      model_.init_expert(id.block, id.group, groups_[size_t(id.group)].first + id.expert, buf.data());
      store_->set_weights(id, buf.data());
    }
  }
}

ExpertParallel::~ExpertParallel() { model_.set_expert_executor(nullptr); }

int64_t ExpertParallel::owned_experts() const { return store_ ? store_->num_experts() : 0; }
int64_t ExpertParallel::store_bytes() const { return store_ ? int64_t(store_->data_bytes()) : 0; }

std::vector<CommStats> ExpertParallel::group_traffic() const {
  std::vector<CommStats> out;
  for (const Group& gr : groups_) out.push_back(gr.comm ? gr.comm->stats() : CommStats{});
  return out;
}

bool ExpertParallel::holds(int g, int32_t k) const {
  const Group& gr = groups_[size_t(g)];
  return k >= gr.first && k < gr.first + gr.count;
}

// The step's experts: every expert the batches activate (for the norm's pieces), and this
// rank's of them gathered from the store and bound to the model.
void ExpertParallel::bind_step_experts(std::span<const Batch> micro) {
  for (const ExpertId& id : ids_) model_.bind_expert(id.block, groups_[size_t(id.group)].E0 + id.expert, nullptr, nullptr);
  // A learned gate picks experts only inside the forward pass: every expert may be used (the
  // update touches only those that received rows, update()).
  const bool gated = model_.config().gated();
  std::vector<uint8_t> used(size_t(blocks_) * size_t(E_), gated ? 1 : 0);
  for (const Batch& b : gated ? std::span<const Batch>{} : micro) {
    const auto active = model_.active_experts(b);
    for (int bi = 0; bi < blocks_; ++bi)
      for (int e : active[size_t(bi)]) used[size_t(bi) * size_t(E_) + size_t(e)] = 1;
  }
  global_active_.clear();
  ids_.clear();
  slot_.assign(used.size(), -1);
  for (int bi = 0; bi < blocks_; ++bi)
    for (size_t g = 0; g < groups_.size(); ++g)
      for (int32_t k = 0; k < groups_[g].K; ++k) {
        const size_t at = size_t(bi) * size_t(E_) + size_t(groups_[g].E0 + k);
        if (!used[at]) continue;
        const ExpertId id{first_block_ + bi, int32_t(g), k};
        global_active_.push_back(id);
        if (!mine_[size_t(groups_[g].E0 + k)]) continue;
        slot_[at] = int32_t(ids_.size());
        ids_.push_back(id);
      }
  touched_.assign(ids_.size(), 0);
  const int64_t n = int64_t(ids_.size());
  if (w_.numel() < n * stride_) {
    w_ = Tensor();  // freed first: old and new together could be twice the step's experts
    w_ = ops::empty(DType::F32, {n, stride_});  // the compute weights, on the device
  }
  std::vector<ExpertId> local_ids;
  std::vector<float*> dst;
  for (int64_t i = 0; i < n; ++i) {
    local_ids.push_back(local(ids_[size_t(i)]));
    dst.push_back(w_.dev_f() + i * stride_);
  }
  if (n > 0) store_->gather(local_ids, dst);
  for (int64_t i = 0; i < n; ++i) {
    const ExpertId id = ids_[size_t(i)];
    model_.bind_expert(id.block, groups_[size_t(id.group)].E0 + id.expert, dst[size_t(i)], nullptr);
  }
}

void ExpertParallel::begin_step(std::span<const Batch> micro) {
  micro_ = micro;
  k_ = 0;
  in_micro_ = false;
  bind_step_experts(micro);
}

void ExpertParallel::begin_global_step(std::span<const Batch> micro, size_t first, size_t count) {
  const ModelConfig& cfg = model_.config();
  for (size_t i = first; i < first + count; ++i)
    for (int32_t dom : micro[i].domain) {
      const int g = model_.domain_group(dom);
      SIGMA_CHECK(groups_[size_t(g)].comm, "rank {} runs micro-batch {} of the step, which has "
                  "rows of domain '{}', but that domain's expert group '{}' is not placed on "
                  "this rank (dist.placement)", world_.rank(), i, cfg.domains[size_t(dom)].name,
                  cfg.groups[size_t(g)].name);
    }
  micro_ = micro;
  k_ = count;
  j_ = 0;
  in_micro_ = false;
  bind_step_experts(micro);
  const int64_t n = int64_t(ids_.size()) * stride_;
  for (size_t r = 0; r < leaf_.size(); ++r) {
    trees_[r] = TreeAccumulator();
    if (source_[r]) reserve(leaf_[r], n);
  }
  total_.clear();
  for (auto& s : state_) std::fill(s->planned.begin(), s->planned.end(), -1);
}

void ExpertParallel::begin_micro_batch(size_t j) {
  j_ = j;
  in_micro_ = true;
  const int64_t n = int64_t(ids_.size()) * stride_;
  for (size_t r = 0; r < leaf_.size(); ++r)
    if (source_[r] && n > 0) ops::fill(leaf_[r].dev_f(), 0.0f, n);
}

void ExpertParallel::end_micro_batch() {
  in_micro_ = false;
  // The leaves come to the host, where the store's Adam reads the step's sums (as ECSS's
  // gradients come to its GradientArea), and are summed there in TrainStep's tree order.
  const int64_t leaf = int64_t(ids_.size()) * stride_;
  for (size_t r = 0; r < leaf_.size(); ++r)
    if (source_[r]) {
      std::vector<float> h;
      download_to(h, leaf_[r].dev_f(), leaf);
      trees_[r].push(std::move(h));
    }
  if (j_ + 1 < k_) return;
  // The step's last micro-batch: the source ranks' subtotals, added in rank order.
  const size_t n = ids_.size() * size_t(stride_);
  total_.assign(n, 0.0f);
  if (n == 0) return;
  const std::vector<float> zero(n, 0.0f);
  std::vector<std::vector<float>> block(leaf_.size());
  std::vector<const float*> parts;
  for (size_t r = 0; r < leaf_.size(); ++r) {
    if (source_[r]) block[r] = trees_[r].finish();
    parts.push_back(source_[r] ? block[r].data() : zero.data());
  }
  tree_sum(total_.data(), parts.data(), int(parts.size()), int64_t(n));
}

const RrePlan& ExpertParallel::plan_of(int block, const RreWeights& w, int source_rank) {
  BlockState& s = *state_[size_t(block - first_block_)];
  const int64_t mb = int64_t(source_rank) * int64_t(k_) + int64_t(j_);
  if (s.planned[size_t(source_rank)] != mb) {
    const Batch& b = micro_[size_t(mb)];
    std::vector<int32_t> row_group(size_t(b.B) * size_t(b.T));
    for (size_t i = 0; i < row_group.size(); ++i)
      row_group[i] = model_.domain_group(b.domain[i / size_t(b.T)]);
    rre_plan(s.plans[size_t(source_rank)], w, b.tokens.data(), row_group.data(), int64_t(row_group.size()));
    s.planned[size_t(source_rank)] = mb;
  }
  return s.plans[size_t(source_rank)];
}

// A learned gate's plans exist only once the block's input does: the members of a group
// exchange their plans' rows per expert (one all-gather per group and block, the count
// exchange routing tables do without), and each builds every member's plan from them.
void ExpertParallel::exchange_plans(int block, Communicator& c, const RrePlan& p) {
  BlockState& s = *state_[size_t(block - first_block_)];
  const size_t n = size_t(c.size()), E = size_t(E_);
  std::vector<double> mine(E), all(n * E);
  for (size_t e = 0; e < E; ++e) mine[e] = double(p.rows(int(e)));
  c.all_gather(all.data(), mine.data(), int64_t(E));
  for (size_t m = 0; m < n; ++m) {
    std::vector<int64_t> start(E + 1, 0);
    for (size_t e = 0; e < E; ++e) start[e + 1] = start[e] + int64_t(all[m * E + e]);
    grouped_plan(s.plans[size_t(source_of(c, int(m)))], std::move(start));
  }
}

// send and recv are host memory (the communicator's buffers; download_to, upload_from).
void ExpertParallel::exchange(Communicator& c, const std::vector<float>& send,
                              const std::vector<int64_t>& send_rows, std::vector<float>& recv,
                              const std::vector<int64_t>& recv_rows, int64_t width) {
  std::vector<int64_t> sc(send_rows.size()), rc(recv_rows.size());
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = send_rows[i] * width;
  for (size_t i = 0; i < rc.size(); ++i) rc[i] = recv_rows[i] * width;
  recv.resize(size_t(std::accumulate(rc.begin(), rc.end(), int64_t(0))));
  c.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
}

// Rows of group gr per member of its communicator in plan p: member m holds a contiguous range
// of the group's experts, so its rows are contiguous in plan order.
std::vector<int64_t> ExpertParallel::rows_per_holder(const Group& gr, const RrePlan& p) const {
  const size_t n = size_t(gr.comm->size());
  std::vector<int64_t> rows(n);
  for (size_t m = 0; m < n; ++m)
    rows[m] = p.start[size_t(gr.E0 + GroupPlacement::first(gr.K, n, m + 1))] -
              p.start[size_t(gr.E0 + GroupPlacement::first(gr.K, n, m))];
  return rows;
}

// What member `member` (world rank `source`) sends this rank in one block: its rows for this
// rank's experts of group g, planned as they arrive.
ExpertParallel::Chunk ExpertParallel::chunk_from(int g, int member, int source, const RrePlan& q) const {
  const Group& gr = groups_[size_t(g)];
  const int e0 = gr.E0 + gr.first, e1 = e0 + gr.count;
  Chunk ch;
  ch.g = g, ch.member = member, ch.source = source;
  ch.rows = q.start[size_t(e1)] - q.start[size_t(e0)];
  RrePlan& cp = ch.plan;
  cp.start.assign(size_t(E_) + 1, 0);
  cp.expert.resize(size_t(ch.rows));
  for (int e = e0; e < e1; ++e) {
    cp.start[size_t(e) + 1] = q.rows(e);
    std::fill(cp.expert.begin() + (q.start[size_t(e)] - q.start[size_t(e0)]),
              cp.expert.begin() + (q.start[size_t(e) + 1] - q.start[size_t(e0)]), e);
  }
  std::partial_sum(cp.start.begin(), cp.start.end(), cp.start.begin());
  cp.order.resize(size_t(ch.rows));
  std::iota(cp.order.begin(), cp.order.end(), 0);
  cp.single = q.single;  // the whole micro-batch to one expert: run as one dense FFN there too
  if (cp.single < 0) upload_order(cp);
  ch.slice = {e0, e1, whole_plan(q).side_by_side};
  return ch;
}

void ExpertParallel::forward(int block, const RreWeights& w, const RrePlan& p,
                             const ExpertBuffers& b, float* y, const float* x, int64_t N,
                             int64_t d, int64_t f) {
  if (!in_micro_) return forward_replicated(w, p, b, y, x, N, d, f);
  BlockState& s = *state_[size_t(block - first_block_)];
  s.chunks.clear();
  int64_t held = 0;  // rows received so far in this block
  std::vector<float> send, recv, out, back;  // host: the exchanges' buffers
  for (size_t g = 0; g < groups_.size(); ++g) {
    const Group& gr = groups_[g];
    if (!gr.comm) continue;
    Communicator& c = *gr.comm;
    // Out: per holder, its rows of x, then the same rows of y (the residual the FFN adds to).
    const std::vector<int64_t> send_rows = rows_per_holder(gr, p);
    const int64_t r0 = p.start[size_t(gr.E0)], rows_g = p.start[size_t(gr.E0 + gr.K)] - r0;
    reserve(rows_d_, 2 * rows_g * d);
    for (int64_t m = 0, at = 0; m < c.size(); at += send_rows[size_t(m)], ++m) {
      const int64_t n = send_rows[size_t(m)];
      gather_plan_rows(rows_d_.dev_f() + 2 * at * d, x, p, r0 + at, n, d);
      gather_plan_rows(rows_d_.dev_f() + (2 * at + n) * d, y, p, r0 + at, n, d);
    }
    download_to(send, rows_d_.dev_f(), 2 * rows_g * d);
    // In: each member's rows for this rank's experts, known from its plan.
    std::vector<int64_t> recv_rows(size_t(c.size()), 0);
    const size_t first_chunk = s.chunks.size();
    const int64_t base = held;
    if (model_.config().gated()) exchange_plans(block, c, p);
    for (int m = 0; m < c.size(); ++m) {
      const int source = source_of(c, m);
      Chunk ch = chunk_from(int(g), m, source, model_.config().gated()
                                                   ? s.plans[size_t(source)]
                                                   : plan_of(block, w, source));
      for (int e = ch.slice.begin; e < ch.slice.end; ++e)  // the experts the step updates
        if (const int32_t slot = slot_[size_t(block - first_block_) * size_t(E_) + size_t(e)];
            slot >= 0 && ch.plan.rows(e) > 0)
          touched_[size_t(slot)] = 1;
      recv_rows[size_t(m)] = ch.rows;
      ch.at = held;
      held += ch.rows;
      if (ch.rows > 0) s.chunks.push_back(std::move(ch));
    }
    exchange(c, send, send_rows, recv, recv_rows, 2 * d);
    reserve(s.x, held * d, base * d);
    reserve(s.pre, held * f, base * f);
    reserve(s.act, held * f, base * f);
    reserve(out_d_, (held - base) * d);
    for (size_t i = first_chunk; i < s.chunks.size(); ++i) {
      const Chunk& ch = s.chunks[i];
      const size_t bytes = size_t(ch.rows * d) * sizeof(float);
      const float* in = recv.data() + 2 * (ch.at - base) * d;
      float* yr = out_d_.dev_f() + (ch.at - base) * d;
      ops::upload(s.x.dev_f() + ch.at * d, in, bytes);
      ops::upload(yr, in + ch.rows * d, bytes);
      reserve(gx_, ch.rows * d);
      reserve(gy_, ch.rows * d);
      rre_forward(yr, s.pre.dev_f() + ch.at * f, s.act.dev_f() + ch.at * f, gx_.dev_f(), gy_.dev_f(),
                  s.x.dev_f() + ch.at * d, w, ch.plan, ch.slice, ch.rows, d, f);
    }
    // Back: y + FFN(x) of every row, to the rank it came from.
    download_to(out, out_d_.dev_f(), (held - base) * d);
    exchange(c, out, recv_rows, back, send_rows, d);
    upload_from(rows_d_.dev_f(), back);
    scatter_plan_rows(y, rows_d_.dev_f(), p, r0, rows_g, d, /*accumulate=*/false);
  }
}

void ExpertParallel::backward(int block, const RreWeights& w, const RrePlan& p,
                              const ExpertBuffers&, float* dx, const float* dy, const float*,
                              int64_t, int64_t d, int64_t f) {
  SIGMA_CHECK(in_micro_, "ExpertParallel: a backward pass outside a training micro-batch");
  const int bi = block - first_block_;
  BlockState& s = *state_[size_t(bi)];
  const ExpertGroupSpec layout = rre_group_spec(block, 0, 1, d, f);
  std::vector<float> send, recv, out, back;  // host: the exchanges' buffers
  for (size_t g = 0; g < groups_.size(); ++g) {
    const Group& gr = groups_[g];
    if (!gr.comm) continue;
    Communicator& c = *gr.comm;
    const std::vector<int64_t> send_rows = rows_per_holder(gr, p);
    const int64_t r0 = p.start[size_t(gr.E0)], rows_g = p.start[size_t(gr.E0 + gr.K)] - r0;
    reserve(rows_d_, rows_g * d);
    gather_plan_rows(rows_d_.dev_f(), dy, p, r0, rows_g, d);
    download_to(send, rows_d_.dev_f(), rows_g * d);
    std::vector<int64_t> recv_rows(size_t(c.size()), 0);
    for (const Chunk& ch : s.chunks)
      if (ch.g == int(g)) recv_rows[size_t(ch.member)] = ch.rows;
    exchange(c, send, send_rows, recv, recv_rows, d);
    const int64_t rows = int64_t(recv.size()) / d;  // this group's chunks' rows
    reserve(in_d_, rows * d);
    reserve(out_d_, rows * d);
    upload_from(in_d_.dev_f(), recv);
    if (rows > 0) ops::fill(out_d_.dev_f(), 0.0f, rows * d);
    int64_t o = 0;  // rows of this group's chunks so far
    for (const Chunk& ch : s.chunks) {
      if (ch.g != int(g)) continue;
      RreWeights wl = w;  // the experts' gradients go to the source's leaf
      for (int e = ch.slice.begin; e < ch.slice.end; ++e) {
        const int32_t slot = slot_[size_t(bi) * size_t(E_) + size_t(e)];
        if (slot >= 0) wl.expert_grad[size_t(e)] = grads_at(leaf_[size_t(ch.source)].dev_f() + slot * stride_, layout);
      }
      reserve(gx_, ch.rows * d);
      reserve(gy_, ch.rows * d);
      reserve(gdx_, ch.rows * d);
      rre_backward(out_d_.dev_f() + o * d, gx_.dev_f(), gy_.dev_f(), gdx_.dev_f(),
                   in_d_.dev_f() + o * d, s.x.dev_f() + ch.at * d, s.pre.dev_f() + ch.at * f,
                   s.act.dev_f() + ch.at * f, wl, ch.plan, ch.slice, ch.rows, d, f);
      o += ch.rows;
    }
    download_to(out, out_d_.dev_f(), rows * d);
    exchange(c, out, recv_rows, back, send_rows, d);
    upload_from(rows_d_.dev_f(), back);
    scatter_plan_rows(dx, rows_d_.dev_f(), p, r0, rows_g, d, /*accumulate=*/true);
  }
}

void ExpertParallel::forward_replicated(const RreWeights& w, const RrePlan& p,
                                        const ExpertBuffers& b, float* y, const float* x,
                                        int64_t N, int64_t d, int64_t f) {
  reserve(out_d_, N * d);
  ops::copy(out_d_.dev_f(), y, N * d);
  const bool side = whole_plan(p).side_by_side;
  for (const Group& gr : groups_)
    if (gr.count > 0)
      rre_forward(out_d_.dev_f(), b.pre, b.act, b.gx, b.gy, x, w, p,
                  {gr.E0 + gr.first, gr.E0 + gr.first + gr.count, side}, N, d, f);
  std::vector<float> ours, mine(size_t(N * d), 0.0f);  // host: the all-reduce's buffers
  download_to(ours, out_d_.dev_f(), N * d);
  for (int64_t i = 0; i < N; ++i)
    if (mine_[size_t(p.expert[size_t(i)])])
      std::memcpy(mine.data() + i * d, ours.data() + i * d, size_t(d) * sizeof(float));
  world_.all_reduce_sum(mine.data(), N * d);  // one holder per row, zeros elsewhere: exact
  upload_from(y, mine);
}

void ExpertParallel::append_grad_sq_parts(std::vector<double>& parts) const {
  const ModelConfig& cfg = model_.config();
  const ExpertGroupSpec layout = rre_group_spec(first_block_, 0, 1, cfg.d_model, f_);
  const size_t leaves = layout.tensors.size(), first = parts.size();
  parts.resize(first + global_active_.size() * leaves, 0.0);
  for (size_t i = 0; i < global_active_.size(); ++i) {
    const ExpertId id = global_active_[i];
    const size_t at = size_t(id.block - first_block_) * size_t(E_) + size_t(groups_[size_t(id.group)].E0 + id.expert);
    if (slot_[at] < 0) continue;
    const float* g = total_.data() + slot_[at] * stride_;  // host, like the store's Adam
    for (size_t t = 0; t < leaves; ++t)
      parts[first + i * leaves + t] = host_sum_sq(g + layout.offset(t), shape_numel(layout.tensors[t].shape));
  }
}

void ExpertParallel::update(float lr, float grad_scale) {
  const AdamStepArgs a = expert_adam_args(optim_, lr, grad_scale);
  std::vector<ExpertId> update;
  std::vector<const float*> grads;
  for (size_t i = 0; i < ids_.size(); ++i) {
    if (!touched_[i]) continue;  // no row reached it this step (possible with a learned gate)
    update.push_back(local(ids_[i]));
    grads.push_back(total_.data() + int64_t(i) * stride_);
  }
  if (!update.empty()) store_->apply_grads(update, grads, a);
}

// Checkpoints. Each (RRE block, group) pair's file pair is written by one member of the group,
// the pairs taking the members in turn, so that the ranks write in parallel and none holds
// more than its share. Each expert's record travels to the writer as its weights, m and v (P
// floats each) and its step count (an int64's bits in two floats: moved, never added). With
// tp > 1 the records are first assembled whole at the tp group's rank 0 (the group's ranks
// hold the same experts' slices), which sends them on: the files are a tp = 1 run's.
int ExpertParallel::writer_of(int block, int g) const {
  const std::vector<int>& ranks = placement_.ranks[size_t(g)];  // blocks in turn, from g on
  return ranks[size_t(block - first_block_ + g) % ranks.size()];
}

void ExpertParallel::collect() {
  const ModelConfig& cfg = model_.config();
  const TpGroup& tp = model_.tp();
  SIGMA_CHECK(!tp.split() || (tp_ && tp_->size() == tp.size),
              "ExpertParallel: checkpointing experts split over {} tensor-parallel ranks needs "
              "the tp group's communicator (set_tensor_parallel)", tp.size);
  const int R = world_.size(), me = world_.rank();
  const int64_t d = cfg.d_model, f = cfg.ffn(), Pw = 2 * d * f + f + d;  // whole records
  const int64_t rec = 3 * Pw + kStepFloats, local_rec = 3 * P_ + kStepFloats;
  collected_.clear();
  std::vector<float> send, recv, mine, all;
  for (int l = first_block_; l < cfg.layers; ++l)
    for (size_t g = 0; g < groups_.size(); ++g) {
      const Group& gr = groups_[g];
      mine.resize(size_t(local_rec * gr.count));  // host: this rank's store records
      for (int32_t k = 0; k < gr.count; ++k) {
        const ExpertId id{l, int32_t(g), k};
        float* r = mine.data() + k * local_rec;
        std::memcpy(r, store_->weights(id), size_t(P_) * 4);
        std::memcpy(r + P_, store_->m(id), size_t(P_) * 4);
        std::memcpy(r + 2 * P_, store_->v(id), size_t(P_) * 4);
        const int64_t step = store_->step(id);
        std::memcpy(r + 3 * P_, &step, sizeof step);
      }
      if (!tp.split()) {
        send.swap(mine);
      } else {  // whole records from the tp group's slices (the same experts on each)
        // The slices go to the group's rank 0 alone (it sends the whole records on).
        const size_t n = mine.size();
        std::vector<int64_t> to(size_t(tp.size), 0), from(size_t(tp.size), 0);
        to[0] = int64_t(n);
        if (tp.rank == 0) std::fill(from.begin(), from.end(), int64_t(n));
        all.resize(tp.rank == 0 ? n * size_t(tp.size) : 0);
        if (n > 0) tp_->all_to_all_v(mine.data(), to.data(), all.data(), from.data());
        if (tp.rank != 0) continue;  // the tp group's rank 0 writes (save_checkpoint)
        send.resize(size_t(rec * gr.count));
        std::vector<const float*> parts(size_t(tp.size));
        for (int32_t k = 0; k < gr.count; ++k) {
          for (int64_t part = 0; part < 3; ++part) {  // weights, m, v
            for (int r = 0; r < tp.size; ++r)
              parts[size_t(r)] = all.data() + size_t(r) * n + k * local_rec + part * P_;
            tp_assemble_expert(send.data() + k * rec + part * Pw, parts.data(), d, f, tp.size);
          }
          std::memcpy(send.data() + k * rec + 3 * Pw, all.data() + k * local_rec + 3 * P_,
                      kStepFloats * sizeof(float));  // the group's ranks step alike
        }
      }
      const std::vector<int>& ranks = placement_.ranks[g];
      const int writer = writer_of(l, int(g));
      std::vector<int64_t> send_counts(size_t(R), 0), recv_counts(size_t(R), 0);
      for (size_t m = 0; me == writer && m < ranks.size(); ++m)
        recv_counts[size_t(ranks[m])] = rec * (GroupPlacement::first(gr.K, ranks.size(), m + 1) -
                                               GroupPlacement::first(gr.K, ranks.size(), m));
      send_counts[size_t(writer)] = rec * gr.count;
      recv.resize(size_t(std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t(0))));
      world_.all_to_all_v(send.data(), send_counts.data(), recv.data(), recv_counts.data());
      if (me == writer) collected_.push_back({l, int(g), std::move(recv)});
      recv = {};
    }
}

void ExpertParallel::add_checkpoint_files(CheckpointWriter& w) const {
  const ModelConfig& cfg = model_.config();
  const int64_t d = cfg.d_model, f = cfg.ffn(), P = 2 * d * f + f + d;  // whole records
  const int64_t rec = 3 * P + kStepFloats;
  for (const Collected& c : collected_) {
    const float* all = c.records.data();
    const ExpertGroupSpec gs = rre_group_spec(c.block, int32_t(c.group), groups_[size_t(c.group)].K,
                                              cfg.d_model, cfg.ffn());
    const ExpertViews views{[&](int32_t k) { return all + k * rec; },
                            [&](int32_t k) { return all + k * rec + P; },
                            [&](int32_t k) { return all + k * rec + 2 * P; },
                            [&](int32_t k) {
                              int64_t step;
                              std::memcpy(&step, all + k * rec + 3 * P, sizeof step);
                              return step;
                            }};
    add_expert_weights_file(w, gs, cfg.groups[size_t(c.group)].name, views);
    add_expert_adam_file(w, gs, cfg.groups[size_t(c.group)].name, views);
  }
}

std::vector<std::string> ExpertParallel::files_of_rank(int rank) const {
  const ModelConfig& cfg = model_.config();
  std::vector<std::string> files;
  for (int l = first_block_; l < cfg.layers; ++l)
    for (size_t g = 0; g < groups_.size(); ++g)
      if (writer_of(l, int(g)) == rank)
        for (bool adam : {false, true}) files.push_back(expert_group_file(l, cfg.groups[g].name, adam));
  return files;
}

void ExpertParallel::checkpoint_written(const std::string&) { collected_.clear(); }

void ExpertParallel::load(const std::string& dir) {
  if (!store_) return;
  const ModelConfig& cfg = model_.config();
  const bool per_group = !expert_group_files(dir, false).empty();
  std::vector<std::vector<int64_t>> steps;  // pass 1 checks everything before the store changes
  for (const ExpertGroupSpec& held : store_->spec().groups) {
    const Group& gr = groups_[size_t(held.group)];
    const std::string& name = cfg.groups[size_t(held.group)].name;
    const auto [model_path, opt_path] = expert_group_paths(dir, per_group, held.block, name);
    steps.push_back(check_expert_group(rre_group_spec(held.block, held.group, gr.K, cfg.d_model, cfg.ffn()),
                                       name, model_path, opt_path));
  }
  for (size_t i = 0; i < store_->spec().groups.size(); ++i) {
    const ExpertGroupSpec& held = store_->spec().groups[i];
    const Group& gr = groups_[size_t(held.group)];
    const std::string& name = cfg.groups[size_t(held.group)].name;
    const auto [model_path, opt_path] = expert_group_paths(dir, per_group, held.block, name);
    load_expert_group(*store_, rre_group_spec(held.block, held.group, gr.K, cfg.d_model, cfg.ffn()),
                      gr.first, gr.count, name, model_path, opt_path, steps[i], model_.tp().size,
                      model_.tp().rank);
  }
  store_->flush();
}

}  // namespace sigma
