#include "data/jsonl.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_depth.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;

namespace sigma::data {

std::string ReadStats::summary() const {
  return fmt::format("{} records ({:.1f} MB of text); skipped: {} too long, {} bad JSON, {} bad "
                     "UTF-8, {} without text, {} undeclared domain; {} empty files",
                     records, text_bytes / 1e6, too_long, bad_json, bad_utf8, no_text, bad_domain,
                     empty_files);
}

LineReader::LineReader(const std::string& path, size_t max_line)
    : path_(path), buf_(64u << 10), max_line_(max_line) {  // grows for longer lines (fill)
  f_ = std::fopen(path.c_str(), "rb");
  SIGMA_CHECK(f_, "cannot open {}: {}", path, std::strerror(errno));
}

LineReader::~LineReader() {
  if (f_) std::fclose(f_);
}

// Moves the unread tail to the front and reads more; false when nothing more came.
bool LineReader::fill() {
  if (eof_) return false;
  if (pos_ > 0) {
    std::memmove(buf_.data(), buf_.data() + pos_, end_ - pos_);
    end_ -= pos_;
    pos_ = 0;
  }
  if (end_ == buf_.size()) buf_.resize(buf_.size() * 2);
  size_t got = std::fread(buf_.data() + end_, 1, buf_.size() - end_, f_);
  SIGMA_CHECK(!std::ferror(f_), "read error in {}: {}", path_, std::strerror(errno));
  if (got == 0) eof_ = true;
  end_ += got;
  bytes_read_ += got;
  return got > 0;
}

bool LineReader::next(std::string& line, bool& too_long) {
  too_long = false;
  size_t scanned = pos_;
  for (;;) {
    if (auto* nl = static_cast<char*>(std::memchr(buf_.data() + scanned, '\n', end_ - scanned))) {
      size_t e = nl - buf_.data();
      if (!too_long && e - pos_ > max_line_) too_long = true;
      if (too_long) line.clear();
      else line.assign(buf_.data() + pos_, e - pos_);
      pos_ = e + 1;
      ++line_no_;
      return true;
    }
    if (!too_long && end_ - pos_ > max_line_) {
      too_long = true;  // drop what we hold and keep discarding up to the next '\n'
      line.clear();
    }
    if (too_long) pos_ = end_;
    scanned = end_;
    size_t keep = scanned - pos_;
    if (!fill()) {
      if (end_ == pos_ && !too_long) return false;
      if (!too_long && end_ - pos_ > max_line_) too_long = true;
      if (too_long) line.clear();
      else line.assign(buf_.data() + pos_, end_ - pos_);
      pos_ = end_;
      ++line_no_;
      return true;  // last line without '\n'
    }
    scanned = pos_ + keep;
  }
}

namespace {

bool is_corpus_file(const fs::path& p) {
  auto e = p.extension();
  return e == ".jsonl" || e == ".txt";
}

Source source_of(const fs::path& p, std::string domain) {
  return {p.string(), std::move(domain), p.extension() == ".txt"};
}

// Every corpus file under `dir`, recursively, in sorted order.
std::vector<fs::path> files_under(const fs::path& dir) {
  std::vector<fs::path> out;
  for (auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && is_corpus_file(e.path())) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<Source> expand_corpus(const std::vector<std::string>& paths) {
  std::vector<Source> out;
  for (auto& p : paths) {
    fs::path path(p);
    std::error_code ec;
    auto st = fs::status(path, ec);
    SIGMA_CHECK(!ec && fs::exists(st), "corpus path {} does not exist", p);
    if (fs::is_regular_file(st)) {
      SIGMA_CHECK(path.extension() == ".jsonl",
                  "corpus file {}: only .jsonl files can be given directly (put .txt files in a "
                  "folder named after their domain)", p);
      out.push_back(source_of(path, ""));
      continue;
    }
    SIGMA_CHECK(fs::is_directory(st), "corpus path {} is neither a file nor a folder", p);
    std::vector<fs::path> subdirs, files;
    for (auto& e : fs::directory_iterator(path)) {
      if (e.is_directory()) subdirs.push_back(e.path());
      else if (e.is_regular_file() && is_corpus_file(e.path())) files.push_back(e.path());
    }
    std::sort(subdirs.begin(), subdirs.end());
    std::sort(files.begin(), files.end());
    size_t before = out.size();
    if (subdirs.empty()) {
      std::string domain = path.lexically_normal().filename().string();
      if (domain.empty()) domain = path.lexically_normal().parent_path().filename().string();
      for (auto& f : files) out.push_back(source_of(f, domain));
    } else {
      for (auto& f : files) {
        SIGMA_CHECK(f.extension() == ".jsonl",
                    "corpus file {}: a .txt file needs a domain folder around it", f.string());
        out.push_back(source_of(f, ""));
      }
      for (auto& d : subdirs)
        for (auto& f : files_under(d)) out.push_back(source_of(f, d.filename().string()));
    }
    SIGMA_CHECK(out.size() > before, "corpus folder {} holds no .jsonl or .txt files", p);
  }
  return out;
}

namespace {

struct Skipper {
  const ReadOptions& opt;
  ReadStats& stats;
  const std::string& file;
  void operator()(uint64_t& counter, uint64_t line, std::string_view why) {
    ++counter;
    if (stats.messages.size() < opt.max_messages)
      stats.messages.push_back(line ? fmt::format("{}:{}: {}", file, line, why)
                                    : fmt::format("{}: {}", file, why));
  }
};

bool declared(const ReadOptions& opt, const std::string& d) {
  return opt.domains.empty() || std::find(opt.domains.begin(), opt.domains.end(), d) != opt.domains.end();
}

// Checks domain and text; hands the record on or counts why not.
void deliver(Record& r, const ReadOptions& opt, ReadStats& stats, Skipper& skip, const RecordFn& f) {
  if (r.domain.empty()) return skip(stats.bad_domain, r.line, "no \"domain\" and no domain folder");
  if (!declared(opt, r.domain))
    return skip(stats.bad_domain, r.line, fmt::format("domain '{}' is not declared", r.domain));
  if (r.text.empty()) return skip(stats.no_text, r.line, "empty text");
  ++stats.records;
  stats.text_bytes += r.text.size() + r.prompt.size();
  f(r);
}

void read_txt(const Source& src, const ReadOptions& opt, ReadStats& stats, Skipper& skip,
              const RecordFn& f) {
  std::error_code ec;
  auto size = fs::file_size(src.path, ec);
  SIGMA_CHECK(!ec, "cannot read {}: {}", src.path, ec.message());
  if (size == 0) return skip(stats.empty_files, 0, "empty file");
  if (size > opt.max_line_bytes)
    return skip(stats.too_long, 0, fmt::format("{} bytes exceeds the cap of {}", size, opt.max_line_bytes));
  std::FILE* fp = std::fopen(src.path.c_str(), "rb");
  SIGMA_CHECK(fp, "cannot open {}: {}", src.path, std::strerror(errno));
  Record r;
  r.text.resize(size);
  size_t got = std::fread(r.text.data(), 1, size, fp);
  std::fclose(fp);
  SIGMA_CHECK(got == size, "read error in {}", src.path);
  if (!utf8_valid(r.text)) return skip(stats.bad_utf8, 0, "invalid UTF-8");
  r.domain = src.domain;
  r.file = &src.path;
  deliver(r, opt, stats, skip, f);
}

void read_jsonl(const Source& src, const ReadOptions& opt, ReadStats& stats, Skipper& skip,
                const RecordFn& f) {
  LineReader lines(src.path, opt.max_line_bytes);
  std::string line;
  bool too_long;
  uint64_t parsed = 0, nonblank = 0;
  std::string first_problem;
  auto note = [&](std::string why) {
    if (first_problem.empty()) first_problem = fmt::format("line {}: {}", lines.line_no(), why);
  };
  while (lines.next(line, too_long)) {
    const uint64_t ln = lines.line_no();
    if (too_long) {
      ++nonblank;
      skip(stats.too_long, ln, fmt::format("line longer than {} bytes", opt.max_line_bytes));
      note("too long");
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++nonblank;
    if (!utf8_valid(line)) {
      skip(stats.bad_utf8, ln, "invalid UTF-8");
      note("invalid UTF-8");
      continue;
    }
    auto j = parse_json_or_discard(line);
    if (j.is_discarded() || !j.is_object()) {
      skip(stats.bad_json, ln, "not a JSON object (or nested too deep)");
      note("not a JSON object");
      continue;
    }
    auto text = j.find("text");
    if (text == j.end()) text = j.find("answer");  // fine-tuning pairs: {"prompt", "answer"}
    if (text == j.end() || !text->is_string()) {
      skip(stats.no_text, ln, "no string \"text\" (or \"answer\")");
      note("no string \"text\" (or \"answer\")");
      continue;
    }
    ++parsed;
    Record r;
    r.text = text->get<std::string>();
    if (auto p = j.find("prompt"); p != j.end() && p->is_string()) r.prompt = p->get<std::string>();
    auto d = j.find("domain");
    r.domain = d != j.end() && d->is_string() ? d->get<std::string>() : src.domain;
    r.file = &src.path;
    r.line = ln;
    deliver(r, opt, stats, skip, f);
  }
  if (lines.bytes_read() == 0) return skip(stats.empty_files, 0, "empty file");
  // A file where nothing at all parses is not a corpus file: stop rather than train on nothing.
  SIGMA_CHECK(parsed > 0 || nonblank == 0,
              "{}: no usable record in {} non-blank lines (first problem at {}); is this a JSONL "
              "file of {{\"text\": ...}} records?", src.path, nonblank, first_problem);
}

}  // namespace

void read_source(const Source& src, const ReadOptions& opt, ReadStats& stats, const RecordFn& f) {
  Skipper skip{opt, stats, src.path};
  if (!src.domain.empty() && !declared(opt, src.domain))
    return skip(stats.bad_domain, 0, fmt::format("whole file skipped: domain folder '{}' is not "
                                                 "declared", src.domain));
  if (src.whole_file) read_txt(src, opt, stats, skip, f);
  else read_jsonl(src, opt, stats, skip, f);
}

void read_corpus(const std::vector<Source>& sources, const ReadOptions& opt, ReadStats& stats,
                 const RecordFn& f) {
  for (auto& s : sources) read_source(s, opt, stats, f);
}

}  // namespace sigma::data
