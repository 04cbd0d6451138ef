#include "ecss/expert_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <omp.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/error.h"
#include "io/file.h"
#include "kernels/ops.h"
#include "model/names.h"

namespace sigma {

AdamStepArgs expert_adam_args(const OptimConfig& o, float lr, float grad_scale) {
  AdamStepArgs a;
  a.lr = lr;
  a.beta1 = o.beta1;
  a.beta2 = o.beta2;
  a.eps = o.eps_rre;
  a.weight_decay = o.weight_decay;
  a.grad_scale = grad_scale;
  return a;
}

namespace {

constexpr char kMagic[8] = {'S', 'I', 'G', 'M', 'A', 'E', 'C', 'S'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 4096;  // one page: records start page-aligned
constexpr uint64_t kRecordHead = 64;     // the step field, padded to a cache line
constexpr uint32_t kEndianMark = 0x01020304;

// The file's first bytes (native little-endian; the rest of the header page is zero).
struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t endian;
  uint64_t header_bytes;
  uint64_t spec_hash;
  uint64_t num_experts;
  uint64_t data_bytes;
  uint64_t file_bytes;
  uint32_t clean;  // 1: every record is from completed updates (flushed); 0: being modified
  uint32_t reserved;
};
static_assert(sizeof(FileHeader) <= kHeaderBytes);

uint64_t group_key(int32_t block, int32_t group) {
  return (uint64_t(uint32_t(block)) << 32) | uint32_t(group);
}

}  // namespace

// ---- spec ------------------------------------------------------------------------------------

int64_t ExpertGroupSpec::params() const {
  int64_t p = 0;
  for (const auto& t : tensors) p += shape_numel(t.shape);
  return p;
}

int64_t ExpertGroupSpec::offset(size_t t) const {
  int64_t p = 0;
  for (size_t i = 0; i < t; ++i) p += shape_numel(tensors.at(i).shape);
  return p;
}

// The store knows groups by index; the model's checkpoints name them (ExpertOffload).
std::string ExpertGroupSpec::prefix() const {
  return names::expert_prefix(block, std::to_string(group));
}

ExpertGroupSpec rre_group_spec(int32_t block, int32_t group, int32_t experts, int64_t d, int64_t f) {
  return {block,
          group,
          experts,
          {{names::kWIn, {d, f}, true},
           {names::kBIn, {f}, false},
           {names::kWOut, {f, d}, true},
           {names::kBOut, {d}, false}}};
}

void ExpertStoreSpec::validate() const {
  SIGMA_CHECK(!groups.empty(), "expert store spec: no expert groups");
  std::vector<uint64_t> keys;
  for (const auto& g : groups) {
    const std::string where = fmt::format("expert store spec, block {} group {}", g.block, g.group);
    SIGMA_CHECK(g.block >= 0 && g.group >= 0, "{}: negative block or group index", where);
    SIGMA_CHECK(g.experts >= 1, "{}: {} experts (need at least 1)", where, g.experts);
    SIGMA_CHECK(!g.tensors.empty(), "{}: no tensors", where);
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      const auto& t = g.tensors[i];
      SIGMA_CHECK(!t.name.empty(), "{}: tensor {} has no name", where, i);
      SIGMA_CHECK(!t.shape.empty(), "{}: tensor '{}' has no dimensions", where, t.name);
      for (int64_t d : t.shape)
        SIGMA_CHECK(d >= 1, "{}: tensor '{}' has shape {}", where, t.name, shape_str(t.shape));
      for (size_t j = 0; j < i; ++j)
        SIGMA_CHECK(g.tensors[j].name != t.name, "{}: tensor '{}' twice", where, t.name);
    }
    keys.push_back(group_key(g.block, g.group));
  }
  std::sort(keys.begin(), keys.end());
  SIGMA_CHECK(std::adjacent_find(keys.begin(), keys.end()) == keys.end(),
              "expert store spec: a (block, group) appears twice");
}

std::string ExpertStoreSpec::canonical() const {
  std::string s = "sigma-ecss-spec 1\n";
  for (const auto& g : groups) {
    s += fmt::format("group block={} group={} experts={}\n", g.block, g.group, g.experts);
    for (const auto& t : g.tensors)
      s += fmt::format(" tensor {} {} decay={}\n", t.name, shape_str(t.shape), int(t.decay));
  }
  return s;
}

uint64_t ExpertStoreSpec::hash() const {
  const std::string c = canonical();
  return XXH3_64bits(c.data(), c.size());
}

// ---- layout and lifetime ---------------------------------------------------------------------

void ExpertStore::layout(ExpertStoreSpec spec) {
  spec.validate();
  spec_ = std::move(spec);
  uint64_t offset = 0;
  for (uint32_t gi = 0; gi < spec_.groups.size(); ++gi) {
    const auto& g = spec_.groups[gi];
    const int64_t p = g.params(), pp = (p + 15) / 16 * 16;
    const uint64_t rec = kRecordHead + 3 * uint64_t(pp) * 4;
    groups_.push_back({p, pp, rec, int64_t(index_.size())});
    group_keys_.push_back({group_key(g.block, g.group), gi});
    for (int32_t e = 0; e < g.experts; ++e, offset += rec) index_.push_back({gi, offset});
  }
  std::sort(group_keys_.begin(), group_keys_.end());
  data_bytes_ = offset;
}

ExpertStore ExpertStore::in_ram(ExpertStoreSpec spec) {
  ExpertStore s;
  s.layout(std::move(spec));
  const long page = ::sysconf(_SC_PAGESIZE);
  s.map_bytes_ = std::max<size_t>(1, (s.data_bytes_ + page - 1) / page * page);
  void* p = ::mmap(nullptr, s.map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  SIGMA_CHECK(p != MAP_FAILED,
              "cannot allocate {} for the expert store in RAM ({}); give it a file with "
              "--expert-store PATH",
              gib_str(s.data_bytes_), errno_str(errno));
  ::madvise(p, s.map_bytes_, MADV_HUGEPAGE);  // fewer TLB misses; a hint, failures are fine
  s.map_ = s.data_ = static_cast<std::byte*>(p);
  return s;
}

ExpertStore ExpertStore::open(const std::string& path, ExpertStoreSpec spec) {
  ExpertStore s;
  s.layout(std::move(spec));
  s.path_ = path;
  const uint64_t file_bytes = kHeaderBytes + s.data_bytes_;
  const uint64_t spec_hash = s.spec_.hash();

  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) {
    // Create under a temporary name, reserve every block, write the header, then rename: a
    // half-created store never appears under `path`.
    const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
    fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    SIGMA_CHECK(fd >= 0, "cannot create expert store {}: {} (the store is written in place: give "
                "a writable path)", tmp, errno_str(errno));
    auto give_up = [&](const std::string& what, int e) {
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("cannot create expert store {}: {}: {}", path, what, errno_str(e));
    };
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) give_up("locking", errno);  // held from the start
    if (int e = ::posix_fallocate(fd, 0, off_t(file_bytes)); e != 0)
      give_up(fmt::format("reserving {} on disk failed{}", gib_str(file_bytes),
                          e == ENOSPC || e == EFBIG ? " (disk full or file size limit)" : ""),
              e);
    FileHeader h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kVersion;
    h.endian = kEndianMark;
    h.header_bytes = kHeaderBytes;
    h.spec_hash = spec_hash;
    h.num_experts = uint64_t(s.index_.size());
    h.data_bytes = s.data_bytes_;
    h.file_bytes = file_bytes;
    h.clean = 1;
    if (::pwrite(fd, &h, sizeof h, 0) != ssize_t(sizeof h)) give_up("writing the header", errno);
    if (::fsync(fd) != 0) give_up("fsync", errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0) give_up("rename", errno);
    fsync_parent(path);
    s.created_ = true;
  }
  SIGMA_CHECK(fd >= 0, "cannot open expert store {} for reading and writing: {} (the store is "
              "updated in place: give a writable path)", path, errno_str(errno));
  s.fd_ = fd;  // closed by the destructor from here on

  struct stat st;
  SIGMA_CHECK(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode), "expert store {}: not a regular file",
              path);
  SIGMA_CHECK(::flock(fd, LOCK_EX | LOCK_NB) == 0,
              "expert store {} is in use by another open store (another trainer?): {}", path,
              errno_str(errno));
  FileHeader h{};
  SIGMA_CHECK(uint64_t(st.st_size) >= kHeaderBytes &&
                  ::pread(fd, &h, sizeof h, 0) == ssize_t(sizeof h) &&
                  std::memcmp(h.magic, kMagic, 8) == 0,
              "{} is not an expert store file (no 'SIGMAECS' header); remove it or give another "
              "--expert-store path", path);
  // One check per field, so the message names the one that differs.
  SIGMA_CHECK(h.version == kVersion, "expert store {} has format version {} but this build reads "
              "version {}; re-create it from a checkpoint", path, h.version, kVersion);
  SIGMA_CHECK(h.endian == kEndianMark, "expert store {} was written on a machine of the other byte "
              "order (mark {:#x}, expected {:#x}); re-create it from a checkpoint", path, h.endian,
              kEndianMark);
  SIGMA_CHECK(h.header_bytes == kHeaderBytes, "expert store {}: its header says it is {} bytes "
              "long, this build's is {} (a damaged header); re-create it from a checkpoint", path,
              h.header_bytes, kHeaderBytes);
  SIGMA_CHECK(h.spec_hash == spec_hash && h.num_experts == uint64_t(s.index_.size()) &&
                  h.data_bytes == s.data_bytes_,
              "expert store {} was made for another expert layout ({} experts, {} of records, spec "
              "hash {:016x}; this model needs {} experts, {}, hash {:016x}); use the config it "
              "was made with or another --expert-store path",
              path, h.num_experts, gib_str(h.data_bytes), h.spec_hash, s.index_.size(),
              gib_str(s.data_bytes_), spec_hash);
  SIGMA_CHECK(h.file_bytes == file_bytes && uint64_t(st.st_size) == file_bytes,
              "expert store {} has {} bytes but its header and the spec say {}: the file was "
              "truncated or extended; restore it from a checkpoint", path, st.st_size, file_bytes);
  s.clean_on_open_ = h.clean == 1;

  void* p = ::mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  SIGMA_CHECK(p != MAP_FAILED, "cannot map expert store {} ({}): {}", path, gib_str(file_bytes),
              errno_str(errno));
  s.map_ = static_cast<std::byte*>(p);
  s.map_bytes_ = file_bytes;
  s.data_ = s.map_ + kHeaderBytes;
  return s;
}

ExpertStore::ExpertStore(ExpertStore&& o) noexcept { *this = std::move(o); }

ExpertStore& ExpertStore::operator=(ExpertStore&& o) noexcept {
  if (this != &o) {
    release();
    spec_ = std::move(o.spec_);
    groups_ = std::move(o.groups_);
    group_keys_ = std::move(o.group_keys_);
    index_ = std::move(o.index_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    data_ = std::exchange(o.data_, nullptr);
    data_bytes_ = std::exchange(o.data_bytes_, 0);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
    created_ = o.created_;
    clean_on_open_ = o.clean_on_open_;
    records_gathered_ = std::exchange(o.records_gathered_, 0);
    gathers_ = std::exchange(o.gathers_, 0);
    dirty_ = std::exchange(o.dirty_, std::make_unique<DirtyState>());
  }
  return *this;
}

ExpertStore::~ExpertStore() { release(); }

void ExpertStore::release() noexcept {
  if (fd_ >= 0 && map_ && dirty_->dirty.load()) {
    try {
      flush();
    } catch (...) {
      // The header stays unclean, so the next open reports it (clean_on_open() == false).
    }
  }
  if (map_) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);  // also drops the lock
  map_ = data_ = nullptr;
  fd_ = -1;
}

// ---- access ----------------------------------------------------------------------------------

const ExpertStore::Slot& ExpertStore::slot(ExpertId id) const {
  const uint64_t key = group_key(id.block, id.group);
  auto it = std::lower_bound(group_keys_.begin(), group_keys_.end(), std::pair{key, 0u});
  SIGMA_CHECK(id.block >= 0 && id.group >= 0 && it != group_keys_.end() && it->first == key,
              "expert store: no group (block {}, group {})", id.block, id.group);
  const auto& g = spec_.groups[it->second];
  SIGMA_CHECK(id.expert >= 0 && id.expert < g.experts,
              "expert store: expert {} out of range for block {} group {} ({} experts)", id.expert,
              id.block, id.group, g.experts);
  return index_[size_t(groups_[it->second].first_slot + id.expert)];
}

const ExpertGroupSpec& ExpertStore::group_of(ExpertId id) const {
  return spec_.groups[slot(id).group];
}

int64_t ExpertStore::step(ExpertId id) const {
  int64_t s;
  std::memcpy(&s, record(id), 8);
  return s;
}

float* ExpertStore::weights(ExpertId id) { return reinterpret_cast<float*>(record(id) + kRecordHead); }
const float* ExpertStore::weights(ExpertId id) const {
  return reinterpret_cast<const float*>(record(id) + kRecordHead);
}
const float* ExpertStore::m(ExpertId id) const {
  return weights(id) + groups_[slot(id).group].padded;
}
const float* ExpertStore::v(ExpertId id) const {
  return weights(id) + 2 * groups_[slot(id).group].padded;
}

void ExpertStore::gather(std::span<const ExpertId> ids, std::span<float* const> dst) const {
  SIGMA_CHECK(ids.size() == dst.size(), "expert store gather: {} experts but {} destinations",
              ids.size(), dst.size());
  std::vector<const Slot*> slots;
  for (ExpertId id : ids) slots.push_back(&slot(id));  // validate before any copy
  const int64_t n = int64_t(ids.size());
  records_gathered_ += n;
  gathers_ += n > 0;
  // The store is host memory; dst are compute buffers on the device: the ECSS boundary is
  // this explicit host-to-device copy (ops::upload), as in the paper.
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t i = 0; i < n; ++i)
    ops::upload(dst[size_t(i)], data_ + slots[size_t(i)]->offset + kRecordHead,
                size_t(groups_[slots[size_t(i)]->group].params) * 4);
}

void ExpertStore::set_weights(ExpertId id, const float* src) {
  mark_dirty();
  std::memcpy(weights(id), src, size_t(params(id)) * 4);
}

void ExpertStore::set_state(ExpertId id, const float* m, const float* v, int64_t step) {
  mark_dirty();
  const size_t P = size_t(params(id));
  std::byte* r = record(id);
  const int64_t Pp = groups_[slot(id).group].padded;
  std::memcpy(r, &step, sizeof step);
  std::memcpy(r + kRecordHead + 4 * Pp, m, P * 4);
  std::memcpy(r + kRecordHead + 8 * Pp, v, P * 4);
}

void ExpertStore::prefetch(std::span<const ExpertId> ids, bool fault_in) const {
  if (fd_ < 0) return;
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  for (ExpertId id : ids) {
    const Slot& s = slot(id);
    const uintptr_t b = uintptr_t(data_ + s.offset) & ~(page - 1);
    const uintptr_t e = uintptr_t(data_ + s.offset + groups_[s.group].record_bytes);
    ::madvise(reinterpret_cast<void*>(b), e - b, MADV_WILLNEED);  // a hint
  }
  if (!fault_in) return;
  // Read one byte of every page. (Rewriting it with its own value, so that Adam would not take
  // the write fault of a clean shared page, made the 35 GB benchmark slower: 2.56 s per step
  // against 2.06 s, the dirtying and its write-back throttling landing on the critical path.)
  uint8_t sink = 0;
  for (ExpertId id : ids) {
    const Slot& s = slot(id);
    const volatile uint8_t* p = reinterpret_cast<const volatile uint8_t*>(data_ + s.offset);
    for (uint64_t off = 0; off < groups_[s.group].record_bytes; off += page) sink ^= p[off];
  }
  (void)sink;
}

// ---- updates ---------------------------------------------------------------------------------

void ExpertStore::mark_dirty() {
  if (fd_ < 0 || dirty_->dirty.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(dirty_->mu);
  if (dirty_->dirty.load(std::memory_order_relaxed)) return;
  // The unclean mark must reach the disk before any modified record can.
  reinterpret_cast<FileHeader*>(map_)->clean = 0;
  SIGMA_CHECK(::msync(map_, kHeaderBytes, MS_SYNC) == 0, "expert store {}: writing the header: {}",
              path_, errno_str(errno));
  dirty_->dirty.store(true, std::memory_order_release);
}

template <class G>
void ExpertStore::apply(ExpertId id, const G* grad, const AdamStepArgs& a, cpu::AdamPath path) {
  const Slot& s = slot(id);
  const ExpertGroupSpec& g = spec_.groups[s.group];
  const int64_t pp = groups_[s.group].padded;
  mark_dirty();
  std::byte* rec = data_ + s.offset;
  float* w = reinterpret_cast<float*>(rec + kRecordHead);
  float *m = w + pp, *v = w + 2 * pp;
  int64_t step;
  std::memcpy(&step, rec, 8);
  AdamStepArgs x = a;
  x.step = step + 1;
  int64_t off = 0;
  for (const ExpertTensorSpec& t : g.tensors) {
    const int64_t n = shape_numel(t.shape);
    x.weight_decay = t.decay ? a.weight_decay : 0.0f;
    // The records are host memory whatever the compute backend: the cpu kernel, directly. It is
    // the kernel behind ops::adam_step, so experts update as they would in the model.
    cpu::adam_step(w + off, m + off, v + off, grad + off, n, x, path);
    off += n;
  }
  std::memcpy(rec, &x.step, 8);
}

void ExpertStore::apply_grads(ExpertId id, const float* grad, const AdamStepArgs& a,
                              cpu::AdamPath path) {
  apply(id, grad, a, path);
}
void ExpertStore::apply_grads(ExpertId id, const uint16_t* grad, const AdamStepArgs& a,
                              cpu::AdamPath path) {
  apply(id, grad, a, path);
}

void ExpertStore::apply_grads(std::span<const ExpertId> ids, std::span<const float* const> grads,
                              const AdamStepArgs& a, cpu::AdamPath path) {
  SIGMA_CHECK(ids.size() == grads.size(), "expert store apply_grads: {} experts but {} gradients",
              ids.size(), grads.size());
  std::vector<uint64_t> offsets;
  int64_t largest = 0;
  for (ExpertId id : ids) {  // validate, and refuse duplicates (two updates of one record race)
    offsets.push_back(slot(id).offset);
    largest = std::max(largest, params(id));
  }
  std::sort(offsets.begin(), offsets.end());
  SIGMA_CHECK(std::adjacent_find(offsets.begin(), offsets.end()) == offsets.end(),
              "expert store apply_grads: an expert appears twice in one batch");
  mark_dirty();  // once, before the threads start
  const int64_t n = int64_t(ids.size());
  // Enough experts to share out: one thread per expert (adam_step stays on its thread inside
  // the region), one fork for the batch. Few large ones: each adam_step forks over all threads
  // itself. (Forking per tensor of many mid-sized experts cost more than the updates.)
  const bool per_expert = n >= 2 * omp_get_max_threads() || largest < cpu::kAdamParallelMin;
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && per_expert)
  for (int64_t i = 0; i < n; ++i) apply(ids[size_t(i)], grads[size_t(i)], a, path);
}

void ExpertStore::flush() {
  if (fd_ < 0 || !dirty_->dirty.load()) return;
  std::lock_guard<std::mutex> lock(dirty_->mu);
  SIGMA_CHECK(::msync(map_, map_bytes_, MS_SYNC) == 0, "expert store {}: writing back: {}", path_,
              errno_str(errno));
  reinterpret_cast<FileHeader*>(map_)->clean = 1;
  SIGMA_CHECK(::msync(map_, kHeaderBytes, MS_SYNC) == 0, "expert store {}: writing the header: {}",
              path_, errno_str(errno));
  dirty_->dirty.store(false);
}

// ---- checkpoint views ------------------------------------------------------------------------

std::vector<TensorRef> ExpertStore::tensor_refs() const {
  std::vector<TensorRef> refs;
  for (uint32_t gi = 0; gi < spec_.groups.size(); ++gi) {
    const ExpertGroupSpec& g = spec_.groups[gi];
    const int64_t pp = groups_[gi].padded;
    for (int32_t e = 0; e < g.experts; ++e) {
      const std::byte* rec = data_ + index_[size_t(groups_[gi].first_slot + e)].offset;
      const float* w = reinterpret_cast<const float*>(rec + kRecordHead);
      const std::string base = fmt::format("{}.experts.{}.", g.prefix(), e);
      for (size_t t = 0; t < g.tensors.size(); ++t) {
        const auto& ts = g.tensors[t];
        const int64_t off = g.offset(t);
        refs.push_back({base + ts.name, DType::F32, ts.shape, w + off});
        refs.push_back({base + ts.name + ".m", DType::F32, ts.shape, w + pp + off});
        refs.push_back({base + ts.name + ".v", DType::F32, ts.shape, w + 2 * pp + off});
      }
      refs.push_back({base + "step", DType::I64, Shape{}, rec});
    }
  }
  return refs;
}

void ExpertStore::import_tensors(const TensorMap& tensors, const std::string& source) {
  const std::vector<TensorRef> refs = tensor_refs();
  for (const TensorRef& r : refs) {  // check all before changing anything
    auto it = tensors.find(r.name);
    SIGMA_CHECK(it != tensors.end(), "{}: expert tensor '{}' is missing", source, r.name);
    SIGMA_CHECK(it->second.dtype() == r.dtype && it->second.shape() == r.shape,
                "{}: expert tensor '{}' is {} {} but the store expects {} {}", source, r.name,
                dtype_name(it->second.dtype()), shape_str(it->second.shape()), dtype_name(r.dtype),
                shape_str(r.shape));
  }
  mark_dirty();
  for (const TensorRef& r : refs) {
    const Tensor& t = tensors.at(r.name);
    std::memcpy(const_cast<void*>(r.data), t.bytes(), t.nbytes());
  }
}

}  // namespace sigma
