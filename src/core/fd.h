// A POSIX file descriptor owned by a scope, so that every error path closes it.
#pragma once
#include <unistd.h>

namespace sigma {

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace sigma
