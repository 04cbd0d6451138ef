#include "model/tensor_parallel.h"

#include <algorithm>

#include "core/error.h"
#include "model/names.h"

namespace sigma {

TpSplit tp_expert_leaf_split(size_t t) {
  static const TpSplit leaves[] = {{1, 1}, {0, 1}, {0, 1}, {}};  // w_in, b_in, w_out, b_out
  SIGMA_CHECK(t < std::size(leaves), "expert leaf {} (an expert has 4)", t);
  return leaves[t];
}

TpSplit tp_split(const ModelConfig& cfg, const std::string& name) {
  if (name == names::kTokens) return {0, cfg.slots};  // [S*V, d]: each slot's rows by token id
  if (names::is_expert(name)) {  // stacked [K, ...]: each expert as the dense FFN
    const std::string leaf = names::leaf_of(name);
    for (size_t t = 0; t < std::size(names::kExpertLeaves); ++t)
      if (leaf == names::kExpertLeaves[t]) {
        const TpSplit s = tp_expert_leaf_split(t);
        return s.replicated() ? s : TpSplit{s.dim + 1, s.parts};
      }
    return {};
  }
  if (names::block_of(name) < 0 || names::is_gate(name)) return {};
  auto ends = [&](std::string_view s) { return name.ends_with(s); };
  if (ends(".attn.qkv.w")) return {1, 3};  // [d, 3d]: Q | K | V, each by heads
  if (ends(".attn.qkv.b")) return {0, 3};
  if (ends(".attn.out.w")) return {0, 1};  // [d, d]: the rows of this rank's heads
  if (ends(".ffn.w_in")) return {1, 1};    // [d, f]
  if (ends(".ffn.b_in")) return {0, 1};
  if (ends(".ffn.w_out")) return {0, 1};   // [f, d]
  return {};
}

namespace {
// The full shape as [outer, dim, inner] around the split dimension.
struct Frame {
  int64_t outer = 1, dim = 1, inner = 1;
};
Frame frame(const Shape& full, TpSplit s, int size) {
  SIGMA_CHECK(s.dim < int(full.size()), "tp split of dimension {} of a {}-dimensional tensor",
              s.dim, full.size());
  Frame f;
  for (int i = 0; i < s.dim; ++i) f.outer *= full[size_t(i)];
  f.dim = full[size_t(s.dim)];
  for (size_t i = size_t(s.dim) + 1; i < full.size(); ++i) f.inner *= full[i];
  SIGMA_CHECK(f.dim % (int64_t(s.parts) * size) == 0,
              "dimension {} of size {} does not split into {} parts over {} tensor-parallel ranks",
              s.dim, f.dim, s.parts, size);
  return f;
}

// Copies between the full tensor and rank r's slice; to_local picks the direction.
void move_slice(float* local, float* full, const Shape& shape, TpSplit s, int size, int r,
                bool to_local) {
  const Frame f = frame(shape, s, size);
  const int64_t chunk = f.dim / (int64_t(s.parts) * size) * f.inner;  // one part's slice
  for (int64_t o = 0; o < f.outer; ++o)
    for (int p = 0; p < s.parts; ++p) {
      float* l = local + (o * s.parts + p) * chunk;
      float* g = full + o * f.dim * f.inner + (int64_t(p) * size + r) * chunk;
      if (to_local) std::copy(g, g + chunk, l);
      else std::copy(l, l + chunk, g);
    }
}
}  // namespace

Shape tp_local_shape(const Shape& full, TpSplit s, int size) {
  if (s.replicated() || size == 1) return full;
  (void)frame(full, s, size);
  Shape local = full;
  local[size_t(s.dim)] /= size;
  return local;
}

void tp_slice(float* local, const float* full, const Shape& full_shape, TpSplit s, int size,
              int rank) {
  int64_t n = 1;
  for (int64_t x : full_shape) n *= x;
  if (s.replicated() || size == 1) return (void)std::copy(full, full + n, local);
  move_slice(local, const_cast<float*>(full), full_shape, s, size, rank, true);
}

void tp_assemble(float* full, const float* const* locals, const Shape& full_shape, TpSplit s,
                 int size) {
  int64_t n = 1;
  for (int64_t x : full_shape) n *= x;
  if (s.replicated() || size == 1) return (void)std::copy(locals[0], locals[0] + n, full);
  for (int r = 0; r < size; ++r)
    move_slice(const_cast<float*>(locals[r]), full, full_shape, s, size, r, false);
}

namespace {
// Calls fn(leaf, its whole shape, its offset in the whole record, in rank r's record of size P).
template <class Fn>
void for_each_expert_leaf(int64_t d, int64_t f, int size, Fn&& fn) {
  const Shape shapes[] = {{d, f}, {f}, {f, d}, {d}};
  int64_t whole = 0, local = 0;
  for (size_t t = 0; t < std::size(shapes); ++t) {
    fn(shapes[t], tp_expert_leaf_split(t), whole, local);
    int64_t n = 1;
    for (int64_t x : shapes[t]) n *= x;
    whole += n;
    local += tp_expert_leaf_split(t).replicated() ? n : n / size;
  }
}
}  // namespace

void tp_slice_expert(float* local, const float* whole, int64_t d, int64_t f, int size, int rank) {
  for_each_expert_leaf(d, f, size, [&](const Shape& s, TpSplit sp, int64_t w, int64_t l) {
    tp_slice(local + l, whole + w, s, sp, size, rank);
  });
}

void tp_assemble_expert(float* whole, const float* const* locals, int64_t d, int64_t f, int size) {
  std::vector<const float*> parts(static_cast<size_t>(size));
  for_each_expert_leaf(d, f, size, [&](const Shape& s, TpSplit sp, int64_t w, int64_t l) {
    for (int r = 0; r < size; ++r) parts[size_t(r)] = locals[r] + l;
    tp_assemble(whole + w, parts.data(), s, sp, size);
  });
}

RowRanges tp_local_rows(const RowRanges& rows, int64_t vocab, int size, int rank) {
  const int64_t Vl = vocab / size, v0 = Vl * rank;
  RowRanges out;
  for (auto [b, e] : rows)
    for (int64_t s = b / vocab; s * vocab < e; ++s) {  // the slots the range touches
      const int64_t lo = std::max(b, s * vocab + v0), hi = std::min(e, s * vocab + v0 + Vl);
      if (lo < hi) out.push_back({s * Vl + lo - s * vocab - v0, s * Vl + hi - s * vocab - v0});
    }
  return out;
}

}  // namespace sigma
