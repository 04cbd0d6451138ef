// Corpus reading: JSONL records {"text", "domain", optional "prompt"} (fine-tuning pairs may
// say {"prompt", "answer"}: "answer" is read as "text"), or one folder per domain of
// .jsonl / .txt files (a .txt file is one sample). Bad records are skipped and counted with a
// message naming file:line; input that cannot be read at all throws sigma::Error.
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace sigma::data {

struct Record {
  std::string text;
  std::string prompt;  // fine-tuning prompt, "" when none
  std::string domain;
  const std::string* file = nullptr;
  uint64_t line = 0;  // 1-based; 0 for a whole .txt file
};

// An input file and the domain its folder gives it ("" = records must name their domain).
struct Source {
  std::string path;
  std::string domain;
  bool whole_file = false;  // .txt: the file is one record
};

struct ReadOptions {
  size_t max_line_bytes = 64u << 20;  // longer lines (or .txt files) are skipped, not stored
  std::vector<std::string> domains;   // declared domains; empty accepts any
  size_t max_messages = 20;           // skip messages kept (all skips are still counted)
};

struct ReadStats {
  uint64_t records = 0, text_bytes = 0;
  uint64_t too_long = 0, bad_json = 0, bad_utf8 = 0, no_text = 0, bad_domain = 0, empty_files = 0;
  std::vector<std::string> messages;  // "FILE:LINE: why", the first max_messages of them
  uint64_t skipped() const { return too_long + bad_json + bad_utf8 + no_text + bad_domain; }
  std::string summary() const;  // one line: counts of records and of each kind of skip
};

// Streams a file line by line in fixed-size reads; a line longer than the cap is consumed
// without being stored and reported as too long.
class LineReader {
 public:
  LineReader(const std::string& path, size_t max_line);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;
  // Next line without its '\n'; false at end of file. `too_long` marks a capped line (empty).
  bool next(std::string& line, bool& too_long);
  uint64_t line_no() const { return line_no_; }
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  bool fill();
  std::string path_;
  std::FILE* f_ = nullptr;
  std::vector<char> buf_;
  size_t pos_ = 0, end_ = 0, max_line_;
  uint64_t line_no_ = 0, bytes_read_ = 0;
  bool eof_ = false;
};

// Expands corpus paths, in sorted order: a .jsonl/.txt file is one source; a folder with
// subfolders gives each subfolder as a domain (files directly inside: records name the domain);
// a folder with only files is itself one domain, named by the folder.
std::vector<Source> expand_corpus(const std::vector<std::string>& paths);

using RecordFn = std::function<void(Record&)>;
void read_source(const Source& src, const ReadOptions& opt, ReadStats& stats, const RecordFn& f);
void read_corpus(const std::vector<Source>& sources, const ReadOptions& opt, ReadStats& stats,
                 const RecordFn& f);

}  // namespace sigma::data
