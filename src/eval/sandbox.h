// Runs untrusted Python (a model's code sample and the problem's tests) in a child process that
// cannot hang, exhaust or escape the evaluator (docs/evaluation.md, "The sandbox"):
// - a fresh temporary directory as its working directory and home, removed afterwards;
// - wall-clock limit: the whole process group is killed with SIGKILL when it runs out; CPU,
//   address-space, file-size, open-file and process limits (setrlimit);
// - no network: a new network namespace (unshare), and Landlock denies TCP bind/connect;
// - no writes outside its directory: Landlock (kernel >= 5.13) where the kernel has it; as
//   root the child also drops to user nobody;
// - a Python audit hook refuses fork/exec/subprocess, sockets, ctypes and writes outside the
//   directory, as a second line where the kernel features are missing.
// Whatever the sample does, the result is pass or fail with a reason.
#pragma once
#include <cstdint>
#include <string>

namespace sigma::eval {

struct SandboxLimits {
  double seconds = 10;                 // wall clock
  uint64_t memory_bytes = 1ull << 30;  // address space
  uint64_t file_bytes = 16ull << 20;   // largest file it may write (and its captured output)
  std::string python = "";             // interpreter; "" = /usr/bin/python3, else python3 on PATH
};

struct SandboxResult {
  bool passed = false;
  bool timed_out = false;
  int exit_code = -1;  // when it exited
  int signal = 0;      // when a signal ended it
  std::string why;     // "ok", "timeout after 2 s", "exit 1: AssertionError ...", "signal 6"
  std::string protections;  // what the child got, e.g. "rlimits process-group-kill netns nobody
                            // landlock-abi7 audit-hook" ("" when it failed before reporting)
};

// Runs `program` (Python source) with python3 -I -B; passed = exit status 0 within the limits.
SandboxResult run_python_sandboxed(const std::string& program, const SandboxLimits& limits);

}  // namespace sigma::eval
