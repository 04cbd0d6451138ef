// `sigma serve`'s HTTP side (docs/serving.md) on the bounded server of serve/http.h: the OpenAI
// routes, /health, /metrics, /tokenize and /detokenize, API-key checks before any body is read,
// JSON errors for every refusal, several models (a checkpoint and its extracts, each domain
// addressable as NAME:DOMAIN), and a drain on stop(): no new connections, requests in flight
// finish until --drain-timeout, then whatever is left is cut and wait() returns.
#pragma once
#include <memory>
#include <string>

#include "data/tokenizer.h"
#include "model/domains.h"
#include "model/model.h"

namespace sigma::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;          // 0 = any free port (start() returns it)
  std::string api_key;      // empty = no key required
  int slots = 4;            // sequences decoded together (per model)
  int queue = 64;           // choices waiting for a slot before requests get 503
  size_t max_body = 1 << 20;  // bytes, counted as they arrive (chunked bodies too)
  int max_tokens = 4096;    // largest max_tokens a request may ask for
  int max_connections = 1024;   // open client sockets; past it a 503 and close
  double head_timeout = 10;     // seconds from a request's first byte to the end of its head
  double request_timeout = 30;  // seconds from a request's first byte to the end of its body
  double idle_timeout = 60;     // seconds a keep-alive connection may sit idle
  double write_timeout = 30;    // seconds a response may make no progress (a client not reading)
  double drain_timeout = 30;    // seconds stop() lets requests in flight run before cutting them
  bool prefix_cache = true;     // reuse the keys and values of shared prompt prefixes (Engine)
};

class Server {
 public:
  explicit Server(ServerOptions o);
  ~Server();
  // Binds the socket and starts answering (/health says 503 "loading" until serve_model).
  // Returns the bound port; throws sigma::Error when the address cannot be bound.
  int start();
  // Serves `model` (and `tok`, null for token-id models) under `name` from now on; the first
  // model served is the default one (a request without `model`). Names must be distinct.
  // /health says ready once the `last` one is served: with more to come, pass last = false.
  // `data_domains`: the checkpoint's data registry (text prompts get its domains' prefixes).
  void serve_model(Model& model, const data::Tokenizer* tok, const std::string& name, bool last = true,
                   const DomainRegistry* data_domains = nullptr);
  // Stops accepting; requests in flight finish until the drain timeout, then are cut. Safe from
  // any thread, once or more.
  void stop();
  // Blocks until stop() has drained (or cut) every request and the engines have stopped.
  void wait();
  // Answers one request given as the bytes a client sent and returns the bytes of the response,
  // through the same routes but without a socket (the fuzzer: tests/fuzz/fuzz_serve_request.cpp).
  std::string answer(const std::string& request);
  int connections() const;  // open client sockets
  int requests_in_flight() const;  // requests being answered now

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sigma::serve
