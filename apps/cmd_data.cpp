// `sigma tokenizer train|encode|decode` and `sigma prepare`: raw text to tokenizer to shards.
#include <fmt/core.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <sstream>

#include "command.h"
#include "core/error.h"
#include "core/progress.h"
#include "data/jsonl.h"
#include "data/prepare.h"
#include "data/tokenizer.h"

namespace sigma::cli {
namespace {

using data::Tokenizer;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string read_all(std::istream& in) {
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void add_tokenizer(CLI::App& root) {
  auto* tok = root.add_subcommand("tokenizer", "Train, or inspect, the byte-level BPE tokenizer");
  tok->require_subcommand(1);

  struct TrainArgs {
    std::vector<std::string> corpus, controls;
    std::string out;
    uint32_t vocab = 16384, max_run = 16;
    uint64_t max_line = 64u << 20;
  };
  auto ta = std::make_shared<TrainArgs>();
  auto* train = tok->add_subcommand("train", "Learn BPE merges from a corpus (JSONL or domain folders)");
  train->add_option("--corpus", ta->corpus, "Corpus .jsonl files or folders")->required();
  train->add_option("--vocab-size", ta->vocab, "Total vocabulary size")->capture_default_str();
  train->add_option("--out", ta->out, "Tokenizer file to write (JSON)")->required();
  train->add_option("--control", ta->controls, "Extra control tokens, e.g. <mask> (repeatable)");
  train->add_option("--max-space-run", ta->max_run, "Longest run of spaces with its own token")
      ->capture_default_str();
  train->add_option("--max-line-bytes", ta->max_line, "Skip longer JSONL lines")->capture_default_str();
  train->callback([ta] {
    auto t0 = std::chrono::steady_clock::now();
    data::BpeTrainer trainer(
        {.vocab_size = ta->vocab, .controls = ta->controls, .max_space_run = ta->max_run});
    data::ReadOptions ro;
    ro.max_line_bytes = ta->max_line;
    data::ReadStats stats;
    const std::vector<data::Source> sources = data::expand_corpus(ta->corpus);
    // Progress by the files' bytes: those of the files read, plus the current file's text.
    uint64_t total = 0, files_done = 0, in_file = 0, file_size = 0;
    std::error_code ec;
    for (const data::Source& src : sources) total += std::filesystem::file_size(src.path, ec);
    Progress shown("tokenizer train: reading", total >> 10, "KiB");
    const std::string* file = nullptr;
    data::read_corpus(sources, ro, stats, [&](data::Record& r) {
      if (r.file != file) {
        files_done += file_size;
        file = r.file;
        file_size = file ? std::filesystem::file_size(*file, ec) : 0;
        in_file = 0;
      }
      in_file += r.prompt.size() + r.text.size();
      shown.set((files_done + std::min(in_file, file_size)) >> 10);
      trainer.add(r.prompt);
      trainer.add(r.text);
    });
    shown.finish();
    for (auto& m : stats.messages) fmt::print(stderr, "skip: {}\n", m);
    fmt::print(stderr, "read {} ({} distinct words) in {:.1f} s\n", stats.summary(),
               trainer.distinct_words(), seconds_since(t0));
    SIGMA_CHECK(stats.records > 0, "tokenizer train: the corpus has no usable record");
    Tokenizer t = trainer.finish(/*progress=*/true);
    t.save(ta->out);
    fmt::print(stderr, "wrote {}: vocab {} ({} merges), hash {:016x}, {:.1f} s in all\n", ta->out,
               t.vocab_size(), t.n_merges(), t.hash(), seconds_since(t0));
  });

  struct CodecArgs {
    std::string tokenizer, text;
    std::vector<uint32_t> ids;
    bool pieces = false;
  };
  auto ea = std::make_shared<CodecArgs>();
  auto* enc = tok->add_subcommand("encode", "Print the token ids of --text (or stdin)");
  enc->add_option("--tokenizer", ea->tokenizer, "Tokenizer file")->required();
  enc->add_option("--text", ea->text, "Text to encode; stdin when absent");
  enc->add_flag("--pieces", ea->pieces, "Print each token's bytes beside its id");
  enc->callback([ea, enc] {
    Tokenizer t = Tokenizer::load(ea->tokenizer);
    std::string text = enc->count("--text") ? ea->text : read_all(std::cin);
    auto ids = t.encode(text);
    if (!ea->pieces) {
      fmt::print("{}\n", fmt::join(ids, " "));
      return;
    }
    for (uint32_t id : ids) {
      std::string shown;
      for (unsigned char c : t.token_bytes(id))
        shown += (c < 0x20 || c == 0x7F) ? fmt::format("\\x{:02x}", c) : std::string(1, char(c));
      fmt::print("{}\t'{}'\n", id, shown);
    }
    fmt::print(stderr, "{} bytes -> {} tokens\n", text.size(), ids.size());
  });

  auto da = std::make_shared<CodecArgs>();
  auto* dec = tok->add_subcommand("decode", "Print the text of token ids (arguments or stdin)");
  dec->add_option("--tokenizer", da->tokenizer, "Tokenizer file")->required();
  dec->add_option("ids", da->ids, "Token ids; stdin (whitespace-separated) when absent");
  dec->callback([da] {
    Tokenizer t = Tokenizer::load(da->tokenizer);
    std::vector<uint32_t> ids = da->ids;
    if (ids.empty()) {
      std::string word;
      while (std::cin >> word) {
        char* end = nullptr;
        unsigned long v = std::strtoul(word.c_str(), &end, 10);
        SIGMA_CHECK(end && *end == '\0' && !word.empty(), "tokenizer decode: '{}' is not a token id", word);
        ids.push_back(static_cast<uint32_t>(v));
      }
    }
    std::string s = t.decode(ids);
    std::fwrite(s.data(), 1, s.size(), stdout);
  });
}

void add_prepare(CLI::App& root) {
  struct Args {
    std::string config, out;
    int threads = 0;
  };
  auto a = std::make_shared<Args>();
  auto* p = root.add_subcommand("prepare", "Tokenize a corpus into per-domain token shards");
  p->add_option("--config", a->config, "Data config (JSON: tokenizer, domains, corpus)")->required();
  p->add_option("--out", a->out, "Output folder for the shards and manifest.json")->required();
  p->add_option("--threads", a->threads, "Encoding threads (0 = all cores)")->capture_default_str();
  p->callback([a] {
    auto t0 = std::chrono::steady_clock::now();
    auto report = data::prepare(data::PrepareConfig::load(a->config), a->out,
                                {.threads = a->threads, .progress = true});
    uint64_t tokens = 0;
    for (auto& d : report.domains) tokens += d.tokens;
    fmt::print(stderr, "prepare: {} tokens in {} domains -> {} in {:.1f} s\n", tokens,
               report.domains.size(), a->out, seconds_since(t0));
  });
}

RegisterCommand reg_tokenizer(add_tokenizer);
RegisterCommand reg_prepare(add_prepare);

}  // namespace
}  // namespace sigma::cli
