#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace sigma {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U16: return 2;
    case DType::U8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U16: return "U16";
    case DType::U8: return "U8";
  }
  return "?";
}

DType dtype_from_name(const std::string& n) {
  for (DType t : {DType::F32, DType::BF16, DType::I32, DType::I64, DType::U16, DType::U8})
    if (n == dtype_name(t)) return t;
  fail("unsupported dtype '{}' (supported: F32, BF16, I32, I64, U16, U8)", n);
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    SIGMA_CHECK(d >= 0, "negative dimension in shape");
    n *= d;
  }
  return n;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

const char* device_name(Device d) {
  switch (d) {
    case Device::Host: return "host";
    case Device::Guard: return "guard";
    case Device::Cuda: return "cuda";
  }
  return "?";
}

// calloc, not aligned_alloc + memset: memory fresh from the system (glibc maps large blocks)
// is zero already and calloc leaves it unwritten, so pages nobody writes cost no memory (a
// ZeRO-3 rank's values of the tensors it does not own). Aligned by hand: the block calloc
// returned is kept in the 8 bytes before the aligned pointer.
void* host_alloc(size_t nbytes) {
  size_t rounded = (nbytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  void* raw = std::calloc(1, rounded + 64);
  if (!raw) throw std::bad_alloc();
  const uintptr_t a = (reinterpret_cast<uintptr_t>(raw) + 64) & ~uintptr_t(63);
  reinterpret_cast<void**>(a)[-1] = raw;
  return reinterpret_cast<void*>(a);
}

void host_free(void* p) {
  if (p) std::free(static_cast<void**>(p)[-1]);
}

namespace {
constexpr size_t kDevices = kDeviceCount;
DeviceAllocator g_allocators[kDevices] = {{&host_alloc, &host_free}};
}  // namespace

void set_device_allocator(Device d, DeviceAllocator a) {
  SIGMA_CHECK(d != Device::Host, "the host allocator belongs to core and cannot be replaced");
  SIGMA_CHECK(a.alloc && a.free, "device {}: an allocator needs alloc and free", device_name(d));
  const size_t i = size_t(d);
  SIGMA_CHECK(i < kDevices, "device {} is unknown to core/tensor.cpp", i);
  g_allocators[i] = a;
}

const DeviceAllocator& device_allocator(Device d) {
  SIGMA_CHECK(size_t(d) < kDevices, "device {} is unknown to core/tensor.cpp", size_t(d));
  const DeviceAllocator& a = g_allocators[size_t(d)];
  SIGMA_CHECK(a.alloc, "no allocator for device {}: choose its backend first (ops::use_backend)",
              device_name(d));
  return a;
}

Tensor::Tensor(DType dtype, Shape shape, Device device)
    : dtype_(dtype), device_(device), shape_(std::move(shape)), numel_(shape_numel(shape_)) {
  const DeviceAllocator& a = device_allocator(device_);
  buf_ = std::unique_ptr<std::byte[], TensorFree>(static_cast<std::byte*>(a.alloc(nbytes())),
                                                  TensorFree{a.free});
}

void Tensor::refuse_host_access() const {
  fail("host code accessed a {} tensor {} in {} memory, which only ops may touch: use ops:: or "
       "download it (ops::download, ops::to_host)",
       dtype_name(dtype_), shape_str(shape_), device_name(device_));
}

Tensor Tensor::clone() const {
  const std::byte* from = bytes();  // host tensors only
  Tensor t(dtype_, shape_, Device::Host);
  if (nbytes()) std::memcpy(t.bytes(), from, nbytes());
  return t;
}

void Tensor::zero() {
  std::byte* p = bytes();  // host tensors only
  if (nbytes()) std::memset(p, 0, nbytes());
}

void Tensor::reshape(Shape shape) {
  SIGMA_CHECK(shape_numel(shape) == numel_, "reshape {} -> {} changes the element count",
              shape_str(shape_), shape_str(shape));
  shape_ = std::move(shape);
}

}  // namespace sigma
