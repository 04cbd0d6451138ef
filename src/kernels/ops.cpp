#include "kernels/ops.h"

#include <atomic>

#include "core/error.h"

namespace sigma {
namespace cpu {
extern const ops::Backend kBackend;  // kernels/cpu/backend.cpp
}
namespace ref {
extern const ops::Backend kBackend;  // kernels/ref/backend.cpp
}

namespace ops {

// The address of a table in another file is a constant: no static-initialisation order issue.
constinit const Backend* detail::active = &cpu::kBackend;
constinit Precision detail::precision = Precision::Fp32;

const Backend& backend(BackendKind kind) {
  switch (kind) {
    case BackendKind::Cpu: return cpu::kBackend;
    case BackendKind::Ref: return ref::kBackend;
  }
  fail("unknown backend kind {}", int(kind));
}

const Backend& active_backend() { return *detail::active; }

const char* backend_names() { return "cpu, ref"; }

void use_backend(const Backend& b) {
  // A device backend's memory becomes that device's Tensor allocator; core owns host memory.
  if (b.device != Device::Host) set_device_allocator(b.device, {b.alloc, b.free});
  detail::active = &b;
}

void use_backend(BackendKind kind) { use_backend(backend(kind)); }

void use_backend(std::string_view name) {
  for (BackendKind k : {BackendKind::Cpu, BackendKind::Ref})
    if (name == backend(k).name) return use_backend(k);
  fail("unknown ops backend '{}' (known: {})", name, backend_names());
}

namespace {
// Process-wide, not per thread: a decode step's kernels also run on OpenMP workers.
std::atomic<int> g_few_row_kernels{0};
}
FewRowKernels::FewRowKernels() : prev_(false) { g_few_row_kernels.fetch_add(1); }
FewRowKernels::~FewRowKernels() { g_few_row_kernels.fetch_sub(1); }
bool FewRowKernels::on() { return g_few_row_kernels.load(std::memory_order_relaxed) > 0; }

void use_precision(Precision p) { detail::precision = p; }

void use_precision(std::string_view name) {
  if (name == "fp32") return use_precision(Precision::Fp32);
  if (name == "bf16") return use_precision(Precision::Bf16);
  fail("unknown precision '{}' (known: fp32, bf16)", name);
}

Precision precision() { return detail::precision; }

}  // namespace ops
}  // namespace sigma
