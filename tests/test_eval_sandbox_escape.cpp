// The sandbox against samples that try to fool or outlive it (issue 28): an early exit before
// the tests, processes escaping through setsid / double fork / _posixsubprocess.fork_exec, a
// sample that kills its parent or forks without bound, one that fills the disk, one that
// connects to a host Unix socket by path (issue 37) and one whose processes together exceed the
// memory limit (issue 37). As root
// (the tests' user) and as uid 1000 (a forked child that drops to it), each must end as a
// failure with a reason, leave no process behind, and leave the evaluator running.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <string>

#include "sandbox_test_util.h"

namespace {

using namespace sigma::testing;

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
      if (refused_here(uid, o)) continue;
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
    if (refused_here(uid, o)) continue;
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
    if (refused_here(uid, o)) continue;
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
    if (refused_here(uid, o)) continue;
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_FALSE(o.r.passed) << "uid " << uid;
    EXPECT_NE(o.r.why.find("No space left"), std::string::npos) << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.protections.find("disk-quota"), std::string::npos) << o.r.protections;
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
  }
}

// A host service listening on a Unix socket in a world-writable folder: a sample that connects
// by path from a process the audit hook does not see (a fresh python3) must not reach it. The
// network namespace and Landlock's TCP rules do not cover pathname sockets; the sample's
// private root does (the path does not exist there).
TEST(SandboxEscape, AHostUnixSocketIsUnreachableByPath) {
  TempDir dir("sock");
  fs::permissions(dir.path, fs::perms::all | fs::perms::sticky_bit);
  const std::string path = dir / "service.sock";
  const int srv = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  ASSERT_GE(srv, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  ASSERT_EQ(bind(srv, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(chmod(path.c_str(), 0777), 0);
  ASSERT_EQ(listen(srv, 8), 0);
  const std::string program = std::string(kSpawn) +
      "pid = spawn(['/usr/bin/python3', '-c', 'import socket; s = socket.socket(socket.AF_UNIX); "
      "s.connect(\"" + path + "\"); s.sendall(b\"pwned\")'])\n"
      "_, st = os.waitpid(pid, 0)\n"
      "assert os.waitstatus_to_exitcode(st) == 0, 'the connection failed'\n";
  for (uid_t uid : users()) {
    const Outcome o = run_as(uid, program);
    if (refused_here(uid, o)) continue;
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.why.find("the connection failed"), std::string::npos) << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.protections.find("private-root"), std::string::npos) << o.r.protections;
    const int c = accept(srv, nullptr, nullptr);
    EXPECT_LT(c, 0) << "uid " << uid << ": the sample reached the host's socket";
    if (c >= 0) close(c);
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
  }
  close(srv);
}

// Six processes of 100 MiB each under a 256 MiB limit: each is within its own address-space
// limit, together they are not. Where a memory cgroup can be made (root on this machine's
// cgroup v1) the sample fails; elsewhere the protections line says the bound is per process.
TEST(SandboxEscape, TheMemoryLimitBindsTheSampleAsAWhole) {
  SandboxLimits l = limits();
  l.memory_bytes = 256ull << 20;
  l.seconds = 60;
  const std::string program = std::string(kSpawn) +
      "pids = [spawn(['/usr/bin/python3', '-c', 'import time; b = b\"x\" * (100 << 20); time.sleep(2)'])\n"
      "        for _ in range(6)]\n"
      "for pid in pids:\n    os.waitpid(pid, 0)\n";
  for (uid_t uid : users()) {
    const Outcome o = run_as(uid, program, l);
    if (refused_here(uid, o)) continue;
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.leftover_dirs, 0) << "uid " << uid;
    if (o.r.protections.find("memcg-") == std::string::npos) {
      EXPECT_NE(o.r.protections.find("memory-per-process-only"), std::string::npos) << o.r.protections;
      std::printf("uid %u: no memory cgroup here, the fallback is stated: %s\n", uid, o.r.protections.c_str());
      continue;
    }
    EXPECT_FALSE(o.r.passed) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.why.find("out of memory"), std::string::npos) << "uid " << uid << ": " << o.r.why;
  }
}

}  // namespace
