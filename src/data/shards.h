// Token shards (DESIGN.md §5): one memory-mapped file per domain.
// Layout (little-endian):
//   ShardHeader (128 bytes)
//   tokens        n_tokens x (2 or 4 bytes), zero-padded to a multiple of 8 bytes
//   offsets       (n_samples + 1) x u64: sample i is tokens [offsets[i], offsets[i+1])
//   prompt_len    n_samples x u32: leading tokens of the sample that are prompt (0 = none)
// `checksum` covers the whole file: the xxh3_64 of the header's other 120 bytes seeded with the
// xxh3_64 of everything after the header (shard_checksum). Version 3; version 2 checked only
// the body (a changed vocab_size or domain id went unseen) and version 1 nothing: such shards
// are refused and `prepare` remakes them.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/domains.h"

namespace sigma::data {

inline constexpr char kShardMagic[8] = {'S', 'I', 'G', 'S', 'H', 'R', 'D', '\0'};
inline constexpr uint32_t kShardVersion = 3;

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;     // 2 (u16) or 4 (u32)
  uint64_t tokenizer_hash;  // Tokenizer::hash() of the tokenizer that made the tokens
  uint64_t inputs_hash;     // what the shard was made from (prepare skips unchanged shards)
  uint64_t n_tokens;
  uint64_t n_samples;
  uint32_t domain_id;
  uint32_t vocab_size;
  char domain[64];  // NUL-padded name
  uint64_t checksum;  // shard_checksum: header fields and body
};
static_assert(sizeof(ShardHeader) == 128);

// The checksum of a shard with header `h` (its `checksum` field ignored) and a body whose
// xxh3_64 is `body_xxh3`.
uint64_t shard_checksum(const ShardHeader& h, uint64_t body_xxh3);

// Streams samples to PATH.tmp-<pid>; finish() completes and fsyncs it, commit() renames it to
// PATH. `sigma prepare` finishes every shard before it commits any, and writes the manifest
// (which names each shard's checksum and token count) last: a folder killed in between has
// shards its manifest does not name, which readers refuse (ShardSet::open).
class ShardWriter {
 public:
  ShardWriter(std::string path, const DomainSpec& d, uint32_t vocab_size, uint64_t tokenizer_hash,
              uint64_t inputs_hash);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  void add(std::span<const uint32_t> tokens, uint32_t prompt_len = 0);
  void finish();
  void commit();
  uint64_t n_tokens() const { return hdr_.n_tokens; }
  uint64_t checksum() const { return hdr_.checksum; }
  uint64_t n_samples() const { return hdr_.n_samples; }

 private:
  void write(const void* p, size_t n);
  void write_body(const void* p, size_t n);  // write() and into the body checksum
  std::string path_, tmp_;
  struct HashState;
  std::unique_ptr<HashState> hash_;
  std::FILE* f_ = nullptr;
  bool finished_ = false;
  ShardHeader hdr_{};
  std::vector<uint64_t> offsets_{0};
  std::vector<uint32_t> prompt_;
  std::vector<uint16_t> buf16_;
};

// Read-only view of a shard file; open() validates everything and names the file on error.
class Shard {
 public:
  // expect_tokenizer_hash = 0 skips the tokenizer check (inspection tools).
  static std::shared_ptr<const Shard> open(const std::string& path, uint64_t expect_tokenizer_hash);
  static ShardHeader read_header(const std::string& path);  // validated header only
  ~Shard();

  const ShardHeader& header() const { return hdr_; }
  const std::string& path() const { return path_; }
  std::string domain() const;
  uint32_t domain_id() const { return hdr_.domain_id; }
  uint64_t n_tokens() const { return hdr_.n_tokens; }
  uint64_t n_samples() const { return hdr_.n_samples; }
  uint32_t token(uint64_t i) const {
    return hdr_.token_bytes == 2 ? static_cast<const uint16_t*>(tokens_)[i]
                                 : static_cast<const uint32_t*>(tokens_)[i];
  }
  // Copies tokens [begin, begin + n) to out as int32 (what the model consumes).
  void read(uint64_t begin, uint64_t n, int32_t* out) const;
  uint64_t sample_begin(uint64_t s) const { return offsets_[s]; }
  uint64_t sample_end(uint64_t s) const { return offsets_[s + 1]; }
  uint32_t prompt_len(uint64_t s) const { return prompt_[s]; }

 private:
  Shard() = default;
  std::string path_;
  ShardHeader hdr_{};
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const void* tokens_ = nullptr;
  const uint64_t* offsets_ = nullptr;
  const uint32_t* prompt_ = nullptr;
};

// A prepared folder: manifest.json (domain registry, tokenizer hash, and each shard's file,
// token count and checksum) plus one shard per domain.
struct ShardSet {
  DomainRegistry domains;
  uint64_t tokenizer_hash = 0;
  uint32_t vocab_size = 0;
  std::vector<std::shared_ptr<const Shard>> shards;  // shards[i] belongs to domains[i]

  // Throws when the folder, manifest or any shard is missing, corrupt, from another tokenizer,
  // or not the shard the manifest names (a prepare killed between its renames).
  static ShardSet open(const std::string& dir, uint64_t expect_tokenizer_hash);
};

// Bytes the file must have for the counts in its header.
uint64_t shard_file_size(const ShardHeader& h);

// The manifest's own checksum, stored in it as "manifest_xxh3_64": xxh3_64 of the compact
// JSON dump (keys sorted) of every other field, so that an edit to any field, present or future,
// is refused rather than trusted.
constexpr int kManifestVersion = 3;
std::string manifest_checksum(nlohmann::json manifest);

}  // namespace sigma::data
