// What the sandbox tests share: a way to start processes the audit hook does not see, a count
// of processes by command line, and running the sandbox as another user in a forked child.
#pragma once
#include <gtest/gtest.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.h"
#include "eval/sandbox.h"

namespace sigma::testing {

using eval::SandboxLimits;
using eval::SandboxResult;
using eval::run_python_sandboxed;
namespace fs = std::filesystem;

inline SandboxLimits limits() {
  SandboxLimits l;
  l.seconds = 30;  // generous: starting python3 on a loaded machine has taken 2 s
  l.memory_bytes = 512ull << 20;
  return l;
}

// Python that starts a process without the audit hook noticing (subprocess and os.fork are
// refused; _posixsubprocess.fork_exec is not). Its arity differs between Python versions.
constexpr const char* kSpawn = R"PY(import os, _posixsubprocess
def spawn(argv, setsid=False):
    r, w = os.pipe()
    head = [[a.encode() for a in argv], [argv[0].encode()], True, (), None, None,
            -1, -1, -1, -1, -1, -1, r, w, False, setsid, -1, None, None, None]
    try:
        for tail in ([-1, None, False], [-1, None], [None]):
            try:
                return _posixsubprocess.fork_exec(*head, *tail)
            except TypeError:
                continue
    finally:
        os.close(r)
        os.close(w)
)PY";

// Processes whose command line contains `marker` (each test uses its own sleep length).
inline int processes_with(const std::string& marker) {
  int n = 0;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmd;  // read with read(2): a process that ends meanwhile is just not counted
    if (const int fd = open((e.path() / "cmdline").c_str(), O_RDONLY | O_CLOEXEC); fd >= 0) {
      char buf[4096];
      for (ssize_t k; (k = read(fd, buf, sizeof buf)) > 0;) cmd.append(buf, size_t(k));
      close(fd);
    }
    for (char& c : cmd) c = c == '\0' ? ' ' : c;
    n += cmd.find(marker) != std::string::npos;
  }
  return n;
}

inline std::string unique_sleep(int salt) {
  return std::to_string(5000 + (getpid() * 7 + salt) % 4000) + ".25";
}

struct Outcome {
  bool evaluator_ok = false;  // the process that ran the sandbox returned normally
  SandboxResult r;
  int leftover_dirs = -1;  // entries in its TMPDIR afterwards
};

// Runs `run` (which runs the sandbox) in a forked child that has dropped to `uid` (when the
// tests run as root; otherwise as the current user), with its own TMPDIR; the result comes
// back on a pipe.
inline Outcome run_as_with(uid_t uid, const std::function<SandboxResult()>& run) {
  sigma::testing::TempDir tmp("sandbox-user");
  if (geteuid() == 0) (void)!chown(tmp.path.c_str(), uid, uid);
  fs::permissions(tmp.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);  // as /tmp: nobody may pass
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    if (geteuid() == 0 && (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0)) _exit(3);
    setenv("TMPDIR", tmp.str().c_str(), 1);
    SandboxResult r;
    try {
      r = run();
    } catch (const std::exception& e) {  // never back into the test's own code from this child
      std::fprintf(stderr, "run_as: %s\n", e.what());
      _exit(4);
    }
    int left = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(tmp.path)) ++left;
    const std::string msg = std::string(r.passed ? "1" : "0") + "\n" + r.outcome + "\n" +
                            std::to_string(left) + "\n" + r.protections + "\n" + r.why;
    (void)!write(fds[1], msg.data(), msg.size());
    _exit(0);
  }
  close(fds[1]);
  std::string msg;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, size_t(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  Outcome o;
  o.evaluator_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!o.evaluator_ok) return o;
  std::istringstream in(msg);
  std::string passed, left;
  std::getline(in, passed), std::getline(in, o.r.outcome), std::getline(in, left);
  std::getline(in, o.r.protections), std::getline(in, o.r.why, '\0');
  o.r.passed = passed == "1";
  o.leftover_dirs = std::stoi(left);
  return o;
}

inline Outcome run_as(uid_t uid, const std::string& program, const SandboxLimits& l = limits()) {
  return run_as_with(uid, [&] { return run_python_sandboxed(program, l); });
}

// The sandbox refused the sample because this user gets no namespaces here (a chroot, or a
// container that forbids user namespaces): refused with the reason, nothing run or left. The
// tests accept that, and only that, in place of the protection they check.
inline bool is_refusal(const SandboxResult& r) {
  return r.outcome == "error" && r.why.find("no mount, PID and network namespace") != std::string::npos;
}
inline bool refused_here(uid_t uid, const Outcome& o) {
  const bool refused = o.evaluator_ok && is_refusal(o.r);
  if (refused) {
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
    std::printf("uid %u: no namespaces here, the sample was refused: %s\n", uid, o.r.why.c_str());
  }
  return refused;
}

constexpr uid_t kUser = 1000;
inline std::vector<uid_t> users() { return geteuid() == 0 ? std::vector<uid_t>{0, kUser} : std::vector<uid_t>{geteuid()}; }

}  // namespace sigma::testing
