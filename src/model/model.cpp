#include "model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/rng.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/xent.h"
#include "model/ffn.h"
#include "model/gate.h"
#include "model/rre.h"

namespace sigma {

namespace {
using Buf = std::vector<float>;
}  // namespace

// What backward needs, per block; N = B*T rows.
struct Model::Acts {
  struct Block {
    Buf x;                   // [N,d] block input (residual stream)
    Buf a1, mean1, rstd1;    // LN1 output [N,d], its row stats [N]
    Buf qkv;                 // [N,3d] (query layer: the q third is unused)
    Buf qtop;                // [T,d] query layer: query table projected by W_q
    Buf probs;               // [B,H,T,T] attention probabilities
    Buf att;                 // [N,d] attention output before the output projection
    Buf mid;                 // [N,d] residual after attention
    Buf a2, mean2, rstd2;    // LN2 output and stats
    Buf pre, act;            // [N,f] FFN before and after FastGelu (experts: [k*N,f] in plan order)
    RrePlan plan;            // RRE block: rows grouped by expert
    GatePlan gplan;          // learned-gate block: choices, gates, gathered layout
    Buf yg;                  // [k*N,d] learned-gate block: each expert's output
  };
  int B = 0, T = 0;
  std::vector<int32_t> rows;  // [N] embedding rows: slot*V + token
  std::vector<int32_t> row_group;  // [N] expert group of each row (RRE blocks)
  std::vector<Block> blocks;
  Buf h_final;                // [N,d] output of the last block
  Buf hf, meanf, rstdf;       // final LayerNorm
  Buf logits;                 // [N,V], overwritten by its gradient when training
  // backward scratch
  Buf dh, da, datt, dqkv, dffn, dq_shared;
  Buf gx, gy, gdx;            // [k*N,d] expert gather scratch (forward and backward)
  Buf z;                      // [N,Kmax] learned gate: logits, then their gradient
  double scale_sum = 0;       // sum of grad_scale: d(loss)/d(aux loss)
};

double BlockLoad::imbalance() const {
  double worst = 0;
  for (const auto& g : tokens) {
    int64_t total = 0, most = 0;
    for (int64_t n : g) total += n, most = std::max(most, n);
    if (total > 0) worst = std::max(worst, double(most) * double(g.size()) / double(total));
  }
  return worst;
}

namespace {
bool ends_with(const std::string& n, const char* s) {
  const size_t k = std::strlen(s);
  return n.size() >= k && n.compare(n.size() - k, k, s) == 0;
}
// Initial std of a weight matrix: residual output projections get init_std / sqrt(2L).
float init_std_of(const std::string& name, const ModelConfig& cfg) {
  return (ends_with(name, "attn.out.w") || ends_with(name, "w_out"))
             ? cfg.init_std / std::sqrt(2.0f * cfg.layers) : cfg.init_std;
}
// Expert e's slice of the stacked tensor `name` ([K, in, out]): its own random stream.
void init_expert_matrix(float* v, const std::string& name, int64_t e, int64_t count, float std,
                        uint64_t seed) {
  const uint64_t stream = stream_of(fmt::format("{}[{}]", name, e).c_str());
  for (int64_t i = 0; i < count; ++i) v[i] = std * rng_normal(seed, stream, i);
}
}  // namespace

Model::Model(const ModelConfig& cfg, uint64_t seed, const TokenCounts* counts, bool external_experts)
    : cfg_(cfg), seed_(seed), external_experts_(external_experts), w_(new ModelWeights),
      a_(new Acts) {
  cfg_.validate();
  SIGMA_CHECK(!external_experts || (cfg_.rre_layers > 0 && !cfg_.gated()),
              "experts in a store need a sparse model routed by tables (model.rre_layers > 0, "
              "model.router = rre)");
  const int L = cfg_.layers;
  register_params(params_, cfg_, !external_experts);
  register_buffers(buffers_, cfg_);
  for (const DomainSpec& d : cfg_.domains)
    domain_group_.push_back(cfg_.rre_layers == 0 ? -1 : cfg_.group_index(d.group));

  // Initialisation: N(0, std) per tensor from its own RNG stream (so adding a tensor never
  // shifts another's values), and per expert from its own stream (so resizing a group never
  // shifts another expert); residual output projections scaled by 1/sqrt(2L) (GPT-2);
  // LayerNorm gains 1, biases 0.
  for (Param& p : params_.all()) {
    const std::string& n = p.name;
    float* v = p.value.f();
    const int64_t count = p.value.numel();
    const float std = init_std_of(n, cfg_);
    if (ends_with(n, "ln1.w") || ends_with(n, "ln2.w") || n == "final_ln.w") {
      std::fill(v, v + count, 1.0f);
    } else if (p.expert && p.value.shape().size() == 3) {  // [K, in, out]: one stream per expert
      const int64_t per = count / p.value.dim(0);
      for (int64_t e = 0; e < p.value.dim(0); ++e) init_expert_matrix(v + e * per, n, e, per, std, seed);
    } else if (!p.expert && p.value.shape().size() >= 2) {
      const uint64_t stream = stream_of(n.c_str());
      for (int64_t i = 0; i < count; ++i) v[i] = std * rng_normal(seed, stream, i);
    }
  }

  // Routing tables R[l][g] (DESIGN §2), independent per (block, group).
  for (int l = cfg_.first_rre_block(); l < L; ++l) {
    BlockLoad bl;
    bl.block = l;
    for (const GroupSpec& g : cfg_.groups) {
      bl.tokens.emplace_back(size_t(g.experts), 0);
      if (cfg_.gated()) continue;
      const std::string name = routing_name(l, g.name);
      int32_t* t = buffers_.at(name).value.data<int32_t>();
      std::vector<int32_t> table;
      if (cfg_.routing == "random") {
        table = random_routing_table(cfg_.vocab, g.experts, cfg_.routing_seed, l, g.name);
      } else if (counts) {
        auto it = counts->find(g.name);
        SIGMA_CHECK(it != counts->end() && int64_t(it->second.size()) == cfg_.vocab,
                    "model.routing = 'frequency': no token counts of length {} for group '{}'",
                    cfg_.vocab, g.name);
        table = frequency_routing_table(it->second, g.experts, cfg_.routing_seed, l, g.name);
      } else {
        unset_tables_.push_back(name);
      }
      std::copy(table.begin(), table.end(), t);
    }
    load_.push_back(std::move(bl));
  }

  *w_ = ModelWeights::bind(params_, buffers_, cfg_);
}

void Model::bind_expert(int block, int e, const float* weights, float* grads) {
  SIGMA_CHECK(external_experts_, "bind_expert: this model holds its experts itself");
  SIGMA_CHECK(block >= cfg_.first_rre_block() && block < cfg_.layers, "bind_expert: block {} has no experts", block);
  RreWeights& r = w_->blocks[size_t(block)].rre;
  SIGMA_CHECK(e >= 0 && e < r.experts(), "bind_expert: block {} has no expert {}", block, e);
  const int64_t d = cfg_.d_model, f = cfg_.ffn();
  if (!weights) {
    r.expert[size_t(e)] = {};
    r.expert_grad[size_t(e)] = {};
    return;
  }
  r.expert[size_t(e)] = {weights, weights + d * f, weights + d * f + f, weights + 2 * d * f + f};
  r.expert_grad[size_t(e)] = {grads, grads + d * f, grads + d * f + f, grads + 2 * d * f + f};
}

void Model::init_expert(int block, int g, int k, float* dst) const {
  const int64_t d = cfg_.d_model, f = cfg_.ffn();
  const std::string& group = cfg_.groups.at(size_t(g)).name;
  const std::string w_in = expert_tensor_name(block, group, "w_in"),
                    w_out = expert_tensor_name(block, group, "w_out");
  init_expert_matrix(dst, w_in, k, d * f, init_std_of(w_in, cfg_), seed_);
  std::fill(dst + d * f, dst + d * f + f, 0.0f);
  init_expert_matrix(dst + d * f + f, w_out, k, f * d, init_std_of(w_out, cfg_), seed_);
  std::fill(dst + 2 * d * f + f, dst + 2 * d * f + f + d, 0.0f);
}

void Model::load_buffer(const std::string& name, const Tensor& t) {
  SIGMA_CHECK(buffers_.contains(name), "the model has no buffer named '{}'", name);
  Buffer& b = buffers_.at(name);
  SIGMA_CHECK(t.dtype() == DType::I32 && t.shape() == b.value.shape(),
              "routing table '{}' is {} {} but the model needs I32 [{}] (one expert per token id "
              "of model.vocab = {})", name, dtype_name(t.dtype()), shape_str(t.shape()),
              cfg_.vocab, cfg_.vocab);
  // routing.{l}.{group}: the group's expert count bounds the entries.
  const std::string group = name.substr(name.find('.', std::strlen("routing.")) + 1);
  const int K = cfg_.groups[size_t(cfg_.group_index(group))].experts;
  const int32_t* src = t.data<int32_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    SIGMA_CHECK(src[i] >= 0 && src[i] < K,
                "routing table '{}' sends token id {} to expert {}, but group '{}' has {} "
                "experts", name, i, src[i], group, K);
  std::memcpy(b.value.bytes(), t.bytes(), t.nbytes());
  std::erase(unset_tables_, name);
}

void Model::check_routing_ready() const {
  SIGMA_CHECK(unset_tables_.empty(), "routing table '{}' is not set: model.routing = "
              "'frequency' needs token counts per group (or a checkpoint holding the tables)",
              unset_tables_.empty() ? std::string() : unset_tables_.front());
}

std::vector<std::vector<int>> Model::active_experts(const Batch& batch) const {
  SIGMA_CHECK(!cfg_.gated(), "active_experts: model.router = '{}' chooses experts inside the "
              "forward pass; only routing tables (router = rre) know them in advance", cfg_.router);
  check_routing_ready();
  std::vector<std::vector<int>> out;
  for (int l = cfg_.first_rre_block(); l < cfg_.layers; ++l) {
    const RreWeights& r = w_->blocks[size_t(l)].rre;
    std::vector<uint8_t> used(size_t(r.experts()), 0);
    for (int b = 0; b < batch.B; ++b) {
      const int g = domain_group_.at(size_t(batch.domain.at(size_t(b))));
      for (int t = 0; t < batch.T; ++t) {
        const int32_t x = batch.tokens.at(size_t(b) * batch.T + t);
        SIGMA_CHECK(x >= 0 && x < cfg_.vocab, "token id {} out of range [0, {})", x, cfg_.vocab);
        used[size_t(r.route(g, x))] = 1;
      }
    }
    std::vector<int> ids;
    for (int e = 0; e < r.experts(); ++e)
      if (used[size_t(e)]) ids.push_back(e);
    out.push_back(std::move(ids));
  }
  return out;
}

void Model::reset_expert_load() {
  for (auto& b : load_) {
    for (auto& g : b.tokens) std::fill(g.begin(), g.end(), 0);
    b.dropped = 0;
  }
}

Model::~Model() = default;

const float* Model::logits() const { return a_->logits.data(); }

double Model::train_flops_per_token() const {
  const double d = cfg_.d_model, V = cfg_.vocab, T = cfg_.context, L = cfg_.layers;
  const double per_block = 12.0 * d * d + 13.0 * d;  // qkv, out, ffn weights and biases
  // A top-2 gate runs two experts per token in each expert block.
  const double extra = double(cfg_.rre_layers) * (cfg_.experts_per_token() - 1) * (8.0 * d * d + 5.0 * d);
  return 6.0 * (L * per_block + extra) + 6.0 * V * d + 12.0 * L * T * d;
}

int64_t Model::active_params_per_token() const {
  const int64_t V = cfg_.vocab, d = cfg_.d_model, f = cfg_.ffn();
  int64_t n = 0;
  int64_t Kmax = 1;
  for (const auto& g : cfg_.groups) Kmax = std::max<int64_t>(Kmax, g.experts);
  for (const Param& p : params_.all())
    if (!p.expert && p.name.find(".gate.") == std::string::npos) n += p.value.numel();
  n -= int64_t(cfg_.slots - 1) * V * d;  // other slots' embedding rows
  // k experts per expert block (1 with RRE), and the gate of the widest group.
  n += int64_t(cfg_.rre_layers) * (cfg_.experts_per_token() * (2 * d * f + f + d) +
                                   (cfg_.gated() ? d * Kmax : 0));
  return n;
}

void Model::ensure_workspace(int B, int T) {
  SIGMA_CHECK(T <= cfg_.context, "batch length {} exceeds model.context {}", T, cfg_.context);
  if (a_->B == B && a_->T == T) return;
  const size_t N = size_t(B) * T, d = cfg_.d_model, f = cfg_.ffn(), V = cfg_.vocab,
               H = cfg_.heads;
  Acts& a = *a_;
  a.B = B;
  a.T = T;
  a.rows.assign(N, 0);
  a.blocks.assign(cfg_.layers, {});
  for (int l = 0; l < cfg_.layers; ++l) {
    auto& k = a.blocks[l];
    k.x.assign(N * d, 0);
    k.a1.assign(N * d, 0);
    k.mean1.assign(N, 0);
    k.rstd1.assign(N, 0);
    k.qkv.assign(N * 3 * d, 0);
    if (l == cfg_.layers - 1) k.qtop.assign(size_t(T) * d, 0);
    k.probs.assign(size_t(B) * H * T * T, 0);
    k.att.assign(N * d, 0);
    k.mid.assign(N * d, 0);
    k.a2.assign(N * d, 0);
    k.mean2.assign(N, 0);
    k.rstd2.assign(N, 0);
    const size_t rows = cfg_.is_rre_block(l) ? N * cfg_.experts_per_token() : N;
    k.pre.assign(rows * f, 0);
    k.act.assign(rows * f, 0);
    if (cfg_.is_rre_block(l) && cfg_.gated()) k.yg.assign(rows * d, 0);
  }
  a.h_final.assign(N * d, 0);
  a.hf.assign(N * d, 0);
  a.meanf.assign(N, 0);
  a.rstdf.assign(N, 0);
  a.logits.assign(N * V, 0);
  a.dh.assign(N * d, 0);
  a.da.assign(N * d, 0);
  a.datt.assign(N * d, 0);
  a.dqkv.assign(N * 3 * d, 0);
  a.dffn.assign(2 * N * (cfg_.rre_layers > 0 ? cfg_.experts_per_token() : 1) * f, 0);
  a.dq_shared.assign(size_t(T) * d, 0);
  a.row_group.assign(N, 0);
  if (cfg_.rre_layers > 0) {
    const size_t k = cfg_.experts_per_token();
    a.gx.assign(k * N * d, 0);
    a.gy.assign(k * N * d, 0);
    a.gdx.assign(k * N * d, 0);
    int Kmax = 1;
    for (const auto& g : cfg_.groups) Kmax = std::max(Kmax, g.experts);
    if (cfg_.gated()) a.z.assign(N * Kmax, 0);
  }
}

void Model::forward(const Batch& batch, float* token_loss, const float* grad_scale) {
  const int B = batch.B, T = batch.T;
  SIGMA_CHECK(B > 0 && T > 0 && batch.tokens.size() == size_t(B) * T &&
                  batch.targets.size() == size_t(B) * T && batch.domain.size() == size_t(B),
              "malformed batch (B={}, T={})", B, T);
  ensure_workspace(B, T);
  const int64_t N = int64_t(B) * T, d = cfg_.d_model, V = cfg_.vocab;
  Acts& a = *a_;
  for (int b = 0; b < B; ++b) {
    SIGMA_CHECK(batch.domain[b] >= 0 && size_t(batch.domain[b]) < cfg_.domains.size(),
                "batch row {} has domain index {} (model has {} domains)", b, batch.domain[b],
                cfg_.domains.size());
    const int64_t base = int64_t(cfg_.domains[batch.domain[b]].slot) * V;
    for (int t = 0; t < T; ++t) {
      const int32_t x = batch.tokens[size_t(b) * T + t], y = batch.targets[size_t(b) * T + t];
      SIGMA_CHECK(x >= 0 && x < V && y >= 0 && y < V,
                  "token id out of range [0, {}) at batch row {} position {}", V, b, t);
      a.rows[size_t(b) * T + t] = static_cast<int32_t>(base + x);
    }
    std::fill_n(a.row_group.begin() + int64_t(b) * T, T, domain_group_[size_t(batch.domain[b])]);
  }
  check_routing_ready();
  aux_loss_ = 0;
  a.scale_sum = 0;
  if (grad_scale)
    for (int64_t i = 0; i < N; ++i) a.scale_sum += grad_scale[i];
  cpu::embedding_forward(a.blocks[0].x.data(), a.rows.data(), w_->tokens.v, w_->positions.v, B,
                         T, d);
  for (int l = 0; l < cfg_.layers; ++l) block_forward(l, batch);
  head(batch, token_loss, grad_scale);
  if (!grad_scale) return;

  // Backward: a.dh holds dL/dh of the current residual stream.
  std::fill(a.dh.begin(), a.dh.end(), 0.0f);
  cpu::layernorm_backward(a.dh.data(), w_->lnf_w.g, w_->lnf_b.g, a.da.data(), a.h_final.data(),
                          a.meanf.data(), a.rstdf.data(), w_->lnf_w.v, N, d);
  for (int l = cfg_.layers - 1; l >= 0; --l) block_backward(l, batch, a.dh.data());
  cpu::embedding_backward(w_->tokens.g, w_->positions.g, a.dh.data(), a.rows.data(), B, T, d);
}

void Model::block_forward(int l, const Batch& batch) {
  const int B = batch.B, T = batch.T;
  const int64_t N = int64_t(B) * T, d = cfg_.d_model, f = cfg_.ffn(), H = cfg_.heads,
                hd = cfg_.head_dim();
  const bool query_layer = (l == cfg_.layers - 1);
  const BlockWeights& w = w_->blocks[l];
  Acts::Block& k = a_->blocks[l];

  cpu::layernorm_forward(k.a1.data(), k.mean1.data(), k.rstd1.data(), k.x.data(), w.ln1_w.v,
                         w.ln1_b.v, N, d);
  cpu::AttnOperand q;
  if (!query_layer) {
    cpu::linear_forward(k.qkv.data(), k.a1.data(), w.qkv_w.v, w.qkv_b.v, N, d, 3 * d);
    q = {k.qkv.data(), 3 * d, T * 3 * d};
  } else {
    // Keys and values from LN1(h): the K|V column slice of the QKV weight.
    cpu::linear_forward(k.qkv.data() + d, k.a1.data(), w.qkv_w.v + d, w.qkv_b.v + d, N, d, 2 * d,
                        false, {d, 3 * d, 3 * d});
    // Queries from the learned position table (not normalised), shared by every row.
    cpu::linear_forward(k.qtop.data(), w.query.v, w.qkv_w.v, w.qkv_b.v, T, d, d, false,
                        {d, 3 * d, d});
    q = {k.qtop.data(), d, 0};
  }
  const cpu::AttnOperand kk{k.qkv.data() + d, 3 * d, T * 3 * d};
  const cpu::AttnOperand vv{k.qkv.data() + 2 * d, 3 * d, T * 3 * d};
  cpu::attention_forward(k.att.data(), k.probs.data(), q, kk, vv, {B, T, T, H, hd},
                         1.0f / std::sqrt(float(hd)));
  std::copy(k.x.begin(), k.x.end(), k.mid.begin());
  cpu::linear_forward(k.mid.data(), k.att.data(), w.out_w.v, w.out_b.v, N, d, d, true);
  cpu::layernorm_forward(k.a2.data(), k.mean2.data(), k.rstd2.data(), k.mid.data(), w.ln2_w.v,
                         w.ln2_b.v, N, d);
  Buf& out = (l + 1 < cfg_.layers) ? a_->blocks[l + 1].x : a_->h_final;
  std::copy(k.mid.begin(), k.mid.end(), out.begin());
  if (!w.is_rre()) {
    ffn_forward(out.data(), k.pre.data(), k.act.data(), k.a2.data(), w.ffn(), N, d, f);
    return;
  }
  BlockLoad& load = load_[size_t(l - cfg_.first_rre_block())];
  if (cfg_.gated()) {
    gate_forward(out.data(), k.yg.data(), k.pre.data(), k.act.data(), a_->gx.data(),
                 a_->z.data(), k.gplan, k.a2.data(), w.rre, w.gate, a_->row_group.data(),
                 cfg_.experts_per_token(), cfg_.capacity_factor, N, d, f);
    aux_loss_ += double(cfg_.aux_loss_weight) * k.gplan.aux;
    load.dropped += k.gplan.dropped;
  } else {
    rre_plan(k.plan, w.rre, batch.tokens.data(), a_->row_group.data(), N);
    if (external_experts_)
      for (int e = 0; e < w.rre.experts(); ++e)
        SIGMA_CHECK(k.plan.rows(e) == 0 || w.rre.expert[size_t(e)].w_in,
                    "block {}: expert {} receives tokens but is not bound (not in the step's "
                    "active set)", l, e);
    rre_forward(out.data(), k.pre.data(), k.act.data(), a_->gx.data(), a_->gy.data(),
                k.a2.data(), w.rre, k.plan, N, d, f);
  }
  for (size_t g = 0; g < load.tokens.size(); ++g)
    for (size_t e = 0; e < load.tokens[g].size(); ++e) {
      const int ge = w.rre.offset[g] + int(e);
      load.tokens[g][e] += cfg_.gated() ? k.gplan.rows(ge) : k.plan.rows(ge);
    }
}

// Final LayerNorm, tied head over each row's slot, cross-entropy. With grad_scale, leaves
// dL/d(LNf output) in a.da.
void Model::head(const Batch& batch, float* token_loss, const float* grad_scale) {
  const int B = batch.B, T = batch.T;
  const int64_t N = int64_t(B) * T, d = cfg_.d_model, V = cfg_.vocab;
  Acts& a = *a_;
  cpu::layernorm_forward(a.hf.data(), a.meanf.data(), a.rstdf.data(), a.h_final.data(),
                         w_->lnf_w.v, w_->lnf_b.v, N, d);
  // Consecutive rows that share a slot form one GEMM against that slot's rows of E.
  auto for_each_slot_run = [&](auto&& fn) {
    for (int b0 = 0; b0 < B;) {
      const int slot = cfg_.domains[batch.domain[b0]].slot;
      int b1 = b0 + 1;
      while (b1 < B && cfg_.domains[batch.domain[b1]].slot == slot) ++b1;
      fn(int64_t(b0) * T, int64_t(b1 - b0) * T, int64_t(slot) * V * d);
      b0 = b1;
    }
  };
  for_each_slot_run([&](int64_t r0, int64_t rows, int64_t e0) {
    cpu::gemm(false, true, rows, V, d, 1.0f, a.hf.data() + r0 * d, d, w_->tokens.v + e0, d, 0.0f,
              a.logits.data() + r0 * V, V);
  });
  cpu::softmax_xent(a.logits.data(), token_loss, batch.targets.data(), grad_scale, N, V);
  if (!grad_scale) return;
  std::fill(a.da.begin(), a.da.end(), 0.0f);
  for_each_slot_run([&](int64_t r0, int64_t rows, int64_t e0) {
    const float* dlogits = a.logits.data() + r0 * V;
    cpu::gemm(false, false, rows, d, V, 1.0f, dlogits, V, w_->tokens.v + e0, d, 1.0f,
              a.da.data() + r0 * d, d);
    cpu::gemm(true, false, V, d, rows, 1.0f, dlogits, V, a.hf.data() + r0 * d, d, 1.0f,
              w_->tokens.g + e0, d);
  });
}

void Model::block_backward(int l, const Batch& batch, float* dh) {
  const int B = batch.B, T = batch.T;
  const int64_t N = int64_t(B) * T, d = cfg_.d_model, f = cfg_.ffn(), H = cfg_.heads,
                hd = cfg_.head_dim();
  const bool query_layer = (l == cfg_.layers - 1);
  const BlockWeights& w = w_->blocks[l];
  Acts::Block& k = a_->blocks[l];
  Acts& a = *a_;

  // FFN branch: dh is dL/d(block output); the residual passes it through unchanged.
  std::fill(a.da.begin(), a.da.end(), 0.0f);
  if (!w.is_rre())
    ffn_backward(a.da.data(), w.ffn_grad(), a.dffn.data(), dh, k.a2.data(), k.pre.data(),
                 k.act.data(), w.ffn(), N, d, f);
  else if (!cfg_.gated())
    rre_backward(a.da.data(), a.dffn.data(), a.gx.data(), a.gy.data(), a.gdx.data(), dh,
                 k.a2.data(), k.pre.data(), k.act.data(), w.rre, k.plan, N, d, f);
  else
    gate_backward(a.da.data(), a.dffn.data(), a.gx.data(), a.gy.data(), a.gdx.data(),
                  a.z.data(), dh, k.a2.data(), k.yg.data(), k.pre.data(), k.act.data(), k.gplan,
                  w.rre, w.gate, a.row_group.data(),
                  float(a.scale_sum * cfg_.aux_loss_weight), N, d, f);
  cpu::layernorm_backward(dh, w.ln2_w.g, w.ln2_b.g, a.da.data(), k.mid.data(), k.mean2.data(),
                          k.rstd2.data(), w.ln2_w.v, N, d);  // dh is now dL/d(mid)

  // Attention branch.
  std::fill(a.datt.begin(), a.datt.end(), 0.0f);
  cpu::linear_backward(a.datt.data(), w.out_w.g, w.out_b.g, dh, k.att.data(), w.out_w.v, N, d, d);
  std::fill(a.dqkv.begin(), a.dqkv.end(), 0.0f);
  cpu::AttnOperand q{k.qkv.data(), 3 * d, T * 3 * d};
  if (query_layer) q = {k.qtop.data(), d, 0};
  const cpu::AttnOperand kk{k.qkv.data() + d, 3 * d, T * 3 * d};
  const cpu::AttnOperand vv{k.qkv.data() + 2 * d, 3 * d, T * 3 * d};
  // dq always gets per-row storage (the q third of dqkv), even when q is shared.
  cpu::attention_backward({a.dqkv.data(), 3 * d, T * 3 * d}, {a.dqkv.data() + d, 3 * d, T * 3 * d},
                          {a.dqkv.data() + 2 * d, 3 * d, T * 3 * d}, a.datt.data(), k.att.data(),
                          k.probs.data(), q, kk, vv, {B, T, T, H, hd}, 1.0f / std::sqrt(float(hd)));
  std::fill(a.da.begin(), a.da.end(), 0.0f);
  if (!query_layer) {
    cpu::linear_backward(a.da.data(), w.qkv_w.g, w.qkv_b.g, a.dqkv.data(), k.a1.data(), w.qkv_w.v,
                         N, d, 3 * d);
  } else {
    cpu::linear_backward(a.da.data(), w.qkv_w.g + d, w.qkv_b.g + d, a.dqkv.data() + d,
                         k.a1.data(), w.qkv_w.v + d, N, d, 2 * d, {d, 3 * d, 3 * d});
    // The shared query: sum dq over the batch, then back through W_q to the query table.
    std::fill(a.dq_shared.begin(), a.dq_shared.end(), 0.0f);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) {
        const float* src = a.dqkv.data() + (int64_t(b) * T + t) * 3 * d;
        float* dst = a.dq_shared.data() + int64_t(t) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] += src[c];
      }
    cpu::linear_backward(w.query.g, w.qkv_w.g, w.qkv_b.g, a.dq_shared.data(), w.query.v,
                         w.qkv_w.v, T, d, d, {d, 3 * d, d});
  }
  cpu::layernorm_backward(dh, w.ln1_w.g, w.ln1_b.g, a.da.data(), k.x.data(), k.mean1.data(),
                          k.rstd1.data(), w.ln1_w.v, N, d);  // dh is now dL/d(block input)
}

}  // namespace sigma
