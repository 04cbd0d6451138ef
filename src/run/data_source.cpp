#include "run/data_source.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/error.h"
#include "core/json_depth.h"
#include "data/synthetic.h"
#include "data/tokenizer.h"
#include "data/windows.h"
#include "run/checkpoint.h"

namespace sigma {

namespace {

class SyntheticSource : public DataSource {
 public:
  // `only`: the domains to keep (empty = all three), e.g. to train one domain alone.
  SyntheticSource(uint64_t seed, const std::vector<std::string>& only) : data_(seed) {
    const auto all = data_.domains();
    for (size_t d = 0; d < all.size(); ++d)
      if (only.empty() || std::find(only.begin(), only.end(), all[d]) != only.end())
        keep_.push_back(int(d));
    for (const auto& n : only)
      SIGMA_CHECK(std::find(all.begin(), all.end(), n) != all.end(),
                  "data.domains: the synthetic data has no domain '{}' (it has {})", n,
                  fmt::join(all, ", "));
  }
  int vocab() const override { return data_.vocab(); }
  std::vector<std::string> domains() const override {
    std::vector<std::string> names;
    for (int d : keep_) names.push_back(data_.domains()[size_t(d)]);
    return names;
  }
  void train_batch(Batch& b, int B, int T, uint64_t index) const override {
    fill(b, B, T, kTrainStream, index * uint64_t(B),
         allowed_.empty() ? nullptr : &allowed_[index % allowed_.size()]);
  }
  void restrict_batches(std::vector<std::vector<uint32_t>> allowed) override {
    for (const auto& a : allowed) SIGMA_CHECK(!a.empty(), "synthetic data: a micro-batch allows no domain");
    allowed_ = std::move(allowed);
  }
  void eval_batches(int B, int T, int rows_per_domain,
                    const std::function<void(const Batch&)>& fn) const override {
    const uint64_t total = uint64_t(rows_per_domain) * keep_.size();
    Batch b;
    for (uint64_t row = 0; row < total; row += B) {
      fill(b, int(std::min<uint64_t>(B, total - row)), T, kEvalStream, row);
      fn(b);
    }
  }
  std::optional<double> optimum(int domain, int T) const override {
    return data_.optimum(keep_[size_t(domain)], T);
  }

 private:
  // Rows dealt round-robin over the kept domains (or the `allowed` of them); sample index = row
  // number, so batches from distinct offsets never repeat a sample (with every domain kept:
  // SyntheticData::fill_batch).
  void fill(Batch& b, int B, int T, uint64_t stream, uint64_t row0,
            const std::vector<uint32_t>* allowed = nullptr) const {
    b.resize(B, T);
    for (int i = 0; i < B; ++i) {
      const int local = allowed ? int((*allowed)[(row0 + i) % allowed->size()])
                                : int((row0 + i) % keep_.size());
      b.domain[size_t(i)] = local;
      data_.sample(keep_[size_t(local)], stream, row0 + i, T, &b.tokens[size_t(i) * T],
                   &b.targets[size_t(i) * T]);
    }
  }
  static constexpr uint64_t kTrainStream = 1, kEvalStream = 2;  // disjoint samples
  SyntheticData data_;
  std::vector<int> keep_;  // SyntheticData domain of each of this source's domains
  std::vector<std::vector<uint32_t>> allowed_;  // per micro-batch slot (restrict_batches)
};

// The tokenizer a prepared directory was made with, as its manifest records it.
std::string manifest_tokenizer(const std::string& dir) {
  std::ifstream in(dir + "/manifest.json");
  nlohmann::json m = parse_json_or_discard(in);
  if (m.is_discarded() || !m.is_object() || !m.contains("tokenizer") || !m["tokenizer"].is_string())
    return "";
  // A relative path is relative to the manifest's folder (prepare writes it so), never to the
  // directory a run happens to start in.
  const std::filesystem::path p = m["tokenizer"].get<std::string>();
  return p.is_absolute() ? p.string() : (std::filesystem::path(dir) / p).lexically_normal().string();
}

// Held-out or training windows from a prepared directory. Model domain index = position in the
// directory's registry; batch rows carry that index.
class ShardsSource : public DataSource {
 public:
  ShardsSource(data::ShardSet set, std::string tokenizer, std::string path)
      : set_(std::move(set)), tokenizer_(std::move(tokenizer)), path_(std::move(path)) {
    for (size_t i = 0; i < set_.domains.size(); ++i) index_of_id_[set_.domains[i].id] = int(i);
  }
  int vocab() const override { return int(set_.vocab_size); }
  std::vector<std::string> domains() const override { return set_.domains.names(); }
  DomainRegistry domain_specs() const override { return set_.domains; }
  std::string tokenizer_path() const override { return tokenizer_; }
  uint64_t tokenizer_hash() const override { return set_.tokenizer_hash; }

  void restrict_batches(std::vector<std::vector<uint32_t>> allowed) override {
    SIGMA_CHECK(batches_, "shards source: no training stream");
    batches_->restrict_batches(std::move(allowed));
  }
  void start_training(const Config& cfg) override {
    data::SamplerConfig sc = data::SamplerConfig::from_json(cfg.data.sampler, "data.sampler");
    if (!cfg.data.sampler.contains("seed")) sc.seed = cfg.train.seed;
    sc.batches_per_step = uint64_t(std::max(1, cfg.train.accum));  // stages count optimizer steps
    data::BatchConfig bc{uint32_t(cfg.train.batch), uint32_t(cfg.model.context), cfg.data.finetune,
                         cfg.data.mask_prompt};
    batches_ = std::make_unique<data::BatchSource>(set_, bc, sc);
  }
  void train_batch(Batch& b, int B, int T, uint64_t index) const override {
    SIGMA_CHECK(batches_, "shards source: no training stream");
    SIGMA_CHECK(index == next_index_, "shards source: batch {} requested, the stream is at {}",
                index, next_index_);
    batches_->next(scratch_);
    SIGMA_CHECK(int(scratch_.B) == B && int(scratch_.T) == T, "shards source: batch shape mismatch");
    convert(scratch_, b);
    ++next_index_;
  }
  void eval_batches(int B, int T, int rows_per_domain,
                    const std::function<void(const Batch&)>& fn) const override {
    // Windows spread evenly through each domain's shard, the same ones every time.
    Batch b;
    b.resize(B, T);
    int filled = 0;
    auto flush = [&] {
      if (!filled) return;
      Batch part;
      part.resize(filled, T);
      std::copy_n(b.tokens.begin(), size_t(filled) * T, part.tokens.begin());
      std::copy_n(b.targets.begin(), size_t(filled) * T, part.targets.begin());
      std::copy_n(b.mask.begin(), size_t(filled) * T, part.mask.begin());
      std::copy_n(b.domain.begin(), size_t(filled), part.domain.begin());
      fn(filled == B ? b : part);
      filled = 0;
    };
    for (size_t d = 0; d < set_.shards.size(); ++d) {
      const uint64_t n = data::window_count(set_.shards[d]->n_tokens(), uint32_t(T));
      const uint64_t take = std::min<uint64_t>(n, uint64_t(rows_per_domain));
      for (uint64_t k = 0; k < take; ++k) {
        const uint64_t w = k * n / take;
        const size_t o = size_t(filled) * T;
        data::fill_window(*set_.shards[d], w, uint32_t(T), &b.tokens[o], &b.targets[o], &b.mask[o]);
        b.domain[filled] = int(d);
        if (++filled == B) flush();
      }
    }
    flush();
  }
  std::map<std::string, std::vector<int64_t>> domain_token_counts(int vocab) const override {
    std::map<std::string, std::vector<int64_t>> out;
    for (size_t d = 0; d < set_.shards.size(); ++d) {
      auto& c = out[set_.domains[d].name];
      c.assign(size_t(vocab), 0);
      const data::Shard& s = *set_.shards[d];
      for (uint64_t i = 0; i < s.n_tokens(); ++i) ++c[s.token(i)];
    }
    return out;
  }
  nlohmann::json cursor() const override {
    return batches_ ? nlohmann::json{{"sampler", batches_->cursor()}, {"index", next_index_}}
                    : nlohmann::json(nullptr);
  }
  void restore(const nlohmann::json& c) override {
    SIGMA_CHECK(batches_ && c.is_object() && c.contains("sampler") && c.contains("index"),
                "checkpoint has no data cursor for the shards source");
    try {
      batches_->restore(c["sampler"]);
    } catch (const Error& e) {
      // The cursor was saved for the checkpoint's training data: say which data differs and
      // how to train the checkpoint's weights on it anyway.
      fail("{}. --resume continues the checkpoint's data order, so it needs the data the "
           "checkpoint was trained on, and data.path = {} is other data. Resume with the "
           "checkpoint's own data.path, or train its weights on this data from step 0: sigma "
           "extract --ckpt CKPT --domain <every domain of the model> --out NEW (a copy without "
           "a data cursor), then sigma train --resume NEW --set data.path={}",
           e.what(), path_, path_);
    }
    next_index_ = c["index"].get<uint64_t>();
  }
  uint64_t continue_at(uint64_t index) override {
    SIGMA_CHECK(batches_, "shards source: no training stream");
    const uint64_t was = next_index_;
    if (index != was) batches_->continue_at(index);
    next_index_ = index;
    return was;
  }

 private:
  void convert(const data::Batch& in, Batch& out) const {
    out.B = int(in.B);
    out.T = int(in.T);
    out.tokens = in.inputs;
    out.targets = in.targets;
    out.mask = in.mask;
    out.domain.resize(in.B);
    for (uint32_t r = 0; r < in.B; ++r) out.domain[r] = index_of_id_.at(uint32_t(in.domain[r]));
  }
  data::ShardSet set_;
  std::string tokenizer_;
  std::string path_;  // the prepared folder, for errors
  std::map<uint32_t, int> index_of_id_;
  std::unique_ptr<data::BatchSource> batches_;
  mutable data::Batch scratch_;
  mutable uint64_t next_index_ = 0;
};

std::unique_ptr<ShardsSource> open_shards(const std::string& dir, std::string tokenizer) {
  SIGMA_CHECK(!dir.empty(), "data.path is empty: set it to a directory made by sigma prepare");
  const bool from_config = !tokenizer.empty();
  if (!from_config) tokenizer = manifest_tokenizer(dir);
  uint64_t hash = 0;
  if (!tokenizer.empty()) {
    const std::string named_by =
        from_config ? std::string("data.tokenizer")
                    : fmt::format("{}/manifest.json (written by sigma prepare; data.tokenizer is "
                                  "unset)", dir);
    SIGMA_CHECK(std::filesystem::is_regular_file(tokenizer),
                "tokenizer '{}', named by {}, is not a file: set data.tokenizer to the tokenizer "
                "the shards of data.path = {} were made with (--set data.tokenizer=FILE)",
                tokenizer, named_by, dir);
    try {
      hash = data::Tokenizer::load(tokenizer).hash();
    } catch (const Error& e) {
      fail("data.tokenizer: {} (named by {})", e.what(), named_by);
    }
  }
  return std::make_unique<ShardsSource>(data::ShardSet::open(dir, hash), tokenizer, dir);
}

}  // namespace

void DataSource::restrict_batches(std::vector<std::vector<uint32_t>>) {
  fail("this data source cannot restrict training micro-batches to some domains");
}

std::unique_ptr<DataSource> make_data_source(const Config& cfg, bool start_training) {
  if (cfg.data.source == "synthetic") {
    SIGMA_CHECK(cfg.data.sampler.empty(), "data.sampler weights the domains of prepared shards "
                "(data.source = shards); the synthetic source would ignore it: remove it, or "
                "choose synthetic domains with data.domains");
    return std::make_unique<SyntheticSource>(cfg.train.seed, cfg.data.domains);
  }
  SIGMA_CHECK(cfg.data.domains.empty(), "data.domains selects synthetic domains; for prepared "
              "shards, prepare a directory holding only the domains to train (or weight them "
              "with data.sampler stages)");
  auto s = open_shards(cfg.data.path, cfg.data.tokenizer);
  if (start_training) s->start_training(cfg);
  return s;
}

std::unique_ptr<DataSource> make_eval_source(const std::string& dir, uint64_t tokenizer_hash) {
  return std::make_unique<ShardsSource>(data::ShardSet::open(dir, tokenizer_hash),
                                        manifest_tokenizer(dir), dir);
}

std::string tokenizer_mismatch(const std::string& ckpt_dir, const DataSource& data,
                               const std::string& data_dir) {
  const std::string mine = checkpoint_tokenizer_path(ckpt_dir);
  if (mine.empty() || data.tokenizer_hash() == 0) return "";
  const data::Tokenizer tok = data::Tokenizer::load(mine);
  if (tok.hash() == data.tokenizer_hash()) return "";
  const std::string theirs = data.tokenizer_path();
  return fmt::format("the checkpoint {} reads the ids of its tokenizer {} (hash {:016x}, {} ids), but "
                     "the shards of {} were made by {}{} (hash {:016x}, {} ids): the same id is "
                     "another string", ckpt_dir, mine, tok.hash(), tok.vocab_size(), data_dir,
                     theirs.empty() ? "another tokenizer" : "the tokenizer ",
                     theirs, data.tokenizer_hash(), data.vocab());
}

void bind_model_to_data(ModelConfig& m, const DataSource& d) {
  if (m.vocab == 0) m.vocab = d.vocab();
  SIGMA_CHECK(m.vocab >= d.vocab(), "model.vocab = {} is smaller than the data's vocabulary ({})",
              m.vocab, d.vocab());
  const auto names = d.domains();
  if (m.domains.empty()) {  // the data's registry decides names, groups and slots
    m.domains = d.domain_specs();
    for (const auto& s : m.domains) m.slots = std::max(m.slots, s.slot + 1);
    return;
  }
  for (const auto& n : names) m.domain_index(n);  // each data domain must be a model domain
}

}  // namespace sigma
