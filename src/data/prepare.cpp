#include "data/prepare.h"

#include <omp.h>
#include <xxhash.h>

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/json_depth.h"
#include "core/progress.h"
#include "data/shards.h"
#include "io/file.h"

namespace fs = std::filesystem;

namespace sigma::data {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Config

PrepareConfig PrepareConfig::from_json(const json& j, const std::string& base_dir,
                                       const std::string& origin) {
  SIGMA_CHECK(j.is_object(), "{}: must be a JSON object", origin);
  for (auto& [k, v] : j.items())
    SIGMA_CHECK(k == "tokenizer" || k == "corpus" || k == "domains" || k == "max_line_bytes",
                "{}: unknown key \"{}\" (known: tokenizer, corpus, domains, max_line_bytes)", origin, k);
  auto resolve = [&](const std::string& p) {
    return fs::path(p).is_absolute() ? p : (fs::path(base_dir) / p).lexically_normal().string();
  };
  PrepareConfig c;
  SIGMA_CHECK(j.contains("tokenizer") && j["tokenizer"].is_string(),
              "{}: key \"tokenizer\" (path of the tokenizer file) is missing or not a string", origin);
  c.tokenizer = resolve(j["tokenizer"].get<std::string>());
  SIGMA_CHECK(j.contains("corpus"), "{}: key \"corpus\" (files or folders) is missing", origin);
  const json& corpus = j["corpus"];
  SIGMA_CHECK(corpus.is_string() || (corpus.is_array() && !corpus.empty()),
              "{}: key \"corpus\" must be a path or a non-empty array of paths", origin);
  for (auto& p : corpus.is_string() ? json::array({corpus}) : corpus) {
    SIGMA_CHECK(p.is_string(), "{}: key \"corpus\" must hold paths (strings)", origin);
    c.corpus.push_back(resolve(p.get<std::string>()));
  }
  SIGMA_CHECK(j.contains("domains"), "{}: key \"domains\" is missing", origin);
  c.domains = DomainRegistry::from_json(j["domains"], origin + ": domains", DomainForm::Data);
  if (j.contains("max_line_bytes")) {
    SIGMA_CHECK(j["max_line_bytes"].is_number_unsigned() && j["max_line_bytes"].get<uint64_t>() > 0,
                "{}: key \"max_line_bytes\" must be a positive integer", origin);
    c.max_line_bytes = j["max_line_bytes"].get<uint64_t>();
  }
  return c;
}

PrepareConfig PrepareConfig::load(const std::string& path) {
  std::ifstream f(path);
  SIGMA_CHECK(f, "cannot open config {}", path);
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = json::parse(ss.str(), json_depth_limit("config " + path), false);
  SIGMA_CHECK(!j.is_discarded(), "config {}: not valid JSON", path);
  return from_json(j, fs::path(path).parent_path().string(), path);
}

// ---------------------------------------------------------------------------------------------
// Formatting

bool looks_chinese(std::string_view line) {
  size_t cjk = 0, latin = 0;
  uint32_t cp;
  for (size_t i = 0; i < line.size();) {
    size_t len = utf8_next(line, i, cp);
    if (len == 0) { ++i; continue; }
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) ++latin;
    else if ((cp >= 0x3400 && cp <= 0x9FFF) || (cp >= 0xF900 && cp <= 0xFAFF) || cp >= 0x20000) ++cjk;
    i += len;
  }
  return cjk > 0 && 2 * cjk >= latin;
}

namespace {

// Each non-empty line tagged <EN> or <CN> by its script; the '\n' between lines is dropped.
void append_bilingual(const Tokenizer& tok, std::string_view text, std::vector<uint32_t>& out) {
  const uint32_t en = tok.id_of_control("<EN>"), cn = tok.id_of_control("<CN>");
  for (size_t b = 0; b <= text.size();) {
    size_t e = std::min(text.find('\n', b), text.size());
    std::string_view line = text.substr(b, e - b);
    if (!line.empty()) {
      out.push_back(looks_chinese(line) ? cn : en);
      tok.encode_append(line, out);
    }
    b = e + 1;
  }
}

}  // namespace

uint32_t format_sample(const Tokenizer& tok, const DomainSpec& d, std::string_view prompt,
                       std::string_view text, std::vector<uint32_t>& out) {
  out.clear();
  for (auto& p : d.prefix) out.push_back(tok.id_of_control(p));
  // A translation pair's prompt is tagged too (<EN>source<CN>target), so the model learns
  // which tag opens the answer.
  if (d.format == SampleFormat::Plain) tok.encode_append(prompt, out);
  else append_bilingual(tok, prompt, out);
  const auto prompt_len = static_cast<uint32_t>(out.size());
  if (d.format == SampleFormat::Plain) tok.encode_append(text, out);
  else append_bilingual(tok, text, out);
  out.push_back(kEotId);
  return prompt_len;
}

// ---------------------------------------------------------------------------------------------
// Prepare

namespace {

uint64_t file_hash(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  SIGMA_CHECK(f, "cannot open {}", path);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(1 << 20);
  while (f.read(buf.data(), buf.size()) || f.gcount() > 0) XXH3_64bits_update(st, buf.data(), f.gcount());
  uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

// A batch of records on its way from the reader thread to the encoders.
struct RecordBatch {
  std::vector<Record> records;
  size_t bytes = 0;
  uint64_t done = 0;  // input bytes finished when this batch was cut (for progress)
};

// Single-producer queue holding at most two batches, so reading overlaps encoding.
class BatchQueue {
 public:
  // False once the consumer has stopped: the producer should give up.
  bool push(RecordBatch b) {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return q_.size() < 2 || stop_; });
    if (stop_) return false;
    q_.push_back(std::move(b));
    cv_.notify_all();
    return true;
  }
  std::optional<RecordBatch> pop() {
    std::unique_lock lk(m_);
    cv_.wait(lk, [&] { return !q_.empty() || closed_; });
    if (q_.empty()) return std::nullopt;
    RecordBatch b = std::move(q_.front());
    q_.pop_front();
    cv_.notify_all();
    return b;
  }
  void close() {
    std::lock_guard lk(m_);
    closed_ = true;
    cv_.notify_all();
  }
  void stop() {  // consumer failed: let the producer finish without blocking
    std::lock_guard lk(m_);
    stop_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<RecordBatch> q_;
  bool closed_ = false, stop_ = false;
};

// Every prefix must be a control token of the tokenizer, or its samples could not be encoded.
void check_prefixes(const PrepareConfig& cfg, const Tokenizer& tok) {
  for (size_t i = 0; i < cfg.domains.size(); ++i)
    for (auto& p : cfg.domains[i].prefix)
      SIGMA_CHECK(tok.find_control(p), "domains[{}].prefix: '{}' is not a control token of "
                  "tokenizer {} (it has: {})", i, p, cfg.tokenizer, fmt::join(tok.controls(), " "));
}

// A file without a domain feeds every domain; a folder domain feeds only its own.
bool feeds(const Source& s, const DomainSpec& d) {
  return s.domain.empty() || s.domain == d.name;
}

// Hash of everything a domain's shard is made from: the tokenizer, the domain entry, the line
// limit and the content of every file that feeds it.
uint64_t domain_inputs_hash(const PrepareConfig& cfg, const Tokenizer& tok, const DomainSpec& d,
                            const std::vector<Source>& sources, const std::vector<uint64_t>& content) {
  std::string key = fmt::format("sigma-prepare/1 {:016x} {} {}", tok.hash(),
                                to_json(d, DomainForm::Data).dump(),
                                cfg.max_line_bytes);
  for (size_t s = 0; s < sources.size(); ++s)
    if (feeds(sources[s], d)) key += fmt::format(" {:016x}", content[s]);
  return XXH3_64bits(key.data(), key.size());
}

// What the shard at `path` holds, and whether it was made from these inputs.
DomainReport existing_shard(const std::string& path, const DomainSpec& d, const Tokenizer& tok,
                            uint64_t inputs_hash, uint64_t& checksum) {
  DomainReport r{d.name};
  try {
    ShardHeader h = Shard::read_header(path);
    checksum = h.checksum;
    r.reused = h.inputs_hash == inputs_hash && h.tokenizer_hash == tok.hash() && h.domain_id == d.id;
    r.tokens = h.n_tokens;
    r.samples = h.n_samples;
  } catch (const Error&) {  // absent or unreadable: make it again
  }
  return r;
}

// The shards of one run, per domain in registry order.
struct ShardPlan {
  std::vector<std::unique_ptr<ShardWriter>> writers;  // null: the shard on disk is current, kept
  std::vector<uint64_t> inputs_hash;                  // see domain_inputs_hash
  std::vector<uint64_t> checksum;                     // each shard's, for the manifest
};

// Which files feed which domain; a shard is current when the hash of all that matches. Opens a
// writer for every other shard and adds every domain to the report.
ShardPlan plan_shards(const PrepareConfig& cfg, const Tokenizer& tok, const std::vector<Source>& sources,
                      const std::string& out_dir, PrepareReport& report) {
  std::vector<uint64_t> content(sources.size());
  for (size_t s = 0; s < sources.size(); ++s) content[s] = file_hash(sources[s].path);
  const size_t nd = cfg.domains.size();
  ShardPlan plan;
  plan.writers.resize(nd);
  plan.inputs_hash.resize(nd);
  plan.checksum.resize(nd);
  for (size_t i = 0; i < nd; ++i) {
    const DomainSpec& d = cfg.domains[i];
    plan.inputs_hash[i] = domain_inputs_hash(cfg, tok, d, sources, content);
    std::string path = out_dir + "/" + d.name + ".shard";
    DomainReport r = existing_shard(path, d, tok, plan.inputs_hash[i], plan.checksum[i]);
    if (!r.reused) plan.writers[i] = std::make_unique<ShardWriter>(path, d, tok.vocab_size(), tok.hash(),
                                                                   plan.inputs_hash[i]);
    report.domains.push_back(r);
  }
  return plan;
}

void note_undeclared_domains(const PrepareConfig& cfg, const std::vector<Source>& sources,
                             const PrepareOptions& opt) {
  for (auto& s : sources)
    if (!s.domain.empty() && !cfg.domains.find(s.domain) && opt.progress)
      fmt::print(stderr, "prepare: note: folder domain '{}' ({}) is not declared; skipped\n", s.domain,
                 s.path);
}

// The sources that feed a stale shard, and their total size in bytes (for progress).
std::vector<size_t> sources_to_read(const PrepareConfig& cfg, const std::vector<Source>& sources,
                                    const ShardPlan& plan, uint64_t& total) {
  std::vector<size_t> todo;
  bool any_stale = false;
  for (auto& w : plan.writers) any_stale |= w != nullptr;
  for (size_t s = 0; s < sources.size(); ++s) {
    const DomainSpec* d = cfg.domains.find(sources[s].domain);
    if (sources[s].domain.empty() ? any_stale : d && plan.writers[size_t(cfg.domains.index(d->name))]) {
      todo.push_back(s);
      total += fs::file_size(sources[s].path);
    }
  }
  return todo;
}

struct Stopped {};  // thrown by the reader when the consumer has stopped

// Reader thread: the records of stale domains in `todo`, in batches of about 2 MB or 4096
// records, one batch ending at each file's end. Throws Stopped once the consumer has stopped.
void read_batches(const PrepareConfig& cfg, const std::vector<Source>& sources,
                  const std::vector<size_t>& todo, const ShardPlan& plan, ReadStats& stats,
                  BatchQueue& queue) {
  ReadOptions ro;
  ro.max_line_bytes = cfg.max_line_bytes;
  ro.domains = cfg.domains.names();
  RecordBatch b;
  uint64_t done = 0;
  for (size_t s : todo) {
    read_source(sources[s], ro, stats, [&](Record& r) {
      const size_t i = size_t(cfg.domains.index(r.domain));
      if (!plan.writers[i]) return;  // a mixed file also feeds domains that are up to date
      b.bytes += r.text.size() + r.prompt.size();
      b.records.push_back(std::move(r));
      if (b.bytes >= (2u << 20) || b.records.size() >= 4096) {
        b.done = done;
        if (!queue.push(std::exchange(b, RecordBatch{}))) throw Stopped{};
      }
    });
    done += fs::file_size(sources[s].path);
    b.done = done;
    if (!queue.push(std::exchange(b, RecordBatch{}))) throw Stopped{};
  }
}

// Encodes each batch on every thread, then adds its samples to their shards in input order.
void encode_batches(const PrepareConfig& cfg, const Tokenizer& tok, int threads, BatchQueue& queue,
                    ShardPlan& plan, Progress& progress) {
  std::vector<std::vector<uint32_t>> toks;
  std::vector<uint32_t> plen;
  while (auto b = queue.pop()) {
    const size_t n = b->records.size();
    toks.resize(n);
    plen.resize(n);
    std::vector<std::string> errors(n);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (size_t k = 0; k < n; ++k) {
      const Record& r = b->records[k];
      try {
        plen[k] = format_sample(tok, cfg.domains.at(r.domain), r.prompt, r.text, toks[k]);
      } catch (const std::exception& e) {  // exceptions must not leave an OpenMP region
        errors[k] = e.what();
      }
    }
    for (size_t k = 0; k < n; ++k) {
      const Record& r = b->records[k];
      SIGMA_CHECK(errors[k].empty(), "{}:{}: {}", *r.file, r.line, errors[k]);
      plan.writers[size_t(cfg.domains.index(r.domain))]->add(toks[k], plen[k]);
    }
    progress.set(b->done >> 10);
  }
}

// Read the files of stale domains; encode batches of records on every thread, write in order.
// Reading overlaps encoding; whichever side fails stops the other before the error propagates.
void write_stale_shards(const PrepareConfig& cfg, const Tokenizer& tok,
                        const std::vector<Source>& sources, const std::vector<size_t>& todo,
                        uint64_t total, const PrepareOptions& opt, ShardPlan& plan, ReadStats& stats) {
  const int threads = opt.threads > 0 ? opt.threads : omp_get_max_threads();
  Progress progress("sigma prepare: reading and encoding", total >> 10, "KiB", opt.progress);
  BatchQueue queue;
  std::exception_ptr read_error;
  std::thread reader([&] {
    try {
      read_batches(cfg, sources, todo, plan, stats, queue);
    } catch (const Stopped&) {  // the consumer failed and reports its own error
    } catch (...) {
      read_error = std::current_exception();
    }
    queue.close();
  });
  try {
    encode_batches(cfg, tok, threads, queue, plan, progress);
  } catch (...) {
    queue.stop();
    reader.join();
    throw;
  }
  reader.join();
  if (read_error) std::rethrow_exception(read_error);
}

// Completes every new shard, then renames them all into place; their sizes replace those read
// from the stale ones. Until write_manifest the folder is refused by readers (the manifest
// names the old shards' checksums), never taken for a whole preparation.
void finish_shards(ShardPlan& plan, PrepareReport& report) {
  for (size_t i = 0; i < plan.writers.size(); ++i) {
    if (!plan.writers[i]) continue;
    plan.writers[i]->finish();
    report.domains[i].tokens = plan.writers[i]->n_tokens();
    report.domains[i].samples = plan.writers[i]->n_samples();
    plan.checksum[i] = plan.writers[i]->checksum();
  }
  for (auto& w : plan.writers)
    if (w) w->commit();
}

void write_manifest(const PrepareConfig& cfg, const Tokenizer& tok, const std::string& out_dir,
                    const PrepareReport& report, const ShardPlan& plan) {
  json shards = json::array();
  for (size_t i = 0; i < report.domains.size(); ++i)
    shards.push_back({{"domain", report.domains[i].name},
                      {"file", report.domains[i].name + ".shard"},
                      {"tokens", report.domains[i].tokens},
                      {"samples", report.domains[i].samples},
                      {"xxh3_64", fmt::format("{:016x}", plan.checksum[i])},
                      {"inputs_hash", fmt::format("{:016x}", plan.inputs_hash[i])}});
  // The tokenizer relative to the manifest's folder (readers resolve it against that folder),
  // so the run reads it from any directory, and a folder moved with its tokenizer still works.
  const std::string tokenizer =
      fs::relative(fs::absolute(cfg.tokenizer), fs::absolute(out_dir)).lexically_normal().string();
  json manifest = {{"format", "sigma-shards"},
                   {"version", kManifestVersion},
                   {"tokenizer", tokenizer.empty() ? cfg.tokenizer : tokenizer},
                   {"tokenizer_hash", fmt::format("{:016x}", tok.hash())},
                   {"vocab_size", tok.vocab_size()},
                   {"domains", cfg.domains.to_json(DomainForm::Data)},
                   {"shards", std::move(shards)}};
  manifest["manifest_xxh3_64"] = manifest_checksum(manifest);
  write_file_atomic(out_dir + "/manifest.json", manifest.dump(2) + "\n");
}

void print_summary(const PrepareReport& report, bool read_any) {
  for (auto& m : report.stats.messages) fmt::print(stderr, "prepare: skip: {}\n", m);
  if (read_any) fmt::print(stderr, "prepare: read {}\n", report.stats.summary());
  for (auto& d : report.domains)
    fmt::print(stderr, "prepare: {:<12} {:>10} tokens {:>8} samples  {}\n", d.name, d.tokens,
               d.samples, d.reused ? "(up to date, kept)" : "(written)");
}

}  // namespace

PrepareReport prepare(const PrepareConfig& cfg, const std::string& out_dir, const PrepareOptions& opt) {
  SIGMA_CHECK(fs::is_regular_file(cfg.tokenizer), "tokenizer {} (the prepare config's "
              "\"tokenizer\" key, relative to the config file's folder) does not exist: make it "
              "with sigma tokenizer train --corpus DIR --vocab-size N --out {}, or point the key at "
              "an existing tokenizer", cfg.tokenizer, cfg.tokenizer);
  Tokenizer tok = Tokenizer::load(cfg.tokenizer);
  check_prefixes(cfg, tok);
  std::vector<Source> sources = expand_corpus(cfg.corpus);
  fs::create_directories(out_dir);
  remove_dead_temporaries(out_dir);  // NAME.shard.tmp-<pid> of a killed prepare
  PrepareReport report;
  ShardPlan plan = plan_shards(cfg, tok, sources, out_dir, report);
  note_undeclared_domains(cfg, sources, opt);
  uint64_t total = 0;
  const std::vector<size_t> todo = sources_to_read(cfg, sources, plan, total);
  write_stale_shards(cfg, tok, sources, todo, total, opt, plan, report.stats);
  finish_shards(plan, report);
  // The commit: fsync the renames, then the manifest that names every shard, last.
  fsync_path(out_dir, true);
  write_manifest(cfg, tok, out_dir, report, plan);
  if (opt.progress) print_summary(report, !todo.empty());
  return report;
}

}  // namespace sigma::data
