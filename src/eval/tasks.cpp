// Scoring task items with a model: log-likelihoods for multiple choice, decoding for generation
// and code, then the metrics.
#include "eval/tasks.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "core/rng.h"
#include "data/prepare.h"
#include "eval/pass_at_k.h"
#include "infer/generate.h"

namespace sigma::eval {

namespace {

using nlohmann::json;

const DomainSpec& spec_of(const TaskContext& ctx, const std::string& domain) {
  static const DomainSpec plain;
  if (!ctx.data_domains) return plain;
  const DomainSpec* s = ctx.data_domains->find(domain);
  return s ? *s : plain;
}

// Prompt tokens and answer tokens formatted as fine-tuning formats a sample (prefix, prompt,
// answer; bilingual domains tag lines <EN>/<CN>), without the final <EOT>.
void format(const TaskContext& ctx, const TaskItem& it, const std::string& answer,
            std::vector<int32_t>& prompt, std::vector<int32_t>& rest) {
  std::vector<uint32_t> ids;
  const uint32_t plen = data::format_sample(ctx.tok, spec_of(ctx, it.domain), it.context, answer, ids);
  ids.pop_back();  // <EOT>
  prompt.assign(ids.begin(), ids.begin() + plen);
  rest.assign(ids.begin() + plen, ids.end());
}

// log p(rest | prompt) under the model, the prompt cut from the left to fit the context.
double loglik(const TaskContext& ctx, const TaskItem& it, std::vector<int32_t> prompt,
              const std::vector<int32_t>& rest) {
  const int context = ctx.model.config().context;
  SIGMA_CHECK(int(rest.size()) < context, "line {}: a choice of {} tokens does not fit the "
              "model's context of {}", it.line, rest.size(), context);
  SIGMA_CHECK(!rest.empty(), "line {}: a choice encodes to no tokens", it.line);
  if (prompt.empty()) prompt.push_back(int32_t(data::kEotId));  // start-of-text: an <EOT>
  const size_t keep = std::min(prompt.size(), size_t(context) + 1 - rest.size());
  std::vector<int32_t> seq(prompt.end() - keep, prompt.end());
  seq.insert(seq.end(), rest.begin(), rest.end());
  Batch b;
  b.resize(1, int(seq.size()) - 1);
  std::copy(seq.begin(), seq.end() - 1, b.tokens.begin());
  std::copy(seq.begin() + 1, seq.end(), b.targets.begin());
  b.domain[0] = ctx.model.config().domain_index(it.domain);
  std::vector<float> loss(seq.size() - 1);
  ctx.model.expert_executor().begin_step({&b, 1});
  ctx.model.forward(b, loss.data());
  double sum = 0;
  for (size_t t = keep - 1; t < loss.size(); ++t) sum -= loss[t];
  return sum;
}

json score_choices(const TaskContext& ctx, const std::vector<const TaskItem*>& items) {
  int64_t acc = 0, norm = 0, bytes = 0;
  for (const TaskItem* it : items) {
    std::vector<double> ll, chars, nbytes;
    for (const std::string& c : it->choices) {
      std::vector<int32_t> prompt, rest;
      format(ctx, *it, c, prompt, rest);
      ll.push_back(loglik(ctx, *it, prompt, rest));
      chars.push_back(double(utf8_chars(c)));
      nbytes.push_back(double(c.size()));
    }
    acc += best_choice(ll, std::vector<double>(ll.size(), 1.0)) == it->answer;
    norm += best_choice(ll, chars) == it->answer;
    bytes += best_choice(ll, nbytes) == it->answer;
  }
  const double n = double(items.size());
  return {{"items", items.size()}, {"acc", acc / n}, {"acc_norm", norm / n}, {"acc_bytes", bytes / n}};
}

// One answer: decoded until <EOT> or max_new tokens, control tokens left out of the text.
std::string answer(const TaskContext& ctx, const TaskItem& it, const TaskOptions& opt, int sample) {
  std::vector<int32_t> prompt, rest;
  format(ctx, it, "", prompt, rest);
  const int context = ctx.model.config().context;
  const int max_new = std::min(opt.max_new, context - 1);
  if (int(prompt.size()) > context - max_new) prompt.erase(prompt.begin(), prompt.end() - (context - max_new));
  SamplingConfig s;
  s.temperature = opt.temperature;
  s.top_k = opt.top_k;
  s.top_p = opt.top_p;
  s.seed = rng_u64(opt.seed, it.line, uint64_t(sample));
  s.max_new_tokens = max_new;
  s.stop_token = int(data::kEotId);
  const auto out = generate(ctx.model, ctx.model.config().domain_index(it.domain), prompt, s);
  std::vector<uint32_t> text;
  for (int32_t id : out)
    if (id >= 0 && !ctx.tok.is_control(uint32_t(id)) && id < int32_t(ctx.tok.vocab_size()))
      text.push_back(uint32_t(id));
  return ctx.tok.decode(text);
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

json score_generation(const TaskContext& ctx, const std::vector<const TaskItem*>& items,
                      const TaskOptions& opt) {
  int64_t exact = 0;
  std::map<BleuTokenizer, std::pair<std::vector<std::string>, std::vector<std::vector<std::string>>>> by_tok;
  for (const TaskItem* it : items) {
    const std::string out = trim(answer(ctx, *it, opt, 0));
    exact += std::any_of(it->references.begin(), it->references.end(),
                         [&](const std::string& r) { return trim(r) == out; });
    by_tok[it->tokenize].first.push_back(out);
    by_tok[it->tokenize].second.push_back(it->references);
  }
  json bleu = json::object();
  for (const auto& [t, hr] : by_tok) {
    const BleuScore b = corpus_bleu(hr.first, hr.second, t);
    const char* name = t == BleuTokenizer::V13a ? "13a" : t == BleuTokenizer::Zh ? "zh" : "none";
    bleu[name] = {{"score", b.score}, {"precisions", b.precisions}, {"bp", b.bp},
                  {"sys_len", b.sys_len}, {"ref_len", b.ref_len}, {"items", hr.first.size()}};
  }
  return {{"items", items.size()}, {"exact_match", double(exact) / double(items.size())},
          {"bleu", bleu}};
}

json score_code(const TaskContext& ctx, const std::vector<const TaskItem*>& items,
                const TaskOptions& opt) {
  std::vector<double> sums(opt.k.size(), 0.0);
  int64_t passed = 0;
  std::string protections;  // as the first sample's child reported them
  json failures = json::object();  // why samples failed, counted by reason's first word
  for (const TaskItem* it : items) {
    int c = 0;
    for (int j = 0; j < opt.samples; ++j) {
      const std::string program = it->context + answer(ctx, *it, opt, j) + "\n\n" + it->tests + "\n";
      const SandboxResult r = run_python_sandboxed(program, opt.sandbox);
      c += r.passed;
      if (protections.empty()) protections = r.protections;
      if (!r.passed) {
        const std::string kind = r.why.substr(0, r.why.find(' '));
        failures[kind] = failures.value(kind, 0) + 1;
      }
    }
    passed += c;
    for (size_t i = 0; i < opt.k.size(); ++i) sums[i] += pass_at_k(opt.samples, c, opt.k[i]);
  }
  json out = {{"items", items.size()}, {"samples", opt.samples}, {"passed", passed},
              {"failures", failures}, {"sandbox", protections}};
  for (size_t i = 0; i < opt.k.size(); ++i)
    out[fmt::format("pass@{}", opt.k[i])] = sums[i] / double(items.size());
  return out;
}

}  // namespace

size_t utf8_chars(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

int best_choice(const std::vector<double>& loglik, const std::vector<double>& divisor) {
  SIGMA_CHECK(!loglik.empty() && loglik.size() == divisor.size(), "best_choice: bad sizes");
  int best = 0;
  for (size_t i = 1; i < loglik.size(); ++i)
    if (loglik[i] / divisor[i] > loglik[size_t(best)] / divisor[size_t(best)]) best = int(i);
  return best;
}

json run_tasks(const TaskContext& ctx, const std::vector<TaskItem>& items, const TaskOptions& opt) {
  std::vector<const TaskItem*> by_kind[3];
  for (const TaskItem& it : items) by_kind[int(it.kind)].push_back(&it);
  if (!by_kind[2].empty())  // checked before any scoring: a bad k should not waste a run
    for (int k : opt.k)
      SIGMA_CHECK(k >= 1 && k <= opt.samples, "pass@{} needs at least {} samples per problem "
                  "(--samples {})", k, k, opt.samples);
  json out = {{"items", items.size()}};
  if (!by_kind[0].empty()) out["choice"] = score_choices(ctx, by_kind[0]);
  if (!by_kind[1].empty()) out["generate"] = score_generation(ctx, by_kind[1], opt);
  if (!by_kind[2].empty()) out["code"] = score_code(ctx, by_kind[2], opt);
  return out;
}

}  // namespace sigma::eval
