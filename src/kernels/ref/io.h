// The ref backend (DESIGN §8; docs/ops.md): every op of the front as naive loops in the
// textbook formula, accumulating in double. It is the tests' oracle and the model of what a new
// backend must compute. Speed is not a goal.
//
// The formulas (ref/linear.h, ref/layers.h, ref/attention.h) are templates over their
// arithmetic type T. The backend instantiates them with T = double. The op tests
// (tests/test_ops.cpp) instantiate them with an error-bound type that carries, next to each
// value, a bound on how far an fp32 evaluation of the same formula can stray from it; that is
// where the cpu-vs-ref tolerances come from. So the formulas follow two rules:
//   - every fp32 input is read as T(x) (exact), every result is written through store<T>();
//   - an output is never read back after the kernel wrote it, except the initial value of an
//     accumulated gradient (read once, before any write): intermediates stay in T.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/types.h"

namespace sigma::ref {

using kernels::AttnGrad;
using kernels::AttnOperand;
using kernels::AttnOperand16;
using kernels::AttnShape;
using kernels::kLayerNormEps;
using kernels::Strides;

// How a result leaves the formula: the backend rounds to fp32 once; the tests specialise this.
template <class T>
struct Io {
  static void put(float* p, const T& v) { *p = float(v); }
};
template <class T>
inline void store(float* p, const T& v) {
  Io<T>::put(p, v);
}

}  // namespace sigma::ref
