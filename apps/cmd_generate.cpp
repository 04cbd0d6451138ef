// sigma generate: continues a prompt with a checkpoint's model (KV cache, seeded sampling).
#include <fmt/format.h>

#include <cstdio>
#include <sstream>

#include <unistd.h>

#include "command.h"
#include "data/tokenizer.h"
#include "infer/generate.h"
#include "kernels/ops.h"
#include "run/checkpoint.h"

namespace sigma::cli {
namespace {

struct GenerateArgs {
  std::string ckpt, prompt, domain, precision = "fp32", backend = "cpu", kv_cache = "auto";
  SamplingConfig s;
  bool no_cache = false;
};

// Without a tokenizer in the checkpoint (the synthetic data), prompts are token ids.
std::vector<int32_t> parse_ids(const std::string& text) {
  std::istringstream in(text);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long v = -1;
    try {
      v = std::stol(word, &used);
    } catch (...) {
    }
    SIGMA_CHECK(used == word.size() && v >= 0,
                "this checkpoint has no tokenizer, so --prompt must be token ids separated by "
                "spaces; '{}' is not one", word);
    ids.push_back(int32_t(v));
  }
  return ids;
}

// The process's resident set (/proc/self/statm), 0 where it cannot be read.
double resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long pages = 0, resident = 0;
  const bool ok = std::fscanf(f, "%ld %ld", &pages, &resident) == 2;
  std::fclose(f);
  return ok ? double(resident) * double(sysconf(_SC_PAGESIZE)) : 0;
}

void run_generate(GenerateArgs a) {
  ops::use_backend(a.backend);
  std::jthread warm_up = ops::warm_up_in_background();  // beside the load
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  model->use_weights(weight_format_from_name(a.precision));
  a.kv_cache = kv_cache_type(a.kv_cache, a.precision);
  model->use_kv_cache(kv_cache_dtype(a.kv_cache));
  const ModelConfig& c = model->config();
  const int domain = a.domain.empty() ? 0 : c.domain_index(a.domain);
  const std::string tok_path = checkpoint_tokenizer_path(info.dir);
  std::vector<int32_t> prompt;
  std::optional<data::Tokenizer> tok;
  if (!tok_path.empty()) {
    tok = data::Tokenizer::load(tok_path);
    for (uint32_t id : tok->encode(a.prompt)) prompt.push_back(int32_t(id));
    if (a.s.stop_token < 0) a.s.stop_token = int(data::kEotId);
  } else {
    prompt = parse_ids(a.prompt);
  }
  SIGMA_CHECK(!prompt.empty(), "--prompt is empty");
  GenerateStats st;
  if (warm_up.joinable()) warm_up.join();
  const auto out = generate(*model, domain, prompt, a.s, !a.no_cache, &st);
  // generate() also ends when the sequence fills the context (there is no sliding window).
  const bool stop_token = !out.empty() && out.back() == a.s.stop_token;
  if (int(out.size()) < a.s.max_new_tokens && !stop_token)
    fmt::print(stderr, "sigma generate: stopped at the context length {} after {} new tokens "
               "(--max-new {}; the prompt has {} tokens)\n", c.context, out.size(),
               a.s.max_new_tokens, prompt.size());
  if (tok) {
    std::vector<uint32_t> ids(out.begin(), out.end());
    fmt::print("{}{}\n", a.prompt, tok->decode(ids));
  } else {
    fmt::print("{}\n", fmt::join(out, " "));
  }
  std::fflush(stdout);  // the text first, then how fast it came
  const double rate = st.decode_seconds > 0 ? st.decode_steps / st.decode_seconds : 0.0;
  const double bytes = double(weight_bytes_per_token(*model));
  fmt::print(stderr, "sigma generate: prompt of {} tokens and first token in {:.3f} s; {} more "
             "tokens in {:.3f} s ({:.1f} tokens/s, {} weights: {:.1f} MB a token, {:.1f} GB/s; "
             "{:.1f} MB of weights held, {} KV cache: {:.3f} MB, {:.1f} MB resident)\n",
             st.prompt_tokens, st.prefill_seconds, st.decode_steps, st.decode_seconds, rate,
             a.precision, bytes * 1e-6, rate * bytes * 1e-9, double(model->held_bytes()) * 1e-6,
             a.kv_cache, double(st.kv_cache_bytes) * 1e-6, resident_bytes() * 1e-6);
}

const RegisterCommand reg_generate([](CLI::App& root) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* c = root.add_subcommand("generate", "Generate a continuation of a prompt");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_option("--prompt", a->prompt, "Prompt text (token ids if the checkpoint has no tokenizer)")
      ->required();
  c->add_option("--domain", a->domain, "Domain of the prompt (default: the first)");
  c->add_option("--max-new", a->s.max_new_tokens, "Tokens to generate")->check(CLI::Range(1, 1 << 20));
  c->add_option("--temperature", a->s.temperature, "0 = greedy")->check(CLI::Range(0.0, 100.0));
  c->add_option("--top-k", a->s.top_k, "Keep the k most likely tokens (0 = off)")->check(CLI::NonNegativeNumber);
  c->add_option("--top-p", a->s.top_p, "Nucleus mass (1 = off)")->check(CLI::Range(0.0, 1.0));
  c->add_option("--repetition-penalty", a->s.repetition_penalty, "> 1 discourages repeats")
      ->check(CLI::Range(0.01, 100.0));
  c->add_option("--seed", a->s.seed, "Sampling seed");
  c->add_option("--stop-token", a->s.stop_token, "Stop after this token id (default <EOT> with a tokenizer)");
  c->add_option("--precision", a->precision,
                 "Weights the forward pass reads: fp32; bf16 (half the bytes per token); or int8 "
                 "with a scale per output channel (a quarter). Converted at load, the fp32 "
                 "matrices freed; activations and sums stay fp32")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  add_backend_option(*c, a->backend);
  add_kv_cache_option(*c, a->kv_cache);
  c->add_flag("--no-cache", a->no_cache, "Recompute the whole prefix each step (reference path)");
  c->callback([a, c] {
    a->s.validate();  // before the model loads: CLI11's ranges let NaN through
    if (a->no_cache) refuse_given(*c, {"--kv-cache"}, "--no-cache decodes without a KV cache");
    if (a->s.temperature <= 0.0f)
      refuse_given(*c, {"--top-k", "--top-p", "--seed"}, "--temperature 0 (the default) decodes "
                   "greedily; give --temperature > 0 to sample");
    run_generate(*a);
  });
});

}  // namespace
}  // namespace sigma::cli
