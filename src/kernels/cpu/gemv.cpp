#include "kernels/cpu/gemv.h"

#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/spin_team.h"
#include "kernels/ops.h"

namespace sigma::cpu {

namespace {

// Below this many weights one thread streams them faster than two can start.
constexpr int64_t kParallelWeights = int64_t(1) << 16;

// The reduction over w's rows is cut into fixed chunks of kChunkRows, each summed into its own
// partial vector, so that a thread streams whole rows of a contiguous block of w (one stream
// the prefetchers follow, instead of a column slice of every row; docs/benchmarks.md, issue
// 12). The chunk bounds do not depend on the thread count, so neither do the bits. fp32 and
// bf16 weights in panels (kernels::panel_index) keep the same chunks and add each chunk's sums
// in the same order.
constexpr int64_t kChunkRows = 64;
using kernels::kPanelColumns;

// The panel kernels (gemv_simd.inc) prefetch the lines kPanelAhead bytes past each row into L2
// (fp32 only where the ISA's kPrefetchPanel says): a panel is one run of bytes, and for bf16
// 0.5-1 KiB ahead streamed 3-8 % faster than the hardware prefetcher alone, 2 KiB ahead 5-10 %
// slower (2 threads, from memory, Zen 3; issue 40).
constexpr int64_t kPanelAhead = 1024;
// The bf16 and int8 heads read a row at a time from this many inputs on (else 4 rows at once):
// one stream the hardware prefetcher follows, where 4 rows are 4 short ones. A 16k x 512 head
// (2 threads, from memory, Zen 3, medians of 5 alternating pairs) streamed bf16 13.4 -> 18.3
// GB/s, int8 11.2 -> 14.6, fp32 no faster (it keeps 4); at d = 128 (128-byte int8 rows) the
// per-row sums cost more and int8 ran ~30 % slower a row at a time. Prefetching the next row
// as well made int8 slower again (15-19 -> 10-17 GB/s).
constexpr int64_t kHeadRowAlone = 512;
// A panel's int8 pair rows are read in pieces of at most kPiecePairs, whose int32 lanes cannot
// overflow (|sum| <= 2 * 256 * 127 * 32767 < 2^31), each piece's lanes then added into int64.
constexpr int64_t kPiecePairs = 256;
static_assert(2 * kPiecePairs * 127 * 32767 < (int64_t(1) << 31));

inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return from_bf16(w); }

// Whether the kernels prefetch a sweep of `bytes` into L1 (else L2): when it and the sweep being
// read take at most 3/4 of L1 (gemv_simd.inc).
const int64_t g_l1_prefetch_bytes = [] {
  const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  return l1 > 0 ? int64_t(l1) / 4 * 3 : int64_t(0);
}();
inline bool prefetch_to_l1(int64_t bytes) { return 2 * bytes <= g_l1_prefetch_bytes; }

// The instruction set the products run on (gemv_use_isa; Best until a test picks one).
GemvIsa g_isa = GemvIsa::Best;

// [lo, hi): columns or rows of w.
struct Range {
  int64_t lo, hi;
};

// y rows [M, lo..hi) = (accumulate ? y : 0) + b + the partials p [chunks][M][out], in chunk
// order.
void sum_rows(float* y, int64_t ldy, const float* b, int64_t M, bool accumulate, Range c,
              const float* p, int64_t chunks, int64_t out) {
  for (int64_t r = 0; r < M; ++r) {
    float* row = y + r * ldy;
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

// One panel of fp32 or bf16 weights t[in, width] (kernels::panel_index) into y's width columns,
// which hold (accumulate ? y : 0) + b: per chunk of kChunkRows rows the FMAs in row order from
// zero (nn's partial), then added to y, chunk by chunk (sum_rows' order), so the bits are nn's.
template <class W>
void panel_scalar(float* y, int64_t ldy, const float* x, int64_t ldx, const W* t,
                  int64_t width, int64_t in, int64_t M) {
  for (int64_t i0 = 0; i0 < in; i0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, in - i0);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < width; ++j) {
        float s = 0.0f;
        for (int64_t i = i0; i < i0 + rows; ++i) s = std::fma(x[r * ldx + i], widen(t[i * width + j]), s);
        y[r * ldy + j] += s;
      }
  }
}

// The SIMD paths' order: 16 lanes, lane l summing k = l, l + 16, ..., then the lanes added
// as _mm512_reduce_add_ps does (halving: 16 -> 8 -> 4 -> 2 -> 1).
template <class W>
void nt_scalar(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
               int64_t M, int64_t in, Range rows) {
  for (int64_t j = rows.lo; j < rows.hi; ++j)
    for (int64_t r = 0; r < M; ++r) {
      float lane[16] = {};
      for (int64_t k = 0; k < in; ++k)
        lane[k % 16] = std::fma(x[r * ldx + k], widen(w[j * ldw + k]), lane[k % 16]);
      for (int n = 8; n >= 1; n /= 2)
        for (int l = 0; l < n; ++l) lane[l] += lane[l + n];
      y[r * ldy + j] = lane[0];
    }
}

// One panel of int8 weights t (kernels::i8_index: `pairs` row pairs of `width` columns) for M
// rows of 16-bit x: total[r * kPanelColumns + j] = the exact sum of xq q (any order gives the
// SIMD paths' values).
void panel_i8_scalar(int64_t* total, const int16_t* xq, int64_t ldq, const int8_t* t, int64_t width,
                     int64_t pairs, int64_t M) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < width; ++j) {
      int64_t s = 0;
      for (int64_t k = 0; k < pairs; ++k)
        s += int32_t(xq[r * ldq + 2 * k]) * t[k * 2 * width + 2 * j] + int32_t(xq[r * ldq + 2 * k + 1]) * t[k * 2 * width + 2 * j + 1];
      total[r * kPanelColumns + j] = s;
    }
}
void nt_i8_scalar(int64_t* s, const int16_t* xq, int64_t ldq, const int8_t* w, int64_t ldw,
                  int64_t M, int64_t in, int64_t j, int64_t Q) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t q = 0; q < Q; ++q) {
      int64_t t = 0;
      for (int64_t k = 0; k < in; ++k) t += int32_t(xq[r * ldq + k]) * w[(j + q) * ldw + k];
      s[r * Q + q] = t;
    }
}

// ---- SIMD paths: one kernel source (gemv_simd.inc), compiled once per instruction set ----
#if defined(__x86_64__)
#define SIGMA_GEMV_X86 1

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_* as the unused merge source, which
// -Wuninitialized reports wherever AVX-512 is enabled by attribute rather than by -m flags (on a
// machine without it): a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The tests compile this file a second time with its AVX-512 code on SIMDe's portable AVX-512
// (tests/avx512_emulation.h defines SIGMA_EMULATED_AVX512), so that the AVX-512 kernels are
// checked bit for bit on machines without AVX-512 too: there, no AVX-512 target attribute.
#if defined(SIGMA_EMULATED_AVX512)
#define SIGMA_AVX512_TARGET
#define SIGMA_AVX512VNNI_TARGET
#else
#define SIGMA_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define SIGMA_AVX512VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#endif
namespace avx512 {
#define SIGMA_SIMD SIGMA_AVX512_TARGET
using vec = __m512;
constexpr int kLanes = 16;
SIGMA_SIMD inline __mmask16 mask(int n) { return __mmask16((1u << n) - 1); }
SIGMA_SIMD inline vec zero() { return _mm512_setzero_ps(); }
SIGMA_SIMD inline vec set1(float v) { return _mm512_set1_ps(v); }
SIGMA_SIMD inline vec loadu(const float* p) { return _mm512_loadu_ps(p); }
SIGMA_SIMD inline vec load_masked(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
SIGMA_SIMD inline void storeu(float* p, vec v) { _mm512_storeu_ps(p, v); }
SIGMA_SIMD inline void store_masked(float* p, vec v, int n) { _mm512_mask_storeu_ps(p, mask(n), v); }
SIGMA_SIMD inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
SIGMA_SIMD inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
SIGMA_SIMD inline void load_w_pair(const float* p, vec& lo, vec& hi) {
  lo = loadu(p);
  hi = loadu(p + kLanes);
}
// 32 bf16 weights: lo gets columns {0-3, 8-11, 16-19, 24-27}, hi {4-7, 12-15, 20-23, 28-31}.
SIGMA_SIMD inline void load_w_pair(const uint16_t* p, vec& lo, vec& hi) {
  const __m512i h = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h));
}
SIGMA_SIMD inline void pair_in_order(vec& lo, vec& hi) {  // columns 0-15 into lo, 16-31 into hi
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const vec a = _mm512_permutex2var_ps(lo, first, hi);
  hi = _mm512_permutex2var_ps(lo, second, hi);
  lo = a;
}
SIGMA_SIMD inline vec widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Unmasked loads of 16 weights: the widening folds the load, where a masked load is a separate
// instruction.
SIGMA_SIMD inline vec load_w(const float* p) { return _mm512_loadu_ps(p); }
SIGMA_SIMD inline vec load_w(const uint16_t* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SIGMA_SIMD inline vec load_w_masked(const float* p, int n) { return load_masked(p, n); }
SIGMA_SIMD inline vec load_w_masked(const uint16_t* p, int n) {
  return widen_bf16(_mm256_maskz_loadu_epi16(mask(n), p));
}
// 16 lanes added by halving: 16 -> 8 -> 4 -> 2 -> 1 (GCC's _mm512_reduce_add_ps).
SIGMA_SIMD inline float reduce16(const vec* v) { return _mm512_reduce_add_ps(v[0]); }
using ivec = __m512i;
SIGMA_SIMD inline ivec izero() { return _mm512_setzero_si512(); }
SIGMA_SIMD inline ivec iset1(int32_t v) { return _mm512_set1_epi32(v); }
SIGMA_SIMD inline ivec iload(const int32_t* p) { return _mm512_loadu_si512(p); }
SIGMA_SIMD inline ivec iload_masked(const int32_t* p, int n) { return _mm512_maskz_loadu_epi32(mask(n), p); }
SIGMA_SIMD inline void istore(int32_t* p, ivec v) { _mm512_storeu_si512(p, v); }
SIGMA_SIMD inline void istore_masked(int32_t* p, ivec v, int n) { _mm512_mask_storeu_epi32(p, mask(n), v); }
SIGMA_SIMD inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
SIGMA_SIMD inline ivec dpadd(ivec acc, ivec a, ivec b) { return iadd(acc, _mm512_madd_epi16(a, b)); }
SIGMA_SIMD inline ivec widen16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SIGMA_SIMD inline ivec widen16_masked(const int8_t* p, int n) {  // n < 32
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(__mmask32((1u << n) - 1), p));
}
SIGMA_SIMD inline ivec load16(const int16_t* p) { return _mm512_loadu_si512(p); }
// The lanes' int32 sum (the caller keeps it from overflowing: nt_i8_group's blocks).
SIGMA_SIMD inline int32_t ireduce(ivec v) {
  const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
}
template <class W>
constexpr bool kUnpackBf16 = false;  // avx2 only (below)
// Whether the panel kernels prefetch kPanelAhead past each row (gemv_simd.inc). Never measured
// on AVX-512 machines with panels: kept as first written (issue 40).
template <class W>
constexpr bool kPrefetchPanel = true;
#include "kernels/cpu/gemv_simd.inc"
#undef SIGMA_SIMD
}  // namespace avx512

// AVX-512 with VNNI (Zen 4 and 5, Ice Lake on): the int8 kernels' multiply-add and add in one
// vpdpwssd. Its int32 lanes wrap as vpmaddwd + vpaddd do, and no sum here reaches 2^31
// (gemv.h), so the bits are the same; the fp32 and bf16 kernels are avx512's.
namespace avx512vnni {
using namespace avx512;
#define SIGMA_SIMD SIGMA_AVX512VNNI_TARGET
SIGMA_SIMD inline ivec dpadd(ivec acc, ivec a, ivec b) { return _mm512_dpwssd_epi32(acc, a, b); }
#include "kernels/cpu/gemv_simd.inc"
#undef SIGMA_SIMD
}  // namespace avx512vnni
#pragma GCC diagnostic pop

namespace avx2 {
#define SIGMA_SIMD __attribute__((target("avx2,fma")))
using vec = __m256;
constexpr int kLanes = 8;
SIGMA_SIMD inline __m256i mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
SIGMA_SIMD inline vec zero() { return _mm256_setzero_ps(); }
SIGMA_SIMD inline vec set1(float v) { return _mm256_set1_ps(v); }
SIGMA_SIMD inline vec loadu(const float* p) { return _mm256_loadu_ps(p); }
SIGMA_SIMD inline vec load_masked(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
SIGMA_SIMD inline void storeu(float* p, vec v) { _mm256_storeu_ps(p, v); }
SIGMA_SIMD inline void store_masked(float* p, vec v, int n) { _mm256_maskstore_ps(p, mask(n), v); }
SIGMA_SIMD inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
SIGMA_SIMD inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
SIGMA_SIMD inline void load_w_pair(const float* p, vec& lo, vec& hi) {
  lo = loadu(p);
  hi = loadu(p + kLanes);
}
// 16 bf16 weights: lo gets columns {0-3, 8-11}, hi {4-7, 12-15} (AVX2 has no bf16 instructions;
// a zero-extension and a shift take four instructions for the same 16).
SIGMA_SIMD inline void load_w_pair(const uint16_t* p, vec& lo, vec& hi) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}
SIGMA_SIMD inline void pair_in_order(vec& lo, vec& hi) {  // columns 0-7 into lo, 8-15 into hi
  const vec a = _mm256_permute2f128_ps(lo, hi, 0x20);
  hi = _mm256_permute2f128_ps(lo, hi, 0x31);
  lo = a;
}
SIGMA_SIMD inline vec widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
SIGMA_SIMD inline vec load_w(const float* p) { return _mm256_loadu_ps(p); }
SIGMA_SIMD inline vec load_w(const uint16_t* p) {
  return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// AVX2 has no masked load of 16-bit elements: a tail goes through a zeroed copy.
template <class W>
SIGMA_SIMD inline vec load_w_masked(const W* p, int n) {
  if constexpr (sizeof(W) == 4) {
    return load_masked(p, n);
  } else {
    W t[kLanes] = {};
    std::memcpy(t, p, size_t(n) * sizeof(W));
    return load_w(t);
  }
}
// The 16 lanes v[0] (lanes 0-7) and v[1] (8-15) added by halving, as AVX-512's reduce16.
SIGMA_SIMD inline float reduce16(const vec* v) {
  const vec s8 = _mm256_add_ps(v[1], v[0]);
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
using ivec = __m256i;
SIGMA_SIMD inline ivec izero() { return _mm256_setzero_si256(); }
SIGMA_SIMD inline ivec iset1(int32_t v) { return _mm256_set1_epi32(v); }
SIGMA_SIMD inline ivec iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
SIGMA_SIMD inline ivec iload_masked(const int32_t* p, int n) { return _mm256_maskload_epi32(p, mask(n)); }
SIGMA_SIMD inline void istore(int32_t* p, ivec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
SIGMA_SIMD inline void istore_masked(int32_t* p, ivec v, int n) { _mm256_maskstore_epi32(p, mask(n), v); }
SIGMA_SIMD inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
SIGMA_SIMD inline ivec dpadd(ivec acc, ivec a, ivec b) { return iadd(acc, _mm256_madd_epi16(a, b)); }
SIGMA_SIMD inline ivec widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
SIGMA_SIMD inline ivec widen16_masked(const int8_t* p, int n) {  // n < 16: a zeroed copy
  int8_t t[16] = {};
  std::memcpy(t, p, size_t(n));
  return widen16(t);
}
SIGMA_SIMD inline ivec load16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
SIGMA_SIMD inline int32_t ireduce(ivec v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
}
// bf16 head weights widened by unpacking (nt_kernel_pairs, after the kernels).
template <class W>
constexpr bool kUnpackBf16 = std::is_same_v<W, uint16_t>;
// fp32 panels stream 4 lines a row and the hardware prefetcher alone keeps up: with the software
// prefetches fp32 decode ran 12-15 % slower (Zen 3, alternating runs), bf16 and int8 ~10 % and
// ~25 % faster (their widening leaves the stream room to fall behind).
template <class W>
constexpr bool kPrefetchPanel = !std::is_same_v<W, float>;
template <int M>
SIGMA_SIMD void nt_kernel_pairs(float* y, int64_t ldy, const float* x, int64_t ldx, const uint16_t* w,
                                int64_t ldw, int64_t in, Range rows, std::integral_constant<int, M>);
#include "kernels/cpu/gemv_simd.inc"
// The head's rows of bf16 weights (nt_kernel) widened by the same unpacks: x is copied once a
// call with each 16 inputs in the unpacks' order, so that every lane sums the inputs it summed
// in nt_group, in the same order, and the lanes are put back in order before the tail block
// (nt_group's code) and reduce16: the same sums, the same bits. At any row count: the copy's
// permutes are per call, not per weight.
template <int M, int Q>
SIGMA_SIMD inline __attribute__((always_inline)) void nt_group_pairs(float* y, int64_t ldy, const float* x, int64_t ldx,
                                                                    const float* xs, const uint16_t* w, int64_t ldw,
                                                                    int64_t in, int64_t j, bool ahead) {
  constexpr int64_t kLine = 32;  // bf16 weights of a 64-byte line
  const int64_t full = in / 16 * 16;
  vec acc[M][Q][2];
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < Q; ++q) acc[r][q][0] = acc[r][q][1] = zero();
  for (int64_t k = 0; k < full; k += 16) {
    if (ahead && k % kLine == 0)
      for (int q = Q; q < 2 * Q; ++q) prefetch_line(reinterpret_cast<const char*>(w + (j + q) * ldw + k), true);
    vec wlo[Q], whi[Q];
    for (int q = 0; q < Q; ++q) load_w_pair(w + (j + q) * ldw + k, wlo[q], whi[q]);
    for (int r = 0; r < M; ++r) {
      const vec xlo = loadu(xs + r * full + k), xhi = loadu(xs + r * full + k + kLanes);
      for (int q = 0; q < Q; ++q) {
        acc[r][q][0] = fmadd(xlo, wlo[q], acc[r][q][0]);
        acc[r][q][1] = fmadd(xhi, whi[q], acc[r][q][1]);
      }
    }
  }
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < Q; ++q) pair_in_order(acc[r][q][0], acc[r][q][1]);  // inputs 0-7, 8-15 of every 16
  if (full < in)  // the last, partial 16 inputs: nt_group's own loads and FMAs
    for (int s = 0; s < 2; ++s) {
      const int64_t k0 = full + s * kLanes;
      const int n = int(std::clamp<int64_t>(in - k0, 0, kLanes));
      vec wv[Q];
      for (int q = 0; q < Q; ++q) wv[q] = load_w_masked(w + (j + q) * ldw + k0, n);
      for (int r = 0; r < M; ++r) {
        const vec xv = load_masked(x + r * ldx + k0, n);
        for (int q = 0; q < Q; ++q) acc[r][q][s] = fmadd(xv, wv[q], acc[r][q][s]);
      }
    }
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < Q; ++q) y[r * ldy + j + q] = reduce16(acc[r][q]);
}

template <int M>
SIGMA_SIMD void nt_kernel_pairs(float* y, int64_t ldy, const float* x, int64_t ldx, const uint16_t* w,
                                int64_t ldw, int64_t in, Range rows, std::integral_constant<int, M>) {
  const int64_t full = in / 16 * 16;
  thread_local std::vector<float> copy;  // [M][full]: x's inputs in the unpacks' order
  copy.resize(size_t(M * full));
  float* xs = copy.data();
  for (int r = 0; r < M; ++r)
    for (int64_t k = 0; k < full; k += 16) {
      const vec a = loadu(x + r * ldx + k), b = loadu(x + r * ldx + k + kLanes);
      storeu(xs + r * full + k, _mm256_permute2f128_ps(a, b, 0x20));           // 0-3, 8-11
      storeu(xs + r * full + k + kLanes, _mm256_permute2f128_ps(a, b, 0x31));  // 4-7, 12-15
    }
  int64_t j = rows.lo;
  if (in < kHeadRowAlone)
    for (; j + 4 <= rows.hi; j += 4) nt_group_pairs<M, 4>(y, ldy, x, ldx, xs, w, ldw, in, j, j + 8 <= rows.hi);
  for (; j < rows.hi; ++j) nt_group_pairs<M, 1>(y, ldy, x, ldx, xs, w, ldw, in, j, false);
}
#undef SIGMA_SIMD
}  // namespace avx2

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

bool cpu_has(GemvIsa isa) {
#if defined(SIGMA_EMULATED_AVX512)
  if (isa == GemvIsa::Avx512Vnni || isa == GemvIsa::Avx512) return true;
#endif
#if SIGMA_GEMV_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  if (isa == GemvIsa::Avx512Vnni) return vnni;
  if (isa == GemvIsa::Avx512) return avx512;
  if (isa == GemvIsa::Avx2) return avx2;
#endif
  return isa == GemvIsa::Portable;
}

GemvIsa resolve(GemvIsa isa) {
  if (isa != GemvIsa::Best) return isa;
  static const GemvIsa best = cpu_has(GemvIsa::Avx512Vnni) ? GemvIsa::Avx512Vnni
                              : cpu_has(GemvIsa::Avx512)   ? GemvIsa::Avx512
                              : cpu_has(GemvIsa::Avx2) ? GemvIsa::Avx2
                                                       : GemvIsa::Portable;
  return best;
}

template <class W>
struct NN {
  template <int M>
  struct K {
    static void run(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
                    int64_t in, int64_t reach, Range c) {
      switch (resolve(g_isa)) {
#if SIGMA_GEMV_X86
        case GemvIsa::Avx512Vnni:
        case GemvIsa::Avx512: return avx512::nn_kernel<W, M>(y, ldy, x, ldx, w, ldw, in, reach, c);
        case GemvIsa::Avx2: return avx2::nn_kernel<W, M>(y, ldy, x, ldx, w, ldw, in, reach, c);
#endif
        default: return nn_scalar(y, ldy, x, ldx, w, ldw, M, in, c);
      }
    }
  };
};
template <class W>
struct NT {
  template <int M>
  struct K {
    static void run(float* y, int64_t ldy, const float* x, int64_t ldx, const W* w, int64_t ldw,
                    int64_t in, Range rows) {
      switch (resolve(g_isa)) {
#if SIGMA_GEMV_X86
        case GemvIsa::Avx512Vnni:
        case GemvIsa::Avx512: return avx512::nt_kernel<W, M>(y, ldy, x, ldx, w, ldw, in, rows);
        case GemvIsa::Avx2: return avx2::nt_kernel<W, M>(y, ldy, x, ldx, w, ldw, in, rows);
#endif
        default: return nt_scalar(y, ldy, x, ldx, w, ldw, M, in, rows);
      }
    }
  };
};
template <class W>
struct NP {
  template <int M>
  struct K {
    static void run(float* y, int64_t ldy, const float* x, int64_t ldx, const W* t,
                    int64_t width, int64_t in) {
      switch (resolve(g_isa)) {
#if SIGMA_GEMV_X86
        case GemvIsa::Avx512Vnni:
        case GemvIsa::Avx512: return avx512::panel_kernel<W, M>(y, ldy, x, ldx, t, width, in);
        case GemvIsa::Avx2: return avx2::panel_kernel<W, M>(y, ldy, x, ldx, t, width, in);
#endif
        default: return panel_scalar(y, ldy, x, ldx, t, width, in, M);
      }
    }
  };
};
struct NPI8 {
  template <int M>
  struct K {
    static void run(int64_t* total, const int16_t* xq, int64_t ldq, const int8_t* t, int64_t width,
                    int64_t pairs) {
      switch (resolve(g_isa)) {
#if SIGMA_GEMV_X86
        case GemvIsa::Avx512Vnni: return avx512vnni::panel_i8_kernel<M>(total, xq, ldq, t, width, pairs);
        case GemvIsa::Avx512: return avx512::panel_i8_kernel<M>(total, xq, ldq, t, width, pairs);
        case GemvIsa::Avx2: return avx2::panel_i8_kernel<M>(total, xq, ldq, t, width, pairs);
#endif
        default: return panel_i8_scalar(total, xq, ldq, t, width, pairs, M);
      }
    }
  };
};
// Q rows of the head at j (Q = 4 or 1).
struct NTI8 {
  template <int M>
  struct K {
    template <int Q>
    static void group(int64_t* s, const int16_t* xq, int64_t ldq, const int8_t* w, int64_t ldw,
                      int64_t in, int64_t j, bool ahead) {
      switch (resolve(g_isa)) {
#if SIGMA_GEMV_X86
        case GemvIsa::Avx512Vnni: return avx512vnni::nt_i8_group<M, Q>(s, xq, ldq, w, ldw, in, j, ahead);
        case GemvIsa::Avx512: return avx512::nt_i8_group<M, Q>(s, xq, ldq, w, ldw, in, j, ahead);
        case GemvIsa::Avx2: return avx2::nt_i8_group<M, Q>(s, xq, ldq, w, ldw, in, j, ahead);
#endif
        default: return nt_i8_scalar(s, xq, ldq, w, ldw, M, in, j, Q);
      }
    }
    static void run(float* y, int64_t ldy, const int16_t* xq, int64_t ldq, const float* step,
                    const int8_t* w, int64_t ldw, const float* scale, int64_t in, Range rows) {
      int64_t s[M * 4];
      for (int64_t j = rows.lo; j < rows.hi;) {
        const int Q = j + 4 <= rows.hi && in < kHeadRowAlone ? 4 : 1;
        if (Q == 4) group<4>(s, xq, ldq, w, ldw, in, j, j + 8 <= rows.hi);
        else group<1>(s, xq, ldq, w, ldw, in, j, false);
        for (int r = 0; r < M; ++r)
          for (int q = 0; q < Q; ++q) y[r * ldy + j + q] = scale[j + q] * (step[r] * kernels::exact_to_float(s[r * Q + q]));
        j += Q;
      }
    }
  };
};

// ---- the next product's streams (spin_team.h's NextJob) ----
// A decode step runs the same products in the same order every token (a served batch's steps
// too), so the product that followed a matrix the last time is the one likely to follow it
// now. Per calling thread, each product shared with the team records the streams of its first
// two items (its weights' first rows of the caller's and a helper's first item) as the successor
// of the product before it, and hands the team those recorded as its own successor's: a thread
// that waits at the end of this product (or, a helper, while the caller runs the LayerNorms,
// attention and activations between two products) pulls the start of its next item into L2.
// Only prefetches: a wrong guess costs bandwidth, never a bit.
struct Successor {
  const void* key = nullptr;
  NextJob next;
};
constexpr int kSuccessorSlots = 256;
thread_local Successor t_successors[kSuccessorSlots];
thread_local const void* t_last_product = nullptr;

Successor& successor_slot(const void* key) {
  const uint64_t h = uint64_t(reinterpret_cast<uintptr_t>(key) >> 4) * 0x9E3779B97F4A7C15ull;
  return t_successors[h >> 56];
}

// `mine`: this product's first two items' streams (key: its weights); returns its successor's.
NextJob next_product(const void* key, const NextJob& mine) {
  if (t_last_product) successor_slot(t_last_product) = {t_last_product, mine};
  t_last_product = key;
  const Successor& s = successor_slot(key);
  return s.key == key ? s.next : NextJob{};
}

// Item k's stream where item k is `rows` whole rows of row_bytes from row r0 of base (nothing
// where the rows are not contiguous: a column slice of a wider matrix).
Stream rows_stream(const void* base, int64_t r0, int64_t rows, int64_t row_bytes, bool contiguous) {
  if (!contiguous || rows <= 0) return {};
  return {static_cast<const char*>(base) + r0 * row_bytes, rows * row_bytes};
}

// The items of a product of `weights` weights, on the spin team (kernels/cpu/spin_team.h) when
// it is large enough: a decode step runs dozens of these back to back.
template <class Fn>
void run_items(int64_t weights, int64_t items, Fn&& fn, const NextJob& next = {}) {
  if (weights >= kParallelWeights) return for_each_item(items, fn, next);
  for (int64_t i = 0; i < items; ++i) fn(i);
}

// The same for a product's items and then `then` items that need all of them (the sums of the
// partials, then_weights values read): where both are large enough, one job, one hand-off
// (spin_team.h's for_each_item_phased); where the sums are not, they run on the calling thread
// after the product's job, as a job of their own would (a helper that came late could
// otherwise take a sum item and keep the caller waiting on a busy machine).
template <class Fn>
void run_items_phased(int64_t weights, int64_t items, int64_t then, int64_t then_weights, Fn&& fn,
                      const NextJob& next) {
  if (weights >= kParallelWeights && then_weights >= kParallelWeights)
    return for_each_item_phased(items, then, fn, next);
  run_items(weights, items, fn, next);
  for (int64_t i = items; i < items + then; ++i) fn(i);
}

// Columns [lo, hi) of block `blk` of `blocks` over out columns, in SIMD widths.
Range column_block(int64_t out, int64_t blk, int64_t blocks) {
  const int64_t per = ((out + 15) / 16 + blocks - 1) / blocks;
  return {std::min(out, blk * per * 16), std::min(out, (blk + 1) * per * 16)};
}

int64_t chunks_of(int64_t in, int64_t rows = kChunkRows) {
  return std::max<int64_t>(1, (in + rows - 1) / rows);
}

// The items of an nn product: runs of consecutive chunks of whole rows of w (one contiguous
// stream each; per_thread items a thread), split into column blocks only when there are fewer
// chunks than items; fn(chunk, its first row, its rows, the rows to its item's end, the
// columns) for each chunk of an item, in order (the kernels prefetch across a chunk's end). A thread streaming a run of chunks, not every other chunk as the items are claimed,
// keeps the hardware prefetcher's stream: bf16 +13-16 %, fp32 and int8 +3-10 % at 2 threads
// (bench_gemv, Zen 5; issue 40). Partials stay per chunk, so the bits do not change.
// Then then_fn(b) for b in [0, then) once every chunk has run (the sums, reading then_weights
// values; run_items_phased).
// w: the weights (row_bytes a row of w; contiguous: rows of exactly the
// out columns), for the prefetch of the next product (next_product).
template <class Fn, class Then>
void for_each_chunk(int64_t in, int64_t out, Fn&& fn, int64_t chunk_rows, int64_t per_thread,
                    int64_t then, int64_t then_weights, Then&& then_fn, const void* w,
                    int64_t row_bytes, bool contiguous) {
  const int64_t chunks = chunks_of(in, chunk_rows), items = per_thread * team_threads();
  const int64_t blocks = std::max<int64_t>(1, (items + chunks - 1) / chunks);
  const int64_t runs = std::min(chunks, items);
  NextJob next;
  if (in * out >= kParallelWeights) {
    auto run_rows = [&](int64_t run) -> Stream {  // run `run`'s rows (whole rows: one block)
      if (blocks > 1 || run >= runs) return {};
      const int64_t r0 = run * chunks / runs * chunk_rows;
      const int64_t r1 = std::min(in, (run + 1) * chunks / runs * chunk_rows);
      return rows_stream(w, r0, r1 - r0, row_bytes, contiguous);
    };
    next = next_product(w, {run_rows(0), run_rows(1)});
  }
  run_items_phased(in * out, runs * blocks, then, then_weights, [&](int64_t it) {
    if (it >= runs * blocks) return then_fn(it - runs * blocks);
    const int64_t run = it / blocks;
    const Range cols = column_block(out, it % blocks, blocks);
    const int64_t c0 = run * chunks / runs, c1 = (run + 1) * chunks / runs;
    const int64_t end = std::min(in, c1 * chunk_rows);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * chunk_rows, rows = std::min(chunk_rows, in - i0);
      if (cols.lo < cols.hi && rows > 0) fn(c, i0, rows, end - i0, cols);
    }
  }, next);
}

template <class W>
void nn(float* y, const float* x, const W* w, const float* b, int64_t M, int64_t in, int64_t out,
        bool accumulate, Strides ld) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  if (M == 0 || out == 0) return;
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  const int64_t chunks = chunks_of(in), stride = M * out;
  thread_local std::vector<float> partial;  // [chunks][M][out]
  partial.resize(size_t(chunks * stride));
  float* p = partial.data();
  // Then the chunk sums, in order, by column blocks (in the same job where large enough).
  const int64_t sum_chunks = in > 0 ? chunks : 0, sum_blocks = (out + 511) / 512;
  for_each_chunk(
      in, out,
      [&](int64_t c, int64_t i0, int64_t rows, int64_t reach, Range cols) {
        with_rows<NN<W>::template K>(M, p + c * stride, out, x + i0, ldx, w + i0 * ldw, ldw, rows,
                                     reach, cols);
      },
      kChunkRows, 2, sum_blocks, sum_chunks * stride,
      [&](int64_t blk) {
        sum_rows(y, ldy, b, M, accumulate, column_block(out, blk, sum_blocks), p, sum_chunks, out);
      },
      w, ldw * int64_t(sizeof(W)), ldw == out);
}

// fn(range) for each item of a product of in * out weights over `total` columns (panels) or
// rows (the head): runs of whole units of `unit`, two a thread, each one run of bytes where
// `contiguous` (unit_bytes a column or row from w), prefetched for as next_product's streams.
template <class Fn>
void for_each_run(const void* w, int64_t in, int64_t out, int64_t total, int64_t unit,
                  int64_t unit_bytes, bool contiguous, Fn&& fn) {
  const int64_t units = (total + unit - 1) / unit;
  const int64_t runs = std::min<int64_t>(units, 2 * team_threads());
  auto range = [&](int64_t run) {
    return Range{run * units / runs * unit, std::min(total, (run + 1) * units / runs * unit)};
  };
  NextJob next;
  if (in * out >= kParallelWeights) {
    auto stream = [&](int64_t run) -> Stream {
      if (run >= runs) return {};
      const Range r = range(run);
      return rows_stream(w, r.lo, r.hi - r.lo, unit_bytes, contiguous);
    };
    next = next_product(w, {stream(0), stream(1)});
  }
  run_items(in * out, runs, [&](int64_t run) { fn(range(run)); }, next);
}

// fn(c0, width) for each panel of a product on weights in panels (kernels/types.h) of
// `column_bytes` bytes a column, an item a run of whole panels.
template <class Fn>
void for_each_panel(const void* w, int64_t in, int64_t out, int64_t column_bytes, Fn&& fn) {
  for_each_run(w, in, out, out, kPanelColumns, column_bytes, true, [&](Range c) {
    for (int64_t c0 = c.lo; c0 < c.hi; c0 += kPanelColumns) fn(c0, std::min(kPanelColumns, out - c0));
  });
}

void check_panels(int64_t out, Strides ld) {
  SIGMA_CHECK(ld.w == 0 || ld.w == out, "weights in panels have no row stride (got {} for {} columns)",
              ld.w, out);
}

// y (+)= x @ w + b on fp32 or bf16 weights in panels, each panel's sums added to y chunk by chunk
// as it goes, so no partials and no second phase: the bits of nn's partials and sums.
template <class W>
void nn_panels(float* y, const float* x, const W* w, const float* b, int64_t M, int64_t in,
               int64_t out, bool accumulate, Strides ld) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  check_panels(out, ld);
  if (M == 0 || out == 0) return;
  const int64_t ldx = ld.x ? ld.x : in, ldy = ld.y ? ld.y : out;
  for_each_panel(w, in, out, int64_t(sizeof(W)) * in, [&](int64_t c0, int64_t width) {
    for (int64_t r = 0; r < M; ++r) {
      float* row = y + r * ldy + c0;
      for (int64_t j = 0; j < width; ++j) row[j] = (accumulate ? row[j] : 0.0f) + (b ? b[c0 + j] : 0.0f);
    }
    with_rows<NP<W>::template K>(M, y + c0, ldy, x, ldx, w + c0 * in, width, in);
  });
}

// fn(rows) for each item of a product on the head's w[out, in] (rows ldw apart; elem_bytes a
// weight): runs of rows in multiples of 4 (the kernels' groups). Groups of 64 rows (what the
// items were) were 8 KiB at d = 128 in int8: 256 claims a call cost more than the imbalance of
// 4 runs (Zen 3, issue 40).
template <class Fn>
void for_each_head_run(const void* w, int64_t in, int64_t out, int64_t ldw, int64_t elem_bytes, Fn&& fn) {
  for_each_run(w, in, out, out, 4, ldw * elem_bytes, ldw == in, fn);
}

template <class W>
void nt(float* y, const float* x, const W* w, int64_t M, int64_t in, int64_t out, int64_t ldx,
        int64_t ldw, int64_t ldy) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  if (M == 0 || out == 0) return;
  for_each_head_run(w, in, out, ldw, int64_t(sizeof(W)), [&](Range rows) {
    with_rows<NT<W>::template K>(M, y, ldy, x, ldx, w, ldw, in, rows);
  });
}

// ---- int8 weights: x as 16-bit fixed point, exact integer sums ----
// Why: widening an int8 weight to fp32 (sign-extend, convert, FMA: three instructions per 8
// weights on AVX2) made int8 no faster than bf16 (two); a 16-bit multiply-add takes 2 weights
// per 32-bit lane, one widening per 16 (AVX2) weights and no conversion. x rounds by at most
// half a step of max|x| / 32767, finer than bf16's 8 bits for all but the row's smallest values.

// Rows of x as 16-bit fixed point (kernels::round_row16), xq zero from `in` to ldq.
void quantize_rows16(int16_t* xq, int64_t ldq, float* step, const float* x, int64_t ldx,
                     int64_t M, int64_t in) {
  for (int64_t r = 0; r < M; ++r) {
    step[r] = kernels::round_row16(xq + r * ldq, x + r * ldx, in);
    std::fill(xq + r * ldq + in, xq + (r + 1) * ldq, int16_t(0));
  }
}

// The 16-bit rows of x: [M][ldq], ldq a multiple of 32 (the widest SIMD step of the head).
struct Rows16 {
  std::vector<int16_t> q;
  float step[kGemvMaxRows];
  int64_t ld;
};
Rows16& rows16(const float* x, int64_t ldx, int64_t M, int64_t in) {
  thread_local Rows16 r;
  r.ld = (in + 31) / 32 * 32;
  r.q.resize(size_t(M * r.ld));
  quantize_rows16(r.q.data(), r.ld, r.step, x, ldx, M, in);
  return r;
}

// A prompt's rows of x as the int8 GEMVs read them: 16-bit fixed point, widened back to fp32
// (step * xq, one rounding), so that a prompt and its decode steps compute the same product.
const float* rows16_as_fp32(const float* x, int64_t ldx, int64_t N, int64_t in) {
  thread_local std::vector<float> out;
  thread_local std::vector<int16_t> q;
  out.resize(size_t(N * in));
  q.resize(size_t(in));
  for (int64_t r = 0; r < N; ++r) {
    float step;
    quantize_rows16(q.data(), in, &step, x + r * ldx, ldx, 1, in);
    for (int64_t k = 0; k < in; ++k) out[size_t(r * in + k)] = step * float(q[size_t(k)]);
  }
  return out.data();
}

// y = (accumulate ? y : 0) + b + scale * (step * S) on int8 weights in panels, S the exact sum
// of xq q, computed per panel: no partials, no second phase, and the bits do not depend on how
// the panels are shared.
void nn_i8(float* y, const float* x, const int8_t* q, const float* scale, const float* b,
           int64_t M, int64_t in, int64_t out, bool accumulate, Strides ld) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  check_panels(out, ld);
  if (M == 0 || out == 0) return;
  SIGMA_CHECK(in < (int64_t(1) << 28), "gemv: {} inputs (at most 2^28)", in);  // |S| < 2^51
  const int64_t ldx = ld.x ? ld.x : in, ldy = ld.y ? ld.y : out, pairs = (in + 1) / 2;
  const Rows16& xq = rows16(x, ldx, M, in);
  for_each_panel(q, in, out, 2 * pairs, [&](int64_t c0, int64_t width) {
    int64_t total[kGemvMaxRows * kPanelColumns];
    with_rows<NPI8::K>(M, total, xq.q.data(), xq.ld, q + kernels::i8_elements(in, c0), width, pairs);
    for (int64_t r = 0; r < M; ++r) {
      float* row = y + r * ldy + c0;
      for (int64_t j = 0; j < width; ++j)
        row[j] = (accumulate ? row[j] : 0.0f) + (b ? b[c0 + j] : 0.0f) +
                 scale[c0 + j] * (xq.step[r] * kernels::exact_to_float(total[r * kPanelColumns + j]));
    }
  });
}

// y = scale * (step * S) over the head's rows of q[out, in] (a scale per row).
void nt_i8(float* y, const float* x, const int8_t* q, const float* scale, int64_t M, int64_t in,
           int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  SIGMA_CHECK(M >= 0 && M <= kGemvMaxRows, "gemv: {} rows (at most {})", M, kGemvMaxRows);
  if (M == 0 || out == 0) return;
  SIGMA_CHECK(in < (int64_t(1) << 28), "gemv: {} inputs (at most 2^28)", in);  // |S| < 2^51
  const Rows16& xq = rows16(x, ldx, M, in);
  for_each_head_run(q, in, out, ldw, 1, [&](Range rows) {
    with_rows<NTI8::K>(M, y, ldy, xq.q.data(), xq.ld, xq.step, q, ldw, scale, in, rows);
  });
}

// Prompts (more than kGemvMaxRows rows, or any rows outside a decode step) on bf16 and int8
// copies: oneDNN on the weights widened a block of about kPanelFloats at a time (linear_panels),
// so that no fp32 copy of a large matrix is ever held (a served model keeps only its inference
// weights). 4 MiB blocks (a whole matrix at d = 512) made a 12-token prompt's first token
// 1.5-1.7x as fast as 512 KiB ones (fewer oneDNN calls; Zen 3); the head's blocks too.
constexpr int64_t kPanelFloats = int64_t(1) << 20;

// The panel of a linear's w[in, out] in panels (kernels/types.h) whose first column is c0
// (`width` columns) into rows of dst, ld apart, as fp32: fp32, bf16, or int8 with a scale per
// column. Row by row as the panel lies (an index computed per element made a 12-token prompt on
// fp32 panels take 3x as long as on rows).
void unpack_panel(float* dst, int64_t ld, const float* w, const float*, int64_t c0, int64_t width, int64_t in) {
  const float* t = w + c0 * in;
  for (int64_t i = 0; i < in; ++i) std::memcpy(dst + i * ld, t + i * width, size_t(width) * sizeof(float));
}
void unpack_panel(float* dst, int64_t ld, const uint16_t* w, const float*, int64_t c0, int64_t width, int64_t in) {
  const uint16_t* t = w + c0 * in;
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < width; ++j) dst[i * ld + j] = from_bf16(t[i * width + j]);
}
void unpack_panel(float* dst, int64_t ld, const int8_t* w, const float* scale, int64_t c0, int64_t width, int64_t in) {
  const int8_t* t = w + kernels::i8_elements(in, c0);  // pair rows of 2 width bytes
  for (int64_t i = 0; i < in; ++i) {
    const int8_t* pair = t + (i / 2) * 2 * width + (i & 1);
    for (int64_t j = 0; j < width; ++j) dst[i * ld + j] = scale[c0 + j] * float(pair[2 * j]);
  }
}
// Element (j, k) of the head's w[out, in]: bf16, or int8 rows with a scale per row.
inline float widen_head(const uint16_t* w, const float*, int64_t j, int64_t k, int64_t ld) {
  return from_bf16(w[j * ld + k]);
}
inline float widen_head(const int8_t* w, const float* scale, int64_t j, int64_t k, int64_t ld) {
  return scale[j] * float(w[j * ld + k]);
}

// y[N, out] (+)= x @ w[in, out] + b on weights in panels (ld.w 0 or out): blocks of whole
// panels, about kPanelFloats weights, each widened to fp32 and a whole reduction over in. A
// prompt's chunk (inside a decode step) widens them as panels, which oneDNN reads in place
// (linear_forward_panels); elsewhere (eval) they go back in rows for gemm (cpu/gemm.cpp), whose
// row tiles inside ops::BatchInvariant keep a row's bits whatever the rows beside it.
template <class W>
void linear_panels(float* y, const float* x, const W* w, const float* scale, const float* b,
                   int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld) {
  const int64_t ldy = ld.y ? ld.y : out;
  const int64_t cols = std::max(kPanelColumns, kPanelFloats / std::max<int64_t>(in, 1) / kPanelColumns * kPanelColumns);
  const bool as_panels = ops::FewRowKernels::on();
  thread_local std::vector<float> block;
  block.resize(size_t(in * std::min(cols, out)));
  for (int64_t j0 = 0; j0 < out; j0 += cols) {
    const int64_t n = std::min(cols, out - j0);
    float* dst = block.data();  // the calling thread's (thread_local) block, widened by the team
    const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
    parallel_for(panels, !omp_in_parallel() && n * in >= kParallelFloats, [&](int64_t p) {
      const int64_t c0 = j0 + p * kPanelColumns, width = std::min(kPanelColumns, out - c0);
      if (as_panels)
        unpack_panel(dst + (c0 - j0) * in, width, w, scale, c0, width, in);
      else
        unpack_panel(dst + (c0 - j0), n, w, scale, c0, width, in);
    });
    if (as_panels)
      linear_forward_panels(y + j0, x, dst, b ? b + j0 : nullptr, N, in, n, accumulate, {ld.x, 0, ldy});
    else
      linear_forward(y + j0, x, dst, b ? b + j0 : nullptr, N, in, n, accumulate, {ld.x, n, ldy});
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
        panel[size_t(j * in + k)] = widen_head(w, scale, j0 + j, k, ldw);
    gemm(false, true, N, n, in, 1.0f, x, ldx, panel.data(), in, 0.0f, y + j0, ldy);
  }
}

}  // namespace

bool gemv_isa_available(GemvIsa isa) { return isa == GemvIsa::Best || cpu_has(isa); }
void gemv_use_isa(GemvIsa isa) {
  SIGMA_CHECK(gemv_isa_available(isa), "gemv: this CPU cannot run the {} kernels", gemv_isa_name(isa));
  g_isa = isa;
}
GemvIsa gemv_isa() { return resolve(g_isa); }
const char* gemv_isa_name(GemvIsa isa) {
  switch (isa) {
    case GemvIsa::Best: return "best";
    case GemvIsa::Avx512Vnni: return "avx512vnni";
    case GemvIsa::Avx512: return "avx512";
    case GemvIsa::Avx2: return "avx2";
    case GemvIsa::Portable: return "portable";
  }
  return "?";
}

void gemv_nn(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t in,
             int64_t out, bool accumulate, Strides ld) {
  nn(y, x, w, b, M, in, out, accumulate, ld);
}
void gemv_nn(float* y, const float* x, const uint16_t* w, const float* b, int64_t M, int64_t in,
             int64_t out, bool accumulate, Strides ld) {
  nn_panels(y, x, w, b, M, in, out, accumulate, ld);
}
void gemv_nn_panels(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t in,
                    int64_t out, bool accumulate, Strides ld) {
  nn_panels(y, x, w, b, M, in, out, accumulate, ld);
}
void gemv_nn(float* y, const float* x, const int8_t* q, const float* scale, const float* b,
             int64_t M, int64_t in, int64_t out, bool accumulate, Strides ld) {
  nn_i8(y, x, q, scale, b, M, in, out, accumulate, ld);
}
void gemv_nt(float* y, const float* x, const float* w, int64_t M, int64_t in, int64_t out,
             int64_t ldx, int64_t ldw, int64_t ldy) {
  nt(y, x, w, M, in, out, ldx, ldw, ldy);
}
void gemv_nt(float* y, const float* x, const uint16_t* w, int64_t M, int64_t in, int64_t out,
             int64_t ldx, int64_t ldw, int64_t ldy) {
  nt(y, x, w, M, in, out, ldx, ldw, ldy);
}
void gemv_nt(float* y, const float* x, const int8_t* q, const float* scale, int64_t M, int64_t in,
             int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  nt_i8(y, x, q, scale, M, in, out, ldx, ldw, ldy);
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

// The products on inference copies take the GEMVs where gemm_rows and linear_forward_rows do: a
// decode step's few rows (ops::FewRowKernels); elsewhere oneDNN: a prompt's chunk on the panels
// (fp32 in place, bf16 and int8 widened as panels), eval on the copy put back in rows for gemm,
// so that a row's bits do not depend on the rows beside it (gemm's row tiles).
namespace {
bool few_rows(int64_t N) { return N <= kGemvMaxRows && ops::FewRowKernels::on(); }
}  // namespace

void linear_forward_w16(float* y, const float* x, const uint16_t* w16, const float* b, int64_t N,
                        int64_t in, int64_t out, bool accumulate, Strides ld) {
  if (few_rows(N)) return gemv_nn(y, x, w16, b, N, in, out, accumulate, ld);
  check_panels(out, ld);
  linear_panels(y, x, w16, nullptr, b, N, in, out, accumulate, ld);
}

// A prompt's chunk (inside a decode step) reads the panels in place: putting them back in rows
// took longer than its product at 64 rows (matmul.h). Elsewhere (eval) they go back in rows for
// gemm's row tiles (linear_panels).
void linear_forward_f32_panels(float* y, const float* x, const float* w, const float* b, int64_t N,
                               int64_t in, int64_t out, bool accumulate, Strides ld) {
  if (few_rows(N)) return gemv_nn_panels(y, x, w, b, N, in, out, accumulate, ld);
  check_panels(out, ld);
  if (ops::FewRowKernels::on()) return linear_forward_panels(y, x, w, b, N, in, out, accumulate, ld);
  linear_panels(y, x, w, nullptr, b, N, in, out, accumulate, ld);
}

void gemm_nt_w16(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                 int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  if (few_rows(N)) return gemv_nt(y, x, w16, N, in, out, ldx, ldw, ldy);
  if (N == 0 || out == 0) return;
  nt_panels(y, x, w16, nullptr, N, in, out, ldx, ldw, ldy);
}

void linear_forward_i8(float* y, const float* x, const int8_t* q, const float* scale,
                       const float* b, int64_t N, int64_t in, int64_t out, bool accumulate,
                       Strides ld) {
  if (few_rows(N)) return gemv_nn(y, x, q, scale, b, N, in, out, accumulate, ld);
  check_panels(out, ld);
  linear_panels(y, rows16_as_fp32(x, ld.x ? ld.x : in, N, in), q, scale, b, N, in, out, accumulate,
                {in, ld.w, ld.y});
}

void gemm_nt_i8(float* y, const float* x, const int8_t* q, const float* scale, int64_t N,
                int64_t in, int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  if (few_rows(N)) return gemv_nt(y, x, q, scale, N, in, out, ldx, ldw, ldy);
  if (N == 0 || out == 0) return;
  nt_panels(y, rows16_as_fp32(x, ldx, N, in), q, scale, N, in, out, in, ldw, ldy);
}

}  // namespace sigma::cpu
