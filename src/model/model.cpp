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
// Initial std of a weight matrix: residual output projections get init_std / sqrt(2L).
float init_std_of(const std::string& name, const ModelConfig& cfg) {
  return names::is_residual_projection(name) ? cfg.init_std / std::sqrt(2.0f * cfg.layers)
                                             : cfg.init_std;
}
// Expert e's slice of the stacked tensor `name` ([K, in, out]): its own random stream.
// v[i] = std * N(0, 1) from element i of `stream`: a counter-based draw, so threads split it
// without changing a value (a 25 M-parameter model's start-up drops from 0.4 s to half).
void fill_normal(float* v, int64_t count, float std, uint64_t seed, uint64_t stream) {
#pragma omp parallel for schedule(static) if (count >= (int64_t(1) << 16))
  for (int64_t i = 0; i < count; ++i) v[i] = std * rng_normal(seed, stream, i);
}

void init_expert_matrix(float* v, const std::string& name, int64_t e, int64_t count, float std,
                        uint64_t seed) {
  fill_normal(v, count, std, seed, stream_of(names::expert_slice(name, e).c_str()));
}
}  // namespace

Model::Model(const ModelConfig& cfg, uint64_t seed, const TokenCounts* counts, bool external_experts,
             TpGroup tp, const InitOnly& init_only)
    : Model(cfg, seed, counts, external_experts, true, tp, init_only) {}

std::unique_ptr<Model> Model::for_loading(const ModelConfig& cfg, uint64_t seed) {
  return std::unique_ptr<Model>(new Model(cfg, seed, nullptr, false, false, TpGroup{}, {}));
}

Model::Model(const ModelConfig& cfg, uint64_t seed, const TokenCounts* counts,
             bool external_experts, bool initialise, TpGroup tp, const InitOnly& init_only)
    : cfg_(cfg), seed_(seed), external_experts_(external_experts), tp_(tp), w_(new ModelWeights),
      own_(new Activations) {
  cfg_.validate();
  SIGMA_CHECK(tp_.size >= 1 && tp_.rank >= 0 && tp_.rank < tp_.size && (tp_.size == 1 || tp_.reducer),
              "tensor-parallel group: rank {} of {} without a reducer", tp_.rank, tp_.size);
  SIGMA_CHECK(cfg_.heads % tp_.size == 0 && cfg_.ffn() % tp_.size == 0,
              "dist.tp = {} must divide model.heads ({}) and the FFN width ({})", tp_.size,
              cfg_.heads, cfg_.ffn());
  SIGMA_CHECK(cfg_.vocab % tp_.size == 0, "dist.tp = {} does not divide model.vocab = {}: each "
              "tensor-parallel rank holds an equal share of the vocabulary (the embedding, the tied "
              "head and the loss are vocabulary-parallel); set model.vocab = {} (ids the data never "
              "uses are never a target and only learn to be unlikely)", tp_.size, cfg_.vocab,
              (cfg_.vocab + tp_.size - 1) / tp_.size * tp_.size);
  SIGMA_CHECK(!external_experts || cfg_.rre_layers > 0,
              "experts in a store need a sparse model (model.rre_layers > 0)");
  const int L = cfg_.layers;
  register_params(params_, cfg_, !external_experts, tp_.size);
  register_buffers(buffers_, cfg_);
  grad_stages_.resize(size_t(L) + 2);
  // RRE blocks with their experts in the model: each expert a stage of its own (its slice of
  // each of its group's stacked tensors), read and finished expert by expert, so that a pass
  // holds one expert's gathered values and gradients at a time under ZeRO-3, not a group's.
  const bool expert_stages = !external_experts && cfg_.rre_layers > 0 && !cfg_.gated();
  expert_stages_.assign(size_t(L), {});
  std::vector<int> group_first;  // [g]: the group's first expert in a block
  for (int first = 0; const GroupSpec& g : cfg_.groups) {
    group_first.push_back(first);
    first += g.experts;
  }
  if (expert_stages)
    for (int l = cfg_.first_rre_block(); l < L; ++l)
      for (const GroupSpec& g : cfg_.groups)
        for (int e = 0; e < g.experts; ++e) {
          expert_stages_[size_t(l)].push_back(grad_stages_.size());
          grad_stages_.emplace_back();
        }
  for (size_t i = 0; i < params_.all().size(); ++i) {
    const Param& p = params_.all()[i];
    const int l = names::block_of(p.name);
    if (expert_stages && l >= 0 && names::is_expert(p.name)) {  // stacked [K, ...]
      const int first = group_first[size_t(cfg_.group_index(names::group_of(p.name)))];
      const int64_t K = p.value.dim(0), per = p.value.numel() / K;
      for (int64_t e = 0; e < K; ++e)
        grad_stages_[expert_stages_[size_t(l)][size_t(first + e)]].push_back({i, e * per, (e + 1) * per});
      continue;
    }
    grad_stages_[l >= 0 ? size_t(l) : p.name.starts_with("final_ln.") ? size_t(L) : size_t(L) + 1]
        .push_back(whole_param(params_, i));
  }
  for (const DomainSpec& d : cfg_.domains)
    domain_group_.push_back(cfg_.rre_layers == 0 ? -1 : cfg_.group_index(d.group));

  // Initialisation: N(0, std) per tensor from its own RNG stream (so adding a tensor never
  // shifts another's values), and per expert from its own stream (so resizing a group never
  // shifts another expert); residual output projections scaled by 1/sqrt(2L) (GPT-2);
  // LayerNorm gains 1, biases 0. Per-tensor streams: skipping a tensor (init_only) changes
  // no other tensor's bits.
  if (initialise && init_only) {
    initialised_only_ = init_only(params_);
    SIGMA_CHECK(initialised_only_.size() == params_.all().size(),
                "init_only: pieces of {} parameters for {}", initialised_only_.size(),
                params_.all().size());
  }
  for (size_t i = 0; i < params_.all().size(); ++i) {
    if (!initialise) break;
    Param& p = params_.all()[i];
    ParamPiece only{i, 0, p.value.numel()};  // the elements written
    if (!initialised_only_.empty()) only = initialised_only_[i];
    if (only.size() <= 0) continue;
    const std::string& n = p.name;
    // A tensor split over tp ranks: the whole one drawn (the values one rank starts from),
    // this rank's slice kept.
    const TpSplit split = tp_.split() ? tp_split(cfg_, n) : TpSplit{};
    Shape full = p.value.shape();
    if (!split.replicated()) full[size_t(split.dim)] *= tp_.size;
    Tensor init(DType::F32, full, Device::Host);  // drawn on the host, uploaded
    float* v = init.f();
    const int64_t count = init.numel();
    const float std = init_std_of(n, cfg_);
    if (names::is_ln_gain(n)) {
      std::fill(v, v + count, 1.0f);
    } else if (p.expert && p.value.shape().size() == 3) {  // [K, in, out]: one stream per expert
      const int64_t per = count / p.value.dim(0);
      for (int64_t e = 0; e < p.value.dim(0); ++e) init_expert_matrix(v + e * per, n, e, per, std, seed);
    } else if (!p.expert && p.value.shape().size() >= 2) {
      fill_normal(v, count, std, seed, stream_of(n.c_str()));
    }
    if (!split.replicated()) {
      Tensor local(DType::F32, p.value.shape(), Device::Host);
      tp_slice(local.f(), v, full, split, tp_.size, tp_.rank);
      init = std::move(local);
    }
    ops::upload(p.value, init.f() + only.begin, size_t(only.size()) * sizeof(float),
                size_t(only.begin) * sizeof(float));
  }

  // Routing tables R[l][g] (DESIGN §2), independent per (block, group).
  for (int l = cfg_.first_rre_block(); l < L; ++l) {
    BlockLoad bl;
    bl.block = l;
    for (const GroupSpec& g : cfg_.groups) {
      bl.tokens.emplace_back(size_t(g.experts), 0);
      if (cfg_.gated()) continue;
      const std::string name = names::routing(l, g.name);
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
  const int64_t d = cfg_.d_model, f = cfg_.ffn() / tp_.size;  // this rank's columns
  if (!weights) {
    r.expert[size_t(e)] = {};
    r.expert_grad[size_t(e)] = {};
    return;
  }
  r.expert[size_t(e)] = {{.v = weights}, weights + d * f, {.v = weights + d * f + f}, weights + 2 * d * f + f};
  r.expert_grad[size_t(e)] = grads ? FfnGrads{grads, grads + d * f, grads + d * f + f, grads + 2 * d * f + f}
                                    : FfnGrads{};
}

namespace {
// The matrices use_weights converts: every linear weight but a learned gate's (decay marks the
// linear weights), and the embedding table.
bool streamed_matrix(const Param& p) {
  return p.name == names::kTokens || (p.decay && !names::is_gate(p.name));
}

// A streamed matrix as use_weights lays it out: `slices` matrices of rows x cols (a [K, rows,
// cols] stack of experts: K slices; else one).
struct MatrixShape {
  int64_t slices, rows, cols;
};
MatrixShape matrix_shape(const Param& p) {
  const int64_t cols = p.value.shape().back(), slices = p.value.shape().size() == 3 ? p.value.dim(0) : 1;
  return {slices, p.value.numel() / std::max<int64_t>(cols, 1) / slices, cols};
}

// fn(slice, first column, columns) for each part of a linear laid out in panels as a matrix of
// its own (kernels::panel_index, i8_index): each slice, and in the query layer's QKV its Q and
// K|V columns, which are used apart (model_passes.cpp).
template <class Fn>
void for_each_part(const MatrixShape& s, bool query_qkv, Fn&& fn) {
  const int64_t first = query_qkv ? s.cols / 3 : s.cols;
  for (int64_t k = 0; k < s.slices; ++k) {
    fn(k, int64_t(0), first);
    if (first < s.cols) fn(k, first, s.cols - first);
  }
}
}  // namespace

void Model::use_weights(WeightFormat f) {
  SIGMA_CHECK(!tp_.split(), "{} weights: a tensor-parallel model is for training only",
              weight_format_name(f));
  SIGMA_CHECK(!external_experts_, "{} weights: this model's experts live in a store; load the "
              "checkpoint with its experts for inference", weight_format_name(f));
  SIGMA_CHECK(!inference_, "use_weights: this model already holds {} inference weights",
              weight_format_name(format_));
  inference_ = true;
  format_ = f;
  for (Param& p : params_.all()) p.grad = Tensor();  // inference reads no gradient
  auto is_query_qkv = [&](const Param& p) { return p.name == names::block(cfg_.layers - 1, "attn.qkv.w"); };
  if (f == WeightFormat::F32) {
    // The linears' fp32 values move into panels as bf16's are (the decode GEMVs stream a panel
    // as one run of bytes, ~10 % faster than rows; issue 40), one matrix at a time: each
    // copy is made and the rows freed before the next, so a load holds at most one matrix more
    // than the model. The embedding table stays where it is (the head and the lookup read its
    // rows). Huge pages for the whole 2 MiB ranges of each (a hint).
    for (Param& p : params_.all()) {
      if (!streamed_matrix(p)) continue;
      if (p.name == names::kTokens) {
        ops::advise_huge_pages(p.value);
        continue;
      }
      const MatrixShape m = matrix_shape(p);
      WeightCopy c;
      c.owned = ops::empty(DType::F32, p.value.shape());
      ops::advise_huge_pages(c.owned);
      c.data = c.owned.dev_bytes();
      const float* v = p.value.dev_f();
      for_each_part(m, is_query_qkv(p), [&](int64_t k, int64_t c0, int64_t n) {
        const int64_t at = k * m.rows * m.cols;
        ops::convert_f32_panels(c.owned.dev_f() + at + c0 * m.rows, v + at + c0, m.rows, n, m.cols);
      });
      copy_bytes_ += int64_t(p.value.nbytes());
      copies_.emplace(p.name, std::move(c));
      p.value = Tensor();  // the rows are gone
    }
  } else {
    // Every copy in one arena of huge pages (ops::advise_huge_pages): with 4 KiB pages the
    // decode GEMVs streamed bf16 and int8 weights ~15 % slower (one thread, Zen 5; issue 40).
    // The arena is allocated before the first conversion, so at the peak the model holds its
    // fp32 weights and every copy (1.5x fp32's bytes with bf16, 1.26x with int8).
    constexpr int64_t kAlign = int64_t(2) << 20;
    auto round64 = [](int64_t n) { return (n + 63) / 64 * 64; };
    struct Layout {
      Param* p;
      MatrixShape m;
      int64_t slice, data, scale;  // slice: elements; data, scale: byte offsets
    };
    std::vector<Layout> layout;
    int64_t bytes = 0;
    for (Param& p : params_.all()) {
      if (!streamed_matrix(p)) continue;
      Layout l{&p, matrix_shape(p), 0, 0, -1};
      // Each expert of a stack has its own columns' scales. A linear's int8 matrix is stored in
      // panels of row pairs (ops::i8_elements), the embedding's rows as they are.
      const bool per_row = p.name == names::kTokens;
      const int64_t rows = l.m.slices * l.m.rows;
      l.slice = f == WeightFormat::Bf16 || per_row ? l.m.rows * l.m.cols : ops::i8_elements(l.m.rows, l.m.cols);
      const int64_t data = f == WeightFormat::Bf16 ? 2 * rows * l.m.cols : l.m.slices * l.slice;
      const int64_t scale = f == WeightFormat::Int8 ? 4 * (per_row ? rows : l.m.slices * l.m.cols) : 0;
      l.data = bytes;
      l.scale = scale > 0 ? bytes + round64(data) : -1;
      bytes += round64(data) + round64(scale);
      copy_bytes_ += data + scale;
      layout.push_back(l);
    }
    arena_ = ops::empty(DType::U8, {bytes + kAlign});
    std::byte* base = arena_.dev_bytes();
    base += (kAlign - int64_t(reinterpret_cast<uintptr_t>(base) % kAlign)) % kAlign;
    ops::advise_huge_pages(arena_);
    for (const Layout& l : layout) {
      Param& p = *l.p;
      WeightCopy c;
      c.data = base + l.data;
      c.scale = l.scale >= 0 ? reinterpret_cast<float*>(base + l.scale) : nullptr;
      const float* v = p.value.dev_f();
      const int64_t r = l.m.rows, cols = l.m.cols;
      int64_t bad = 0;
      if (p.name == names::kTokens) {  // the head and the lookup read the table's rows as they are
        if (f == WeightFormat::Bf16)
          ops::convert_bf16(reinterpret_cast<uint16_t*>(c.data), v, p.value.numel());
        else
          bad = ops::quantize_i8(reinterpret_cast<int8_t*>(c.data), c.scale, v, r, cols, cols, true);
      } else {
        for_each_part(l.m, is_query_qkv(p), [&](int64_t k, int64_t c0, int64_t n) {
          const float* src = v + k * r * cols + c0;
          if (f == WeightFormat::Bf16)
            ops::convert_bf16_panels(reinterpret_cast<uint16_t*>(c.data) + k * r * cols + c0 * r, src, r, n, cols);
          else
            bad += ops::quantize_i8(reinterpret_cast<int8_t*>(c.data) + k * l.slice + ops::i8_elements(r, c0),
                                    c.scale + k * cols + c0, src, r, n, cols, false);
        });
      }
      SIGMA_CHECK(bad == 0, "int8 weights: parameter '{}' holds {} non-finite values", p.name, bad);
      copies_.emplace(p.name, std::move(c));
      p.value = Tensor();  // the fp32 matrix is gone
    }
  }
#if defined(__GLIBC__)
  malloc_trim(0);  // hand the freed fp32 pages back to the system
#endif
  *w_ = ModelWeights::bind(params_, buffers_, cfg_);  // null pointers for what was freed
  attach_copies();
}

// Points the weight view at the copies (after a rebind: the converted matrices' v are null).
void Model::attach_copies() {
  if (copies_.empty()) return;
  const int64_t d = cfg_.d_model, f = cfg_.ffn();
  auto set = [&](PV& pv, const std::string& name) {
    const WeightCopy& c = copies_.at(name);
    if (format_ == WeightFormat::F32) pv.p = reinterpret_cast<const float*>(c.data);
    else if (format_ == WeightFormat::Bf16) pv.h = reinterpret_cast<const uint16_t*>(c.data);
    else pv.q = reinterpret_cast<const int8_t*>(c.data), pv.s = c.scale;
  };
  // Expert e's [in, out] matrix of a group's stack of copies.
  auto expert_copy = [](const PV& stack, int64_t e, int64_t in, int64_t out) {
    WeightView w;
    if (stack.p) w.p = stack.p + e * in * out;
    if (stack.h) w.h = stack.h + e * in * out;
    if (stack.q) w.q = stack.q + e * ops::i8_elements(in, out), w.s = stack.s + e * out;
    return w;
  };
  if (format_ != WeightFormat::F32) set(w_->tokens, names::kTokens);  // fp32: the table in place
  for (int l = 0; l < cfg_.layers; ++l) {
    BlockWeights& b = w_->blocks[size_t(l)];
    set(b.qkv_w, names::block(l, "attn.qkv.w"));
    set(b.out_w, names::block(l, "attn.out.w"));
    if (!b.is_rre()) {
      set(b.w_in, names::ffn(l, names::kWIn));
      set(b.w_out, names::ffn(l, names::kWOut));
      continue;
    }
    for (size_t g = 0; g < cfg_.groups.size(); ++g) {
      PV wi, wo;
      set(wi, names::expert(l, cfg_.groups[g].name, names::kWIn));
      set(wo, names::expert(l, cfg_.groups[g].name, names::kWOut));
      for (int e = 0; e < cfg_.groups[g].experts; ++e) {
        FfnWeights& x = b.rre.expert[size_t(b.rre.offset[g] + e)];
        x.w_in = expert_copy(wi, e, d, f);
        x.w_out = expert_copy(wo, e, f, d);
      }
    }
  }
}

int64_t Model::held_bytes() const {
  int64_t n = 0;
  for (const Param& p : params_.all()) n += int64_t(p.value.nbytes() + p.grad.nbytes());
  for (const Buffer& b : buffers_.all()) n += int64_t(b.value.nbytes());
  return n + copy_bytes_;
}

void Model::init_expert(int block, int g, int k, float* out) const {
  const int64_t d = cfg_.d_model, f = cfg_.ffn();
  const std::string& group = cfg_.groups.at(size_t(g)).name;
  const std::string w_in = names::expert(block, group, names::kWIn),
                    w_out = names::expert(block, group, names::kWOut);
  // Split over tp: the whole expert drawn (the values one rank starts from), this rank's cut.
  std::vector<float> whole(tp_.split() ? size_t(2 * d * f + f + d) : 0);
  float* dst = tp_.split() ? whole.data() : out;
  init_expert_matrix(dst, w_in, k, d * f, init_std_of(w_in, cfg_), seed_);
  std::fill(dst + d * f, dst + d * f + f, 0.0f);
  init_expert_matrix(dst + d * f + f, w_out, k, f * d, init_std_of(w_out, cfg_), seed_);
  std::fill(dst + 2 * d * f + f, dst + 2 * d * f + f + d, 0.0f);
  if (tp_.split()) tp_slice_expert(out, dst, d, f, tp_.size, tp_.rank);
}

void Model::load_buffer(const std::string& name, const Tensor& t) {
  SIGMA_CHECK(buffers_.contains(name), "the model has no buffer named '{}'", name);
  Buffer& b = buffers_.at(name);
  SIGMA_CHECK(t.dtype() == DType::I32 && t.shape() == b.value.shape(),
              "routing table '{}' is {} {} but the model needs I32 [{}] (one expert per token id "
              "of model.vocab = {})", name, dtype_name(t.dtype()), shape_str(t.shape()),
              cfg_.vocab, cfg_.vocab);
  // The table's group's expert count bounds the entries.
  const std::string group = names::group_of(name);
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

std::vector<float> Model::logits() const {
  std::vector<float> out(static_cast<size_t>(own_->logits.numel()));
  ops::download(out.data(), own_->logits, out.size() * sizeof(float));
  return out;
}

std::vector<float> Model::logits_row(int64_t r) const {
  const int64_t V = cfg_.vocab;
  SIGMA_CHECK(r >= 0 && (r + 1) * V <= own_->logits.numel(), "no logits row {}", r);
  std::vector<float> out(static_cast<size_t>(V));
  ops::download(out.data(), own_->logits, size_t(V) * sizeof(float), size_t(r * V) * sizeof(float));
  return out;
}

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
    if (!p.expert && !names::is_gate(p.name)) n += p.value.numel();
  n -= int64_t(cfg_.slots - 1) * V * d;  // other slots' embedding rows
  // k experts per expert block (1 with RRE), and the gate of the widest group.
  n += int64_t(cfg_.rre_layers) * (cfg_.experts_per_token() * (2 * d * f + f + d) +
                                   (cfg_.gated() ? d * Kmax : 0));
  return n;
}

}  // namespace sigma
