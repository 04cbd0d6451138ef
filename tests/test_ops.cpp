// The ops front's per-backend op test (as ggml's test-backend-ops): every op of kernels/ops.h,
// forward and backward, at odd sizes, run on the cpu backend and on the ref backend from the
// same inputs and compared element by element, and a mutation test that breaks one output of
// one op of the cpu backend at a time and requires the comparison to fail. The finite-difference
// checks, backend selection and the training run on each backend are in test_ops_gradients.cpp;
// the error-bound arithmetic both use is in ops_bound.h.
//
// Tolerance. The ref formulas (kernels/ref/) are templates over their arithmetic type. Here they
// also run with Bound: a value in double plus a first-order bound, in units of u = 2^-24, on
// how far an fp32 evaluation of the same formula can be from that value (running error
// analysis; Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1-3.3):
//  - an fp32 input is exact (bound 0);
//  - a product, quotient or square root: the operands' bounds times the partial derivatives,
//    plus one rounding of the result (|result|);
//  - exp and log: the argument's bound times the derivative, plus 2|result| (the cpu's
//    vectorised exp is within 1e-8 relative, glibc's expf and logf within one ulp);
//  - a sum of n terms in ANY order or blocking (threads, SIMD lanes, GEMM panels, FMAs): the
//    terms' bounds plus (n - 1) * sum_k |term_k| (Higham (3.5): |s_fp32 - s| <= gamma_{n-1}
//    sum |x_k| for every summation order). For a K-term dot product this is the familiar
//    |cpu - ref| <= K u sum_k |a_k b_k|.
// An element's tolerance is u * (2 * bound + |ref|) + 1e-30: the factor 2 covers the dropped
// second-order terms and the cpu's algebraically equal variants of a step (x * (1/z) for x/z);
// |ref| covers the ref's own rounding to fp32. Ops that do not round (copy, fill, gather and
// scatter, add_into's single addition, Adam's fixed fp32 sequence) must agree bit for bit.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/cpu/spin_team.h"
#include "kernels/ops.h"
#include "kernels/ref/attention.h"
#include "kernels/ref/layers.h"
#include "kernels/ref/linear.h"
#include "ops_bound.h"
#include "run/config.h"
#include "train/trainer.h"

using namespace sigma;
using namespace sigma::ops_test;

namespace {

using ops::AttnGrad;
using ops::AttnOperand;
using ops::AttnShape;
using ops::Strides;

// ---- cases -------------------------------------------------------------------------------------


struct Out {
  std::string name;
  std::vector<float> init;  // the buffer before the call (gradients accumulate onto it)
  bool written = true;      // false: an in-out buffer this variant leaves alone
};

struct Case {
  std::string op, label;
  std::vector<Out> outs;
  std::function<void(Outs&)> front;  // the op through ops:: on the active backend
  std::function<void(Outs&)> bound;  // the ref formula with T = Bound; empty: must match exactly
  void (*mutate)(ops::Backend&);     // replaces this op's pointer by its perturbing wrapper
  std::string no_mutation;           // why the mutation test cannot use this case (rare)
  std::string title() const { return op + " " + label; }
};

// The mutation: after the cpu kernel ran, one element of one output changes by 1e-3 relative.
float* g_target = nullptr;

template <auto M>
struct Mutant;
template <class... A, void (*ops::Backend::*M)(A...)>
struct Mutant<M> {
  static void call(A... a) {
    (ops::backend(ops::BackendKind::Cpu).*M)(a...);
    if (g_target) *g_target *= 1.001f;
  }
};
template <auto M>
void mutate(ops::Backend& b) {
  b.*M = &Mutant<M>::call;
}

// body(fn, outs) calls fn, the front's function or the ref formula, with the case's arguments.
template <class Front, class Ref, class Body>
Case make_case(const char* op, void (*mut)(ops::Backend&), Front front, Ref ref, std::string label,
               std::vector<Out> outs, Body body) {
  Case c{op, std::move(label), std::move(outs), {}, {}, mut, {}};
  c.front = [body, front](Outs& o) { body(front, o); };
  if constexpr (!std::is_same_v<Ref, std::nullptr_t>) c.bound = [body, ref](Outs& o) { body(ref, o); };
  return c;
}
#define OP(name) #name, &mutate<&ops::Backend::name>, &ops::name, &ref::name<Bound>
#define EXACT_OP(name) #name, &mutate<&ops::Backend::name>, &ops::name, nullptr

// Outputs of one run of c's front on backend b (g_target: the element a mutant perturbs).
Outs run_front(const Case& c, const ops::Backend& b, int mut_out = -1, size_t mut_idx = 0) {
  Outs o;
  for (const Out& x : c.outs) o.push_back(x.init);
  g_target = mut_out >= 0 ? &o[size_t(mut_out)][mut_idx] : nullptr;
  ops::use_backend(b);
  c.front(o);
  ops::use_backend(ops::BackendKind::Cpu);
  g_target = nullptr;
  return o;
}

struct Reference {
  Outs val;                               // the ref backend's outputs
  std::vector<std::vector<double>> tol;  // per element
};

Reference reference(const Case& c) {
  Reference r;
  r.val = run_front(c, ops::backend(ops::BackendKind::Ref));
  for (size_t k = 0; k < c.outs.size(); ++k) r.tol.emplace_back(c.outs[k].init.size(), 0.0);
  if (!c.bound) return r;  // exact op
  Outs o;
  for (const Out& x : c.outs) o.push_back(x.init);
  const auto sh = run_bound(c.bound, o);
  for (size_t k = 0; k < sh.size(); ++k)
    for (size_t i = 0; i < sh[k].size(); ++i)
      r.tol[k][i] = kU * (2 * sh[k][i].bound() + std::fabs(r.val[k][i])) + kFloor;
  return r;
}

struct Verdict {
  int64_t bad = 0;
  double worst = 0;  // max |cpu - ref| / tol (0 for an exact op that matches)
  std::string first;
};

Verdict compare(const std::vector<float>& got, const std::vector<float>& want,
                const std::vector<double>& tol) {
  Verdict v;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - double(want[i]));
    const bool ok = tol[i] == 0 ? std::memcmp(&got[i], &want[i], 4) == 0 : err <= tol[i];
    if (tol[i] > 0) v.worst = std::max(v.worst, err / tol[i]);
    if (!ok && v.bad++ == 0)
      v.first = fmt::format("[{}]: cpu {} ref {} |diff| {:.3g} tol {:.3g}", i, got[i], want[i], err,
                            tol[i]);
  }
  return v;
}

// The element a mutant perturbs: the largest in magnitude of those the op changed (ties: the
// first). A relative perturbation of an output that is all zeros changes nothing.
size_t mutation_index(const Out& out, const std::vector<float>& ref) {
  size_t best = 0;
  double most = -1;
  for (size_t i = 0; i < ref.size(); ++i)
    if (ref[i] != out.init[i] && std::fabs(ref[i]) > most) most = std::fabs(ref[i]), best = i;
  return best;
}

// ---- the cases ---------------------------------------------------------------------------------

void add_gemm(std::vector<Case>& cs, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
              float alpha, float beta, int64_t pad, uint64_t seed, bool bf16 = false) {
  const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
  const auto A = vec((ta ? K : M) * lda, seed), B = vec((tb ? N : K) * ldb, seed + 1);
  const std::string label = fmt::format("{}{} M={} N={} K={} alpha={} beta={} pad={}",
                                        ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, beta, pad);
  const std::vector<Out> outs = {{"C", vec(M * ldc, seed + 2)}};
  auto body = [=](auto fn, Outs& o) {
    fn(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, o[0].data(), ldc);
  };
  if (bf16)
    cs.push_back(make_case(OP(gemm_bf16), label, outs, body));
  else
    cs.push_back(make_case(OP(gemm), label, outs, body));
}

// strided: the query layer's K|V column slice (x, w, y rows wider than the product).
void add_linear(std::vector<Case>& cs, int64_t N, int64_t in, int64_t out, bool bias, bool acc,
                bool strided, uint64_t seed, bool bf16 = false) {
  const Strides ld = strided ? Strides{in + 3, 3 * out, 2 * out + 1} : Strides{};
  const int64_t ldx = ld.x ? ld.x : in, ldw = ld.w ? ld.w : out, ldy = ld.y ? ld.y : out;
  const int64_t woff = strided ? out : 0, yoff = strided ? 1 : 0;
  const auto x = vec(N * ldx, seed), w = vec(in * ldw, seed + 1, 0.5f), b = vec(out, seed + 2);
  const auto dy = vec(N * ldy, seed + 3);
  const std::string label = fmt::format("N={} in={} out={}{}{}{}", N, in, out, bias ? " bias" : "",
                                        acc ? " accumulate" : "", strided ? " strided" : "");
  const std::vector<Out> fwd_outs = {{"y", vec(N * ldy + yoff, seed + 4)}};
  auto fwd = [=](auto fn, Outs& o) {
    fn(o[0].data() + yoff, x.data(), w.data() + woff, bias ? b.data() : nullptr, N, in, out, acc,
       ld);
  };
  if (bf16)
    cs.push_back(make_case(OP(linear_forward_bf16), label, fwd_outs, fwd));
  else
    cs.push_back(make_case(OP(linear_forward), label, fwd_outs, fwd));
  // Backward: dx present unless `acc` (reusing the flag for the null-dx variant), db with bias.
  const bool with_dx = !acc;
  std::vector<Out> outs = {{"dw", vec(in * ldw, seed + 5)}};
  if (with_dx) outs.push_back({"dx", vec(N * ldx, seed + 6)});
  if (bias) outs.push_back({"db", vec(out, seed + 7)});
  const std::string bwd_label = label + (with_dx ? "" : " dx=null") + (bias ? "" : " db=null");
  auto bwd = [=](auto fn, Outs& o) {
    float* dx = with_dx ? o[1].data() : nullptr;
    float* db = bias ? o[with_dx ? 2 : 1].data() : nullptr;
    fn(dx, o[0].data() + woff, db, dy.data(), x.data(), w.data() + woff, N, in, out, ld);
  };
  if (bf16)
    cs.push_back(make_case(OP(linear_backward_bf16), bwd_label, outs, bwd));
  else
    cs.push_back(make_case(OP(linear_backward), bwd_label, outs, bwd));
}

std::vector<uint16_t> bf16_vec(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<uint16_t> h;
  for (float v : vec(n, seed, scale)) h.push_back(to_bf16(v));
  return h;
}

// linear_forward on bf16 weights (w16[in,out] in panels, kernels::panel_index: no row stride);
// x and y strided as in add_linear.
void add_linear_w16(std::vector<Case>& cs, int64_t N, int64_t in, int64_t out, bool bias, bool acc,
                    bool strided, uint64_t seed) {
  const Strides ld = strided ? Strides{in + 3, 0, 2 * out + 1} : Strides{};
  const int64_t ldx = ld.x ? ld.x : in, ldy = ld.y ? ld.y : out;
  const int64_t yoff = strided ? 1 : 0;
  const auto x = vec(N * ldx, seed), b = vec(out, seed + 2);
  const auto w = bf16_vec(in * out, seed + 1, 0.5f);
  const std::string label = fmt::format("N={} in={} out={}{}{}{}", N, in, out, bias ? " bias" : "",
                                        acc ? " accumulate" : "", strided ? " strided" : "");
  const std::vector<Out> outs = {{"y", vec(N * ldy + yoff, seed + 4)}};
  cs.push_back(make_case(OP(linear_forward_w16), label, outs, [=](auto fn, Outs& o) {
    fn(o[0].data() + yoff, x.data(), w.data(), bias ? b.data() : nullptr, N, in, out, acc, ld);
  }));
}

// linear_forward on fp32 weights in panels (kernels::panel_index: no row stride); x and y
// strided as in add_linear.
void add_linear_f32_panels(std::vector<Case>& cs, int64_t N, int64_t in, int64_t out, bool bias, bool acc,
                           bool strided, uint64_t seed) {
  const Strides ld = strided ? Strides{in + 3, 0, 2 * out + 1} : Strides{};
  const int64_t ldx = ld.x ? ld.x : in, ldy = ld.y ? ld.y : out;
  const int64_t yoff = strided ? 1 : 0;
  const auto x = vec(N * ldx, seed), w = vec(in * out, seed + 1, 0.5f), b = vec(out, seed + 2);
  const std::string label = fmt::format("N={} in={} out={}{}{}{}", N, in, out, bias ? " bias" : "",
                                        acc ? " accumulate" : "", strided ? " strided" : "");
  const std::vector<Out> outs = {{"y", vec(N * ldy + yoff, seed + 4)}};
  cs.push_back(make_case(OP(linear_forward_f32_panels), label, outs, [=](auto fn, Outs& o) {
    fn(o[0].data() + yoff, x.data(), w.data(), bias ? b.data() : nullptr, N, in, out, acc, ld);
  }));
}

// The head on bf16 rows: y[N,out] = x[N,in] w16[out,in]^T, every operand `pad` wider.
void add_gemm_nt_w16(std::vector<Case>& cs, int64_t N, int64_t in, int64_t out, int64_t pad,
                     uint64_t seed) {
  const int64_t ldx = in + pad, ldw = in + pad, ldy = out + pad;
  const auto x = vec(N * ldx, seed);
  const auto w = bf16_vec(out * ldw, seed + 1);
  const std::string label = fmt::format("N={} in={} out={} pad={}", N, in, out, pad);
  const std::vector<Out> outs = {{"y", vec(N * ldy, seed + 2)}};
  cs.push_back(make_case(OP(gemm_nt_w16), label, outs, [=](auto fn, Outs& o) {
    fn(o[0].data(), x.data(), w.data(), N, in, out, ldx, ldw, ldy);
  }));
}

std::vector<int8_t> i8_vec(int64_t n, uint64_t seed) {
  std::vector<int8_t> q;
  for (int32_t v : ints(n, seed, 255)) q.push_back(int8_t(v - 127));
  return q;
}

// Per-channel scales of trained matrices' spread (0.001 to 0.1).
std::vector<float> scales(int64_t n, uint64_t seed) {
  std::vector<float> s = vec(n, seed);
  for (float& v : s) v = 0.001f * std::exp2(std::fabs(v) * 3.0f);
  return s;
}

// linear_forward on int8 weights (in panels of row pairs, kernels::i8_index: no row stride) with
// a scale per column; x and y strided as in add_linear.
void add_linear_i8(std::vector<Case>& cs, int64_t N, int64_t in, int64_t out, bool bias, bool acc,
                   bool strided, uint64_t seed) {
  const Strides ld = strided ? Strides{in + 3, 0, 2 * out + 1} : Strides{};
  const int64_t ldx = ld.x ? ld.x : in, ldy = ld.y ? ld.y : out;
  const int64_t woff = strided ? out : 0, yoff = strided ? 1 : 0;  // woff: the scales' offset
  const auto x = vec(N * ldx, seed), b = vec(out, seed + 2);
  const auto q = i8_vec(ops::i8_elements(in, out), seed + 1);
  const auto sc = scales(woff + out, seed + 3);
  const std::string label = fmt::format("N={} in={} out={}{}{}{}", N, in, out, bias ? " bias" : "",
                                        acc ? " accumulate" : "", strided ? " strided" : "");
  const std::vector<Out> outs = {{"y", vec(N * ldy + yoff, seed + 4)}};
  cs.push_back(make_case(OP(linear_forward_i8), label, outs, [=](auto fn, Outs& o) {
    fn(o[0].data() + yoff, x.data(), q.data(), sc.data() + woff,
       bias ? b.data() : nullptr,
       N, in, out, acc, ld);
  }));
}

// The head on int8 rows with a scale per row, every operand `pad` wider.
void add_gemm_nt_i8(std::vector<Case>& cs, int64_t N, int64_t in, int64_t out, int64_t pad,
                    uint64_t seed) {
  const int64_t ldx = in + pad, ldw = in + pad, ldy = out + pad;
  const auto x = vec(N * ldx, seed);
  const auto q = i8_vec(out * ldw, seed + 1);
  const auto sc = scales(out, seed + 3);
  const std::string label = fmt::format("N={} in={} out={} pad={}", N, in, out, pad);
  const std::vector<Out> outs = {{"y", vec(N * ldy, seed + 2)}};
  cs.push_back(make_case(OP(gemm_nt_i8), label, outs, [=](auto fn, Outs& o) {
    fn(o[0].data(), x.data(), q.data(), sc.data(), N, in, out, ldx, ldw, ldy);
  }));
}

// The embedding lookups on a bf16 and an int8 table.
void add_embedding_q(std::vector<Case>& cs, int64_t B, int64_t T, int64_t d, int32_t rows,
                     uint64_t seed) {
  const auto ids = ints(B * T, seed, rows);
  const auto t16 = bf16_vec(rows * d, seed + 1);
  const auto q = i8_vec(rows * d, seed + 1);
  const auto sc = scales(rows, seed + 3);
  const auto pos = vec(T * d, seed + 2);
  const std::string label = fmt::format("B={} T={} d={} rows={}", B, T, d, rows);
  cs.push_back(make_case(OP(embedding_forward_w16), label, {{"out", vec(B * T * d, seed + 3)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), ids.data(), t16.data(), pos.data(), B, T, d);
                         }));
  cs.push_back(make_case(OP(embedding_forward_i8), label, {{"out", vec(B * T * d, seed + 4)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), ids.data(), q.data(), sc.data(), pos.data(), B, T, d);
                         }));
}

void add_column_sum(std::vector<Case>& cs, int64_t N, int64_t C, int64_t ld, uint64_t seed) {
  const auto dy = vec(N * (ld ? ld : C), seed);
  cs.push_back(make_case(OP(column_sum_accumulate), fmt::format("N={} C={} ld={}", N, C, ld),
                         {{"db", vec(C, seed + 1)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), dy.data(), N, C, ld); }));
}

void add_layernorm(std::vector<Case>& cs, int64_t N, int64_t C, uint64_t seed) {
  const auto x = vec(N * C, seed, 2.0f, 3.0f);  // an offset: the mean cancels
  const auto w = vec(C, seed + 1, 0.5f, 1.0f), b = vec(C, seed + 2, 0.3f);
  const std::string label = fmt::format("N={} C={}", N, C);
  cs.push_back(make_case(OP(layernorm_forward), label,
                         {{"out", vec(N * C, seed + 3)}, {"mean", vec(N, 4)}, {"rstd", vec(N, 5)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), o[1].data(), o[2].data(), x.data(), w.data(), b.data(),
                              N, C);
                         }));
  // The saved statistics come from the ref forward; both backends get the same.
  std::vector<float> out(N * C), mean(N), rstd(N);
  ops::use_backend(ops::BackendKind::Ref);
  ops::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  ops::use_backend(ops::BackendKind::Cpu);
  const auto dout = vec(N * C, seed + 6);
  cs.push_back(make_case(
      OP(layernorm_backward), label,
      {{"dx", vec(N * C, seed + 7)}, {"dw", vec(C, seed + 8)}, {"db", vec(C, seed + 9)}},
      [=](auto fn, Outs& o) {
        fn(o[0].data(), o[1].data(), o[2].data(), dout.data(), x.data(), mean.data(), rstd.data(),
           w.data(), N, C);
      }));
  if (C == 1)
    cs.back().no_mutation =
        "C = 1: each row is its own mean, so g - mean(g) cancels exactly, but the first-order "
        "bound, blind to that correlation, charges both roundings times rstd = 1/sqrt(eps)";
}

// q: own rows (ld d+1) or one table shared by the batch (bs 0, the query layer); k and v: two
// column slices of one packed [B, Tk, 2d+1] buffer, as in the model's qkv activations.
void add_attention(std::vector<Case>& cs, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                   int64_t hd, bool shared_q, uint64_t seed) {
  const int64_t d = H * hd, ldq = d + 1, ldkv = 2 * d + 1;
  const AttnShape s{B, Tq, Tk, H, hd};
  const float scale = 1.0f / std::sqrt(float(hd));
  const auto q = std::make_shared<const std::vector<float>>(
      vec((shared_q ? 1 : B) * Tq * ldq, seed, 1.5f));
  const auto kv = std::make_shared<const std::vector<float>>(vec(B * Tk * ldkv, seed + 1, 1.5f));
  // The operands point into q and kv, which the case's closures keep alive.
  const AttnOperand qo{q->data(), ldq, shared_q ? 0 : Tq * ldq};
  const AttnOperand ko{kv->data(), ldkv, Tk * ldkv}, vo{kv->data() + d, ldkv, Tk * ldkv};
  const std::string label = fmt::format("B={} Tq={} Tk={} H={} hd={}{}", B, Tq, Tk, H, hd,
                                        shared_q ? " shared-q" : "");
  cs.push_back(make_case(OP(attention_forward), label,
                         {{"out", vec(B * Tq * d, seed + 2)}, {"probs", vec(B * H * Tq * Tk, 3)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), o[1].data(), qo, ko, vo, s, scale);
                           (void)q, (void)kv;
                         }));
  // out and probs come from the ref forward; dq has per-row storage even for a shared q.
  auto out = std::make_shared<std::vector<float>>(B * Tq * d);
  auto probs = std::make_shared<std::vector<float>>(B * H * Tq * Tk);
  ops::use_backend(ops::BackendKind::Ref);
  ops::attention_forward(out->data(), probs->data(), qo, ko, vo, s, scale);
  ops::use_backend(ops::BackendKind::Cpu);
  const auto dout = vec(B * Tq * d, seed + 4);
  const int64_t lddq = d + 2, lddk = d + 3;
  cs.push_back(make_case(
      OP(attention_backward), label,
      {{"dq", vec(B * Tq * lddq, seed + 5)},
       {"dk", vec(B * Tk * lddk, seed + 6)},
       {"dv", vec(B * Tk * lddk, seed + 7)}},
      [=](auto fn, Outs& o) {
        fn(AttnGrad{o[0].data(), lddq, Tq * lddq}, AttnGrad{o[1].data(), lddk, Tk * lddk},
           AttnGrad{o[2].data(), lddk, Tk * lddk}, dout.data(), out->data(), probs->data(), qo,
           ko, vo, s, scale);
        (void)q, (void)kv;
      }));
  // The flash variant: lse instead of probs, from the same operands.
  cs.push_back(make_case(OP(flash_attention_forward), label,
                         {{"out", vec(B * Tq * d, seed + 8)}, {"lse", vec(B * H * Tq, seed + 9)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), o[1].data(), qo, ko, vo, s, scale);
                           (void)q, (void)kv;
                         }));
  auto lse = std::make_shared<std::vector<float>>(B * H * Tq);
  ops::use_backend(ops::BackendKind::Ref);
  ops::flash_attention_forward(out->data(), lse->data(), qo, ko, vo, s, scale);
  ops::use_backend(ops::BackendKind::Cpu);
  cs.push_back(make_case(
      OP(flash_attention_backward), label,
      {{"dq", vec(B * Tq * lddq, seed + 5)},
       {"dk", vec(B * Tk * lddk, seed + 6)},
       {"dv", vec(B * Tk * lddk, seed + 7)}},
      [=](auto fn, Outs& o) {
        fn(AttnGrad{o[0].data(), lddq, Tq * lddq}, AttnGrad{o[1].data(), lddk, Tk * lddk},
           AttnGrad{o[2].data(), lddk, Tk * lddk}, dout.data(), out->data(), lse->data(), qo, ko,
           vo, s, scale);
        (void)q, (void)kv;
      }));
}

// The forward on bf16 keys and values (a bf16 KV cache) against its ref formula on their widened
// values, in the cache's layout (each head's positions contiguous, a context longer than Tk).
void add_attention_kv16(std::vector<Case>& cs, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                        int64_t hd, uint64_t seed) {
  const int64_t d = H * hd, C = Tk + 3;
  const AttnShape s{B, Tq, Tk, H, hd};
  const float scale = 1.0f / std::sqrt(float(hd));
  const auto q = std::make_shared<const std::vector<float>>(vec(B * Tq * d, seed, 1.5f));
  const auto kv =
      std::make_shared<const std::vector<uint16_t>>(bf16_vec(B * 2 * H * C * hd, seed + 1, 1.5f));
  const AttnOperand qo{q->data(), d, Tq * d};
  const ops::AttnOperand16 ko{kv->data(), hd, 2 * H * C * hd, C * hd},
      vo{kv->data() + H * C * hd, hd, 2 * H * C * hd, C * hd};
  cs.push_back(make_case(OP(attention_forward_kv16),
                         fmt::format("B={} Tq={} Tk={} H={} hd={}", B, Tq, Tk, H, hd),
                         {{"out", vec(B * Tq * d, seed + 8)}, {"lse", vec(B * H * Tq, seed + 9)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), o[1].data(), qo, ko, vo, s, scale);
                           (void)q, (void)kv;
                         }));
}

// The bf16 pair against its ref formula (inputs rounded to bf16, the probabilities and dS
// rounded where the products read them), from add_attention's operand layout.
void add_attention_bf16(std::vector<Case>& cs, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                        int64_t hd, bool shared_q, uint64_t seed) {
  const int64_t d = H * hd, ldq = d + 1, ldkv = 2 * d + 1;
  const AttnShape s{B, Tq, Tk, H, hd};
  const float scale = 1.0f / std::sqrt(float(hd));
  const auto q = std::make_shared<const std::vector<float>>(
      vec((shared_q ? 1 : B) * Tq * ldq, seed, 1.5f));
  const auto kv = std::make_shared<const std::vector<float>>(vec(B * Tk * ldkv, seed + 1, 1.5f));
  const AttnOperand qo{q->data(), ldq, shared_q ? 0 : Tq * ldq};
  const AttnOperand ko{kv->data(), ldkv, Tk * ldkv}, vo{kv->data() + d, ldkv, Tk * ldkv};
  const std::string label = fmt::format("B={} Tq={} Tk={} H={} hd={}{}", B, Tq, Tk, H, hd,
                                        shared_q ? " shared-q" : "");
  cs.push_back(make_case(OP(flash_attention_forward_bf16), label,
                         {{"out", vec(B * Tq * d, seed + 8)}, {"lse", vec(B * H * Tq, seed + 9)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), o[1].data(), qo, ko, vo, s, scale);
                           (void)q, (void)kv;
                         }));
  auto out = std::make_shared<std::vector<float>>(B * Tq * d);
  auto lse = std::make_shared<std::vector<float>>(B * H * Tq);
  ops::use_backend(ops::BackendKind::Ref);
  ops::flash_attention_forward_bf16(out->data(), lse->data(), qo, ko, vo, s, scale);
  ops::use_backend(ops::BackendKind::Cpu);
  const auto dout = vec(B * Tq * d, seed + 4);
  const int64_t lddq = d + 2, lddk = d + 3;
  cs.push_back(make_case(
      OP(flash_attention_backward_bf16), label,
      {{"dq", vec(B * Tq * lddq, seed + 5)},
       {"dk", vec(B * Tk * lddk, seed + 6)},
       {"dv", vec(B * Tk * lddk, seed + 7)}},
      [=](auto fn, Outs& o) {
        fn(AttnGrad{o[0].data(), lddq, Tq * lddq}, AttnGrad{o[1].data(), lddk, Tk * lddk},
           AttnGrad{o[2].data(), lddk, Tk * lddk}, dout.data(), out->data(), lse->data(), qo, ko,
           vo, s, scale);
        (void)q, (void)kv;
      }));
}

void add_gelu(std::vector<Case>& cs, int64_t n, uint64_t seed) {
  const auto x = vec(n, seed, 3.0f), dy = vec(n, seed + 1);
  const std::string label = fmt::format("n={}", n);
  cs.push_back(make_case(OP(fast_gelu_forward), label, {{"y", vec(n, seed + 2)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), x.data(), n); }));
  cs.push_back(make_case(OP(fast_gelu_backward), label, {{"dx", vec(n, seed + 3)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), dy.data(), x.data(), n); }));
  // In place (ffn_backward: dL/dact becomes dL/dpre in act's buffer).
  cs.push_back(make_case(OP(fast_gelu_backward), label + " in place", {{"dy", dy}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), o[0].data(), x.data(), n); }));
}

void add_xent(std::vector<Case>& cs, int64_t N, int64_t V, bool grad, uint64_t seed) {
  const auto targets = ints(N, seed, int32_t(V));
  auto gs = vec(N, seed + 1, 0.2f, 1.0f);
  if (N > 1) gs[1] = 0.0f;  // a masked row: its gradient is zero
  cs.push_back(make_case(
      OP(softmax_xent), fmt::format("N={} V={} {}", N, V, grad ? "grad" : "loss-only"),
      {{"logits", vec(N * V, seed + 2, 2.0f, 1.0f), grad}, {"loss", vec(N, seed + 3)}},
      [=](auto fn, Outs& o) {
        fn(o[0].data(), o[1].data(), targets.data(), grad ? gs.data() : nullptr, N, V);
      }));
}

// split: a vocabulary-parallel rank's lookup: every third row another rank's (-1), no positions.
void add_embedding(std::vector<Case>& cs, int64_t B, int64_t T, int64_t d, int32_t rows,
                   uint64_t seed, bool split = false) {
  auto ids = ints(B * T, seed, rows);  // repeats: backward sums several tokens per row
  if (split)
    for (size_t i = 1; i < ids.size(); i += 3) ids[i] = -1;
  const auto table = vec(rows * d, seed + 1), pos = vec(T * d, seed + 2), dout = vec(B * T * d, 4);
  const std::string label = fmt::format("B={} T={} d={} rows={}{}", B, T, d, rows,
                                        split ? " split (rows -1, no positions)" : "");
  cs.push_back(make_case(OP(embedding_forward), label, {{"out", vec(B * T * d, seed + 3)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), ids.data(), table.data(), split ? nullptr : pos.data(),
                              B, T, d);
                         }));
  cs.push_back(make_case(OP(embedding_backward), label,
                         {{"dtable", vec(rows * d, seed + 5)}, {"dpos", vec(T * d, seed + 6)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), o[1].data(), dout.data(), ids.data(), B, T, d);
                         }));
}

// Vocabulary-parallel cross-entropy: rank 1 of P, its V columns of rows of P*V ids (targets
// inside and outside its columns); the combination reads all P ranks' true statistics.
void add_xent_parts(std::vector<Case>& cs, int64_t N, int64_t V, int64_t P, bool grad,
                    uint64_t seed) {
  const auto targets = ints(N, seed, int32_t(V * P));
  auto gs = vec(N, seed + 1, 0.2f, 1.0f);
  if (N > 1) gs[1] = 0.0f;
  const auto full = vec(N * V * P, seed + 2, 2.0f, 1.0f);
  auto slice = [&](int64_t r) {  // rank r's columns, contiguous
    std::vector<float> s(size_t(N * V));
    for (int64_t i = 0; i < N; ++i)
      std::copy_n(full.begin() + (i * P + r) * V, V, s.begin() + i * V);
    return s;
  };
  const std::string label = fmt::format("N={} V={} of {} ranks {}", N, V, P, grad ? "grad" : "loss-only");
  const auto mine = slice(1);
  cs.push_back(make_case(OP(xent_partial), label, {{"stats", vec(N * 3, seed + 3)}},
                         [=](auto fn, Outs& o) {
                           fn(o[0].data(), mine.data(), targets.data(), V, N, V);
                         }));
  std::vector<float> stats(size_t(P * N * 3));
  ops::use_backend(ops::BackendKind::Ref);
  for (int64_t r = 0; r < P; ++r)
    ops::xent_partial(stats.data() + r * N * 3, slice(r).data(), targets.data(), r * V, N, V);
  ops::use_backend(ops::BackendKind::Cpu);
  cs.push_back(make_case(
      OP(xent_combine), label, {{"logits", mine, grad}, {"loss", vec(N, seed + 4)}},
      [=](auto fn, Outs& o) {
        fn(o[0].data(), o[1].data(), stats.data(), targets.data(), grad ? gs.data() : nullptr, V,
           P, N, V);
      }));
}

void add_adam(std::vector<Case>& cs, int64_t n, AdamStepArgs a, uint64_t seed) {
  auto g = vec(n, seed, 0.1f);
  if (n > 5) g[5] = 0.0f;
  auto v0 = vec(n, seed + 1, 1e-3f);
  for (float& x : v0) x = x * x;
  cs.push_back(make_case(
      EXACT_OP(adam_step),
      fmt::format("n={} lr={} wd={} eps={} scale={} step={}", n, a.lr, a.weight_decay, a.eps,
                  a.grad_scale, a.step),
      {{"w", vec(n, seed + 2)}, {"m", vec(n, seed + 3, 0.01f)}, {"v", v0}},
      [=](auto fn, Outs& o) { fn(o[0].data(), o[1].data(), o[2].data(), g.data(), n, a); }));
}

void add_movement(std::vector<Case>& cs, int64_t n, int64_t N, int64_t d, uint64_t seed) {
  const auto src = vec(n, seed);
  const std::string label = fmt::format("n={}", n);
  cs.push_back(make_case(EXACT_OP(copy), label, {{"dst", vec(n, seed + 1)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), src.data(), n); }));
  cs.push_back(make_case(EXACT_OP(fill), label, {{"dst", vec(n, seed + 2)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), -1.25f, n); }));
  cs.push_back(make_case(EXACT_OP(add_into), label, {{"dst", vec(n, seed + 3)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), src.data(), n); }));
  const auto order = permutation(N, seed + 4);
  const auto rows = vec(N * d, seed + 5);
  const std::string rl = fmt::format("N={} d={}", N, d);
  cs.push_back(make_case(EXACT_OP(gather_rows), rl, {{"dst", vec(N * d, seed + 6)}},
                         [=](auto fn, Outs& o) { fn(o[0].data(), rows.data(), order.data(), N, d); }));
  for (bool acc : {false, true})
    cs.push_back(make_case(EXACT_OP(scatter_rows), rl + (acc ? " accumulate" : ""),
                           {{"dst", vec(N * d, seed + 7)}}, [=](auto fn, Outs& o) {
                             fn(o[0].data(), rows.data(), order.data(), N, d, acc);
                           }));
}

// Sizes are odd (not multiples of the 16-lane vector width): 1, 7, 33, 131 and neighbours;
// attention crosses the cpu kernel's 128-row blocks and runs queries behind an offset.
std::vector<Case> all_cases() {
  std::vector<Case> cs;
  uint64_t seed = 100;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add_gemm(cs, ta, tb, 7, 33, 131, 0.5f, 2.0f, 3, seed += 10);
  add_gemm(cs, false, false, 1, 1, 1, 1.0f, 0.0f, 0, seed += 10);
  add_gemm(cs, false, true, 131, 7, 33, 1.0f, 0.0f, 0, seed += 10);
  add_gemm(cs, true, false, 33, 131, 1, -1.0f, 1.0f, 1, seed += 10);
  add_gemm(cs, false, false, 7, 5, 0, 1.0f, 2.0f, 0, seed += 10);  // K = 0: C = beta C
  // bf16: the products of bf16 inputs are exact in fp32, so the fp32 sum bound applies as is.
  for (bool ta : {false, true})
    for (bool tb : {false, true}) add_gemm(cs, ta, tb, 7, 33, 131, 0.5f, 2.0f, 3, seed += 10, true);
  add_gemm(cs, false, false, 7, 5, 0, 1.0f, 2.0f, 0, seed += 10, true);
  add_gemm(cs, true, false, 300, 257, 129, 1.0f, 1.0f, 0, seed += 10, true);  // threads
  // bf16 linear backward: db's column sums ride in dy's conversion, in blocks of 256 rows.
  add_linear(cs, 600, 33, 70, true, false, false, seed += 10, true);
  add_linear(cs, 300, 33, 70, true, true, true, seed += 10, true);
  for (bool bf16 : {false, true})
    for (bool bias : {false, true})
      for (bool acc : {false, true}) {
        add_linear(cs, 7, 33, 131, bias, acc, false, seed += 10, bf16);
        add_linear(cs, 33, 131, 7, bias, acc, true, seed += 10, bf16);
      }
  add_linear(cs, 1, 1, 1, true, false, false, seed += 10);
  // 1 to 4 rows: the cpu backend's GEMV kernels (kernels/cpu/gemv.h), with tails of every
  // width, and past kParallelWeights (two threads, columns split).
  add_gemm(cs, false, false, 3, 131, 33, 1.0f, 0.0f, 3, seed += 10);
  add_gemm(cs, false, true, 4, 131, 33, 1.0f, 0.0f, 3, seed += 10);
  add_gemm(cs, false, true, 1, 301, 257, 1.0f, 0.0f, 1, seed += 10);
  add_gemm(cs, false, false, 2, 301, 257, 1.0f, 0.0f, 0, seed += 10);
  for (bool bias : {false, true})
    for (bool acc : {false, true}) {
      add_linear(cs, 1, 33, 131, bias, acc, false, seed += 10);
      add_linear(cs, 4, 131, 7, bias, acc, true, seed += 10);
      add_linear_w16(cs, 1, 33, 131, bias, acc, false, seed += 10);
      add_linear_w16(cs, 3, 131, 7, bias, acc, true, seed += 10);
      add_linear_w16(cs, 7, 33, 131, bias, acc, true, seed += 10);  // a prompt: widened, oneDNN
    }
  add_linear(cs, 3, 257, 301, true, true, false, seed += 10);
  add_linear_w16(cs, 2, 257, 301, true, true, false, seed += 10);
  for (int64_t N : {1, 2, 3, 4, 7}) add_gemm_nt_w16(cs, N, 33, 131, N % 2, seed += 10);
  add_gemm_nt_w16(cs, 1, 257, 301, 0, seed += 10);
  // int8 weights: the GEMVs (1-4 rows, past kParallelWeights too) and a prompt's panels.
  for (bool bias : {false, true})
    for (bool acc : {false, true}) {
      add_linear_i8(cs, 1, 33, 131, bias, acc, false, seed += 10);
      add_linear_i8(cs, 3, 131, 7, bias, acc, true, seed += 10);
      add_linear_i8(cs, 7, 33, 131, bias, acc, true, seed += 10);
    }
  add_linear_i8(cs, 2, 257, 301, true, true, false, seed += 10);
  add_linear_i8(cs, 9, 300, 700, true, false, false, seed += 10);  // several panels
  for (int64_t N : {1, 2, 3, 4, 7}) add_gemm_nt_i8(cs, N, 33, 131, N % 2, seed += 10);
  add_gemm_nt_i8(cs, 1, 257, 301, 0, seed += 10);
  add_gemm_nt_i8(cs, 5, 600, 300, 1, seed += 10);  // several panels
  add_column_sum(cs, 131, 7, 0, seed += 10);
  add_column_sum(cs, 1, 33, 0, seed += 10);
  add_column_sum(cs, 33, 131, 140, seed += 10);
  add_layernorm(cs, 7, 33, seed += 10);
  add_layernorm(cs, 33, 131, seed += 10);
  add_layernorm(cs, 3, 1, seed += 10);
  add_layernorm(cs, 9, 512, seed += 10);  // the model's width: whole SIMD vectors, no tail
  add_attention(cs, 2, 7, 7, 3, 5, false, seed += 10);
  add_attention(cs, 2, 7, 7, 3, 5, true, seed += 10);
  add_attention(cs, 2, 131, 131, 2, 5, false, seed += 10);  // two row blocks
  add_attention(cs, 2, 33, 33, 1, 7, true, seed += 10);
  add_attention(cs, 2, 5, 33, 3, 4, false, seed += 10);     // queries behind an offset
  add_attention(cs, 1, 1, 33, 2, 7, false, seed += 10);     // one decoding step
  add_attention(cs, 1, 130, 131, 1, 3, false, seed += 10);  // offset 1, two row blocks
  // Rows whose hd the 8-key path does not take: AVX-512 builds' 16-column output blocks, then
  // a tail (hd 20) or none (hd 80, past the 8-key path's 64).
  add_attention(cs, 2, 3, 9, 2, 20, false, seed += 10);
  add_attention_kv16(cs, 1, 2, 9, 1, 80, seed += 10);
  // Past kParallelMacs: the threaded oneDNN path (the cases above run on the calling thread).
  add_attention(cs, 2, 131, 131, 4, 16, false, seed += 10);
  add_attention_bf16(cs, 2, 7, 7, 3, 5, false, seed += 10);
  add_attention_bf16(cs, 2, 131, 131, 2, 5, false, seed += 10);  // two row blocks
  add_attention_bf16(cs, 2, 33, 33, 1, 7, true, seed += 10);
  add_attention_bf16(cs, 2, 5, 33, 3, 4, false, seed += 10);     // queries behind an offset
  add_attention_bf16(cs, 1, 130, 131, 1, 3, false, seed += 10);  // offset 1, two row blocks
  add_attention_kv16(cs, 2, 1, 33, 2, 16, seed += 10);   // decode steps: 8-key blocks, a tail
  add_attention_kv16(cs, 1, 2, 40, 2, 64, seed += 10);   // two rows at once
  add_attention_kv16(cs, 2, 5, 33, 3, 4, seed += 10);    // hd not a multiple of 8: plain loops
  add_attention_kv16(cs, 2, 70, 70, 2, 32, seed += 10);  // a prompt: threads over the heads
  for (int64_t n : {1, 7, 33, 131, 4097}) add_gelu(cs, n, seed += 10);
  for (bool grad : {false, true}) {
    add_xent(cs, 1, 1, grad, seed += 10);
    add_xent(cs, 7, 33, grad, seed += 10);
    add_xent(cs, 5, 131, grad, seed += 10);
  }
  add_embedding(cs, 1, 1, 1, 1, seed += 10);
  add_embedding(cs, 2, 7, 33, 11, seed += 10);
  add_embedding(cs, 3, 5, 131, 4, seed += 10);
  add_embedding(cs, 2, 7, 33, 11, seed += 10, true);
  for (bool grad : {false, true}) {
    add_xent_parts(cs, 7, 33, 2, grad, seed += 10);
    add_xent_parts(cs, 5, 131, 4, grad, seed += 10);
  }
  add_embedding_q(cs, 2, 7, 33, 11, seed += 10);
  add_adam(cs, 1, {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1}, seed += 10);
  add_adam(cs, 131, {3e-3f, 0.9f, 0.95f, 1e-10f, 0.0f, 0.25f, 2}, seed += 10);
  add_adam(cs, 40009, {2e-4f, 0.8f, 0.999f, 1e-6f, 0.01f, 1.0f, 37}, seed += 10);  // threads
  add_movement(cs, 7, 7, 33, seed += 10);
  add_movement(cs, 131, 131, 1, seed += 10);
  add_movement(cs, 300007, 4099, 67, seed += 10);  // above the cpu's OpenMP thresholds
  for (bool acc : {false, true})  // bf16 panels of 64, 64 and 22 columns
    add_linear_w16(cs, 2, 200, 150, true, acc, false, seed += 10);
  // fp32 panels: a GEMV's rows, a prompt's (panels put back in rows, oneDNN), strided x and y
  for (bool acc : {false, true}) {
    add_linear_f32_panels(cs, 1, 33, 131, true, acc, false, seed += 10);
    add_linear_f32_panels(cs, 3, 131, 7, !acc, acc, true, seed += 10);
    add_linear_f32_panels(cs, 7, 200, 150, true, acc, true, seed += 10);
  }
  return cs;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> cs = all_cases();
  return cs;
}

const std::vector<Reference>& references() {
  static const std::vector<Reference> rs = [] {
    std::vector<Reference> r;
    for (const Case& c : cases()) r.push_back(reference(c));
    return r;
  }();
  return rs;
}

// ---- the tests ---------------------------------------------------------------------------------

TEST(Ops, EveryOpOfTheFrontHasACase) {
  std::set<std::string> seen;
  for (const Case& c : cases()) seen.insert(c.op);
  for (const char* op :
       {"gemm", "linear_forward", "linear_backward", "gemm_bf16", "linear_forward_bf16",
        "linear_backward_bf16", "column_sum_accumulate", "linear_forward_f32_panels", "linear_forward_w16", "gemm_nt_w16",
        "linear_forward_i8", "gemm_nt_i8", "embedding_forward_w16", "embedding_forward_i8",
        "layernorm_forward",
        "layernorm_backward", "attention_forward", "attention_backward",
        "flash_attention_forward", "flash_attention_backward", "flash_attention_forward_bf16",
        "flash_attention_backward_bf16", "attention_forward_kv16", "fast_gelu_forward",
        "fast_gelu_backward", "softmax_xent", "xent_partial", "xent_combine",
        "embedding_forward", "embedding_backward",
        "adam_step", "copy", "fill", "add_into", "gather_rows", "scatter_rows"})
    EXPECT_TRUE(seen.count(op)) << op;
  EXPECT_EQ(seen.size(), 36u);
}

// warm_up_in_background runs the active backend's warm_up on a thread of its own (generate and
// serve overlap it with loading a checkpoint) and nothing where the backend has none; the cpu
// backend has one (oneDNN's first product generates its code).
std::atomic<std::thread::id> g_warmed_on{};
TEST(Ops, WarmUpRunsTheActiveBackendsSetUpOnAThreadOfItsOwn) {
  EXPECT_NE(ops::backend(ops::BackendKind::Cpu).warm_up, nullptr);
  ops::Backend b = ops::backend(ops::BackendKind::Cpu);
  b.warm_up = [] { g_warmed_on = std::this_thread::get_id(); };
  ops::use_backend(b);
  {
    std::jthread t = ops::warm_up_in_background();
    EXPECT_TRUE(t.joinable());
  }
  EXPECT_NE(g_warmed_on.load(), std::thread::id{});
  EXPECT_NE(g_warmed_on.load(), std::this_thread::get_id());
  b.warm_up = nullptr;
  ops::use_backend(b);
  EXPECT_FALSE(ops::warm_up_in_background().joinable());
  ops::use_backend(ops::BackendKind::Cpu);
  std::jthread real = ops::warm_up_in_background();  // the cpu backend's own: a product that runs
}

// cpu vs ref, element by element, as everywhere and inside a decode step (ops::FewRowKernels:
// a few rows take the GEMVs). Prints, per op, how far below its tolerance the worst element
// sits (worst |cpu - ref| / tol).
TEST(Ops, CpuMatchesRefWithinTheRoundingBound) {
  std::map<std::string, double> worst_per_op;
  for (bool decode : {false, true})
    for (size_t ci = 0; ci < cases().size(); ++ci) {
      const Case& c = cases()[ci];
      const Reference& r = references()[ci];
      std::optional<ops::FewRowKernels> few;
      if (decode) few.emplace();
      const Outs got = run_front(c, ops::backend(ops::BackendKind::Cpu));
      for (size_t k = 0; k < c.outs.size(); ++k) {
        const Verdict v = compare(got[k], r.val[k], r.tol[k]);
        EXPECT_EQ(v.bad, 0) << c.title() << (decode ? " (decode)" : "") << " " << c.outs[k].name << ": "
                            << v.bad << " elements differ, first " << v.first;
        double& w = worst_per_op[c.op];
        w = std::max(w, v.worst);
      }
    }
  for (const auto& [op, w] : worst_per_op)
    std::printf("  %-22s worst |cpu - ref| / tol = %s\n", op.c_str(),
                w == 0 ? "0 (bit-identical)" : fmt::format("{:.2e}", w).c_str());
}

// Break one output of one op at a time (a cpu backend whose pointer for that op perturbs one
// element by 1e-3 relative after the real kernel ran) and require the comparison to fail.
TEST(Ops, EveryMutationIsCaught) {
  int64_t mutants = 0, zero = 0;
  double loosest = 0;  // the largest tol / |perturbation| over all mutants
  for (size_t ci = 0; ci < cases().size(); ++ci) {
    const Case& c = cases()[ci];
    const Reference& r = references()[ci];
    if (!c.no_mutation.empty()) {
      std::printf("  not mutated: %s (%s)\n", c.title().c_str(), c.no_mutation.c_str());
      continue;
    }
    ops::Backend mutant = ops::backend(ops::BackendKind::Cpu);
    c.mutate(mutant);
    for (size_t k = 0; k < c.outs.size(); ++k) {
      if (!c.outs[k].written) continue;
      const size_t idx = mutation_index(c.outs[k], r.val[k]);
      if (r.val[k][idx] == 0.0f) {  // e.g. cross-entropy over V = 1: loss and gradient are 0
        ++zero;
        continue;
      }
      const Outs got = run_front(c, mutant, int(k), idx);
      const Verdict v = compare(got[k], r.val[k], r.tol[k]);
      EXPECT_GT(v.bad, 0) << c.title() << ": perturbing " << c.outs[k].name << "[" << idx
                          << "] went unnoticed (tol " << r.tol[k][idx] << ", value "
                          << r.val[k][idx] << ")";
      ++mutants;
      const double dv = 1e-3 * std::fabs(r.val[k][idx]);
      if (dv > 0) loosest = std::max(loosest, r.tol[k][idx] / dv);
    }
  }
  std::printf("  %lld mutants caught (%lld all-zero outputs left alone); the loosest tolerance "
              "is %.2e of its perturbation\n", (long long)mutants, (long long)zero, loosest);
}

}  // namespace

// The attention shapes the KV cache tests run, on both backends: fn(kind label, shape). The ref
// backend skips the large ones (slow; the same code).
struct CacheShape {
  int64_t B, Tq, Tk, H, hd;
  bool invariant = false;
};
template <class Fn>
void for_each_cache_case(std::initializer_list<CacheShape> shapes, Fn&& fn) {
  for (const ops::BackendKind kind : {ops::BackendKind::Cpu, ops::BackendKind::Ref}) {
    ops::use_backend(kind);
    for (const CacheShape& sh : shapes)
      if (kind == ops::BackendKind::Cpu || sh.Tk * sh.Tq <= 4000)
        fn(std::string(kind == ops::BackendKind::Cpu ? "cpu" : "ref"), sh);
  }
  ops::use_backend(ops::BackendKind::Cpu);
}

// The KV cache's layout (model.h KvCache): each head's positions contiguous (ld = hd, head
// stride hs). A forward kernel given that view must compute exactly what it computes from the
// same numbers laid out with heads side by side in a row (the layout before issue 40): the
// same operations in the same order, so cached decode keeps its bits. Every forward, both
// backends, the decode (one row), few-row, batch-invariant and blocked paths.
TEST(Attention, HeadStrideViewsGiveTheBitsOfTheRowLayout) {
  for_each_cache_case(
      {{1, 1, 300, 4, 16},
       {1, 1, 77, 2, 64},
       {2, 3, 40, 3, 8},
       {1, 1, 520, 8, 64},
       {3, 2, 90, 2, 32, true},
       {2, 150, 150, 2, 32},
       {1, 130, 200, 2, 24}},
      [](const std::string& backend, const CacheShape& sh) {
        const int64_t B = sh.B, Tq = sh.Tq, Tk = sh.Tk, H = sh.H, hd = sh.hd, d = H * hd;
        const int64_t C = Tk + 5;  // the cache's context: a head's run is longer than its keys
        const AttnShape s{B, Tq, Tk, H, hd};
        const float scale = 1.0f / std::sqrt(float(hd));
        const auto q = vec(B * Tq * d, 11, 1.5f), rows = vec(B * Tk * 2 * d, 12, 1.5f);
        // The same keys and values per head: [B, 2, H, C, hd], unused positions NaN (read = fail).
        std::vector<float> heads(size_t(B * 2 * H * C * hd), NAN);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t kv = 0; kv < 2; ++kv)
            for (int64_t h = 0; h < H; ++h)
              for (int64_t j = 0; j < Tk; ++j)
                std::memcpy(&heads[size_t((((b * 2 + kv) * H + h) * C + j) * hd)],
                            &rows[size_t((b * Tk + j) * 2 * d + kv * d + h * hd)], size_t(hd) * 4);
        const AttnOperand qo{q.data(), d, Tq * d};
        const AttnOperand k_rows{rows.data(), 2 * d, Tk * 2 * d},
            v_rows{rows.data() + d, 2 * d, Tk * 2 * d};
        const AttnOperand k_heads{heads.data(), hd, 2 * H * C * hd, C * hd},
            v_heads{heads.data() + H * C * hd, hd, 2 * H * C * hd, C * hd};
        const std::string label = fmt::format("{} B={} Tq={} Tk={} H={} hd={}{}", backend, B, Tq,
                                              Tk, H, hd, sh.invariant ? " batch-invariant" : "");
        std::optional<ops::BatchInvariant> invariant;
        if (sh.invariant) invariant.emplace();
        const ops::FewRowKernels decode;  // as Model::cached_pass (the spin team for big caches)
        using Fwd =
            void (*)(float*, float*, AttnOperand, AttnOperand, AttnOperand, AttnShape, float);
        const std::pair<const char*, Fwd> fwds[] = {
            {"flash", ops::flash_attention_forward},
            {"flash bf16", ops::flash_attention_forward_bf16},
            {"probs", ops::attention_forward}};
        for (const auto& [name, fwd] : fwds) {
          const bool probs = std::string(name) == "probs";
          const size_t saved = size_t(B * H * Tq * (probs ? Tk : 1));
          std::vector<float> o1(size_t(B * Tq * d)), o2(o1.size()), s1(saved), s2(saved);
          fwd(o1.data(), s1.data(), qo, k_rows, v_rows, s, scale);
          fwd(o2.data(), s2.data(), qo, k_heads, v_heads, s, scale);
          EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.size() * 4))
              << name << " out, " << label;
          EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), s1.size() * 4))
              << name << " saved, " << label;
          EXPECT_TRUE(std::all_of(o2.begin(), o2.end(), [](float x) { return std::isfinite(x); }))
              << name << ", " << label;
        }
      });
}

// A bf16 KV cache (Model::use_kv_cache): attention_forward_kv16 widens each key and value where
// it reads it and otherwise runs the fp32 forward, so it gives, bit for bit, what that forward
// gives on the widened values, with and without ops::BatchInvariant. Both backends, every
// path: decode rows in 8-key blocks with tails, two rows at once, plain loops (hd not a
// multiple of 8), the spin team's heads (a cache of 256 KiB and more), and a prompt's row
// blocks (oneDNN's products on each block's widened keys and values; under BatchInvariant the
// rows with threads over the heads).
TEST(Attention, Bf16CacheGivesTheBitsOfItsWidenedValues) {
  for_each_cache_case(
      {{1, 1, 300, 4, 16},
       {1, 1, 77, 2, 64},
       {2, 3, 40, 3, 8},
       {1, 1, 520, 8, 64},
       {2, 5, 33, 3, 4},
       {2, 150, 150, 2, 32},
       {1, 130, 200, 2, 24}},
      [](const std::string& backend, const CacheShape& sh) {
        const int64_t B = sh.B, Tq = sh.Tq, Tk = sh.Tk, H = sh.H, hd = sh.hd, d = H * hd;
        const int64_t C = Tk + 5;  // the cache's context: a head's run is longer than its keys
        const AttnShape s{B, Tq, Tk, H, hd};
        const float scale = 1.0f / std::sqrt(float(hd));
        const auto q = vec(B * Tq * d, 21, 1.5f);
        // [B, 2, H, C, hd] in bf16, positions past Tk NaN (read = fail), and its widened copy.
        std::vector<uint16_t> cache16 = bf16_vec(B * 2 * H * C * hd, 22, 1.5f);
        for (int64_t run = 0; run < B * 2 * H; ++run)
          std::fill(cache16.begin() + (run * C + Tk) * hd, cache16.begin() + (run + 1) * C * hd,
                    uint16_t(0x7FC0));
        std::vector<float> cache32;
        for (uint16_t h : cache16) cache32.push_back(from_bf16(h));
        const AttnOperand qo{q.data(), d, Tq * d};
        const ops::AttnOperand16 k16{cache16.data(), hd, 2 * H * C * hd, C * hd},
            v16{cache16.data() + H * C * hd, hd, 2 * H * C * hd, C * hd};
        const AttnOperand k32{cache32.data(), hd, 2 * H * C * hd, C * hd},
            v32{cache32.data() + H * C * hd, hd, 2 * H * C * hd, C * hd};
        const std::string label =
            fmt::format("{} B={} Tq={} Tk={} H={} hd={}", backend, B, Tq, Tk, H, hd);
        for (bool invariant : {false, true}) {
          std::optional<ops::BatchInvariant> rows;
          if (invariant) rows.emplace();
          const ops::FewRowKernels decode;  // as Model::cached_pass
          std::vector<float> o16(size_t(B * Tq * d)), o32(o16.size()), l16(size_t(B * H * Tq)),
              l32(l16.size());
          ops::attention_forward_kv16(o16.data(), l16.data(), qo, k16, v16, s, scale);
          ops::flash_attention_forward(o32.data(), l32.data(), qo, k32, v32, s, scale);
          const std::string where = label + (invariant ? " batch-invariant" : "");
          EXPECT_EQ(0, std::memcmp(o16.data(), o32.data(), o16.size() * 4)) << "out, " << where;
          EXPECT_EQ(0, std::memcmp(l16.data(), l32.data(), l16.size() * 4)) << "lse, " << where;
          EXPECT_TRUE(std::all_of(o16.begin(), o16.end(), [](float x) { return std::isfinite(x); }))
              << where;
        }
      });
}

// The cpu backward kernels index heads side by side: a head-strided view is refused, not misread.
TEST(Attention, BackwardRefusesAHeadStride) {
  const int64_t T = 4, H = 2, hd = 8, d = H * hd;
  std::vector<float> x(size_t(T * 3 * d), 0.5f), out(size_t(T * d)), lse(size_t(H * T)),
      g(size_t(T * 3 * d));
  const AttnOperand q{x.data(), 3 * d, 0}, k{x.data() + d, hd, 0, T * hd}, v{x.data() + 2 * d, 3 * d, 0};
  const AttnGrad dq{g.data(), 3 * d, 0}, dk{g.data() + d, 3 * d, 0}, dv{g.data() + 2 * d, 3 * d, 0};
  EXPECT_THROW(ops::flash_attention_backward(dq, dk, dv, out.data(), out.data(), lse.data(), q, k,
                                             v, {1, T, T, H, hd}, 1.0f),
               Error);
}
