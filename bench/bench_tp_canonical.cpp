// What a canonical partition would cost (issue 26, "Determinism", docs/distributed.md): to
// make tp = 1, 2, 4 bit-identical, every product whose sum a tp group splits -- the attention
// output and the FFN's w_out forward (K = d, f), the QKV and w_in input gradients backward
// (K = 3d, f) -- would run at every tp as C fixed chunks of K, added in a fixed tree. This
// times those four products per block whole and as C = 4 chunks + tree_sum, one thread set,
// at the shape given: milliseconds per block (median of --reps) and the difference.
//   bench_tp_canonical [--N 1536] [--d 512] [--chunks 4] [--reps 9] [--threads 1]
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "core/rng.h"
#include "dist/communicator.h"
#include "kernels/ops.h"

using namespace sigma;

int main(int argc, char** argv) {
  int64_t N = 1536, d = 512;
  int C = 4, reps = 9, threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::stoi(argv[i + 1]);
    if (k == "--N") N = v;
    else if (k == "--d") d = v;
    else if (k == "--chunks") C = v;
    else if (k == "--reps") reps = v;
    else if (k == "--threads") threads = v;
    else return fmt::print(stderr, "unknown option {}\n", k), 2;
  }
  omp_set_num_threads(threads);
  const int64_t f = 4 * d;
  struct Product { const char* name; int64_t K, out; bool dx; };  // dx: y = dy @ W^T
  const Product products[] = {{"attn.out fwd", d, d, false}, {"ffn.w_out fwd", f, d, false},
                              {"qkv dx bwd", 3 * d, d, true}, {"ffn.w_in dx bwd", f, d, true}};
  double whole_ms = 0, chunked_ms = 0;
  for (const Product& p : products) {
    std::vector<float> x(size_t(N * p.K)), w(size_t(p.K * p.out)), y(size_t(N * p.out));
    std::vector<float> parts(size_t(C * N * p.out));
    for (size_t i = 0; i < x.size(); ++i) x[i] = rng_normal(1, 1, i);
    for (size_t i = 0; i < w.size(); ++i) w[i] = rng_normal(1, 2, i);
    auto time = [&](auto&& fn) {
      std::vector<double> ms;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(ms.begin(), ms.end());
      return ms[ms.size() / 2];
    };
    const int64_t Kc = p.K / C;
    // x [N, K] times w [K, out] (forward), or dy [N, K] times w^T with w [out, K] (dx).
    const double a = time([&] {
      ops::gemm(false, p.dx, N, p.out, p.K, 1.0f, x.data(), p.K, w.data(), p.dx ? p.K : p.out,
                0.0f, y.data(), p.out);
    });
    const double b = time([&] {
      std::vector<const float*> ptr;
      for (int c = 0; c < C; ++c) {
        float* out = parts.data() + int64_t(c) * N * p.out;
        const float* wc = p.dx ? w.data() + c * Kc : w.data() + c * Kc * p.out;
        ops::gemm(false, p.dx, N, p.out, Kc, 1.0f, x.data() + c * Kc, p.K, wc,
                  p.dx ? p.K : p.out, 0.0f, out, p.out);
        ptr.push_back(out);
      }
      tree_sum(y.data(), ptr.data(), C, N * p.out);
    });
    fmt::print("{:<16} K {:>5}: whole {:8.3f} ms, {} chunks + tree {:8.3f} ms ({:+.1f}%)\n", p.name,
               p.K, a, C, b, 100.0 * (b - a) / a);
    whole_ms += a, chunked_ms += b;
  }
  fmt::print("per block: whole {:.3f} ms, canonical {:.3f} ms, +{:.3f} ms\n", whole_ms, chunked_ms,
             chunked_ms - whole_ms);
}
