// sigma serve: an OpenAI-compatible HTTP server for a checkpoint (full or extracted), with
// continuous batching over --slots (docs/serving.md). SIGTERM or SIGINT drains and exits 0.
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <thread>

#include "command.h"
#include "data/tokenizer.h"
#include "serve/server.h"
#include "run/checkpoint.h"

namespace sigma::cli {
namespace {

struct ServeArgs {
  std::string ckpt, name, precision = "fp32";
  serve::ServerOptions o;
};

void run_serve(ServeArgs a) {
  // Signals go to one waiting thread only (blocked here, before any thread starts).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  serve::Server server(a.o);
  const int port = server.start();
  fmt::print("sigma serve: listening on http://{}:{} (loading {})\n", a.o.host, port, a.ckpt);
  std::fflush(stdout);
  std::atomic<bool> finished{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (finished) return;
    fmt::print(stderr, "sigma serve: {} received: finishing the requests in flight\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT");
    server.stop();
  });
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  if (a.precision == "bf16") model->use_bf16_weights();
  std::optional<data::Tokenizer> tok;
  if (const std::string path = checkpoint_tokenizer_path(info.dir); !path.empty())
    tok = data::Tokenizer::load(path);
  // A run's checkpoints/step-N names the run; an extract's folder names itself.
  std::filesystem::path dir = std::filesystem::absolute(info.dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();
  if (dir.parent_path().filename() == "checkpoints") dir = dir.parent_path().parent_path();
  const std::string name = a.name.empty() ? dir.filename().string() : a.name;
  server.serve_model(*model, tok ? &*tok : nullptr, name.empty() ? "sigma" : name);
  std::string domains;
  for (const auto& d : model->config().domains) domains += (domains.empty() ? "" : ", ") + d.name;
  fmt::print("sigma serve: ready: model '{}' (domains: {}), {} slots, {} weights\n", name, domains,
             a.o.slots, a.precision);
  std::fflush(stdout);
  server.wait();
  finished = true;
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter if no signal came
  waiter.join();
  fmt::print("sigma serve: stopped\n");
}

const RegisterCommand reg([](CLI::App& root) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* c = root.add_subcommand("serve", "Serve a checkpoint over an OpenAI-compatible HTTP API");
  c->add_option("--ckpt", a->ckpt, "Checkpoint directory (or a checkpoints/ root)")->required();
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
  c->add_option("--precision", a->precision,
                 "Weights decoding reads: fp32, or bf16 (copies made at load: half the bytes per "
                 "token; activations and sums stay fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  c->add_option("--name", a->name, "Model name in responses (default: the run's folder)");
  c->callback([a] { run_serve(*a); });
});

}  // namespace
}  // namespace sigma::cli
