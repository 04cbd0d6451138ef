// A std::vector whose resize leaves new elements uninitialized, for buffers that are filled
// whole before anything reads them (the data-parallel exchange's send and receive buffers:
// std::vector's value-initialization would write every byte once more, for nothing).
#pragma once

#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace sigma {

template <class T>
struct DefaultInitAllocator : std::allocator<T> {
  using value_type = T;
  DefaultInitAllocator() noexcept = default;
  template <class U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;  // default-initialization: no write for arithmetic types
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

template <class T, class U>
bool operator==(const DefaultInitAllocator<T>&, const DefaultInitAllocator<U>&) noexcept {
  return true;
}

template <class T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

}  // namespace sigma
