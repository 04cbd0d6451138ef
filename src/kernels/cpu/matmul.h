// oneDNN's matmul primitive, created once per shape and cached per thread:
// - bf16 products (avx512_bf16 dot products where the CPU has them; on a CPU where oneDNN has
//   no bf16 product, AVX2 only, the operands widened to fp32 and oneDNN's sgemm: the same
//   numerics, no speed-up): bf16 operands given as strided views, fp32 result and accumulation.
//   The *_bf16 ops of the front (gemm.h, attention.h) convert their fp32 operands with
//   bf16_operand and multiply here.
// - fp32 products on weights in column panels (a prompt's products on decode's fp32 copies).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace sigma::cpu {

// A row-major bf16 matrix: element (r, c) at p[r * ld + c]. `mirror`: set by bf16_operand when
// the view lies in a live mirror (its values fixed until the mirror is dropped), which lets
// matmul_bf16 keep the product's own packed layout of it as B (see there).
struct Bf16View {
  const uint16_t* p;
  int64_t ld;
  const void* mirror = nullptr;
};

// C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] (+ bias[N] on every row) + beta * C (row-major;
// op = transpose when t* is set, i.e. A is stored [K,M] when ta; bias fp32, may be null).
// K = 0 scales C by beta (and adds no bias: callers with a bias have K > 0). Inside an OpenMP
// parallel region the product runs on the calling thread only. A B from the mirror (a weight in
// bf16 training) is reordered once per registration into the layout oneDNN's kernels read and
// kept beside the mirror's copy: with a plain B every call repacks it, per block of rows.
void matmul_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Bf16View A,
                 Bf16View B, float beta, float* C, int64_t ldc, const float* bias = nullptr);

// C[M, N] = A[M, K] @ B + beta * C, B the [K, N] matrix in column panels (kernels::panel_index:
// the columns 64 p.. lie at B + 64 p K, [K, width] row-major) read in place: one batched
// product over the whole panels, each writing its column slice of C, and a plain one for a
// narrower last panel. Putting the panels back in rows for sgemm cost more than the product
// at a prompt chunk's 64 rows; on Zen 3 (oneDNN 2.6) each row's bits are sgemm's on the rows
// up to 256 rows (from 512 sgemm itself changes a row's bits with the row count), but oneDNN
// promises neither: gemv.cpp uses it inside a decode step only (ops::FewRowKernels).
void matmul_f32_panels(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                       const float* B, float beta, float* C, int64_t ldc);

// Whether oneDNN multiplies bf16 on this CPU (AVX-512 or AMX); false on an AVX2-only CPU, where
// matmul_bf16 widens its operands to fp32 and runs sgemm.
bool native_bf16();

// dst[rows, cols] (row stride ldd) = bf16 of src[rows, cols] (row stride lds), round to nearest
// even, NaN kept (sigma::to_bf16, bit for bit). Parallel over rows when large and not nested.
void to_bf16(uint16_t* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows,
             int64_t cols);

// One row of to_bf16, on the calling thread.
void row_to_bf16(uint16_t* dst, const float* src, int64_t n);

// Scratch that only grows: a vector resized down and up again zero-fills each growth, and a
// step's operands alternate sizes (2 M and 8 M elements), a serial pass over megabytes a call.
inline void grow(std::vector<uint16_t>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

// A bf16 view of the fp32 matrix src[rows, cols] (row stride ld): the elements of a registered
// mirror when src lies in one (bf16_mirror_add), else a conversion into buf (grown to fit).
Bf16View bf16_operand(const float* src, int64_t rows, int64_t cols, int64_t ld,
                      std::vector<uint16_t>& buf);

// bf16_operand of a linear layer's dy that also adds its column sums to db[cols] (its bias
// gradient). When dy is converted here the sums ride in the conversion's pass over dy: rows
// summed in order within fixed blocks of 256, the blocks' sums added in order (the same bits
// for any thread count; not column_sum_accumulate's order, which walks each column's rows).
Bf16View bf16_operand_column_sums(const float* src, int64_t rows, int64_t cols, int64_t ld,
                                  std::vector<uint16_t>& buf, float* db);

// The bf16 mirror: fp32 ranges the caller promises not to change until the next clear (the
// model registers its weights for one forward + backward), each converted to bf16 once, on its
// first use, so that the products that read a weight stop converting it per call. Every range
// is dropped by bf16_mirror_clear; a range registered again converts again (the weights changed
// in between, e.g. by the optimizer). add and clear are not thread-safe (call them outside
// parallel regions, as the model does); lookups and conversions are.
void bf16_mirror_add(const float* p, int64_t n);
void bf16_mirror_clear();
// Drops the range registered at p (its copy kept as a spare): the caller is done reading it
// and writes it next, so later products must not read the old copy. Unregistered p: no-op.
void bf16_mirror_drop(const float* p);
// The copy of the live mirror that is exactly [p, p + n), if it has not been converted yet,
// marked converted; null otherwise. The caller is about to write [p, p + n) and writes the bf16
// rounding of each value (to_bf16's bits, row_to_bf16) there too, before any product reads it:
// the conversion then rides in the producer's own pass instead of reading the fp32 values back
// (fast_gelu_forward: an FFN's hidden activations in bf16 training). Outside parallel regions.
uint16_t* bf16_mirror_claim(const float* p, int64_t n);
// Conversions done since the start (tests: a mirrored weight converts once per registration).
int64_t bf16_mirror_conversions();
// Packed copies of mirrored B operands made since the start (matmul_bf16; 0 without native bf16).
int64_t bf16_mirror_packs();
// Copies allocated since the start: a range registered again after a clear, dropped or not,
// reuses its buffer from the registration before (tests).
int64_t bf16_mirror_allocations();

}  // namespace sigma::cpu
