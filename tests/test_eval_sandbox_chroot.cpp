// The sandbox where "/" is not a mount point (a chroot, as the minimal Debian root of
// scripts/check-fresh-install.sh is), issue 37: mount(NULL, "/", MS_REC | MS_PRIVATE) fails
// there with EINVAL, and the disk quota must still hold (or the sample be refused, naming the
// protection), never run quietly without it. The test builds its own minimal chroot of bind
// mounts in a private mount namespace of a forked child (root only); everything vanishes with
// the child.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <functional>

#include "sandbox_test_util.h"
#include "test_util.h"

namespace {

using namespace sigma::testing;

// Runs `body` in a forked child chrooted into a minimal root made of bind mounts (its "/" is a
// plain folder, not a mount point), in the child's own mount namespace; with `shared`, the
// mount that holds that folder is shared (as on a systemd host), so a mount made below it
// would appear in other namespaces too. Returns what body returned ("child failed: ..." when
// the set-up did not work).
std::string in_chroot(bool shared, const std::function<std::string()>& body) {
  TempDir root("chroot");
  fs::permissions(root.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec |
                  fs::perms::group_read | fs::perms::others_read);  // another user's "/"
  int fds[2];
  if (pipe(fds) != 0) return "child failed: pipe";
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    auto die = [&](const std::string& why) {
      const std::string msg = "child failed: " + why + ": " + std::strerror(errno);
      (void)!write(fds[1], msg.data(), msg.size());
      _exit(1);
    };
    if (unshare(CLONE_NEWNS) != 0) die("a mount namespace");
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      if (errno != EINVAL) die("a private mount namespace");
      // Already in a chroot (scripts/check-fresh-install.sh's): the case itself, as it is.
      if (shared) die("not applicable: already in a chroot, whose mount cannot be made shared");
      const std::string out = body();
      (void)!write(fds[1], out.data(), out.size());
      _exit(0);
    }
    for (const char* d : {"/usr", "/etc", "/dev", "/proc", "/sys", "/bin", "/sbin", "/lib", "/lib64", "/lib32"}) {
      struct stat st{};
      if (lstat(d, &st) != 0) continue;
      const std::string at = root.str() + d;
      if (S_ISLNK(st.st_mode)) {
        if (symlink(fs::read_symlink(d).c_str(), at.c_str()) != 0) die(at);
      } else if (mkdir(at.c_str(), 0755) != 0 || mount(d, at.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) {
        die(at);
      }
    }
    const std::string tmp = root / "tmp";
    if (mkdir(tmp.c_str(), 0777) != 0 || chmod(tmp.c_str(), 01777) != 0) die(tmp);
    if (shared && mount(nullptr, "/", nullptr, MS_SHARED, nullptr) != 0) die("a shared /");
    if (chroot(root.str().c_str()) != 0 || chdir("/") != 0) die("chroot");
    setenv("TMPDIR", "/tmp", 1);
    const std::string out = body();
    (void)!write(fds[1], out.data(), out.size());
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(n));
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return out;
}

std::string text(uid_t uid, const Outcome& o) {
  return fmt::format("uid {}: ok {} outcome {} left {} protections [{}] why [{}]\n", uid,
                     o.evaluator_ok, o.r.outcome, o.leftover_dirs, o.r.protections, o.r.why);
}

constexpr const char* kDiskBomb =
    "for i in range(21):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'x' * (16 << 20))\n";

TEST(SandboxChroot, TheDiskQuotaHoldsWhereRootIsNotAMountPoint) {
  if (geteuid() != 0) GTEST_SKIP() << "making a chroot needs root";
  const std::string out = in_chroot(false, [] {
    // mountinfo lists a mount on "/" only where "/" is a mount point
    std::string s = fmt::format("root is a mount point: {}\n", slurp("/proc/self/mountinfo").find(" / / ") != std::string::npos);
    s += text(0, run_as(0, kDiskBomb));
    s += text(kUser, run_as(kUser, kDiskBomb));
    return s;
  });
  std::printf("%s", out.c_str());
  ASSERT_EQ(out.find("child failed"), std::string::npos) << out;
  EXPECT_NE(out.find("root is a mount point: false"), std::string::npos) << out;
  // Root: the quota holds (the folder's own tmpfs needs no private "/").
  EXPECT_NE(out.find("uid 0: ok true outcome failed left 0 protections [rlimits"), std::string::npos) << out;
  const std::string root_line = out.substr(out.find("uid 0:"), out.find('\n', out.find("uid 0:")) - out.find("uid 0:"));
  EXPECT_NE(root_line.find("disk-quota"), std::string::npos) << root_line;
  EXPECT_NE(root_line.find("No space left"), std::string::npos) << root_line;
  // Another user gets no user namespace in a chroot: the sample is refused, saying why.
  const size_t u = out.find(fmt::format("uid {}:", kUser));
  ASSERT_NE(u, std::string::npos) << out;
  const std::string user_line = out.substr(u);
  EXPECT_NE(user_line.find("ok true outcome error left 0"), std::string::npos) << user_line;
  EXPECT_NE(user_line.find("no mount, PID and network namespace"), std::string::npos) << user_line;
}

// Below a shared mount the sample's tmpfs would show up in every peer namespace (and stay
// there): the sample is refused naming the protection, and nothing is left mounted or made.
TEST(SandboxChroot, ASharedMountIsRefusedAndLeavesNothing) {
  if (geteuid() != 0) GTEST_SKIP() << "making a chroot needs root";
  const std::string out = in_chroot(true, [] {
    std::string s = text(0, run_as(0, "assert True\n"));
    s += fmt::format("mounts left: {}\n", slurp("/proc/self/mountinfo").find("sigma-sandbox") != std::string::npos);
    return s;
  });
  if (out.find("not applicable") != std::string::npos) GTEST_SKIP() << out;
  std::printf("%s", out.c_str());
  ASSERT_EQ(out.find("child failed"), std::string::npos) << out;
  EXPECT_NE(out.find("uid 0: ok true outcome error left 0"), std::string::npos) << out;
  EXPECT_NE(out.find("is shared with another mount namespace"), std::string::npos) << out;
  EXPECT_NE(out.find("mounts left: false"), std::string::npos) << out;
}

}  // namespace
