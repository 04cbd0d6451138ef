// `sigma serve`'s HTTP side (docs/serving.md) on cpp-httplib: the OpenAI routes, /health,
// /metrics, /tokenize and /detokenize, API-key checks, JSON errors for every refusal, and a
// drain on stop(): no new connections, in-flight requests finish, then wait() returns.
#pragma once
#include <memory>
#include <string>

#include "data/tokenizer.h"
#include "model/model.h"

namespace sigma::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;          // 0 = any free port (bind() returns it)
  std::string api_key;      // empty = no key required
  int slots = 4;            // sequences decoded together
  int queue = 64;           // choices waiting for a slot before requests get 503
  size_t max_body = 1 << 20;  // bytes
  int max_tokens = 4096;    // largest max_tokens a request may ask for
};

class Server {
 public:
  explicit Server(ServerOptions o);
  ~Server();
  // Binds the socket and starts answering (/health says 503 "loading" until serve_model).
  // Returns the bound port; throws sigma::Error when the address cannot be bound.
  int start();
  // Serves `model` (and `tok`, null for token-id models) under `name` from now on.
  void serve_model(Model& model, const data::Tokenizer* tok, const std::string& name);
  // Stops accepting; requests in flight finish. Safe from any thread, once or more.
  void stop();
  // Blocks until stop() has drained every request.
  void wait();
  // Answers one request given as the bytes a client sent and returns the bytes of the response,
  // through the same routes but without a socket (the fuzzer: tests/fuzz/fuzz_serve_request.cpp).
  std::string answer(const std::string& request);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sigma::serve
