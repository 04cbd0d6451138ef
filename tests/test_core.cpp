#include <gtest/gtest.h>

#include "core/rng.h"
#include "core/tensor.h"

using namespace sigma;

TEST(Tensor, ZeroFilledAlignedAndCloneIsDeep) {
  Tensor t = Tensor::f32({3, 5});
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.f()) % 64, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.f()[i], 0.0f);
  t.f()[7] = 2.5f;
  Tensor c = t.clone();
  c.f()[7] = 1.0f;
  EXPECT_EQ(t.f()[7], 2.5f);
  EXPECT_THROW(t.reshape({4, 4}), Error);
}

// Device::Cuda is named in core ahead of its backend (docs/ops.md, "Adding a backend"): until a
// backend installs its allocator, a tensor there is refused with the device's name.
TEST(Tensor, ADeviceWithoutABackendIsRefused) {
  EXPECT_STREQ(device_name(Device::Cuda), "cuda");
  try {
    Tensor t(DType::F32, {4}, Device::Cuda);
    FAIL() << "a cuda tensor without a cuda backend";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no allocator for device cuda"), std::string::npos) << e.what();
  }
}

TEST(Rng, CounterBasedIsOrderIndependentAndRoughlyUniform) {
  EXPECT_EQ(rng_u64(1, 2, 3), rng_u64(1, 2, 3));
  EXPECT_NE(rng_u64(1, 2, 3), rng_u64(1, 2, 4));
  EXPECT_NE(rng_u64(1, 2, 3), rng_u64(1, 3, 3));
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    float z = rng_normal(7, 1, i);
    sum += z;
    sq += z * z;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.02);
  Rng r(3, 4);
  int hist[10] = {};
  for (int i = 0; i < 100000; ++i) hist[r.below(10)]++;
  for (int h : hist) EXPECT_NEAR(h, 10000, 500);
}
