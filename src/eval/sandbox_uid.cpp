// A user of its own for each sample run as root (docs/evaluation.md, "Its own user"). The
// kernel counts RLIMIT_NPROC per user: samples that shared one user (nobody) shared one count,
// so a fork bomb in one sample, or in another evaluator's, made the forks of every other fail.
// Each sample now runs as a uid and gid of its own from a range no account uses, held by a lock
// for as long as any process of the sample may exist:
// - the range: 2^24 ids from 0x70000000 (1879048192), which systemd's uid map leaves unused
//   (above its container ranges 524288-1879048191, below the foreign range and 2^31), and
//   outside /etc/subuid and /etc/subgid ranges, /etc/passwd and /etc/group (checked per id);
// - the lock: a Unix socket bound to the abstract name "sigma-sandbox-uid-N" in the evaluator's
//   network namespace. bind() either takes the name or fails with EADDRINUSE, atomically; the
//   kernel frees the name when the last descriptor of the socket closes, so nothing is ever
//   left behind (no lock file to remove, no stale lock after a crash), and it is the same in a
//   chroot (mount namespaces do not matter, unlike a lock file under /run or /tmp). The
//   supervisor inherits the descriptor: an evaluator killed by SIGKILL still holds the id
//   through its supervisor until that has killed and reaped the sample's processes;
// - a check after binding: an id with any process left (an evaluator and its supervisor both
//   SIGKILLed, the sample's processes not reaped yet) is skipped, by the real uid of
//   /proc/PID/status, so that a new sample never shares a count with an old one;
// - released (closed) after the supervisor is reaped.
// The search starts at a random id, so evaluators that cannot see each other's names and
// processes (containers with their own network and PID namespaces, as root on one kernel)
// collide only by chance, one in 2^24 per pair of samples running at once.
#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "eval/sandbox_child.h"

namespace fs = std::filesystem;

namespace sigma::eval::detail {

namespace {

constexpr uint32_t kFirstSampleId = 0x70000000u;
constexpr uint32_t kSampleIds = 1u << 24;

// [first, first + count) ranges of /etc/subuid or /etc/subgid ("name:first:count" lines).
std::vector<std::pair<uint64_t, uint64_t>> sub_id_ranges(const char* path) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    try {
      const uint64_t first = std::stoull(line.substr(a + 1, b - a - 1)), count = std::stoull(line.substr(b + 1));
      out.emplace_back(first, first + count);
    } catch (const std::exception&) {  // a malformed line names no range
    }
  }
  return out;
}

bool id_is_in_use(uint32_t id) {
  static std::once_flag once;
  static std::vector<std::pair<uint64_t, uint64_t>> sub;
  std::call_once(once, [] {
    sub = sub_id_ranges("/etc/subuid");
    const auto g = sub_id_ranges("/etc/subgid");
    sub.insert(sub.end(), g.begin(), g.end());
  });
  for (const auto& [lo, hi] : sub)
    if (id >= lo && id < hi) return true;
  return getpwuid(id) != nullptr || getgrgid(id) != nullptr;
}

}  // namespace

// Processes whose real uid is `uid` now (what RLIMIT_NPROC counts). /proc/PID's own owner is
// root for a process that is not dumpable (just after setuid), so the status file is read.
int processes_of(uid_t uid) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const int fd = open((e.path() / "status").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // ended meanwhile
    char buf[2048];
    const ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (got <= 0) continue;
    buf[got] = '\0';
    if (const char* u = std::strstr(buf, "\nUid:\t")) n += std::strtoul(u + 6, nullptr, 10) == uid;
  }
  return n;
}

SampleUser::~SampleUser() { release(); }

SampleUser& SampleUser::operator=(SampleUser&& o) noexcept {
  if (this != &o) {
    release();
    id = std::exchange(o.id, 0);
    lock_fd = std::exchange(o.lock_fd, -1);
  }
  return *this;
}

void SampleUser::release() {
  if (lock_fd >= 0) close(lock_fd);
  lock_fd = -1;
}

SampleUser take_sample_user() {
  uint32_t start = 0;
  SIGMA_CHECK(getrandom(&start, sizeof start, 0) == sizeof start, "sandbox: getrandom failed: {}", std::strerror(errno));
  for (uint32_t i = 0; i < 4096; ++i) {
    const uint32_t id = kFirstSampleId + (start + i) % kSampleIds;
    if (id_is_in_use(id)) continue;
    SampleUser u;
    u.id = id;
    u.lock_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    SIGMA_CHECK(u.lock_fd >= 0, "sandbox: cannot make the socket that locks a sample's uid: {}", std::strerror(errno));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = "sigma-sandbox-uid-" + std::to_string(id);  // sun_path[0] = '\0': abstract
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    const socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (bind(u.lock_fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
      SIGMA_CHECK(errno == EADDRINUSE, "sandbox: cannot lock uid {} for a sample (bind @{}): {}", id, name,
                  std::strerror(errno));
      continue;  // another sample holds it (u's destructor closes the socket)
    }
    if (processes_of(id) > 0) continue;  // left by a SIGKILLed evaluator and supervisor
    return u;
  }
  ::sigma::fail("sandbox: no free uid for the sample in [{}, {}) after 4096 tries", kFirstSampleId,
                uint64_t(kFirstSampleId) + kSampleIds);
}

}  // namespace sigma::eval::detail
