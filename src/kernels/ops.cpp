#include "kernels/ops.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include "core/error.h"

namespace sigma {
namespace cpu {
extern const ops::Backend kBackend;  // kernels/cpu/backend.cpp
}
namespace ref {
extern const ops::Backend kBackend;  // kernels/ref/backend.cpp
}
namespace guard {
extern const ops::Backend kBackend;  // kernels/guard/backend.cpp
}

namespace ops {

// The address of a table in another file is a constant: no static-initialisation order issue.
constinit const Backend* detail::active = &cpu::kBackend;
constinit Precision detail::precision = Precision::Fp32;

const Backend& backend(BackendKind kind) {
  switch (kind) {
    case BackendKind::Cpu: return cpu::kBackend;
    case BackendKind::Ref: return ref::kBackend;
    case BackendKind::Guard: return guard::kBackend;
  }
  fail("unknown backend kind {}", int(kind));
}

const Backend& active_backend() { return *detail::active; }

namespace {
constexpr BackendKind kKinds[] = {BackendKind::Cpu, BackendKind::Ref, BackendKind::Guard};
}

std::vector<std::string> backend_list() {
  std::vector<std::string> names;
  for (BackendKind k : kKinds) names.push_back(backend(k).name);
  return names;
}

std::string backend_names() {
  std::string s;
  for (const std::string& n : backend_list()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

namespace {
// SIGMA_TEST_BACKEND=guard (or guard-strict, guard-lite: kernels/guard/guard.h): the tests run
// every cpu choice on the guard.
BackendKind resolve(BackendKind kind) {
  static const bool guard_for_cpu = [] {
    const char* e = std::getenv("SIGMA_TEST_BACKEND");
    return e && (std::strcmp(e, "guard") == 0 || std::strcmp(e, "guard-strict") == 0 ||
                 std::strcmp(e, "guard-lite") == 0);
  }();
  return kind == BackendKind::Cpu && guard_for_cpu ? BackendKind::Guard : kind;
}

// The table that owns each device's memory (the last one installed for it): transfers of a
// tensor go through its device's backend, whichever backend is active.
const Backend* g_owner[kDeviceCount] = {&cpu::kBackend};

const Backend& owner(Device d) {
  const Backend* b = size_t(d) < std::size(g_owner) ? g_owner[size_t(d)] : nullptr;
  SIGMA_CHECK(b, "no backend owns {} memory", device_name(d));
  return *b;
}

// Start-up: the guard job's environment applies before any tensor is made.
[[maybe_unused]] const bool g_env_applied = [] {
  if (resolve(BackendKind::Cpu) != BackendKind::Cpu) use_backend(BackendKind::Cpu);
  return true;
}();
}  // namespace

void use_backend(const Backend& b) {
  // A device backend's memory becomes that device's Tensor allocator; core owns host memory.
  if (b.device != Device::Host) set_device_allocator(b.device, {b.alloc, b.free});
  if (size_t(b.device) < std::size(g_owner)) g_owner[size_t(b.device)] = &b;
  detail::active = &b;
}

void use_backend(BackendKind kind) { use_backend(backend(resolve(kind))); }

std::jthread warm_up_in_background() {
  void (*warm_up)() = detail::active->warm_up;
  if (!warm_up) return {};
  return std::jthread(warm_up);
}

void use_backend(std::string_view name) {
  for (BackendKind k : kKinds)
    if (name == backend(k).name) return use_backend(k);
  fail("unknown ops backend '{}' (known: {})", name, backend_names());
}

namespace {
// Process-wide, not per thread: a decode step's kernels also run on OpenMP workers.
std::atomic<int> g_few_row_kernels{0};
std::atomic<int> g_batch_invariant{0};
}
FewRowKernels::FewRowKernels() : prev_(false) { g_few_row_kernels.fetch_add(1); }
FewRowKernels::~FewRowKernels() { g_few_row_kernels.fetch_sub(1); }
bool FewRowKernels::on() {
  return g_few_row_kernels.load(std::memory_order_relaxed) > 0 && !BatchInvariant::on();
}
BatchInvariant::BatchInvariant() { g_batch_invariant.fetch_add(1); }
BatchInvariant::~BatchInvariant() { g_batch_invariant.fetch_sub(1); }
bool BatchInvariant::on() { return g_batch_invariant.load(std::memory_order_relaxed) > 0; }

Device device() { return detail::active->device; }

Tensor empty(DType dtype, Shape shape) { return Tensor(dtype, std::move(shape), device()); }

Tensor to_device(const Tensor& host) {
  SIGMA_CHECK(host.device() == Device::Host, "to_device: the tensor is already on {}",
              device_name(host.device()));
  Tensor t(host.dtype(), host.shape(), device());
  upload(t, host.bytes(), host.nbytes());
  return t;
}

Tensor to_host(const Tensor& t) {
  Tensor h(t.dtype(), t.shape(), Device::Host);
  download(h.bytes(), t, t.nbytes());
  return h;
}

Tensor clone(const Tensor& t) {
  Tensor c(t.dtype(), t.shape(), t.device());
  if (t.nbytes()) owner(t.device()).copy_bytes(c.dev_bytes(), t.dev_bytes(), t.nbytes());
  return c;
}

namespace {
// Zeroes host bytes [b, e), handing their whole pages back to the system.
void release_host_bytes(uintptr_t b, uintptr_t e) {
  static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t pb = (b + page - 1) & ~(page - 1), pe = e & ~(page - 1);
  if (pe <= pb) return (void)std::memset(reinterpret_cast<void*>(b), 0, e - b);
  std::memset(reinterpret_cast<void*>(b), 0, pb - b);  // the partial pages at both ends
  std::memset(reinterpret_cast<void*>(pe), 0, e - pe);
  if (madvise(reinterpret_cast<void*>(pb), pe - pb, MADV_DONTNEED) != 0)
    std::memset(reinterpret_cast<void*>(pb), 0, pe - pb);
}
}  // namespace

void zero_release(Tensor& t) {
  if (t.device() != Device::Host) return zero(t);
  release_host_bytes(uintptr_t(t.bytes()), uintptr_t(t.bytes()) + t.nbytes());
}

void zero_release(Tensor& t, int64_t begin, int64_t end) {
  SIGMA_CHECK(t.dtype() == DType::F32 && 0 <= begin && begin <= end && end <= t.numel(),
              "zero_release: elements [{}, {}) of a tensor of {}", begin, end, t.numel());
  if (begin == end) return;
  if (t.device() != Device::Host) return owner(t.device()).fill(t.dev_f() + begin, 0.0f, end - begin);
  const uintptr_t b = uintptr_t(t.bytes()) + uintptr_t(begin) * sizeof(float);
  release_host_bytes(b, b + uintptr_t(end - begin) * sizeof(float));
}

size_t advise_huge_pages(Tensor& t) {
  if (t.device() != Device::Host) return 0;
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  constexpr int kCollapse = 25;  // MADV_COLLAPSE (Linux 6.1), absent from older headers
  const uintptr_t b = uintptr_t(t.bytes()), e = b + t.nbytes();
  const uintptr_t hb = (b + kHuge - 1) & ~(kHuge - 1), he = e & ~(kHuge - 1);
  if (he <= hb) return 0;
  void* p = reinterpret_cast<void*>(hb);
  if (madvise(p, he - hb, MADV_HUGEPAGE) != 0) return 0;  // a hint: failures are fine
  return madvise(p, he - hb, kCollapse) == 0 ? size_t(he - hb) : 0;
}

// Host tensors too through their owner's fill: the CPU backend's runs a large fill (a step's
// gradients, hundreds of MB) on its threads.
void zero(Tensor& t) {
  const bool host = t.device() == Device::Host;
  if (host && uintptr_t(t.bytes()) % alignof(float) != 0) return t.zero();
  // Bytes of zero are 0.0f, 0 and +0 bf16 alike: fill as floats, then the odd tail bytes.
  const Backend& b = owner(t.device());
  const size_t n = t.nbytes();
  if (n >= 4) b.fill(reinterpret_cast<float*>(t.dev_bytes()), 0.0f, int64_t(n / 4));
  if (n % 4) {
    const unsigned char z[4] = {};
    b.upload(t.dev_bytes() + n / 4 * 4, z, n % 4);
  }
}

void upload(Tensor& dst, const void* host_src, size_t bytes, size_t offset) {
  SIGMA_CHECK(offset <= dst.nbytes() && bytes <= dst.nbytes() - offset,
              "upload of {} bytes at {} into a tensor of {} bytes", bytes, offset, dst.nbytes());
  if (bytes) owner(dst.device()).upload(dst.dev_bytes() + offset, host_src, bytes);
}

void download(void* host_dst, const Tensor& src, size_t bytes, size_t offset) {
  SIGMA_CHECK(offset <= src.nbytes() && bytes <= src.nbytes() - offset,
              "download of {} bytes at {} from a tensor of {} bytes", bytes, offset, src.nbytes());
  if (bytes) owner(src.device()).download(host_dst, src.dev_bytes() + offset, bytes);
}

void use_precision(Precision p) { detail::precision = p; }

void use_precision(std::string_view name) {
  if (name == "fp32") return use_precision(Precision::Fp32);
  if (name == "bf16") return use_precision(Precision::Bf16);
  fail("unknown precision '{}' (known: fp32, bf16)", name);
}

Precision precision() { return detail::precision; }

}  // namespace ops
}  // namespace sigma
