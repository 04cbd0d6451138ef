// The metrics of task items from the model's outputs alone (tasks.h score_items): accuracy,
// exact match, BLEU and chrF, pass@k with the samples run in sandboxes (several at once), and
// bits per byte of rolling log-likelihoods; each with its bootstrap standard error.
#include "eval/task_scores.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numbers>

#include "core/error.h"
#include "core/progress.h"
#include "eval/pass_at_k.h"

namespace sigma::eval::scoring {

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

double mean_of(const std::vector<double>& v, const std::vector<size_t>& idx) {
  double s = 0;
  for (size_t i : idx) s += v[i];
  return s / double(idx.size());
}

// Adds "NAME" (the mean) and "NAME_stderr" for per-item values.
void add_mean(json& out, const std::string& name, const std::vector<double>& v, int reps) {
  std::vector<size_t> all(v.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  out[name] = mean_of(v, all);
  out[name + "_stderr"] = bootstrap_stderr(v.size(), reps, [&](const auto& idx) { return mean_of(v, idx); });
}

}  // namespace

json score_choices(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                   const TaskOptions& opt, std::vector<json*>& log) {
  std::vector<double> acc, norm, bytes;
  for (size_t i = 0; i < items.size(); ++i) {
    const TaskItem& it = *items[i];
    const ItemOutput& o = *outs[i];
    SIGMA_CHECK(o.loglik.size() == it.choices.size(), "line {}: {} log-likelihoods for {} choices",
                it.line, o.loglik.size(), it.choices.size());
    std::vector<double> chars, nbytes;
    for (const std::string& c : it.choices) {
      chars.push_back(double(utf8_chars(c)));
      nbytes.push_back(double(c.size()));
    }
    const int p_acc = best_choice(o.loglik, std::vector<double>(o.loglik.size(), 1.0));
    const int p_norm = best_choice(o.loglik, chars), p_bytes = best_choice(o.loglik, nbytes);
    acc.push_back(p_acc == it.answer);
    norm.push_back(p_norm == it.answer);
    bytes.push_back(p_bytes == it.answer);
    if (log[i]) {
      json& r = *log[i];
      r["loglik"] = o.loglik;
      r["tokens"] = o.tokens;
      r["chars"] = chars;
      r["bytes"] = nbytes;
      r["pred"] = {{"acc", p_acc}, {"acc_norm", p_norm}, {"acc_bytes", p_bytes}};
      r["metrics"] = {{"acc", acc.back()}, {"acc_norm", norm.back()}, {"acc_bytes", bytes.back()}};
    }
  }
  json out = {{"items", items.size()}};
  add_mean(out, "acc", acc, opt.bootstrap);
  add_mean(out, "acc_norm", norm, opt.bootstrap);
  add_mean(out, "acc_bytes", bytes, opt.bootstrap);
  return out;
}

const char* tok_name(BleuTokenizer t) {
  return t == BleuTokenizer::V13a ? "13a" : t == BleuTokenizer::Zh ? "zh" : "none";
}

json score_generation(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                      const TaskOptions& opt, std::vector<json*>& log) {
  std::vector<double> exact;
  std::vector<std::string> hyps;
  std::vector<std::vector<std::string>> refs;
  std::vector<ChrfStats> chrf;
  std::map<BleuTokenizer, std::vector<size_t>> by_tok;  // item indices per tokeniser
  for (size_t i = 0; i < items.size(); ++i) {
    const TaskItem& it = *items[i];
    SIGMA_CHECK(outs[i]->generations.size() == 1, "line {}: a generation item needs one "
                "generation, not {}", it.line, outs[i]->generations.size());
    const std::string out = trim(cut_at_stop(outs[i]->generations[0], it.stop));
    exact.push_back(std::any_of(it.references.begin(), it.references.end(),
                                [&](const std::string& r) { return trim(r) == out; }));
    hyps.push_back(out);
    refs.push_back(it.references);
    chrf.push_back(chrf_segment(out, it.references));
    by_tok[it.tokenize].push_back(i);
    if (log[i]) {
      (*log[i])["generations"] = json::array({cut_at_stop(outs[i]->generations[0], it.stop)});
      (*log[i])["metrics"] = {{"exact_match", exact.back()}, {"chrf", chrf_from_stats(chrf.back())}};
    }
  }
  json out = {{"items", items.size()}};
  add_mean(out, "exact_match", exact, opt.bootstrap);
  json bleu = json::object();
  for (const auto& [t, which] : by_tok) {
    std::vector<BleuStats> seg;
    std::vector<std::vector<std::string>> r;
    BleuStats sum;
    for (size_t i : which) {
      seg.push_back(bleu_segment(hyps[i], refs[i], t));
      r.push_back(refs[i]);
      sum += seg.back();
    }
    const BleuScore b = bleu_from_stats(sum);
    const double se = bootstrap_stderr(seg.size(), opt.bootstrap, [&](const auto& idx) {
      BleuStats s;
      for (size_t i : idx) s += seg[i];
      return bleu_from_stats(s).score;
    });
    bleu[tok_name(t)] = {{"score", b.score}, {"stderr", se}, {"precisions", b.precisions},
                         {"bp", b.bp}, {"sys_len", b.sys_len}, {"ref_len", b.ref_len},
                         {"items", which.size()}, {"signature", bleu_signature(r, t)}};
  }
  out["bleu"] = bleu;
  ChrfStats sum;
  for (const ChrfStats& s : chrf) sum += s;
  out["chrf"] = {{"score", chrf_from_stats(sum)},
                 {"stderr", bootstrap_stderr(chrf.size(), opt.bootstrap, [&](const auto& idx) {
                    ChrfStats s;
                    for (size_t i : idx) s += chrf[i];
                    return chrf_from_stats(s);
                  })},
                 {"signature", chrf_signature(refs)}};
  return out;
}

json score_code(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                const TaskOptions& opt, std::vector<json*>& log) {
  const int n = int(outs.empty() ? opt.samples : outs[0]->generations.size());
  for (int k : opt.k)
    SIGMA_CHECK(k >= 1 && k <= n, "pass@{} needs at least {} samples per problem (there are {})", k, k, n);
  std::vector<std::vector<double>> per_k(opt.k.size());
  int64_t passed = 0;
  std::string protections;  // as the first sample's child reported them
  json failures = json::object();  // why samples failed, counted by outcome
  std::vector<SandboxProgram> programs;
  std::vector<json> cut(items.size(), json::array());
  for (size_t i = 0; i < items.size(); ++i) {
    const TaskItem& it = *items[i];
    SIGMA_CHECK(int(outs[i]->generations.size()) == n, "line {}: {} samples where the other "
                "problems have {}", it.line, outs[i]->generations.size(), n);
    for (const std::string& raw : outs[i]->generations) {  // saved ones may not be cut yet
      const std::string completion = cut_at_stop(raw, it.stop);
      cut[i].push_back(completion);
      programs.push_back({it.language, it.context + completion + "\n\n" + it.tests + "\n"});
    }
  }
  // Up to opt.jobs samples at once, each in its own sandbox; the results come back in order,
  // so the scores are those of one sample after the other.
  Progress shown("sigma eval: code runs", programs.size(), "samples", opt.progress);
  const std::vector<SandboxResult> ran = run_sandboxed_many(
      programs, opt.sandbox, std::max(1, opt.jobs), [&](size_t, const SandboxResult&) { shown.add(); });
  for (size_t i = 0; i < items.size(); ++i) {
    int c = 0;
    json outcomes = json::array();
    for (int j = 0; j < n; ++j) {
      const SandboxResult& r = ran[i * size_t(n) + size_t(j)];
      c += r.passed;
      if (protections.empty()) protections = r.protections;
      if (!r.passed) failures[r.outcome] = failures.value(r.outcome, 0) + 1;
      json o = {{"outcome", r.outcome}, {"why", r.why}};
      if (r.exit_code >= 0) o["exit_code"] = r.exit_code;
      if (r.signal) o["signal"] = r.signal;
      outcomes.push_back(o);
    }
    passed += c;
    json m = json::object();
    for (size_t j = 0; j < opt.k.size(); ++j) {
      per_k[j].push_back(pass_at_k(n, c, opt.k[j]));
      m[fmt::format("pass@{}", opt.k[j])] = per_k[j].back();
    }
    if (log[i]) {
      (*log[i])["generations"] = cut[i];
      (*log[i])["outcomes"] = outcomes;
      (*log[i])["passed"] = c;
      (*log[i])["metrics"] = m;
    }
  }
  json out = {{"items", items.size()}, {"samples", n}, {"passed", passed},
              {"failures", failures}, {"sandbox", protections}};
  for (size_t j = 0; j < opt.k.size(); ++j) add_mean(out, fmt::format("pass@{}", opt.k[j]), per_k[j], opt.bootstrap);
  return out;
}


size_t count_words(std::string_view s) {
  size_t n = 0;
  bool in = false;
  for (unsigned char c : s) {
    const bool blank = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
    n += !blank && !in;
    in = !blank;
  }
  return n;
}

json score_rolling(const std::vector<const TaskItem*>& items, const std::vector<const ItemOutput*>& outs,
                   const TaskOptions& opt, std::vector<json*>& log) {
  // Per document: its negative log-likelihood in nats (the windows' sums, in order), the
  // UTF-8 bytes and blank-separated words of its text, and the tokens scored.
  std::vector<double> nats, bytes, words;
  double tokens = 0;
  struct Domain {
    double nats = 0, bytes = 0, words = 0, tokens = 0;
    size_t documents = 0;
  };
  std::map<std::string, Domain> by_domain;
  for (size_t i = 0; i < items.size(); ++i) {
    const TaskItem& it = *items[i];
    const ItemOutput& o = *outs[i];
    SIGMA_CHECK(!o.loglik.empty() && o.tokens.size() == o.loglik.size(), "line {}: a rolling "
                "item needs one log-likelihood and one token count per window ({} and {})",
                it.line, o.loglik.size(), o.tokens.size());
    double d = 0, t = 0;
    for (size_t w = 0; w < o.loglik.size(); ++w) d -= o.loglik[w], t += double(o.tokens[w]);
    nats.push_back(d);
    bytes.push_back(double(it.context.size()));
    words.push_back(double(count_words(it.context)));
    tokens += t;
    Domain& dom = by_domain[it.domain];
    dom.nats += d, dom.bytes += bytes.back(), dom.words += words.back(), dom.tokens += t;
    ++dom.documents;
    if (log[i]) {
      json& r = *log[i];
      r["loglik"] = o.loglik;
      r["tokens"] = o.tokens;
      r["bytes"] = bytes.back();
      r["words"] = words.back();
      r["metrics"] = {{"nats", d}, {"bits_per_byte", d / (std::numbers::ln2 * bytes.back())}};
    }
  }
  double all_nats = 0, all_bytes = 0, all_words = 0;
  for (size_t i = 0; i < nats.size(); ++i) all_nats += nats[i], all_bytes += bytes[i], all_words += words[i];
  auto rates = [](double n, double b, double w, double t) {
    json j = {{"nats", n}, {"bytes", b}, {"words", w}, {"tokens", t},
              {"bits_per_byte", n / (std::numbers::ln2 * b)}, {"byte_perplexity", std::exp(n / b)},
              {"token_perplexity", std::exp(n / t)}};
    j["word_perplexity"] = w > 0 ? json(std::exp(n / w)) : json(nullptr);
    return j;
  };
  json out = rates(all_nats, all_bytes, all_words, tokens);
  out["items"] = items.size();
  out["bits_per_byte_stderr"] = bootstrap_stderr(nats.size(), opt.bootstrap, [&](const auto& idx) {
    double n = 0, b = 0;
    for (size_t i : idx) n += nats[i], b += bytes[i];
    return n / (std::numbers::ln2 * b);
  });
  json doms = json::object();
  for (const auto& [name, d] : by_domain) {
    doms[name] = rates(d.nats, d.bytes, d.words, d.tokens);
    doms[name]["items"] = d.documents;
  }
  out["domains"] = doms;
  return out;
}

}  // namespace sigma::eval::scoring
