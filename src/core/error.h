// Errors: one exception type; the CLI prints its message as one line and exits non-zero.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace sigma {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace sigma

// Checks a condition that bad input can break; the message says what and where.
#define SIGMA_CHECK(cond, ...)          \
  do {                                  \
    if (!(cond)) ::sigma::fail(__VA_ARGS__); \
  } while (0)
