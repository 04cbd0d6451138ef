// Corpus -> shards -> batches: reader skips, formatting, shard validation, window packing,
// fine-tuning rows, sampler determinism and resume, prepare's reuse of finished shards.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "data/jsonl.h"
#include "data/prepare.h"
#include "data/sampler.h"
#include "data/shards.h"
#include "data/tokenizer.h"
#include "data/windows.h"
#include "model/domains.h"

using namespace sigma;
using namespace sigma::data;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kData = SIGMA_SOURCE_DIR "/../shared/data";

// A fresh folder per test under the system temp dir, removed when the test program ends.
fs::path scratch_root() { return fs::temp_directory_path() / fmt::format("sigma_data_{}", ::getpid()); }

struct RemoveScratch : ::testing::Environment {
  void TearDown() override { fs::remove_all(scratch_root()); }
};
const auto* const kRemoveScratch = ::testing::AddGlobalTestEnvironment(new RemoveScratch);

std::string scratch(const std::string& name) {
  auto dir = scratch_root() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void write_file(const std::string& path, const std::string& s) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << s;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

DomainRegistry registry(const std::string& text) {
  return DomainRegistry::from_json(json::parse(text), "cfg", DomainForm::Data);
}

// A shard written from explicit samples, for window and reader tests.
std::string make_shard(const std::string& dir, const std::vector<std::vector<uint32_t>>& samples,
                       uint32_t vocab = 1000, uint64_t tok_hash = 42, std::vector<uint32_t> prompt = {}) {
  DomainSpec d("toy", "toy", 0);
  d.id = 3;
  std::string path = dir + "/toy.shard";
  ShardWriter w(path, d, vocab, tok_hash, 7);
  for (size_t i = 0; i < samples.size(); ++i) w.add(samples[i], prompt.empty() ? 0 : prompt[i]);
  w.finish();
  w.commit();
  return path;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Domains and configs

TEST(Domains, ParsesWithDefaultsAndNamesTheKeyOnError) {
  auto r = registry(R"([{"name": "english"}, {"name": "python", "group": "code", "slot": 5,
                         "prefix": ["<Python>"]}, {"name": "bi", "id": 9, "format": "bilingual"}])");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r.at("english").id, 0u);
  EXPECT_EQ(r.at("english").group, "english");
  EXPECT_EQ(r.at("python").slot, 5);
  EXPECT_EQ(r.at("python").prefix, std::vector<std::string>{"<Python>"});
  EXPECT_EQ(r.at("bi").id, 9u);
  EXPECT_EQ(r.at("bi").slot, 9);
  EXPECT_EQ(r.at("bi").format, SampleFormat::Bilingual);
  EXPECT_EQ(DomainRegistry::from_json(r.to_json(DomainForm::Data), "x", DomainForm::Data)
                .to_json(DomainForm::Data),
            r.to_json(DomainForm::Data));
  EXPECT_THROW(r.at("klingon"), Error);
  auto err = [](const char* text) { return error_of([&] { registry(text); }); };
  EXPECT_NE(err(R"([{"name": "a", "slot": -1}])").find("cfg[0].slot"), std::string::npos);
  EXPECT_NE(err(R"([{"name": "a"}, {"name": "a"}])").find("cfg[1].name"), std::string::npos);
  EXPECT_NE(err(R"([{"name": "a", "colour": 1}])").find("\"colour\""), std::string::npos);
  EXPECT_NE(err(R"([{"name": "a", "format": "poem"}])").find("cfg[0].format"), std::string::npos);
  EXPECT_NE(err(R"([{"name": "a", "prefix": [1]}])").find("cfg[0].prefix"), std::string::npos);
  EXPECT_NE(err(R"([{"name": "a/b"}])").find("file name"), std::string::npos);
  EXPECT_NE(err(R"([{"name": "a", "id": 1}, {"name": "b", "id": 1}])").find("already used"), std::string::npos);
  EXPECT_NE(err(R"({})").find("non-empty array"), std::string::npos);
}

TEST(PrepareConfig, ValidatesKeysAndResolvesPaths) {
  auto cfg = PrepareConfig::from_json(
      json::parse(R"({"tokenizer": "tok.json", "corpus": ["c", "/abs"], "domains": [{"name": "x"}]})"),
      "/base", "data.json");
  EXPECT_EQ(cfg.tokenizer, "/base/tok.json");
  EXPECT_EQ(cfg.corpus, (std::vector<std::string>{"/base/c", "/abs"}));
  auto err = [](const char* text) {
    return error_of([&] { PrepareConfig::from_json(json::parse(text), "/b", "data.json"); });
  };
  EXPECT_NE(err(R"({"corpus": "c", "domains": [{"name": "x"}]})").find("\"tokenizer\""), std::string::npos);
  EXPECT_NE(err(R"({"tokenizer": "t", "corpus": 3, "domains": [{"name": "x"}]})").find("\"corpus\""),
            std::string::npos);
  EXPECT_NE(err(R"({"tokenizer": "t", "corpus": "c"})").find("\"domains\""), std::string::npos);
  EXPECT_NE(err(R"({"tokenizer": "t", "corpus": "c", "domains": [{"name": "x"}], "shards": 1})")
                .find("\"shards\""), std::string::npos);
  EXPECT_NE(err(R"({"tokenizer": "t", "corpus": "c", "domains": [{"name": "x", "slot": "a"}]})")
                .find("data.json: domains[0].slot"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// JSONL reader

TEST(Jsonl, LineReaderMatchesGetlineAcrossBufferBoundaries) {
  std::string dir = scratch("lines");
  Rng r(4, 4);
  std::string content;
  std::vector<std::string> expect;
  for (int i = 0; i < 40; ++i) {
    std::string line(r.below(4) == 0 ? r.below(3u << 20) : r.below(100), 'a' + i % 26);
    expect.push_back(line);
    content += line + "\n";
  }
  content += "last line without newline";
  expect.push_back("last line without newline");
  write_file(dir + "/f.jsonl", content);
  LineReader lr(dir + "/f.jsonl", 8u << 20);
  std::string line;
  bool too_long;
  size_t i = 0;
  while (lr.next(line, too_long)) {
    ASSERT_LT(i, expect.size());
    ASSERT_FALSE(too_long);
    ASSERT_EQ(line, expect[i]) << "line " << i;
    ++i;
  }
  EXPECT_EQ(i, expect.size());
}

TEST(Jsonl, BadRecordsAreCountedSkipsNamingFileAndLine) {
  std::string dir = scratch("bad");
  std::string f = dir + "/mixed.jsonl";
  write_file(f, std::string(R"({"text": "good one", "domain": "en"})") + "\n" +  // 1
                    "{not json\n" +                                                // 2
                    "{\"text\": \"bad \xff utf8\", \"domain\": \"en\"}\n" +        // 3
                    R"({"domain": "en"})" + "\n" +                                 // 4
                    R"({"text": "x", "domain": "klingon"})" + "\n" +               // 5
                    "\n" +                                                         // 6 blank
                    R"({"text": "", "domain": "en"})" + "\n" +                     // 7
                    R"({"text": "no domain"})" + "\n" +                            // 8
                    R"({"text": 5, "domain": "en"})" + "\n" +                      // 9
                    R"({"text": "with prompt", "prompt": "Q: ", "domain": "en"})" + "\n" +  // 10
                    R"({"answer": " A", "prompt": "Q:", "domain": "en"})" + "\n" +  // 11: a pair
                    R"({"answer": 3, "prompt": "Q:", "domain": "en"})");             // 12
  ReadOptions opt;
  opt.domains = {"en"};
  ReadStats st;
  std::vector<Record> got;
  read_corpus(expand_corpus({f}), opt, st, [&](Record& r) { got.push_back(r); });
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].text, "good one");
  EXPECT_EQ(got[0].line, 1u);
  EXPECT_EQ(got[1].prompt, "Q: ");
  EXPECT_EQ(got[1].line, 10u);
  EXPECT_EQ(got[2].prompt, "Q:");
  EXPECT_EQ(got[2].text, " A");
  EXPECT_EQ(st.records, 3u);
  EXPECT_EQ(st.bad_json, 1u);
  EXPECT_EQ(st.bad_utf8, 1u);
  EXPECT_EQ(st.no_text, 4u);     // missing, empty, not a string (text or answer)
  EXPECT_EQ(st.bad_domain, 2u);  // undeclared, absent
  EXPECT_EQ(st.skipped(), 8u);
  std::string all;
  for (auto& m : st.messages) all += m + "\n";
  for (int line : {2, 3, 4, 5, 7, 8, 9, 12})
    EXPECT_NE(all.find(fmt::format("{}:{}:", f, line)), std::string::npos) << all;
  EXPECT_NE(all.find("klingon"), std::string::npos);
}

TEST(Jsonl, HundredMegabyteLineIsSkippedNotStored) {
  std::string dir = scratch("huge");
  std::string f = dir + "/big.jsonl";
  {
    std::ofstream o(f, std::ios::binary);
    o << R"({"text": "before", "domain": "d"})" << "\n" << R"({"text": ")";
    std::string chunk(1 << 20, 'x');
    for (int i = 0; i < 100; ++i) o << chunk;
    o << R"(", "domain": "d"})" << "\n" << R"({"text": "after", "domain": "d"})" << "\n";
  }
  ReadOptions opt;  // default cap (64 MB) is below the line
  ReadStats st;
  std::vector<std::string> texts;
  read_corpus(expand_corpus({f}), opt, st, [&](Record& r) { texts.push_back(r.text); });
  ASSERT_EQ(texts.size(), 2u);  // (sizes first: a failure must not print 100 MB)
  EXPECT_EQ(texts[0], "before");
  ASSERT_EQ(texts[1].size(), 5u);
  EXPECT_EQ(texts[1], "after");
  EXPECT_EQ(st.too_long, 1u);
  ASSERT_FALSE(st.messages.empty());
  EXPECT_NE(st.messages[0].find(f + ":2:"), std::string::npos) << st.messages[0];
  fs::remove_all(dir);
}

TEST(Jsonl, BrokenInputThrowsAndEmptyFilesAreCounted) {
  std::string dir = scratch("broken");
  write_file(dir + "/bin.jsonl", std::string("\x7f" "ELF\x01\x02\x00\x00 garbage\n\x00\x01\n", 20));
  ReadStats st;
  std::string err = error_of([&] { read_corpus(expand_corpus({dir + "/bin.jsonl"}), {}, st, [](Record&) {}); });
  EXPECT_NE(err.find(dir + "/bin.jsonl"), std::string::npos) << err;
  EXPECT_NE(err.find("no usable record"), std::string::npos) << err;
  write_file(dir + "/empty.jsonl", "");
  ReadStats st2;
  read_corpus(expand_corpus({dir + "/empty.jsonl"}), {}, st2, [](Record&) {});
  EXPECT_EQ(st2.empty_files, 1u);
  EXPECT_THROW(expand_corpus({dir + "/nope"}), Error);
  EXPECT_THROW(expand_corpus({scratch("emptydir")}), Error);
}

TEST(Jsonl, FolderPerDomainAndTxtFiles) {
  std::string dir = scratch("folders");
  write_file(dir + "/corpus/english/a.jsonl", R"({"text": "hello"})" "\n");
  write_file(dir + "/corpus/english/sub/b.txt", "a whole\nfile");
  write_file(dir + "/corpus/python/x.txt", "print(1)\n");
  write_file(dir + "/corpus/python/bad.txt", "bad \xc3\x28 utf8");
  write_file(dir + "/corpus/python/README.md", "ignored");
  write_file(dir + "/corpus/mixed.jsonl", R"({"text": "m", "domain": "python"})" "\n");
  auto src = expand_corpus({dir + "/corpus"});
  ASSERT_EQ(src.size(), 5u);
  EXPECT_EQ(src[0].domain, "");  // files beside the domain folders: records name their domain
  std::map<std::string, std::vector<std::string>> by;
  ReadStats st;
  read_corpus(src, {}, st, [&](Record& r) { by[r.domain].push_back(r.text); });
  EXPECT_EQ(by["english"], (std::vector<std::string>{"hello", "a whole\nfile"}));
  EXPECT_EQ(by["python"], (std::vector<std::string>{"m", "print(1)\n"}));
  EXPECT_EQ(st.bad_utf8, 1u);
  // A folder of files is one domain named after the folder.
  auto one = expand_corpus({dir + "/corpus/python/"});
  ASSERT_EQ(one.size(), 2u);
  EXPECT_EQ(one[0].domain, "python");
  // Undeclared domain folders are skipped whole, with one message.
  ReadOptions opt;
  opt.domains = {"english"};
  ReadStats st3;
  size_t n = 0;
  read_corpus(src, opt, st3, [&](Record&) { ++n; });
  EXPECT_EQ(n, 2u);
  EXPECT_EQ(st3.bad_domain, 3u);  // mixed.jsonl's python record + the two python files
}

// Random mutations of valid JSONL never crash the reader: records + skips account for every
// non-blank line, or the file is rejected with sigma::Error.
TEST(Jsonl, FuzzReaderForAFixedTime) {
  std::string dir = scratch("fuzz");
  std::string f = dir + "/f.jsonl";
  Rng r(9, 9);
  const std::string good[] = {R"({"text": "hello", "domain": "a"})", R"({"text": "中文\n", "domain": "b"})",
                              R"({"text": "x", "prompt": "p", "domain": "a"})"};
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  int cases = 0, rejected = 0;
  // At least 60 cases however loaded the machine (a busy one ran 28 in the 1.5 s).
  while (cases < 60 || std::chrono::steady_clock::now() < until) {
    std::string s;
    for (uint32_t i = r.below(30); i > 0; --i) s += good[r.below(3)] + (r.below(8) ? "\n" : "");
    for (uint32_t k = r.below(6); k > 0 && !s.empty(); --k) {
      uint32_t at = r.below(static_cast<uint32_t>(s.size()));
      switch (r.below(3)) {
        case 0: s[at] = static_cast<char>(r.below(256)); break;
        case 1: s.erase(at, r.below(10)); break;
        default: s.insert(at, std::string(r.below(5), static_cast<char>(r.below(256))));
      }
    }
    write_file(f, s);
    ReadOptions opt;
    opt.max_line_bytes = 64 + r.below(64);
    opt.domains = {"a", "b"};
    ReadStats st;
    try {
      read_corpus(expand_corpus({f}), opt, st, [](Record& rec) { ASSERT_FALSE(rec.text.empty()); });
      uint64_t nonblank = 0;
      std::istringstream in(s);
      for (std::string line; std::getline(in, line);)
        nonblank += line.find_first_not_of(" \t\r") != std::string::npos;
      ASSERT_EQ(st.records + st.skipped(), nonblank) << s;
    } catch (const Error&) {
      ++rejected;
    }
    ++cases;
  }
  EXPECT_GT(cases, 50);
  EXPECT_LT(rejected, cases);
}

// ---------------------------------------------------------------------------------------------
// Formatting

TEST(Format, PrefixesEotAndBilingualTags) {
  Tokenizer tok;
  auto reg = registry(R"([{"name": "py", "prefix": ["<Python>"]}, {"name": "bi", "format": "bilingual"}])");
  std::vector<uint32_t> out;
  uint32_t plen = format_sample(tok, reg.at("py"), "", "x = 1\n", out);
  EXPECT_EQ(plen, 1u);
  EXPECT_EQ(out.front(), tok.id_of_control("<Python>"));
  EXPECT_EQ(out.back(), kEotId);
  EXPECT_EQ(tok.decode(out), "<Python>x = 1\n<EOT>");
  format_sample(tok, reg.at("bi"), "", "Hi, Tom.\n嗨，汤姆。", out);
  EXPECT_EQ(tok.decode(out), "<EN>Hi, Tom.<CN>嗨，汤姆。<EOT>");
  format_sample(tok, reg.at("bi"), "", "我叫Tom。\nMy name is Tom.", out);
  EXPECT_EQ(tok.decode(out), "<CN>我叫Tom。<EN>My name is Tom.<EOT>");
  plen = format_sample(tok, reg.at("py"), "Q? ", "A", out);
  EXPECT_EQ(tok.decode(std::span(out).first(plen)), "<Python>Q? ");
  // A translation pair: the prompt is tagged too, and the answer starts at its tag.
  plen = format_sample(tok, reg.at("bi"), "Good morning.", "早上好。", out);
  EXPECT_EQ(tok.decode(out), "<EN>Good morning.<CN>早上好。<EOT>");
  EXPECT_EQ(tok.decode(std::span(out).first(plen)), "<EN>Good morning.");
  EXPECT_FALSE(looks_chinese("I love 中国"));
  EXPECT_TRUE(looks_chinese("你好"));
  EXPECT_FALSE(looks_chinese("。！"));
}

// ---------------------------------------------------------------------------------------------
// Shards

TEST(Shards, RoundTripBothTokenWidths) {
  std::string dir = scratch("shards");
  std::vector<std::vector<uint32_t>> samples = {{1, 2, 3}, {}, {999, 0}};
  for (uint32_t vocab : {1000u, 70000u}) {
    if (vocab > 65536) samples[2][0] = 69999;
    auto s = Shard::open(make_shard(dir, samples, vocab, 42, {1, 0, 2}), 42);
    EXPECT_EQ(s->header().token_bytes, vocab > 65536 ? 4u : 2u);
    EXPECT_EQ(s->n_tokens(), 5u);
    EXPECT_EQ(s->n_samples(), 3u);
    EXPECT_EQ(s->domain(), "toy");
    EXPECT_EQ(s->domain_id(), 3u);
    EXPECT_EQ(s->sample_begin(2), 3u);
    EXPECT_EQ(s->sample_end(2), 5u);
    EXPECT_EQ(s->prompt_len(0), 1u);
    EXPECT_EQ(s->token(3), samples[2][0]);
    std::vector<int32_t> out(5);
    s->read(0, 5, out.data());
    EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 3, int32_t(samples[2][0]), 0}));
    EXPECT_THROW(s->read(3, 3, out.data()), Error);
  }
}

// The shard bytes with the header's body checksum recomputed (a forgery, or a bug in prepare).
std::string with_body_checksum(std::string b) {
  ShardHeader h;
  std::memcpy(&h, b.data(), sizeof h);
  h.checksum = shard_checksum(h, XXH3_64bits(b.data() + sizeof(ShardHeader), b.size() - sizeof(ShardHeader)));
  std::memcpy(b.data(), &h, sizeof h);
  return b;
}

TEST(Shards, TruncatedForeignAndOtherTokenizerShardsAreRejected) {
  std::string dir = scratch("badshards");
  std::string path = make_shard(dir, {{1, 2, 3, 4, 5}, {6, 7}});
  std::string bytes = read_file(path);
  auto expect = [&](const std::string& content, const std::string& needle, uint64_t hash = 42) {
    std::string p = dir + "/x.shard";
    write_file(p, content);
    std::string e = error_of([&] { Shard::open(p, hash); });
    EXPECT_NE(e.find(p), std::string::npos) << e;
    EXPECT_NE(e.find(needle), std::string::npos) << e;
  };
  expect(bytes.substr(0, bytes.size() - 4), "truncated");
  expect(bytes.substr(0, 100), "truncated");
  expect("", "truncated");
  expect(std::string(4096, 'z'), "bad magic");
  expect(bytes, "made by tokenizer 000000000000002a", 43);
  std::string v = bytes;
  v[8] = 9;  // version
  expect(v, "version 9");
  std::string idx = bytes;
  idx[128 + 16 + 8] = 9;  // offsets[1] = 9 > n_tokens: the index no longer tiles the tokens
  expect(idx, "corrupted");  // the body checksum sees it first
  expect(with_body_checksum(idx), "decreases");  // and a forged checksum meets the index check
  std::string tok = bytes;
  tok[128] = char(0xFF), tok[129] = char(0xFF);  // token 65535 >= vocab 1000
  expect(tok, "corrupted");
  expect(with_body_checksum(tok), "outside the vocabulary");
  EXPECT_NO_THROW(Shard::open(path, 0));  // 0 = do not check the tokenizer
}

// ---------------------------------------------------------------------------------------------
// Windows and rows

TEST(Windows, PackingLosesAndDuplicatesNoToken) {
  std::string dir = scratch("windows");
  // Token value = its position (mod vocab), so positions can be recovered from targets.
  std::vector<std::vector<uint32_t>> samples;
  uint32_t pos = 0;
  Rng r(2, 2);
  for (int i = 0; i < 50; ++i) {
    samples.emplace_back();
    for (uint32_t k = r.below(40); k > 0; --k) samples.back().push_back(pos++);
  }
  auto s = Shard::open(make_shard(dir, samples, 70000), 0);
  ASSERT_EQ(s->n_tokens(), pos);
  for (uint32_t T : {1u, 7u, 64u, pos - 1, pos, pos + 5}) {
    uint64_t W = window_count(pos, T);
    std::vector<int> seen_target(pos, 0);
    std::vector<int32_t> in(T), tgt(T);
    std::vector<float> mask(T);
    for (uint64_t w = 0; w < W; ++w) {
      fill_window(*s, w, T, in.data(), tgt.data(), mask.data());
      for (uint32_t j = 0; j < T; ++j) {
        ASSERT_EQ(in[j], int32_t(w * T + j));
        ASSERT_EQ(tgt[j], in[j] + 1);  // targets are the next token
        ASSERT_EQ(mask[j], 1.0f);
        seen_target[tgt[j]]++;
      }
    }
    uint64_t counted = 0;
    for (uint32_t p = 0; p < pos; ++p) {
      ASSERT_LE(seen_target[p], 1) << "token " << p << " is a target twice, T=" << T;
      counted += seen_target[p];
    }
    EXPECT_EQ(counted, W * T);
    EXPECT_EQ(counted + tail_tokens(pos, T) + 1, pos) << "T=" << T;  // + the first token
    EXPECT_THROW(fill_window(*s, W, T, in.data(), tgt.data(), mask.data()), Error);
  }
}

TEST(Windows, FineTuningRowsPadTruncateAndMask) {
  const uint32_t T = 6;
  std::vector<int32_t> in(T), tgt(T);
  std::vector<float> mask(T);
  std::vector<int32_t> sample = {50, 51, 52, 53, 0};  // prompt = first 2 tokens, then <EOT>=0
  fill_row(sample, 2, T, false, in.data(), tgt.data(), mask.data());
  EXPECT_EQ(in, (std::vector<int32_t>{50, 51, 52, 53, 0, 1}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{51, 52, 53, 0, 1, 1}));
  EXPECT_EQ(mask, (std::vector<float>{1, 1, 1, 1, 0, 0}));
  fill_row(sample, 2, T, true, in.data(), tgt.data(), mask.data());
  EXPECT_EQ(mask, (std::vector<float>{0, 1, 1, 1, 0, 0}));  // target 51 is prompt
  std::vector<int32_t> longer = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  fill_row(longer, 0, T, true, in.data(), tgt.data(), mask.data());
  EXPECT_EQ(in, (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(mask, std::vector<float>(T, 1.0f));
}

// ---------------------------------------------------------------------------------------------
// Sampler

namespace {
SamplerConfig staged(uint64_t seed) {
  return SamplerConfig::from_json(json::parse(fmt::format(
      R"({{"seed": {}, "stages": [{{"steps": 20, "weights": {{"a": 3, "b": 1}}}}, {{}}]}})", seed)), "s");
}
std::vector<Sampler::Pick> run(Sampler& s, int steps, uint32_t B) {
  std::vector<Sampler::Pick> all, b;
  for (int i = 0; i < steps; ++i) {
    s.next_batch(B, b);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}
bool same(const std::vector<Sampler::Pick>& x, const std::vector<Sampler::Pick>& y) {
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i].domain != y[i].domain || x[i].item != y[i].item) return false;
  return true;
}
const std::vector<std::string> kNames = {"a", "b", "c"};
const std::vector<uint64_t> kItems = {7, 13, 5}, kTokens = {100, 100, 800};
}  // namespace

TEST(Sampler, DeterministicStagedAndEpochsCoverEveryItem) {
  Sampler s1(staged(5), kNames, kItems, kTokens), s2(staged(5), kNames, kItems, kTokens),
      s3(staged(6), kNames, kItems, kTokens);
  auto p1 = run(s1, 60, 8), p2 = run(s2, 60, 8), p3 = run(s3, 60, 8);
  EXPECT_TRUE(same(p1, p2));
  EXPECT_FALSE(same(p1, p3));
  // Stage 1 (steps 0..19) only draws a and b, about 3:1; stage 2 weights by tokens (c = 80 %).
  int stage1[3] = {}, stage2[3] = {};
  for (size_t i = 0; i < p1.size(); ++i) (i < 20 * 8 ? stage1 : stage2)[p1[i].domain]++;
  EXPECT_EQ(stage1[2], 0);
  EXPECT_NEAR(stage1[0] / 160.0, 0.75, 0.1);
  EXPECT_NEAR(stage2[2] / 320.0, 0.8, 0.07);
  EXPECT_EQ(s1.stage_at(19), 0u);
  EXPECT_EQ(s1.stage_at(20), 1u);
  // Within a domain, each epoch is a permutation of all its items.
  std::vector<uint64_t> a_items;
  for (auto& p : p1)
    if (p.domain == 0) a_items.push_back(p.item);
  ASSERT_GE(a_items.size(), 14u);
  for (size_t e = 0; e + 7 <= a_items.size(); e += 7) {
    std::set<uint64_t> epoch(a_items.begin() + e, a_items.begin() + e + 7);
    EXPECT_EQ(epoch.size(), 7u) << "epoch " << e / 7;
  }
  // ...and each epoch is shuffled afresh.
  std::vector<uint64_t> b_items;
  for (auto& p : p1)
    if (p.domain == 1) b_items.push_back(p.item);
  ASSERT_GE(b_items.size(), 26u);
  EXPECT_FALSE(std::equal(b_items.begin(), b_items.begin() + 13, b_items.begin() + 13));
}

TEST(Sampler, ResumeFromCursorContinuesExactly) {
  for (int cut : {0, 1, 13, 20, 33}) {
    Sampler full(staged(8), kNames, kItems, kTokens);
    auto expect = run(full, 50, 4);
    Sampler first(staged(8), kNames, kItems, kTokens);
    auto head = run(first, cut, 4);
    std::string saved = first.cursor().dump();  // through text, as a checkpoint would
    Sampler resumed(staged(8), kNames, kItems, kTokens);
    resumed.restore(json::parse(saved));
    EXPECT_EQ(resumed.step(), uint64_t(cut));
    auto tail = run(resumed, 50 - cut, 4);
    head.insert(head.end(), tail.begin(), tail.end());
    EXPECT_TRUE(same(head, expect)) << "cut at step " << cut;
  }
  Sampler s(staged(8), kNames, kItems, kTokens);
  json c = s.cursor();
  Sampler other_seed(staged(9), kNames, kItems, kTokens);
  EXPECT_THROW(other_seed.restore(c), Error);
  Sampler other_data(staged(8), kNames, {7, 14, 5}, kTokens);
  EXPECT_NE(error_of([&] { other_data.restore(c); }).find("domain 'b'"), std::string::npos);
  EXPECT_THROW(s.restore(json::parse(R"({"step": 1})")), Error);
}

// one_domain_per_batch: every batch from one domain, drawn with the stage's weights (c = 80 %
// by tokens), still deterministic and resumable; the default mixes domains within a batch.
TEST(Sampler, OneDomainPerBatch) {
  auto cfg = [](bool one) {
    return SamplerConfig::from_json(json{{"seed", 3u}, {"one_domain_per_batch", one}}, "sampler");
  };
  Sampler one(cfg(true), kNames, kItems, kTokens), mixed(cfg(false), kNames, kItems, kTokens);
  int per_domain[3] = {}, mixed_batches = 0;
  for (int b = 0; b < 400; ++b) {
    std::vector<Sampler::Pick> p, q;
    one.next_batch(8, p);
    mixed.next_batch(8, q);
    for (const auto& x : p) EXPECT_EQ(x.domain, p[0].domain) << "batch " << b;
    per_domain[p[0].domain]++;
    for (const auto& x : q) mixed_batches += x.domain != q[0].domain;
  }
  EXPECT_NEAR(per_domain[2] / 400.0, 0.8, 0.06);
  EXPECT_GT(per_domain[0], 0);
  EXPECT_GT(mixed_batches, 100);
  EXPECT_TRUE(SamplerConfig::from_json(cfg(true).to_json(), "s").one_domain_per_batch);  // round trip
  EXPECT_NE(error_of([] { SamplerConfig::from_json(json{{"one_domain_per_batch", 1}}, "sampler"); })
                .find("sampler.one_domain_per_batch"),
            std::string::npos);
}

// dist.placement = by_group: batch slot s draws only from its allowed domains, with the stage's
// weights among them; the other slots keep their draws.
TEST(Sampler, RestrictedBatchesDrawOnlyTheirDomains) {
  const SamplerConfig c = SamplerConfig::from_json(json{{"seed", 3u}}, "sampler");
  Sampler free(c, kNames, kItems, kTokens), slots(c, kNames, kItems, kTokens);
  slots.restrict_batches({{0, 1}, {2}, {0, 1, 2}});
  int in_slot0[3] = {};
  for (int b = 0; b < 300; ++b) {
    std::vector<Sampler::Pick> p, q;
    slots.next_batch(8, p);
    free.next_batch(8, q);
    for (size_t r = 0; r < p.size(); ++r) {
      if (b % 3 == 0) EXPECT_LT(p[r].domain, 2u) << "batch " << b;
      if (b % 3 == 1) EXPECT_EQ(p[r].domain, 2u) << "batch " << b;
      if (b % 3 == 0) in_slot0[p[r].domain]++;
    }
    if (b % 3 == 2) {  // unrestricted: the same domains as an unrestricted sampler's
      for (size_t r = 0; r < p.size(); ++r) EXPECT_EQ(p[r].domain, q[r].domain) << "batch " << b;
    }
  }
  EXPECT_GT(in_slot0[0], 0);
  EXPECT_GT(in_slot0[1], 0);
  EXPECT_NE(error_of([&] { slots.restrict_batches({{}}); }).find("allows no domain"), std::string::npos);
  EXPECT_NE(error_of([&] { slots.restrict_batches({{7}}); }).find("no domain 7"), std::string::npos);
}

TEST(Sampler, ConfigErrorsNameTheProblem) {
  auto make = [](const char* text) {
    return error_of([&] { Sampler(SamplerConfig::from_json(json::parse(text), "sampler"), kNames, kItems, kTokens); });
  };
  EXPECT_NE(make(R"({"stages": [{"weights": {"zz": 1}}]})").find("'zz'"), std::string::npos);
  EXPECT_NE(make(R"({"stages": [{"weights": {"a": 1}}, {}]})").find("no \"steps\""), std::string::npos);
  EXPECT_NE(make(R"({"stages": [{"weights": {"a": 0}}]})").find("positive weight"), std::string::npos);
  EXPECT_NE(make(R"({"stages": [{"weight": {"a": 1}}]})").find("stages[0]"), std::string::npos);
  EXPECT_NE(make(R"({"seed": -1})").find("sampler.seed"), std::string::npos);
  auto empty = error_of([] { Sampler({}, kNames, {7, 0, 5}, kTokens); });
  EXPECT_NE(empty.find("'b'"), std::string::npos) << empty;
}

// ---------------------------------------------------------------------------------------------
// prepare -> ShardSet -> BatchSource

namespace {

// A small two-domain corpus, a tokenizer trained on it and a config pointing at both.
struct Toy {
  std::string dir, config, out;
  explicit Toy(const std::string& name) : dir(scratch(name)), config(dir + "/data.json"), out(dir + "/out") {
    std::string en, py;
    for (int i = 0; i < 200; ++i) {
      en += fmt::format(R"({{"text": "Sentence {} of the toy corpus, with words."}})", i) + "\n";
      py += fmt::format(R"({{"text": "def f{}(x):\n    return x + {}\n"}})", i, i) + "\n";
    }
    write_file(dir + "/corpus/english/train.jsonl", en);
    write_file(dir + "/corpus/python/train.jsonl", py);
    write_file(dir + "/corpus/bilingual/train.jsonl", R"({"text": "Hi.\n嗨。"})" "\n");
    std::vector<std::string> texts = {en, py};
    Tokenizer::train(texts, {.vocab_size = 400}).save(dir + "/tok.json");
    write_file(config, R"({"tokenizer": "tok.json", "corpus": "corpus", "domains": [
        {"name": "english", "group": "en"}, {"name": "python", "prefix": ["<Python>"], "slot": 4},
        {"name": "bilingual", "format": "bilingual"}]})");
  }
};

}  // namespace

TEST(Prepare, WritesShardsThatDecodeToTheFormattedCorpusAndSkipsFinishedOnes) {
  Toy toy("prepare");
  auto cfg = PrepareConfig::load(toy.config);
  auto rep = prepare(cfg, toy.out, {.threads = 2});
  ASSERT_EQ(rep.domains.size(), 3u);
  EXPECT_EQ(rep.stats.records, 401u);
  for (auto& d : rep.domains) EXPECT_FALSE(d.reused);
  Tokenizer tok = Tokenizer::load(toy.dir + "/tok.json");
  ShardSet set = ShardSet::open(toy.out, tok.hash());
  ASSERT_EQ(set.shards.size(), 3u);
  const Shard& py = *set.shards[1];
  EXPECT_EQ(py.n_samples(), 200u);
  std::vector<int32_t> ids(py.sample_end(7) - py.sample_begin(7));
  py.read(py.sample_begin(7), ids.size(), ids.data());
  std::vector<uint32_t> u(ids.begin(), ids.end());
  EXPECT_EQ(tok.decode(u), "<Python>def f7(x):\n    return x + 7\n<EOT>");
  const Shard& bi = *set.shards[2];
  ids.resize(bi.n_tokens());
  bi.read(0, bi.n_tokens(), ids.data());
  EXPECT_EQ(tok.decode(std::vector<uint32_t>(ids.begin(), ids.end())), "<EN>Hi.<CN>嗨。<EOT>");
  // Same result with one thread.
  prepare(cfg, toy.dir + "/out1", {.threads = 1});
  EXPECT_EQ(read_file(toy.out + "/english.shard"), read_file(toy.dir + "/out1/english.shard"));

  // Second run: everything is up to date. Touching one domain's file remakes only that shard.
  auto again = prepare(cfg, toy.out, {});
  for (auto& d : again.domains) EXPECT_TRUE(d.reused) << d.name;
  EXPECT_EQ(again.domains[1].samples, 200u);
  std::ofstream(toy.dir + "/corpus/python/train.jsonl", std::ios::app) << R"({"text": "pass"})" "\n";
  auto third = prepare(cfg, toy.out, {});
  EXPECT_TRUE(third.domains[0].reused);
  EXPECT_FALSE(third.domains[1].reused);
  EXPECT_EQ(third.domains[1].samples, 201u);
  // A different tokenizer invalidates every shard, and opening with it is refused.
  Tokenizer other({"<x>"});
  other.save(toy.dir + "/tok.json");
  auto fourth = prepare(cfg, toy.out, {});
  for (auto& d : fourth.domains) EXPECT_FALSE(d.reused);
  EXPECT_NE(error_of([&] { ShardSet::open(toy.out, tok.hash()); }).find("tokenizer"), std::string::npos);
}

TEST(Prepare, UnknownPrefixTokenIsAnError) {
  Toy toy("badprefix");
  write_file(toy.config, R"({"tokenizer": "tok.json", "corpus": "corpus",
                             "domains": [{"name": "python", "prefix": ["<Rust>"]}]})");
  std::string e = error_of([&] { prepare(PrepareConfig::load(toy.config), toy.out, {}); });
  EXPECT_NE(e.find("domains[0].prefix"), std::string::npos) << e;
  EXPECT_NE(e.find("<Rust>"), std::string::npos) << e;
}

// The manifest guards itself: an edit to any field, even one no reader checks today
// (samples, inputs_hash), is refused naming the file; the untouched manifest opens.
TEST(Prepare, AnEditedManifestFieldIsRefused) {
  Toy toy("manifest_sum");
  prepare(PrepareConfig::load(toy.config), toy.out, {});
  const std::string path = toy.out + "/manifest.json", good = read_file(path);
  EXPECT_NO_THROW(ShardSet::open(toy.out, 0));
  auto edited = [&](const std::function<void(json&)>& edit) {
    json m = json::parse(good);
    edit(m);
    write_file(path, m.dump(2));
    return error_of([&] { ShardSet::open(toy.out, 0); });
  };
  for (const char* field : {"samples", "inputs_hash"}) {
    const std::string e = edited([&](json& m) {
      json& v = m["shards"][0][field];
      v = v.is_string() ? json("0123456789abcdef") : json(v.get<uint64_t>() + 1);
    });
    EXPECT_NE(e.find("manifest.json: the manifest was changed"), std::string::npos) << field << ": " << e;
  }
  std::string e = edited([](json& m) { m["note"] = "a field added by hand"; });
  EXPECT_NE(e.find("was changed"), std::string::npos) << e;
  e = edited([](json& m) { m.erase("manifest_xxh3_64"); });
  EXPECT_NE(e.find("missing key \"manifest_xxh3_64\""), std::string::npos) << e;
  e = edited([](json& m) { m["version"] = 2; });
  EXPECT_NE(e.find("re-run sigma prepare"), std::string::npos) << e;
  // Reformatting alone (indentation, key order) changes no field: still accepted.
  write_file(path, json::parse(good).dump());
  EXPECT_NO_THROW(ShardSet::open(toy.out, 0));
}

TEST(BatchSource, FillsBatchesWithDomainIdsAndResumesExactly) {
  Toy toy("batches");
  prepare(PrepareConfig::load(toy.config), toy.out, {});
  auto sc = SamplerConfig::from_json(json::parse(R"({"seed": 3, "stages": [{"domains": ["english", "python"]}]})"), "s");
  BatchConfig bc{.batch = 4, .seq = 16};
  BatchSource src(ShardSet::open(toy.out, 0), bc, sc);
  Batch b;
  std::vector<Batch> seq;
  for (int i = 0; i < 6; ++i) {
    src.next(b);
    ASSERT_EQ(b.inputs.size(), 64u);
    for (uint32_t r = 0; r < 4; ++r) {
      EXPECT_TRUE(b.domain[r] == 0 || b.domain[r] == 1);
      for (uint32_t j = 0; j + 1 < 16; ++j) EXPECT_EQ(b.targets[r * 16 + j], b.inputs[r * 16 + j + 1]);
    }
    seq.push_back(b);
  }
  BatchSource again(ShardSet::open(toy.out, 0), bc, sc);
  Batch c;
  for (int i = 0; i < 3; ++i) again.next(c);
  json cur = again.cursor();
  BatchSource resumed(ShardSet::open(toy.out, 0), bc, sc);
  resumed.restore(cur);
  for (int i = 3; i < 6; ++i) {
    resumed.next(c);
    EXPECT_EQ(c.inputs, seq[i].inputs) << "batch " << i;
    EXPECT_EQ(c.domain, seq[i].domain);
  }
  // Fine-tuning rows: one sample each, padded, starting at a sample boundary.
  BatchSource ft(ShardSet::open(toy.out, 0), {.batch = 8, .seq = 32, .finetune = true}, sc);
  ft.next(b);
  for (uint32_t r = 0; r < 8; ++r) {
    EXPECT_EQ(b.mask[r * 32 + 31], 0.0f);            // every toy sample is shorter than 32
    EXPECT_EQ(b.inputs[r * 32 + 31], int32_t(kPadId));
    if (b.domain[r] == 1) {
      EXPECT_EQ(b.inputs[r * 32], 4);  // <Python> first
    }
  }
}

TEST(Cli, TokenizerAndPrepareExitCodes) {
  Toy toy("cli");
  std::string bin = SIGMA_BINARY;
  auto sh = [&](const std::string& args) {
    return std::system((bin + " " + args + " >" + toy.dir + "/log 2>&1").c_str());
  };
  EXPECT_EQ(sh("tokenizer train --corpus " + toy.dir + "/corpus --vocab-size 350 --out " + toy.dir + "/t2.json"), 0);
  EXPECT_EQ(Tokenizer::load(toy.dir + "/t2.json").vocab_size(), 350u);
  EXPECT_EQ(sh("tokenizer encode --tokenizer " + toy.dir + "/t2.json --text 'def f(x):'"), 0);
  std::string ids = read_file(toy.dir + "/log");
  EXPECT_EQ(sh("tokenizer decode --tokenizer " + toy.dir + "/t2.json " + ids.substr(0, ids.find('\n'))), 0);
  EXPECT_EQ(read_file(toy.dir + "/log"), "def f(x):");
  EXPECT_EQ(sh("prepare --config " + toy.config + " --out " + toy.out), 0);
  EXPECT_NE(read_file(toy.dir + "/log").find("python"), std::string::npos);
  write_file(toy.dir + "/bad.json", R"({"tokenizer": "tok.json", "corpus": "corpus", "domains": [{"nam": "x"}]})");
  EXPECT_NE(sh("prepare --config " + toy.dir + "/bad.json --out " + toy.out), 0);
  EXPECT_NE(read_file(toy.dir + "/log").find("domains[0]"), std::string::npos) << read_file(toy.dir + "/log");
}

// The real corpus prepares end to end (byte-level tokenizer: no training cost).
TEST(Prepare, SharedCorpusTwoDomains) {
  if (!fs::exists(kData + "/corpus")) GTEST_SKIP() << "no corpus at " << kData;
  std::string dir = scratch("shared");
  Tokenizer().save(dir + "/tok.json");
  write_file(dir + "/data.json", fmt::format(R"({{"tokenizer": "tok.json", "corpus": "{}/corpus",
      "domains": [{{"name": "bilingual", "format": "bilingual"}}, {{"name": "python", "prefix": ["<Python>"]}}]}})", kData));
  auto rep = prepare(PrepareConfig::load(dir + "/data.json"), dir + "/out", {});
  EXPECT_EQ(rep.domains[0].samples, 26253u);
  EXPECT_EQ(rep.domains[1].samples, 446u);
  EXPECT_EQ(rep.stats.skipped(), 0u);
  ShardSet set = ShardSet::open(dir + "/out", Tokenizer().hash());
  EXPECT_EQ(set.shards[1]->n_tokens(), rep.domains[1].tokens);
  fs::remove_all(dir);
}
