// Plain POSIX file helpers: the one place for durable writes (temp + fsync + rename), exact
// reads and writes, and errno messages. Everything that writes files (checkpoints, safetensors,
// the expert store, shards) goes through here.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace sigma {

// A POSIX file descriptor owned by a scope, so that every error path closes it.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  // Closes now and reports close(2)'s error (a deferred write error on some filesystems).
  void close_checked(const std::string& path);
};

// strerror of errno (or of `e`).
std::string errno_str();
std::string errno_str(int e);
// A byte count in GiB for messages ("1.50 GiB").
std::string gib_str(uint64_t bytes);

// Writes all n bytes (write(2) may write less, and Linux caps one call just under 2 GiB).
void write_all(int fd, const void* p, size_t n, const std::string& path);
// Reads exactly n bytes at `off`; running out early means the file shrank or lied.
void read_at(int fd, void* p, size_t n, uint64_t off, const std::string& where);

// fsync of a file, or of a directory (which makes the entries created or renamed in it durable).
void fsync_path(const std::string& path, bool dir);
// fsync of the directory holding `path` (best effort: used after a rename into it).
void fsync_parent(const std::string& path);

// Writes `text` to `path` and fsyncs it (no rename: callers inside a temporary directory).
void write_file_synced(const std::string& path, const std::string& text);
// Durable replacement: writes path.tmp-<pid>, fsyncs it, renames it over `path`, fsyncs the
// directory. A crash leaves either the old file or the new one, never a mix (and a
// path.tmp-<pid> that the next write_file_atomic of `path` removes).
void write_file_atomic(const std::string& path, const std::string& text);

// Removes what killed processes left in `dir`: entries named PREFIX*.tmp-<pid> or
// PREFIX*.old-<pid> (this file's and CheckpointWriter's temporaries) whose pid is no live
// process. Returns how many went. A live writer's temporaries are kept.
int remove_dead_temporaries(const std::string& dir, const std::string& prefix = "");

// A whole small file; more than `limit` bytes is an error naming the file.
std::string read_small_file(const std::string& path, size_t limit);

}  // namespace sigma
