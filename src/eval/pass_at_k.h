// The unbiased pass@k estimator of Chen et al. 2021 (Codex): with n samples of which c pass,
// pass@k = 1 - C(n-c, k) / C(n, k), the chance that k samples drawn without replacement from
// the n include a passing one. Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which stays exact
// in double for large n where the binomials overflow.
#pragma once
#include "core/error.h"

namespace sigma::eval {

inline double pass_at_k(int n, int c, int k) {
  SIGMA_CHECK(n >= 1 && c >= 0 && c <= n && k >= 1 && k <= n,
              "pass@k needs 0 <= c <= n and 1 <= k <= n (n={}, c={}, k={})", n, c, k);
  if (n - c < k) return 1.0;  // every draw of k includes a passing sample
  double fail_all = 1.0;
  for (int i = n - c + 1; i <= n; ++i) fail_all *= 1.0 - double(k) / double(i);
  return 1.0 - fail_all;
}

}  // namespace sigma::eval
