// Evaluation tasks from JSONL files (docs/evaluation.md): multiple choice scored by
// log-likelihood (acc, acc_norm, acc_bytes), generation scored by exact match and corpus BLEU,
// code scored by pass@k with each sample run against the problem's tests in the sandbox, and
// rolling log-likelihood of whole texts (bits per byte, byte / word / token perplexity).
// A task names its domain, which routes it to the domain's expert group and embedding slot.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "eval/bleu.h"
#include "eval/sandbox.h"
#include "model/domains.h"
#include "model/model.h"

namespace sigma::eval {

enum class TaskKind { Choice, Generate, Code, Rolling };
const char* kind_name(TaskKind k);  // "choice", "generate", "code", "rolling"

struct TaskItem {
  TaskKind kind = TaskKind::Choice;
  std::string domain;
  std::string source;                   // the task file, for messages
  uint64_t line = 0;
  std::string context;                  // choice: the context; generate and code: the prompt;
                                        // rolling: the text scored
  std::vector<std::string> choices;     // choice
  int answer = -1;                      // choice: index of the right one
  std::vector<std::string> references;  // generate
  BleuTokenizer tokenize = BleuTokenizer::V13a;  // generate
  std::string tests;                    // code: run after prompt + completion ("\n\n" between)
  SandboxLanguage language = SandboxLanguage::Python;  // code: "language", else java for the
                                                        // domain "java", else python
  std::vector<std::string> stop;        // generate and code: the answer ends before the first
                                        // (code: kCodeStops unless the item says otherwise)
  nlohmann::json doc;                   // the line as read (kept in --log-samples)
};

// Where a code completion ends when the item names no "stop" (HumanEval's: the next top-level
// statement after the function).
inline const std::vector<std::string> kCodeStops = {"\ndef", "\nclass", "\nif", "\nprint", "\n#"};
// Java: the prompt ends inside a method of 4-space-indented class members; the completion ends
// at the method's closing brace, which the tests put back (they begin "    }\n}\n" and then
// define class Main with main()).
inline const std::vector<std::string> kJavaCodeStops = {"\n    }\n"};

// Reads and checks a whole task file; any problem throws "FILE:LINE: what" (one line).
// `domains` are the model's; a task naming another domain is an error.
std::vector<TaskItem> read_task_file(const std::string& path, const std::vector<std::string>& domains);
// One item from its JSON object (`where` = "FILE:LINE" for errors); an empty `domains` accepts
// any domain (scoring saved generations, where no model says which exist).
TaskItem parse_task_item(const nlohmann::json& j, const std::string& path, uint64_t line,
                         const std::vector<std::string>& domains);
// `text` cut before the first occurrence of any of `stops`.
std::string cut_at_stop(const std::string& text, const std::vector<std::string>& stops);

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
  int bootstrap = 1000;      // resamples for the standard errors (0 = none)
  int score_batch = 32;      // choice items: units (an item's shared prompt) per forward pass
  int num_fewshot = 0;       // solved examples before each item (with_fewshot)
  uint64_t fewshot_seed = 1234;
  SandboxLimits sandbox;
  int jobs = 1;              // code: samples run at once, each in its own sandbox
  bool progress = false;     // progress lines with an ETA on stderr (core/progress.h)
  size_t limit = 0;          // run_tasks: only the file's first `limit` items (0 = all); their
                             // few-shot examples still come from the whole file
};

// How text becomes tokens: the domain's prefix controls and format from the data the model was
// trained on (prepare's registry), else plain text with no prefix.
struct TaskContext {
  Model& model;
  const data::Tokenizer& tok;
  const DomainRegistry* data_domains = nullptr;  // may be null
};

// What the model produced for one item: everything its scores need (--log-samples keeps it,
// --score-generations reads it back).
struct ItemOutput {
  std::string prompt;                    // the prompt as the model saw it (cut to fit the
                                         // context), control tokens spelled out
  int64_t prompt_cut = 0;                // tokens cut from the prompt's start to fit (choice:
                                         // with its longest choice; generate and code: with
                                         // room for max_new tokens); 0 = whole
  std::vector<double> loglik;            // choice: log p(choice | context) per choice;
                                         // rolling: the sum of log p per window
  std::vector<int64_t> tokens;           // choice: tokens per choice; rolling: per window
  std::vector<std::string> generations;  // generate: one answer; code: --samples completions
};

// The items with `n` solved examples before each one's context: other items of the same kind
// and domain from the same file (never the item itself), drawn without replacement by a
// sampler seeded with (seed, item line), so a rerun shows the same shots. Layout per shot:
// context + answer (a choice item's right choice, a generation item's first reference, a code
// item's tests are not an answer: code items take no shots) + "\n\n"; then the item's context.
// Only the first `first` items are returned (--limit); their shots come from all of `items`.
std::vector<TaskItem> with_fewshot(const std::vector<TaskItem>& items, int n, uint64_t seed,
                                   size_t first = SIZE_MAX);

// Runs the model on every item. A rolling item's text (the domain's prefix controls, else an
// <EOT>, before it; no <EOT> after) is scored token by token in disjoint windows of at most the
// model's context: the first window sees the text from its start, each later one predicts the
// next `context` tokens from the token before them, the last one with as much context as fits
// (lm-evaluation-harness's loglikelihood_rolling).
std::vector<ItemOutput> run_model(const TaskContext& ctx, const std::vector<TaskItem>& items,
                                  const TaskOptions& opt);

// The scores of `items` given the model's outputs (code samples run in the sandbox here):
// {"items", "choice": {...}, "generate": {...}, "code": {...}} with only the kinds present,
// each metric with its bootstrap standard error ("acc_stderr"...). With `log`, one record per
// item (the --log-samples line: doc, prompt, outputs, per-item metric values, code outcomes).
nlohmann::json score_items(const std::vector<TaskItem>& items, const std::vector<ItemOutput>& outs,
                           const TaskOptions& opt, std::vector<nlohmann::json>* log = nullptr);

// run_model then score_items (on the first opt.limit items, when set).
nlohmann::json run_tasks(const TaskContext& ctx, const std::vector<TaskItem>& items,
                         const TaskOptions& opt, std::vector<nlohmann::json>* log = nullptr);

// Reads a --log-samples file back: the items (from each line's "doc") and their outputs.
// Errors name the file and line.
void read_sample_log(const std::string& path, std::vector<TaskItem>& items,
                     std::vector<ItemOutput>& outs);

}  // namespace sigma::eval
