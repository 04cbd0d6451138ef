// Byte-level BPE: round trips, control tokens, space runs, training, files.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "data/jsonl.h"
#include "data/tokenizer.h"

using namespace sigma;
using namespace sigma::data;
namespace fs = std::filesystem;

namespace {

const std::string kData = SIGMA_SOURCE_DIR "/../shared/data";

// Random text biased towards what pre-tokenisation cares about: spaces, newlines, digits,
// punctuation, multi-byte UTF-8 and broken fragments of it, control-token names.
std::string random_text(Rng& r, size_t n) {
  static const std::string atoms[] = {
      " ", "  ", "     ", "\n", "\t", "e", "th", "the", "ing", "7", "42", "(", ")", ":", "_x",
      "中", "文", "。", "“", "é", "\xe4\xb8", "\xff", "\x80", "\xf0\x9f\x98\x80", "<EOT>",
      "<Pad>", "\r\n", std::string(1, '\0'), std::string(40, ' '), std::string(70, '=')};
  std::string s;
  while (s.size() < n) {
    if (r.below(4) == 0) s.push_back(static_cast<char>(r.below(256)));
    else s += atoms[r.below(std::size(atoms))];
  }
  return s;
}

Tokenizer small_trained() {
  std::vector<std::string> texts;
  Rng r(11, 0);
  for (int i = 0; i < 300; ++i) texts.push_back(random_text(r, 200));
  texts.push_back("def main():\n    return the_thing  # the the the\n");
  TrainOptions opt;
  opt.vocab_size = 700;
  opt.controls = {"<mask>"};
  return Tokenizer::train(texts, opt);
}

using Ranks = std::map<std::pair<uint32_t, uint32_t>, uint32_t>;
Ranks ranks_of(const Tokenizer& t) {
  Ranks rank;
  auto merges = t.to_json()["merges"];
  uint32_t first = t.vocab_size() - t.n_merges();
  for (size_t m = 0; m < merges.size(); ++m)
    rank[{merges[m][0].get<uint32_t>(), merges[m][1].get<uint32_t>()}] = first + uint32_t(m);
  return rank;
}

// Reference BPE on one piece: repeatedly merge the lowest-ranked adjacent pair, leftmost first.
std::vector<uint32_t> naive_bpe(const Tokenizer& t, const Ranks& rank, std::string_view piece) {
  std::vector<uint32_t> ids;
  for (char c : piece) ids.push_back(t.byte_id(static_cast<uint8_t>(c)));
  for (;;) {
    uint32_t best = ~0u;
    for (size_t i = 0; i + 1 < ids.size(); ++i)
      if (auto it = rank.find({ids[i], ids[i + 1]}); it != rank.end()) best = std::min(best, it->second);
    if (best == ~0u) return ids;
    std::vector<uint32_t> next;
    for (size_t i = 0; i < ids.size();) {
      auto it = i + 1 < ids.size() ? rank.find({ids[i], ids[i + 1]}) : rank.end();
      if (it != rank.end() && it->second == best) {
        next.push_back(best);
        i += 2;
      } else {
        next.push_back(ids[i++]);
      }
    }
    ids = std::move(next);
  }
}

fs::path tmp_root() { return fs::temp_directory_path() / fmt::format("sigma_tok_{}", ::getpid()); }

struct RemoveTmp : ::testing::Environment {
  void TearDown() override { fs::remove_all(tmp_root()); }
};
const auto* const kRemoveTmp = ::testing::AddGlobalTestEnvironment(new RemoveTmp);

std::string tmp_path(const std::string& name) {
  fs::create_directories(tmp_root());
  return (tmp_root() / name).string();
}

void write_file(const std::string& path, const std::string& s) {
  std::ofstream(path, std::ios::binary) << s;
}

}  // namespace

TEST(Tokenizer, IdLayoutIsDocumented) {
  Tokenizer t({"<mask>"}, 16);
  EXPECT_EQ(t.id_of_control("<EOT>"), kEotId);
  EXPECT_EQ(t.id_of_control("<Pad>"), kPadId);
  EXPECT_EQ(t.id_of_control("<python>"), 7u);
  EXPECT_EQ(t.id_of_control("<mask>"), 8u);
  EXPECT_EQ(t.byte_id(0), 9u);
  EXPECT_EQ(t.space_run_id(2), 9u + 256);
  EXPECT_EQ(t.vocab_size(), 9u + 256 + 15);
  EXPECT_THROW(t.id_of_control("<nope>"), Error);
  EXPECT_THROW(t.space_run_id(17), Error);
  EXPECT_THROW(Tokenizer({"mask"}), Error);  // controls must look like <name>
}

TEST(Tokenizer, RandomBytesRoundTrip) {
  Tokenizer plain;
  Tokenizer trained = small_trained();
  ASSERT_GT(trained.n_merges(), 100u);
  Rng r(1, 2);
  for (int i = 0; i < 2000; ++i) {
    std::string s(r.below(300), '\0');
    for (auto& c : s) c = static_cast<char>(r.below(256));
    if (i % 2) s = random_text(r, r.below(400));
    for (const Tokenizer* t : {&plain, &trained}) {
      auto ids = t->encode(s);
      ASSERT_EQ(t->decode(ids), s) << "case " << i;
      for (uint32_t id : ids) ASSERT_FALSE(t->is_control(id)) << "control token from plain text";
    }
  }
}

TEST(Tokenizer, HeapBpeMatchesReferenceBpe) {
  Tokenizer t = small_trained();
  Ranks rank = ranks_of(t);
  Rng r(5, 5);
  std::vector<Piece> pieces;
  for (int i = 0; i < 300; ++i) {
    pieces.clear();
    std::string s = random_text(r, 300);
    pretokenize(s, t.max_space_run(), pieces);
    std::string joined;
    for (auto& p : pieces) {
      joined += p.text;
      if (p.space_run) continue;
      ASSERT_EQ(t.encode(p.text), naive_bpe(t, rank, p.text)) << "piece '" << p.text << "'";
    }
    ASSERT_EQ(joined, s);  // pieces tile the text
  }
}

TEST(Tokenizer, ControlTokensAreNeverProducedFromText) {
  Tokenizer t = small_trained();
  for (std::string s : {"<EOT>", "<Pad><EN><CN>", "x<Python>y", "<mask>"}) {
    auto ids = t.encode(s);
    EXPECT_GT(ids.size(), 1u);
    for (uint32_t id : ids) EXPECT_FALSE(t.is_control(id)) << s;
    EXPECT_EQ(t.decode(ids), s);
  }
  // The explicit API is the only way in; controls decode to their names.
  std::vector<uint32_t> ids = {t.id_of_control("<EN>")};
  t.encode_append("hi", ids);
  ids.push_back(t.id_of_control("<EOT>"));
  EXPECT_EQ(t.decode(ids), "<EN>hi<EOT>");
  EXPECT_THROW(t.decode(std::vector<uint32_t>{t.vocab_size()}), Error);
}

TEST(Tokenizer, SpaceRunsAreSingleTokens) {
  Tokenizer t;
  auto ids = t.encode("        return x");
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids[0], t.space_run_id(8));
  for (uint32_t n = 2; n <= 16; ++n)
    EXPECT_EQ(t.encode(std::string(n, ' ')), std::vector<uint32_t>{t.space_run_id(n)}) << n;
  // Longer runs split into maximal runs; a single space stays a byte.
  EXPECT_EQ(t.encode(std::string(35, ' ')),
            (std::vector<uint32_t>{t.space_run_id(16), t.space_run_id(16), t.space_run_id(3)}));
  EXPECT_EQ(t.encode(" "), std::vector<uint32_t>{t.byte_id(' ')});
}

TEST(Tokenizer, TrainingIsDeterministicAndCompresses) {
  Tokenizer a = small_trained(), b = small_trained();
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_LE(a.vocab_size(), 700u);  // stops early once no pair occurs twice
  TrainOptions opt;
  opt.vocab_size = 400;
  Tokenizer c = Tokenizer::train(std::vector<std::string>(3, "the cat sat on the mat; 1234"), opt);
  EXPECT_EQ(c.vocab_size(), 279u + c.n_merges());
  EXPECT_EQ(c.decode(c.encode(" the cat")), " the cat");
  EXPECT_EQ(c.encode(" the cat").size(), 2u);  // " the", " cat" are learned words
  EXPECT_NE(a.hash(), Tokenizer().hash());
  std::string s = "def main():\n    return the_thing  # the the the\n";
  EXPECT_LT(a.encode(s).size(), Tokenizer().encode(s).size());
  EXPECT_EQ(a.id_of_control("<mask>"), 8u);
  TrainOptions tiny;
  tiny.vocab_size = 100;  // below the fixed tokens
  EXPECT_THROW(Tokenizer::train(std::vector<std::string>{"x"}, tiny), Error);
}

// Reference trainer: recount every pair after every merge; pick the most frequent pair, ties to
// the smaller (left, right). The incremental trainer must learn exactly the same merges.
TEST(Tokenizer, IncrementalTrainerMatchesRecountingTrainer) {
  std::vector<std::string> texts;
  Rng r(21, 1);
  for (int i = 0; i < 60; ++i) texts.push_back(random_text(r, 120));
  texts.push_back("aaaa aaaaa abab ababab abba banana bananas 中文中文中文");
  TrainOptions opt{.vocab_size = 420};
  Tokenizer fast = Tokenizer::train(texts, opt);
  Tokenizer base;
  std::map<std::string, int64_t> words;
  std::vector<Piece> pieces;
  for (auto& t : texts) {
    pieces.clear();
    pretokenize(t, opt.max_space_run, pieces);
    for (auto& p : pieces)
      if (!p.space_run && p.text.size() >= 2) words[std::string(p.text)]++;
  }
  std::vector<std::pair<std::vector<uint32_t>, int64_t>> syms;
  for (auto& [w, c] : words) {
    syms.emplace_back();
    for (char ch : w) syms.back().first.push_back(base.byte_id(static_cast<uint8_t>(ch)));
    syms.back().second = c;
  }
  nlohmann::json expect = nlohmann::json::array();
  for (uint32_t z = base.vocab_size(); z < opt.vocab_size; ++z) {
    std::map<std::pair<uint32_t, uint32_t>, int64_t> count;
    for (auto& [s, c] : syms)
      for (size_t i = 0; i + 1 < s.size(); ++i) count[{s[i], s[i + 1]}] += c;
    std::pair<uint32_t, uint32_t> best{};
    int64_t best_c = 0;
    for (auto& [p, c] : count)  // map order = ascending pair, so '>' keeps the smallest on ties
      if (c > best_c) best = p, best_c = c;
    if (best_c < 2) break;
    expect.push_back({best.first, best.second});
    for (auto& [s, c] : syms) {
      std::vector<uint32_t> out;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second) out.push_back(z), i += 2;
        else out.push_back(s[i++]);
      }
      s = std::move(out);
    }
  }
  ASSERT_GT(expect.size(), 50u);
  EXPECT_EQ(fast.to_json()["merges"], expect);
}

TEST(Tokenizer, SaveLoadKeepsEverything) {
  Tokenizer a = small_trained();
  std::string path = tmp_path("tok.json");
  a.save(path);
  Tokenizer b = Tokenizer::load(path);
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_EQ(a.vocab_size(), b.vocab_size());
  EXPECT_EQ(a.controls(), b.controls());
  Rng r(3, 3);
  for (int i = 0; i < 50; ++i) {
    std::string s = random_text(r, 500);
    EXPECT_EQ(a.encode(s), b.encode(s));
  }
  for (uint32_t id = 0; id < a.vocab_size(); ++id) ASSERT_EQ(a.token_bytes(id), b.token_bytes(id));
}

TEST(Tokenizer, MalformedFilesFailNamingTheFile) {
  Tokenizer a = small_trained();
  nlohmann::json good = a.to_json();
  auto expect_fail = [&](const std::string& content, const std::string& needle) {
    std::string path = tmp_path("bad.json");
    write_file(path, content);
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << "loaded a malformed file: " << needle;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
  };
  auto edited = [&](auto fn) {
    nlohmann::json j = good;
    fn(j);
    return j.dump();
  };
  expect_fail("{not json", "not valid JSON");
  expect_fail("", "not valid JSON");
  expect_fail(edited([](auto& j) { j["format"] = "gpt2"; }), "format");
  expect_fail(edited([](auto& j) { j["version"] = 2; }), "version");
  expect_fail(edited([](auto& j) { j.erase("merges"); }), "\"merges\"");
  expect_fail(edited([](auto& j) { j["merges"][3] = {1, 2, 3}; }), "\"merges\"[3]");
  expect_fail(edited([](auto& j) { j["merges"][0] = {100000, 12}; }), "merge #0");
  expect_fail(edited([](auto& j) { j["merges"][0] = {0, 12}; }), "control");  // <EOT> in a merge
  expect_fail(edited([](auto& j) { j["merges"][5] = j["merges"][4]; }), "twice");
  expect_fail(edited([](auto& j) { j["controls"][0] = "<BOS>"; }), "controls");
  expect_fail(edited([](auto& j) { j["controls"].push_back("<Pad>"); }), "twice");
  expect_fail(edited([](auto& j) { j["max_space_run"] = 0; }), "max_space_run");
  expect_fail(edited([](auto& j) { j["hash"] = "0000000000000000"; }), "hash");
  expect_fail(edited([](auto& j) { j["vocab_size"] = 5; }), "vocab_size");
  EXPECT_THROW(Tokenizer::load(tmp_path("missing.json")), Error);
}

// Bounded-time randomized fuzzing of the round trip, on a trained and an untrained tokenizer.
TEST(Tokenizer, FuzzRoundTripForAFixedTime) {
  Tokenizer t = small_trained();
  Tokenizer plain({}, 3);
  Rng r(77, 0);
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  int cases = 0;
  while (std::chrono::steady_clock::now() < until) {
    std::string s = random_text(r, r.below(2000));
    // Mutations: splice random bytes, cut at a random point (splits UTF-8 characters).
    for (uint32_t k = r.below(4); k > 0; --k)
      if (!s.empty()) s[r.below(static_cast<uint32_t>(s.size()))] = static_cast<char>(r.below(256));
    if (r.below(2) && !s.empty()) s.resize(r.below(static_cast<uint32_t>(s.size())));
    ASSERT_EQ(t.decode(t.encode(s)), s) << "case " << cases;
    ASSERT_EQ(plain.decode(plain.encode(s)), s) << "case " << cases;
    ++cases;
  }
  EXPECT_GT(cases, 100);
}

// Every record of ../shared/data encodes and decodes back exactly.
TEST(Tokenizer, WholeCorpusRoundTrip) {
  if (!fs::exists(kData + "/corpus")) GTEST_SKIP() << "no corpus at " << kData;
  auto sources = expand_corpus({kData + "/corpus"});
  std::vector<std::string> texts;
  ReadStats stats;
  read_corpus(sources, {}, stats, [&](Record& r) { texts.push_back(std::move(r.text)); });
  ASSERT_EQ(stats.skipped(), 0u) << stats.summary();
  ASSERT_GT(texts.size(), 40000u);
  // Train on every 20th record (fast) so real merges, including CJK ones, are exercised.
  BpeTrainer trainer({.vocab_size = 4096});
  for (size_t i = 0; i < texts.size(); i += 20) trainer.add(texts[i]);
  Tokenizer t = trainer.finish();
  size_t bytes = 0, tokens = 0;
  for (auto& s : texts) {
    auto ids = t.encode(s);
    ASSERT_EQ(t.decode(ids), s);
    bytes += s.size();
    tokens += ids.size();
  }
  EXPECT_GT(static_cast<double>(bytes) / tokens, 2.0);
}
