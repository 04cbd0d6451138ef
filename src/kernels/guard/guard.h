// The guard backend (`train.backend = guard`; docs/ops.md): the cpu kernels over memory that
// host code cannot touch. Its allocations are whole pages of one reserved arena, kept
// PROT_NONE except while one of its ops runs: an op's entry makes the arena's used pages
// readable and writable, its exit makes them inaccessible again (ops in flight are counted, so
// concurrent ops from OpenMP threads nest). A host read or write of a device tensor outside an
// op faults at once; the SIGSEGV handler the arena installs names the guard, the address and
// the allocation, prints a backtrace and re-raises. So a test suite run under the guard proves
// that no code outside kernels/ dereferences device memory, without a device. It also checks
// the other direction: an op given a host address where device memory belongs is counted.
// SIGMA_TEST_BACKEND=guard-lite keeps the arena open (no page protection, no cost per op) and
// the rest: tensors on Device::Guard, so Tensor's host accessors refuse them (core/tensor.h),
// and an op given host memory is fatal. For tests too long for two mprotect calls per op.
#pragma once
#include <cstddef>

namespace sigma::guard {

// True for an address inside the arena (device memory of the guard backend).
bool owns(const void* p);
// Bytes of live allocations (whole pages): for tests.
size_t live_bytes();
// Memory arguments of ops that were host addresses (upload's source and download's destination
// excepted): each would be an invalid address on a device. SIGMA_GUARD_STRICT=1 makes the first
// one fatal, with a backtrace (so does SIGMA_TEST_BACKEND=guard-strict, the guard job's setting).
long long host_args();

}  // namespace sigma::guard
