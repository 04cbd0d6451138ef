#include "train/data_source.h"

#include <fmt/format.h>

#include "core/error.h"
#include "data/synthetic.h"

namespace sigma {

namespace {

class SyntheticSource : public DataSource {
 public:
  explicit SyntheticSource(uint64_t seed) : data_(seed) {}
  int vocab() const override { return data_.vocab(); }
  std::vector<std::string> domains() const override { return data_.domains(); }
  void train_batch(Batch& b, int B, int T, uint64_t index) const override {
    b.B = B;
    data_.fill_batch(b, T, kTrainStream, index * uint64_t(B));
  }
  void eval_batches(int B, int T, int rows_per_domain,
                    const std::function<void(const Batch&)>& fn) const override {
    const uint64_t total = uint64_t(rows_per_domain) * data_.domains().size();
    Batch b;
    for (uint64_t row = 0; row < total; row += B) {
      b.B = int(std::min<uint64_t>(B, total - row));
      data_.fill_batch(b, T, kEvalStream, row);
      fn(b);
    }
  }
  std::optional<double> optimum(int domain, int T) const override {
    return data_.optimum(domain, T);
  }

 private:
  static constexpr uint64_t kTrainStream = 1, kEvalStream = 2;  // disjoint samples
  SyntheticData data_;
};

}  // namespace

std::unique_ptr<DataSource> make_data_source(const Config& cfg) {
  if (cfg.data.source == "synthetic") return std::make_unique<SyntheticSource>(cfg.train.seed);
  fail("data.source = '{}' is not available yet (allowed: synthetic)", cfg.data.source);
}

void bind_model_to_data(ModelConfig& m, const DataSource& d) {
  if (m.vocab == 0) m.vocab = d.vocab();
  SIGMA_CHECK(m.vocab >= d.vocab(), "model.vocab = {} is smaller than the data's vocabulary ({})",
              m.vocab, d.vocab());
  const auto names = d.domains();
  if (m.domains.empty()) {
    for (const auto& n : names) m.domains.push_back(m.default_domain(n));
    return;
  }
  SIGMA_CHECK(m.domains.size() == names.size(),
              "model.domains lists {} domains but the data has {} ({})", m.domains.size(),
              names.size(), fmt::join(names, ", "));
  for (size_t i = 0; i < names.size(); ++i)
    SIGMA_CHECK(m.domains[i].name == names[i],
                "model.domains[{}] is '{}' but the data's domain {} is '{}'", i,
                m.domains[i].name, i, names[i]);
}

}  // namespace sigma
