#include "eval/sandbox.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/landlock.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "core/error.h"

namespace fs = std::filesystem;

namespace sigma::eval {

namespace {

// Landlock ABI 6 added scoping (signals, abstract sockets), ABI 4 network rules and ABI 3
// truncation; Debian 12's header stops at ABI 2,
// so the newer fields and bits are spelled here.
struct LandlockAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
  uint64_t scoped;  // ABI 6
};
constexpr uint64_t kFsTruncate = 1ull << 14;
constexpr uint64_t kNetBindTcp = 1ull << 0, kNetConnectTcp = 1ull << 1;
constexpr uint64_t kScopeAbstractUnix = 1ull << 0, kScopeSignal = 1ull << 1;
constexpr uid_t kNobody = 65534;

int landlock_abi() {
  const long v = syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
  return v < 0 ? 0 : int(v);
}

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

// What the interpreter may read besides its own directory: the system and its own install
// prefix (a python3 outside /usr). The evaluator's files, models and home stay unreadable.
std::vector<std::string> read_roots(const std::string& python) {
  std::vector<std::string> roots = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc", "/dev"};
  std::error_code ec;
  std::string exe = python;
  if (exe.find('/') == std::string::npos)  // resolve through PATH, as execvpe will
    for (const char* dir : {"/usr/local/bin", "/usr/bin", "/bin"})
      if (::access((fs::path(dir) / exe).c_str(), X_OK) == 0) { exe = (fs::path(dir) / exe).string(); break; }
  const fs::path real = fs::canonical(exe, ec);
  if (!ec) roots.push_back(real.parent_path().parent_path().string());
  return roots;
}

// Installed before the sample runs; an audit hook cannot be removed from Python code. After the
// program (sample and tests) returns, the guard writes the sentinel to fd 3: an early exit
// (sys.exit, os._exit, SystemExit from anywhere) never reaches that line.
constexpr const char* kGuard = R"PY(import os, sys
_root = os.path.realpath(os.getcwd())
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        r = os.path.realpath(os.fsdecode(p))
    except Exception:
        return False
    return r == _root or r.startswith(_root + os.sep)
_deny = {'os.fork', 'os.forkpty', 'os.posix_spawn', 'os.spawn', 'os.exec', 'os.system',
         'subprocess.Popen', 'socket.__new__', 'socket.connect', 'socket.bind', 'os.setuid',
         'pty.spawn', 'os.startfile'}
_paths = {'os.remove', 'os.rename', 'os.mkdir', 'os.rmdir', 'os.chmod', 'os.chown',
          'os.symlink', 'os.link', 'os.truncate', 'os.utime', 'shutil.rmtree', 'shutil.copyfile'}
_write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def _hook(event, args):
    if event in _deny or event.startswith('ctypes.'):
        raise PermissionError('sandbox: ' + event + ' is not allowed')
    if event == 'open':
        path, mode, flags = args
        w = any(c in mode for c in 'wax+') if isinstance(mode, str) else bool(flags & _write)
        if w and not _inside(path):
            raise PermissionError('sandbox: writing outside the sandbox: ' + str(path))
    elif event in _paths:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
                raise PermissionError('sandbox: ' + event + ' outside the sandbox: ' + str(p))
sys.addaudithook(_hook)
del _hook
_end = os.write
with open('sample.py', 'rb') as _f:
    _code = compile(_f.read(), 'sample.py', 'exec')
exec(_code, {'__name__': '__main__'})
_end(3, b'SIGMA-SANDBOX-END\n')
)PY";
constexpr std::string_view kSentinel = "SIGMA-SANDBOX-END\n";

std::string python_path(const SandboxLimits& l) {
  if (!l.python.empty()) return l.python;
  return ::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
  SIGMA_CHECK(out.good(), "sandbox: cannot write {}", p.string());
}

// Processes `uid` owns now (RLIMIT_NPROC counts all of them, the evaluator's included).
int processes_of(uid_t uid) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    struct stat st{};
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") == std::string::npos &&
        stat(e.path().c_str(), &st) == 0 && st.st_uid == uid)
      ++n;
  }
  return n;
}

// Everything the sandbox processes need, prepared before fork: after fork only system calls
// are safe (the evaluator has OpenMP threads, so the children may not allocate).
struct ChildPlan {
  std::string dir, out_path, python, guard, program, guard_path, sample_path;
  std::string mount_opts, uid_map, gid_map;
  std::vector<char*> argv, envp;
  std::vector<int> read_fds;  // O_PATH of each read-only root
  int abi = 0;
  bool as_root = false;  // and the directory was handed to nobody
  int report_fd = -1;    // write end: the sample's process reports its protections
  int status_fd = -1;    // write end: the namespace's init reports the sample's wait status
  int done_fd = -1;      // write end: the guard's sentinel (fd 3 in the sample)
  uint64_t memory = 0, file = 0;
  int nproc = 64;
  double seconds = 0;
  // Set by the supervisor after fork (its own copy).
  int dir_fd = -1;
  uint8_t got = 0;
};

// Bits reported before exec: which protections the sample actually got.
enum : uint8_t {
  kNetns = 1, kNobodyUser = 2, kLandlock = 4, kPidns = 8, kQuota = 16, kUserns = 32, kScoped = 64
};

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

// Writes only beneath the sandbox directory; reads only there and in the system roots; no TCP
// (ABI >= 4); no signals or abstract sockets outside the sandbox (ABI >= 6). 0 when the kernel
// has no Landlock, else the bits it got.
uint8_t restrict_with_landlock(const ChildPlan& p) {
  if (p.abi < 1) return 0;
  const uint64_t write = landlock_write_mask(p.abi);
  LandlockAttr attr{write | kRead, p.abi >= 4 ? (kNetBindTcp | kNetConnectTcp) : 0,
                    p.abi >= 6 ? (kScopeAbstractUnix | kScopeSignal) : 0};
  const size_t size = p.abi >= 6 ? sizeof(attr) : p.abi >= 4 ? 2 * sizeof(uint64_t) : sizeof(uint64_t);
  const int rs = int(syscall(SYS_landlock_create_ruleset, &attr, size, 0));
  if (rs < 0 || !add_rule(rs, p.dir_fd, write | kRead)) _exit(125);
  for (int fd : p.read_fds)  // a file root (none today) would refuse READ_DIR: read-only files
    if (!add_rule(rs, fd, kRead)) _exit(125);
  if (syscall(SYS_landlock_restrict_self, rs, 0) != 0) _exit(125);
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

// The sample's process: limits, its user, Landlock, then python3.
[[noreturn]] void sample_process(const ChildPlan& p) {
  const int done = fcntl(p.done_fd, F_DUPFD, 64);  // becomes fd 3 just before exec
  if (done < 0 || chdir(p.dir.c_str()) != 0) _exit(125);
  set_limit(RLIMIT_CPU, uint64_t(std::ceil(p.seconds)) + 1);
  set_limit(RLIMIT_AS, p.memory);
  set_limit(RLIMIT_FSIZE, p.file);
  set_limit(RLIMIT_NOFILE, 64);
  set_limit(RLIMIT_CORE, 0);
  set_limit(RLIMIT_NPROC, uint64_t(p.nproc));  // binds below root only: hence nobody as root
  uint8_t got = p.got;
  if (p.as_root) {
    if (setgroups(0, nullptr) != 0 || setgid(kNobody) != 0 || setuid(kNobody) != 0) _exit(125);
    got |= kNobodyUser;
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) _exit(125);
  got |= restrict_with_landlock(p);
  if (write(p.report_fd, &got, 1) != 1) _exit(125);
  if (dup2(done, 3) != 3) _exit(125);
  close(done);
  execvpe(p.python.c_str(), p.argv.data(), p.envp.data());
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

// The supervisor (a child of the evaluator): namespaces, the tmpfs, then the namespace's init
// which runs the sample. It enforces the wall clock and, at the end, kills whatever is left.
// Exits 0 (the sample's status is on the status pipe), 124 (timeout) or 125 (set-up failed).
[[noreturn]] void supervisor(ChildPlan& p) {  // its own copy of the plan, after fork
  setpgid(0, 0);  // its own process group: the evaluator's backstop kills the group
  prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // an evaluator that dies takes the sample along
  const int in = open("/dev/null", O_RDONLY);
  const int out = open(p.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (in < 0 || out < 0) _exit(125);
  dup2(in, 0), dup2(out, 1), dup2(out, 2);
  const double deadline = now_seconds() + p.seconds;
  constexpr int kAll = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET;
  if (p.as_root || geteuid() == 0) {
    if (unshare(kAll) == 0) p.got |= kNetns | kPidns | kQuota;
    else if (unshare(CLONE_NEWNET) == 0) p.got |= kNetns;
  } else if (unshare(CLONE_NEWUSER | kAll) == 0) {
    // Map our own uid and gid, so files are ours and nothing gains a privilege outside. A
    // process that changed its uid (a setuid wrapper, su) is not dumpable, and /proc/self's
    // map files are then root's: make it dumpable again (the sample runs as this user anyway).
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    if (!write_file("/proc/self/setgroups", "deny", O_WRONLY, 0) ||
        !write_file("/proc/self/uid_map", p.uid_map, O_WRONLY, 0) ||
        !write_file("/proc/self/gid_map", p.gid_map, O_WRONLY, 0))
      _exit(125);
    p.got |= kUserns | kNetns | kPidns | kQuota;
  }
  if (p.got & kQuota) {  // a tmpfs of disk_bytes over the directory, private to this namespace
    if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("sigma-sandbox", p.dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, p.mount_opts.c_str()) != 0) {
      p.got &= uint8_t(~kQuota);
    } else {
      if (!write_file(p.guard_path.c_str(), p.guard, O_WRONLY | O_CREAT | O_TRUNC, 0644) ||
          !write_file(p.sample_path.c_str(), p.program, O_WRONLY | O_CREAT | O_TRUNC, 0644))
        _exit(125);
    }
  }
  p.dir_fd = open(p.dir.c_str(), O_PATH | O_CLOEXEC);  // after the mount: the tmpfs' root
  if (p.dir_fd < 0) _exit(125);
  const pid_t init = fork();
  if (init < 0) _exit(125);
  if (init == 0) {  // PID 1 of the new namespace (when there is one): runs the sample, reaps
    const pid_t sample = fork();
    if (sample < 0) _exit(125);
    if (sample == 0) sample_process(p);
    for (;;) {
      int status = 0;
      const pid_t w = waitpid(-1, &status, 0);
      if (w == sample) {
        if (!write_all(p.status_fd, reinterpret_cast<const char*>(&status), sizeof status)) _exit(125);
        _exit(0);  // as PID 1: the kernel kills everything left in the namespace
      }
      if (w < 0 && errno != EINTR) _exit(125);
    }
  }
  int code = 124;
  for (;;) {
    int status = 0;
    const pid_t w = waitpid(init, &status, WNOHANG);
    if (w == init) {
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 125;
      break;
    }
    if (now_seconds() >= deadline) {
      kill(init, SIGKILL);
      break;
    }
    const struct timespec ms{0, 2000000};
    nanosleep(&ms, nullptr);
  }
  kill_descendants();
  _exit(code);
}

std::string protections_text(uint8_t got) {
  std::string s = "rlimits subreaper";
  if (got & kPidns) s += " pidns";
  if (got & kUserns) s += " userns";
  if (got & kNetns) s += " netns";
  if (got & kQuota) s += " disk-quota";
  if (got & kNobodyUser) s += " nobody";
  if (got & kLandlock) s += fmt::format(" landlock-abi{}", landlock_abi());
  if (got & kScoped) s += " signal-scope";
  return s + " audit-hook sentinel";
}

// The last non-empty line of the captured output (at most 300 bytes), for the reason.
std::string last_line(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), {});
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  const size_t nl = s.rfind('\n');
  std::string line = nl == std::string::npos ? s : s.substr(nl + 1);
  return line.size() > 300 ? line.substr(0, 300) : line;
}

// Waits for the supervisor (it keeps the sample's clock itself; this deadline is a backstop
// for a supervisor that hangs), then kills its group and reaps it. Returns its exit status.
int wait_supervisor(pid_t pid, double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    siginfo_t info{};
    // WNOWAIT: the child stays a zombie, so its group id cannot be reused before killpg.
    if (waitid(P_PID, id_t(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) break;
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  kill(-pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) ? WEXITSTATUS(status) : 124;
}

std::string read_available(int fd, size_t most) {
  std::string s;
  char buf[256];
  for (ssize_t n; s.size() < most && (n = read(fd, buf, sizeof buf)) > 0;) s.append(buf, size_t(n));
  return s;
}

}  // namespace

SandboxResult run_python_sandboxed(const std::string& program, const SandboxLimits& limits) {
  std::string tmpl = (fs::temp_directory_path() / "sigma-sandbox-XXXXXX").string();
  SIGMA_CHECK(::mkdtemp(tmpl.data()), "sandbox: cannot create a temporary directory: {}",
              std::strerror(errno));
  const fs::path dir = tmpl;
  struct Cleanup {
    fs::path d;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(d, ec);
    }
  } cleanup{dir};
  const fs::path box = dir / "box";  // the sample's directory; its output lands beside it
  fs::create_directory(box);
  write_text(box / "sample.py", program);  // also written into the tmpfs, when there is one
  write_text(box / "guard.py", kGuard);

  ChildPlan p;
  p.dir = box.string();
  p.out_path = (dir / "output.txt").string();
  p.python = python_path(limits);
  p.guard = kGuard;
  p.program = program;
  p.guard_path = (box / "guard.py").string();
  p.sample_path = (box / "sample.py").string();
  p.abi = landlock_abi();
  // As root the child runs as nobody, in a directory nobody owns (where chown is not permitted,
  // e.g. a container without CAP_CHOWN, it stays root: Landlock and the audit hook remain).
  p.as_root = geteuid() == 0 && chown(box.c_str(), kNobody, kNobody) == 0 &&
              chown(dir.c_str(), kNobody, kNobody) == 0;
  const uid_t uid = p.as_root ? kNobody : geteuid();
  const gid_t gid = p.as_root ? kNobody : getegid();
  p.mount_opts = fmt::format("size={},nr_inodes=4096,mode=0700,uid={},gid={}",
                             std::max<uint64_t>(limits.disk_bytes, 4096), uid, gid);
  p.uid_map = fmt::format("{} {} 1\n", geteuid(), geteuid());
  p.gid_map = fmt::format("{} {} 1\n", getegid(), getegid());
  // RLIMIT_NPROC counts every process of the user; as nobody or in a user namespace those are
  // the sandboxes', otherwise the evaluator's own count is added.
  p.nproc = limits.processes;
  if (!p.as_root && geteuid() != 0) p.nproc += processes_of(geteuid());
  p.memory = limits.memory_bytes;
  p.file = limits.file_bytes;
  p.seconds = limits.seconds;
  if (p.as_root) chmod(dir.c_str(), 0700);
  for (const std::string& root : read_roots(p.python)) {
    struct stat st{};
    if (stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    const int fd = open(root.c_str(), O_PATH | O_CLOEXEC);
    if (fd >= 0) p.read_fds.push_back(fd);
  }
  std::string a0 = p.python, a1 = "-I", a2 = "-B", a3 = "guard.py";
  std::string e0 = "PATH=/usr/bin:/bin", e1 = "HOME=" + p.dir, e2 = "LANG=C.UTF-8";
  p.argv = {a0.data(), a1.data(), a2.data(), a3.data(), nullptr};
  p.envp = {e0.data(), e1.data(), e2.data(), nullptr};

  // Read ends non-blocking: a writer the sample left behind can never stall the evaluator.
  int report[2], status[2], done[2];
  SIGMA_CHECK(pipe2(report, O_CLOEXEC) == 0 && pipe2(status, O_CLOEXEC) == 0 &&
              pipe2(done, O_CLOEXEC) == 0, "sandbox: pipe failed: {}", std::strerror(errno));
  for (int fd : {report[0], status[0], done[0]}) fcntl(fd, F_SETFL, O_NONBLOCK);
  p.report_fd = report[1];
  p.status_fd = status[1];
  p.done_fd = done[1];
  const pid_t pid = fork();
  if (pid == 0) supervisor(p);
  for (int fd : {report[1], status[1], done[1]}) close(fd);
  for (int fd : p.read_fds) close(fd);
  SIGMA_CHECK(pid > 0, "sandbox: fork failed: {}", std::strerror(errno));
  setpgid(pid, pid);  // also here, so the group exists before any kill
  const int code = wait_supervisor(pid, limits.seconds + 10);
  SandboxResult r;
  uint8_t got = 0;
  int st = 0;
  const bool reported = read(report[0], &got, 1) == 1;
  const bool have_status = code == 0 && read(status[0], &st, sizeof st) == sizeof st;
  r.finished = read_available(done[0], 64) == kSentinel;
  for (int fd : {report[0], status[0], done[0]}) close(fd);
  r.protections = reported ? protections_text(got) : "";
  r.timed_out = code == 124;
  if (have_status && WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  if (have_status && WIFSIGNALED(st)) r.signal = WTERMSIG(st);
  const std::string tail = last_line(p.out_path);
  if (r.timed_out) r.outcome = "timeout", r.why = fmt::format("timeout after {} s", limits.seconds);
  else if (!have_status) r.outcome = "error", r.why = "the sandbox could not be set up";
  else if (r.signal) r.outcome = "killed", r.why = fmt::format("killed by signal {} ({})", r.signal, strsignal(r.signal));
  else if (r.exit_code == 125) r.outcome = "error", r.why = "the sandbox could not be set up";
  else if (r.exit_code == 127) r.outcome = "error", r.why = fmt::format("cannot run {}", p.python);
  else if (r.exit_code != 0) r.outcome = "failed", r.why = fmt::format("exit {}: {}", r.exit_code, tail);
  else if (!r.finished) r.outcome = "early_exit", r.why = "exit 0 before the tests finished (sys.exit or os._exit)";
  else r.outcome = "passed", r.why = "ok";
  r.passed = r.outcome == "passed";
  return r;
}

}  // namespace sigma::eval
