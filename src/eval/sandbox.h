// Runs untrusted Python or Java (a model's code sample and the problem's tests) in a child process that
// cannot hang, exhaust, fool or escape the evaluator (docs/evaluation.md, "The sandbox"):
// - a pass means the program reached its end: the guard writes a sentinel to a pipe after the
//   tests, so sys.exit(0) or os._exit(0) before them is a failure;
// - its own mount, PID and network namespaces (root, or a user namespace where unprivileged
//   ones are allowed; with neither the sample is refused): when the sample's first process
//   ends, every process it started dies with the namespace; the supervisor is also a subreaper
//   that kills every descendant left at the end of a sample, and it stops the sample and
//   removes its folder when the evaluator dies, however it dies;
// - its own root: a tmpfs with read-only binds of the interpreter's system directories and
//   box/, a tmpfs of disk_bytes (the disk quota) as its directory; nothing else of the host (no
//   /tmp, /run, /home, /proc: no socket reachable by path);
// - one memory limit for all its processes (a cgroup, v1 or v2, where the evaluator may make
//   one), and wall-clock, CPU, address-space, file-size, open-file and process limits;
// - no network: the network namespace, and Landlock denies TCP bind/connect;
// - Landlock: writes only in its directory; no signals to processes outside (ABI >= 6); as
//   root the sample also runs as a uid and gid of its own, unused by any account and by any
//   other sample running at once (sandbox_uid.cpp), so its process limit is its own;
// - Python: an audit hook refuses fork/exec/subprocess, sockets, ctypes and writes outside the
//   directory, as a second line; Java has none (the JVM runs without RLIMIT_AS where the memory
//   cgroup bounds it: it reserves far more address space than it uses).
// Whatever the sample does, the result is pass or fail with a reason.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sigma::eval {

enum class SandboxLanguage { Python, Java };
const char* language_name(SandboxLanguage l);  // "python", "java"

struct SandboxProgram {
  SandboxLanguage language = SandboxLanguage::Python;
  std::string source;  // Python: run as __main__; Java: Main.java, whose class Main has main()
};

struct SandboxLimits {
  double seconds = 10;                 // wall clock
  uint64_t memory_bytes = 1ull << 30;  // all its processes together (cgroup); Python: the address
                                       // space of each too; Java: the heap is this less 256 MiB
  uint64_t file_bytes = 16ull << 20;   // largest file it may write (and its captured output)
  uint64_t disk_bytes = 64ull << 20;   // all its files together (the tmpfs' size)
  int processes = 64;                  // RLIMIT_NPROC: processes of the sample at once
  std::string python = "";             // interpreter; "" = /usr/bin/python3, else python3 on PATH
  std::string java = "";               // "" = /usr/bin/java, else java on PATH (a JDK: it compiles)
};

struct SandboxResult {
  bool passed = false;
  bool timed_out = false;
  bool finished = false;  // the program ran to its end (the sentinel arrived)
  int exit_code = -1;     // when it exited
  int signal = 0;         // when a signal ended it
  int oom_kills = 0;      // processes the memory limit ended
  // "passed", "failed" (a non-zero exit: an exception such as AssertionError; or the memory
  // limit ended one of its processes), "early_exit" (exit 0 before the end), "timeout",
  // "killed" (a signal), "error" (the sandbox could not be set up: `why` names what).
  std::string outcome;
  std::string why;  // "ok", "timeout after 2 s", "exit 1: AssertionError ...", "signal 6"
  std::string protections;  // what the child got, e.g. "rlimits subreaper pidns netns
                            // private-root disk-quota memcg-v1 own-user landlock-abi7
                            // signal-scope audit-hook sentinel" ("" when it failed first)
};

// Runs `program` (Python source) with python3 -I -B; passed = it ran to its end and exited 0
// within the limits.
SandboxResult run_python_sandboxed(const std::string& program, const SandboxLimits& limits);
// Compiles and runs `program` (Main.java: class Main with main()) with the JDK's java in the
// same sandbox; passed = main returned (no exception, no System.exit) within the limits.
SandboxResult run_java_sandboxed(const std::string& program, const SandboxLimits& limits);

// Runs each program as run_python_sandboxed does, each in its own sandbox with its own limits,
// folder and cgroup, at most `jobs` at once (one thread forks and waits for them all); the
// results are in the programs' order, and `on_done(index, result)` is called as each ends. As
// root each sample has its own process count (its own user); as another user each has its own
// user namespace, counted on its own on Linux >= 5.14 (older kernels count the user's processes
// together: there the limit is jobs x limits.processes). On SIGINT/SIGTERM (exit_cleanly_on_interrupt)
// every running sample is stopped and removed before the evaluator ends by that signal.
std::vector<SandboxResult> run_sandboxed_many(
    const std::vector<SandboxProgram>& programs, const SandboxLimits& limits, int jobs,
    const std::function<void(size_t, const SandboxResult&)>& on_done = {});
std::vector<SandboxResult> run_python_sandboxed_many(
    const std::vector<std::string>& programs, const SandboxLimits& limits, int jobs,
    const std::function<void(size_t, const SandboxResult&)>& on_done = {});

// Samples that fit this machine at once: its cores, at most as many as MemAvailable holds at
// each sample's memory and disk limits, at most 64.
int default_sandbox_jobs(const SandboxLimits& limits);

// For a program that runs samples (`sigma eval`): SIGINT and SIGTERM print a message and end
// it by the same signal (status 130 / 143 in a shell), after the running sample is stopped and
// its folder and cgroup removed.
void exit_cleanly_on_interrupt();

}  // namespace sigma::eval
