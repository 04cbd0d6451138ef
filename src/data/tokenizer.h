// Byte-level BPE tokenizer (DESIGN.md §5). Id layout, fixed by construction:
//   [0, C)              control tokens: <EOT>=0, <Pad>=1, <EN>, <CN>, <Python>, <Java>, <comment>,
//                       <python>, then user-defined ones
//   [C, C+256)          one token per byte value, so any byte string encodes (no unknown token)
//   [C+256, C+255+K)    runs of 2..K spaces (code indentation costs one token)
//   [C+255+K, V)        learned merges, in the order they were learned (= merge rank)
// Control tokens are never produced by encode(); ask for them by name with id_of_control().
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sigma::data {

inline constexpr std::array<std::string_view, 8> kDefaultControls = {
    "<EOT>", "<Pad>", "<EN>", "<CN>", "<Python>", "<Java>", "<comment>", "<python>"};
inline constexpr uint32_t kEotId = 0;
inline constexpr uint32_t kPadId = 1;

// Transparent string hash, so maps keyed by std::string can be probed with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const;
};

struct TrainOptions {
  uint32_t vocab_size = 16384;        // total, including controls, bytes and space runs
  std::vector<std::string> controls{};  // user-defined, appended after kDefaultControls
  uint32_t max_space_run = 16;        // K: runs of 2..K spaces get their own token
  uint64_t min_pair_count = 2;        // stop early when no pair occurs this often
};

class Tokenizer {
 public:
  // Untrained: controls, bytes and space runs only (still round-trips everything).
  explicit Tokenizer(std::vector<std::string> user_controls = {}, uint32_t max_space_run = 16);

  static Tokenizer train(std::span<const std::string> texts, const TrainOptions& opt);
  static Tokenizer load(const std::string& path);  // throws Error naming the file
  static Tokenizer from_json(const nlohmann::json& j, const std::string& origin);
  nlohmann::json to_json() const;
  void save(const std::string& path) const;

  std::vector<uint32_t> encode(std::string_view text) const;
  void encode_append(std::string_view text, std::vector<uint32_t>& out) const;
  // Controls decode to their names ("<EOT>"); ids >= vocab_size() throw.
  std::string decode(std::span<const uint32_t> ids) const;

  uint32_t id_of_control(std::string_view name) const;  // throws Error on unknown names
  std::optional<uint32_t> find_control(std::string_view name) const;
  bool is_control(uint32_t id) const { return id < n_controls(); }
  const std::vector<std::string>& controls() const { return controls_; }

  uint32_t vocab_size() const { return static_cast<uint32_t>(bytes_.size()); }
  uint32_t n_controls() const { return static_cast<uint32_t>(controls_.size()); }
  uint32_t n_merges() const { return static_cast<uint32_t>(merges_.size()); }
  uint32_t max_space_run() const { return max_space_run_; }
  uint32_t byte_id(uint8_t b) const { return n_controls() + b; }
  uint32_t space_run_id(uint32_t n) const;  // n in [2, max_space_run]
  // Bytes a token stands for (a control's bytes are its name).
  const std::string& token_bytes(uint32_t id) const { return bytes_.at(id); }
  // xxHash64 of the content (controls, K, merges), independent of file formatting.
  uint64_t hash() const { return hash_; }

 private:
  friend class BpeTrainer;
  void add_merge(uint32_t left, uint32_t right);  // appends; throws on bad ids
  void finalize();                                // computes hash_ and serial_
  void bpe(std::string_view piece, std::vector<uint32_t>& out) const;
  uint32_t merge_of(uint32_t left, uint32_t right) const;  // 0 when none (0 is never a merge)

  std::vector<std::string> controls_;
  uint32_t max_space_run_;
  std::vector<std::array<uint32_t, 2>> merges_;
  std::vector<std::string> bytes_;
  // Open-addressing table (left << 32 | right) -> merged id; key ~0 marks an empty slot.
  std::vector<uint64_t> pair_keys_;
  std::vector<uint32_t> pair_vals_;
  uint64_t hash_ = 0;
  uint64_t serial_ = 0;  // identifies this content for the per-thread encode cache
};

// Learns merges from text added piece by piece; memory grows with distinct words, not text.
class BpeTrainer {
 public:
  explicit BpeTrainer(TrainOptions opt);
  void add(std::string_view text);
  // `progress`: a progress line of the merges on stderr (core/progress.h).
  Tokenizer finish(bool progress = false) const;
  size_t distinct_words() const { return words_.size(); }

 private:
  TrainOptions opt_;
  std::unordered_map<std::string, uint64_t, StringHash, std::equal_to<>> words_;
};

// Pre-tokenisation: splits text into pieces that BPE never merges across (words, digit groups,
// punctuation, newline runs, space runs). Exposed for tests; `space_run` marks 2+ spaces.
struct Piece {
  std::string_view text;
  bool space_run;
};
void pretokenize(std::string_view text, uint32_t max_space_run, std::vector<Piece>& out);

// UTF-8: length of the valid shortest-form character at s[pos], or 0 if there is none.
size_t utf8_next(std::string_view s, size_t pos, uint32_t& cp);
bool utf8_valid(std::string_view s);

}  // namespace sigma::data
