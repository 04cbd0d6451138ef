// The ops front (DESIGN §8; docs/ops.md): the one dispatch point between the model and the
// kernels. Every op the model runs on activations and parameters has a free function here with
// exactly the signature of its cpu:: kernel (outputs, then saved values, then inputs, then
// sizes), and each call goes through one function pointer of the active Backend. Backends live
// in their own folders (kernels/cpu/: the fast kernels; kernels/ref/: naive loops with double
// accumulation, the tests' oracle) and are chosen once, at start-up, with use_backend.
//
// Gradient contract, for every backend (kernels/cpu/contract.h states it for the cpu kernels):
//   - forward functions overwrite their outputs and save what backward needs;
//   - backward functions ACCUMULATE (+=) into every gradient they write, parameter and
//     activation gradients alike; the caller zeroes gradient buffers once per step;
//   - argument order: outputs, then saved values, then inputs, then sizes.
// use_backend is not thread-safe: call it before any kernel runs (or between runs, in tests).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "kernels/types.h"

namespace sigma::ops {

using kernels::AttnGrad;
using kernels::AttnOperand;
using kernels::AttnOperand16;
using kernels::AttnShape;
using kernels::i8_elements;
using kernels::i8_index;
using kernels::kLayerNormEps;
using kernels::Precision;
using kernels::Strides;

// One backend: a table of function pointers, one per op. A backend's memory is `device`'s;
// alloc returns zeroed, 64-byte aligned memory (never null; throws std::bad_alloc).
struct Backend {
  const char* name;
  Device device;
  void* (*alloc)(size_t bytes);
  void (*free)(void* p);
  // Transfers in bytes (no overlap): host memory -> this device, this device -> host memory,
  // and within this device. A host backend's are memcpy; the only ways host code reaches
  // device memory (ops::upload, ops::download, ops::to_host below).
  void (*upload)(void* dst, const void* host_src, size_t bytes);
  void (*download)(void* host_dst, const void* src, size_t bytes);
  void (*copy_bytes)(void* dst, const void* src, size_t bytes);
  // True for an address in this device's memory, which host code may not dereference (not an
  // op: no device work). Null in a host backend, whose device memory is host memory.
  bool (*owns)(const void* p) = nullptr;
  // Readies the kernels' one-time set-up (cpu: oneDNN generates its sgemm code on the first
  // product, ~25-30 ms on Zen 3) so that a command can overlap it with loading a checkpoint
  // (warm_up_in_background below). Null where there is none.
  void (*warm_up)() = nullptr;

  // ---- dense algebra (kernels/cpu/gemm.h) ----
  // C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C (row-major; beta = 0 ignores C).
  void (*gemm)(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc);
  // y[N,out] (+)= x[N,in] @ w[in,out] + b (b may be null).
  void (*linear_forward)(float* y, const float* x, const float* w, const float* b, int64_t N,
                         int64_t in, int64_t out, bool accumulate, Strides ld);
  // dx (may be null) += dy w^T, dw += x^T dy, db (may be null) += column sums of dy.
  void (*linear_backward)(float* dx, float* dw, float* db, const float* dy, const float* x,
                          const float* w, int64_t N, int64_t in, int64_t out, Strides ld);
  // The same three with both GEMM inputs rounded to bf16 (nearest even) and fp32 accumulation:
  // the products of two bf16 values are exact in fp32, so only the sums round. The bias, the
  // accumulated y and the gradients' initial values stay fp32.
  void (*gemm_bf16)(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                    float* C, int64_t ldc);
  void (*linear_forward_bf16)(float* y, const float* x, const float* w, const float* b,
                              int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld);
  void (*linear_backward_bf16)(float* dx, float* dw, float* db, const float* dy, const float* x,
                               const float* w, int64_t N, int64_t in, int64_t out, Strides ld);
  // db[C] += column sums of dy[N,C] with row stride ld (0 = C).
  void (*column_sum_accumulate)(float* db, const float* dy, int64_t N, int64_t C, int64_t ld);
  // Inference on an fp32 copy (Model::use_weights): linear_forward with w[in,out] in column
  // panels (kernels::panel_index; ld.w 0), the same values as linear_forward's:
  void (*linear_forward_f32_panels)(float* y, const float* x, const float* w, const float* b,
                                    int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld);
  // Inference on bf16 weight copies (Model::use_weights; kernels/cpu/gemv.h): the weights
  // are bf16 values, widened exactly; x, b, the products and the sums stay fp32.
  // linear_forward with w16[in,out] in column panels (kernels::panel_index; ld.w 0):
  void (*linear_forward_w16)(float* y, const float* x, const uint16_t* w16, const float* b,
                             int64_t N, int64_t in, int64_t out, bool accumulate, Strides ld);
  // y[N,out] = x[N,in] @ w16[out,in]^T (the tied head on bf16 embedding rows):
  void (*gemm_nt_w16)(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                      int64_t out, int64_t ldx, int64_t ldw, int64_t ldy);
  // Inference on int8 weights with per-output-channel scales (Model::use_weights; kernels/cpu/
  // int8.h): w = scale * q, q in [-127, 127]. A product is scale[j] * (sum_k x[k] q[k,j]), then
  // the bias. The cpu backend first rounds each row of x to 16-bit fixed point (step max|x| /
  // 32767: an error of at most half a step per element); a few rows (decoding) then sum
  // exactly in integers, more rows (a prompt) in fp32 (kernels/cpu/gemv.h).
  // linear_forward with q[in,out] in panels of row pairs (kernels::i8_index; ld.w 0) and scale[out]:
  void (*linear_forward_i8)(float* y, const float* x, const int8_t* q, const float* scale,
                            const float* b, int64_t N, int64_t in, int64_t out, bool accumulate,
                            Strides ld);
  // y[N,out] = x[N,in] @ (scale * q)[out,in]^T, one scale per row of q (the tied head):
  void (*gemm_nt_i8)(float* y, const float* x, const int8_t* q, const float* scale, int64_t N,
                     int64_t in, int64_t out, int64_t ldx, int64_t ldw, int64_t ldy);

  // ---- layers (kernels/cpu/{layernorm,attention,activation,xent,embedding}.h) ----
  void (*layernorm_forward)(float* out, float* mean, float* rstd, const float* x, const float* w,
                            const float* b, int64_t N, int64_t C);
  void (*layernorm_backward)(float* dx, float* dw, float* db, const float* dout, const float* x,
                             const float* mean, const float* rstd, const float* w, int64_t N,
                             int64_t C);
  void (*attention_forward)(float* out, float* probs, AttnOperand q, AttnOperand k, AttnOperand v,
                            AttnShape s, float scale);
  void (*attention_backward)(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                             const float* out, const float* probs, AttnOperand q, AttnOperand k,
                             AttnOperand v, AttnShape s, float scale);
  // The same attention saving lse[B,H,Tq] (log-sum-exp per row) instead of probs[B,H,Tq,Tk]:
  // no [Tq, Tk] buffer; the backward recomputes the probabilities (kernels/cpu/attention.h).
  void (*flash_attention_forward)(float* out, float* lse, AttnOperand q, AttnOperand k,
                                  AttnOperand v, AttnShape s, float scale);
  void (*flash_attention_backward)(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                                   const float* out, const float* lse, AttnOperand q,
                                   AttnOperand k, AttnOperand v, AttnShape s, float scale);
  // The flash pair with every product on bf16 inputs (fp32 accumulation; softmax, lse and dS
  // in fp32, the probabilities and dS rounded to bf16 for the products that read them).
  void (*flash_attention_forward_bf16)(float* out, float* lse, AttnOperand q, AttnOperand k,
                                       AttnOperand v, AttnShape s, float scale);
  void (*flash_attention_backward_bf16)(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                                        const float* out, const float* lse, AttnOperand q,
                                        AttnOperand k, AttnOperand v, AttnShape s, float scale);
  // flash_attention_forward (fp32, whatever the precision) reading keys and values kept in
  // bf16 (a KV cache of half the bytes: Model::use_kv_cache), widened exactly where read (a
  // prompt's row blocks: per block, first): on every path the bits of the fp32 op given the
  // widened keys and values.
  void (*attention_forward_kv16)(float* out, float* lse, AttnOperand q, AttnOperand16 k,
                                 AttnOperand16 v, AttnShape s, float scale);
  void (*fast_gelu_forward)(float* y, const float* x, int64_t n);
  // dx = dy * FastGelu'(x), written (not added); dx may be dy (in place: ffn_backward).
  void (*fast_gelu_backward)(float* dx, const float* dy, const float* x, int64_t n);
  void (*softmax_xent)(float* logits, float* loss, const int32_t* targets,
                       const float* grad_scale, int64_t N, int64_t V);
  // Vocabulary-parallel softmax cross-entropy in two parts around one exchange of the group's
  // stats[P, N, 3] (kernels/cpu/xent.h): no rank holds a whole row of logits.
  void (*xent_partial)(float* stats, const float* logits, const int32_t* targets, int64_t v0,
                       int64_t N, int64_t V);
  void (*xent_combine)(float* logits, float* loss, const float* stats, const int32_t* targets,
                       const float* grad_scale, int64_t v0, int64_t P, int64_t N, int64_t V);
  void (*embedding_forward)(float* out, const int32_t* rows, const float* table, const float* pos,
                            int64_t B, int64_t T, int64_t d);
  void (*embedding_backward)(float* dtable, float* dpos, const float* dout, const int32_t* rows,
                             int64_t B, int64_t T, int64_t d);
  // embedding_forward on a bf16 table (widened exactly), and on an int8 table with one scale
  // per row: out = scale[row] * q[row, :] + pos.
  void (*embedding_forward_w16)(float* out, const int32_t* rows, const uint16_t* table,
                                const float* pos, int64_t B, int64_t T, int64_t d);
  void (*embedding_forward_i8)(float* out, const int32_t* rows, const int8_t* q,
                               const float* scale, const float* pos, int64_t B, int64_t T,
                               int64_t d);

  // ---- optimizer (kernels/types.h states the formula) ----
  void (*adam_step)(float* w, float* m, float* v, const float* g, int64_t n,
                    const AdamStepArgs& a);

  // ---- bf16 weight copies (null in a backend that converts nothing ahead) ----
  // Registers [p, p + n) as unchanged until the next clear: the *_bf16 ops may convert it to
  // bf16 once and reuse the copy (kernels/cpu/matmul.h).
  void (*bf16_mirror_add)(const float* p, int64_t n);
  void (*bf16_mirror_clear)();
  // Ends the promise for the range registered at p before the clear: its last read is done
  // and the caller writes it next (later products convert it per call). Unregistered: no-op.
  void (*bf16_mirror_drop)(const float* p);

  // ---- data movement on activations ----
  void (*copy)(float* dst, const float* src, int64_t n);    // dst = src (no overlap)
  void (*fill)(float* dst, float value, int64_t n);         // dst = value
  void (*add_into)(float* dst, const float* src, int64_t n);  // dst += src
  // dst[j] = src[order[j]] for N rows of width d.
  void (*gather_rows)(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d);
  // dst[order[j]] = src[j] (or += with accumulate); order holds no repeats.
  void (*scatter_rows)(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d,
                       bool accumulate);

  // ---- reductions and conversions (issue 25: the engine's host loops, now ops) ----
  // The sum of x[i]^2 in double, in fixed chunks of 2^14 elements (lanes of 16 inside a chunk,
  // chunks added in order): the same bits for any thread count. The result is returned to the
  // host (a reduction's one scalar).
  double (*sum_sq)(const float* x, int64_t n);
  // dst[i] = x[i] rounded to bf16 (nearest even; core/bf16.h): the inference weight copies.
  void (*convert_bf16)(uint16_t* dst, const float* x, int64_t n);
  // A linear's copy: w[in, out] (rows ld apart) rounded as convert_bf16 into dst's column panels
  // (kernels::panel_index), the layout the *_w16 linears read.
  void (*convert_bf16_panels)(uint16_t* dst, const float* w, int64_t in, int64_t out, int64_t ld);
  // The same without rounding: w's fp32 values in dst's column panels (linear_forward_f32_panels).
  void (*convert_f32_panels)(float* dst, const float* w, int64_t in, int64_t out, int64_t ld);
  // Symmetric int8 quantisation of w[rows, cols] (rows ld apart) with one scale per column
  // (per_row false: the output channels of a linear's w[in,out], written in panels of row pairs,
  // kernels::i8_index: q holds kernels::i8_elements(rows, cols)) or per row (the embedding
  // table's rows, q[rows, cols]):
  // scale = max |w| / 127 over the channel, q = w / scale rounded to nearest even (a channel of
  // zeros: scale 0, q 0). Returns the number of non-finite weights (their channels get scale 0).
  int64_t (*quantize_i8)(int8_t* q, float* scale, const float* w, int64_t rows, int64_t cols,
                         int64_t ld, bool per_row);

  // ---- the learned gate (model/gate.h states the maths; kernels/cpu/gate.h) ----
  // Per row r of group width K = width[r] (<= Kmax): probs[r] = softmax(z[r, :K]) (fp32), then
  // top-k of probs (ties: the lower index): choice[r,0] = base[r] + e1 and, with k = 2 and
  // K > 1, choice[r,1] = base[r] + e2 (else -1); gate[r,:] the combine weights (top-1: p[e1];
  // top-2: p[e]/(p1+p2); a group of one expert under top-2: 1).
  void (*gate_softmax_topk)(float* probs, int32_t* choice, float* gate, const float* z,
                            const int32_t* width, const int32_t* base, int k, int64_t N,
                            int64_t Kmax);
  // y[r] += gate[r,s] * yg[pos[r,s]] for each kept choice (pos >= 0), rows of width d.
  void (*gate_combine)(float* y, const float* yg, const float* gate, const int32_t* pos,
                       int64_t N, int64_t d);
  // Backward of the combine: gdy[pos[r,s]] = gate[r,s] * dy[r] and dgate[r,s] = dy[r].yg[pos]
  // (0 where the choice is not kept); dx[r] is not touched (gate_backward_dz's job).
  void (*gate_expert_dy)(float* gdy, float* dgate, const float* dy, const float* yg,
                         const float* gate, const int32_t* pos, int64_t N, int64_t d);
  // dx[r] += gdx[pos[r,s]] over kept choices, and dz[r, :K] (overwritten; 0 beyond K) = the
  // softmax backward of dp, where dp = d(loss)/d(gate weight) through the combine plus
  // aux[choice base + e] (the load-balancing term per expert, already scaled).
  void (*gate_backward_dz)(float* dx, float* dz, const float* gdx, const float* dgate,
                           const float* probs, const int32_t* choice, const int32_t* pos,
                           const int32_t* width, const int32_t* base, const float* aux,
                           int k, int64_t N, int64_t d, int64_t Kmax);
};

enum class BackendKind : uint8_t { Cpu, Ref, Guard };

const Backend& backend(BackendKind kind);  // the built-in tables
const Backend& active_backend();
// The backends' names ("cpu", "ref", "guard"): the choices of train.backend and --backend, so
// a new backend is registered here only. backend_names joins them for help texts and errors.
std::vector<std::string> backend_list();
std::string backend_names();

// Chooses the backend every ops:: call runs on. The name form throws sigma::Error for a name
// that is not a backend, listing the known ones. With the environment variable
// SIGMA_TEST_BACKEND=guard (the tests' guard job, docs/ops.md), every choice of the cpu backend,
// the start-up default included, installs the guard backend instead: the same kernels, over
// memory host code cannot touch.
void use_backend(BackendKind kind);
void use_backend(std::string_view name);
// Installs any table (tests: a cpu backend with one op perturbed). `b` must outlive its use.
void use_backend(const Backend& b);

// Runs the active backend's warm_up on a thread of its own; joining the thread (its destructor
// does) waits for it. generate and serve start it before loading the checkpoint: a fresh
// process's first prompt of more than a few tokens had paid oneDNN's set-up inside its first
// token's time.
std::jthread warm_up_in_background();

// The precision of gemm, linear_forward, linear_backward and the flash attention pair below
// (train.precision): Bf16 sends them to the backend's *_bf16 ops. Softmax, LayerNorm, the loss
// and the optimizer stay fp32. Set once at start-up, like the backend.
void use_precision(Precision p);
void use_precision(std::string_view name);  // "fp32" or "bf16"; throws sigma::Error otherwise
Precision precision();

// Products of a few rows may run on kernels tuned for them (the cpu backend's GEMVs, which give
// a row other bits than the many-row product) only inside a FewRowKernels scope: a decode step
// (Model::forward_cached) opens one. Everywhere else (eval, training) a row's bits do not
// depend on how many rows share its product, so losses are batch-invariant. Process-wide while
// a scope is open (a decode step's products also run on OpenMP workers).
class FewRowKernels {
 public:
  FewRowKernels();
  ~FewRowKernels();
  FewRowKernels(const FewRowKernels&) = delete;
  FewRowKernels& operator=(const FewRowKernels&) = delete;
  static bool on();  // false inside a BatchInvariant scope

 private:
  bool prev_;
};

// Scoring (eval's log-likelihoods) needs a position's bits to depend only on its own row's
// tokens: not on the other rows of the pass, nor on how many positions the pass computes, nor
// on whether the row's earlier positions come from a KV cache. Inside a BatchInvariant scope
// FewRowKernels is off (even inside a decode step) and the cpu backend's fp32 attention runs
// its per-row kernel for every shape (each query row's scores, softmax and sum over the values
// in one fixed order). With oneDNN's row invariance at >= 16 rows (cpu/gemm.cpp pads fewer) a
// row's loss is then bit-identical whatever batch it is scored in (src/eval/tasks.cpp).
// Process-wide, like FewRowKernels.
class BatchInvariant {
 public:
  BatchInvariant();
  ~BatchInvariant();
  BatchInvariant(const BatchInvariant&) = delete;
  BatchInvariant& operator=(const BatchInvariant&) = delete;
  static bool on();
};

namespace detail {
extern const Backend* active;  // never null; the cpu backend until use_backend says otherwise
extern Precision precision;    // Fp32 until use_precision says otherwise
inline bool bf16() { return precision == Precision::Bf16; }
}

// ---- the front: one inline forwarding function per op, signatures as in kernels/cpu/ ----

inline void* alloc(size_t bytes) { return detail::active->alloc(bytes); }
inline void free(void* p) { detail::active->free(p); }

// ---- tensors on the active backend's device, and the host <-> device boundary ----
// Engine tensors (parameters, gradients, optimizer state, activations) live on device();
// host memory that stays on the host (data, the expert store, checkpoint files, plans) is a
// Host tensor or a std::vector. Host code reads or writes device tensors only through these.
Device device();                                   // the active backend's device
Tensor empty(DType dtype, Shape shape);            // zeroed, on device()
Tensor to_device(const Tensor& host);              // a copy on device()
Tensor to_host(const Tensor& t);                   // a Host copy of a tensor on any device
Tensor clone(const Tensor& t);                     // a copy on t's device
void zero(Tensor& t);                              // any device
// zero(t), and host memory's whole pages handed back to the system (madvise): they read as
// zeros and take no memory until written again (ZeRO-2's gradients of other ranks' tensors).
void zero_release(Tensor& t);
// The same for elements [begin, end) of an F32 tensor (a stage's piece of it).
void zero_release(Tensor& t, int64_t begin, int64_t end);
// A hint that host memory's whole 2 MiB ranges in t be backed by transparent huge pages
// (madvise MADV_HUGEPAGE, then MADV_COLLAPSE for the pages already touched): a decode step
// streams every weight once, and with 4 KiB pages a sequential read of them is slower (one
// TLB miss and a new hardware-prefetch stream every 4 KiB; issue 40). Returns the bytes now in
// huge-page ranges it asked for (0 where the system refuses, or not on the host: nothing done).
size_t advise_huge_pages(Tensor& t);
// Host bytes into / out of any tensor at a byte offset (bounds checked).
void upload(Tensor& dst, const void* host_src, size_t bytes, size_t offset = 0);
void download(void* host_dst, const Tensor& src, size_t bytes, size_t offset = 0);
// Raw pointers on the active backend's device (the expert executor's compute buffers).
inline void upload(void* dst, const void* host_src, size_t bytes) {
  detail::active->upload(dst, host_src, bytes);
}
inline void download(void* host_dst, const void* src, size_t bytes) {
  detail::active->download(host_dst, src, bytes);
}
inline void copy_bytes(void* dst, const void* src, size_t bytes) {
  detail::active->copy_bytes(dst, src, bytes);
}
// True when p is the active backend's device memory that host code may not touch: what a
// host-side consumer of a buffer of either kind (the communicators, dist/communicator.h) asks
// before it stages the buffer through download/upload. Always false on a host backend.
inline bool is_device(const void* p) { return detail::active->owns && detail::active->owns(p); }

inline void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                 int64_t ldc) {
  (detail::bf16() ? detail::active->gemm_bf16 : detail::active->gemm)(
      trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void linear_forward(float* y, const float* x, const float* w, const float* b, int64_t N,
                           int64_t in, int64_t out, bool accumulate = false, Strides ld = {}) {
  (detail::bf16() ? detail::active->linear_forward_bf16 : detail::active->linear_forward)(
      y, x, w, b, N, in, out, accumulate, ld);
}
inline void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                            const float* w, int64_t N, int64_t in, int64_t out, Strides ld = {}) {
  (detail::bf16() ? detail::active->linear_backward_bf16 : detail::active->linear_backward)(
      dx, dw, db, dy, x, w, N, in, out, ld);
}
// The bf16 ops by name, whatever the precision (tests, benchmarks).
inline void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                      const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                      float* C, int64_t ldc) {
  detail::active->gemm_bf16(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void linear_forward_bf16(float* y, const float* x, const float* w, const float* b,
                                int64_t N, int64_t in, int64_t out, bool accumulate = false,
                                Strides ld = {}) {
  detail::active->linear_forward_bf16(y, x, w, b, N, in, out, accumulate, ld);
}
inline void linear_backward_bf16(float* dx, float* dw, float* db, const float* dy,
                                 const float* x, const float* w, int64_t N, int64_t in,
                                 int64_t out, Strides ld = {}) {
  detail::active->linear_backward_bf16(dx, dw, db, dy, x, w, N, in, out, ld);
}
inline void column_sum_accumulate(float* db, const float* dy, int64_t N, int64_t C,
                                  int64_t ld = 0) {
  detail::active->column_sum_accumulate(db, dy, N, C, ld);
}
inline void linear_forward_f32_panels(float* y, const float* x, const float* w, const float* b,
                                      int64_t N, int64_t in, int64_t out, bool accumulate = false,
                                      Strides ld = {}) {
  detail::active->linear_forward_f32_panels(y, x, w, b, N, in, out, accumulate, ld);
}
inline void linear_forward_w16(float* y, const float* x, const uint16_t* w16, const float* b,
                               int64_t N, int64_t in, int64_t out, bool accumulate = false,
                               Strides ld = {}) {
  detail::active->linear_forward_w16(y, x, w16, b, N, in, out, accumulate, ld);
}
inline void gemm_nt_w16(float* y, const float* x, const uint16_t* w16, int64_t N, int64_t in,
                        int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  detail::active->gemm_nt_w16(y, x, w16, N, in, out, ldx, ldw, ldy);
}
inline void linear_forward_i8(float* y, const float* x, const int8_t* q, const float* scale,
                              const float* b, int64_t N, int64_t in, int64_t out,
                              bool accumulate = false, Strides ld = {}) {
  detail::active->linear_forward_i8(y, x, q, scale, b, N, in, out, accumulate, ld);
}
inline void gemm_nt_i8(float* y, const float* x, const int8_t* q, const float* scale, int64_t N,
                       int64_t in, int64_t out, int64_t ldx, int64_t ldw, int64_t ldy) {
  detail::active->gemm_nt_i8(y, x, q, scale, N, in, out, ldx, ldw, ldy);
}
inline void layernorm_forward(float* out, float* mean, float* rstd, const float* x,
                              const float* w, const float* b, int64_t N, int64_t C) {
  detail::active->layernorm_forward(out, mean, rstd, x, w, b, N, C);
}
inline void layernorm_backward(float* dx, float* dw, float* db, const float* dout,
                               const float* x, const float* mean, const float* rstd,
                               const float* w, int64_t N, int64_t C) {
  detail::active->layernorm_backward(dx, dw, db, dout, x, mean, rstd, w, N, C);
}
inline void attention_forward(float* out, float* probs, AttnOperand q, AttnOperand k,
                              AttnOperand v, AttnShape s, float scale) {
  detail::active->attention_forward(out, probs, q, k, v, s, scale);
}
inline void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                               const float* out, const float* probs, AttnOperand q,
                               AttnOperand k, AttnOperand v, AttnShape s, float scale) {
  detail::active->attention_backward(dq, dk, dv, dout, out, probs, q, k, v, s, scale);
}
inline void flash_attention_forward(float* out, float* lse, AttnOperand q, AttnOperand k,
                                    AttnOperand v, AttnShape s, float scale) {
  (detail::bf16() ? detail::active->flash_attention_forward_bf16
                  : detail::active->flash_attention_forward)(out, lse, q, k, v, s, scale);
}
inline void flash_attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, const float* dout,
                                     const float* out, const float* lse, AttnOperand q,
                                     AttnOperand k, AttnOperand v, AttnShape s, float scale) {
  (detail::bf16() ? detail::active->flash_attention_backward_bf16
                  : detail::active->flash_attention_backward)(dq, dk, dv, dout, out, lse, q, k,
                                                              v, s, scale);
}
inline void attention_forward_kv16(float* out, float* lse, AttnOperand q, AttnOperand16 k,
                                   AttnOperand16 v, AttnShape s, float scale) {
  detail::active->attention_forward_kv16(out, lse, q, k, v, s, scale);
}
// The bf16 pair by name, whatever the precision (tests, benchmarks).
inline void flash_attention_forward_bf16(float* out, float* lse, AttnOperand q, AttnOperand k,
                                         AttnOperand v, AttnShape s, float scale) {
  detail::active->flash_attention_forward_bf16(out, lse, q, k, v, s, scale);
}
inline void flash_attention_backward_bf16(AttnGrad dq, AttnGrad dk, AttnGrad dv,
                                          const float* dout, const float* out, const float* lse,
                                          AttnOperand q, AttnOperand k, AttnOperand v,
                                          AttnShape s, float scale) {
  detail::active->flash_attention_backward_bf16(dq, dk, dv, dout, out, lse, q, k, v, s, scale);
}
// bf16 copies of weights: a no-op for a backend without them.
inline void bf16_mirror_add(const float* p, int64_t n) {
  if (detail::active->bf16_mirror_add) detail::active->bf16_mirror_add(p, n);
}
inline void bf16_mirror_clear() {
  if (detail::active->bf16_mirror_clear) detail::active->bf16_mirror_clear();
}
inline void bf16_mirror_drop(const float* p) {
  if (detail::active->bf16_mirror_drop) detail::active->bf16_mirror_drop(p);
}
inline void fast_gelu_forward(float* y, const float* x, int64_t n) {
  detail::active->fast_gelu_forward(y, x, n);
}
inline void fast_gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
  detail::active->fast_gelu_backward(dx, dy, x, n);
}
inline void softmax_xent(float* logits, float* loss, const int32_t* targets,
                         const float* grad_scale, int64_t N, int64_t V) {
  detail::active->softmax_xent(logits, loss, targets, grad_scale, N, V);
}
inline void xent_partial(float* stats, const float* logits, const int32_t* targets, int64_t v0,
                         int64_t N, int64_t V) {
  detail::active->xent_partial(stats, logits, targets, v0, N, V);
}
inline void xent_combine(float* logits, float* loss, const float* stats, const int32_t* targets,
                         const float* grad_scale, int64_t v0, int64_t P, int64_t N, int64_t V) {
  detail::active->xent_combine(logits, loss, stats, targets, grad_scale, v0, P, N, V);
}
inline void embedding_forward(float* out, const int32_t* rows, const float* table,
                              const float* pos, int64_t B, int64_t T, int64_t d) {
  detail::active->embedding_forward(out, rows, table, pos, B, T, d);
}
inline void embedding_backward(float* dtable, float* dpos, const float* dout,
                               const int32_t* rows, int64_t B, int64_t T, int64_t d) {
  detail::active->embedding_backward(dtable, dpos, dout, rows, B, T, d);
}
inline void embedding_forward_w16(float* out, const int32_t* rows, const uint16_t* table,
                                  const float* pos, int64_t B, int64_t T, int64_t d) {
  detail::active->embedding_forward_w16(out, rows, table, pos, B, T, d);
}
inline void embedding_forward_i8(float* out, const int32_t* rows, const int8_t* q,
                                 const float* scale, const float* pos, int64_t B, int64_t T,
                                 int64_t d) {
  detail::active->embedding_forward_i8(out, rows, q, scale, pos, B, T, d);
}
inline void adam_step(float* w, float* m, float* v, const float* g, int64_t n,
                      const AdamStepArgs& a) {
  detail::active->adam_step(w, m, v, g, n, a);
}
inline void copy(float* dst, const float* src, int64_t n) { detail::active->copy(dst, src, n); }
inline void fill(float* dst, float value, int64_t n) { detail::active->fill(dst, value, n); }
inline void add_into(float* dst, const float* src, int64_t n) {
  detail::active->add_into(dst, src, n);
}
inline void gather_rows(float* dst, const float* src, const int32_t* order, int64_t N,
                        int64_t d) {
  detail::active->gather_rows(dst, src, order, N, d);
}
inline void scatter_rows(float* dst, const float* src, const int32_t* order, int64_t N,
                         int64_t d, bool accumulate) {
  detail::active->scatter_rows(dst, src, order, N, d, accumulate);
}

// ---- reductions, conversions, the learned gate (issue 25) ----
inline double sum_sq(const float* x, int64_t n) { return detail::active->sum_sq(x, n); }
inline void convert_bf16(uint16_t* dst, const float* x, int64_t n) {
  detail::active->convert_bf16(dst, x, n);
}
inline void convert_bf16_panels(uint16_t* dst, const float* w, int64_t in, int64_t out, int64_t ld) {
  detail::active->convert_bf16_panels(dst, w, in, out, ld);
}
inline void convert_f32_panels(float* dst, const float* w, int64_t in, int64_t out, int64_t ld) {
  detail::active->convert_f32_panels(dst, w, in, out, ld);
}
inline int64_t quantize_i8(int8_t* q, float* scale, const float* w, int64_t rows, int64_t cols,
                           int64_t ld, bool per_row) {
  return detail::active->quantize_i8(q, scale, w, rows, cols, ld, per_row);
}
inline void gate_softmax_topk(float* probs, int32_t* choice, float* gate, const float* z,
                              const int32_t* width, const int32_t* base, int k, int64_t N,
                              int64_t Kmax) {
  detail::active->gate_softmax_topk(probs, choice, gate, z, width, base, k, N, Kmax);
}
inline void gate_combine(float* y, const float* yg, const float* gate, const int32_t* pos,
                         int64_t N, int64_t d) {
  detail::active->gate_combine(y, yg, gate, pos, N, d);
}
inline void gate_expert_dy(float* gdy, float* dgate, const float* dy, const float* yg,
                           const float* gate, const int32_t* pos, int64_t N, int64_t d) {
  detail::active->gate_expert_dy(gdy, dgate, dy, yg, gate, pos, N, d);
}
inline void gate_backward_dz(float* dx, float* dz, const float* gdx, const float* dgate,
                             const float* probs, const int32_t* choice, const int32_t* pos,
                             const int32_t* width, const int32_t* base, const float* aux, int k,
                             int64_t N, int64_t d, int64_t Kmax) {
  detail::active->gate_backward_dz(dx, dz, gdx, dgate, probs, choice, pos, width, base, aux, k,
                                   N, d, Kmax);
}

}  // namespace sigma::ops
