// `sigma prepare`: corpus -> formatted, tokenized samples -> one shard per domain, plus
// manifest.json. A shard whose inputs (files, domain entry, tokenizer) are unchanged is kept.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/jsonl.h"
#include "data/tokenizer.h"
#include "model/domains.h"

namespace sigma::data {

struct PrepareConfig {
  std::string tokenizer;            // tokenizer JSON file
  std::vector<std::string> corpus;  // .jsonl files or folders (see expand_corpus)
  DomainRegistry domains;
  uint64_t max_line_bytes = 64u << 20;

  // Relative paths are taken from `base_dir` (the config file's folder); errors name `origin`.
  static PrepareConfig from_json(const nlohmann::json& j, const std::string& base_dir,
                                 const std::string& origin);
  static PrepareConfig load(const std::string& path);
};

struct PrepareOptions {
  int threads = 0;        // encoding threads; 0 = all cores
  bool progress = false;  // progress and summary on stderr
};

struct DomainReport {
  std::string name;
  uint64_t tokens = 0, samples = 0;
  bool reused = false;  // shard was up to date and kept
};

struct PrepareReport {
  std::vector<DomainReport> domains;  // in registry order
  ReadStats stats;                    // of the files that were read
};

PrepareReport prepare(const PrepareConfig& cfg, const std::string& out_dir, const PrepareOptions& opt);

// One sample as tokens: domain prefix controls, then the prompt, then the text, then <EOT>.
// Bilingual domains tag each line of the text with <EN> or <CN> instead of keeping the '\n'.
// Returns the prompt length in tokens (prefix included), for prompt masking.
uint32_t format_sample(const Tokenizer& tok, const DomainSpec& d, std::string_view prompt,
                       std::string_view text, std::vector<uint32_t>& out);

// True when the line is mostly CJK script (CJK characters >= half the Latin letters).
bool looks_chinese(std::string_view line);

}  // namespace sigma::data
