// Scoring task items with a model: log-likelihoods for multiple choice, decoding for generation
// and code (run_model); then the metrics from those outputs alone (score_items), so that a
// --log-samples file can be scored again without the model.
#include "eval/tasks.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <span>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "core/progress.h"
#include "core/json_depth.h"
#include "core/rng.h"
#include "data/jsonl.h"
#include "data/prepare.h"
#include "eval/task_scores.h"
#include "infer/generate.h"
#include "kernels/ops.h"

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

std::string prompt_text(const TaskContext& ctx, const std::vector<int32_t>& prompt) {
  return ctx.tok.decode(std::vector<uint32_t>(prompt.begin(), prompt.end()));
}

// Cuts `prompt` to `budget` tokens as the model will see it and returns how many were cut: the
// domain's prefix controls (<Python>) stay, the text after them loses its start, so few-shot
// examples go before the item's own prompt does (they come first).
int64_t fit_prompt(const TaskContext& ctx, const TaskItem& it, std::vector<int32_t>& prompt,
                   size_t budget) {
  if (prompt.size() <= budget) return 0;
  const int64_t cut = int64_t(prompt.size() - budget);
  const size_t head = spec_of(ctx, it.domain).prefix.size();
  const size_t from = head < budget ? head : 0;
  prompt.erase(prompt.begin() + std::ptrdiff_t(from), prompt.begin() + std::ptrdiff_t(from) + cut);
  return cut;
}

// The prompt tokens of a generated answer: room is left for max_new tokens.
int answer_budget(const TaskContext& ctx, const TaskOptions& opt) {
  const int context = ctx.model.config().context;
  return context - std::min(opt.max_new, context - 1);
}

// One item's choices as the model scores them: each choice's window is the prompt, cut from
// the left so that the window has at most context + 1 tokens, then the choice; the choice's
// log-likelihood sums the losses of its own tokens. Choices whose windows keep the same number
// of prompt tokens share those positions (same tokens, same positions), so a Unit computes
// them once into a KV-cache row and runs each of its choices from there.
struct Unit {
  size_t item;
  std::vector<int32_t> prefix;              // window[0 .. keep-2]: computed once (may be empty)
  int32_t last;                             // window[keep-1]: each choice pass starts with it
  std::vector<size_t> choice;               // the item's choice indices
  std::vector<std::vector<int32_t>> rests;  // their tokens (the targets of the choice passes)
  size_t longest = 0;                       // its longest choice
};

// A rolling item's windows (tasks.h run_model) as one-choice units: window w is "choice" w of
// the item, so its log-likelihood lands in loglik[w].
void rolling_units(const TaskContext& ctx, const TaskItem& it, size_t i, std::vector<Unit>& units,
                   ItemOutput& out) {
  const size_t context = size_t(ctx.model.config().context);
  std::vector<uint32_t> ids;
  size_t head = data::format_sample(ctx.tok, spec_of(ctx, it.domain), "", it.context, ids);
  ids.pop_back();  // <EOT>: the text is scored, not its end
  std::vector<int32_t> f(ids.begin(), ids.end());
  if (head == 0) f.insert(f.begin(), int32_t(data::kEotId)), head = 1;  // start-of-text
  SIGMA_CHECK(f.size() > head, "{}:{}: the text encodes to no tokens", it.source, it.line);
  SIGMA_CHECK(head <= context, "{}:{}: the domain's {} prefix controls leave no room in the "
              "model's context of {}", it.source, it.line, head, context);
  out.prompt = prompt_text(ctx, std::vector<int32_t>(f.begin(), f.begin() + std::ptrdiff_t(head)));
  out.loglik.clear(), out.tokens.clear();
  for (size_t s = head; s < f.size();) {
    // Predicts f[s, e) from f[a, e - 1): at most `context` positions.
    const size_t e = std::min(f.size(), s == head ? context + 1 : s + context);
    const size_t a = e - 1 > context ? e - 1 - context : 0;
    Unit u;
    u.item = i;
    u.prefix.assign(f.begin() + std::ptrdiff_t(a), f.begin() + std::ptrdiff_t(s - 1));
    u.last = f[s - 1];
    u.choice = {out.loglik.size()};
    u.rests = {std::vector<int32_t>(f.begin() + std::ptrdiff_t(s), f.begin() + std::ptrdiff_t(e))};
    u.longest = e - s;
    units.push_back(std::move(u));
    out.loglik.push_back(0.0), out.tokens.push_back(0);
    s = e;
  }
}

// The units of the choice and rolling items, in item order; checks each choice fits the context.
std::vector<Unit> units_of(const TaskContext& ctx, const std::vector<TaskItem>& items,
                           const std::vector<size_t>& which, std::vector<ItemOutput>& outs) {
  const int context = ctx.model.config().context;
  std::vector<Unit> units;
  std::vector<int32_t> prompt, rest;
  for (size_t i : which) {
    const TaskItem& it = items[i];
    if (it.kind == TaskKind::Rolling) {
      rolling_units(ctx, it, i, units, outs[i]);
      continue;
    }
    const std::string where = it.source.empty() ? fmt::format("line {}", it.line)
                                                : fmt::format("{}:{}", it.source, it.line);
    std::map<size_t, Unit> by_keep;
    for (size_t c = 0; c < it.choices.size(); ++c) {
      const std::string& choice = it.choices[c];
      format(ctx, it, choice, prompt, rest);
      // A window of context + 1 tokens holds the choice after at least one prompt token.
      SIGMA_CHECK(int(rest.size()) <= context, "{}: the choice '{}' is {} tokens, longer than the "
                  "model's context of {} allows", where, choice.substr(0, 40), rest.size(), context);
      SIGMA_CHECK(!rest.empty(), "{}: the choice '{}' encodes to no tokens", where, choice.substr(0, 40));
      if (prompt.empty()) prompt.push_back(int32_t(data::kEotId));  // start-of-text: an <EOT>
      // The window: the prompt cut to fit (the same tokens for every choice of this length).
      const int64_t cut = fit_prompt(ctx, it, prompt, size_t(context) + 1 - rest.size());
      if (cut > outs[i].prompt_cut || c == 0) {  // the log shows the most cut prompt
        outs[i].prompt_cut = cut;
        outs[i].prompt = prompt_text(ctx, prompt);
      }
      const size_t keep = prompt.size();
      Unit& u = by_keep[keep];
      if (u.choice.empty()) {
        u.item = i;
        u.prefix.assign(prompt.begin(), prompt.end() - 1);
        u.last = prompt.back();
      }
      u.choice.push_back(c);
      u.longest = std::max(u.longest, rest.size());
      u.rests.push_back(rest);
    }
    for (auto& [keep, u] : by_keep) units.push_back(std::move(u));
    outs[i].loglik.assign(it.choices.size(), 0.0);
    outs[i].tokens.assign(it.choices.size(), 0);
  }
  return units;
}

// The choice items' log-likelihoods, `rows` units per pass: units sorted by length, each
// unit's prefix computed once into its KV-cache row (one pass for the R units' prefixes), then
// each choice as [last prefix token, choice tokens but the last] from there (one pass per
// choice index, the rows' lengths set back to their prefixes in between). Rows are padded at
// their end (causal attention keeps padding out of real positions).
//
// Inside ops::BatchInvariant a position's loss has the same bits whatever shares its pass and
// however many positions its pass computes, so a log-likelihood does not depend on `rows`
// (1 included), on the other items, or on the cut of the prompt being cached: tests/
// test_eval_audit_cli.cpp checks it to the bit. For the same reason the passes can run on
// several threads at once, each on its own cache and activations with one-threaded kernels:
// on a small model a pass's products are too small to share well between threads (issue 28:
// 1.6 cores' worth of CPU in 2 cores of wall time), whole passes side by side are not.
constexpr size_t kKeptShapes = 4;

// One scoring thread's cache, activations and scratch; score() takes up to `rows` units.
class Scorer {
 public:
  Scorer(const TaskContext& ctx, const std::vector<TaskItem>& items, int rows,
         std::vector<ItemOutput>& outs)
      : ctx_(ctx), items_(items), outs_(outs), rows_(rows), context_(ctx.model.config().context) {
    cache_.reset(ctx.model.config(), rows == 1 ? 1 : 2 * rows, ctx.model.kv_cache_dtype());  // 2nd half: idle rows
  }

  // Units of one choice (a prompt cut for it alone, or a one-choice item) share nothing: each
  // whole window is one row from position 0.
  void whole(std::span<const Unit* const> units) {
    clear();
    for (size_t k = 0; k < units.size(); ++k) {
      const Unit& u = *units[k];
      cache_.clear(int(k));
      std::vector<int32_t> t = u.prefix, y(u.prefix.begin() + std::min<size_t>(1, u.prefix.size()), u.prefix.end());
      t.push_back(u.last);
      t.insert(t.end(), u.rests[0].begin(), u.rests[0].end() - 1);
      if (!u.prefix.empty()) y.push_back(u.last);
      y.insert(y.end(), u.rests[0].begin(), u.rests[0].end());
      add(u, int(k), std::move(t), std::move(y));
    }
    collect(run(), std::vector<size_t>(units.size(), 0));
  }

  // Units of several choices: their prefixes in one pass, then each choice index from them.
  void shared(std::span<const Unit* const> units) {
    clear();
    for (size_t k = 0; k < units.size(); ++k) {
      const Unit& u = *units[k];
      cache_.clear(int(k));
      if (!u.prefix.empty()) add(u, int(k), u.prefix, {});
    }
    if (!members_.empty()) run(false);  // keys and values only: no prefix position is scored
    size_t most = 0;
    for (const Unit* u : units) most = std::max(most, u->rests.size());
    for (size_t c = 0; c < most; ++c) {
      // The pass's length T fits every row's choice; a row whose prefix leaves less room than
      // T starts at position context - T instead, its last cached positions computed again
      // (the same bits), so that one pass of a few shapes takes every row.
      size_t T = 1;
      for (const Unit* u : units)
        if (c < u->rests.size()) T = std::max(T, u->rests[c].size());
      T = std::min((T + 7) / 8 * 8, size_t(context_));
      clear();
      std::vector<size_t> which_c;
      for (size_t k = 0; k < units.size(); ++k) {
        const Unit& u = *units[k];
        if (c >= u.rests.size()) continue;
        const size_t from = std::min(u.prefix.size(), size_t(context_) - T);
        cache_.length[k] = int(from);  // back to (part of) the shared prefix
        std::vector<int32_t> t(u.prefix.begin() + int64_t(from), u.prefix.end()), y;
        if (!t.empty()) y.assign(t.begin() + 1, t.end()), y.push_back(u.last);
        t.push_back(u.last);
        t.insert(t.end(), u.rests[c].begin(), u.rests[c].end() - 1);
        y.insert(y.end(), u.rests[c].begin(), u.rests[c].end());
        add(u, int(k), std::move(t), std::move(y));
        which_c.push_back(c);
      }
      collect(run(), which_c);
    }
  }

 private:
  void clear() { members_.clear(), of_.clear(), tok_.clear(), tgt_.clear(); }
  void add(const Unit& u, int row, std::vector<int32_t> t, std::vector<int32_t> y) {
    members_.push_back(row);
    of_.push_back(&u);
    tok_.push_back(std::move(t));
    tgt_.push_back(std::move(y));
  }

  // One forward_cached (or fill_cache without `scored`): batch row k continues cache row
  // members_[k] with tok_[k] (tgt_[k] its next tokens); pads (<EOT>, target 0) fill each row up
  // to the pass's length T. A pass of fewer than `rows` rows is filled up with idle rows (spare
  // cache rows from position 0), so that passes keep a few shapes. Returns T.
  size_t run(bool scored = true) {
    size_t T = 1, cached = 0;
    for (const auto& t : tok_) T = std::max(T, t.size());
    for (int m : members_) cached = std::max(cached, size_t(cache_.length[size_t(m)]));
    T = std::max(T, std::min((T + 7) / 8 * 8, size_t(context_) - cached));
    const size_t B = std::max(members_.size(), size_t(rows_));
    b_.resize(int(B), int(T));
    cache_rows_ = members_;
    std::fill(b_.tokens.begin(), b_.tokens.end(), int32_t(data::kEotId));
    std::fill(b_.targets.begin(), b_.targets.end(), 0);
    for (size_t k = 0; k < B; ++k) {
      if (k >= members_.size()) {  // idle
        cache_rows_.push_back(rows_ + int(k - members_.size()));
        cache_.clear(cache_rows_.back());
        b_.domain[k] = b_.domain[0];
        continue;
      }
      std::copy(tok_[k].begin(), tok_[k].end(), b_.tokens.begin() + int64_t(k * T));
      std::copy(tgt_[k].begin(), tgt_[k].end(), b_.targets.begin() + int64_t(k * T));
      b_.domain[k] = ctx_.model.config().domain_index(items_[of_[k]->item].domain);
    }
    loss_.assign(B * T, 0.0f);
    ctx_.model.expert_executor().begin_step({&b_, 1});
    // Activations are sized per (rows, length) and re-allocating them costs more than a pass
    // on a small model: lengths are rounded up to a multiple of 8 and the shapes used last
    // kept (units come sorted by length, so consecutive passes share shapes).
    if (acts_of_.size() >= kKeptShapes && !acts_of_.count({b_.B, b_.T}))
      acts_of_.erase(std::min_element(acts_of_.begin(), acts_of_.end(), [](const auto& x, const auto& y) {
        return x.second.used < y.second.used;
      }));
    Kept& kept = acts_of_[{b_.B, b_.T}];
    kept.used = ++passes_;
    if (scored)
      ctx_.model.forward_cached(b_, cache_, kept.acts, loss_.data(), cache_rows_.data());
    else
      ctx_.model.fill_cache(b_, cache_, kept.acts, cache_rows_.data());
    return T;
  }

  // Each row's choice c: the sum of the losses of its last rests[c].size() positions.
  void collect(size_t T, const std::vector<size_t>& choice_of_row) {
    for (size_t k = 0; k < members_.size(); ++k) {
      const Unit& u = *of_[k];
      const size_t c = choice_of_row[k], q = u.rests[c].size(), end = tok_[k].size();
      double sum = 0;
      for (size_t t = end - q; t < end; ++t) sum -= loss_[k * T + t];
      outs_[u.item].loglik[u.choice[c]] = sum;  // items are split between threads, not shared
      outs_[u.item].tokens[u.choice[c]] = int64_t(q);
    }
  }

  struct Kept {
    Activations acts;
    int64_t used = 0;
  };
  const TaskContext& ctx_;
  const std::vector<TaskItem>& items_;
  std::vector<ItemOutput>& outs_;
  const int rows_, context_;
  KvCache cache_;
  std::map<std::pair<int, int>, Kept> acts_of_;
  int64_t passes_ = 0;
  Batch b_;
  std::vector<float> loss_;
  std::vector<int> members_, cache_rows_;
  std::vector<const Unit*> of_;
  std::vector<std::vector<int32_t>> tok_, tgt_;
};

void choice_logliks(const TaskContext& ctx, const std::vector<TaskItem>& items,
                    const std::vector<size_t>& which, int rows, std::vector<ItemOutput>& outs,
                    bool progress) {
  const ops::BatchInvariant invariant;
  std::vector<Unit> units = units_of(ctx, items, which, outs);
  // Sorted so that a pass's rows are alike: by the length of a choice pass (the longest choice
  // rounded up to 8 positions), then by prefix and choice length.
  auto key = [](const Unit& u) {
    return std::tuple((u.longest + 7) / 8, u.prefix.size(), u.longest);
  };
  std::stable_sort(units.begin(), units.end(), [&](const Unit& a, const Unit& b) { return key(a) < key(b); });
  std::vector<const Unit*> whole, shared;
  for (const Unit& u : units) (u.rests.size() == 1 ? whole : shared).push_back(&u);
  std::stable_sort(whole.begin(), whole.end(), [](const Unit* a, const Unit* b) {
    return a->prefix.size() + a->longest < b->prefix.size() + b->longest;
  });
  // Jobs of up to `rows` units, taken in order by whichever thread is free.
  struct Job {
    bool shared;
    std::span<const Unit* const> units;
  };
  std::vector<Job> jobs;
  for (size_t i = 0; i < whole.size(); i += size_t(rows))
    jobs.push_back({false, std::span(whole).subspan(i, std::min(whole.size() - i, size_t(rows)))});
  for (size_t i = 0; i < shared.size(); i += size_t(rows))
    jobs.push_back({true, std::span(shared).subspan(i, std::min(shared.size() - i, size_t(rows)))});
  const int threads = ctx.model.expert_executor().concurrent_forward()
                          ? int(std::min<size_t>(size_t(omp_get_max_threads()), jobs.size()))
                          : 1;
  Progress shown("sigma eval: choices", units.size(), "units", progress);
  std::atomic<size_t> next{0};
  std::mutex failed_mu;
  std::exception_ptr failed;
  auto work = [&] {
    try {
      Scorer scorer(ctx, items, rows, outs);
      for (size_t j; (j = next.fetch_add(1)) < jobs.size();) {
        jobs[j].shared ? scorer.shared(jobs[j].units) : scorer.whole(jobs[j].units);
        shown.add(jobs[j].units.size());
      }
    } catch (...) {
      next = jobs.size();  // the others stop after their job
      const std::lock_guard lock(failed_mu);
      if (!failed) failed = std::current_exception();
    }
  };
  if (threads <= 1) {
    work();
  } else {
    const int team = omp_get_max_threads();
    auto one_threaded = [&] {
      omp_set_num_threads(1);  // this thread's kernels (its own OpenMP setting)
      work();
    };
    std::vector<std::jthread> others;  // joined on every way out
    for (int t = 1; t < threads; ++t) others.emplace_back(one_threaded);
    one_threaded();
    omp_set_num_threads(team);
    for (std::jthread& t : others) t.join();
  }
  if (failed) std::rethrow_exception(failed);
}

// One answer: decoded until <EOT> or max_new tokens, control tokens left out of the text, cut
// before the item's first stop sequence.
std::string answer(const TaskContext& ctx, const TaskItem& it, const TaskOptions& opt, int sample) {
  std::vector<int32_t> prompt, rest;
  format(ctx, it, "", prompt, rest);
  const int context = ctx.model.config().context;
  const int max_new = std::min(opt.max_new, context - 1);
  fit_prompt(ctx, it, prompt, size_t(answer_budget(ctx, opt)));
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
  return cut_at_stop(ctx.tok.decode(text), it.stop);
}

}  // namespace

const char* kind_name(TaskKind k) {
  return k == TaskKind::Choice ? "choice" : k == TaskKind::Generate ? "generate"
         : k == TaskKind::Code ? "code" : "rolling";
}

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

std::vector<TaskItem> with_fewshot(const std::vector<TaskItem>& items, int n, uint64_t seed,
                                   size_t first) {
  std::vector<TaskItem> out(items.begin(), items.begin() + std::ptrdiff_t(std::min(first, items.size())));
  if (n <= 0) return out;
  for (size_t i = 0; i < out.size(); ++i) {
    const TaskItem& it = items[i];
    SIGMA_CHECK(it.kind != TaskKind::Code, "{}:{}: --num-fewshot: code items take no shots "
                "(their tests are not an answer to show)", it.source, it.line);
    SIGMA_CHECK(it.kind != TaskKind::Rolling, "{}:{}: --num-fewshot: rolling items take no "
                "shots (their text is scored as it stands)", it.source, it.line);
    std::vector<size_t> pool;
    for (size_t j = 0; j < items.size(); ++j)
      if (j != i && items[j].kind == it.kind && items[j].domain == it.domain) pool.push_back(j);
    SIGMA_CHECK(int(pool.size()) >= n, "{}:{}: --num-fewshot {}: only {} other {} items of domain "
                "'{}' to draw from", it.source, it.line, n, pool.size(), kind_name(it.kind), it.domain);
    std::string shots;
    for (int k = 0; k < n; ++k) {  // a partial Fisher-Yates shuffle
      const size_t pick = size_t(k) + size_t(rng_u64(seed, it.line, uint64_t(k)) % (pool.size() - size_t(k)));
      std::swap(pool[size_t(k)], pool[pick]);
      const TaskItem& s = items[pool[size_t(k)]];
      shots += s.context + (s.kind == TaskKind::Choice ? s.choices[size_t(s.answer)] : s.references[0]) + "\n\n";
    }
    out[i].context = shots + it.context;
  }
  return out;
}

std::vector<ItemOutput> run_model(const TaskContext& ctx, const std::vector<TaskItem>& items,
                                  const TaskOptions& opt) {
  std::vector<ItemOutput> outs(items.size());
  std::vector<size_t> choice;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].kind == TaskKind::Choice || items[i].kind == TaskKind::Rolling) choice.push_back(i);
  if (!choice.empty()) choice_logliks(ctx, items, choice, opt.score_batch, outs, opt.progress);
  uint64_t answers = 0;
  for (const TaskItem& it : items)
    answers += it.kind == TaskKind::Code ? uint64_t(opt.samples) : it.kind == TaskKind::Generate;
  Progress shown("sigma eval: generation", answers, "answers", opt.progress);
  for (size_t i = 0; i < items.size(); ++i) {
    const TaskItem& it = items[i];
    ItemOutput& o = outs[i];
    if (it.kind == TaskKind::Choice || it.kind == TaskKind::Rolling) continue;  // done above
    std::vector<int32_t> prompt, rest;
    format(ctx, it, "", prompt, rest);
    o.prompt_cut = fit_prompt(ctx, it, prompt, size_t(answer_budget(ctx, opt)));
    o.prompt = prompt_text(ctx, prompt);
    const int n = it.kind == TaskKind::Code ? opt.samples : 1;
    for (int j = 0; j < n; ++j) {
      o.generations.push_back(answer(ctx, it, opt, j));
      shown.add();
    }
  }
  return outs;
}

json score_items(const std::vector<TaskItem>& items, const std::vector<ItemOutput>& outs,
                 const TaskOptions& opt, std::vector<json>* log) {
  SIGMA_CHECK(items.size() == outs.size(), "score_items: {} items, {} outputs", items.size(), outs.size());
  constexpr int kKinds = 4;
  std::vector<const TaskItem*> by_kind[kKinds];
  std::vector<const ItemOutput*> out_kind[kKinds];
  std::vector<json*> log_kind[kKinds];
  if (log) log->assign(items.size(), json::object());
  for (size_t i = 0; i < items.size(); ++i) {
    const int k = int(items[i].kind);
    by_kind[k].push_back(&items[i]);
    out_kind[k].push_back(&outs[i]);
    log_kind[k].push_back(log ? &(*log)[i] : nullptr);
    if (log)
      (*log)[i] = {{"line", items[i].line}, {"type", kind_name(items[i].kind)}, {"domain", items[i].domain},
                   {"doc", items[i].doc}, {"prompt", outs[i].prompt},
                   {"prompt_cut_tokens", outs[i].prompt_cut}};
  }
  json out = {{"items", items.size()}};
  using namespace scoring;
  if (!by_kind[0].empty()) out["choice"] = score_choices(by_kind[0], out_kind[0], opt, log_kind[0]);
  if (!by_kind[1].empty()) out["generate"] = score_generation(by_kind[1], out_kind[1], opt, log_kind[1]);
  if (!by_kind[2].empty()) out["code"] = score_code(by_kind[2], out_kind[2], opt, log_kind[2]);
  if (!by_kind[3].empty()) out["rolling"] = score_rolling(by_kind[3], out_kind[3], opt, log_kind[3]);
  // Prompts cut to fit the context, per kind and in all: never silent (docs/evaluation.md).
  int64_t cut_all = 0;
  for (int k = 0; k < kKinds; ++k) {
    if (by_kind[k].empty() || TaskKind(k) == TaskKind::Rolling) continue;  // texts are not cut
    int64_t cut = 0;
    for (const ItemOutput* o : out_kind[k]) cut += o->prompt_cut > 0;
    out[kind_name(TaskKind(k))]["prompts_cut"] = cut;
    cut_all += cut;
  }
  out["prompts_cut"] = cut_all;
  return out;
}

json run_tasks(const TaskContext& ctx, const std::vector<TaskItem>& items, const TaskOptions& opt,
               std::vector<json>* log) {
  if (std::any_of(items.begin(), items.end(), [](const TaskItem& it) { return it.kind == TaskKind::Code; }))
    for (int k : opt.k)  // checked before any scoring: a bad k should not waste a run
      SIGMA_CHECK(k >= 1 && k <= opt.samples, "pass@{} needs at least {} samples per problem "
                  "(--samples {})", k, k, opt.samples);
  const size_t n = opt.limit > 0 ? std::min(opt.limit, items.size()) : items.size();
  const std::vector<TaskItem> shot = with_fewshot(items, opt.num_fewshot, opt.fewshot_seed, n);
  const std::vector<TaskItem> scored(items.begin(), items.begin() + std::ptrdiff_t(n));
  return score_items(scored, run_model(ctx, shot, opt), opt, log);
}

void read_sample_log(const std::string& path, std::vector<TaskItem>& items, std::vector<ItemOutput>& outs) {
  data::LineReader lines(path, 64u << 20);
  std::string line;
  bool too_long = false;
  while (lines.next(line, too_long)) {
    const uint64_t no = lines.line_no();
    SIGMA_CHECK(!too_long, "{}:{}: line longer than 64 MiB", path, no);
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json j = parse_json_or_discard(line);
    SIGMA_CHECK(!j.is_discarded() && j.is_object() && j.contains("doc"), "{}:{}: not a line of "
                "--log-samples (a JSON object with \"doc\")", path, no);
    TaskItem it = parse_task_item(j["doc"], path, no, {});
    if (j.contains("line") && j["line"].is_number_unsigned()) it.line = j["line"].get<uint64_t>();
    ItemOutput o;
    try {
      o.prompt = j.value("prompt", "");
      o.prompt_cut = j.value("prompt_cut_tokens", int64_t(0));
      if (it.kind == TaskKind::Choice) {
        o.loglik = j.at("loglik").get<std::vector<double>>();
        o.tokens = j.value("tokens", std::vector<int64_t>{});
      } else if (it.kind == TaskKind::Rolling) {
        o.loglik = j.at("loglik").get<std::vector<double>>();
        o.tokens = j.at("tokens").get<std::vector<int64_t>>();
      } else {
        o.generations = j.at("generations").get<std::vector<std::string>>();
      }
    } catch (const json::exception&) {
      const bool numbers = it.kind == TaskKind::Choice || it.kind == TaskKind::Rolling;
      fail("{}:{}: a {} line needs \"{}\" (an array of {})", path, no, kind_name(it.kind),
           it.kind == TaskKind::Rolling ? "loglik\" and \"tokens" : numbers ? "loglik" : "generations",
           numbers ? "numbers" : "strings");
    }
    items.push_back(std::move(it));
    outs.push_back(std::move(o));
  }
  SIGMA_CHECK(!items.empty(), "{}: no line to score", path);
}

}  // namespace sigma::eval
