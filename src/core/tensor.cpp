#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include <sys/mman.h>

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

// Memory fresh from the system is zero already and stays unwritten, so pages nobody writes
// cost no memory (a ZeRO-3 rank's values of the tensors it does not own). Tensors of 4 MiB and
// more are mapped on their own, 2 MiB-aligned and marked for transparent huge pages: ZeRO's
// releases (ops::zero_release) hand their pages back every step and the next write faults
// them in again, 512 times fewer faults with huge pages (at 12 us a fault on this machine's
// VMs, 2/3 of a ZeRO-3 step at d = 512 was faults: issue 38). Smaller ones come from calloc,
// aligned by hand. Either way the block's base (and a mapping's length) is kept just before
// the aligned pointer.
namespace {
constexpr size_t kHuge = size_t(2) << 20;
struct MapHeader {  // just before a mapped tensor's first byte
  void* base;
  size_t length;
};
}  // namespace

void* host_alloc(size_t nbytes) {
  if (nbytes >= 2 * kHuge) {
    const size_t length = nbytes + 2 * kHuge;
    void* m = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t a = (reinterpret_cast<uintptr_t>(m) + kHuge) & ~uintptr_t(kHuge - 1);
    madvise(reinterpret_cast<void*>(a), (nbytes + kHuge - 1) & ~(kHuge - 1), MADV_HUGEPAGE);
    reinterpret_cast<MapHeader*>(a)[-1] = {m, length};
    return reinterpret_cast<void*>(a);
  }
  size_t rounded = (nbytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  void* raw = std::calloc(1, rounded + 64);
  if (!raw) throw std::bad_alloc();
  const uintptr_t a = (reinterpret_cast<uintptr_t>(raw) + 64) & ~uintptr_t(63);  // >= raw + 16
  reinterpret_cast<MapHeader*>(a)[-1] = {raw, 0};
  return reinterpret_cast<void*>(a);
}

void host_free(void* p) {
  if (!p) return;
  const MapHeader h = static_cast<MapHeader*>(p)[-1];
  if (h.length)
    munmap(h.base, h.length);
  else
    std::free(h.base);
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
