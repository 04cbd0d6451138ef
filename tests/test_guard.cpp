// The guard backend (kernels/guard/guard.h): device tensors that host code cannot touch outside
// an op. It computes what the cpu backend computes, and a host read of its memory, planted on
// purpose across one op's boundary, kills the process with a message naming the guard.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/guard/guard.h"
#include "kernels/ops.h"
#include "model/model.h"
#include "step_config.h"

using namespace sigma;

namespace {

struct UseGuard {  // the guard for one test, then the cpu backend again
  UseGuard() { ops::use_backend(ops::BackendKind::Guard); }
  ~UseGuard() { ops::use_backend(ops::BackendKind::Cpu); }
};

std::vector<float> iota_floats(int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = scale * float((i * 37) % 101 - 50);
  return v;
}

}  // namespace

TEST(Guard, TensorsLiveOnWholePagesAndRoundTrip) {
  UseGuard g;
  EXPECT_EQ(ops::device(), Device::Guard);
  Tensor t = ops::empty(DType::F32, {3, 5});
  EXPECT_EQ(t.device(), Device::Guard);
  EXPECT_TRUE(guard::owns(t.bytes()));
  EXPECT_EQ(uintptr_t(t.bytes()) % 4096, 0u);  // page-aligned: nothing else shares its pages
  const std::vector<float> in = iota_floats(15, 0.5f);
  ops::upload(t, in.data(), in.size() * 4);
  const Tensor h = ops::to_host(t);
  EXPECT_EQ(h.device(), Device::Host);
  EXPECT_EQ(std::vector<float>(h.f(), h.f() + 15), in);
  Tensor c = ops::clone(t);  // device to device
  ops::zero(t);
  std::vector<float> back(15, 1.0f), zeros(15, 0.0f);
  ops::download(back.data(), c, 60);
  EXPECT_EQ(back, in);
  ops::download(back.data(), t, 60);
  EXPECT_EQ(back, zeros);
  EXPECT_THROW(ops::download(back.data(), t, 64), Error);  // bounds checked
}

TEST(Guard, OpsComputeWhatCpuComputes) {
  const int64_t N = 7, in = 9, out = 5;
  const std::vector<float> x = iota_floats(N * in, 0.01f), w = iota_floats(in * out, 0.02f);
  std::vector<float> want(size_t(N * out));
  ops::linear_forward(want.data(), x.data(), w.data(), nullptr, N, in, out);
  UseGuard g;
  Tensor dx = ops::empty(DType::F32, {N, in}), dw = ops::empty(DType::F32, {in, out});
  Tensor dy = ops::empty(DType::F32, {N, out});
  ops::upload(dx, x.data(), x.size() * 4);
  ops::upload(dw, w.data(), w.size() * 4);
  ops::linear_forward(dy.f(), dx.f(), dw.f(), nullptr, N, in, out);
  std::vector<float> got(size_t(N * out));
  ops::download(got.data(), dy, got.size() * 4);
  EXPECT_EQ(got, want);
  EXPECT_EQ(ops::sum_sq(dx.f(), dx.numel()), ops::backend(ops::BackendKind::Cpu).sum_sq(x.data(), N * in));
}

TEST(Guard, FreedPagesComeBackZeroed) {
  UseGuard g;
  const size_t before = guard::live_bytes();
  {
    Tensor a = ops::empty(DType::F32, {2048});
    ops::fill(a.f(), 3.0f, 2048);
    EXPECT_GE(guard::live_bytes(), before + 8192);
  }
  EXPECT_EQ(guard::live_bytes(), before);
  Tensor b = ops::empty(DType::F32, {2048});  // likely the same pages: zero again
  EXPECT_EQ(ops::sum_sq(b.f(), 2048), 0.0);
}

// The planted break: host code reads a device tensor between two ops. It must die at once,
// naming the guard (and printing a backtrace).
TEST(GuardDeathTest, HostReadOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        UseGuard g;
        Tensor t = ops::empty(DType::F32, {16});
        ops::fill(t.f(), 1.0f, 16);
        volatile float v = t.f()[3];  // the host touch
        std::printf("read %f\n", double(v));
      },
      "sigma guard backend: host code touched device memory");
}

// The same through one op whose boundary is broken: a guard table whose fill runs the cpu
// kernel without opening the arena (what a backend op that forgot its device would do).
TEST(GuardDeathTest, AnOpWithoutItsBoundaryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  static ops::Backend broken = ops::backend(ops::BackendKind::Guard);
  broken.fill = ops::backend(ops::BackendKind::Cpu).fill;
  EXPECT_DEATH(
      {
        UseGuard g;
        Tensor t = ops::empty(DType::F32, {16});
        ops::use_backend(broken);
        ops::fill(t.f(), 1.0f, 16);
      },
      "sigma guard backend");
}

// The other direction: an op handed host memory where device memory belongs (what a device
// kernel given a host pointer would crash on, or silently read garbage from) is counted, and
// is fatal under SIGMA_GUARD_STRICT=1 (the guard job's setting). upload's source and
// download's destination are host memory by design and are not counted.
TEST(Guard, AnOpGivenHostMemoryIsCounted) {
  UseGuard g;
  Tensor t = ops::empty(DType::F32, {16});
  std::vector<float> host(16, 2.0f);
  const long long before = guard::host_args();
  ops::upload(t, host.data(), 16 * sizeof(float));
  ops::download(host.data(), t, 16 * sizeof(float));
  ops::copy(t.f(), t.f(), 16);
  EXPECT_EQ(guard::host_args(), before) << "device memory and the by-design host sides";
  if (guard::host_args() != before) return;  // strict mode would have aborted already
  if (const char* s = std::getenv("SIGMA_TEST_BACKEND"); s && std::string(s) == "guard-strict") return;
  ops::copy(t.f(), host.data(), 16);  // host memory as an op's source
  EXPECT_EQ(guard::host_args(), before + 1);
  // An attention view carries its memory inside: one sequence, one head of width 16, one row.
  const ops::AttnShape shape(1, 1, 1, 1, 16);
  Tensor out = ops::empty(DType::F32, {16}), lse = ops::empty(DType::F32, {1});
  const ops::AttnOperand dev{t.f(), 16, 16}, on_host{host.data(), 16, 16};
  ops::flash_attention_forward(out.f(), lse.f(), dev, dev, dev, shape, 0.25f);
  EXPECT_EQ(guard::host_args(), before + 1) << "device views";
  ops::flash_attention_forward(out.f(), lse.f(), dev, on_host, dev, shape, 0.25f);
  EXPECT_EQ(guard::host_args(), before + 2) << "a key view over host memory";
}

TEST(GuardDeathTest, StrictModeStopsAtAnOpGivenHostMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        ::setenv("SIGMA_GUARD_STRICT", "1", 1);  // read once, in the re-executed child
        UseGuard g;
        Tensor t = ops::empty(DType::F32, {16});
        std::vector<float> host(16, 2.0f);
        ops::copy(t.f(), host.data(), 16);
      },
      "an op was given host memory");
}

// A model built under the guard: its parameters are device tensors, and a forward and backward
// pass run (every host touch of them faults). It found the FFN backward's host std::fill of its
// scratch (now ops::fill).
TEST(Guard, ModelTensorsAreDeviceTensors) {
  UseGuard g;
  const ModelConfig c = sigma::testing::step_config(1);  // dense blocks and an RRE block
  Model m(c, 3);
  for (const Param& p : m.params().all()) {
    EXPECT_EQ(p.value.device(), Device::Guard) << p.name;
    EXPECT_EQ(p.grad.device(), Device::Guard) << p.name;
  }
  Batch b;
  b.resize(2, 8);
  for (size_t i = 0; i < b.tokens.size(); ++i) b.tokens[i] = int32_t(i % 17), b.targets[i] = int32_t((i + 1) % 17);
  b.domain = {0, 1};
  std::vector<float> loss(16), weight(16, 1.0f / 16);
  m.forward(b, loss.data());
  for (float l : loss) EXPECT_GT(l, 0.0f);
  m.params().zero_grad();  // and a backward: gradients reach the parameters on the device
  m.forward(b, loss.data(), weight.data());
  m.backward(b);
  double gsq = 0;
  for (const Param& p : m.params().all()) gsq += ops::sum_sq(p.grad.f(), p.grad.numel());
  EXPECT_GT(gsq, 0.0);
  EXPECT_EQ(m.logits().size(), size_t(16 * 17));
}

// What the guard costs per op (two mprotect calls over the live pages): reported, not bounded.
TEST(Guard, CostPerOp) {
  Tensor hx = Tensor::f32({1024});
  const int reps = 2000;
  auto time = [&](float* p) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) ops::fill(p, float(i), 1024);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  const double cpu = time(hx.f());
  UseGuard g;
  Tensor dx = ops::empty(DType::F32, {1024});
  const double guarded = time(dx.f());
  RecordProperty("cpu_fill_us", std::to_string(cpu * 1e6));
  RecordProperty("guard_fill_us", std::to_string(guarded * 1e6));
  std::printf("fill of 1024 floats: cpu %.2f us, guard %.2f us (%zu live guard bytes)\n", cpu * 1e6,
              guarded * 1e6, guard::live_bytes());
}
