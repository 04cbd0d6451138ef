#include "kernels/cpu/gemv.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/spin_team.h"
#include "kernels/ops.h"

namespace sigma::cpu {

namespace {

// Below this many weights one thread streams them faster than two can start.
constexpr int64_t kParallelWeights = int64_t(1) << 16;

inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return from_bf16(w); }
inline float widen(int8_t w) { return float(w); }

// Tests: the portable paths instead of AVX-512 (gemv_use_portable).
bool g_portable = false;

// [lo, hi): columns or rows of w.
struct Range {
  int64_t lo, hi;
};

// y rows [M, lo..hi) = (accumulate ? y : 0) + b + the partials p [chunks][M][out], in chunk
// order. With int8 weights (scale not null): (accumulate ? y : 0) + b + scale * (the partials
// summed in chunk order).
void sum_rows(float* y, int64_t ldy, const float* b, const float* scale, int64_t M,
              bool accumulate, Range c, const float* p, int64_t chunks, int64_t out) {
  for (int64_t r = 0; r < M; ++r) {
    float* row = y + r * ldy;
    if (scale) {
      for (int64_t j = c.lo; j < c.hi; ++j) {
        float t = chunks > 0 ? p[r * out + j] : 0.0f;
        for (int64_t k = 1; k < chunks; ++k) t += p[(k * M + r) * out + j];
        row[j] = (accumulate ? row[j] : 0.0f) + (b ? b[j] : 0.0f) + scale[j] * t;
      }
      continue;
    }
    for (int64_t j = c.lo; j < c.hi; ++j) row[j] = (accumulate ? row[j] : 0.0f) + (b ? b[j] : 0.0f);
    for (int64_t k = 0; k < chunks; ++k) {
      const float* pr = p + (k * M + r) * out;
      for (int64_t j = c.lo; j < c.hi; ++j) row[j] += pr[j];
    }
  }
}

// ---- portable paths (the same order of operations per element) ----

template <class W>
void nn_scalar(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
               int64_t M, int64_t in, Range c) {
  for (int64_t i = 0; i < in; ++i)
    for (int64_t r = 0; r < M; ++r) {
      const float xi = x[r * ldx + i];
      for (int64_t j = c.lo; j < c.hi; ++j)
        y[r * ldy + j] = std::fma(xi, widen(w[i * ldw + j]), i == 0 ? 0.0f : y[r * ldy + j]);
    }
}

// The AVX-512 path's order: 16 lanes, lane l summing k = l, l + 16, ..., then the lanes added
// as _mm512_reduce_add_ps does (halving: 16 -> 8 -> 4 -> 2 -> 1), then the row's scale.
template <class W>
void nt_scalar(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
               const float* scale, int64_t M, int64_t in, Range rows) {
  for (int64_t j = rows.lo; j < rows.hi; ++j)
    for (int64_t r = 0; r < M; ++r) {
      float lane[16] = {};
      for (int64_t k = 0; k < in; ++k)
        lane[k % 16] = std::fma(x[r * ldx + k], widen(w[j * ldw + k]), lane[k % 16]);
      for (int n = 8; n >= 1; n /= 2)
        for (int l = 0; l < n; ++l) lane[l] += lane[l + n];
      y[r * ldy + j] = scale ? scale[j] * lane[0] : lane[0];
    }
}

// ---- AVX-512 paths ----
#if defined(__x86_64__)
#define SIGMA_GEMV_X86 1
#define SIGMA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

SIGMA_AVX512 inline __m512 load_w(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
SIGMA_AVX512 inline __m512 load_w(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
SIGMA_AVX512 inline __m512 load_w(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
// Unmasked loads of 16 weights: the widening folds the load (vpmovsxbd zmm, m128), where a
// masked load is a separate instruction.
SIGMA_AVX512 inline __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
SIGMA_AVX512 inline __m512 load_w(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
SIGMA_AVX512 inline __m512 load_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
SIGMA_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

// y[r, c] = sum_i x[r, i] w[i, c] over this thread's columns c (y is overwritten: the first
// sweep starts from zero, so nobody clears it first), R rows of w per sweep so that y (in L1)
// is loaded and stored once per R weights: 4 for fp32 and bf16, 8 for int8, whose 16 weights
// are only 16 bytes, so that y's traffic and the loop's overhead per weight byte stay those of
// bf16 (at 4 rows the int8 kernel was compute-bound at ~14 GB/s on one thread, in L2). The
// next sweep's rows are prefetched: the hardware prefetcher loses each row's stream at the
// jump to the next sweep (single-thread stream rate 6.5 -> 13.7 GB/s against a 17.6 GB/s read,
// bench/bench_gemv). Into L2, not L1: a sweep of the model's widest rows (4 x 2048 floats) is
// L1's whole 32 KiB, so lines prefetched into L1 were evicted before their use
// (docs/benchmarks.md, issue 12). Each element's FMAs run in row order whatever R is.
// One sweep's 32 columns at j: two independent FMA chains (each column's operations as in
// nn_columns), so that the chains' latency overlaps.
template <class W, int M, int R>
SIGMA_AVX512 inline void nn_columns2(float* y, int64_t ldy, const float* x, int64_t ldx,
                                     const W* w0, int64_t ldw, int64_t i, int64_t j, bool prefetch) {
  __m512 wa[R], wb[R];
  for (int k = 0; k < R; ++k) {
    wa[k] = load_w(w0 + k * ldw + j);
    wb[k] = load_w(w0 + k * ldw + j + 16);
  }
  if (prefetch)
    for (int k = R; k < 2 * R; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + k * ldw + j), _MM_HINT_T1);
      if (sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(w0 + k * ldw + j + 16), _MM_HINT_T1);
    }
  for (int r = 0; r < M; ++r) {
    float* yr = y + r * ldy + j;
    const float* xr = x + r * ldx + i;
    __m512 a = i == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yr);
    __m512 b = i == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yr + 16);
    for (int k = 0; k < R; ++k) {
      const __m512 xk = _mm512_set1_ps(xr[k]);
      a = _mm512_fmadd_ps(xk, wa[k], a);
      b = _mm512_fmadd_ps(xk, wb[k], b);
    }
    _mm512_storeu_ps(yr, a);
    _mm512_storeu_ps(yr + 16, b);
  }
}

// One sweep's 16 columns at j (Full: all 16, unmasked loads and stores; else the mask m).
template <class W, int M, int R, bool Full>
SIGMA_AVX512 inline void nn_columns(float* y, int64_t ldy, const float* x, int64_t ldx,
                                    const W* w0, int64_t ldw, int64_t i, int64_t j, __mmask16 m,
                                    bool prefetch) {
  __m512 wv[R];
  for (int k = 0; k < R; ++k) wv[k] = Full ? load_w(w0 + k * ldw + j) : load_w(w0 + k * ldw + j, m);
  if (prefetch)
    for (int k = R; k < 2 * R; ++k)
      _mm_prefetch(reinterpret_cast<const char*>(w0 + k * ldw + j), _MM_HINT_T1);
  for (int r = 0; r < M; ++r) {
    float* yr = y + r * ldy + j;
    const float* xr = x + r * ldx + i;
    __m512 acc = i == 0 ? _mm512_setzero_ps()
                        : (Full ? _mm512_loadu_ps(yr) : _mm512_maskz_loadu_ps(m, yr));
    for (int k = 0; k < R; ++k) acc = _mm512_fmadd_ps(_mm512_set1_ps(xr[k]), wv[k], acc);
    if (Full)
      _mm512_storeu_ps(yr, acc);
    else
      _mm512_mask_storeu_ps(yr, m, acc);
  }
}

template <class W, int M>
SIGMA_AVX512 void nn_avx512(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w,
                            int64_t ldw, int64_t in, Range c) {
  constexpr int R = sizeof(W) == 1 ? 8 : 4;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights of a 64-byte line: one prefetch each
  const int64_t full = c.lo + (c.hi - c.lo) / 16 * 16;
  int64_t i = 0;
  for (; i + R <= in; i += R) {
    const W* w0 = w + i * ldw;
    const bool ahead = i + 2 * R <= in;
    int64_t j = c.lo;
    for (; j + 32 <= full; j += 32)
      nn_columns2<W, M, R>(y, ldy, x, ldx, w0, ldw, i, j, ahead && (j - c.lo) % kLine == 0);
    for (; j < full; j += 16)
      nn_columns<W, M, R, true>(y, ldy, x, ldx, w0, ldw, i, j, 0xffff,
                                ahead && (j - c.lo) % kLine == 0);
    if (full < c.hi)
      nn_columns<W, M, R, false>(y, ldy, x, ldx, w0, ldw, i, full, tail_mask(c.hi - full), ahead);
  }
  for (; i < in; ++i)  // the last rows of w, one at a time (same order per element)
    for (int64_t j = c.lo; j < c.hi; j += 16) {
      const __mmask16 m = tail_mask(c.hi - j);
      const __m512 a = load_w(w + i * ldw + j, m);
      for (int r = 0; r < M; ++r) {
        float* yr = y + r * ldy + j;
        const __m512 acc = i == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, yr);
        _mm512_mask_storeu_ps(yr, m, _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + i]), a, acc));
      }
    }
}

// y[r, j] = dot(x[r, :], w[j, :]) (times scale[j] with int8 weights) over this thread's rows j
// of w, four at a time (independent accumulators); each (r, j) is the same lane-wise sum and
// the same final reduction.
template <class W, int M, int Q>
SIGMA_AVX512 void nt_group(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w,
                           int64_t ldw, const float* scale, int64_t in, int64_t j) {
  __m512 acc[M][Q];
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < Q; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 16) {
    const __mmask16 m = tail_mask(in - k);
    __m512 wv[Q];
    for (int q = 0; q < Q; ++q) wv[q] = load_w(w + (j + q) * ldw + k, m);
    for (int r = 0; r < M; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
      for (int q = 0; q < Q; ++q) acc[r][q] = _mm512_fmadd_ps(xv, wv[q], acc[r][q]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < Q; ++q) {
      const float dot = _mm512_reduce_add_ps(acc[r][q]);
      y[r * ldy + j + q] = scale ? scale[j + q] * dot : dot;
    }
}

template <class W, int M>
SIGMA_AVX512 void nt_avx512(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w,
                            int64_t ldw, const float* scale, int64_t in, Range rows) {
  int64_t j = rows.lo;
  for (; j + 4 <= rows.hi; j += 4) nt_group<W, M, 4>(y, ldy, x, ldx, w, ldw, scale, in, j);
  for (; j < rows.hi; ++j) nt_group<W, M, 1>(y, ldy, x, ldx, w, ldw, scale, in, j);
}

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}
#else
bool has_avx512() { return false; }
#endif

// Calls kernel<M> for the runtime M (1..kGemvMaxRows).
template <template <int> class K, class... A>
void with_rows(int64_t M, A&&... a) {
  switch (M) {
    case 1: return K<1>::run(a...);
    case 2: return K<2>::run(a...);
    case 3: return K<3>::run(a...);
    case 4: return K<4>::run(a...);
  }
  SIGMA_CHECK(false, "gemv: {} rows (at most {})", M, kGemvMaxRows);
}

template <class W>
struct NN {
  template <int M>
  struct K {
    static void run(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
                    int64_t in, Range c) {
#if SIGMA_GEMV_X86
      if (has_avx512() && !g_portable) return nn_avx512<W, M>(y, ldy, x, ldx, w, ldw, in, c);
#endif
      nn_scalar(y, ldy, x, ldx, w, ldw, M, in, c);
    }
  };
};
template <class W>
struct NT {
  template <int M>
  struct K {
    static void run(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
                    const float* scale, int64_t in, Range rows) {
#if SIGMA_GEMV_X86
      if (has_avx512() && !g_portable)
        return nt_avx512<W, M>(y, ldy, x, ldx, w, ldw, scale, in, rows);
#endif
      nt_scalar(y, ldy, x, ldx, w, ldw, scale, M, in, rows);
    }
  };
};

// The reduction over w's rows is cut into fixed chunks of kChunkRows, each summed into its own
// partial vector, so that a thread streams whole rows of a contiguous block of w (one stream
// the prefetchers follow, instead of a column slice of every row; docs/benchmarks.md, issue
// 12). The chunk bounds do not depend on the thread count, so neither do the bits.
constexpr int64_t kChunkRows = 64;

// The items of a product of `weights` weights, on the spin team (kernels/cpu/spin_team.h) when
// it is large enough: a decode step runs dozens of these back to back.
template <class Fn>
void run_items(int64_t weights, int64_t items, Fn&& fn) {
  if (weights >= kParallelWeights) return for_each_item(items, fn);
  for (int64_t i = 0; i < items; ++i) fn(i);
}

// Columns [lo, hi) of block `blk` of `blocks` over out columns, in SIMD widths.
Range column_block(int64_t out, int64_t blk, int64_t blocks) {
  const int64_t per = ((out + 15) / 16 + blocks - 1) / blocks;
  return {std::min(out, blk * per * 16), std::min(out, (blk + 1) * per * 16)};
}

template <class W>
void nn(float* y, const float* x, const W* w, const float* scale, const float* b, int64_t M,
        int64_t in, int64_t out, bool accumulate, Strides ld) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  if (M == 0 || out == 0) return;
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  const int64_t chunks = std::max<int64_t>(1, (in + kChunkRows - 1) / kChunkRows);
  const int64_t stride = M * out;
  thread_local std::vector<float> partial;  // [chunks][M][out]
  partial.resize(size_t(chunks * stride));
  float* p = partial.data();
  // An item is a chunk of whole rows (one contiguous stream), split into column blocks only
  // when there are too few chunks for the threads.
  const int64_t blocks = std::max<int64_t>(1, (2 * team_threads() + chunks - 1) / chunks);
  run_items(in * out, chunks * blocks, [&](int64_t it) {
    const int64_t c = it / blocks, i0 = c * kChunkRows, rows = std::min(kChunkRows, in - i0);
    const Range cols = column_block(out, it % blocks, blocks);
    if (cols.lo < cols.hi && rows > 0)
      with_rows<NN<W>::template K>(M, p + c * stride, out, x + i0, ldx, w + i0 * ldw, ldw, rows,
                                   cols);
  });
  // The chunk sums, in order, by column blocks.
  const int64_t sum_chunks = in > 0 ? chunks : 0, sum_blocks = (out + 511) / 512;
  run_items(sum_chunks * stride, sum_blocks, [&](int64_t blk) {
    sum_rows(y, ldy, b, scale, M, accumulate, column_block(out, blk, sum_blocks), p, sum_chunks,
             out);
  });
}

template <class W>
void nt(float* y, const float* x, const W* w, const float* scale, int64_t M, int64_t in,
        int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  if (M == 0 || out == 0) return;
  constexpr int64_t kGroup = 64;  // rows of w an item streams
  run_items(in * out, (out + kGroup - 1) / kGroup, [&](int64_t g) {
    const Range rows{g * kGroup, std::min(out, (g + 1) * kGroup)};
    with_rows<NT<W>::template K>(M, y, ldy, x, ldx, w, ldw, scale, in, rows);
  });
}

// Prompts (more than kGemvMaxRows rows) on bf16 or int8 weights: oneDNN's sgemm on the weights
// widened to fp32 one panel at a time, so that no fp32 copy of a whole matrix is ever held
// (a served model keeps only its bf16 or int8 weights). A panel holds about kPanelFloats.
constexpr int64_t kPanelFloats = int64_t(1) << 17;  // 512 KiB

inline float widen(const uint16_t* w, const float*, int64_t i, int64_t) { return from_bf16(w[i]); }
inline float widen(const int8_t* w, const float* scale, int64_t i, int64_t channel) {
  return scale[channel] * float(w[i]);
}

// y[N, out] (+)= x @ w[in, out] + b: column panels of w, each a whole reduction over in.
template <class W>
void linear_panels(float* y, const float* x, const W* w, const float* scale, const float* b,
                   int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  const int64_t cols = std::max<int64_t>(16, kPanelFloats / std::max<int64_t>(in, 1) / 16 * 16);
  thread_local std::vector<float> panel;
  panel.resize(size_t(in * std::min(cols, out)));
  for (int64_t j0 = 0; j0 < out; j0 += cols) {
    const int64_t n = std::min(cols, out - j0);
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < n; ++j) panel[size_t(i * n + j)] = widen(w, scale, i * ldw + j0 + j, j0 + j);
    linear_forward(y + j0, x, panel.data(), b ? b + j0 : nullptr, N, in, n, accumulate,
                   {ld.x, n, ldy});
  }
}

// y[N, out] = x @ w[out, in]^T: row panels of w (the head's vocabulary rows).
template <class W>
void nt_panels(float* y, const float* x, const W* w, const float* scale, int64_t N, int64_t in,
               int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  const int64_t rows = std::max<int64_t>(16, kPanelFloats / std::max<int64_t>(in, 1));
  thread_local std::vector<float> panel;
  panel.resize(size_t(std::min(rows, out) * in));
  for (int64_t j0 = 0; j0 < out; j0 += rows) {
    const int64_t n = std::min(rows, out - j0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t k = 0; k < in; ++k)
        panel[size_t(j * in + k)] = widen(w, scale, (j0 + j) * ldw + k, j0 + j);
    gemm(false, true, N, n, in, 1.0f, x, ldx, panel.data(), in, 0.0f, y + j0, ldy);
  }
}

}  // namespace

void gemv_use_portable(bool on) { g_portable = on; }

void gemv_nn(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t in,
             int64_t out, bool accumulate, Strides ld) {
  nn(y, x, w, nullptr, b, M, in, out, accumulate, ld);
}
void gemv_nn(float* y, const float* x, const uint16_t* w, const float* b, int64_t M, int64_t in,
             int64_t out, bool accumulate, Strides ld) {
  nn(y, x, w, nullptr, b, M, in, out, accumulate, ld);
}
void gemv_nn(float* y, const float* x, const int8_t* q, const float* scale, const float* b,
             int64_t M, int64_t in, int64_t out, bool accumulate, Strides ld) {
  nn(y, x, q, scale, b, M, in, out, accumulate, ld);
}
void gemv_nt(float* y, const float* x, const float* w, int64_t M, int64_t in, int64_t out,
             int64_t ldx, int64_t ldw, int64_t ldy) {
  nt(y, x, w, nullptr, M, in, out, ldx, ldw, ldy);
}
void gemv_nt(float* y, const float* x, const uint16_t* w, int64_t M, int64_t in, int64_t out,
             int64_t ldx, int64_t ldw, int64_t ldy) {
  nt(y, x, w, nullptr, M, in, out, ldx, ldw, ldy);
}
void gemv_nt(float* y, const float* x, const int8_t* q, const float* scale, int64_t M, int64_t in,
             int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  nt(y, x, q, scale, M, in, out, ldx, ldw, ldy);
}

// The GEMVs only inside a decode step (ops::FewRowKernels); elsewhere oneDNN, which gives a row
// the same bits for any number of rows (gemm.h), so that eval is batch-invariant.
void gemm_rows(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (!ops::FewRowKernels::on() || ta || M > kGemvMaxRows || alpha != 1.0f || beta != 0.0f ||
      K == 0)
    return gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (tb) return gemv_nt(C, A, B, M, K, N, lda, ldb, ldc);
  gemv_nn(C, A, B, nullptr, M, K, N, false, {lda, ldb, ldc});
}

void linear_forward_rows(float* y, const float* x, const float* w, const float* b, int64_t N,
                         int64_t in, int64_t out, bool accumulate, Strides ld) {
  if (!ops::FewRowKernels::on() || N > kGemvMaxRows)
    return linear_forward(y, x, w, b, N, in, out, accumulate, ld);
  gemv_nn(y, x, w, b, N, in, out, accumulate, ld);
}

void linear_forward_w16(float* y, const float* x, const uint16_t* w16, const float* b, int64_t N,
                        int64_t in, int64_t out, bool accumulate, Strides ld) {
  if (N <= kGemvMaxRows) return gemv_nn(y, x, w16, b, N, in, out, accumulate, ld);
  linear_panels(y, x, w16, nullptr, b, N, in, out, accumulate, ld);
}

void gemm_nt_w16(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                 int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  if (N <= kGemvMaxRows) return gemv_nt(y, x, w16, N, in, out, ldx, ldw, ldy);
  if (N == 0 || out == 0) return;
  nt_panels(y, x, w16, nullptr, N, in, out, ldx, ldw, ldy);
}

void linear_forward_i8(float* y, const float* x, const int8_t* q, const float* scale,
                       const float* b, int64_t N, int64_t in, int64_t out, bool accumulate,
                       Strides ld) {
  if (N <= kGemvMaxRows) return gemv_nn(y, x, q, scale, b, N, in, out, accumulate, ld);
  linear_panels(y, x, q, scale, b, N, in, out, accumulate, ld);
}

void gemm_nt_i8(float* y, const float* x, const int8_t* q, const float* scale, int64_t N,
                int64_t in, int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  if (N <= kGemvMaxRows) return gemv_nt(y, x, q, scale, N, in, out, ldx, ldw, ldy);
  if (N == 0 || out == 0) return;
  nt_panels(y, x, q, scale, N, in, out, ldx, ldw, ldy);
}

}  // namespace sigma::cpu
