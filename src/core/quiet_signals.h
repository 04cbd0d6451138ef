// The asynchronous signals Sigma handles (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) are taken by one
// thread that runs nothing else: every other thread blocks them (docs/reliability.md, "Signals").
//
// Why: Debian 12's oneDNN (2.7) runs its f32 GEMM kernels with the stack pointer moved onto a
// heap workspace (oneDNN issue 4845; upstream no longer does since PR 4855). A handler entered
// on a thread inside one of them pushes the signal frame (~3 KiB with AVX-512 state) below that
// pointer, over the heap's bookkeeping, and glibc aborts a moment later ("corrupted size vs.
// prev_size"): about 1 stop signal in 10 while training under load. On the quiet thread the
// handlers, and the default actions of signals without one, run as before.
#pragma once

namespace sigma {

// Blocks those signals in the calling thread, so in every thread it starts after, and starts
// the quiet thread with them unblocked. Call it first in main, before any thread exists (a
// thread started earlier keeps them unblocked). Children started with fork inherit the block:
// what they exec must unblock them (posix_spawnattr_setsigmask, sigprocmask).
void route_signals_to_quiet_thread();

}  // namespace sigma
