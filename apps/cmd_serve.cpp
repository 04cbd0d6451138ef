// sigma serve: an OpenAI-compatible HTTP server for a checkpoint (full or extracted), with
// continuous batching over --slots (docs/serving.md). SIGTERM or SIGINT drains and exits 0.
#include <fmt/format.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>
#include <vector>

#include "core/error.h"

#include "command.h"
#include "kernels/ops.h"
#include "data/tokenizer.h"
#include "serve/server.h"
#include "io/checkpoint_dir.h"
#include "run/checkpoint_bundle.h"

namespace sigma::cli {
namespace {

// SIGTERM and SIGINT reach the quiet thread (core/quiet_signals.h), whose handler hands the
// signal's number to the waiter below through a pipe; a 0 byte wakes it when none came.
int g_signal_pipe[2] = {-1, -1};
extern "C" void on_serve_signal(int sig) {
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!::write(g_signal_pipe[1], &b, 1);
}
void wake_waiter() { on_serve_signal(0); }

struct ServeArgs {
  std::string ckpt, name, precision = "fp32", backend = "cpu", kv_cache = "auto";
  std::vector<std::string> extra;  // NAME=CKPT
  serve::ServerOptions o;
};

// A served checkpoint: the model, its tokenizer and data registry (one checkpoint's, under
// read_checkpoint's retry: run/checkpoint_bundle.h), and the name clients select it by.
struct Loaded {
  std::unique_ptr<Model> model;
  std::optional<data::Tokenizer> tok;
  std::optional<DomainRegistry> data_domains;  // text prompts get their domain's prefix
  std::string name;
};

Loaded load(const std::string& ckpt, const ServeArgs& a) {
  CheckpointBundle b = load_checkpoint_bundle(ckpt);
  Loaded l{std::move(b.model), std::move(b.tok), std::move(b.data_domains), ""};
  l.model->use_weights(weight_format_from_name(a.precision));
  l.model->use_kv_cache(kv_cache_dtype(a.kv_cache));
  // A run's checkpoints/step-N names the run; an extract's folder (holding its step-N) itself.
  std::filesystem::path dir = std::filesystem::absolute(b.info.dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();
  if (dir.filename().string().rfind("step-", 0) == 0) dir = dir.parent_path();
  if (dir.filename() == kRunCheckpointsDir) dir = dir.parent_path();
  l.name = dir.filename().string().empty() ? "sigma" : dir.filename().string();
  return l;
}

// Every connection costs a descriptor: raise the soft limit to the hard one, and keep
// --max-connections below it (with room for checkpoints and logs).
void fit_descriptor_limit(serve::ServerOptions& o) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  if (r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
    getrlimit(RLIMIT_NOFILE, &r);
  }
  const rlim_t room = r.rlim_cur > 128 ? r.rlim_cur - 64 : 64;
  if (rlim_t(o.max_connections) > room) {
    fmt::print(stderr, "sigma serve: --max-connections {} lowered to {} (the descriptor limit is {})\n",
               o.max_connections, room, r.rlim_cur);
    o.max_connections = int(room);
  }
}

void run_serve(ServeArgs a) {
  a.kv_cache = kv_cache_type(a.kv_cache, a.precision);
  SIGMA_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC) == 0, "sigma serve: a pipe for signals: {}",
              std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_serve_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGTERM, SIGINT}) ::sigaction(s, &sa, nullptr);
  ops::use_backend(a.backend);
  std::jthread warm_up = ops::warm_up_in_background();  // beside the loads
  fit_descriptor_limit(a.o);
  serve::Server server(a.o);
  const int port = server.start();
  fmt::print("sigma serve: listening on http://{}:{} (loading {})\n", a.o.host, port, a.ckpt);
  std::fflush(stdout);
  std::atomic<bool> finished{false};
  std::thread waiter([&] {
    unsigned char b = 0;
    while (::read(g_signal_pipe[0], &b, 1) < 0 && errno == EINTR) {}
    const int sig = b;
    if (finished || sig == 0) return;
    const char* name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    if (const int n = server.requests_in_flight(); n > 0)
      fmt::print(stderr, "sigma serve: {} received: finishing the {} request{} in flight; any still "
                 "running after {} s is cut (--drain-timeout)\n", name, n, n == 1 ? "" : "s",
                 a.o.drain_timeout);
    else
      fmt::print(stderr, "sigma serve: {} received: stopping (no request in flight)\n", name);
    server.stop();
  });
  std::vector<Loaded> models;
  try {
    models.push_back(load(a.ckpt, a));
    if (!a.name.empty()) models[0].name = a.name;
    for (const std::string& spec : a.extra) {
      const size_t eq = spec.find('=');
      SIGMA_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < spec.size(),
                  "--model takes NAME=CKPT, not '{}'", spec);
      models.push_back(load(spec.substr(eq + 1), a));
      models.back().name = spec.substr(0, eq);
    }
  } catch (...) {  // a checkpoint that does not load: stop and join before the error surfaces
    finished = true;
    server.stop();
    wake_waiter();
    waiter.join();
    throw;
  }
  if (warm_up.joinable()) warm_up.join();
  std::string listed;
  for (Loaded& m : models) {
    server.serve_model(*m.model, m.tok ? &*m.tok : nullptr, m.name, &m == &models.back(),
                       m.data_domains ? &*m.data_domains : nullptr);
    listed += fmt::format("{}'{}' (domains:", listed.empty() ? "" : "; ", m.name);
    for (const auto& d : m.model->config().domains) listed += " " + d.name;
    listed += ")";
  }
  int64_t held = 0;
  for (const Loaded& m : models) held += m.model->held_bytes();
  fmt::print("sigma serve: ready: {}, {} slots each, {} weights ({:.1f} MB held), {} KV cache\n",
             listed, a.o.slots, a.precision, double(held) * 1e-6, a.kv_cache);
  std::fflush(stdout);
  server.wait();
  finished = true;
  wake_waiter();  // if no signal came
  waiter.join();
  fmt::print("sigma serve: stopped\n");
}

const RegisterCommand reg_serve([](CLI::App& root) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* c = root.add_subcommand("serve", "Serve a checkpoint over an OpenAI-compatible HTTP API");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_option("--host", a->o.host, "Address to listen on");
  c->add_option("--port", a->o.port, "Port (0 = any free port; the bound one is printed)")
      ->check(CLI::Range(0, 65535));
  c->add_option("--api-key", a->o.api_key, "Require 'Authorization: Bearer KEY'");
  c->add_option("--slots", a->o.slots, "Sequences decoded together")->check(CLI::Range(1, 256));
  c->add_option("--queue", a->o.queue, "Choices that may wait for a slot before 503")
      ->check(CLI::Range(1, 4096));
  c->add_option("--max-body", a->o.max_body, "Largest request body in bytes")->check(CLI::Range(64, 1 << 30));
  c->add_option("--max-tokens", a->o.max_tokens, "Largest max_tokens a request may ask for")
      ->check(CLI::Range(1, 1 << 20));
  add_backend_option(*c, a->backend);
  add_kv_cache_option(*c, a->kv_cache);
  c->add_option("--precision", a->precision,
                 "Weights decoding reads: fp32; bf16 (half the bytes per token); or int8 with a "
                 "scale per output channel (a quarter). Converted at load, the fp32 matrices "
                 "freed; activations and sums stay fp32")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  c->add_option("--name", a->name,
                 "Name of the --ckpt model (default: the run's folder); NAME:DOMAIN selects a domain");
  c->add_option("--model", a->extra,
                 "Also serve CKPT (an extract, or another model) under NAME; repeatable (NAME=CKPT)");
  c->add_flag("--no-prefix-cache", [a](int64_t) { a->o.prefix_cache = false; },
              "Recompute every prompt (the prefix cache reuses shared prefixes' keys and values, same outputs)");
  c->add_option("--max-connections", a->o.max_connections, "Open connections; past it a 503 and close")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--drain-timeout", a->o.drain_timeout,
                 "Seconds SIGTERM lets requests in flight finish before cutting them (then exit 0)")
      ->check(CLI::Range(0.0, 86400.0));
  c->add_option("--head-timeout", a->o.head_timeout, "Seconds a request's head may take to arrive")
      ->check(CLI::Range(0.1, 3600.0));
  c->add_option("--request-timeout", a->o.request_timeout,
                 "Seconds a whole request (head and body) may take to arrive")
      ->check(CLI::Range(0.1, 3600.0));
  c->add_option("--idle-timeout", a->o.idle_timeout, "Seconds an idle keep-alive connection stays open")
      ->check(CLI::Range(0.1, 86400.0));
  c->add_option("--write-timeout", a->o.write_timeout,
                 "Seconds a response may make no progress (a client that stopped reading) before it is cut")
      ->check(CLI::Range(0.1, 3600.0));
  c->callback([a] { run_serve(*a); });
});

}  // namespace
}  // namespace sigma::cli
