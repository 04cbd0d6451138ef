// The guard backend (kernels/guard/guard.h): the arena, the op scope, the fault handler, and
// the table that wraps every cpu op in a scope.
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <map>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "core/tensor.h"
#include "kernels/guard/guard.h"
#include "kernels/ops.h"

namespace sigma {
namespace cpu {
extern const ops::Backend kBackend;  // kernels/cpu/backend.cpp
}

namespace guard {

namespace {

// Virtual address space reserved once (no memory is committed until a page is used); only the
// pages below the high-water mark ever change protection.
constexpr size_t kReserve = size_t(64) << 30;

struct Arena {
  std::mutex mu;
  std::byte* base = nullptr;
  size_t page = 4096;
  size_t top = 0;                   // high-water mark: [base, base + top) may be open
  std::map<size_t, size_t> free_;   // offset -> bytes, coalesced
  std::map<size_t, size_t> live_;   // offset -> bytes
  size_t live_bytes = 0;
  int open = 0;                     // ops in flight
};

// SIGMA_TEST_BACKEND=guard-lite (guard.h): the arena stays readable and writable, ops open
// nothing; what remains are Tensor's host-accessor check and the host-argument check.
bool lite() {
  static const bool on = [] {
    const char* t = std::getenv("SIGMA_TEST_BACKEND");
    return t && std::string_view(t) == "guard-lite";
  }();
  return on;
}

Arena& arena();  // the one arena, reserved on first use
std::atomic<Arena*> g_arena{nullptr};  // the same, for the signal handler (never initialises)

struct sigaction g_previous;  // the handler before ours, for faults outside the arena

// Async-signal-safe output: fixed strings and hex numbers only.
void say(const char* s) { (void)!::write(2, s, std::strlen(s)); }
void say_hex(uintptr_t v) {
  char buf[19] = "0x";
  for (int i = 0; i < 16; ++i) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 15];
  buf[18] = 0;
  say(buf);
}

void on_fault(int sig, siginfo_t* info, void* ctx) {
  const Arena* a = g_arena.load();
  const auto* p = static_cast<const std::byte*>(info->si_addr);
  if (a && p >= a->base && p < a->base + kReserve) {
    say("\nsigma guard backend: host code touched device memory outside an op, at ");
    say_hex(uintptr_t(p));
    say(" (arena offset ");
    say_hex(uintptr_t(p - a->base));
    say("). Device tensors are read and written only by ops (kernels/ops.h: ops::download, "
        "ops::to_host). Backtrace:\n");
    void* frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
    ::signal(SIGSEGV, SIG_DFL);  // re-raised on return: the default action, a core, a death
    return;
  }
  // Not ours: the previous handler, or the default action.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) return g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    return g_previous.sa_handler(sig);
  }
  ::signal(SIGSEGV, SIG_DFL);
}

Arena& arena() {
  static Arena* a = [] {
    auto* r = new Arena;  // never freed: tensors may outlive static destructors
    r->page = size_t(::sysconf(_SC_PAGESIZE));
    void* m = ::mmap(nullptr, kReserve, lite() ? PROT_READ | PROT_WRITE : PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    SIGMA_CHECK(m != MAP_FAILED, "guard backend: cannot reserve {} GiB of address space: {}",
                kReserve >> 30, std::strerror(errno));
    r->base = static_cast<std::byte*>(m);
    struct sigaction sa {};
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &g_previous);
    g_arena.store(r);
    return r;
  }();
  return *a;
}

void protect(Arena& a, size_t from, size_t to, int prot) {
  if (to > from && ::mprotect(a.base + from, to - from, prot) != 0)
    fail("guard backend: mprotect failed: {}", std::strerror(errno));
}

void* alloc(size_t bytes) {
  Arena& a = arena();
  std::lock_guard lock(a.mu);
  const size_t n = (std::max<size_t>(bytes, 1) + a.page - 1) / a.page * a.page;
  size_t at = a.top;
  for (auto it = a.free_.begin(); it != a.free_.end(); ++it)
    if (it->second >= n) {  // first fit
      at = it->first;
      if (it->second > n) a.free_[at + n] = it->second - n;
      a.free_.erase(it);
      break;
    }
  if (at == a.top) {
    if (a.top + n > kReserve) throw std::bad_alloc();
    if (a.open) protect(a, a.top, a.top + n, PROT_READ | PROT_WRITE);  // an op is running
    a.top += n;
  }
  a.live_[at] = n;
  a.live_bytes += n;
  return a.base + at;  // fresh or returned with MADV_DONTNEED: zero pages
}

void release(void* p) {
  if (!p) return;
  Arena& a = arena();
  std::lock_guard lock(a.mu);
  const size_t at = size_t(static_cast<std::byte*>(p) - a.base);
  auto it = a.live_.find(at);
  SIGMA_CHECK(it != a.live_.end(), "guard backend: free of {} that it did not allocate", p);
  size_t off = at, n = it->second;
  a.live_bytes -= n;
  a.live_.erase(it);
  ::madvise(a.base + off, n, MADV_DONTNEED);  // its pages read as zero when reused
  auto next = a.free_.find(off + n);
  if (next != a.free_.end()) n += next->second, a.free_.erase(next);
  auto prev = a.free_.lower_bound(off);
  if (prev != a.free_.begin() && (--prev, prev->first + prev->second == off))
    prev->second += n;
  else
    a.free_[off] = n;
}

// Open while any op runs on any thread: the first entry opens the arena, the last exit closes it.
struct OpScope {
  OpScope() {
    if (lite()) return;
    Arena& a = arena();
    std::lock_guard lock(a.mu);
    if (a.open++ == 0) protect(a, 0, a.top, PROT_READ | PROT_WRITE);
  }
  ~OpScope() {
    if (lite()) return;
    Arena& a = arena();
    std::lock_guard lock(a.mu);
    if (--a.open == 0) protect(a, 0, a.top, PROT_NONE);
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;
};

// A host address handed to an op as one of its memory arguments: on a device it would not be
// device memory. Only upload's source and download's destination are host memory by design.
std::atomic<long long> g_host_args{0};

void on_host_arg(const void* p) {
  g_host_args.fetch_add(1, std::memory_order_relaxed);
  static const bool strict = [] {
    const char* s = std::getenv("SIGMA_GUARD_STRICT");
    const char* t = std::getenv("SIGMA_TEST_BACKEND");
    return (s && std::string_view(s) == "1") ||
           (t && (std::string_view(t) == "guard-strict" || std::string_view(t) == "guard-lite"));
  }();
  if (!strict) return;
  say("\nsigma guard backend: an op was given host memory at ");
  say_hex(uintptr_t(p));
  say(" where device memory belongs (SIGMA_GUARD_STRICT=1). Backtrace:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  std::abort();
}

template <auto M>
constexpr int kHostArg = -1;  // the argument that is host memory by design, if any
template <>
constexpr int kHostArg<&ops::Backend::upload> = 1;
template <>
constexpr int kHostArg<&ops::Backend::download> = 0;

template <class T>
void check_arg(T arg, bool host_by_design) {
  if constexpr (std::is_pointer_v<T>) {
    if (arg && !host_by_design && !owns(arg)) on_host_arg(arg);
  } else if constexpr (std::is_same_v<T, ops::AttnOperand> || std::is_same_v<T, ops::AttnOperand16> ||
                       std::is_same_v<T, ops::AttnGrad>) {
    check_arg(arg.p, false);  // the attention views carry their memory inside
  }
}

// The cpu op behind member M of the table, run inside a scope.
template <auto M, class F = std::remove_cvref_t<decltype(std::declval<ops::Backend>().*M)>>
struct Wrap;
template <auto M, class R, class... A>
struct Wrap<M, R (*)(A...)> {
  static R call(A... args) {
    int i = 0;
    (check_arg(args, i++ == kHostArg<M>), ...);
    OpScope open;
    return (cpu::kBackend.*M)(args...);
  }
};
template <auto M>
constexpr auto wrapped = &Wrap<M>::call;

}  // namespace

bool owns(const void* p) {
  Arena& a = arena();
  const auto* b = static_cast<const std::byte*>(p);
  return b >= a.base && b < a.base + kReserve;
}

size_t live_bytes() {
  Arena& a = arena();
  std::lock_guard lock(a.mu);
  return a.live_bytes;
}

long long host_args() { return g_host_args.load(); }

extern const ops::Backend kBackend;
using B = ops::Backend;
const ops::Backend kBackend = {
    .name = "guard",
    .device = Device::Guard,
    .alloc = &alloc,
    .free = &release,
    .upload = wrapped<&B::upload>,
    .download = wrapped<&B::download>,
    .copy_bytes = wrapped<&B::copy_bytes>,
    .owns = &owns,
    .gemm = wrapped<&B::gemm>,
    .linear_forward = wrapped<&B::linear_forward>,
    .linear_backward = wrapped<&B::linear_backward>,
    .gemm_bf16 = wrapped<&B::gemm_bf16>,
    .linear_forward_bf16 = wrapped<&B::linear_forward_bf16>,
    .linear_backward_bf16 = wrapped<&B::linear_backward_bf16>,
    .column_sum_accumulate = wrapped<&B::column_sum_accumulate>,
    .linear_forward_f32_panels = wrapped<&B::linear_forward_f32_panels>,
    .linear_forward_w16 = wrapped<&B::linear_forward_w16>,
    .gemm_nt_w16 = wrapped<&B::gemm_nt_w16>,
    .linear_forward_i8 = wrapped<&B::linear_forward_i8>,
    .gemm_nt_i8 = wrapped<&B::gemm_nt_i8>,
    .layernorm_forward = wrapped<&B::layernorm_forward>,
    .layernorm_backward = wrapped<&B::layernorm_backward>,
    .attention_forward = wrapped<&B::attention_forward>,
    .attention_backward = wrapped<&B::attention_backward>,
    .flash_attention_forward = wrapped<&B::flash_attention_forward>,
    .flash_attention_backward = wrapped<&B::flash_attention_backward>,
    .flash_attention_forward_bf16 = wrapped<&B::flash_attention_forward_bf16>,
    .flash_attention_backward_bf16 = wrapped<&B::flash_attention_backward_bf16>,
    .attention_forward_kv16 = wrapped<&B::attention_forward_kv16>,
    .fast_gelu_forward = wrapped<&B::fast_gelu_forward>,
    .fast_gelu_backward = wrapped<&B::fast_gelu_backward>,
    .softmax_xent = wrapped<&B::softmax_xent>,
    .xent_partial = wrapped<&B::xent_partial>,
    .xent_combine = wrapped<&B::xent_combine>,
    .embedding_forward = wrapped<&B::embedding_forward>,
    .embedding_backward = wrapped<&B::embedding_backward>,
    .embedding_forward_w16 = wrapped<&B::embedding_forward_w16>,
    .embedding_forward_i8 = wrapped<&B::embedding_forward_i8>,
    .adam_step = wrapped<&B::adam_step>,
    .bf16_mirror_add = wrapped<&B::bf16_mirror_add>,
    .bf16_mirror_clear = wrapped<&B::bf16_mirror_clear>,
    .bf16_mirror_drop = wrapped<&B::bf16_mirror_drop>,
    .copy = wrapped<&B::copy>,
    .fill = wrapped<&B::fill>,
    .add_into = wrapped<&B::add_into>,
    .gather_rows = wrapped<&B::gather_rows>,
    .scatter_rows = wrapped<&B::scatter_rows>,
    .sum_sq = wrapped<&B::sum_sq>,
    .convert_bf16 = wrapped<&B::convert_bf16>,
    .convert_bf16_panels = wrapped<&B::convert_bf16_panels>,
    .convert_f32_panels = wrapped<&B::convert_f32_panels>,
    .quantize_i8 = wrapped<&B::quantize_i8>,
    .gate_softmax_topk = wrapped<&B::gate_softmax_topk>,
    .gate_combine = wrapped<&B::gate_combine>,
    .gate_expert_dy = wrapped<&B::gate_expert_dy>,
    .gate_backward_dz = wrapped<&B::gate_backward_dz>,
};

}  // namespace guard
}  // namespace sigma
