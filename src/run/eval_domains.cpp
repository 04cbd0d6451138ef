#include "run/eval_domains.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace sigma {

namespace {

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Evaluation over a subset of another source's domains (see keep_domains).
class KeptDomains : public DataSource {
 public:
  KeptDomains(std::unique_ptr<DataSource> inner, const std::vector<std::string>& keep)
      : inner_(std::move(inner)), keep_(keep) {
    const auto all = inner_->domains();
    local_.assign(all.size(), -1);
    for (size_t k = 0; k < keep_.size(); ++k) {
      const auto it = std::find(all.begin(), all.end(), keep_[k]);
      SIGMA_CHECK(it != all.end(), "the held-out data has no domain '{}' (it has {})", keep_[k],
                  fmt::join(all, ", "));
      local_[size_t(it - all.begin())] = int(k);
      inner_index_.push_back(int(it - all.begin()));
    }
  }
  int vocab() const override { return inner_->vocab(); }
  std::vector<std::string> domains() const override { return keep_; }
  DomainRegistry domain_specs() const override {
    const DomainRegistry all = inner_->domain_specs();
    DomainRegistry out;
    for (int i : inner_index_) out.push_back(all[size_t(i)]);
    return out;
  }
  std::string tokenizer_path() const override { return inner_->tokenizer_path(); }
  uint64_t tokenizer_hash() const override { return inner_->tokenizer_hash(); }
  std::optional<double> optimum(int d, int T) const override {
    return inner_->optimum(inner_index_[size_t(d)], T);
  }
  void train_batch(Batch&, int, int, uint64_t) const override {
    fail("a held-out domain subset has no training stream");
  }
  void eval_batches(int B, int T, int rows_per_domain,
                    const std::function<void(const Batch&)>& fn) const override {
    Batch out;
    out.resize(B, T);
    int filled = 0;
    auto flush = [&] {  // a full batch, or the last rows as a shorter one
      if (filled == B) {
        fn(out);
      } else if (filled > 0) {
        Batch part;
        part.resize(filled, T);
        const size_t n = size_t(filled) * T;
        std::copy_n(out.tokens.begin(), n, part.tokens.begin());
        std::copy_n(out.targets.begin(), n, part.targets.begin());
        std::copy_n(out.mask.begin(), n, part.mask.begin());
        std::copy_n(out.domain.begin(), size_t(filled), part.domain.begin());
        fn(part);
      }
      filled = 0;
    };
    inner_->eval_batches(B, T, rows_per_domain, [&](const Batch& b) {
      for (int r = 0; r < b.B; ++r) {
        const int d = local_[size_t(b.domain[size_t(r)])];
        if (d < 0) continue;
        const size_t src = size_t(r) * T, dst = size_t(filled) * T;
        std::copy_n(b.tokens.begin() + src, T, out.tokens.begin() + dst);
        std::copy_n(b.targets.begin() + src, T, out.targets.begin() + dst);
        std::copy_n(b.mask.begin() + src, T, out.mask.begin() + dst);
        out.domain[size_t(filled)] = d;
        if (++filled == B) flush();
      }
    });
    flush();
  }

 private:
  std::unique_ptr<DataSource> inner_;
  std::vector<std::string> keep_;
  std::vector<int> local_;        // [inner domain] -> index in keep_, or -1
  std::vector<int> inner_index_;  // [kept domain] -> inner domain
};

}  // namespace

EvalDomains choose_eval_domains(const std::vector<std::string>& data, const ModelConfig& model,
                                const std::vector<std::string>& requested, const std::string& what) {
  const std::vector<std::string> known = model.domains.names();
  EvalDomains out;
  for (const auto& n : data) {
    if (contains(known, n))
      out.keep.push_back(n);
    else
      out.skipped.push_back({n, "not a domain of the model"});
  }
  SIGMA_CHECK(!out.keep.empty(), "{} holds none of the model's domains (it has {}; the model "
              "knows {})", what, fmt::join(data, ", "), fmt::join(known, ", "));
  if (requested.empty()) return out;
  for (const auto& n : requested) {
    SIGMA_CHECK(contains(known, n), "--domains: the model has no domain '{}'; the domains of {} "
                "it knows: {}", n, what, fmt::join(out.keep, ", "));
    SIGMA_CHECK(contains(data, n), "--domains: {} holds no domain '{}'; the domains of it the "
                "model knows: {}", what, n, fmt::join(out.keep, ", "));
  }
  std::vector<std::string> chosen;
  for (const auto& n : out.keep)
    if (contains(requested, n)) chosen.push_back(n);
  out.keep = std::move(chosen);
  return out;
}

std::unique_ptr<DataSource> keep_domains(std::unique_ptr<DataSource> inner,
                                         const std::vector<std::string>& keep) {
  if (inner->domains() == keep) return inner;
  return std::make_unique<KeptDomains>(std::move(inner), keep);
}

}  // namespace sigma
