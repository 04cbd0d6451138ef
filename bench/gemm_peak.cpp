// gemm_peak: this machine's GEMM throughput through oneDNN, the MFU denominator of the training
// benchmark (docs/benchmarks.md, "Training throughput (issue 2)").
//
// fp32: dnnl_sgemm (row-major) on a square 2048 problem and on the GEMM shapes of the benchmark
// model (d=512, f=2048, V=16384, B*T=4096 tokens, 8 heads of 64): forward, data-gradient and
// weight-gradient products, the tied head, and the per-head attention products. bf16: oneDNN's
// matmul primitive with bf16 inputs and an f32 result (oneDNN 2.6 exposes no bf16 gemm in its C
// API) on every shape but the per-head attention products; bf16_peak_gflops is the best of them
// (where oneDNN has no bf16 matmul, an AVX2-only CPU: the fp32 sgemm peak, and bf16_native false).
// sigma_bf16_shapes: Sigma's own bf16 GEMM (cpu::gemm_bf16: fp32 operands converted per call)
// on the same shapes, so the conversion's cost shows beside the primitive's speed.
//
// Each shape: one untimed call, then `--samples` timed samples of enough calls to last
// >= `--min-ms`; the figure is the median sample. gemm_peak_gflops is the best fp32 median over
// all shapes. Prints one JSON line on stdout.
//
//   gemm_peak [--threads 2] [--samples 7] [--min-ms 150] [--no-bf16]
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <nlohmann/json.hpp>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

struct Shape {
  const char* name;
  int64_t M, N, K;
  char ta, tb;        // 'N' or 'T', row-major: C[M,N] = op(A)[M,K] * op(B)[K,N]
  int64_t batch = 1;  // independent products per call (per-head attention)
  bool bf16 = false;  // also measured in bf16
};

// The benchmark model: d=512, f=4d, V=16384, tokens = batch 8 * T 512, heads 8 (dh 64).
constexpr int64_t kTok = 4096, kD = 512, kF = 2048, kV = 16384, kT = 512, kDh = 64, kBH = 64;

const std::vector<Shape> kShapes = {
    {"square_2048", 2048, 2048, 2048, 'N', 'N', 1, true},
    {"qkv_fwd", kTok, 3 * kD, kD, 'N', 'N', 1, true},
    {"attn_out_fwd", kTok, kD, kD, 'N', 'N', 1, true},
    {"ffn_in_fwd", kTok, kF, kD, 'N', 'N', 1, true},
    {"ffn_out_fwd", kTok, kD, kF, 'N', 'N', 1, true},
    {"ffn_in_dgrad", kTok, kD, kF, 'N', 'T', 1, true},
    {"ffn_in_wgrad", kD, kF, kTok, 'T', 'N', 1, true},
    {"head_fwd", kTok, kV, kD, 'N', 'T', 1, true},
    {"head_dgrad", kTok, kD, kV, 'N', 'N', 1, true},
    {"head_wgrad", kV, kD, kTok, 'T', 'N', 1, true},
    {"attn_qk_x64", kT, kT, kDh, 'N', 'T', kBH},
    {"attn_av_x64", kT, kDh, kT, 'N', 'N', kBH},
};

using Clock = std::chrono::steady_clock;

void fill(std::vector<float>& v, uint64_t seed) {
  for (auto& x : v) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    x = static_cast<float>((seed >> 40) & 0xFFFF) / 65536.0f - 0.5f;
  }
}

struct Result {
  double median = 0, lo = 0, hi = 0;
};

// Runs `call` (which does `flops` FLOPs) in samples lasting >= min_ms; returns GFLOP/s.
Result measure(const std::function<void()>& call, double flops, int samples, double min_ms) {
  call();  // warm: JIT, page faults, caches
  auto t0 = Clock::now();
  call();
  double one_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  int reps = std::max(1, static_cast<int>(min_ms / std::max(one_ms, 1e-3)));
  std::vector<double> g;
  for (int s = 0; s < samples; ++s) {
    auto a = Clock::now();
    for (int r = 0; r < reps; ++r) call();
    double sec = std::chrono::duration<double>(Clock::now() - a).count();
    g.push_back(flops * reps / sec / 1e9);
  }
  std::sort(g.begin(), g.end());
  return {g[g.size() / 2], g.front(), g.back()};
}

nlohmann::json to_json(const Shape& s, const Result& r) {
  return {{"M", s.M},           {"N", s.N},           {"K", s.K},
          {"trans", std::string{s.ta, s.tb}},          {"batch", s.batch},
          {"gflops", r.median}, {"gflops_min", r.lo}, {"gflops_max", r.hi}};
}

Result run_f32(const Shape& s, int samples, double min_ms) {
  std::vector<float> A(s.batch * s.M * s.K), B(s.batch * s.K * s.N), C(s.batch * s.M * s.N);
  fill(A, 1);
  fill(B, 2);
  const int64_t lda = s.ta == 'N' ? s.K : s.M, ldb = s.tb == 'N' ? s.N : s.K, ldc = s.N;
  auto call = [&] {
    for (int64_t b = 0; b < s.batch; ++b) {
      dnnl_status_t st = dnnl_sgemm(s.ta, s.tb, s.M, s.N, s.K, 1.0f, A.data() + b * s.M * s.K, lda,
                                    B.data() + b * s.K * s.N, ldb, 0.0f,
                                    C.data() + b * s.M * s.N, ldc);
      if (st != dnnl_success) {
        std::fprintf(stderr, "gemm_peak: dnnl_sgemm failed on %s (status %d)\n", s.name, int(st));
        std::exit(1);
      }
    }
  };
  return measure(call, 2.0 * s.M * s.N * s.K * s.batch, samples, min_ms);
}

Result run_bf16(const Shape& s, dnnl::engine& eng, dnnl::stream& strm, int samples, double min_ms) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  dnnl::memory::desc a_md({s.M, s.K}, dt::bf16, s.ta == 'N' ? tag::ab : tag::ba);
  dnnl::memory::desc b_md({s.K, s.N}, dt::bf16, s.tb == 'N' ? tag::ab : tag::ba);
  dnnl::memory::desc c_md({s.M, s.N}, dt::f32, tag::ab);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), eng);
  dnnl::matmul mm(pd);
  dnnl::memory a(a_md, eng), b(b_md, eng), c(c_md, eng);
  // bf16 bit patterns of small values: truncated fp32
  auto fill_bf16 = [](dnnl::memory& m, int64_t n, uint64_t seed) {
    std::vector<float> f(n);
    fill(f, seed);
    auto* p = static_cast<uint16_t*>(m.get_data_handle());
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &f[i], 4);
      p[i] = static_cast<uint16_t>(u >> 16);
    }
  };
  fill_bf16(a, s.M * s.K, 1);
  fill_bf16(b, s.K * s.N, 2);
  auto call = [&] {
    mm.execute(strm, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    strm.wait();
  };
  return measure(call, 2.0 * s.M * s.N * s.K, samples, min_ms);
}

// Sigma's own bf16 GEMM (kernels/cpu/gemm.h): fp32 operands converted to bf16 on every call,
// then oneDNN's bf16 matmul; the gap to run_bf16 is the conversion's cost.
Result run_sigma_bf16(const Shape& s, int samples, double min_ms) {
  std::vector<float> A(s.M * s.K), B(s.K * s.N), C(s.M * s.N);
  fill(A, 1);
  fill(B, 2);
  const int64_t lda = s.ta == 'N' ? s.K : s.M, ldb = s.tb == 'N' ? s.N : s.K;
  auto call = [&] {
    sigma::cpu::gemm_bf16(s.ta == 'T', s.tb == 'T', s.M, s.N, s.K, 1.0f, A.data(), lda, B.data(),
                          ldb, 0.0f, C.data(), s.N);
  };
  return measure(call, 2.0 * s.M * s.N * s.K, samples, min_ms);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, samples = 7;
  double min_ms = 150;
  bool bf16 = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gemm_peak: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--threads") threads = std::atoi(next());
    else if (a == "--samples") samples = std::atoi(next());
    else if (a == "--min-ms") min_ms = std::atof(next());
    else if (a == "--no-bf16") bf16 = false;
    else {
      std::fprintf(stderr, "usage: gemm_peak [--threads N] [--samples N] [--min-ms MS] [--no-bf16]\n");
      return 2;
    }
  }
  if (threads < 1 || samples < 1 || min_ms <= 0) {
    std::fprintf(stderr, "gemm_peak: --threads, --samples and --min-ms must be positive\n");
    return 2;
  }
  omp_set_num_threads(threads);

  nlohmann::json shapes = nlohmann::json::object(), shapes_bf16 = nlohmann::json::object(),
                 shapes_sigma = nlohmann::json::object();
  double peak = 0, peak_bf16 = 0;
  std::string peak_at, peak_bf16_at;
  for (const auto& s : kShapes) {
    Result r = run_f32(s, samples, min_ms);
    shapes[s.name] = to_json(s, r);
    if (r.median > peak) peak = r.median, peak_at = s.name;
  }
  // Without oneDNN's bf16 products (an AVX2-only CPU such as Zen 3) Sigma's bf16 products widen
  // their operands to fp32 and run sgemm (kernels/cpu/matmul.h): their limit is sgemm's.
  const bool bf16_native = sigma::cpu::native_bf16();
  if (bf16) {
    dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    dnnl::stream strm(eng);
    for (const auto& s : kShapes) {
      if (!s.bf16) continue;
      if (bf16_native) {
        Result r = run_bf16(s, eng, strm, samples, min_ms);
        shapes_bf16[s.name] = to_json(s, r);
        if (r.median > peak_bf16) peak_bf16 = r.median, peak_bf16_at = s.name;
      }
      shapes_sigma[s.name] = to_json(s, run_sigma_bf16(s, samples, min_ms));
    }
    if (!bf16_native) peak_bf16 = peak, peak_bf16_at = "sgemm " + peak_at;
  }
  const dnnl_version_t* v = dnnl_version();
  nlohmann::json out = {
      {"gemm_peak_gflops", peak},
      {"gemm_peak_shape", peak_at},
      {"threads", threads},
      {"samples", samples},
      {"onednn", std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                     std::to_string(v->patch)},
      {"shapes", shapes},
  };
  if (bf16) {
    out["bf16_native"] = bf16_native;  // false: bf16_peak_gflops is the fp32 sgemm peak
    out["bf16_peak_gflops"] = peak_bf16;
    out["bf16_peak_shape"] = peak_bf16_at;
    out["bf16_shapes"] = shapes_bf16;
    out["sigma_bf16_shapes"] = shapes_sigma;  // with the per-call fp32 -> bf16 conversion
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
