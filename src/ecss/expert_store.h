// The ECSS expert store (DESIGN §3, issue 5; docs/ecss.md): per expert one contiguous record of
// fp32 master weights, Adam m and v and the expert's own step count, in RAM or in a
// memory-mapped file so that all experts with their optimizer state may exceed RAM.
//
// Record layout (every record starts on a 64-byte line; P = the expert's parameter count, the
// sizes of its tensors in spec order, Pp = P rounded up to 16 floats):
//   [int64 step | 56 bytes zero][w: Pp floats][m: Pp floats][v: Pp floats]
// Weights, gradients and gather buffers use the same concatenated layout: tensor t of the
// expert starts at float offset ExpertGroupSpec::offset(t).
//
// File layout: a 4096-byte header (magic "SIGMAECS", version, spec hash, counts, sizes, clean
// flag), then the records of every group in spec order, expert 0 first. The file is reserved
// in full when created (a full disk fails then, not at a random later write) and locked while
// open (a second writer is an error).
//
// Lazy Adam: apply_grads advances only that expert's moments and step (hence its bias
// correction); experts not updated stay bit for bit as they were.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/adam.h"
#include "optim/adamw.h"
#include "io/safetensors.h"

namespace sigma {

struct ExpertTensorSpec {
  std::string name;  // e.g. "w_in"
  Shape shape;       // of one expert, e.g. [d, f]
  bool decay;        // weight decay applies (linear weights; not biases)
};

// The K experts of one (block, group); every expert of a group has the same tensors.
struct ExpertGroupSpec {
  int32_t block = 0, group = 0, experts = 0;
  std::vector<ExpertTensorSpec> tensors;

  int64_t params() const;             // P: floats of one expert's weights
  int64_t offset(size_t t) const;     // float offset of tensor t inside the weights
  std::string prefix() const;         // "blocks.{block}.rre.{group}"
};

// RRE's expert FFN (src/model/rre.h): w_in [d,f], b_in [f], w_out [f,d], b_out [d].
ExpertGroupSpec rre_group_spec(int32_t block, int32_t group, int32_t experts, int64_t d, int64_t f);

struct ExpertStoreSpec {
  std::vector<ExpertGroupSpec> groups;
  // Throws sigma::Error on a duplicate (block, group), no experts, no tensors, a bad shape or
  // duplicate tensor names.
  void validate() const;
  std::string canonical() const;  // the text the hash covers: every field, in order
  uint64_t hash() const;          // xxh3_64 of canonical()
};

struct ExpertId {
  int32_t block = 0, group = 0, expert = 0;
  friend bool operator==(const ExpertId&, const ExpertId&) = default;
};

// The arguments of an expert's lazy Adam update under `o` (the hybrid Adam's eps_rre).
AdamStepArgs expert_adam_args(const OptimConfig& o, float lr, float grad_scale);

class ExpertStore {
 public:
  // All records zero (weights, moments, steps); anonymous, page-aligned memory.
  static ExpertStore in_ram(ExpertStoreSpec spec);
  // Opens the store file at `path`, creating it (all records zero) when it does not exist.
  // Throws sigma::Error naming the file when it cannot be created or opened for writing, lacks
  // the disk space, is locked by another open store, or is not a store of this version, spec
  // and size.
  static ExpertStore open(const std::string& path, ExpertStoreSpec spec);

  ExpertStore(ExpertStore&&) noexcept;
  ExpertStore& operator=(ExpertStore&&) noexcept;
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;
  ~ExpertStore();  // a file-backed store is flushed (errors are swallowed: call flush()) and closed

  const ExpertStoreSpec& spec() const { return spec_; }
  bool file_backed() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // open(): true when the file was created by this call (the trainer initialises the weights).
  bool created() const { return created_; }
  // open(): false when the file was being modified when its last user stopped (a crash between
  // two flushes): its records may mix steps, restore them from a checkpoint with import_tensors.
  bool clean_on_open() const { return clean_on_open_; }
  int64_t num_experts() const { return int64_t(index_.size()); }
  uint64_t data_bytes() const { return data_bytes_; }  // all records

  const ExpertGroupSpec& group_of(ExpertId id) const;
  // The expert's position in the store, 0 .. num_experts() - 1 (spec order).
  int64_t ordinal(ExpertId id) const { return &slot(id) - index_.data(); }
  int64_t params(ExpertId id) const { return group_of(id).params(); }
  uint64_t record_bytes(ExpertId id) const { return groups_[slot(id).group].record_bytes; }
  int64_t step(ExpertId id) const;
  // Views into the record (P floats each); writing through weights() sets master weights.
  float* weights(ExpertId id);
  const float* weights(ExpertId id) const;
  const float* m(ExpertId id) const;
  const float* v(ExpertId id) const;

  // Copies each expert's P weights to dst[i] (ids.size() == dst.size()), in parallel over
  // experts: host memory (this store) to compute buffers on the active backend's device
  // (ops::upload). The compute dtype is fp32.
  void gather(std::span<const ExpertId> ids, std::span<float* const> dst) const;
  // What gather() has copied since the store was opened: weight records, and calls that copied
  // at least one (the store's own count, against which the executor's counters are tested).
  int64_t records_gathered() const { return records_gathered_; }
  int64_t gathers() const { return gathers_; }
  // Sets an expert's weights (initialisation); moments and step are untouched.
  void set_weights(ExpertId id, const float* src);
  // Sets an expert's Adam moments (P floats each) and step count (restoring a checkpoint).
  void set_state(ExpertId id, const float* m, const float* v, int64_t step);
  // Hints the kernel to read these records ahead (file backing; RAM: nothing), for overlapping
  // the next step's gather with this step's compute. With fault_in it also reads one byte of
  // every page, so that the pages are resident and mapped when it returns (run it on a
  // background thread; it must not overlap updates, imports or a flush).
  void prefetch(std::span<const ExpertId> ids, bool fault_in = false) const;

  // One lazy Adam update of this expert from its P gradients: step += 1, then adam_step on each
  // tensor with a.step = the new step and a.weight_decay on decayed tensors only (0 on biases).
  // The caller passes the expert eps (eps_rre) in a.eps; a.step is ignored. Calls for different
  // experts may run concurrently.
  void apply_grads(ExpertId id, const float* grad, const AdamStepArgs& a,
                   cpu::AdamPath path = cpu::AdamPath::Auto);
  void apply_grads(ExpertId id, const uint16_t* grad_bf16, const AdamStepArgs& a,
                   cpu::AdamPath path = cpu::AdamPath::Auto);

  // Updates several distinct experts as above (grads[i] holds ids[i]'s P gradients): in
  // parallel over experts when they are small, else one after another with each update split
  // over the threads. The same bits as calling apply_grads on each in turn.
  void apply_grads(std::span<const ExpertId> ids, std::span<const float* const> grads,
                   const AdamStepArgs& a, cpu::AdamPath path = cpu::AdamPath::Auto);

  // File backing: writes every dirty page back (msync), then marks the header clean. Throws
  // sigma::Error naming the file on an I/O error. RAM: nothing.
  void flush();

  // Checkpointing without copying the store: named views into the records, valid while the
  // store lives and is not modified. Per expert e of a group with prefix P and tensor T:
  //   P.experts.e.T    F32 weights     P.experts.e.T.m / .T.v   F32 moments
  //   P.experts.e.step I64 scalar (the record's own step field)
  std::vector<TensorRef> tensor_refs() const;
  // Copies every tensor named as above from `tensors` (read from `source`, named in errors)
  // into the records; every name must be present with the dtype and shape above, others are
  // ignored. Marks the store dirty (flush() afterwards).
  void import_tensors(const TensorMap& tensors, const std::string& source);

 private:
  struct Slot {  // one record
    uint32_t group;  // index into spec_.groups
    uint64_t offset;  // bytes from data_
  };
  ExpertStore() = default;
  void layout(ExpertStoreSpec spec);  // fills spec_, groups_, index_, data_bytes_
  const Slot& slot(ExpertId id) const;
  std::byte* record(ExpertId id) const { return data_ + slot(id).offset; }
  void mark_dirty();
  template <class G>
  void apply(ExpertId id, const G* grad, const AdamStepArgs& a, cpu::AdamPath path);
  void release() noexcept;

  struct GroupInfo {
    int64_t params, padded;  // P and Pp
    uint64_t record_bytes;
    int64_t first_slot;      // index_ of expert 0
  };
  struct DirtyState {  // heap-held so the store stays movable
    std::mutex mu;
    std::atomic<bool> dirty{false};  // the header says unclean since the last flush
  };
  ExpertStoreSpec spec_;
  std::vector<GroupInfo> groups_;
  std::vector<std::pair<uint64_t, uint32_t>> group_keys_;  // (block, group) key -> group, sorted
  std::vector<Slot> index_;
  std::byte* map_ = nullptr;   // the whole mapping (file: header + data)
  size_t map_bytes_ = 0;
  std::byte* data_ = nullptr;  // the first record
  uint64_t data_bytes_ = 0;
  int fd_ = -1;
  std::string path_;
  bool created_ = false, clean_on_open_ = true;
  mutable int64_t records_gathered_ = 0, gathers_ = 0;  // gather() runs on one thread at a time
  std::unique_ptr<DirtyState> dirty_ = std::make_unique<DirtyState>();
};

}  // namespace sigma
