// Central finite differences against analytic gradients, element by element.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "device_access.h"

namespace sigma::testing {

inline std::vector<float> random_vec(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * rng_normal(seed, 99, i);
  return v;
}

// Perturbs element i by ±h for every i in `indices` (all when empty) and compares
// (loss(x+h) - loss(x-h)) / 2h with analytic[i]: |fd - an| <= atol + rtol * max(|fd|, |an|).
// `get` and `set` read and write one element (a host array, or a device tensor through ops).
inline void expect_grad_matches(const std::string& what, size_t n,
                                const std::function<float(size_t)>& get,
                                const std::function<void(size_t, float)>& set,
                                const std::vector<float>& analytic,
                                const std::function<double()>& loss, double h, double atol,
                                double rtol, std::vector<size_t> indices) {
  if (indices.empty())
    for (size_t i = 0; i < n; ++i) indices.push_back(i);
  int failures = 0;
  for (size_t i : indices) {
    const float saved = get(i);
    set(i, saved + float(h));
    const double lp = loss();
    set(i, saved - float(h));
    const double lm = loss();
    set(i, saved);
    const double fd = (lp - lm) / (2 * h), an = analytic[i];
    const double tol = atol + rtol * std::max(std::fabs(fd), std::fabs(an));
    if (std::fabs(fd - an) > tol && failures++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: finite difference " << fd << " vs analytic " << an;
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << indices.size()
                         << " elements differ";
}

// A host array.
inline void expect_grad_matches(const std::string& what, float* x, size_t n,
                                const std::vector<float>& analytic,
                                const std::function<double()>& loss, double h = 1e-2,
                                double atol = 1e-3, double rtol = 1e-2,
                                std::vector<size_t> indices = {}) {
  expect_grad_matches(
      what, n, [&](size_t i) { return x[i]; }, [&](size_t i, float v) { x[i] = v; }, analytic,
      loss, h, atol, rtol, std::move(indices));
}

// A tensor on any device (a model parameter), through ops.
inline void expect_grad_matches(const std::string& what, Tensor& x,
                                const std::vector<float>& analytic,
                                const std::function<double()>& loss, double h = 1e-2,
                                double atol = 1e-3, double rtol = 1e-2,
                                std::vector<size_t> indices = {}) {
  expect_grad_matches(
      what, size_t(x.numel()), [&](size_t i) { return element(x, int64_t(i)); },
      [&](size_t i, float v) { set_element(x, int64_t(i), v); }, analytic, loss, h, atol, rtol,
      std::move(indices));
}

// sum_i r[i] * y[i] in double: a scalar loss whose gradient w.r.t. y is r.
inline double dot(const std::vector<float>& r, const float* y) {
  double s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += double(r[i]) * y[i];
  return s;
}

}  // namespace sigma::testing
