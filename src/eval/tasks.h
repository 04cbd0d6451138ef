// Evaluation tasks from JSONL files (docs/evaluation.md): multiple choice scored by
// log-likelihood (acc, acc_norm, acc_bytes), generation scored by exact match and corpus BLEU,
// and code scored by pass@k with each sample run against the problem's tests in the sandbox.
// A task names its domain, which routes it to the domain's expert group and embedding slot.
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "eval/bleu.h"
#include "eval/sandbox.h"
#include "model/domains.h"
#include "model/model.h"

namespace sigma::eval {

enum class TaskKind { Choice, Generate, Code };

struct TaskItem {
  TaskKind kind = TaskKind::Choice;
  std::string domain;
  uint64_t line = 0;
  std::string context;                  // choice: the context; generate and code: the prompt
  std::vector<std::string> choices;     // choice
  int answer = -1;                      // choice: index of the right one
  std::vector<std::string> references;  // generate
  BleuTokenizer tokenize = BleuTokenizer::V13a;  // generate
  std::string tests;                    // code: Python run after prompt + completion
};

// Reads and checks a whole task file; any problem throws "FILE:LINE: what" (one line).
// `domains` are the model's; a task naming another domain is an error.
std::vector<TaskItem> read_task_file(const std::string& path, const std::vector<std::string>& domains);

// acc picks the largest log-likelihood; acc_norm divides it by the continuation's length in
// characters, acc_bytes by its length in UTF-8 bytes. Ties go to the first choice.
int best_choice(const std::vector<double>& loglik, const std::vector<double>& divisor);
size_t utf8_chars(std::string_view s);

struct TaskOptions {
  int samples = 1;           // code: completions per problem (n of pass@k)
  std::vector<int> k = {1};  // code: the k of pass@k (each <= samples)
  float temperature = 0;     // 0 = greedy
  int top_k = 0;
  float top_p = 1;
  uint64_t seed = 0;
  int max_new = 64;          // tokens generated at most per answer
  SandboxLimits sandbox;
};

// How text becomes tokens: the domain's prefix controls and format from the data the model was
// trained on (prepare's registry), else plain text with no prefix.
struct TaskContext {
  Model& model;
  const data::Tokenizer& tok;
  const DomainRegistry* data_domains = nullptr;  // may be null
};

// Runs every item; returns {"items", "choice": {...}, "generate": {...}, "code": {...}} with
// only the kinds present.
nlohmann::json run_tasks(const TaskContext& ctx, const std::vector<TaskItem>& items,
                         const TaskOptions& opt);

}  // namespace sigma::eval
