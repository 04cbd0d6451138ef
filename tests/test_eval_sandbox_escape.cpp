// The sandbox against samples that try to fool or outlive it (issue 28): an early exit before
// the tests, processes escaping through setsid / double fork / _posixsubprocess.fork_exec, a
// sample that kills its parent or forks without bound, and one that fills the disk. As root
// (the tests' user) and as uid 1000 (a forked child that drops to it), each must end as a
// failure with a reason, leave no process behind, and leave the evaluator running.
#include <gtest/gtest.h>
#include <grp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "cli_util.h"
#include "eval/sandbox.h"

using namespace sigma::eval;
namespace fs = std::filesystem;

namespace {

SandboxLimits limits() {
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
int processes_with(const std::string& marker) {
  int n = 0;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "cmdline", std::ios::binary);
    std::string cmd((std::istreambuf_iterator<char>(in)), {});
    for (char& c : cmd) c = c == '\0' ? ' ' : c;
    n += cmd.find(marker) != std::string::npos;
  }
  return n;
}

std::string unique_sleep(int salt) {
  return std::to_string(5000 + (getpid() * 7 + salt) % 4000) + ".25";
}

struct Outcome {
  bool evaluator_ok = false;  // the process that ran the sandbox returned normally
  SandboxResult r;
  int leftover_dirs = -1;  // entries in its TMPDIR afterwards
};

// Runs the sandbox in a forked child that has dropped to `uid` (when the tests run as root;
// otherwise as the current user), with its own TMPDIR; the result comes back on a pipe.
Outcome run_as(uid_t uid, const std::string& program, const SandboxLimits& l = limits()) {
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
    const SandboxResult r = run_python_sandboxed(program, l);
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

constexpr uid_t kUser = 1000;
std::vector<uid_t> users() { return geteuid() == 0 ? std::vector<uid_t>{0, kUser} : std::vector<uid_t>{geteuid()}; }

TEST(SandboxEscape, ExitingBeforeTheTestsFails) {
  for (const char* early : {"import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n",
                            "def f():\n    raise SystemExit\nf()\n"}) {
    const SandboxResult r = run_python_sandboxed(std::string(early) + "\n\nassert False\n", limits());
    EXPECT_FALSE(r.passed) << early;
    EXPECT_EQ(r.outcome, "early_exit") << early << r.why;
  }
  const SandboxResult ok = run_python_sandboxed("x = 1\n\n\nassert x == 1\n", limits());
  EXPECT_TRUE(ok.passed) << ok.why;
  EXPECT_TRUE(ok.finished);
  EXPECT_NE(ok.protections.find("sentinel"), std::string::npos) << ok.protections;
}

// setsid, setsid + double fork through a shell, and a plain fork_exec child: none outlives its
// sample, whether the sample ends normally or at the time limit.
TEST(SandboxEscape, NoProcessOutlivesItsSample) {
  for (uid_t uid : users())
    for (bool hang : {false, true}) {
      const std::string a = unique_sleep(int(uid) + hang), b = unique_sleep(int(uid) + 2 + hang),
                        c = unique_sleep(int(uid) + 4 + hang);
      std::string program = std::string(kSpawn) +
          "spawn(['/bin/sleep', '" + a + "'], setsid=True)\n"
          "spawn(['/bin/sh', '-c', '(setsid /bin/sleep " + b + " &) &'])\n"
          "spawn(['/bin/sleep', '" + c + "'])\n"
          "import time\ntime.sleep(0.5)\n";
      if (hang) program += "while True:\n    pass\n";
      SandboxLimits l = limits();
      if (hang) l.seconds = 3;
      const Outcome o = run_as(uid, program, l);
      ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
      EXPECT_EQ(o.r.outcome, hang ? "timeout" : "passed") << "uid " << uid << ": " << o.r.why;
      EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
      for (const std::string& m : {a, b, c})
        EXPECT_EQ(processes_with("sleep " + m), 0) << "uid " << uid << " hang " << hang << ": sleep " << m
                                                   << " survived (" << o.r.protections << ")";
    }
}

// Killing its parent, every process it can see and the evaluator by pid: the evaluator finishes
// with a result and removes its folder.
TEST(SandboxEscape, KillingTheParentIsContained) {
  for (uid_t uid : users()) {
    const std::string program =
        "import os, signal\n"
        "for pid in (os.getppid(), -1, " + std::to_string(getpid()) + ", 1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
        "assert True\n";
    const Outcome o = run_as(uid, program);
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid << ": the evaluator was killed";
    EXPECT_EQ(o.r.outcome, "passed") << "uid " << uid << ": " << o.r.why;
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
  }
}

TEST(SandboxEscape, AForkBombIsBoundedAndCleanedUp) {
  for (uid_t uid : users()) {
    const std::string m = unique_sleep(int(uid) + 10);
    const std::string program = std::string(kSpawn) +
        "n = 0\ntry:\n    for _ in range(300):\n        spawn(['/bin/sleep', '" + m + "'])\n"
        "        n += 1\nfinally:\n    print('started', n)\n";
    const Outcome o = run_as(uid, program);
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.why.find("Resource temporarily unavailable"), std::string::npos) << o.r.why;
    EXPECT_EQ(processes_with("sleep " + m), 0) << "uid " << uid;
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
  }
}

TEST(SandboxEscape, TheDiskQuotaRefusesThe21stFile) {
  for (uid_t uid : users()) {
    const std::string program =
        "for i in range(21):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * (16 << 20))\n";
    const Outcome o = run_as(uid, program);
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_FALSE(o.r.passed) << "uid " << uid;
    EXPECT_NE(o.r.why.find("No space left"), std::string::npos) << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.protections.find("disk-quota"), std::string::npos) << o.r.protections;
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
  }
}

}  // namespace
