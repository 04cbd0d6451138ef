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
#include "thread_comm.h"

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
  EXPECT_TRUE(guard::owns(t.dev_bytes()));
  EXPECT_EQ(uintptr_t(t.dev_bytes()) % 4096, 0u);  // page-aligned: nothing else shares its pages
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
  ops::linear_forward(dy.dev_f(), dx.dev_f(), dw.dev_f(), nullptr, N, in, out);
  std::vector<float> got(size_t(N * out));
  ops::download(got.data(), dy, got.size() * 4);
  EXPECT_EQ(got, want);
  EXPECT_EQ(ops::sum_sq(dx.dev_f(), dx.numel()), ops::backend(ops::BackendKind::Cpu).sum_sq(x.data(), N * in));
}

TEST(Guard, FreedPagesComeBackZeroed) {
  UseGuard g;
  const size_t before = guard::live_bytes();
  {
    Tensor a = ops::empty(DType::F32, {2048});
    ops::fill(a.dev_f(), 3.0f, 2048);
    EXPECT_GE(guard::live_bytes(), before + 8192);
  }
  EXPECT_EQ(guard::live_bytes(), before);
  Tensor b = ops::empty(DType::F32, {2048});  // likely the same pages: zero again
  EXPECT_EQ(ops::sum_sq(b.dev_f(), 2048), 0.0);
}

// The planted break: host code reads a device tensor between two ops. It must die at once,
// naming the guard (and printing a backtrace).
TEST(GuardDeathTest, HostReadOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        UseGuard g;
        Tensor t = ops::empty(DType::F32, {16});
        ops::fill(t.dev_f(), 1.0f, 16);
        volatile float v = t.dev_f()[3];  // the host touch, through the unchecked address
        std::printf("read %f\n", double(v));
      },
      "sigma guard backend: host code touched device memory");
}

// Tensor's host accessors refuse a device tensor at the access, naming it, before any
// dereference (issue 37 item 12): the rule holds by construction, not only where a test
// happens to read the memory. The unchecked address (dev_f) is for ops.
TEST(Guard, HostAccessorsRefuseADeviceTensor) {
  UseGuard g;
  Tensor t = ops::empty(DType::F32, {3, 5});
  const Tensor& ct = t;
  const std::string msg = [&] {
    try {
      (void)t.f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  }();
  EXPECT_NE(msg.find("F32 tensor [3, 5] in guard memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("use ops:: or download"), std::string::npos) << msg;
  EXPECT_THROW((void)ct.f(), Error);
  EXPECT_THROW((void)t.data<int32_t>(), Error);
  EXPECT_THROW((void)ct.data<float>(), Error);
  EXPECT_THROW((void)t.bytes(), Error);
  EXPECT_THROW((void)ct.bytes(), Error);
  EXPECT_THROW((void)t.clone(), Error);
  EXPECT_THROW(t.zero(), Error);
  ops::fill(t.dev_f(), 2.0f, t.numel());  // the address for an op: unchecked
  const Tensor h = ops::to_host(t);       // host tensors: read freely
  EXPECT_EQ(h.f()[14], 2.0f);
  EXPECT_EQ(h.clone().f()[0], 2.0f);
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
        ops::fill(t.dev_f(), 1.0f, 16);
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
  ops::copy(t.dev_f(), t.dev_f(), 16);
  EXPECT_EQ(guard::host_args(), before) << "device memory and the by-design host sides";
  if (guard::host_args() != before) return;  // strict mode would have aborted already
  if (const char* s = std::getenv("SIGMA_TEST_BACKEND"); s && std::string(s) == "guard-strict") return;
  ops::copy(t.dev_f(), host.data(), 16);  // host memory as an op's source
  EXPECT_EQ(guard::host_args(), before + 1);
  // An attention view carries its memory inside: one sequence, one head of width 16, one row.
  const ops::AttnShape shape(1, 1, 1, 1, 16);
  Tensor out = ops::empty(DType::F32, {16}), lse = ops::empty(DType::F32, {1});
  const ops::AttnOperand dev{t.dev_f(), 16, 16}, on_host{host.data(), 16, 16};
  ops::flash_attention_forward(out.dev_f(), lse.dev_f(), dev, dev, dev, shape, 0.25f);
  EXPECT_EQ(guard::host_args(), before + 1) << "device views";
  ops::flash_attention_forward(out.dev_f(), lse.dev_f(), dev, on_host, dev, shape, 0.25f);
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
        ops::copy(t.dev_f(), host.data(), 16);
      },
      "an op was given host memory");
}

// guard-lite (the long tests' mode: no page protection) keeps the other two checks: Tensor's
// host accessors refuse its tensors, and an op given host memory is fatal.
TEST(GuardDeathTest, LiteModeKeepsTheAccessorAndHostArgumentChecks) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        ::setenv("SIGMA_TEST_BACKEND", "guard-lite", 1);  // read once, in the re-executed child
        UseGuard g;
        Tensor t = ops::empty(DType::F32, {16});
        ops::fill(t.dev_f(), 1.0f, 16);
        volatile float v = t.dev_f()[3];  // no page protection in lite mode: this read passes
        bool refused = false;
        try {
          (void)t.f();
        } catch (const Error&) {
          refused = true;
        }
        if (refused && v == 1.0f) {
          std::vector<float> host(16, 2.0f);
          ops::copy(t.dev_f(), host.data(), 16);
        }
      },
      "an op was given host memory");
}

// A model built under the guard: its parameters are device tensors, and a forward and backward
// pass run (every host touch of them faults). It found the FFN backward's host std::fill of its
// scratch (now ops::fill).
// The communicator's memory contract (dist/communicator.h): every collective takes device
// buffers (here guard memory, which would fault if a communicator touched it) or host buffers,
// mixed within a call, and gives the bits it gives on host buffers. Two thread ranks.
TEST(Guard, CollectivesTakeDeviceBuffersAndGiveTheHostBits) {
  UseGuard g;
  const long long host_args = guard::host_args();
  test_ranks::run_ranks(2, [](Communicator& c) {
    const int r = c.rank();
    const int64_t n = 6;
    auto dev = [](const std::vector<float>& v) {
      Tensor t = ops::empty(DType::F32, {int64_t(v.size())});
      ops::upload(t, v.data(), v.size() * 4);
      return t;
    };
    auto host = [](const Tensor& t) {
      const Tensor h = ops::to_host(t);
      return std::vector<float>(h.f(), h.f() + h.numel());
    };
    const std::vector<float> mine = iota_floats(2 * n, 0.1f * float(r + 1));
    // all_reduce_sum
    std::vector<float> want = mine;
    c.all_reduce_sum(want.data(), want.size());
    Tensor d = dev(mine);
    c.all_reduce_sum(d.dev_f(), size_t(d.numel()));
    EXPECT_EQ(host(d), want);
    // reduce_scatter_sum: device in, host out; host in, device out
    std::vector<float> rs(static_cast<size_t>(n)), rs2(static_cast<size_t>(n));
    c.reduce_scatter_sum(rs.data(), mine.data(), size_t(n));
    c.reduce_scatter_sum(rs2.data(), dev(mine).dev_f(), size_t(n));
    EXPECT_EQ(rs2, rs);
    Tensor rsd = ops::empty(DType::F32, {n});
    c.reduce_scatter_sum(rsd.dev_f(), mine.data(), size_t(n));
    EXPECT_EQ(host(rsd), rs);
    // reduce_scatter_sum_v: device in, host out; host in, device out
    const int64_t each[2] = {n, n};
    std::vector<float> rsv(static_cast<size_t>(n));
    c.reduce_scatter_sum_v(rsv.data(), dev(mine).dev_f(), each);
    EXPECT_EQ(rsv, rs);
    Tensor rsvd = ops::empty(DType::F32, {n});
    c.reduce_scatter_sum_v(rsvd.dev_f(), mine.data(), each);
    EXPECT_EQ(host(rsvd), rs);
    // all_gather, all_gather_v, all_to_all_v, broadcast: all on the device
    std::vector<float> ag(size_t(4 * n));
    c.all_gather(ag.data(), mine.data(), size_t(2 * n));
    Tensor agd = ops::empty(DType::F32, {4 * n});
    c.all_gather(agd.dev_f(), dev(mine).dev_f(), size_t(2 * n));
    EXPECT_EQ(host(agd), ag);
    const int64_t counts[2] = {3, 5};
    std::vector<float> agv(8);
    c.all_gather_v(agv.data(), mine.data(), counts);
    Tensor agvd = ops::empty(DType::F32, {8});
    c.all_gather_v(agvd.dev_f(), dev(mine).dev_f(), counts);
    EXPECT_EQ(host(agvd), agv);
    const int64_t sends[2][2] = {{2, 4}, {1, 3}};  // sends[r][q]: rank r to rank q
    const int64_t recv_counts[2] = {sends[0][r], sends[1][r]};
    std::vector<float> a2a(size_t(recv_counts[0] + recv_counts[1]));
    c.all_to_all_v(mine.data(), sends[r], a2a.data(), recv_counts);
    Tensor a2ad = ops::empty(DType::F32, {int64_t(a2a.size())});
    c.all_to_all_v(dev(mine).dev_f(), sends[r], a2ad.dev_f(), recv_counts);
    EXPECT_EQ(host(a2ad), a2a);
    Tensor b = dev(mine);
    c.broadcast(b.dev_f(), size_t(b.nbytes()), 1);
    EXPECT_EQ(host(b), iota_floats(2 * n, 0.2f));
  });
  EXPECT_EQ(guard::host_args(), host_args);  // staging hands ops no host memory as device's
}

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
  for (const Param& p : m.params().all()) gsq += ops::sum_sq(p.grad.dev_f(), p.grad.numel());
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
  const double guarded = time(dx.dev_f());
  RecordProperty("cpu_fill_us", std::to_string(cpu * 1e6));
  RecordProperty("guard_fill_us", std::to_string(guarded * 1e6));
  std::printf("fill of 1024 floats: cpu %.2f us, guard %.2f us (%zu live guard bytes)\n", cpu * 1e6,
              guarded * 1e6, guard::live_bytes());
}
