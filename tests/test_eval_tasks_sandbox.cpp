// The pass@k sandbox: hostile samples are failures within the time limit, and the evaluator
// (this process) carries on unharmed.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "eval/sandbox.h"

using namespace sigma::eval;
using Clock = std::chrono::steady_clock;

namespace {

// A Python string literal for a path (JSON string syntax is valid Python for plain paths).
std::string nlohmann_quote(const std::string& s) { return nlohmann::json(s).dump(); }

// Generous: on a loaded machine starting python3 alone has taken 2 s. Only the tests of the
// clock use a short limit.
SandboxLimits limits() {
  SandboxLimits l;
  l.seconds = 30;
  l.memory_bytes = 512ull << 20;
  return l;
}

double run_timed(const std::string& program, SandboxResult& r, const SandboxLimits& l = limits()) {
  const auto t0 = Clock::now();
  r = run_python_sandboxed(program, l);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

TEST(Sandbox, PassingAndFailingTests) {
  SandboxResult r;
  run_timed("def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n", r);
  EXPECT_TRUE(r.passed) << r.why;
  EXPECT_NE(r.protections.find("audit-hook"), std::string::npos) << r.protections;
  run_timed("def add(a, b):\n    return a - b\n\nassert add(2, 3) == 5\n", r);
  EXPECT_FALSE(r.passed);
  EXPECT_NE(r.why.find("AssertionError"), std::string::npos) << r.why;
  run_timed("def add(a, b)\n", r);  // a syntax error
  EXPECT_FALSE(r.passed);
  EXPECT_NE(r.why.find("SyntaxError"), std::string::npos) << r.why;
}

TEST(Sandbox, AnEndlessLoopIsKilledAtTheTimeLimit) {
  SandboxLimits l = limits();
  l.seconds = 1.5;
  SandboxResult r;
  const double s = run_timed("while True:\n    pass\n", r, l);
  EXPECT_FALSE(r.passed);
  EXPECT_TRUE(r.timed_out) << r.why;
  EXPECT_GE(s, 1.4);
  EXPECT_LT(s, 10.0);  // killed at the limit: the margin only absorbs a loaded machine
  // Sleeping burns no CPU time, so only the wall clock can stop it.
  const double s2 = run_timed("import time\ntime.sleep(1000)\n", r, l);
  EXPECT_TRUE(r.timed_out) << r.why;
  EXPECT_LT(s2, 10.0);
}

TEST(Sandbox, UnboundedAllocationFailsWithinTheLimit) {
  SandboxResult r;
  const double s = run_timed("x = []\nwhile True:\n    x.append(bytearray(10**7))\n", r);
  EXPECT_FALSE(r.passed);
  EXPECT_FALSE(r.timed_out) << r.why;  // the address-space limit stops it, not the clock
  EXPECT_NE(r.why.find("MemoryError"), std::string::npos) << r.why;
  EXPECT_LT(s, 25.0);
}

TEST(Sandbox, WritingOutsideItsDirectoryFails) {
  sigma::testing::TempDir outside("escape");
  std::filesystem::permissions(outside.path, std::filesystem::perms::all);  // even world-writable
  const std::string target = outside / "pwned.txt";
  SandboxResult r;
  run_timed("open(" + nlohmann_quote(target) + ", 'w').write('x')\n", r);
  EXPECT_FALSE(r.passed) << r.why;
  EXPECT_FALSE(std::filesystem::exists(target));
  // Through os.open and a rename too; its own directory stays writable.
  run_timed("import os\nfd = os.open(" + nlohmann_quote(target) + ", os.O_WRONLY | os.O_CREAT)\n", r);
  EXPECT_FALSE(r.passed) << r.why;
  EXPECT_FALSE(std::filesystem::exists(target));
  run_timed("open('mine.txt', 'w').write('ok')\nassert open('mine.txt').read() == 'ok'\n", r);
  EXPECT_TRUE(r.passed) << r.why;
}

// Reads are confined by the sample's private root (and Landlock): the evaluator's files, a
// world-readable one included, stay out of reach; the standard library does not.
TEST(Sandbox, ReadingOutsideItsDirectoryAndTheSystemFails) {
  SandboxResult r;
  run_timed("pass\n", r);
  ASSERT_TRUE(r.passed) << r.why;
  sigma::testing::TempDir outside("secret");
  std::filesystem::permissions(outside.path, std::filesystem::perms::all);
  std::ofstream(outside / "secret.txt") << "the answer";
  std::filesystem::permissions(outside / "secret.txt", std::filesystem::perms::all);
  run_timed("print(open(" + nlohmann_quote(outside / "secret.txt") + ").read())\n", r);
  EXPECT_FALSE(r.passed) << r.why;
  // Not even there: the sample's root holds only the interpreter's files and its own folder.
  EXPECT_NE(r.why.find("No such file"), std::string::npos) << r.why;
  run_timed("import json, re, collections, itertools\nassert json.loads('[1]') == [1]\n", r);
  EXPECT_TRUE(r.passed) << r.why;
}

TEST(Sandbox, ForkExecAndSignalsAreFailures) {
  SandboxResult r;
  run_timed("import os\nif os.fork() == 0:\n    os._exit(0)\n", r);
  EXPECT_FALSE(r.passed) << r.why;
  run_timed("import subprocess\nsubprocess.run(['true'])\n", r);
  EXPECT_FALSE(r.passed) << r.why;
  run_timed("import os\nos.abort()\n", r);
  EXPECT_FALSE(r.passed);
  EXPECT_EQ(r.signal, 6) << r.why;  // SIGABRT
  run_timed("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n", r);
  EXPECT_FALSE(r.passed) << r.why;
  // The evaluator is unharmed: the next honest sample passes.
  run_timed("assert sum(range(10)) == 45\n", r);
  EXPECT_TRUE(r.passed) << r.why;
}

}  // namespace
