// Tests read and write engine tensors (parameters, gradients, activations) through the ops
// front, never through their memory: under the guard backend (SIGMA_TEST_BACKEND=guard,
// docs/ops.md) a device tensor cannot be touched outside an op, as on a GPU.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "core/tensor.h"
#include "kernels/ops.h"

namespace sigma::testing {

// A host copy of a tensor's floats.
inline std::vector<float> host_floats(const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  ops::download(v.data(), t, v.size() * sizeof(float));
  return v;
}

// A host copy of a tensor's bytes, whatever its type.
inline std::vector<uint8_t> host_bytes(const Tensor& t) {
  std::vector<uint8_t> v(size_t(t.numel()) * dtype_size(t.dtype()));
  ops::download(v.data(), t, v.size());
  return v;
}

// Appends a tensor's floats to `out`.
inline void append_floats(std::vector<float>& out, const Tensor& t) {
  const std::vector<float> v = host_floats(t);
  out.insert(out.end(), v.begin(), v.end());
}

inline float element(const Tensor& t, int64_t i) {
  float v;
  ops::download(&v, t, sizeof v, size_t(i) * sizeof v);
  return v;
}

inline void set_element(Tensor& t, int64_t i, float v) {
  ops::upload(t, &v, sizeof v, size_t(i) * sizeof v);
}

// Downloads the floats, lets `edit` change them on the host, uploads them back.
inline void edit_floats(Tensor& t, const std::function<void(float*, int64_t)>& edit) {
  std::vector<float> v = host_floats(t);
  edit(v.data(), t.numel());
  ops::upload(t, v.data(), v.size() * sizeof(float));
}

}  // namespace sigma::testing
