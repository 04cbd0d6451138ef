// The model's passes: embedding, forward (training and cached decode), the head and loss,
// backward, per block. Construction, weights and counts are in model.cpp.
#include "model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/ops.h"
#include "model/ffn.h"
#include "model/gate.h"
#include "model/names.h"
#include "model/rre.h"

namespace sigma {

namespace {
void zero(Tensor& t) { ops::fill(t.dev_f(), 0.0f, t.numel()); }

void check_batch(const Batch& b) {
  SIGMA_CHECK(b.B > 0 && b.T > 0 && b.tokens.size() == size_t(b.B) * b.T &&
                  b.targets.size() == size_t(b.B) * b.T && b.domain.size() == size_t(b.B),
              "malformed batch (B={}, T={})", b.B, b.T);
}
// y[n] += the output of a layer whose every rank computes a partial sum over its slice: a
// row-parallel layer's forward, a column-parallel layer's input gradient. `layer(out)` adds
// this rank's share into out; with tp > 1 the shares meet in a zeroed scratch, one all-reduce
// (the same bits on every rank), then y. With tp = 1 the layer adds straight into y.
template <class Layer>
void add_tp_sum(const TpGroup& tp, float* y, float* scratch, int64_t n, Layer&& layer) {
  if (!tp.split()) return layer(y);
  ops::fill(scratch, 0.0f, n);
  layer(scratch);
  tp.all_reduce(scratch, n);
  ops::add_into(y, scratch, n);
}
}  // namespace

Remat remat_from_name(const std::string& name) {
  if (name == "none") return Remat::None;
  if (name == "attention") return Remat::Attention;
  if (name == "blocks") return Remat::Blocks;
  fail("unknown remat mode '{}' (known: none, attention, blocks)", name);
}

void Activations::ensure(const ModelConfig& cfg, int B_, int T_, Remat remat_, int tp_) {
  SIGMA_CHECK(T_ <= cfg.context, "batch length {} exceeds model.context {}", T_, cfg.context);
  if (B == B_ && T == T_ && remat == remat_ && tp == tp_) return;
  B = B_;
  T = T_;
  remat = remat_;
  tp = tp_;
  const int64_t N = int64_t(B) * T, d = cfg.d_model, f = cfg.ffn(), V = cfg.vocab, H = cfg.heads;
  const int64_t k = cfg.rre_layers > 0 ? cfg.experts_per_token() : 1;
  auto t = [](Shape s) { return ops::empty(DType::F32, std::move(s)); };
  rows.assign(size_t(N), 0);
  row_group.assign(size_t(N), 0);
  rows_d = ops::empty(DType::I32, {N}), targets_d = ops::empty(DType::I32, {N});
  loss_d = t({N}), weight_d = t({N});
  blocks.clear();
  blocks.resize(size_t(cfg.layers));
  // One block's buffers, sized for block l (expert blocks hold k rows per token).
  auto fill = [&](BlockActs& a, int l, bool with_att) {
    const int64_t rows_ffn = cfg.is_rre_block(l) ? k * N : N;
    const int64_t f_local = f / tp;  // the dense FFN's and each expert's columns
    a.a1 = t({N, d}), a.mean1 = t({N}), a.rstd1 = t({N});
    a.qkv = t({N, 3 * d / tp});
    if (l == cfg.layers - 1) a.qtop = t({T, d});
    a.lse = t({B, H, T});
    if (with_att) a.att = t({N, d / tp});
    a.mid = t({N, d});
    a.a2 = t({N, d}), a.mean2 = t({N}), a.rstd2 = t({N});
    a.pre = t({rows_ffn, f_local}), a.act = t({rows_ffn, f_local});
    if (cfg.is_rre_block(l) && cfg.gated()) a.yg = t({rows_ffn, d});
  };
  for (int l = 0; l < cfg.layers; ++l) {
    blocks[size_t(l)].x = t({N, d});
    if (remat != Remat::Blocks) fill(blocks[size_t(l)], l, remat == Remat::None);
  }
  work = BlockActs{};
  if (remat == Remat::Attention) work.att = t({N, d / tp});
  if (remat == Remat::Blocks) {  // the widest block: the query layer, an expert block if any
    fill(work, cfg.rre_layers > 0 ? cfg.layers - 1 : 0, true);
    if (!work.qtop.numel()) work.qtop = t({T, d});
  }
  h_final = t({N, d}), hf = t({N, d}), meanf = t({N}), rstdf = t({N});
  logits = t({N, V / tp});  // vocabulary-parallel: never the whole rows
  xent_stats = tp > 1 ? t({tp, N, 3}) : Tensor{};
  dh = t({N, d}), da = t({N, d});
  SIGMA_CHECK(f >= 4 * d, "attention's gradients live in the FFN's pre (att_grad)");
  dq_shared = t({T, d});
  tp_sum = tp > 1 ? t({N, d}) : Tensor{};
  if (cfg.rre_layers > 0) {
    gx = t({k * N, d}), gy = t({k * N, d}), gdx = t({k * N, d});
    int Kmax = 1;
    for (const auto& g : cfg.groups) Kmax = std::max(Kmax, g.experts);
    if (cfg.gated()) {
      z = t({N, Kmax}), gate_x = t({k * N, d}), gate_dy = t({k * N, d}), gate_dx = t({k * N, d});
      dgate = t({N, 2});
    }
  }
}

// Embedding rows (slot * V + token) and expert groups of every row; h0 = E[rows] + P[first_pos + t].
// Vocabulary-parallel (tp > 1): this rank holds ids [v0, v0 + V/P) of each slot, so a row is
// slot * V/P + token - v0, or -1 (zeros) for another rank's token; the group's all-reduce then
// adds one row and P - 1 zeros (the positions come from rank 0 alone): the tp = 1 bits.
void Model::embed(const Batch& batch, Activations& a, const int* first_pos) {
  const int B = batch.B, T = batch.T;
  const int64_t V = cfg_.vocab, Vl = V / tp_.size, v0 = Vl * tp_.rank;
  for (int b = 0; b < B; ++b) {
    SIGMA_CHECK(batch.domain[b] >= 0 && size_t(batch.domain[b]) < cfg_.domains.size(),
                "batch row {} has domain index {} (model has {} domains)", b, batch.domain[b],
                cfg_.domains.size());
    const int64_t base = int64_t(cfg_.domains[batch.domain[b]].slot) * Vl;
    for (int t = 0; t < T; ++t) {
      const int32_t x = batch.tokens[size_t(b) * T + t], y = batch.targets[size_t(b) * T + t];
      SIGMA_CHECK(x >= 0 && x < V && y >= 0 && y < V,
                  "token id out of range [0, {}) at batch row {} position {}", V, b, t);
      a.rows[size_t(b) * T + t] = x >= v0 && x < v0 + Vl ? static_cast<int32_t>(base + x - v0) : -1;
    }
    std::fill_n(a.row_group.begin() + int64_t(b) * T, T, domain_group_[size_t(batch.domain[b])]);
  }
  const int64_t d = cfg_.d_model;
  ops::upload(a.rows_d, a.rows.data(), a.rows.size() * sizeof(int32_t));
  ops::upload(a.targets_d, batch.targets.data(), batch.targets.size() * sizeof(int32_t));
  const int32_t* rows = a.rows_d.dev<int32_t>();
  // Rows [b0, b0 + n) from positions pos, on whichever table the model holds.
  auto lookup = [&](int64_t b0, int64_t n, const float* pos) {
    if (tp_.rank != 0) pos = nullptr;
    float* out = a.blocks[0].x.dev_f() + b0 * T * d;
    const int32_t* r = rows + b0 * T;
    const PV& e = w_->tokens;
    if (e.q)
      ops::embedding_forward_i8(out, r, e.q, e.s, pos, n, T, d);
    else if (e.h)
      ops::embedding_forward_w16(out, r, e.h, pos, n, T, d);
    else
      ops::embedding_forward(out, r, e.v, pos, n, T, d);
  };
  if (!first_pos) {
    lookup(0, B, w_->positions.v);
    tp_.all_reduce(a.blocks[0].x.dev_f(), int64_t(B) * T * d);
    return;
  }
  SIGMA_CHECK(!tp_.split(), "a tensor-parallel model has no KV cache (training only)");
  for (int b = 0; b < B; ++b)  // each row from its own position
    lookup(b, 1, w_->positions.v + int64_t(first_pos[b]) * d);
}

void Model::forward(const Batch& batch, Activations& a, float* token_loss,
                    const float* loss_weight) {
  const int B = batch.B, T = batch.T;
  check_batch(batch);
  a.ensure(cfg_, B, T, remat_, tp_.size);
  check_routing_ready();
  const size_t L = size_t(cfg_.layers);
  if (loss_weight && ops::precision() == ops::Precision::Bf16)  // mirror_weights reads them all
    for (size_t s = 0; s < grad_stages_.size(); ++s) params_needed(s);
  params_needed(L + 1);
  mirror_weights(loss_weight != nullptr);
  embed(batch, a, nullptr);
  params_done(L + 1);
  aux_loss_ = 0;
  a.weight_sum = 0;
  if (loss_weight)
    for (int64_t i = 0; i < int64_t(B) * T; ++i) a.weight_sum += loss_weight[i];
  for (int l = 0; l < cfg_.layers; ++l) {
    params_needed(size_t(l));
    block_forward(l, batch, a, nullptr);
    params_done(size_t(l));
  }
  params_needed(L);
  params_needed(L + 1);  // the tied head reads the token table
  head(batch, a, token_loss, loss_weight);
}

void KvCache::reset(const ModelConfig& cfg, int rows, DType t) {
  SIGMA_CHECK(t == DType::F32 || t == DType::BF16, "a KV cache holds F32 or BF16 values, not {}",
              dtype_name(t));
  B = rows;
  length.assign(size_t(rows), 0);
  context = cfg.context, heads = cfg.heads, head_dim = cfg.head_dim();
  dtype = t;
  kv.clear();
  for (int l = 0; l < cfg.layers; ++l)
    kv.push_back(ops::empty(dtype, {rows, 2, heads, context, head_dim}));
}

void KvCache::copy_prefix(int from, int to, int n) {
  if (from == to || n == 0) return;
  const int64_t run = context * head_dim;  // one head's keys (or values) of one row
  const size_t elem = dtype_size(dtype);
  for (Tensor& t : kv) {  // device to device: the cache lives on the backend's device
    auto* base = t.dev<uint8_t>();
    for (int64_t part = 0; part < 2 * heads; ++part)
      ops::copy_bytes(base + size_t((to * 2 * heads + part) * run) * elem,
                      base + size_t((from * 2 * heads + part) * run) * elem, size_t(n * head_dim) * elem);
  }
}

int64_t KvCache::bytes() const {
  int64_t n = 0;
  for (const Tensor& t : kv) n += t.numel() * int64_t(dtype_size(t.dtype()));
  return n;
}

void Model::use_kv_cache(DType t) {
  SIGMA_CHECK(t == DType::F32 || t == DType::BF16, "a KV cache holds F32 or BF16 values, not {}",
              dtype_name(t));
  kv_dtype_ = t;
}

void Model::forward_cached(const Batch& batch, KvCache& cache, Activations& a, float* token_loss,
                           const int* cache_rows) {
  cached_pass(batch, cache, a, token_loss, cache_rows, Outputs::All);
}

void Model::forward_cached_last(const Batch& batch, KvCache& cache, Activations& a, const int* cache_rows) {
  cached_pass(batch, cache, a, nullptr, cache_rows, Outputs::Last);
}

void Model::fill_cache(const Batch& batch, KvCache& cache, Activations& a, const int* cache_rows) {
  cached_pass(batch, cache, a, nullptr, cache_rows, Outputs::None);
}

void Model::cached_pass(const Batch& batch, KvCache& cache, Activations& a, float* token_loss,
                        const int* cache_rows, Outputs outputs) {
  const ops::FewRowKernels decode;  // a decode step's few rows may take the GEMVs (kernels/ops.h)
  const int B = batch.B, T = batch.T;
  check_batch(batch);
  if (cache.kv.empty()) cache.reset(cfg_, B, kv_dtype_);
  SIGMA_CHECK(cache_rows || cache.B == B, "KV cache holds {} sequences, the batch {}", cache.B, B);
  std::vector<int> rows(static_cast<size_t>(B)), start(static_cast<size_t>(B));
  std::vector<bool> used(static_cast<size_t>(cache.B), false);
  for (int b = 0; b < B; ++b) {
    const int r = cache_rows ? cache_rows[b] : b;
    SIGMA_CHECK(r >= 0 && r < cache.B && !used[size_t(r)],
                "batch row {} names cache row {} (the cache has {}; each row once)", b, r, cache.B);
    used[size_t(r)] = true;
    rows[size_t(b)] = r;
    start[size_t(b)] = cache.length[size_t(r)];
    SIGMA_CHECK(start[size_t(b)] + T <= cfg_.context,
                "generation reached the model's context length ({} positions)", cfg_.context);
  }
  a.ensure(cfg_, B, T);
  check_routing_ready();
  ops::bf16_mirror_clear();  // a training forward's copies; only reads when none is live
  if (mirrored_) mirrored_ = false;  // written only when set: concurrent passes write nothing
  embed(batch, a, start.data());
  a.weight_sum = 0;
  const int top = cfg_.layers - 1;
  const bool last_only = outputs == Outputs::Last && T > 1;
  for (int l = 0; l < cfg_.layers; ++l)
    block_forward(l, batch, a, &cache, false, rows.data(),
                  l == top && (outputs == Outputs::None || last_only) ? BlockPart::KeysValues
                                                                      : BlockPart::All);
  if (!last_only) {
    for (int r : rows) cache.length[size_t(r)] += T;
    if (outputs != Outputs::None) head(batch, a, token_loss, nullptr);
    return;
  }
  // The top block's rest and the head on each row's last position, moved to row b: a batch
  // of T = 1 whose cache rows hold the chunk's other positions already. In order: b < bT + T - 1,
  // and every later row's source lies past b.
  const int64_t d = cfg_.d_model;
  Batch last;
  last.resize(B, 1);
  last.domain = batch.domain;
  float* x = a.blocks[size_t(top)].x.dev_f();
  for (int b = 0; b < B; ++b) {
    const int64_t src = int64_t(b) * T + T - 1;
    last.tokens[size_t(b)] = batch.tokens[size_t(src)];  // level 2 of the routing: the token's id
    a.row_group[size_t(b)] = a.row_group[size_t(src)];
    ops::copy(x + b * d, x + src * d, d);
  }
  for (int r : rows) cache.length[size_t(r)] += T - 1;
  try {
    block_forward(top, last, a, &cache, false, rows.data(), BlockPart::Rest);
  } catch (...) {  // as after any failed pass: the cache's lengths without the chunk
    for (int r : rows) cache.length[size_t(r)] -= T - 1;
    throw;
  }
  for (int r : rows) cache.length[size_t(r)] += 1;
  head(last, a, nullptr, nullptr);
}

// Batch row b's new keys and values join cache row cache_rows[b] after its cached positions:
// head h's slice of the key (value) row goes to its own positions of the cache.
void Model::append_kv(int l, const Batch& batch, Activations& acts, KvCache& cache, const int* cache_rows) {
  const int64_t d = cfg_.d_model, H = cache.heads, hd = cache.head_dim, C = cache.context;
  const float* qkv = acts.block(l).qkv.dev_f();
  const bool bf16 = cache.dtype == DType::BF16;
  for (int b = 0; b < batch.B; ++b) {
    const int r = cache_rows[b];
    const int64_t row = r * 2 * H * C * hd;
    for (int t = 0; t < batch.T; ++t) {
      const float* src = qkv + (int64_t(b) * batch.T + t) * 3 * d + d;  // key | value
      const int64_t pos = cache.length[size_t(r)] + t;
      for (int64_t kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t at = row + ((kv * H + h) * C + pos) * hd;
          if (bf16)
            ops::convert_bf16(cache.kv[size_t(l)].dev<uint16_t>() + at, src + kv * d + h * hd, hd);
          else
            ops::copy(cache.kv[size_t(l)].dev_f() + at, src + kv * d + h * hd, hd);
        }
    }
  }
}

// Batch row b's new keys and values join its cache row, and its queries attend over them: one
// attention call per row, since rows differ in length.
void Model::cached_attention(int l, const Batch& batch, Activations& acts, KvCache& cache,
                             const int* cache_rows, ops::AttnOperand q, float* att, bool append) {
  const int B = batch.B, T = batch.T;
  const int64_t d = cfg_.d_model, H = cache.heads, hd = cache.head_dim, C = cache.context;
  const int64_t bs = 2 * H * C * hd;  // one cache row
  BlockActs& k = acts.block(l);
  if (append) append_kv(l, batch, acts, cache, cache_rows);
  // Scoring (ops::BatchInvariant, where a row's bits do not depend on the call's shape): rows
  // at the same position in consecutive cache rows share one call.
  bool one_call = ops::BatchInvariant::on();
  for (int b = 0; b < B && one_call; ++b)
    one_call = cache_rows[b] == cache_rows[0] + b &&
               cache.length[size_t(cache_rows[b])] == cache.length[size_t(cache_rows[0])];
  for (int b = 0; b < B; ++b) {
    const int p0 = cache.length[size_t(cache_rows[b])];
    if (one_call && b + 1 < B) continue;
    const int b0 = one_call ? 0 : b, n = one_call ? B : 1;
    const ops::AttnOperand qb{q.p + b0 * q.bs, q.ld, q.bs};
    float* out = att + int64_t(b0) * T * d;
    float* lse = k.lse.dev_f() + int64_t(b0) * H * T;
    const ops::AttnShape shape{n, T, p0 + T, H, hd};
    const float scale = 1.0f / std::sqrt(float(hd));
    if (cache.dtype == DType::BF16) {
      const uint16_t* keys = cache.kv[size_t(l)].dev<uint16_t>() + cache_rows[b0] * bs;
      ops::attention_forward_kv16(out, lse, qb, {keys, hd, bs, C * hd},
                                  {keys + H * C * hd, hd, bs, C * hd}, shape, scale);
    } else {
      const float* keys = cache.kv[size_t(l)].dev_f() + cache_rows[b0] * bs;
      ops::flash_attention_forward(out, lse, qb, {keys, hd, bs, C * hd},
                                   {keys + H * C * hd, hd, bs, C * hd}, shape, scale);
    }
  }
}

void Model::backward(const Batch& batch, Activations& a) {
  SIGMA_CHECK(!inference_, "backward: this model holds {} inference weights and no gradients "
              "(Model::use_weights), for inference only", weight_format_name(format_));
  SIGMA_CHECK(a.has_grad && a.B == batch.B && a.T == batch.T,
              "backward needs the forward pass of the same batch with loss weights first");
  a.has_grad = false;  // the head's gradient is consumed
  const size_t L = size_t(cfg_.layers);
  params_needed(L);
  params_needed(L + 1);
  head_backward(batch, a);
  grads_done(L);
  params_done(L);
  params_done(L + 1);  // the embeddings' backward reads no values
  for (int l = cfg_.layers - 1; l >= 0; --l) {
    params_needed(size_t(l));
    // The shared buffers still hold the last block's forward.
    if (a.remat == Remat::Blocks && l < cfg_.layers - 1) block_forward(l, batch, a, nullptr, true);
    block_backward(l, batch, a, a.dh.dev_f());
    grads_done(size_t(l));
    params_done(size_t(l));
  }
  ops::embedding_backward(w_->tokens.g, w_->positions.g, a.dh.dev_f(), a.rows_d.dev<int32_t>(), batch.B,
                          batch.T, cfg_.d_model);
  grads_done(size_t(cfg_.layers) + 1);
  ops::bf16_mirror_clear();  // the optimizer changes the weights next
}

// In bf16, a training forward's GEMMs and its backward's read each weight converted once
// (ops::bf16_mirror_add) instead of once per product. The copies live from here to the end of
// backward(), and every forward drops the previous ones first, so none outlives a change of
// the weights. Only the model's own tensors: experts bound from a store are not registered.
// (head() adds dL/dlogits the same way.)
void Model::mirror_weights(bool training) {
  ops::bf16_mirror_clear();
  mirrored_ = training && ops::precision() == ops::Precision::Bf16;
  if (!mirrored_) return;
  for (const Param& p : params_.all()) ops::bf16_mirror_add(p.value.dev_f(), p.value.numel());
}

// The same for an activation that a forward product and its backward's weight gradient both
// read, when it has its own buffer from forward to backward (remat = none). Registered before
// the product that first reads it, once whatever writes it has finished (conversion is lazy).
void Model::mirror(const Activations& a, float* p, int64_t n) const {
  if (mirrored_ && a.remat == Remat::None) ops::bf16_mirror_add(p, n);
}

// With a cache, batch row b's T positions follow its cache row's cached ones (cached_attention).
void Model::block_forward(int l, const Batch& batch, Activations& acts, KvCache* cache,
                          bool recompute, const int* cache_rows, BlockPart part) {
  const int B = batch.B, T = batch.T;
  const int64_t N = int64_t(B) * T, d = cfg_.d_model, hd = cfg_.head_dim();
  // This rank's share of the heads and of the dense FFN's width (all of them at tp = 1).
  const int64_t dl = d / tp_.size, fl = cfg_.ffn() / tp_.size, Hl = cfg_.heads / tp_.size;
  const bool query_layer = (l == cfg_.layers - 1);
  const BlockWeights& w = w_->blocks[l];
  BlockActs& k = acts.block(l);
  const float* x = acts.blocks[size_t(l)].x.dev_f();
  SIGMA_CHECK(!cache || !tp_.split(), "a tensor-parallel model has no KV cache (training only)");
  SIGMA_CHECK(part == BlockPart::All || (cache && (part == BlockPart::KeysValues || query_layer)),
              "block {}: only the query layer's rest runs apart from its keys and values", l);
  const bool kv_only = part == BlockPart::KeysValues;

  // Registered before LayerNorm writes them: it writes their bf16 copies in its own pass.
  if (!cache && !recompute) {
    mirror(acts, k.a1.dev_f(), N * d);
    mirror(acts, k.a2.dev_f(), N * d);
  }
  // The query layer's LN1 feeds its keys and values alone: its rest starts at the queries.
  if (part != BlockPart::Rest)
    ops::layernorm_forward(k.a1.dev_f(), k.mean1.dev_f(), k.rstd1.dev_f(), x, w.ln1_w.v, w.ln1_b.v, N, d);
  ops::AttnOperand q;
  // QKV column-parallel: this rank's heads of each of Q, K, V (dl columns each).
  if (!query_layer) {
    linear(k.qkv.dev_f(), k.a1.dev_f(), w.qkv_w.view(), w.qkv_b.v, N, d, 3 * dl);
    if (kv_only) return append_kv(l, batch, acts, *cache, cache_rows);
    q = {k.qkv.dev_f(), 3 * dl, T * 3 * dl};
  } else {
    // Keys and values from LN1(h): the K|V column slice of the QKV weight.
    if (part != BlockPart::Rest)
      linear(k.qkv.dev_f() + dl, k.a1.dev_f(), w.qkv_w.view(), w.qkv_b.v + dl, N, d, 2 * dl, false,
             {d, 3 * dl, 3 * dl}, dl);
    // Queries from the learned position table (not normalised): shared by every row in
    // training; from each row's own positions with a cache.
    if (kv_only) return append_kv(l, batch, acts, *cache, cache_rows);
    if (!cache) {
      linear(k.qtop.dev_f(), w.query.v, w.qkv_w.view(), w.qkv_b.v, T, d, dl, false, {d, 3 * dl, dl});
      q = {k.qtop.dev_f(), dl, 0};
    } else {
      if (k.qtop.numel() < N * d) k.qtop = ops::empty(DType::F32, {N, d});
      for (int b = 0; b < B; ++b)
        linear(k.qtop.dev_f() + int64_t(b) * T * d,
               w.query.v + int64_t(cache->length[size_t(cache_rows[b])]) * d, w.qkv_w.view(),
               w.qkv_b.v, T, d, d, false, {d, 3 * d, d});
      q = {k.qtop.dev_f(), d, T * d};
    }
  }
  float* att = acts.att(l);
  if (cache) {
    cached_attention(l, batch, acts, *cache, cache_rows, q, att, part != BlockPart::Rest);
  } else {
    ops::flash_attention_forward(att, k.lse.dev_f(), q, {k.qkv.dev_f() + dl, 3 * dl, T * 3 * dl},
                                 {k.qkv.dev_f() + 2 * dl, 3 * dl, T * 3 * dl}, {B, T, T, Hl, hd},
                                 1.0f / std::sqrt(float(hd)));
  }
  if (!cache && !recompute) mirror(acts, att, N * dl);
  ops::copy(k.mid.dev_f(), x, N * d);
  // Attention output row-parallel: mid = x + the group's sum of att_r @ W_r (+ b once).
  add_tp_sum(tp_, k.mid.dev_f(), acts.tp_sum.dev_f(), N * d, [&](float* y) {
    linear(y, att, w.out_w.view(), tp_.row_bias(w.out_b.v), N, dl, d, true);
  });
  ops::layernorm_forward(k.a2.dev_f(), k.mean2.dev_f(), k.rstd2.dev_f(), k.mid.dev_f(), w.ln2_w.v, w.ln2_b.v, N,
                         d);
  if (!cache && !recompute && !w.is_rre())
    mirror(acts, k.act.dev_f(), N * fl);  // written whole by FastGelu, then read
  float* out = (l + 1 < cfg_.layers) ? acts.blocks[size_t(l) + 1].x.dev_f() : acts.h_final.dev_f();
  ops::copy(out, k.mid.dev_f(), N * d);
  // A cached (inference) pass keeps no books, so concurrent ones share the model (forward_cached).
  if (w.is_rre()) return expert_forward(l, batch, acts, out, recompute || cache);
  // Dense FFN: w_in column-parallel, w_out row-parallel (its bias added once).
  FfnWeights fw = w.ffn();
  fw.b_out = tp_.row_bias(fw.b_out);
  add_tp_sum(tp_, out, acts.tp_sum.dev_f(), N * d, [&](float* y) {
    ffn_forward(y, k.pre.dev_f(), k.act.dev_f(), k.a2.dev_f(), fw, N, d, fl);
  });
}

// An expert block: the learned-gate baseline, or RRE through the executor; counts the load.
void Model::expert_forward(int l, const Batch& batch, Activations& acts, float* out,
                           bool recompute) {
  // Each expert split over the tp group as the dense FFN: this rank's f/tp columns of every
  // expert, the rows' outputs summed over the group, each expert's b_out added by rank 0.
  const int64_t N = int64_t(batch.B) * batch.T, d = cfg_.d_model, f = cfg_.ffn() / tp_.size;
  const BlockWeights& w = w_->blocks[l];
  RreWeights split_w;
  if (tp_.rank != 0) {
    split_w = w.rre;
    for (FfnWeights& e : split_w.expert) e.b_out = nullptr;
  }
  const RreWeights& rw = tp_.rank != 0 ? split_w : w.rre;
  BlockActs& k = acts.block(l);
  BlockLoad& load = load_[size_t(l - cfg_.first_rre_block())];
  const ExpertBuffers buf{k.pre.dev_f(), k.act.dev_f(), acts.gx.dev_f(), acts.gy.dev_f(), acts.gdx.dev_f()};
  if (cfg_.gated()) {  // the gate picks the rows' experts; the executor runs them
    GatePlan& gp = k.gplan;
    gate_route(gp, acts.z.dev_f(), k.a2.dev_f(), w.rre, w.gate, acts.row_group.data(),
               cfg_.experts_per_token(), cfg_.capacity_factor, N, d);
    gate_expert_plan(k.plan, gp);
    gate_gather(acts.gate_x.dev_f(), gp, k.a2.dev_f(), d);
    ops::fill(k.yg.dev_f(), 0.0f, gp.assigned * d);
    executor_->forward(l, rw, k.plan, buf, k.yg.dev_f(), acts.gate_x.dev_f(), gp.assigned, d, f);
    tp_.all_reduce(k.yg.dev_f(), gp.assigned * d);  // the rows' outputs, whole
    gate_combine(out, k.yg.dev_f(), gp, N, d);
    if (recompute) return;
    aux_loss_ += double(cfg_.aux_loss_weight) * gp.aux;
    load.dropped += gp.dropped;
  } else {
    rre_plan(k.plan, w.rre, batch.tokens.data(), acts.row_group.data(), N);
    const std::vector<size_t>& stages = expert_stages(l);
    add_tp_sum(tp_, out, acts.tp_sum.dev_f(), N * d, [&](float* y) {
      if (stages.empty() || executor_ != &local_ || !staged()) {
        for (size_t s : stages) params_needed(s);
        executor_->forward(l, rw, k.plan, buf, y, k.a2.dev_f(), N, d, f);
        for (size_t s : stages) params_done(s);
        return;
      }
      // Expert by expert, each read between its stage's hooks: slices of the whole pass, so
      // the same bits as one call (rre.h).
      for (size_t e = 0; e < stages.size(); ++e) {
        params_needed(stages[e]);
        rre_forward(y, buf.pre, buf.act, buf.gx, buf.gy, k.a2.dev_f(), rw, k.plan,
                    {int(e), int(e) + 1, false}, N, d, f);
        params_done(stages[e]);
      }
    });
  }
  if (recompute) return;
  for (size_t g = 0; g < load.tokens.size(); ++g)
    for (size_t e = 0; e < load.tokens[g].size(); ++e) {
      const int ge = w.rre.offset[g] + int(e);
      load.tokens[g][e] += k.plan.rows(ge);
    }
}

// Calls fn(first row, rows, offset of the slot's rows in E) for each run of consecutive batch
// rows that share an embedding slot: one GEMM against that slot's rows of the tied head (the
// V rows of the slot this rank holds: V = cfg.vocab / tp).
template <class Fn>
static void for_each_slot_run(const ModelConfig& cfg, const Batch& batch, int64_t V, Fn&& fn) {
  const int64_t T = batch.T, d = cfg.d_model;
  for (int b0 = 0; b0 < batch.B;) {
    const int slot = cfg.domains[batch.domain[b0]].slot;
    int b1 = b0 + 1;
    while (b1 < batch.B && cfg.domains[batch.domain[b1]].slot == slot) ++b1;
    fn(int64_t(b0) * T, int64_t(b1 - b0) * T, int64_t(slot) * V * d);
    b0 = b1;
  }
}

// Final LayerNorm, tied head over each row's slot, cross-entropy. With loss weights the
// logits are overwritten by their gradient. Vocabulary-parallel (tp > 1): this rank's logits
// are its V/P ids of each row, and the loss meets the group's per-row statistics in one
// all-reduce (kernels/cpu/xent.h): the [N, V] logits exist on no rank. With neither a loss to
// return nor loss weights (a decode step), the logits alone: the cross-entropy's exp of every
// logit was ~30 % of a decode token of the model trained on ../shared/data (16,384 ids, d = 128).
void Model::head(const Batch& batch, Activations& a, float* token_loss,
                 const float* loss_weight) {
  const int64_t N = int64_t(batch.B) * batch.T, d = cfg_.d_model, V = cfg_.vocab / tp_.size;
  // Read by the logits' product and the table's gradient: converted once, by LayerNorm.
  if (loss_weight) mirror(a, a.hf.dev_f(), N * d);
  ops::layernorm_forward(a.hf.dev_f(), a.meanf.dev_f(), a.rstdf.dev_f(), a.h_final.dev_f(), w_->lnf_w.v,
                         w_->lnf_b.v, N, d);
  for_each_slot_run(cfg_, batch, V, [&](int64_t r0, int64_t rows, int64_t e0) {
    if (w_->tokens.q)
      ops::gemm_nt_i8(a.logits.dev_f() + r0 * V, a.hf.dev_f() + r0 * d, w_->tokens.q + e0,
                      w_->tokens.s + e0 / d, rows, d, V, d, d, V);
    else if (w_->tokens.h)
      ops::gemm_nt_w16(a.logits.dev_f() + r0 * V, a.hf.dev_f() + r0 * d, w_->tokens.h + e0, rows, d, V,
                       d, d, V);
    else
      ops::gemm(false, true, rows, V, d, 1.0f, a.hf.dev_f() + r0 * d, d, w_->tokens.v + e0, d,
                0.0f, a.logits.dev_f() + r0 * V, V);
  });
  a.has_grad = loss_weight != nullptr;
  if (!token_loss && !loss_weight) return;
  if (loss_weight) ops::upload(a.weight_d, loss_weight, size_t(N) * sizeof(float));
  const float* grad_scale = loss_weight ? a.weight_d.dev_f() : nullptr;
  const int32_t* targets = a.targets_d.dev<int32_t>();
  // dL/dlogits feeds both products of head_backward: in bf16, converted once for the two (by
  // softmax_xent, as it writes each row; registered before it).
  if (a.has_grad && ops::precision() == ops::Precision::Bf16)
    ops::bf16_mirror_add(a.logits.dev_f(), N * V);
  if (!tp_.split()) {
    ops::softmax_xent(a.logits.dev_f(), a.loss_d.dev_f(), targets, grad_scale, N, V);
  } else {  // each rank fills its [N, 3] of the stats, the others stay zero: an exact gather
    const int64_t v0 = V * tp_.rank;
    ops::fill(a.xent_stats.dev_f(), 0.0f, a.xent_stats.numel());
    ops::xent_partial(a.xent_stats.dev_f() + tp_.rank * N * 3, a.logits.dev_f(), targets, v0, N, V);
    tp_.all_reduce(a.xent_stats.dev_f(), a.xent_stats.numel());
    ops::xent_combine(a.logits.dev_f(), a.loss_d.dev_f(), a.xent_stats.dev_f(), targets, grad_scale, v0,
                      tp_.size, N, V);
  }
  if (token_loss) ops::download(token_loss, a.loss_d, size_t(N) * sizeof(float));
}

// From dL/dlogits to dL/dh of the last block's output, in a.dh. Vocabulary-parallel: dL/d hf
// is the group's sum over its shares of the vocabulary; each rank's rows of the table get
// their own gradient.
void Model::head_backward(const Batch& batch, Activations& a) {
  const int64_t N = int64_t(batch.B) * batch.T, d = cfg_.d_model, V = cfg_.vocab / tp_.size;
  zero(a.da);
  add_tp_sum(tp_, a.da.dev_f(), a.tp_sum.dev_f(), N * d, [&](float* da) {
    for_each_slot_run(cfg_, batch, V, [&](int64_t r0, int64_t rows, int64_t e0) {
      ops::gemm(false, false, rows, d, V, 1.0f, a.logits.dev_f() + r0 * V, V, w_->tokens.v + e0, d,
                1.0f, da + r0 * d, d);
    });
  });
  for_each_slot_run(cfg_, batch, V, [&](int64_t r0, int64_t rows, int64_t e0) {
    ops::gemm(true, false, V, d, rows, 1.0f, a.logits.dev_f() + r0 * V, V, a.hf.dev_f() + r0 * d, d,
              1.0f, w_->tokens.g + e0, d);
  });
  zero(a.dh);
  ops::layernorm_backward(a.dh.dev_f(), w_->lnf_w.g, w_->lnf_b.g, a.da.dev_f(), a.h_final.dev_f(),
                          a.meanf.dev_f(), a.rstdf.dev_f(), w_->lnf_w.v, N, d);
}

// dh: dL/d(block output) on entry, dL/d(block input) on return.
void Model::block_backward(int l, const Batch& batch, Activations& a, float* dh) {
  const int64_t N = int64_t(batch.B) * batch.T, d = cfg_.d_model, fl = cfg_.ffn() / tp_.size;
  const BlockWeights& w = w_->blocks[l];
  BlockActs& k = a.block(l);
  // FFN branch; the residual passes dh through unchanged.
  zero(a.da);
  if (!w.is_rre()) {
    ffn_backward(a.da.dev_f(), w.ffn_grad(), dh, k.a2.dev_f(), k.pre.dev_f(), k.act.dev_f(), w.ffn(),
                 N, d, fl);
    tp_.all_reduce(a.da.dev_f(), N * d);  // w_in is column-parallel: dL/da2 is the group's sum
  } else {
    expert_backward(l, a, dh);
  }
  ops::layernorm_backward(dh, w.ln2_w.g, w.ln2_b.g, a.da.dev_f(), k.mid.dev_f(), k.mean2.dev_f(),
                          k.rstd2.dev_f(), w.ln2_w.v, N, d);  // dh is now dL/d(mid)
  attention_backward(l, batch, a, dh);
}

// An expert block's backward: RRE through the executor, or the learned gate around it.
void Model::expert_backward(int l, Activations& a, float* dh) {
  const int64_t N = int64_t(a.B) * a.T, d = cfg_.d_model, f = cfg_.ffn() / tp_.size;
  const BlockWeights& w = w_->blocks[l];
  BlockActs& k = a.block(l);
  const ExpertBuffers buf{k.pre.dev_f(), k.act.dev_f(), a.gx.dev_f(), a.gy.dev_f(), a.gdx.dev_f()};
  if (!cfg_.gated()) {
    const std::vector<size_t>& stages = expert_stages(l);
    if (stages.empty() || executor_ != &local_ || !staged()) {
      for (size_t s : stages) params_needed(s);
      executor_->backward(l, w.rre, k.plan, buf, a.da.dev_f(), dh, k.a2.dev_f(), N, d, f);
      for (size_t s : stages) grads_done(s);
      for (size_t s : stages) params_done(s);
    } else {  // expert by expert, as the forward (each row's dx from one expert: the same bits)
      for (size_t e = 0; e < stages.size(); ++e) {
        params_needed(stages[e]);
        rre_backward(a.da.dev_f(), buf.gx, buf.gy, buf.gdx, dh, k.a2.dev_f(), buf.pre, buf.act,
                     w.rre, k.plan, {int(e), int(e) + 1, false}, N, d, f);
        grads_done(stages[e]);
        params_done(stages[e]);
      }
    }
    return tp_.all_reduce(a.da.dev_f(), N * d);  // column-parallel w_in: dL/da2 is the group's sum
  }
  const GatePlan& gp = k.gplan;
  gate_expert_dy(a.gate_dy.dev_f(), a.dgate.dev_f(), dh, k.yg.dev_f(), gp, N, d);
  gate_gather(a.gate_x.dev_f(), gp, k.a2.dev_f(), d);
  ops::fill(a.gate_dx.dev_f(), 0.0f, gp.assigned * d);
  executor_->backward(l, w.rre, k.plan, buf, a.gate_dx.dev_f(), a.gate_dy.dev_f(), a.gate_x.dev_f(),
                      gp.assigned, d, f);
  tp_.all_reduce(a.gate_dx.dev_f(), gp.assigned * d);
  gate_backward_rest(a.da.dev_f(), a.z.dev_f(), a.gate_dx.dev_f(), a.dgate.dev_f(), k.a2.dev_f(), gp, w.rre, w.gate,
                     a.row_group.data(), float(a.weight_sum * cfg_.aux_loss_weight), N, d);
}

// The attention branch of block l; dh: dL/d(mid) on entry, dL/d(block input) on return.
void Model::attention_backward(int l, const Batch& batch, Activations& a, float* dh) {
  const int B = batch.B, T = batch.T;
  const int64_t N = int64_t(B) * T, d = cfg_.d_model, hd = cfg_.head_dim();
  const int64_t dl = d / tp_.size, Hl = cfg_.heads / tp_.size;  // this rank's heads
  const bool query_layer = (l == cfg_.layers - 1);
  const BlockWeights& w = w_->blocks[l];
  BlockActs& k = a.block(l);
  const float scale = 1.0f / std::sqrt(float(hd));
  ops::AttnOperand q{k.qkv.dev_f(), 3 * dl, T * 3 * dl};
  if (query_layer) q = {k.qtop.dev_f(), dl, 0};
  const ops::AttnOperand kk{k.qkv.dev_f() + dl, 3 * dl, T * 3 * dl};
  const ops::AttnOperand vv{k.qkv.dev_f() + 2 * dl, 3 * dl, T * 3 * dl};
  float* att = a.att(l);
  if (a.remat == Remat::Attention)  // the same call on the same inputs: the same bits
    ops::flash_attention_forward(att, k.lse.dev_f(), q, kk, vv, {B, T, T, Hl, hd}, scale);
  float* datt = a.att_grad(l);
  ops::fill(datt, 0.0f, N * dl);
  // Row-parallel output: its input gradient and weight gradient are this rank's rows alone.
  ops::linear_backward(datt, w.out_w.g, w.out_b.g, dh, att, w.out_w.v, N, dl, d);
  // dq always gets per-row storage (the q third of dqkv), even when q is shared.
  float* dqkv = a.qkv_grad(l, dl);
  ops::fill(dqkv, 0.0f, N * 3 * dl);
  ops::flash_attention_backward({dqkv, 3 * dl, T * 3 * dl}, {dqkv + dl, 3 * dl, T * 3 * dl},
                                {dqkv + 2 * dl, 3 * dl, T * 3 * dl}, datt, att, k.lse.dev_f(),
                                q, kk, vv, {B, T, T, Hl, hd}, scale);
  zero(a.da);
  if (!query_layer) {
    ops::linear_backward(a.da.dev_f(), w.qkv_w.g, w.qkv_b.g, dqkv, k.a1.dev_f(), w.qkv_w.v, N, d, 3 * dl);
  } else {
    ops::linear_backward(a.da.dev_f(), w.qkv_w.g + dl, w.qkv_b.g + dl, dqkv + dl, k.a1.dev_f(),
                         w.qkv_w.v + dl, N, d, 2 * dl, {d, 3 * dl, 3 * dl});
    // The shared query: sum dq over the batch, then back through W_q to the query table
    // (column-parallel: the table's gradient is the group's sum).
    zero(a.dq_shared);
    float* dq = a.dq_shared.dev_f();
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) ops::add_into(dq + int64_t(t) * dl, dqkv + (int64_t(b) * T + t) * 3 * dl, dl);
    add_tp_sum(tp_, w.query.g, a.tp_sum.dev_f(), T * d, [&](float* dquery) {
      ops::linear_backward(dquery, w.qkv_w.g, w.qkv_b.g, dq, w.query.v, w.qkv_w.v, T, d, dl,
                           {d, 3 * dl, dl});
    });
  }
  tp_.all_reduce(a.da.dev_f(), N * d);  // QKV is column-parallel: dL/da1 is the group's sum
  ops::layernorm_backward(dh, w.ln1_w.g, w.ln1_b.g, a.da.dev_f(), a.blocks[size_t(l)].x.dev_f(),
                          k.mean1.dev_f(), k.rstd1.dev_f(), w.ln1_w.v, N, d);  // dL/d(block input)
}

}  // namespace sigma
