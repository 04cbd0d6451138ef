// Causal flash attention at the training benchmark's shape (B=8, T=512, 8 heads of 64), fp32
// and bf16 products, forward and backward: milliseconds per call (median of --reps) and the
// GFLOP/s they execute (the causal half of the key blocks, as run_train_bench.sh counts them).
//   bench_attention [--B 8] [--T 512] [--H 8] [--hd 64] [--reps 9] [--threads 2]
//                   [--precision fp32|bf16] (default: both, fp32 first)
// With --decode L: a batch-1 generation of T positions over L layers' KV caches instead (one
// query row a layer a step, the calling thread as Model::cached_pass runs it, a layer's weights
// read between two layers), CPU microseconds a
// token (the calling thread's, median of --reps; run it with --threads 1) with the cache laid out by rows ([T, 2d], before issue 40) and by heads (KvCache's).
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/ops.h"

using namespace sigma;

// The calling thread's CPU time: on a shared machine the wall time mostly counts other processes.
double cpu_us() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e6 + double(t.tv_nsec) * 1e-3;
}

int decode_bench(int64_t L, int64_t C, int64_t H, int64_t hd, int reps) {
  const int64_t d = H * hd;
  std::vector<float> q(static_cast<size_t>(d)), out(q.size()), lse(static_cast<size_t>(H));
  std::vector<std::vector<float>> rows(static_cast<size_t>(L)), heads(rows.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = rng_normal(1, 3, i);
  for (int64_t l = 0; l < L; ++l) {
    rows[size_t(l)].resize(size_t(C * 2 * d));
    heads[size_t(l)].resize(size_t(C * 2 * d));
    for (size_t i = 0; i < rows[size_t(l)].size(); ++i)
      rows[size_t(l)][i] = heads[size_t(l)][i] = rng_normal(1, 4 + uint64_t(l), i);
  }
  // Between two layers' attention a decode step streams the layer's weights (3.2 MB, int8 at
  // d = 512), which evicts the KV cache from L2 and some of L3 as in Model::cached_pass.
  std::vector<float> weights(size_t(800) << 10, 1.0f);
  volatile float sink = 0;
  const ops::FewRowKernels few;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (const bool by_head : {false, true}) {
    std::vector<double> us;
    for (int r = 0; r <= reps; ++r) {
      double t = 0;  // the attention's alone
      for (int64_t pos = 1; pos <= C; ++pos)
        for (int64_t l = 0; l < L; ++l) {
          const float* p = by_head ? heads[size_t(l)].data() : rows[size_t(l)].data();
          const ops::AttnOperand k = by_head ? ops::AttnOperand{p, hd, 0, C * hd}
                                             : ops::AttnOperand{p, 2 * d, 0},
                                 v = by_head ? ops::AttnOperand{p + H * C * hd, hd, 0, C * hd}
                                             : ops::AttnOperand{p + d, 2 * d, 0};
          const double t0 = cpu_us();
          ops::flash_attention_forward(out.data(), lse.data(), {q.data(), d, 0}, k, v,
                                       {1, 1, pos, H, hd}, scale);
          t += cpu_us() - t0;
          for (size_t i = 0; i < weights.size(); i += 16) sink = sink + weights[i];  // a layer's GEMVs
        }
      if (r > 0)
        us.push_back(t / double(C));
    }
    std::sort(us.begin(), us.end());
    fmt::print("{{\"decode_layout\":\"{}\",\"layers\":{},\"positions\":{},\"us_per_token\":{:.1f}}}\n",
               by_head ? "heads" : "rows", L, C, us[us.size() / 2]);
  }
  return 0;
}

int main(int argc, char** argv) {
  int64_t B = 8, T = 512, H = 8, hd = 64;
  int reps = 9, threads = 2, decode = 0;
  std::string only;  // one precision, or both
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--precision") {
      only = argv[i + 1];
      if (only != "fp32" && only != "bf16") return fmt::print(stderr, "--precision: fp32 or bf16\n"), 2;
      continue;
    }
    const int v = std::stoi(argv[i + 1]);
    if (k == "--B") B = v;
    else if (k == "--T") T = v;
    else if (k == "--H") H = v;
    else if (k == "--hd") hd = v;
    else if (k == "--reps") reps = v;
    else if (k == "--threads") threads = v;
    else if (k == "--decode") decode = v;
    else return fmt::print(stderr, "unknown option {}\n", k), 2;
  }
  omp_set_num_threads(threads);
  if (decode > 0) return decode_bench(decode, T, H, hd, reps);
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
    if (!only.empty() && only != p) continue;
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
