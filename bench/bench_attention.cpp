// Causal flash attention at the training benchmark's shape (B=8, T=512, 8 heads of 64), fp32
// and bf16 products, forward and backward: milliseconds per call (median of --reps) and the
// GFLOP/s they execute (the causal half of the key blocks, as run_train_bench.sh counts them).
//   bench_attention [--B 8] [--T 512] [--H 8] [--hd 64] [--reps 9] [--threads 2]
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/ops.h"

using namespace sigma;

int main(int argc, char** argv) {
  int64_t B = 8, T = 512, H = 8, hd = 64;
  int reps = 9, threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::stoi(argv[i + 1]);
    if (k == "--B") B = v;
    else if (k == "--T") T = v;
    else if (k == "--H") H = v;
    else if (k == "--hd") hd = v;
    else if (k == "--reps") reps = v;
    else if (k == "--threads") threads = v;
    else return fmt::print(stderr, "unknown option {}\n", k), 2;
  }
  omp_set_num_threads(threads);
  const int64_t d = H * hd, N = B * T;
  std::vector<float> qkv(size_t(N * 3 * d)), dout(size_t(N * d)), out(size_t(N * d)),
      lse(size_t(B * H * T)), g(size_t(N * 3 * d));
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = rng_normal(1, 1, i);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = rng_normal(1, 2, i);
  const ops::AttnOperand q{qkv.data(), 3 * d, T * 3 * d}, k{qkv.data() + d, 3 * d, T * 3 * d},
      v{qkv.data() + 2 * d, 3 * d, T * 3 * d};
  const ops::AttnGrad dq{g.data(), 3 * d, T * 3 * d}, dk{g.data() + d, 3 * d, T * 3 * d},
      dv{g.data() + 2 * d, 3 * d, T * 3 * d};
  const ops::AttnShape s{B, T, T, H, hd};
  const float scale = 1.0f / std::sqrt(float(hd));
  double frac = 0;  // executed fraction of the T x T products (128-row blocks)
  for (int64_t i0 = 0; i0 < T; i0 += 128) frac += double(std::min(T, i0 + 128)) * double(std::min<int64_t>(128, T - i0));
  frac /= double(T * T);
  const double fwd_flops = 4.0 * B * H * T * T * hd * frac, bwd_flops = 10.0 * B * H * T * T * hd * frac;
  auto time = [&](auto&& fn) {
    std::vector<double> ms;
    fn();
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  for (const char* p : {"fp32", "bf16"}) {
    ops::use_precision(p);
    const double f = time([&] { ops::flash_attention_forward(out.data(), lse.data(), q, k, v, s, scale); });
    const double b = time([&] {
      ops::flash_attention_backward(dq, dk, dv, dout.data(), out.data(), lse.data(), q, k, v, s, scale);
    });
    fmt::print("{{\"precision\":\"{}\",\"forward_ms\":{:.2f},\"backward_ms\":{:.2f},"
               "\"forward_gflops\":{:.1f},\"backward_gflops\":{:.1f}}}\n",
               p, f, b, fwd_flops / f / 1e6, bwd_flops / b / 1e6);
  }
  return 0;
}
