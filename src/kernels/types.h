// Argument types of the ops front (kernels/ops.h), shared by every backend (kernels/cpu/,
// kernels/ref/), so that a call site changes only its namespace when it moves between them.
// Plain structs of pointers and sizes: no framework types reach a kernel (STYLE rule 1).
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sigma {

namespace kernels {

// Row strides of linear_forward/backward's operands; 0 = contiguous (in, out, out). A column
// slice of a wider weight (the query layer's K/V part of QKV) passes its own ldw/ldy.
struct Strides {
  int64_t x = 0, w = 0, y = 0;
};

// Causal attention of Tq query rows over Tk key rows (Tq <= Tk), H heads of width hd, in B
// sequences. Query row i sits at absolute position Tk - Tq + i and attends keys 0..Tk-Tq+i, so
// training passes Tq == Tk (row i attends 0..i) and a KV-cache decoder passes the new rows
// against the whole cache (Tq = 1: the last position attends everything). Five explicit
// arguments (no aggregate), so that a call written for the old {B, T, H, hd} fails to compile.
struct AttnShape {
  int64_t B, Tq, Tk, H, hd;
  constexpr AttnShape(int64_t B_, int64_t Tq_, int64_t Tk_, int64_t H_, int64_t hd_)
      : B(B_), Tq(Tq_), Tk(Tk_), H(H_), hd(hd_) {}
};

// A read-only [B, rows, H, hd] view: row stride ld, batch stride bs, head stride hs (0: hd,
// heads side by side in a row). A KV cache lays each head's positions out contiguously
// (hs = context * hd, ld = hd), so that a decode step reads a head's keys in one stream; only
// the forward kernels take such a view (a backward checks that hs is 0 or hd).
struct AttnOperand {
  const float* p;
  int64_t ld, bs, hs = 0;
  const float* head(int64_t b, int64_t h, int64_t hd) const { return p + b * bs + h * (hs ? hs : hd); }
  bool heads_in_rows(int64_t hd) const { return hs == 0 || hs == hd; }
};

// The same view of bf16 values: a KV cache kept in bf16 (ops::attention_forward_kv16).
struct AttnOperand16 {
  const uint16_t* p;
  int64_t ld, bs, hs = 0;
  const uint16_t* head(int64_t b, int64_t h, int64_t hd) const { return p + b * bs + h * (hs ? hs : hd); }
};

struct AttnGrad {  // a gradient [B, rows, H*hd] view (accumulated)
  float* p;
  int64_t ld, bs;
};

// The precision of the front's GEMMs (ops::use_precision): Bf16 rounds both GEMM inputs to
// bf16 (nearest even) and accumulates in fp32; everything else stays fp32 either way.
enum class Precision : uint8_t { Fp32, Bf16 };

// LayerNorm's epsilon (inside the square root), the same for every backend.
constexpr float kLayerNormEps = 1e-5f;

// A linear's inference copy (fp32, bf16 or int8; Model::use_weights) is stored in column panels of
// kPanelColumns columns (the last one narrower where out is not a multiple), one after another,
// each panel's rows contiguous: a decode GEMV streams one panel top to bottom as one run of
// bytes with the panel's sums in registers (kernels/cpu/gemv.cpp), where rows of the whole width
// made it keep the sums in memory and read 4 rows a sweep from 4 places (on Zen 3 bf16 streamed
// at 66-70 % of the read that way, at 85-90 % in panels; issue 40). A part of the columns used
// on its own (the query layer's Q and K|V parts of QKV) is laid out as a matrix of its own:
// the part from column c starts at element panel_index(0, c, in, out) or i8_elements(in, c).
constexpr int64_t kPanelColumns = 64;

// fp32 and bf16, w[in, out]: a panel's rows of its width one after another.
inline int64_t panel_index(int64_t i, int64_t j, int64_t in, int64_t out) {
  const int64_t p0 = j / kPanelColumns * kPanelColumns;
  const int64_t width = out - p0 < kPanelColumns ? out - p0 : kPanelColumns;
  return p0 * in + i * width + (j - p0);
}

// int8, q[in, out] (one scale per output column; ops::quantize_i8): a panel's rows in pairs,
// rows 2p and 2p + 1 interleaved column by column, so that the two weights one 32-bit lane of
// an integer multiply-add needs (x[2p] q[2p, j] + x[2p+1] q[2p+1, j]) are adjacent
// (kernels/cpu/gemv.h); an odd last row is paired with a row of zeros.
inline int64_t i8_elements(int64_t rows, int64_t cols) { return (rows + 1) / 2 * 2 * cols; }
inline int64_t i8_index(int64_t i, int64_t j, int64_t in, int64_t out) {
  const int64_t p0 = j / kPanelColumns * kPanelColumns;
  const int64_t width = out - p0 < kPanelColumns ? out - p0 : kPanelColumns;
  return i8_elements(in, p0) + (i / 2) * 2 * width + 2 * (j - p0) + (i & 1);
}

// A row of x as the products on int8 weights read it: 16-bit fixed point, xq[k] = x[k] * (1 /
// step) to nearest, step = max |x| / 32767 (returned); the product is then step * (xq . q). A
// row of zeros (or whose largest value is below 1e-30) gets step 0 and xq 0; a row holding a
// NaN or an infinity gets step NaN (its products come out NaN, as fp32's would) and xq 0.
// Every backend rounds with this one function. The largest |x| is found on the bits: |x|'s bits
// (the sign cleared) order as the values do, and an infinity or a NaN is exactly a value whose
// bits are >= 0x7f800000, so one unsigned max does both jobs and vectorises (a float max with a
// flag for the specials compiled to a scalar loop: ~3 ns an input, 5 % of an int8 decode token).
inline float round_row16(int16_t* xq, const float* x, int64_t n) {
  uint32_t amax_bits = 0;
  for (int64_t k = 0; k < n; ++k) {
    uint32_t bits;
    std::memcpy(&bits, x + k, 4);
    bits &= 0x7fffffffu;
    amax_bits = bits > amax_bits ? bits : amax_bits;
  }
  const bool special = amax_bits >= 0x7f800000u;
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  const float step = special ? NAN : amax >= 1e-30f ? amax / 32767.0f : 0.0f;
  const float inv = step > 0 ? 1.0f / step : 0.0f;
  for (int64_t k = 0; k < n; ++k) {  // |x / step| <= 32767 up to its rounding: clamped
    const float v = std::nearbyint(x[k] * inv);  // NaN only in a row with step NaN
    const float c = v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
    xq[k] = c == c ? int16_t(c) : int16_t(0);
  }
  return step;
}

// float(v), rounded once as the conversion rounds it, for |v| < 2^51 (the int8 products' exact
// sums): v lands exactly in the mantissa of 1.5 * 2^52 (a double), then one rounding to float.
// Unlike cvtsi2ss (scalar below AVX-512) it vectorises: the scalar conversion was ~40 % of the
// int8 products' sums (perf, Zen 3; issue 40).
inline float exact_to_float(int64_t v) {
  return float(std::bit_cast<double>(v + int64_t(0x4338000000000000)) - 0x1.8p52);
}

}  // namespace kernels

// One Adam(W) update (ops::adam_step). Per element i, with g = g_in[i] * grad_scale:
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   w = w - (lr * weight_decay * w + (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps))
// with the bias corrections bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (step 1-based, counted
// per parameter, or per row for lazy rows).
struct AdamStepArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: w -= lr * weight_decay * w
  float grad_scale = 1.0f;    // gradients are multiplied by this first (global-norm clipping)
  int64_t step = 1;           // 1-based count of updates of this parameter, this one included
};

// bc1 = 1 - beta1^step, bc2 = 1 - beta2^step, in fp32 (powf of a float exponent). Every
// backend derives its constants through this one function.
struct AdamBiasCorrections {
  float bc1, bc2;
};
inline AdamBiasCorrections adam_bias_corrections(float beta1, float beta2, int64_t step) {
  return {1.0f - std::pow(beta1, float(step)), 1.0f - std::pow(beta2, float(step))};
}

}  // namespace sigma
