// Tensor: an owned, 64-byte aligned, contiguous buffer with a dtype and a shape.
// Kernels never see this type; they take raw pointers and sizes (STYLE.md rule 1).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"

namespace sigma {

enum class DType : uint8_t { F32, BF16, I32, I64, U16, U8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // safetensors spelling: "F32", "BF16", "I32", ...
DType dtype_from_name(const std::string& name);  // throws Error on unknown names

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);  // zero-filled
  static Tensor f32(Shape shape) { return Tensor(DType::F32, std::move(shape)); }

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor clone() const;

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  bool empty() const { return numel_ == 0; }

  template <class T> T* data() { return reinterpret_cast<T*>(buf_.get()); }
  template <class T> const T* data() const { return reinterpret_cast<const T*>(buf_.get()); }
  std::byte* bytes() { return buf_.get(); }
  const std::byte* bytes() const { return buf_.get(); }
  float* f() { return data<float>(); }
  const float* f() const { return data<float>(); }

  void zero();
  // Same element count, new shape (no copy).
  void reshape(Shape shape);

 private:
  struct Free { void operator()(std::byte* p) const; };
  DType dtype_ = DType::F32;
  Shape shape_;
  int64_t numel_ = 0;
  std::unique_ptr<std::byte[], Free> buf_;
};

// Aligned float scratch buffer for activations (owned, zero-initialised on resize).
std::unique_ptr<float[], void (*)(float*)> alloc_floats(size_t n);

}  // namespace sigma
