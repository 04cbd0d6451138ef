#include "data/shards.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <map>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json_depth.h"
#include "io/file.h"

namespace sigma::data {
namespace {
nlohmann::json json_any() { return nlohmann::json(); }
}  // namespace

uint64_t shard_checksum(const ShardHeader& h, uint64_t body_xxh3) {
  return XXH3_64bits_withSeed(&h, offsetof(ShardHeader, checksum), body_xxh3);
}

uint64_t shard_file_size(const ShardHeader& h) {
  uint64_t tok = (h.n_tokens * h.token_bytes + 7) / 8 * 8;
  return sizeof(ShardHeader) + tok + (h.n_samples + 1) * 8 + h.n_samples * 4;
}

// ---------------------------------------------------------------------------------------------
// Writer

struct ShardWriter::HashState {
  XXH3_state_t* st = XXH3_createState();
  HashState() { SIGMA_CHECK(st && XXH3_64bits_reset(st) == XXH_OK, "xxhash: cannot allocate state"); }
  ~HashState() { XXH3_freeState(st); }
};

ShardWriter::ShardWriter(std::string path, const DomainSpec& d, uint32_t vocab_size,
                         uint64_t tokenizer_hash, uint64_t inputs_hash)
    : path_(std::move(path)), tmp_(path_ + ".tmp-" + std::to_string(::getpid())),
      hash_(std::make_unique<HashState>()) {
  std::memcpy(hdr_.magic, kShardMagic, 8);
  hdr_.version = kShardVersion;
  hdr_.token_bytes = vocab_size <= 65536 ? 2 : 4;
  hdr_.tokenizer_hash = tokenizer_hash;
  hdr_.inputs_hash = inputs_hash;
  hdr_.domain_id = d.id;
  hdr_.vocab_size = vocab_size;
  SIGMA_CHECK(d.name.size() < sizeof(hdr_.domain), "shard: domain name '{}' is longer than {} bytes",
              d.name, sizeof(hdr_.domain) - 1);
  std::memcpy(hdr_.domain, d.name.data(), d.name.size());
  f_ = std::fopen(tmp_.c_str(), "wb");
  SIGMA_CHECK(f_, "shard: cannot create {}: {}", tmp_, std::strerror(errno));
  write(&hdr_, sizeof(hdr_));  // placeholder; rewritten with the counts by finish()
}

ShardWriter::~ShardWriter() {
  if (f_) std::fclose(f_);
  if (f_ || finished_) std::remove(tmp_.c_str());  // not committed: drop the file
}

void ShardWriter::write(const void* p, size_t n) {
  SIGMA_CHECK(std::fwrite(p, 1, n, f_) == n, "shard: write to {} failed: {}", tmp_, std::strerror(errno));
}

void ShardWriter::write_body(const void* p, size_t n) {
  write(p, n);
  XXH3_64bits_update(hash_->st, p, n);
}

void ShardWriter::add(std::span<const uint32_t> tokens, uint32_t prompt_len) {
  SIGMA_CHECK(prompt_len <= tokens.size(), "shard: prompt of {} tokens in a sample of {}", prompt_len,
              tokens.size());
  for (uint32_t t : tokens)
    SIGMA_CHECK(t < hdr_.vocab_size, "shard: token {} is outside the vocabulary of {}", t, hdr_.vocab_size);
  if (hdr_.token_bytes == 2) {
    buf16_.assign(tokens.begin(), tokens.end());
    write_body(buf16_.data(), buf16_.size() * 2);
  } else {
    write_body(tokens.data(), tokens.size() * 4);
  }
  hdr_.n_tokens += tokens.size();
  hdr_.n_samples += 1;
  offsets_.push_back(hdr_.n_tokens);
  prompt_.push_back(prompt_len);
}

void ShardWriter::finish() {
  static const char zeros[8] = {};
  write_body(zeros, (8 - (hdr_.n_tokens * hdr_.token_bytes) % 8) % 8);
  write_body(offsets_.data(), offsets_.size() * 8);
  write_body(prompt_.data(), prompt_.size() * 4);
  hdr_.checksum = shard_checksum(hdr_, XXH3_64bits_digest(hash_->st));
  SIGMA_CHECK(std::fseek(f_, 0, SEEK_SET) == 0, "shard: seek in {} failed", tmp_);
  write(&hdr_, sizeof(hdr_));
  int rc = std::fclose(f_);
  f_ = nullptr;
  SIGMA_CHECK(rc == 0, "shard: closing {} failed: {}", tmp_, errno_str());
  fsync_path(tmp_, false);  // durable before it gets its name
  finished_ = true;
}

void ShardWriter::commit() {
  SIGMA_CHECK(finished_, "shard {}: committed before it was finished", path_);
  SIGMA_CHECK(std::rename(tmp_.c_str(), path_.c_str()) == 0, "shard: cannot rename {} to {}: {}", tmp_,
              path_, errno_str());
  finished_ = false;
}

// ---------------------------------------------------------------------------------------------
// Reader

namespace {

void check_header(const ShardHeader& h, uint64_t file_size, const std::string& path) {
  SIGMA_CHECK(std::memcmp(h.magic, kShardMagic, 8) == 0,
              "shard {}: not a Sigma token shard (bad magic)", path);
  SIGMA_CHECK(h.version == kShardVersion, "shard {}: format version {}, this build reads {}{}; "
              "re-run sigma prepare", path, h.version, kShardVersion,
              h.version < kShardVersion ? " (older shards do not check their header)" : "");
  SIGMA_CHECK(h.token_bytes == 2 || h.token_bytes == 4, "shard {}: token size {} is not 2 or 4", path,
              h.token_bytes);
  SIGMA_CHECK(std::memchr(h.domain, 0, sizeof(h.domain)), "shard {}: domain name is not terminated", path);
  SIGMA_CHECK(h.n_tokens <= file_size && h.n_samples <= file_size && shard_file_size(h) == file_size,
              "shard {}: {} bytes, but its header ({} tokens, {} samples) needs {}; the file is "
              "truncated or corrupt, re-run sigma prepare", path, file_size, h.n_tokens, h.n_samples,
              h.n_tokens <= file_size && h.n_samples <= file_size ? shard_file_size(h) : 0);
}

}  // namespace

ShardHeader Shard::read_header(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SIGMA_CHECK(f, "shard {}: cannot open", path);
  ShardHeader h{};
  f.read(reinterpret_cast<char*>(&h), sizeof(h));
  std::error_code ec;
  uint64_t size = std::filesystem::file_size(path, ec);
  SIGMA_CHECK(f.gcount() == sizeof(h) && !ec, "shard {}: truncated ({} bytes; the header alone is {})",
              path, ec ? 0 : size, sizeof(h));
  check_header(h, size, path);
  return h;
}

std::shared_ptr<const Shard> Shard::open(const std::string& path, uint64_t expect_tokenizer_hash) {
  std::shared_ptr<Shard> s(new Shard());
  s->path_ = path;
  s->hdr_ = read_header(path);
  const ShardHeader& h = s->hdr_;
  SIGMA_CHECK(expect_tokenizer_hash == 0 || h.tokenizer_hash == expect_tokenizer_hash,
              "shard {} was made by tokenizer {:016x}, but the tokenizer in use is {:016x}; re-run "
              "sigma prepare with this tokenizer", path, h.tokenizer_hash, expect_tokenizer_hash);
  int fd = ::open(path.c_str(), O_RDONLY);
  SIGMA_CHECK(fd >= 0, "shard {}: cannot open: {}", path, std::strerror(errno));
  s->map_size_ = shard_file_size(h);
  s->map_ = ::mmap(nullptr, s->map_size_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (s->map_ == MAP_FAILED) {
    s->map_ = nullptr;
    fail("shard {}: mmap failed: {}", path, std::strerror(errno));
  }
  const char* base = static_cast<const char*>(s->map_);
  const uint64_t sum = shard_checksum(
      h, XXH3_64bits(base + sizeof(ShardHeader), s->map_size_ - sizeof(ShardHeader)));
  SIGMA_CHECK(sum == h.checksum, "shard {}: corrupted: its header, tokens and index hash to {:016x} "
              "but the header says {:016x}; re-run sigma prepare", path, sum, h.checksum);
  s->tokens_ = base + sizeof(ShardHeader);
  uint64_t tok_bytes = (h.n_tokens * h.token_bytes + 7) / 8 * 8;
  s->offsets_ = reinterpret_cast<const uint64_t*>(base + sizeof(ShardHeader) + tok_bytes);
  s->prompt_ = reinterpret_cast<const uint32_t*>(s->offsets_ + h.n_samples + 1);
  // The index must tile the tokens exactly; prompts fit inside their samples.
  SIGMA_CHECK(s->offsets_[0] == 0 && s->offsets_[h.n_samples] == h.n_tokens,
              "shard {}: sample index does not cover the {} tokens", path, h.n_tokens);
  for (uint64_t i = 0; i < h.n_samples; ++i) {
    SIGMA_CHECK(s->offsets_[i] <= s->offsets_[i + 1], "shard {}: sample index decreases at sample {}",
                path, i);
    SIGMA_CHECK(s->prompt_[i] <= s->offsets_[i + 1] - s->offsets_[i],
                "shard {}: sample {} has a prompt longer than itself", path, i);
  }
  for (uint64_t i = 0; i < h.n_tokens; ++i)
    SIGMA_CHECK(s->token(i) < h.vocab_size, "shard {}: token {} at position {} is outside the "
                "vocabulary of {}", path, s->token(i), i, h.vocab_size);
  return s;
}

Shard::~Shard() {
  if (map_) ::munmap(map_, map_size_);
}

std::string Shard::domain() const { return std::string(hdr_.domain); }

void Shard::read(uint64_t begin, uint64_t n, int32_t* out) const {
  SIGMA_CHECK(begin + n <= hdr_.n_tokens, "shard {}: read of [{}, {}) past {} tokens", path_, begin,
              begin + n, hdr_.n_tokens);
  if (hdr_.token_bytes == 2) {
    auto* p = static_cast<const uint16_t*>(tokens_) + begin;
    for (uint64_t i = 0; i < n; ++i) out[i] = p[i];
  } else {
    auto* p = static_cast<const uint32_t*>(tokens_) + begin;
    for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(p[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Prepared folder

std::string manifest_checksum(nlohmann::json manifest) {
  manifest.erase("manifest_xxh3_64");
  const std::string text = manifest.dump();
  return fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()));
}

ShardSet ShardSet::open(const std::string& dir, uint64_t expect_tokenizer_hash) {
  std::string mpath = dir + "/manifest.json";
  std::ifstream f(mpath);
  SIGMA_CHECK(f, "{}: cannot open; is {} a folder made by sigma prepare?", mpath, dir);
  std::stringstream ss;
  ss << f.rdbuf();
  auto m = nlohmann::json::parse(ss.str(), json_depth_limit(mpath), false);
  SIGMA_CHECK(!m.is_discarded() && m.is_object(), "{}: not valid JSON", mpath);
  SIGMA_CHECK(m.value("format", "") == "sigma-shards",  "{}: not a sigma-shards manifest", mpath);
  SIGMA_CHECK(m.value("version", 0) == kManifestVersion, "{}: sigma-shards manifest version {}, this "
              "build reads version {} (which carries its own checksum); re-run sigma prepare on the "
              "same config (it keeps the shards and rewrites the manifest)", mpath,
              m.value("version", 0), kManifestVersion);
  SIGMA_CHECK(m.value("manifest_xxh3_64", json_any()).is_string(),
              "{}: missing key \"manifest_xxh3_64\" (the manifest's own checksum)", mpath);
  const std::string own = manifest_checksum(m);
  SIGMA_CHECK(m["manifest_xxh3_64"].get<std::string>() == own,
              "{}: the manifest was changed after sigma prepare wrote it (its checksum is {}, its "
              "fields hash to {}); re-run sigma prepare rather than editing it", mpath,
              m["manifest_xxh3_64"].get<std::string>(), own);
  ShardSet set;
  SIGMA_CHECK(m.contains("domains"), "{}: missing key \"domains\"", mpath);
  set.domains = DomainRegistry::from_json(m["domains"], mpath + ": domains", DomainForm::Data);
  SIGMA_CHECK(m.contains("tokenizer_hash") && m["tokenizer_hash"].is_string(),
              "{}: missing key \"tokenizer_hash\"", mpath);
  std::string hex = m["tokenizer_hash"].get<std::string>();
  char* end = nullptr;
  set.tokenizer_hash = std::strtoull(hex.c_str(), &end, 16);
  SIGMA_CHECK(hex.size() == 16 && end == hex.c_str() + 16, "{}: \"tokenizer_hash\" '{}' is not 16 hex "
              "digits", mpath, hex);
  SIGMA_CHECK(expect_tokenizer_hash == 0 || set.tokenizer_hash == expect_tokenizer_hash,
              "{}: shards were made by tokenizer {:016x}, but the tokenizer in use is {:016x}; "
              "re-run sigma prepare with this tokenizer", mpath, set.tokenizer_hash,
              expect_tokenizer_hash);
  // Each domain's entry: its file, token count and checksum, which the shard must match.
  std::map<std::string, nlohmann::json> entries;
  SIGMA_CHECK(m.contains("shards") && m["shards"].is_array(), "{}: missing key \"shards\"", mpath);
  for (const auto& e : m["shards"]) {
    SIGMA_CHECK(e.is_object() && e.value("domain", json_any()).is_string() &&
                    e.value("tokens", json_any()).is_number_unsigned() &&
                    e.value("xxh3_64", json_any()).is_string(),
                "{}: a \"shards\" entry lacks domain, tokens or xxh3_64", mpath);
    entries[e["domain"].get<std::string>()] = e;
  }
  for (const DomainSpec& d : set.domains) {
    auto shard = Shard::open(dir + "/" + d.name + ".shard", set.tokenizer_hash);
    SIGMA_CHECK(shard->domain() == d.name && shard->domain_id() == d.id,
                "shard {} holds domain '{}' (id {}), the manifest expects '{}' (id {})",
                shard->path(), shard->domain(), shard->domain_id(), d.name, d.id);
    auto it = entries.find(d.name);
    SIGMA_CHECK(it != entries.end(), "{}: no \"shards\" entry for domain '{}'", mpath, d.name);
    const std::string sum = fmt::format("{:016x}", shard->header().checksum);
    const uint64_t tokens = it->second["tokens"].get<uint64_t>();
    SIGMA_CHECK(it->second["xxh3_64"] == sum && tokens == shard->n_tokens(),
                "shard {} ({} tokens, checksum {}) is not the one {} names ({} tokens, checksum {}): "
                "the folder mixes two preparations (a prepare stopped part-way?); re-run sigma "
                "prepare", shard->path(), shard->n_tokens(), sum, mpath, tokens,
                it->second["xxh3_64"].get<std::string>());
    if (set.vocab_size == 0) set.vocab_size = shard->header().vocab_size;
    set.shards.push_back(std::move(shard));
  }
  return set;
}

}  // namespace sigma::data
