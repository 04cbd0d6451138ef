#include "data/tokenizer.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"
#include "core/json_depth.h"
#include "core/rng.h"
#include "io/file.h"

namespace sigma::data {

// ---------------------------------------------------------------------------------------------
// UTF-8 and pre-tokenisation

size_t utf8_next(std::string_view s, size_t pos, uint32_t& cp) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  size_t n = s.size() - pos;
  unsigned char b = p[0];
  if (b < 0x80) { cp = b; return 1; }
  size_t len;
  uint32_t min;
  if ((b & 0xE0) == 0xC0) { len = 2; cp = b & 0x1F; min = 0x80; }
  else if ((b & 0xF0) == 0xE0) { len = 3; cp = b & 0x0F; min = 0x800; }
  else if ((b & 0xF8) == 0xF0) { len = 4; cp = b & 0x07; min = 0x10000; }
  else return 0;
  if (n < len) return 0;
  for (size_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not valid UTF-8.
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

bool utf8_valid(std::string_view s) {
  uint32_t cp;
  for (size_t i = 0; i < s.size();) {
    size_t len = utf8_next(s, i, cp);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

namespace {

// Character classes; a piece is a run of one class (digits: at most 3).
enum Cls : uint8_t { kLatin, kCjk, kDigit, kSpace, kWs, kPunct, kInvalid };

constexpr std::array<Cls, 128> make_ascii_table() {
  std::array<Cls, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') t[c] = kLatin;
    else if (c >= '0' && c <= '9') t[c] = kDigit;
    else if (c == ' ') t[c] = kSpace;
    else if (c == '\n' || c == '\t' || c == '\r' || c == '\v' || c == '\f') t[c] = kWs;
    else t[c] = kPunct;
  }
  return t;
}
constexpr auto kAscii = make_ascii_table();

Cls classify_cp(uint32_t cp) {
  // Punctuation blocks, so "。”" or "——" form their own pieces and do not glue to words.
  if (cp < 0xC0 || (cp >= 0x2000 && cp <= 0x206F) || (cp >= 0x3000 && cp <= 0x303F) ||
      (cp >= 0xFE30 && cp <= 0xFE4F) || (cp >= 0xFF00 && cp <= 0xFF0F) ||
      (cp >= 0xFF1A && cp <= 0xFF20) || (cp >= 0xFF3B && cp <= 0xFF40) ||
      (cp >= 0xFF5B && cp <= 0xFF65))
    return kPunct;
  return cp >= 0x2E80 ? kCjk : kLatin;  // CJK, kana, hangul, fullwidth vs other scripts
}

// Class and byte length of the character at s[i] (an invalid byte is a 1-byte kInvalid).
inline Cls class_at(std::string_view s, size_t i, size_t& len) {
  auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) { len = 1; return kAscii[b]; }
  uint32_t cp;
  len = utf8_next(s, i, cp);
  if (len == 0) { len = 1; return kInvalid; }
  return classify_cp(cp);
}

// Calls f(piece, is_space_run) for consecutive pieces that concatenate to `s`. A single space
// joins the piece after it (" the"); runs of 2+ spaces become space-run pieces of <= K spaces.
template <class F>
void for_each_piece(std::string_view s, uint32_t max_run, F&& f) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    size_t start = i, len;
    Cls c = class_at(s, i, len);
    if (c == kSpace) {
      size_t j = i;
      while (j < n && s[j] == ' ') ++j;
      size_t run = j - i;
      if (run == 1 && j < n) {
        size_t len2;
        Cls c2 = class_at(s, j, len2);
        if (c2 == kLatin || c2 == kCjk || c2 == kDigit || c2 == kPunct) {
          c = c2;
          i = j;
          len = len2;
          goto body;
        }
      }
      while (run > 0) {
        size_t k = std::min<size_t>(run, max_run);
        f(s.substr(i, k), k >= 2);
        i += k;
        run -= k;
      }
      continue;
    }
  body:
    i += len;
    if (c == kDigit) {
      for (int d = 1; d < 3 && i < n && s[i] >= '0' && s[i] <= '9'; ++d) ++i;
    } else if (c != kInvalid) {
      while (i < n) {
        size_t l2;
        if (class_at(s, i, l2) != c) break;
        i += l2;
      }
    }
    f(s.substr(start, i - start), false);
  }
}

std::atomic<uint64_t> g_serial{1};

constexpr uint64_t kEmptyKey = ~0ULL;
inline uint64_t pair_key(uint32_t a, uint32_t b) { return (uint64_t(a) << 32) | b; }

}  // namespace

void pretokenize(std::string_view text, uint32_t max_space_run, std::vector<Piece>& out) {
  for_each_piece(text, max_space_run, [&](std::string_view p, bool run) { out.push_back({p, run}); });
}

// ---------------------------------------------------------------------------------------------
// Construction, hashing, lookup

Tokenizer::Tokenizer(std::vector<std::string> user_controls, uint32_t max_space_run)
    : max_space_run_(max_space_run) {
  SIGMA_CHECK(max_space_run >= 1 && max_space_run <= 256,
              "tokenizer: max_space_run must be in [1, 256], got {}", max_space_run);
  for (auto c : kDefaultControls) controls_.emplace_back(c);
  for (auto& c : user_controls) {
    if (std::find(controls_.begin(), controls_.end(), c) != controls_.end()) continue;
    SIGMA_CHECK(c.size() >= 3 && c.front() == '<' && c.back() == '>',
                "tokenizer: control token '{}' must look like <name>", c);
    controls_.push_back(std::move(c));
  }
  bytes_ = controls_;
  for (int b = 0; b < 256; ++b) bytes_.emplace_back(1, static_cast<char>(b));
  for (uint32_t k = 2; k <= max_space_run_; ++k) bytes_.emplace_back(k, ' ');
  finalize();
}

uint32_t Tokenizer::space_run_id(uint32_t n) const {
  SIGMA_CHECK(n >= 2 && n <= max_space_run_, "tokenizer: no token for a run of {} spaces", n);
  return n_controls() + 256 + (n - 2);
}

void Tokenizer::add_merge(uint32_t left, uint32_t right) {
  uint32_t first_merge = n_controls() + 255 + max_space_run_;
  uint32_t id = vocab_size();
  auto usable = [&](uint32_t t) {
    return t < id && !is_control(t) && (t < n_controls() + 256 || t >= first_merge);
  };
  SIGMA_CHECK(usable(left) && usable(right),
              "tokenizer: merge #{} ({}, {}) refers to a control, a space run or a later token",
              merges_.size(), left, right);
  merges_.push_back({left, right});
  bytes_.push_back(bytes_[left] + bytes_[right]);
}

void Tokenizer::finalize() {
  // Pair table at load factor <= 1/2, so probes stay short.
  size_t cap = 16;
  while (cap < 2 * merges_.size() + 2) cap <<= 1;
  pair_keys_.assign(cap, kEmptyKey);
  pair_vals_.assign(cap, 0);
  uint32_t first_merge = vocab_size() - n_merges();
  for (size_t m = 0; m < merges_.size(); ++m) {
    uint64_t key = pair_key(merges_[m][0], merges_[m][1]);
    size_t h = mix64(key) & (cap - 1);
    while (pair_keys_[h] != kEmptyKey) {
      SIGMA_CHECK(pair_keys_[h] != key, "tokenizer: merge #{} ({}, {}) is listed twice", m,
                  merges_[m][0], merges_[m][1]);
      h = (h + 1) & (cap - 1);
    }
    pair_keys_[h] = key;
    pair_vals_[h] = first_merge + static_cast<uint32_t>(m);
  }
  // Canonical content: format tag, controls (length-prefixed), K, merges.
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0x5167AULL);
  auto put = [&](const void* p, size_t n) { XXH64_update(st, p, n); };
  put("sigma-bpe/1", 11);
  uint64_t nc = controls_.size();
  put(&nc, 8);
  for (auto& c : controls_) {
    uint64_t l = c.size();
    put(&l, 8);
    put(c.data(), c.size());
  }
  put(&max_space_run_, 4);
  put(merges_.data(), merges_.size() * sizeof(merges_[0]));
  hash_ = XXH64_digest(st);
  XXH64_freeState(st);
  serial_ = g_serial.fetch_add(1);
}

uint32_t Tokenizer::merge_of(uint32_t left, uint32_t right) const {
  uint64_t key = pair_key(left, right);
  size_t mask = pair_keys_.size() - 1;
  for (size_t h = mix64(key) & mask;; h = (h + 1) & mask) {
    if (pair_keys_[h] == key) return pair_vals_[h];
    if (pair_keys_[h] == kEmptyKey) return 0;
  }
}

std::optional<uint32_t> Tokenizer::find_control(std::string_view name) const {
  for (size_t i = 0; i < controls_.size(); ++i)
    if (controls_[i] == name) return static_cast<uint32_t>(i);
  return std::nullopt;
}

uint32_t Tokenizer::id_of_control(std::string_view name) const {
  auto id = find_control(name);
  if (!id) {
    std::string known;
    for (auto& c : controls_) known += (known.empty() ? "" : " ") + c;
    fail("tokenizer has no control token '{}' (it has: {})", name, known);
  }
  return *id;
}

// ---------------------------------------------------------------------------------------------
// Encode / decode

// Applies merges to one piece lowest rank first, leftmost first: a linked list over the piece's
// symbols and a min-heap of candidate pairs (stale entries are skipped when popped).
void Tokenizer::bpe(std::string_view piece, std::vector<uint32_t>& out) const {
  const size_t n = piece.size();
  if (n == 1) {
    out.push_back(byte_id(static_cast<uint8_t>(piece[0])));
    return;
  }
  struct Cand {
    uint32_t id, pos, left, right;
    bool operator>(const Cand& o) const { return id != o.id ? id > o.id : pos > o.pos; }
  };
  thread_local std::vector<uint32_t> ids, nxt, prv;
  thread_local std::vector<Cand> heap;
  ids.resize(n);
  nxt.resize(n);
  prv.resize(n);
  heap.clear();
  const uint32_t none = static_cast<uint32_t>(n);
  for (size_t i = 0; i < n; ++i) {
    ids[i] = byte_id(static_cast<uint8_t>(piece[i]));
    nxt[i] = static_cast<uint32_t>(i + 1);
    prv[i] = i == 0 ? none : static_cast<uint32_t>(i - 1);
  }
  auto push = [&](uint32_t pos) {
    if (pos == none || nxt[pos] == none) return;
    uint32_t r = nxt[pos];
    if (uint32_t m = merge_of(ids[pos], ids[r])) {
      heap.push_back({m, pos, ids[pos], ids[r]});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (uint32_t i = 0; i + 1 < n; ++i)  // all initial pairs, then one O(n) heapify
    if (uint32_t m = merge_of(ids[i], ids[i + 1])) heap.push_back({m, i, ids[i], ids[i + 1]});
  std::make_heap(heap.begin(), heap.end(), std::greater<>());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    Cand c = heap.back();
    heap.pop_back();
    uint32_t r = nxt[c.pos];
    // Stale: the left symbol was absorbed (ids marked none) or either side changed since.
    if (ids[c.pos] != c.left || r == none || ids[r] != c.right) continue;
    ids[c.pos] = c.id;
    ids[r] = ~0u;
    nxt[c.pos] = nxt[r];
    if (nxt[r] != none) prv[nxt[r]] = c.pos;
    push(prv[c.pos]);
    push(c.pos);
  }
  for (uint32_t i = 0; i != none; i = nxt[i]) out.push_back(ids[i]);
}

size_t StringHash::operator()(std::string_view s) const { return XXH3_64bits(s.data(), s.size()); }

namespace {
// Per-thread piece -> ids cache; words repeat, so most pieces skip BPE entirely.
struct EncodeCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>> map;
};
constexpr size_t kCacheMaxEntries = 1 << 18;
constexpr size_t kCacheMaxPiece = 16;
}  // namespace

void Tokenizer::encode_append(std::string_view text, std::vector<uint32_t>& out) const {
  thread_local EncodeCache cache;
  if (cache.owner != serial_) {
    cache.map.clear();
    cache.owner = serial_;
  }
  for_each_piece(text, max_space_run_, [&](std::string_view p, bool run) {
    if (run) {
      out.push_back(space_run_id(static_cast<uint32_t>(p.size())));
      return;
    }
    if (p.size() == 1) {
      out.push_back(byte_id(static_cast<uint8_t>(p[0])));
      return;
    }
    if (p.size() > kCacheMaxPiece) return bpe(p, out);
    if (auto it = cache.map.find(p); it != cache.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    size_t before = out.size();
    bpe(p, out);
    if (cache.map.size() >= kCacheMaxEntries) cache.map.clear();
    cache.map.emplace(std::string(p), std::vector<uint32_t>(out.begin() + before, out.end()));
  });
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> out;
  out.reserve(text.size() / 3 + 8);
  encode_append(text, out);
  return out;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids) const {
  std::string s;
  for (uint32_t id : ids) {
    SIGMA_CHECK(id < vocab_size(), "tokenizer: token id {} is outside the vocabulary of {}", id,
                vocab_size());
    s += bytes_[id];
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Files

nlohmann::json Tokenizer::to_json() const {
  nlohmann::json merges = nlohmann::json::array();
  for (auto& m : merges_) merges.push_back({m[0], m[1]});
  return {{"format", "sigma-bpe"},
          {"version", 1},
          {"hash", fmt::format("{:016x}", hash_)},
          {"controls", controls_},
          {"max_space_run", max_space_run_},
          {"vocab_size", vocab_size()},
          {"merges", std::move(merges)}};
}

void Tokenizer::save(const std::string& path) const {
  write_file_atomic(path, to_json().dump() + "\n");
}

Tokenizer Tokenizer::from_json(const nlohmann::json& j, const std::string& origin) {
  using nlohmann::json;
  auto key = [&](const char* k, json::value_t t1, json::value_t t2 = json::value_t::discarded)
      -> const json& {
    SIGMA_CHECK(j.is_object() && j.contains(k), "tokenizer {}: missing key \"{}\"", origin, k);
    const json& v = j.at(k);
    SIGMA_CHECK(v.type() == t1 || v.type() == t2, "tokenizer {}: key \"{}\" has the wrong type",
                origin, k);
    return v;
  };
  SIGMA_CHECK(key("format", json::value_t::string) == "sigma-bpe",
              "tokenizer {}: \"format\" is not \"sigma-bpe\"", origin);
  auto version = key("version", json::value_t::number_unsigned).get<uint64_t>();
  SIGMA_CHECK(version == 1, "tokenizer {}: unsupported version {} (this build reads 1)", origin,
              version);
  const json& ctl = key("controls", json::value_t::array);
  SIGMA_CHECK(ctl.size() >= kDefaultControls.size(),
              "tokenizer {}: \"controls\" must start with the {} default control tokens", origin,
              kDefaultControls.size());
  std::vector<std::string> user;
  for (size_t i = 0; i < ctl.size(); ++i) {
    SIGMA_CHECK(ctl[i].is_string(), "tokenizer {}: \"controls\"[{}] is not a string", origin, i);
    auto name = ctl[i].get<std::string>();
    if (i < kDefaultControls.size()) {
      SIGMA_CHECK(name == kDefaultControls[i], "tokenizer {}: \"controls\"[{}] is '{}', expected '{}'",
                  origin, i, name, kDefaultControls[i]);
    } else {
      SIGMA_CHECK(std::find(user.begin(), user.end(), name) == user.end(),
                  "tokenizer {}: control token '{}' is listed twice", origin, name);
      user.push_back(std::move(name));
    }
  }
  auto k = key("max_space_run", json::value_t::number_unsigned).get<uint64_t>();
  SIGMA_CHECK(k >= 1 && k <= 256, "tokenizer {}: \"max_space_run\" {} is outside [1, 256]", origin, k);
  Tokenizer t(std::move(user), static_cast<uint32_t>(k));
  SIGMA_CHECK(t.n_controls() == ctl.size(), "tokenizer {}: \"controls\" lists a default token twice",
              origin);
  const json& merges = key("merges", json::value_t::array);
  t.merges_.reserve(merges.size());
  for (size_t m = 0; m < merges.size(); ++m) {
    const json& p = merges[m];
    SIGMA_CHECK(p.is_array() && p.size() == 2 && p[0].is_number_unsigned() && p[1].is_number_unsigned(),
                "tokenizer {}: \"merges\"[{}] is not a pair of token ids", origin, m);
    uint64_t a = p[0].get<uint64_t>(), b = p[1].get<uint64_t>();
    SIGMA_CHECK(a < 0xFFFFFFFFull && b < 0xFFFFFFFFull, "tokenizer {}: \"merges\"[{}] id too large",
                origin, m);
    try {
      t.add_merge(static_cast<uint32_t>(a), static_cast<uint32_t>(b));
    } catch (const Error& e) {
      fail("tokenizer {}: {}", origin, e.what());
    }
  }
  try {
    t.finalize();
  } catch (const Error& e) {
    fail("tokenizer {}: {}", origin, e.what());
  }
  if (j.contains("vocab_size"))
    SIGMA_CHECK(j["vocab_size"] == t.vocab_size(), "tokenizer {}: \"vocab_size\" {} disagrees with "
                "the {} tokens the file defines", origin, j["vocab_size"].dump(), t.vocab_size());
  if (j.contains("hash"))
    SIGMA_CHECK(j["hash"] == fmt::format("{:016x}", t.hash()),
                "tokenizer {}: content hash {} does not match the recorded \"hash\" {} (edited or "
                "corrupted file)", origin, fmt::format("{:016x}", t.hash()), j["hash"].dump());
  return t;
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SIGMA_CHECK(f, "tokenizer: cannot open {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), json_depth_limit("tokenizer " + path), /*allow_exceptions=*/false);
  SIGMA_CHECK(!j.is_discarded(), "tokenizer {}: not valid JSON", path);
  return from_json(j, path);
}

}  // namespace sigma::data

// ---------------------------------------------------------------------------------------------
// Training

namespace sigma::data {

BpeTrainer::BpeTrainer(TrainOptions opt) : opt_(std::move(opt)) {}

void BpeTrainer::add(std::string_view text) {
  for_each_piece(text, opt_.max_space_run, [&](std::string_view p, bool run) {
    if (run || p.size() < 2) return;  // nothing to merge inside
    if (auto it = words_.find(p); it != words_.end()) ++it->second;
    else words_.emplace(std::string(p), 1);
  });
}

namespace {
struct MixHash {
  size_t operator()(uint64_t k) const { return mix64(k); }
};

// Incremental pair counting: counts of every adjacent pair over the distinct words (weighted by
// word frequency), an index pair -> words containing it, and a lazy max-heap. A merge touches
// only the words that contain its pair and updates the counts of the neighbouring pairs.
class PairCounts {
 public:
  // Every word as byte tokens; `words` (word, frequency) sorted, so that the merges do not
  // depend on hash-map iteration order.
  PairCounts(const Tokenizer& tok, std::span<const std::pair<std::string_view, uint64_t>> words)
      : syms_(words.size()), freq_(words.size()), stamp_(words.size(), ~0u) {
    for (size_t w = 0; w < words.size(); ++w) {
      auto& s = syms_[w];
      for (char c : words[w].first) s.push_back(tok.byte_id(static_cast<uint8_t>(c)));
      freq_[w] = static_cast<int64_t>(words[w].second);
      for (size_t i = 0; i + 1 < s.size(); ++i) {
        uint64_t k = pair_key(s[i], s[i + 1]);
        count_[k] += freq_[w];
        auto& list = where_[k];
        if (list.empty() || list.back() != w) list.push_back(static_cast<uint32_t>(w));
      }
    }
    for (auto& [k, c] : count_) heap_.push({c, ~k});
  }

  // The most frequent pair and its count, stale heap entries skipped; nullopt when none is left.
  std::optional<std::pair<uint64_t, int64_t>> pop_best() {
    while (!heap_.empty()) {
      auto [c, nk] = heap_.top();
      heap_.pop();
      auto it = count_.find(~nk);
      int64_t cur = it == count_.end() ? 0 : it->second;
      if (cur == c) return std::pair{~nk, c};
      // Stale entry; an increase was pushed separately when it happened.
      if (cur > 0 && cur < c) heap_.push({cur, nk});
    }
    return std::nullopt;
  }

  // Merge number `step`: pair `key` becomes token z in every word that holds it.
  void merge(uint64_t key, uint32_t z, uint32_t step) {
    const uint32_t a = static_cast<uint32_t>(key >> 32), b = static_cast<uint32_t>(key);
    grown_.clear();
    std::vector<uint32_t> list = std::move(where_[key]);
    where_.erase(key);
    for (uint32_t w : list) {
      if (stamp_[w] == step) continue;
      stamp_[w] = step;
      merge_in_word(w, a, b, z);
    }
    count_.erase(key);  // every occurrence was merged
    std::sort(grown_.begin(), grown_.end());
    grown_.erase(std::unique(grown_.begin(), grown_.end()), grown_.end());
    for (uint64_t k : grown_) heap_.push({count_[k], ~k});
  }

 private:
  // Rewrites word w's tokens and moves the counts of the pairs around each (a, b) to (., z).
  void merge_in_word(uint32_t w, uint32_t a, uint32_t b, uint32_t z) {
    auto& s = syms_[w];
    const int64_t f = freq_[w];
    size_t out = 0;
    for (size_t i = 0; i < s.size();) {
      if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
        if (out > 0) {
          add(w, s[out - 1], a, -f);
          add(w, s[out - 1], z, f);
        }
        if (i + 2 < s.size()) {
          add(w, b, s[i + 2], -f);
          add(w, z, s[i + 2], f);
        }
        s[out++] = z;
        i += 2;
      } else {
        s[out++] = s[i++];
      }
    }
    s.resize(out);
  }

  // Pair (x, y) in word w: its count changes by d; a pair that grows is indexed and re-queued.
  void add(uint32_t w, uint32_t x, uint32_t y, int64_t d) {
    uint64_t k = pair_key(x, y);
    count_[k] += d;
    if (d > 0) {
      auto& l = where_[k];
      if (l.empty() || l.back() != w) l.push_back(w);
      grown_.push_back(k);
    }
  }

  std::vector<std::vector<uint32_t>> syms_;  // [word] its tokens so far
  std::vector<int64_t> freq_;                // [word] its count in the text
  std::unordered_map<uint64_t, int64_t, MixHash> count_;                // pair -> weighted count
  std::unordered_map<uint64_t, std::vector<uint32_t>, MixHash> where_;  // pair -> words with it
  // Max count first; ties go to the smaller pair key (~key is larger), deterministically.
  std::priority_queue<std::pair<int64_t, uint64_t>> heap_;  // (count, ~key), some stale
  std::vector<uint32_t> stamp_;  // [word] the last merge step that rewrote it
  std::vector<uint64_t> grown_;  // pairs whose count grew during the current merge
};
}  // namespace

Tokenizer BpeTrainer::finish(bool progress) const {
  Tokenizer tok(opt_.controls, opt_.max_space_run);
  SIGMA_CHECK(opt_.vocab_size >= tok.vocab_size(),
              "tokenizer train: vocab size {} is below the {} fixed tokens (controls, bytes, space "
              "runs)", opt_.vocab_size, tok.vocab_size());
  const uint32_t target = opt_.vocab_size - tok.vocab_size();

  // Sorted, so the merges do not depend on hash-map iteration order.
  std::vector<std::pair<std::string_view, uint64_t>> sorted(words_.begin(), words_.end());
  std::sort(sorted.begin(), sorted.end());
  PairCounts pairs(tok, sorted);
  Progress shown("tokenizer train: merges", target, "merges", progress);
  for (uint32_t step = 0; step < target; ++step) {
    shown.set(step);
    const auto best = pairs.pop_best();
    if (!best || best->second < static_cast<int64_t>(opt_.min_pair_count)) break;
    const uint64_t key = best->first;
    const uint32_t z = tok.vocab_size();
    tok.add_merge(static_cast<uint32_t>(key >> 32), static_cast<uint32_t>(key));
    pairs.merge(key, z, step);
  }
  tok.finalize();
  return tok;
}

Tokenizer Tokenizer::train(std::span<const std::string> texts, const TrainOptions& opt) {
  BpeTrainer t(opt);
  for (auto& s : texts) t.add(s);
  return t.finish();
}

}  // namespace sigma::data
