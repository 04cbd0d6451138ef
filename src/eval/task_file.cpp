// Reading task files: every line is checked, and the first problem stops the run with
// "FILE:LINE: what" (a task file is small and hand-made; a silent skip would change the score).
#include <algorithm>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/json_depth.h"
#include "data/jsonl.h"
#include "eval/tasks.h"

namespace sigma::eval {

namespace {

using nlohmann::json;

struct LineCheck {
  const std::string& path;
  uint64_t line;
  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    sigma::fail("{}:{}: {}", path, line, fmt::format(f, std::forward<Args>(args)...));
  }
  std::string text(const json& j, const char* key) const {
    auto it = j.find(key);
    if (it == j.end()) fail("missing \"{}\"", key);
    if (!it->is_string()) fail("\"{}\" must be a string", key);
    return it->get<std::string>();
  }
  std::vector<std::string> texts(const json& j, const char* key) const {
    auto it = j.find(key);
    if (it == j.end()) fail("missing \"{}\"", key);
    if (!it->is_array() || it->empty()) fail("\"{}\" must be a non-empty array of strings", key);
    std::vector<std::string> out;
    for (const json& v : *it) {
      if (!v.is_string()) fail("\"{}\" must be a non-empty array of strings", key);
      out.push_back(v.get<std::string>());
    }
    return out;
  }
};

TaskKind kind_of(const json& j, const LineCheck& at) {
  if (auto t = j.find("type"); t != j.end()) {
    if (*t == "choice") return TaskKind::Choice;
    if (*t == "generate") return TaskKind::Generate;
    if (*t == "code") return TaskKind::Code;
    if (*t == "rolling") return TaskKind::Rolling;
    at.fail("\"type\" must be \"choice\", \"generate\", \"code\" or \"rolling\", not {}", t->dump());
  }
  if (j.contains("choices")) return TaskKind::Choice;
  if (j.contains("tests")) return TaskKind::Code;
  if (j.contains("references")) return TaskKind::Generate;
  if (j.contains("text")) return TaskKind::Rolling;
  at.fail("no \"type\", and neither \"choices\", \"references\", \"tests\" nor \"text\" to tell the kind");
}

void check_keys(const json& j, TaskKind k, const LineCheck& at) {
  static const std::set<std::string> common = {"type", "domain", "id"};
  const std::set<std::string> own =
      k == TaskKind::Choice     ? std::set<std::string>{"context", "choices", "answer"}
      : k == TaskKind::Generate ? std::set<std::string>{"prompt", "references", "tokenize", "stop"}
      : k == TaskKind::Code     ? std::set<std::string>{"prompt", "tests", "stop", "language"}
                                : std::set<std::string>{"text"};
  for (const auto& [key, v] : j.items())
    if (!common.count(key) && !own.count(key)) at.fail("unknown key \"{}\"", key);
}

TaskItem parse_item(const json& j, const LineCheck& at, const std::vector<std::string>& domains) {
  TaskItem it;
  it.kind = kind_of(j, at);
  it.line = at.line;
  it.source = at.path;
  check_keys(j, it.kind, at);
  it.domain = at.text(j, "domain");
  it.doc = j;
  if (!domains.empty() && std::find(domains.begin(), domains.end(), it.domain) == domains.end())
    at.fail("unknown domain '{}' (the model has {})", it.domain, fmt::join(domains, ", "));
  if (it.kind == TaskKind::Choice) {
    it.context = at.text(j, "context");
    it.choices = at.texts(j, "choices");
    auto a = j.find("answer");
    if (a == j.end()) at.fail("missing \"answer\"");
    if (!a->is_number_integer() || a->get<int64_t>() < 0 || a->get<int64_t>() >= int64_t(it.choices.size()))
      at.fail("\"answer\" must be the index of one of the {} choices", it.choices.size());
    it.answer = a->get<int>();
    for (const auto& c : it.choices)
      if (c.empty()) at.fail("a choice is empty");
  } else if (it.kind == TaskKind::Rolling) {
    it.context = at.text(j, "text");
    if (it.context.empty()) at.fail("\"text\" is empty");
  } else {
    it.context = at.text(j, "prompt");
    if (it.context.empty()) at.fail("\"prompt\" is empty");
  }
  if (it.kind == TaskKind::Generate) {
    it.references = at.texts(j, "references");
    if (j.contains("tokenize")) {
      const std::string t = at.text(j, "tokenize");
      if (t != "13a" && t != "zh" && t != "none") at.fail("\"tokenize\" must be 13a, zh or none");
      it.tokenize = bleu_tokenizer(t);
    }
  }
  if (it.kind == TaskKind::Code) {
    it.tests = at.text(j, "tests");
    const std::string lang = j.contains("language") ? at.text(j, "language") : it.domain == "java" ? "java" : "python";
    if (lang != "python" && lang != "java") at.fail("\"language\" must be \"python\" or \"java\", not \"{}\"", lang);
    it.language = lang == "java" ? SandboxLanguage::Java : SandboxLanguage::Python;
    it.stop = it.language == SandboxLanguage::Java ? kJavaCodeStops : kCodeStops;
  }
  if (j.contains("stop")) {  // [] turns the code default off
    if (!j["stop"].is_array()) at.fail("\"stop\" must be an array of strings");
    it.stop.clear();
    for (const json& v : j["stop"]) {
      if (!v.is_string() || v.get<std::string>().empty()) at.fail("\"stop\" must be an array of non-empty strings");
      it.stop.push_back(v.get<std::string>());
    }
  }
  return it;
}

}  // namespace

TaskItem parse_task_item(const json& j, const std::string& path, uint64_t line,
                         const std::vector<std::string>& domains) {
  const LineCheck at{path, line};
  if (!j.is_object()) at.fail("not a JSON object");
  return parse_item(j, at, domains);
}

std::string cut_at_stop(const std::string& text, const std::vector<std::string>& stops) {
  size_t end = text.size();
  for (const std::string& s : stops) end = std::min(end, text.find(s));
  return text.substr(0, end);
}

std::vector<TaskItem> read_task_file(const std::string& path, const std::vector<std::string>& domains) {
  data::LineReader lines(path, 16u << 20);
  std::vector<TaskItem> items;
  std::string line;
  bool too_long = false;
  while (lines.next(line, too_long)) {
    const LineCheck at{path, lines.line_no()};
    if (too_long) at.fail("line longer than 16 MiB");
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (!data::utf8_valid(line)) at.fail("invalid UTF-8");
    const json j = parse_json_or_discard(line);
    if (j.is_discarded() || !j.is_object()) at.fail("not a JSON object (or nested too deep)");
    items.push_back(parse_item(j, at, domains));
  }
  SIGMA_CHECK(!items.empty(), "{}: no task in the file (one JSON object per line; see "
              "docs/evaluation.md)", path);
  return items;
}

}  // namespace sigma::eval
