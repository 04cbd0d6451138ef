// The sandbox's own processes (docs/evaluation.md, "The sandbox"): the supervisor, the PID
// namespace's init and the sample. Everything here runs after fork and makes only system calls.
#include <fcntl.h>
#include <grp.h>
#include <linux/landlock.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "eval/sandbox_child.h"

namespace sigma::eval::detail {

namespace {

// Landlock ABI 6 added scoping (signals, abstract sockets), ABI 4 network rules and ABI 3
// truncation; Debian 12's header stops at ABI 2, so the newer fields and bits are spelled here.
struct LandlockAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
  uint64_t scoped;  // ABI 6
};
constexpr uint64_t kFsTruncate = 1ull << 14;
constexpr uint64_t kNetBindTcp = 1ull << 0, kNetConnectTcp = 1ull << 1;
constexpr uint64_t kScopeAbstractUnix = 1ull << 0, kScopeSignal = 1ull << 1;

// Every write-like access Landlock knows at this ABI; reads and execution stay allowed.
uint64_t landlock_write_mask(int abi) {
  uint64_t m = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR |
               LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_CHAR |
               LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
               LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO |
               LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_MAKE_SYM;
  if (abi >= 2) m |= LANDLOCK_ACCESS_FS_REFER;
  if (abi >= 3) m |= kFsTruncate;
  return m;
}
constexpr uint64_t kRead = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_READ_FILE |
                           LANDLOCK_ACCESS_FS_READ_DIR;

void report(const ChildPlan& p, uint8_t kind, uint16_t bits, int32_t value) {
  const Record r{kind, 0, bits, value};
  (void)!write(p.report_fd, &r, sizeof r);  // a dead evaluator: EPIPE (SIGPIPE is ignored)
}

void set_limit(int what, uint64_t v) {
  struct rlimit r{rlim_t(v), rlim_t(v)};
  setrlimit(what, &r);
}

bool add_rule(int ruleset, int fd, uint64_t access) {
  struct landlock_path_beneath_attr beneath{};
  beneath.allowed_access = access;
  beneath.parent_fd = fd;
  return syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &beneath, 0) == 0;
}

// Writes only beneath the sample's directory, reads in its root; no TCP (ABI >= 4); no signals
// or abstract sockets outside the sandbox (ABI >= 6). 0 when the kernel has no Landlock, else
// the bits it got; -1 when it failed.
int restrict_with_landlock(const ChildPlan& p) {
  if (p.abi < 1) return 0;
  const uint64_t write = landlock_write_mask(p.abi);
  LandlockAttr attr{write | kRead, p.abi >= 4 ? (kNetBindTcp | kNetConnectTcp) : 0,
                    p.abi >= 6 ? (kScopeAbstractUnix | kScopeSignal) : 0};
  const size_t size = p.abi >= 6 ? sizeof(attr) : p.abi >= 4 ? 2 * sizeof(uint64_t) : sizeof(uint64_t);
  const int rs = int(syscall(SYS_landlock_create_ruleset, &attr, size, 0));
  if (rs < 0 || !add_rule(rs, p.box_fd, write | kRead) || !add_rule(rs, p.root_fd, kRead) ||
      syscall(SYS_landlock_restrict_self, rs, 0) != 0)
    return -1;
  close(rs);
  return kLandlock | (p.abi >= 6 ? kScoped : 0);
}

bool write_all(int fd, const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = write(fd, s, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    s += w, n -= size_t(w);
  }
  return true;
}

bool write_file(const char* path, const std::string& text, int flags, mode_t mode) {
  const int fd = open(path, flags | O_CLOEXEC, mode);
  if (fd < 0) return false;
  const bool ok = write_all(fd, text.data(), text.size());
  close(fd);
  return ok;
}

// The sample's process: its root, limits, its user, Landlock, then python3 or java. A failure is
// reported with its stage; the supervisor cleans up.
[[noreturn]] void sample_process(const ChildPlan& p) {
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);  // the supervisor blocks SIGTERM; python should not
  signal(SIGPIPE, SIG_DFL);
  auto fail = [&](Stage s) {
    report(p, kFail, s, errno);
    _exit(125);
  };
  const int done = fcntl(p.done_fd, F_DUPFD, 64);  // becomes fd 3 just before exec
  if (done < 0) fail(kStageFork);
  // Its root is the folder: the interpreter's read-only files and its own tmpfs, nothing else
  // (no host socket, no /proc, no /tmp). The caller may chroot: root, or a user namespace.
  if (chroot(p.folder.c_str()) != 0 || chdir("/box") != 0) fail(kStageChroot);
  set_limit(RLIMIT_CPU, uint64_t(std::ceil(p.seconds)) + 1);
  if (p.memory) set_limit(RLIMIT_AS, p.memory);  // none for the JVM: its cgroup bounds it
  set_limit(RLIMIT_FSIZE, p.file);
  set_limit(RLIMIT_NOFILE, 64);
  set_limit(RLIMIT_CORE, 0);
  // Binds below root only: hence a user of the sample's own as root, whose count starts at 0.
  set_limit(RLIMIT_NPROC, uint64_t(p.nproc));
  uint16_t got = p.got;
  if (p.as_root) {
    if (setgroups(0, nullptr) != 0 || setgid(p.gid) != 0 || setuid(p.uid) != 0) fail(kStageUser);
    got |= kOwnUser;
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail(kStageLandlock);
  const int ll = restrict_with_landlock(p);
  if (ll < 0) fail(kStageLandlock);
  got |= uint16_t(ll);
  report(p, kGot, got, 0);
  if (dup2(done, 3) != 3) fail(kStageFork);
  close(done);
  // Nothing else of the evaluator's: an inherited descriptor of a folder outside would lead
  // out of the root, of a file would be written.
  if (syscall(SYS_close_range, 4u, ~0u, 0u) != 0)
    for (int fd = 4; fd < 4096; ++fd) close(fd);
  execve(p.argv[0], p.argv.data(), p.envp.data());
  _exit(127);
}

// Kills every descendant of this process (a subreaper: orphans of the sample land here) until
// none is left, reaping them.
void kill_descendants() {
  char path[64] = "/proc/self/task/";
  char digits[16];
  int nd = 0;
  for (pid_t self = getpid(); self > 0; self /= 10) digits[nd++] = char('0' + self % 10);
  size_t at = std::strlen(path);
  while (nd > 0) path[at++] = digits[--nd];
  std::memcpy(path + at, "/children", 10);
  for (;;) {
    char buf[4096];
    ssize_t n = 0;
    if (const int fd = open(path, O_RDONLY | O_CLOEXEC); fd >= 0) {
      n = read(fd, buf, sizeof buf);
      close(fd);
    }
    bool any = false;
    pid_t v = 0;
    for (ssize_t i = 0; i < n; ++i)
      if (buf[i] >= '0' && buf[i] <= '9') v = v * 10 + (buf[i] - '0');
      else if (v > 0) kill(v, SIGKILL), v = 0, any = true;  // a number cut at the end waits
    int status = 0;
    const pid_t w = waitpid(-1, &status, any ? 0 : WNOHANG);
    if (w < 0 && errno == ECHILD) return;
    if (w == 0) {  // a child that is not listed yet (being forked): look again shortly
      const struct timespec ms{0, 1000000};
      nanosleep(&ms, nullptr);
    }
  }
}

double now_seconds() {
  struct timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// The count after "oom_kill " in a cgroup's memory.oom_control (v1) or memory.events (v2).
int32_t oom_kills(const char* path) {
  char buf[1024];
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  for (const char* at = buf; (at = std::strstr(at, "oom_kill ")) != nullptr; ++at)
    if (at == buf || at[-1] == '\n') {
      int32_t v = 0;
      for (at += 9; *at >= '0' && *at <= '9'; ++at) v = v * 10 + (*at - '0');
      return v;
    }
  return 0;
}

// Undoes whatever the supervisor set up: the namespace's processes, the folder (its mounts
// exist only in this mount namespace; unmounting also undoes any copy propagated elsewhere),
// the cgroup. Then exits with `code`.
[[noreturn]] void finish(ChildPlan& p, int code) {
  if (p.init > 0) kill(p.init, SIGKILL);  // the namespace's init: everything in it dies
  kill_descendants();
  if (p.made_folder) {
    umount2(p.folder.c_str(), MNT_DETACH);
    rmdir(p.folder.c_str());
  }
  if (p.in_cgroup) report(p, kOom, 0, oom_kills(p.cg.events.c_str()));
  if (p.made_cgroup && (!p.in_cgroup || write_file(p.cg.parent_procs.c_str(), "0", O_WRONLY, 0)))
    for (int i = 0; i < 200 && rmdir(p.cg.dir.c_str()) != 0 && errno == EBUSY; ++i) {
      const struct timespec ms{0, 5000000};  // an exiting process may hold it a moment
      nanosleep(&ms, nullptr);
    }
  _exit(code);
}

[[noreturn]] void fail_at(ChildPlan& p, Stage s) {
  report(p, kFail, s, errno);
  finish(p, 125);
}

// Mounts `source` read-only at `target` (with what is mounted below it), keeping the flags a
// user namespace may not drop (nosuid, nodev, noexec, atime).
bool bind_read_only(const char* source, const char* target) {
  if (mount(source, target, nullptr, MS_BIND | MS_REC, nullptr) != 0) return false;
  struct statfs fs{};
  if (statfs(target, &fs) != 0) return false;
  const unsigned long keep = fs.f_flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME |
                                           MS_NODIRATIME | MS_RELATIME);
  return mount(nullptr, target, nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, nullptr) == 0;
}

// Whether the folder's tmpfs is shared with another mount namespace (its /proc/self/mountinfo
// line has "shared:"), or that cannot be told. Only asked where "/" is not a mount point (a
// chroot) and so could not be made private first.
bool shared_or_unknown(const ChildPlan& p) {
  static char buf[1 << 16];
  const int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;
  size_t have = 0;
  bool found = false, shared = false;
  for (;;) {
    const ssize_t n = read(fd, buf + have, sizeof buf - 1 - have);
    if (n <= 0) break;
    have += size_t(n);
    size_t start = 0;
    for (size_t i = 0; i < have; ++i) {
      if (buf[i] != '\n') continue;
      buf[i] = '\0';
      // Fields: id parent major:minor root mount-point options [optional...] - type ...
      const char* line = buf + start;
      const char* f = line;
      for (int k = 0; k < 4 && f; ++k) f = std::strchr(f, ' ') ? std::strchr(f, ' ') + 1 : nullptr;
      const size_t len = p.folder_escaped.size();
      if (f && std::strncmp(f, p.folder_escaped.c_str(), len) == 0 && f[len] == ' ') {
        const char* dash = std::strstr(f, " - ");
        const char* s = std::strstr(f, " shared:");
        found = true;
        shared = s && (!dash || s < dash);  // the last mount there is ours: keep its answer
      }
      start = i + 1;
    }
    if (start == 0 && have == sizeof buf - 1) break;  // a line longer than the buffer
    std::memmove(buf, buf + start, have - start);
    have -= start;
  }
  close(fd);
  return !found || shared;
}

// A new mount namespace (as root) or a user namespace that maps only our own ids, with new PID
// and network namespaces. No namespace, no sample: without one there is no private root, no
// disk quota and no PID namespace.
void enter_namespaces(ChildPlan& p) {
  constexpr int kAll = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET;
  if (p.as_root) {
    if (unshare(kAll) != 0) fail_at(p, kStageNamespaces);
    p.got |= kNetns | kPidns;
    return;
  }
  if (unshare(CLONE_NEWUSER | kAll) != 0) fail_at(p, kStageNamespaces);
  // A process that changed its uid (a setuid wrapper, su) is not dumpable, and /proc/self's
  // map files are then root's: make it dumpable again (the sample runs as this user anyway).
  prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
  if (!write_file("/proc/self/setgroups", "deny", O_WRONLY, 0) ||
      !write_file("/proc/self/uid_map", p.uid_map, O_WRONLY, 0) ||
      !write_file("/proc/self/gid_map", p.gid_map, O_WRONLY, 0))
    fail_at(p, kStageNamespaces);
  p.got |= kUserns | kNetns | kPidns;
}

// The sample's root: a small tmpfs at the folder holding read-only binds of the interpreter's
// system directories, a few device files and box/, the sample's tmpfs of disk_bytes (the
// quota). Nothing else of the host is in it: no /tmp, /run, /home or /proc, so no socket
// reachable by path either.
void build_root(ChildPlan& p) {
  bool chrooted = false;
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    if (errno != EINVAL) fail_at(p, kStageRoot);
    chrooted = true;  // "/" is not a mount point: the folder's mount is checked below instead
  }
  if (mkdir(p.folder.c_str(), 0700) != 0) fail_at(p, kStageFolder);
  p.made_folder = true;
  if (mount("sigma-sandbox", p.folder.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, p.root_opts.c_str()) != 0)
    fail_at(p, kStageRoot);
  if (chrooted && shared_or_unknown(p)) {
    errno = 0;
    fail_at(p, kStageSharedMount);  // finish() unmounts it, here and wherever it propagated
  }
  for (const RootEntry& e : p.entries) {
    bool ok = true;
    if (e.kind == RootEntry::Link) ok = symlink(e.source.c_str(), e.path.c_str()) == 0;
    else if (e.kind == RootEntry::BindFile) ok = write_file(e.path.c_str(), "", O_WRONLY | O_CREAT, 0644);
    else ok = mkdir(e.path.c_str(), 0755) == 0 || errno == EEXIST;
    if (ok && (e.kind == RootEntry::Bind || e.kind == RootEntry::BindFile))
      ok = bind_read_only(e.source.c_str(), e.path.c_str());
    if (!ok) fail_at(p, kStageRoot);
  }
  if (mkdir(p.box.c_str(), 0700) != 0 ||
      mount("sigma-sandbox", p.box.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, p.box_opts.c_str()) != 0 ||
      !write_file(p.guard_path.c_str(), p.guard, O_WRONLY | O_CREAT | O_TRUNC, 0644) ||
      !write_file(p.sample_path.c_str(), p.program, O_WRONLY | O_CREAT | O_TRUNC, 0644))
    fail_at(p, kStageQuota);
  p.got |= kQuota;
  if (mount(nullptr, p.folder.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
            nullptr) != 0)
    fail_at(p, kStageRoot);
  p.root_fd = open(p.folder.c_str(), O_PATH | O_CLOEXEC);
  p.box_fd = open(p.box.c_str(), O_PATH | O_CLOEXEC);
  if (p.root_fd < 0 || p.box_fd < 0) fail_at(p, kStageRoot);
  p.got |= kPrivateRoot;
}

// Dies with its parent (the evaluator) as a SIGTERM it handles; false if the parent is gone.
bool watch_parent(const ChildPlan& p) {
  prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0);
  return getppid() == p.evaluator;
}

}  // namespace

[[noreturn]] void supervisor(ChildPlan& p) {
  setpgid(0, 0);  // its own process group: the evaluator's backstop kills the group
  prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigprocmask(SIG_BLOCK, &term, nullptr);  // taken by sigtimedwait in the loop below
  signal(SIGPIPE, SIG_IGN);
  if (!watch_parent(p)) _exit(126);  // nothing made yet
  const double deadline = now_seconds() + p.seconds;
  if (!p.cg.version.empty()) {  // the sample's processes share one memory limit
    if (mkdir(p.cg.dir.c_str(), 0755) != 0) fail_at(p, kStageCgroup);
    p.made_cgroup = true;
    for (const auto& [file, value] : p.cg.limits)
      if (!write_file(file.c_str(), value, O_WRONLY, 0)) fail_at(p, kStageCgroup);
    if (!write_file(p.cg.procs.c_str(), "0", O_WRONLY, 0)) fail_at(p, kStageCgroup);
    p.in_cgroup = true;
    p.got |= kMemcg;
  }
  const int in = open("/dev/null", O_RDONLY);
  if (in < 0 || dup2(in, 0) != 0 || dup2(p.out_fd, 1) != 1 || dup2(p.out_fd, 2) != 2) fail_at(p, kStageFork);
  enter_namespaces(p);
  if (!watch_parent(p)) finish(p, 126);  // again: a credential change may have reset it
  build_root(p);
  const pid_t init = fork();
  if (init < 0) fail_at(p, kStageFork);
  if (init == 0) {  // PID 1 of the new namespace: runs the sample, reaps, reports its status
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // a killed supervisor takes the namespace along
    const pid_t sample = fork();
    if (sample < 0) _exit(125);
    if (sample == 0) sample_process(p);
    for (;;) {
      int status = 0;
      const pid_t w = waitpid(-1, &status, 0);
      if (w == sample) {
        report(p, kStatus, 0, status);
        _exit(0);  // as PID 1: the kernel kills everything left in the namespace
      }
      if (w < 0 && errno != EINTR) _exit(125);
    }
  }
  p.init = init;
  int code = 124;
  for (;;) {
    int status = 0;
    if (waitpid(init, &status, WNOHANG) == init) {
      p.init = 0;
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 125;
      break;
    }
    if (now_seconds() >= deadline) break;
    const struct timespec ms{0, 2000000};
    if (sigtimedwait(&term, nullptr, &ms) == SIGTERM) {  // the evaluator died or asks to stop
      code = 126;
      break;
    }
  }
  finish(p, code);
}

}  // namespace sigma::eval::detail
