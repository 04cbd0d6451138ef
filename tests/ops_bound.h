// The error-bound arithmetic and test data shared by the ops front's tests (test_ops.cpp:
// every op on cpu against ref within the rounding bound; test_ops_gradients.cpp: finite
// differences of the ref backward formulas). test_ops.cpp's head comment states the rules.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/ref/io.h"

namespace sigma::ops_test {

constexpr double kU = 1.0 / 16777216.0;  // fp32 unit roundoff, 2^-24
constexpr double kFloor = 1e-30;

// ---- the error-bound arithmetic ----------------------------------------------------------------

// One rounding of an exact result v: none when the operands were exact (bound 0) and v is an
// fp32 number (IEEE operations are correctly rounded), else u |v| (first order).
inline double rounding(double v, double operand_bounds) {
  return operand_bounds == 0 && double(float(v)) == v ? 0.0 : std::fabs(v);
}

struct Bound {
  double v = 0;     // the exact value of the formula (in double)
  double e = 0;     // bound on the error of the operations already charged, in units of u
  double mass = 0;  // an open sum: sum of |terms| whose additions are not charged yet
  int64_t n = 0;    // an open sum: its number of terms
  Bound() = default;
  Bound(double x) : v(x), mass(std::fabs(x)), n(x != 0) {}  // an exact input or constant
  // Everything charged. An open sum's additions cost (n - 1) * mass in any order; a single
  // addition rounds once, relative to its result.
  double bound() const {
    if (n <= 1) return e;
    if (n == 2) return e + rounding(v, e);
    return e + double(n - 1) * mass;
  }
};

inline Bound result(double v, double e) {  // a rounded result: one term of any sum it enters
  Bound r(v);
  r.e = e;
  r.n = 1;
  return r;
}

// Additions only merge open sums: the order of the terms does not matter.
inline Bound operator+(const Bound& a, const Bound& b) {
  Bound r;
  r.v = a.v + b.v;
  r.e = a.e + b.e;
  r.mass = a.mass + b.mass;
  r.n = a.n + b.n;
  return r;
}
inline Bound operator-(const Bound& a) {
  Bound r = a;
  r.v = -a.v;
  return r;
}
inline Bound operator-(const Bound& a, const Bound& b) { return a + (-b); }
inline Bound& operator+=(Bound& a, const Bound& b) { return a = a + b; }
inline Bound operator*(const Bound& a, const Bound& b) {
  const double ea = a.bound(), eb = b.bound(), v = a.v * b.v;
  return result(v, std::fabs(a.v) * eb + std::fabs(b.v) * ea + ea * eb * kU + rounding(v, ea + eb));
}
inline Bound operator/(const Bound& a, const Bound& b) {
  const double ea = a.bound(), eb = b.bound(), v = a.v / b.v;
  return result(v, ea / std::fabs(b.v) + std::fabs(a.v) * eb / (b.v * b.v) + rounding(v, ea + eb));
}
inline bool operator>(const Bound& a, const Bound& b) { return a.v > b.v; }
inline Bound sqrt(const Bound& a) {
  const double v = std::sqrt(a.v), ea = a.bound();
  return result(v, (ea > 0 ? ea / (2 * v) : 0.0) + rounding(v, ea));
}
inline Bound exp(const Bound& a) {
  const double v = std::exp(a.v);
  return result(v, v * a.bound() + 2 * v);
}
inline Bound log(const Bound& a) {
  const double v = std::log(a.v);
  return result(v, a.bound() / a.v + 2 * std::fabs(v));
}

// A computed value rounded to bf16 (the bf16 attention's probabilities and dS): exact when
// every fp32 evaluation within the bound rounds to the same bf16 value (almost always: a bf16
// spacing is 2^16 fp32 ones), else off by up to the larger distance to the two candidates.
// Found by argument-dependent lookup from ref::attn_computed.
inline Bound bf16_rounded(const Bound& a) {
  // How far an fp32 evaluation may be from a.v (the tolerance rule of reference()).
  const double r = round_bf16(float(a.v)), e = kU * (2 * a.bound() + std::fabs(a.v));
  const double lo = round_bf16(float(a.v - e)), hi = round_bf16(float(a.v + e));
  if (lo == r && hi == r) return Bound(r);
  return result(r, std::max(std::fabs(lo - a.v), std::fabs(hi - a.v)) / kU + a.bound());
}

// Where a ref formula's results go when T = Bound: the fp32 value into the buffer, the Bound
// into the shadow registered for that buffer.
struct Shadow {
  float* base;
  size_t n;
  Bound* b;
};
inline std::vector<Shadow> g_shadows;


}  // namespace sigma::ops_test

template <>
struct sigma::ref::Io<sigma::ops_test::Bound> {
  static void put(float* p, const sigma::ops_test::Bound& v) {
    for (sigma::ops_test::Shadow& s : sigma::ops_test::g_shadows)
      if (p >= s.base && p < s.base + s.n) {
        s.b[p - s.base] = v;
        *p = float(v.v);
        return;
      }
    ADD_FAILURE() << "a ref formula wrote outside its outputs";
    std::abort();
  }
};

namespace sigma::ops_test {

// ---- test data ---------------------------------------------------------------------------------

inline std::vector<float> vec(int64_t n, uint64_t seed, float scale = 1.0f, float offset = 0.0f) {
  std::vector<float> v(size_t(std::max<int64_t>(n, 0)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = offset + scale * rng_normal(seed, 7, i);
  return v;
}

// Multiples of 2^-8 in [-4, 4]: x +- 2^-12 is exact in fp32 (finite differences).
inline std::vector<float> dyadic(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v = vec(n, seed, scale);
  for (float& x : v) x = std::clamp(std::round(x * 256.0f) / 256.0f, -4.0f, 4.0f);
  return v;
}

inline std::vector<int32_t> ints(int64_t n, uint64_t seed, int32_t bound) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = int32_t(rng_u64(seed, 8, i) % uint64_t(bound));
  return v;
}

inline std::vector<int32_t> permutation(int64_t n, uint64_t seed) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (size_t i = 0; i < p.size(); ++i) p[i] = int32_t(i);
  for (size_t i = p.size(); i > 1; --i) std::swap(p[i - 1], p[rng_u64(seed, 9, i) % i]);
  return p;
}

using Outs = std::vector<std::vector<float>>;

// Runs the ref formula with T = Bound over buffers holding `init`: the exact values and bounds.
inline std::vector<std::vector<Bound>> run_bound(const std::function<void(Outs&)>& f, Outs& o) {
  std::vector<std::vector<Bound>> sh;
  for (auto& buf : o) {
    sh.emplace_back(buf.begin(), buf.end());  // untouched elements keep their exact initial value
    g_shadows.push_back({buf.data(), buf.size(), sh.back().data()});
  }
  f(o);
  g_shadows.clear();
  return sh;
}

}  // namespace sigma::ops_test
