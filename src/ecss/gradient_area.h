// Where ECSS accumulates a step's expert gradients (docs/ecss.md, "Memory budget"): one slot per
// expert of a store, P floats each on its own pages, zero until written. The compute side holds
// only the weights of the experts it is running (train.expert_memory); every backward pass adds
// its experts' gradients into their slots, in micro-batch order, and the lazy Adam reads them
// once per step and releases them.
//
// Backing follows the store's: beside a file-backed store, an unnamed temporary file in the same
// directory (O_TMPFILE: a crash leaves nothing behind), so that the gradients of a step larger
// than RAM live in the page cache, which the kernel can write out, not in the process's own
// anonymous memory; with a store in RAM, anonymous memory mapped lazily. Either way a slot
// costs memory only once written, and release() hands the memory back and makes it read zero
// again, dropping dirty pages without writing them to disk. The file's blocks are reserved at
// creation, so a full disk is an error then and not a SIGBUS mid-step.
#pragma once
#include <cstdint>
#include <span>
#include <string>

namespace sigma {

class GradientArea {
 public:
  GradientArea() = default;
  // `slots` slots of `floats` floats. beside_file: the store file to sit beside ("" = RAM).
  GradientArea(int64_t slots, int64_t floats, const std::string& beside_file);
  GradientArea(GradientArea&&) noexcept;
  GradientArea& operator=(GradientArea&&) noexcept;
  GradientArea(const GradientArea&) = delete;
  GradientArea& operator=(const GradientArea&) = delete;
  ~GradientArea();

  // bytes() of an area of `slots` slots of `floats` floats.
  static uint64_t bytes_for(int64_t slots, int64_t floats);

  float* slot(int64_t i) const { return reinterpret_cast<float*>(map_ + uint64_t(i) * slot_bytes_); }
  uint64_t bytes() const { return map_bytes_; }
  bool file_backed() const { return fd_ >= 0; }

  // Zeroes these slots and returns their memory (runs of adjacent slots in one call each).
  void release(std::span<const int64_t> slots);

 private:
  void release_range(uint64_t offset, uint64_t bytes);
  void close() noexcept;
  std::byte* map_ = nullptr;
  uint64_t map_bytes_ = 0, slot_bytes_ = 0;
  int fd_ = -1;
  std::string where_;  // for errors: the directory of the file, or "RAM"
};

}  // namespace sigma
