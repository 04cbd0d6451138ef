#include "io/file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace sigma {

std::string errno_str(int e) { return std::strerror(e); }
std::string errno_str() { return errno_str(errno); }
std::string gib_str(uint64_t bytes) {
  return fmt::format("{:.2f} GiB", double(bytes) / (1ull << 30));
}

void Fd::close_checked(const std::string& path) {
  const int f = fd;
  fd = -1;
  SIGMA_CHECK(::close(f) == 0, "cannot close '{}': {}", path, errno_str());
}

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("cannot write '{}': {}", path, errno_str());
    }
    c += w;
    n -= static_cast<size_t>(w);
  }
}

void read_at(int fd, void* p, size_t n, uint64_t off, const std::string& where) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::pread(fd, c, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail("{}: read error: {}", where, errno_str());
    }
    if (r == 0) fail("{}: truncated: unexpected end of file at byte {}", where, off);
    c += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
}

void fsync_path(const std::string& path, bool dir) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | (dir ? O_DIRECTORY : 0)));
  SIGMA_CHECK(f.fd >= 0, "cannot open '{}' to fsync it: {}", path, errno_str());
  SIGMA_CHECK(::fsync(f.fd) == 0, "cannot fsync '{}': {}", path, errno_str());
}

void fsync_parent(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  Fd d(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd >= 0) ::fsync(d.fd);
}

void write_file_synced(const std::string& path, const std::string& text) {
  Fd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  SIGMA_CHECK(f.fd >= 0, "cannot create '{}': {}", path, errno_str());
  write_all(f.fd, text.data(), text.size(), path);
  SIGMA_CHECK(::fsync(f.fd) == 0, "cannot fsync '{}': {}", path, errno_str());
  f.close_checked(path);
}

int remove_dead_temporaries(const std::string& dir, const std::string& prefix) {
  namespace fs = std::filesystem;
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir.empty() ? "." : dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    size_t at = name.rfind(".tmp-");
    if (at == std::string::npos) at = name.rfind(".old-");
    if (at == std::string::npos || at + 5 == name.size() ||
        name.find_first_not_of("0123456789", at + 5) != std::string::npos)
      continue;
    const long pid = std::strtol(name.c_str() + at + 5, nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    if (fs::remove_all(e.path(), rm) > 0 && !rm) ++removed;
  }
  return removed;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const std::filesystem::path p(path);
  remove_dead_temporaries(p.parent_path().string(), p.filename().string() + ".tmp-");
  try {
    write_file_synced(tmp, text);
    SIGMA_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '{}' to '{}': {}", tmp,
                path, errno_str());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_parent(path);
}

std::string read_small_file(const std::string& path, size_t limit) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  SIGMA_CHECK(f.fd >= 0, "cannot open '{}': {}", path, errno_str());
  std::string s;
  char buf[4096];
  for (;;) {
    ssize_t r = ::read(f.fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    SIGMA_CHECK(r >= 0, "cannot read '{}': {}", path, errno_str());
    if (r == 0) return s;
    s.append(buf, static_cast<size_t>(r));
    SIGMA_CHECK(s.size() <= limit, "'{}' is larger than {} bytes; it is not what it should be",
                path, limit);
  }
}

}  // namespace sigma
