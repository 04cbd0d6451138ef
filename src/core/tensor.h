// Tensor: an owned, 64-byte aligned, contiguous buffer with a dtype, a shape and the device
// its memory lives on. Kernels never see this type; they take raw pointers and sizes (STYLE.md
// rule 1).
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

// Where a buffer lives. Core owns host memory; a device backend (kernels/ops.h) installs its
// device's allocator at start-up, so core needs nothing from kernels. Guard is the guard
// backend's memory (kernels/guard/): host pages that are inaccessible except while one of its
// ops runs, the stand-in for an accelerator's memory that host code cannot dereference. Cuda
// is the CUDA backend's, named here so that adding that backend changes nothing outside
// kernels/ (docs/ops.md); until one installs its allocator, a Cuda tensor is refused.
enum class Device : uint8_t { Host, Guard, Cuda };
inline constexpr size_t kDeviceCount = 3;  // the values of Device
const char* device_name(Device d);

// A device's allocator: alloc returns zeroed, 64-byte aligned memory and never null (it throws
// std::bad_alloc). Host's is host_alloc/host_free and cannot be replaced.
struct DeviceAllocator {
  void* (*alloc)(size_t bytes);
  void (*free)(void* p);
};
void set_device_allocator(Device d, DeviceAllocator a);  // throws Error for Host
const DeviceAllocator& device_allocator(Device d);        // throws Error if none installed
void* host_alloc(size_t bytes);
void host_free(void* p);

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"

struct TensorFree {  // the allocator's free, kept with the buffer it frees
  void (*fn)(void*) = nullptr;
  void operator()(std::byte* p) const { fn(p); }
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape, Device device = Device::Host);  // zero-filled
  static Tensor f32(Shape shape) { return Tensor(DType::F32, std::move(shape)); }

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor clone() const;  // host tensors only (as zero()); ops::clone copies on any device

  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  bool empty() const { return numel_ == 0; }

  // Host access to the elements. A tensor in device memory is read and written only by ops
  // (kernels/ops.h; ops::download, ops::to_host): here it throws sigma::Error naming its dtype,
  // shape and device, at the access rather than as a fault at some later dereference. For a
  // host tensor (every tensor of the cpu backend) the check is one predictable branch.
  template <class T> T* data() { return reinterpret_cast<T*>(host_bytes()); }
  template <class T> const T* data() const { return reinterpret_cast<const T*>(host_bytes()); }
  std::byte* bytes() { return host_bytes(); }
  const std::byte* bytes() const { return host_bytes(); }
  float* f() { return data<float>(); }
  const float* f() const { return data<float>(); }

  // The memory's address on whichever device holds it, unchecked: only for an op's argument
  // (ops::*, a communicator's buffer, a kernel view), never dereferenced by host code. The
  // guard backend (kernels/guard/guard.h) faults where host code does.
  template <class T> T* dev() { return reinterpret_cast<T*>(buf_.get()); }
  template <class T> const T* dev() const { return reinterpret_cast<const T*>(buf_.get()); }
  std::byte* dev_bytes() { return buf_.get(); }
  const std::byte* dev_bytes() const { return buf_.get(); }
  float* dev_f() { return dev<float>(); }
  const float* dev_f() const { return dev<float>(); }

  void zero();
  // Same element count, new shape (no copy).
  void reshape(Shape shape);

 private:
  std::byte* host_bytes() const {
    if (device_ != Device::Host) [[unlikely]] refuse_host_access();
    return buf_.get();
  }
  [[noreturn]] void refuse_host_access() const;

  DType dtype_ = DType::F32;
  Device device_ = Device::Host;
  Shape shape_;
  int64_t numel_ = 0;
  std::unique_ptr<std::byte[], TensorFree> buf_;
};

}  // namespace sigma
