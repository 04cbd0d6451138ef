#include "eval/sandbox.h"

#include <fcntl.h>
#include <grp.h>
#include <linux/landlock.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
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

// Landlock ABI 4 added network rules and ABI 3 truncation; Debian 12's header stops at ABI 2,
// so the newer fields and bits are spelled here.
struct LandlockAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
};
constexpr uint64_t kFsTruncate = 1ull << 14;
constexpr uint64_t kNetBindTcp = 1ull << 0, kNetConnectTcp = 1ull << 1;
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

// Installed before the sample runs; an audit hook cannot be removed from Python code.
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
with open('sample.py', 'rb') as _f:
    _code = compile(_f.read(), 'sample.py', 'exec')
exec(_code, {'__name__': '__main__'})
)PY";

std::string python_path(const SandboxLimits& l) {
  if (!l.python.empty()) return l.python;
  return ::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
  SIGMA_CHECK(out.good(), "sandbox: cannot write {}", p.string());
}

// Everything the child needs, prepared before fork: after fork only system calls are safe (the
// evaluator has OpenMP threads, so the child may not allocate).
struct ChildPlan {
  std::string dir, out_path, python;
  std::vector<char*> argv, envp;
  int dir_fd = -1;            // O_PATH of the sandbox directory, for the Landlock rules
  std::vector<int> read_fds;  // O_PATH of each read-only root
  int abi = 0;
  bool as_root = false;  // and the directory was handed to nobody
  int report_fd = -1;    // write end of the pipe the child reports its protections on
  uint64_t memory = 0, file = 0;
  double seconds = 0;
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

// Writes only beneath the sandbox directory; reads only there and in the system roots. False
// when the kernel has no Landlock.
bool restrict_with_landlock(const ChildPlan& p) {
  if (p.abi < 1) return false;
  const uint64_t write = landlock_write_mask(p.abi);
  LandlockAttr attr{write | kRead, p.abi >= 4 ? (kNetBindTcp | kNetConnectTcp) : 0};
  const size_t size = p.abi >= 4 ? sizeof(attr) : sizeof(attr.handled_access_fs);
  const int rs = int(syscall(SYS_landlock_create_ruleset, &attr, size, 0));
  if (rs < 0 || !add_rule(rs, p.dir_fd, write | kRead)) _exit(125);
  for (int fd : p.read_fds)  // a file root (none today) would refuse READ_DIR: read-only files
    if (!add_rule(rs, fd, kRead)) _exit(125);
  if (syscall(SYS_landlock_restrict_self, rs, 0) != 0) _exit(125);
  close(rs);
  return true;
}

// Bits the child reports before exec: which protections it actually got.
enum : uint8_t { kNetns = 1, kNobodyUser = 2, kLandlock = 4 };

[[noreturn]] void child(const ChildPlan& p) {
  setpgid(0, 0);  // its own process group: a timeout kills everything it started
  const int in = open("/dev/null", O_RDONLY);
  const int out = open(p.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (in < 0 || out < 0 || chdir(p.dir.c_str()) != 0) _exit(125);
  dup2(in, 0), dup2(out, 1), dup2(out, 2);
  uint8_t got = 0;
  if (unshare(CLONE_NEWNET) == 0 || unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0) got |= kNetns;
  set_limit(RLIMIT_CPU, uint64_t(std::ceil(p.seconds)) + 1);
  set_limit(RLIMIT_AS, p.memory);
  set_limit(RLIMIT_FSIZE, p.file);
  set_limit(RLIMIT_NOFILE, 64);
  set_limit(RLIMIT_CORE, 0);
  if (p.as_root) {  // RLIMIT_NPROC binds only below root; nobody owns nothing outside the dir
    set_limit(RLIMIT_NPROC, 64);
    if (setgroups(0, nullptr) != 0 || setgid(kNobody) != 0 || setuid(kNobody) != 0) _exit(125);
    got |= kNobodyUser;
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) _exit(125);
  if (restrict_with_landlock(p)) got |= kLandlock;
  if (write(p.report_fd, &got, 1) != 1) _exit(125);
  execvpe(p.python.c_str(), p.argv.data(), p.envp.data());
  _exit(127);
}

std::string protections_text(uint8_t got) {
  std::string s = "rlimits process-group-kill";
  if (got & kNetns) s += " netns";
  if (got & kNobodyUser) s += " nobody";
  if (got & kLandlock) s += fmt::format(" landlock-abi{}", landlock_abi());
  return s + " audit-hook";
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

// Waits until the child exits or the deadline passes; then the whole group is killed (a sample
// may have left processes behind) and the child reaped.
SandboxResult wait_and_reap(pid_t pid, double seconds) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  SandboxResult r;
  for (;;) {
    siginfo_t info{};
    // WNOWAIT: the child stays a zombie, so its group id cannot be reused before killpg.
    if (waitid(P_PID, id_t(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid) break;
    if (Clock::now() >= deadline) {
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  kill(-pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
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
  write_text(box / "sample.py", program);
  write_text(box / "guard.py", kGuard);

  ChildPlan p;
  p.dir = box.string();
  p.out_path = (dir / "output.txt").string();
  p.python = python_path(limits);
  p.abi = landlock_abi();
  // As root the child runs as nobody, in a directory nobody owns (where chown is not permitted,
  // e.g. a container without CAP_CHOWN, it stays root: Landlock and the audit hook remain).
  p.as_root = geteuid() == 0 && chown(box.c_str(), kNobody, kNobody) == 0 &&
              chown(dir.c_str(), kNobody, kNobody) == 0;
  p.memory = limits.memory_bytes;
  p.file = limits.file_bytes;
  p.seconds = limits.seconds;
  if (p.as_root) chmod(dir.c_str(), 0700);
  p.dir_fd = open(p.dir.c_str(), O_PATH | O_CLOEXEC);
  SIGMA_CHECK(p.dir_fd >= 0, "sandbox: cannot open {}", p.dir);
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

  int report[2];
  SIGMA_CHECK(pipe2(report, O_CLOEXEC) == 0, "sandbox: pipe failed: {}", std::strerror(errno));
  p.report_fd = report[1];
  const pid_t pid = fork();
  if (pid == 0) child(p);
  close(report[1]);
  close(p.dir_fd);
  for (int fd : p.read_fds) close(fd);
  SIGMA_CHECK(pid > 0, "sandbox: fork failed: {}", std::strerror(errno));
  setpgid(pid, pid);  // also here, so the group exists before any kill
  SandboxResult r = wait_and_reap(pid, limits.seconds);
  uint8_t got = 0;
  const bool reported = read(report[0], &got, 1) == 1;  // the child has exited: no blocking
  close(report[0]);
  r.protections = reported ? protections_text(got) : "";
  const std::string tail = last_line(p.out_path);
  if (r.timed_out) r.why = fmt::format("timeout after {} s", limits.seconds);
  else if (r.signal) r.why = fmt::format("killed by signal {} ({})", r.signal, strsignal(r.signal));
  else if (r.exit_code == 125) r.why = "the sandbox could not be set up";
  else if (r.exit_code == 127) r.why = fmt::format("cannot run {}", p.python);
  else if (r.exit_code != 0) r.why = fmt::format("exit {}: {}", r.exit_code, tail);
  else r.why = "ok";
  r.passed = !r.timed_out && r.signal == 0 && r.exit_code == 0;
  return r;
}

}  // namespace sigma::eval
