#include "io/checkpoint_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "io/file.h"

namespace sigma {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kManifestVersion = 1;         // whole tensors (one process, or layout whole)
constexpr int kManifestVersionSharded = 2;  // io/checkpoint_shards.h

// A plain path component: no separators, so nothing can escape the checkpoint root.
bool plain_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos &&
         s.find('\0') == std::string::npos;
}

struct Sum {
  uint64_t size = 0;
  uint64_t xxh3 = 0;
};

Sum checksum_file(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  SIGMA_CHECK(f.fd >= 0, "cannot open '{}': {}", path, errno_str());
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(),
                                                              &XXH3_freeState);
  SIGMA_CHECK(st && XXH3_64bits_reset(st.get()) == XXH_OK, "xxhash: cannot allocate state");
  std::vector<char> buf(size_t{4} << 20);
  Sum s;
  for (;;) {
    ssize_t r = ::read(f.fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    SIGMA_CHECK(r >= 0, "cannot read '{}': {}", path, errno_str());
    if (r == 0) break;
    XXH3_64bits_update(st.get(), buf.data(), static_cast<size_t>(r));
    s.size += static_cast<uint64_t>(r);
  }
  s.xxh3 = XXH3_64bits_digest(st.get());
  return s;
}

std::string hex16(uint64_t v) { return fmt::format("{:016x}", v); }

// Puts the finished directory `src` at `dst`. An existing `dst` is swapped out atomically
// (RENAME_EXCHANGE), so no crash can leave `dst` missing; where the filesystem lacks that,
// the old one is renamed aside, the new one renamed in, and the old one deleted.
void install_dir(const std::string& src, const std::string& dst) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dst, ec))) {
    SIGMA_CHECK(::rename(src.c_str(), dst.c_str()) == 0, "cannot rename '{}' to '{}': {}", src,
                dst, errno_str());
    return;
  }
  if (::renameat2(AT_FDCWD, src.c_str(), AT_FDCWD, dst.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(src, ec);  // now the old checkpoint; a leftover is harmless
    return;
  }
  SIGMA_CHECK(errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP,
              "cannot replace '{}' with '{}': {}", dst, src, errno_str());
  const std::string aside = fmt::format("{}.old-{}", dst, ::getpid());
  fs::remove_all(aside, ec);
  SIGMA_CHECK(::rename(dst.c_str(), aside.c_str()) == 0, "cannot move '{}' aside: {}", dst,
              errno_str());
  if (::rename(src.c_str(), dst.c_str()) != 0) {
    int err = errno;
    ::rename(aside.c_str(), dst.c_str());  // put the previous checkpoint back
    fail("cannot rename '{}' to '{}': {}", src, dst, std::strerror(err));
  }
  fs::remove_all(aside, ec);
}

// The complete checkpoint (a directory with a manifest, not a save in progress) of `root`
// whose name sorts last ("" when none): names like step-00001000 sort by step.
std::string newest_complete(const std::string& root) {
  std::string best;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (!plain_name(name) || name.find(".tmp-") != std::string::npos ||
        name.find(".old-") != std::string::npos || !fs::exists(e.path() / kManifestFile, ec))
      continue;
    if (name > best) best = name;
  }
  return best.empty() ? "" : (fs::path(root) / best).string();
}

}  // namespace

CheckpointWriter::CheckpointWriter(std::string root, std::string name)
    : root_(std::move(root)), name_(std::move(name)) {
  SIGMA_CHECK(plain_name(name_) && name_ != kLatestFile &&
                  name_.find(".tmp-") == std::string::npos &&
                  name_.find(".old-") == std::string::npos,
              "invalid checkpoint name '{}': use one path component such as 'step_001000'",
              name_);
  std::error_code ec;
  fs::create_directories(root_, ec);
  SIGMA_CHECK(!ec, "cannot create checkpoint root '{}': {}", root_, ec.message());
  tmp_ = (fs::path(root_) / fmt::format("{}.tmp-{}", name_, ::getpid())).string();
  fs::remove_all(tmp_, ec);  // a leftover from an earlier process that had our pid
  SIGMA_CHECK(fs::create_directory(tmp_, ec) && !ec, "cannot create '{}': {}", tmp_,
              ec ? ec.message() : "it already exists");
}

CheckpointWriter CheckpointWriter::peer(std::string tmp_dir) {
  CheckpointWriter w;
  w.tmp_ = std::move(tmp_dir);
  w.name_ = fs::path(w.tmp_).filename().string();
  w.peer_ = true;
  std::error_code ec;
  SIGMA_CHECK(fs::is_directory(w.tmp_, ec), "checkpoint directory '{}' (made by rank 0) is not "
              "visible here: ranks must share the --out filesystem", w.tmp_);
  return w;
}

void CheckpointWriter::add_peer_file(const std::string& file, uint64_t size, uint64_t xxh3) {
  const std::string path = start_file(file);
  std::error_code ec;
  const uint64_t on_disk = fs::file_size(path, ec);
  SIGMA_CHECK(!ec && on_disk == size, "checkpoint file '{}' written by another rank is {} bytes "
              "here, not the {} it wrote", path, ec ? 0 : on_disk, size);
  files_[file] = {size, xxh3};
}

std::pair<uint64_t, uint64_t> CheckpointWriter::recorded(const std::string& file) const {
  auto it = files_.find(file);
  SIGMA_CHECK(it != files_.end(), "checkpoint '{}': no file '{}' recorded", name_, file);
  return {it->second.size, it->second.xxh3};
}

CheckpointWriter::~CheckpointWriter() {
  if (committed_ || peer_ || tmp_.empty()) return;
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

std::string CheckpointWriter::start_file(const std::string& file) {
  SIGMA_CHECK(!committed_, "checkpoint '{}' is already committed", name_);
  SIGMA_CHECK(plain_name(file) && file != kManifestFile,
              "invalid checkpoint file name '{}'", file);
  SIGMA_CHECK(!files_.count(file), "checkpoint '{}': file '{}' added twice", name_, file);
  return (fs::path(tmp_) / file).string();
}

// The checksum is taken from the file as written (back from the page cache), so the
// manifest vouches for the bytes on disk rather than for what we meant to write.
void CheckpointWriter::record(const std::string& file) {
  Sum s = checksum_file((fs::path(tmp_) / file).string());
  files_[file] = {s.size, s.xxh3};
}

void CheckpointWriter::add_safetensors(const std::string& file,
                                       const std::vector<TensorRef>& tensors,
                                       const Metadata& meta) {
  write_safetensors(start_file(file), tensors, meta);
  record(file);
}

void CheckpointWriter::add_json(const std::string& file, const json& j) {
  const std::string path = start_file(file);
  std::string text;
  try {
    text = j.dump(2) + "\n";
  } catch (const json::exception& e) {
    fail("cannot write '{}': {}", path, e.what());
  }
  write_file_synced(path, text);
  record(file);
}

void CheckpointWriter::add_file_copy(const std::string& file, const std::string& src_path) {
  const std::string path = start_file(file);
  std::error_code ec;
  fs::copy_file(src_path, path, fs::copy_options::overwrite_existing, ec);
  SIGMA_CHECK(!ec, "cannot copy '{}' into checkpoint as '{}': {}", src_path, file,
              ec.message());
  fsync_path(path, false);
  record(file);
}

bool CheckpointWriter::add_link(const std::string& file, const std::string& src_dir) {
  const std::string path = start_file(file);
  std::map<std::string, ManifestEntry> src;
  try {
    src = read_manifest(src_dir);
  } catch (const Error&) {
    return false;  // gone or unreadable: the caller writes the file
  }
  auto it = src.find(file);
  const std::string from = (fs::path(src_dir) / file).string();
  struct stat st;
  if (it == src.end() || ::stat(from.c_str(), &st) != 0 || uint64_t(st.st_size) != it->second.size ||
      ::link(from.c_str(), path.c_str()) != 0)
    return false;
  files_[file] = {it->second.size, it->second.xxh3};
  return true;
}

std::string CheckpointWriter::commit() {
  SIGMA_CHECK(!committed_, "checkpoint '{}' is already committed", name_);
  SIGMA_CHECK(!peer_, "checkpoint '{}': only the rank that created it commits it", name_);
  json files = json::object();
  for (const auto& [f, s] : files_) files[f] = {{"size", s.size}, {"xxh3_64", hex16(s.xxh3)}};
  json manifest = {{"format", "sigma-checkpoint"},
                   {"version", sharded_ ? kManifestVersionSharded : kManifestVersion},
                   {"files", std::move(files)}};
  if (sharded_) manifest["layout"] = "sharded";
  write_file_synced((fs::path(tmp_) / kManifestFile).string(), manifest.dump(2) + "\n");
  fsync_path(tmp_, true);

  const std::string dir = (fs::path(root_) / name_).string();
  install_dir(tmp_, dir);
  fsync_path(root_, true);  // the rename must be durable before `latest` can name it

  const std::string latest = (fs::path(root_) / kLatestFile).string();
  write_file_atomic(latest, name_ + "\n");
  committed_ = true;
  return dir;
}

namespace {
// resolve_checkpoint; in_run: whether a run's folder may stand for its checkpoints (one level
// only: a `checkpoints` that links back to its folder must not recurse).
std::string resolve_in(const std::string& path, bool in_run) {
  std::error_code ec;
  const fs::path p(path);
  SIGMA_CHECK(fs::is_directory(p, ec), "checkpoint path '{}' is not a directory", path);
  if (fs::exists(p / kManifestFile, ec)) return path;
  const fs::path latest = p / kLatestFile;
  if (!fs::exists(latest, ec)) {
    // A save killed after renaming its directory but before writing `latest` (the first
    // checkpoint of a run) leaves a complete checkpoint that nothing names yet.
    const std::string newest = newest_complete(path);
    // A run's folder, as `sigma train --out` named it: its checkpoints.
    if (newest.empty() && in_run && fs::is_directory(p / kRunCheckpointsDir, ec))
      return resolve_in((p / kRunCheckpointsDir).string(), false);
    SIGMA_CHECK(!newest.empty(),
                "'{}' is not a checkpoint: it has neither {} nor a '{}' file naming one", path,
                kManifestFile, kLatestFile);
    return newest;
  }
  std::string name = read_small_file(latest.string(), 4096);
  while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
  SIGMA_CHECK(plain_name(name), "'{}' holds '{}', which is not a checkpoint name",
              latest.string(), name);
  const fs::path dir = p / name;
  if (fs::exists(dir / kManifestFile, ec)) return dir.string();
  // A dangling `latest` (a copy of a live run taken between a save and the next prune, or a
  // checkpoint deleted by hand): the newest complete checkpoint, said aloud.
  const std::string newest = newest_complete(path);
  SIGMA_CHECK(!newest.empty(), "'{}' names checkpoint '{}', but '{}' is missing or has no {}, "
              "and '{}' holds no other complete checkpoint", latest.string(), name, dir.string(),
              kManifestFile, path);
  fmt::print(stderr, "sigma: warning: '{}' names checkpoint '{}', which is missing or incomplete; "
             "using the newest complete one, '{}'\n", latest.string(), name, newest);
  return newest;
}
}  // namespace

std::string resolve_checkpoint(const std::string& path) { return resolve_in(path, true); }

int prune_checkpoints(const std::string& root, int64_t keep_last, int64_t keep_every) {
  if (keep_last <= 0) return 0;
  const std::string latest = fs::path(resolve_checkpoint(root)).filename().string();
  std::vector<std::pair<int64_t, std::string>> steps;  // complete step-N checkpoints
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("step-") || name.size() == 5 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos ||
        !fs::exists(e.path() / kManifestFile, ec))
      continue;
    steps.emplace_back(std::strtoll(name.c_str() + 5, nullptr, 10), name);
  }
  std::sort(steps.rbegin(), steps.rend());  // newest first
  int removed = 0;
  for (size_t i = size_t(keep_last); i < steps.size(); ++i) {
    const auto& [step, name] = steps[i];
    if (name == latest || (keep_every > 0 && step % keep_every == 0)) continue;
    const fs::path dir = fs::path(root) / name;
    const fs::path aside = fs::path(root) / fmt::format("{}.old-{}", name, ::getpid());
    if (::rename(dir.c_str(), aside.c_str()) != 0) continue;  // retried after the next save
    fs::remove_all(aside, ec);
    ++removed;
  }
  if (removed) fsync_path(root, true);
  return removed;
}

std::map<std::string, ManifestEntry> read_manifest(const std::string& dir) {
  const std::string mpath = (fs::path(dir) / kManifestFile).string();
  std::error_code ec;
  SIGMA_CHECK(fs::exists(mpath, ec),
              "checkpoint '{}': no {} (not a checkpoint, or its save was interrupted)", dir,
              kManifestFile);
  json m;
  try {
    m = json::parse(read_small_file(mpath, size_t{16} << 20), json_depth_limit(mpath));
  } catch (const json::exception& e) {
    fail("checkpoint '{}': {} is not valid JSON: {}", dir, kManifestFile, e.what());
  }
  SIGMA_CHECK(m.is_object() && m.value("format", json()) == "sigma-checkpoint" &&
                  m.contains("files") && m["files"].is_object(),
              "checkpoint '{}': {} is not a sigma checkpoint manifest", dir, kManifestFile);
  SIGMA_CHECK(m.value("version", json()) == kManifestVersion ||
                  m.value("version", json()) == kManifestVersionSharded,
              "checkpoint '{}': {} has version {}, this build reads versions {} and {}", dir,
              kManifestFile, m.value("version", json()).dump(), kManifestVersion,
              kManifestVersionSharded);
  std::map<std::string, ManifestEntry> out;
  for (const auto& [file, e] : m["files"].items()) {
    SIGMA_CHECK(plain_name(file) && e.is_object() && e.contains("size") &&
                    e["size"].is_number_unsigned() && e.contains("xxh3_64") &&
                    e["xxh3_64"].is_string() && e["xxh3_64"].get<std::string>().size() == 16,
                "checkpoint '{}': {} has a malformed entry for '{}'", dir, kManifestFile, file);
    const std::string hex = e["xxh3_64"].get<std::string>();
    char* end = nullptr;
    const uint64_t sum = std::strtoull(hex.c_str(), &end, 16);
    SIGMA_CHECK(end == hex.c_str() + hex.size(), "checkpoint '{}': {} has a malformed checksum "
                "for '{}'", dir, kManifestFile, file);
    out[file] = {e["size"].get<uint64_t>(), sum};
  }
  return out;
}

void verify_checkpoint(const std::string& dir) {
  const std::map<std::string, ManifestEntry> manifest = read_manifest(dir);
  // Every file must be vouched for: one whose entry was deleted would load unchecked.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    SIGMA_CHECK(file == kManifestFile || manifest.count(file),
                "checkpoint '{}': file '{}' is not listed in {} (its entry was removed, or the "
                "file was added later); it cannot be checked", dir, file, kManifestFile);
  }
  SIGMA_CHECK(!ec, "checkpoint '{}': cannot list it: {}", dir, ec.message());
  for (const auto& [file, e] : manifest) {
    const std::string path = (fs::path(dir) / file).string();
    struct stat st;
    SIGMA_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode),
                "checkpoint '{}': file '{}' listed in {} is missing", dir, file, kManifestFile);
    SIGMA_CHECK(uint64_t(st.st_size) == e.size,
                "checkpoint '{}': file '{}' is {} bytes but {} says {} (truncated or replaced)",
                dir, file, uint64_t(st.st_size), kManifestFile, e.size);
    const Sum s = checksum_file(path);
    SIGMA_CHECK(s.size == e.size && s.xxh3 == e.xxh3,
                "checkpoint '{}': file '{}' is corrupted: xxh3_64 {} but {} says {}", dir, file,
                hex16(s.xxh3), kManifestFile, hex16(e.xxh3));
  }
}

std::vector<std::string> expert_group_files(const std::string& dir, bool adam) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("experts.", 0) != 0 || !file.ends_with(".safetensors")) continue;
    if (file.ends_with(".adam.safetensors") == adam) out.push_back(file);
  }
  std::sort(out.begin(), out.end());
  return out;
}


std::string optimizer_shard_file(int rank) {
  return fmt::format("optimizer.rank-{:04d}.safetensors", rank);
}

std::vector<std::string> optimizer_shard_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& [file, e] : read_manifest(dir))  // sorted by name: rank order
    if (file.rfind("optimizer.rank-", 0) == 0 && file.ends_with(".safetensors")) out.push_back(file);
  return out;
}

}  // namespace sigma
