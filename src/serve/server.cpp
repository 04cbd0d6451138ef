#include "serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "serve/api.h"
#include "serve/choice.h"
#include "serve/engine.h"

namespace sigma::serve {

using nlohmann::json;

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

// Invalid UTF-8 (a token that is part of a character) becomes U+FFFD instead of an exception.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  if (e.status == 503) res.set_header("Retry-After", "1");
  send_json(res, e.status, e.body());
}

// A request's choices in flight: the engine's events turned into text per choice.
struct Run {
  GenerationRequest r;
  std::shared_ptr<Channel> ch;
  std::vector<ChoiceText> choices;
  std::string id;
  int64_t created = unix_now();

  Run(GenerationRequest req, const ServedModel& m, std::string id_)
      : r(std::move(req)), ch(std::make_shared<Channel>(r.n)), id(std::move(id_)) {
    for (int i = 0; i < r.n; ++i) choices.emplace_back(m, r);
  }
};

json completion_logprobs(const Run& run, const ChoiceText& c, const ServedModel& m) {
  json tokens = json::array(), values = json::array(), top = json::array(), offsets = json::array();
  auto piece = [&](int32_t id) { return m.tok ? m.tok->token_bytes(uint32_t(id)) : fmt::format(" {}", id); };
  size_t offset = 0;
  if (run.r.echo) {
    const auto& lp = run.ch->prompt_logprobs[0];
    for (size_t i = 0; i < run.r.prompt.size(); ++i) {
      tokens.push_back(piece(run.r.prompt[i]));
      values.push_back(i == 0 || i > lp.size() ? json(nullptr) : json(lp[i - 1]));
      top.push_back(nullptr);
      offsets.push_back(offset);
      offset += piece(run.r.prompt[i]).size();
    }
  }
  for (const TokenEvent& e : c.tokens()) {
    tokens.push_back(piece(e.token));
    values.push_back(e.logprob);
    json alt = json::object();
    for (const auto& [id, lp] : e.top) alt[piece(id)] = lp;
    top.push_back(alt);
    offsets.push_back(offset);
    offset += piece(e.token).size();
  }
  return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json chat_logprobs(const ChoiceText& c, const ServedModel& m) {
  json content = json::array();
  auto piece = [&](int32_t id) { return m.tok->token_bytes(uint32_t(id)); };
  for (const TokenEvent& e : c.tokens()) {
    json alts = json::array();
    for (const auto& [id, lp] : e.top) alts.push_back({{"token", piece(id)}, {"logprob", lp}});
    content.push_back({{"token", piece(e.token)}, {"logprob", e.logprob}, {"top_logprobs", alts}});
  }
  return {{"content", content}};
}

// httplib's server with its request handling reachable without a socket (Server::answer).
class Http : public httplib::Server {
 public:
  void answer(httplib::Stream& conn) {
    // httplib writes a streamed body only while its listening socket is set (its shutdown
    // test): a server that does not listen stands in a placeholder that nothing reads.
    socket_t none = INVALID_SOCKET;
    const bool placeholder = svr_sock_.compare_exchange_strong(none, 0);
    bool closed = false;
    process_request(conn, true, closed, nullptr);
    if (placeholder) svr_sock_ = INVALID_SOCKET;
  }
};

// A connection that has sent `in` and collects what the server writes back.
class MemoryStream : public httplib::Stream {
 public:
  explicit MemoryStream(const std::string& in) : in_(in) {}
  bool is_readable() const override { return true; }
  bool is_writable() const override { return true; }
  ssize_t read(char* p, size_t n) override {
    n = std::min(n, in_.size() - at_);
    std::memcpy(p, in_.data() + at_, n);
    at_ += n;
    return ssize_t(n);
  }
  ssize_t write(const char* p, size_t n) override {
    out.append(p, n);
    return ssize_t(n);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { ip = "127.0.0.1", port = 0; }
  void get_local_ip_and_port(std::string& ip, int& port) const override { ip = "127.0.0.1", port = 0; }
  socket_t socket() const override { return INVALID_SOCKET; }
  std::string out;

 private:
  const std::string& in_;
  size_t at_ = 0;
};

}  // namespace

struct Server::Impl {
  ServerOptions o;
  Http http;
  std::thread listener;
  std::atomic<bool> ready{false}, stopped{false}, listen_done{false};
  std::unique_ptr<Engine> engine;
  ServedModel served;
  std::atomic<int64_t> next_id{1};
  std::mutex counts_m;
  std::map<std::pair<std::string, int>, int64_t> counts;  // (route, status) -> requests

  explicit Impl(ServerOptions opt) : o(std::move(opt)) {}
  void routes();
  void guarded(const httplib::Request& req, httplib::Response& res, bool needs_model,
               const std::function<void()>& fn);
  void generation(const httplib::Request& req, httplib::Response& res, bool chat);
  json final_response(Run& run) const;
  void stream(std::shared_ptr<Run> run, httplib::Response& res);
  std::string metrics();
};

// Checks the key and readiness, and turns every exception into a JSON error.
void Server::Impl::guarded(const httplib::Request& req, httplib::Response& res, bool needs_model,
                           const std::function<void()>& fn) {
  try {
    if (!o.api_key.empty() && req.get_header_value("Authorization") != "Bearer " + o.api_key)
      throw ApiError{401, "missing or wrong API key (send 'Authorization: Bearer KEY')", ""};
    if (needs_model && !ready) throw ApiError{503, "the model is still loading", ""};
    fn();
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (const std::exception& e) {
    send_error(res, ApiError{500, fmt::format("internal error: {}", e.what()), ""});
  }
}

void Server::Impl::generation(const httplib::Request& req, httplib::Response& res, bool chat) {
  GenerationRequest r = parse_generation(req.body, chat, served);
  if (r.stream && r.echo) throw ApiError{400, "'echo' is not supported with 'stream'", "echo"};
  auto run = std::make_shared<Run>(std::move(r), served,
                                   fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id++));
  std::vector<Job> jobs;
  for (int i = 0; i < run->r.n; ++i) {
    Job j;
    j.index = i;
    j.domain = run->r.domain;
    j.prompt = run->r.prompt;
    j.s = run->r.s;
    j.s.seed = run->r.s.seed + uint64_t(i);  // choice i: its own stream of draws
    j.stop_tokens = run->r.stop_tokens;
    j.top_logprobs = run->r.logprobs;
    j.prompt_logprobs = run->r.echo && run->r.logprobs >= 0;
    j.out = run->ch;
    jobs.push_back(std::move(j));
  }
  if (!engine->submit(std::move(jobs)))
    throw ApiError{503, fmt::format("the server is busy ({} slots and the queue are full); retry",
                                    engine->slots()), ""};
  if (run->r.stream) return stream(run, res);
  int open = run->r.n;  // finish events still due from the engine
  while (open > 0) {
    auto e = run->ch->pop(1000);
    if (!e) continue;
    if (!e->finish_reason.empty()) --open;
    ChoiceText& c = run->choices[size_t(e->index)];
    if (c.apply(*e) && e->finish_reason.empty()) run->ch->cancelled[e->index] = true;
  }
  for (const ChoiceText& c : run->choices)
    if (c.finish_reason() == "error") {
      std::lock_guard<std::mutex> lock(run->ch->m);
      throw ApiError{500, "generation failed: " + run->ch->error, ""};
    }
  send_json(res, 200, final_response(*run));
}

json Server::Impl::final_response(Run& run) const {
  json choices = json::array();
  int64_t completion = 0;
  for (int i = 0; i < run.r.n; ++i) {
    ChoiceText& c = run.choices[size_t(i)];
    completion += int64_t(c.ids().size());
    json ch = {{"index", i}, {"finish_reason", c.finish_reason()}};
    if (run.r.chat) {
      ch["message"] = {{"role", "assistant"}, {"content", c.text()}};
      ch["logprobs"] = run.r.logprobs >= 0 ? chat_logprobs(c, served) : json(nullptr);
    } else {
      ch["text"] = (run.r.echo ? detokenize(served, run.r.prompt) : "") + c.text();
      ch["logprobs"] = run.r.logprobs >= 0 ? completion_logprobs(run, c, served) : json(nullptr);
    }
    choices.push_back(ch);
  }
  const int64_t prompt = int64_t(run.r.prompt.size());
  return {{"id", run.id}, {"object", run.r.chat ? "chat.completion" : "text_completion"},
          {"created", run.created}, {"model", served.name}, {"choices", choices},
          {"usage", {{"prompt_tokens", prompt}, {"completion_tokens", completion},
                     {"total_tokens", prompt + completion}}}};
}

// Server-sent events: one chunk per piece of text, a last chunk per choice with its
// finish_reason, then "data: [DONE]". A failed write (the client left) cancels every choice.
void Server::Impl::stream(std::shared_ptr<Run> run, httplib::Response& res) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [this, run](size_t, httplib::DataSink& sink) {
    auto chunk = [&](int i, const std::string& text, const json& finish, bool first) {
      json c = {{"index", i}, {"finish_reason", finish}};
      if (run->r.chat) {
        json delta = json::object();
        if (first) delta["role"] = "assistant";
        if (!text.empty() || first) delta["content"] = text;
        c["delta"] = delta;
      } else {
        c["text"] = text;
        c["logprobs"] = nullptr;
      }
      const json j = {{"id", run->id}, {"object", run->r.chat ? "chat.completion.chunk" : "text_completion"},
                      {"created", run->created}, {"model", served.name}, {"choices", {c}}};
      const std::string line = "data: " + dump(j) + "\n\n";
      return sink.write(line.data(), line.size());
    };
    bool ok = true;
    if (run->r.chat)
      for (int i = 0; i < run->r.n && ok; ++i) ok = chunk(i, "", nullptr, true);
    int open = run->r.n;
    while (ok && open > 0) {
      auto e = run->ch->pop(200);
      if (!e) {
        ok = sink.is_writable();
        continue;
      }
      if (!e->finish_reason.empty()) --open;
      ChoiceText& c = run->choices[size_t(e->index)];
      const bool was_done = c.done();
      if (c.apply(*e) && e->finish_reason.empty()) run->ch->cancelled[e->index] = true;
      if (was_done) continue;
      const std::string text = c.take_ready();
      if (!text.empty()) ok = chunk(e->index, text, nullptr, false);
      if (ok && c.done()) ok = chunk(e->index, "", c.finish_reason(), false);
    }
    if (!ok) {  // the client is gone: free its slots; the engine's finish events are dropped
      run->ch->cancel_all();
      return false;
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  });
}

std::string Server::Impl::metrics() {
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, const std::string& lines) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}", name, help, name, type, lines);
  };
  std::string lines;
  {
    std::lock_guard<std::mutex> lock(counts_m);
    for (const auto& [key, n] : counts)
      lines += fmt::format("sigma_requests_total{{route=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
  }
  metric("sigma_requests_total", "counter", "HTTP requests answered, by route and status.", lines);
  const EngineStats s = engine ? engine->stats() : EngineStats{};
  metric("sigma_prompt_tokens_total", "counter", "Prompt tokens run through the model.",
         fmt::format("sigma_prompt_tokens_total {}\n", s.prompt_tokens));
  metric("sigma_generated_tokens_total", "counter", "Tokens generated.",
         fmt::format("sigma_generated_tokens_total {}\n", s.generated_tokens));
  metric("sigma_decode_steps_total", "counter", "Batched decode steps.",
         fmt::format("sigma_decode_steps_total {}\n", s.decode_steps));
  metric("sigma_decode_seconds_total", "counter", "Time spent in decode steps.",
         fmt::format("sigma_decode_seconds_total {:.6f}\n", s.decode_seconds));
  metric("sigma_decode_tokens_per_second", "gauge",
         "Tokens decoded per second of decode time, all slots together, since start.",
         fmt::format("sigma_decode_tokens_per_second {:.3f}\n",
                     s.decode_seconds > 0 ? double(s.decode_tokens) / s.decode_seconds : 0.0));
  metric("sigma_busy_slots", "gauge", "Slots decoding a sequence.", fmt::format("sigma_busy_slots {}\n", s.busy_slots));
  metric("sigma_slots", "gauge", "Slots (sequences decoded together).", fmt::format("sigma_slots {}\n", o.slots));
  metric("sigma_queue_length", "gauge", "Choices waiting for a slot.", fmt::format("sigma_queue_length {}\n", s.queued));
  return out;
}

void Server::Impl::routes() {
  using httplib::Request;
  using httplib::Response;
  http.Get("/health", [this](const Request&, Response& res) {
    send_json(res, ready ? 200 : 503, {{"status", ready ? "ok" : "loading"}});
  });
  http.Get("/metrics", [this](const Request&, Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4");
  });
  http.Get("/v1/models", [this](const Request& req, Response& res) {
    guarded(req, res, true, [&] {
      json domains = json::array();
      for (const auto& d : served.cfg->domains) domains.push_back(d.name);
      json model = {{"id", served.name}, {"object", "model"}, {"created", unix_now()},
                    {"owned_by", "sigma"}, {"domains", domains}, {"context", served.cfg->context}};
      send_json(res, 200, {{"object", "list"}, {"data", {model}}});
    });
  });
  http.Post("/v1/completions", [this](const Request& req, Response& res) {
    guarded(req, res, true, [&] { generation(req, res, false); });
  });
  http.Post("/v1/chat/completions", [this](const Request& req, Response& res) {
    guarded(req, res, true, [&] { generation(req, res, true); });
  });
  http.Post("/tokenize", [this](const Request& req, Response& res) {
    guarded(req, res, true, [&] {
      const json j = parse_body(req.body);
      const char* key = j.contains("prompt") ? "prompt" : "text";
      if (!j.contains(key) || !j[key].is_string())
        throw ApiError{400, "'text' (or 'prompt') must be a string", key};
      const auto ids = tokens_of(j[key], served, key);
      send_json(res, 200, {{"tokens", ids}, {"count", ids.size()}});
    });
  });
  http.Post("/detokenize", [this](const Request& req, Response& res) {
    guarded(req, res, true, [&] {
      const json j = parse_body(req.body);
      if (!j.contains("tokens")) throw ApiError{400, "'tokens' is required", "tokens"};
      if (!j["tokens"].is_array()) throw ApiError{400, "'tokens' must be an array of token ids", "tokens"};
      send_json(res, 200, {{"text", detokenize(served, tokens_of(j["tokens"], served, "tokens"))}});
    });
  });
  // Refusals httplib makes itself (unknown route, body too large) get a JSON body too.
  http.set_error_handler([this](const Request& req, Response& res) {
    if (!res.body.empty()) return;
    std::string msg = fmt::format("HTTP {}", res.status);
    if (res.status == 404) msg = fmt::format("no route {} {}", req.method, req.path);
    if (res.status == 413) msg = fmt::format("the body is larger than the limit of {} bytes", o.max_body);
    send_json(res, res.status, ApiError{res.status, msg, ""}.body());
  });
  http.set_logger([this](const Request& req, const Response& res) {
    static const char* known[] = {"/health", "/metrics", "/v1/models", "/v1/completions",
                                  "/v1/chat/completions", "/tokenize", "/detokenize"};
    std::string route = "other";
    for (const char* k : known)
      if (req.path == k) route = k;
    std::lock_guard<std::mutex> lock(counts_m);
    counts[{route, res.status}] += 1;
  });
}

Server::Server(ServerOptions o) : impl_(std::make_unique<Impl>(std::move(o))) {
  SIGMA_CHECK(impl_->o.slots >= 1 && impl_->o.queue >= 1, "--slots and --queue must be at least 1");
  impl_->routes();
  impl_->http.set_payload_max_length(impl_->o.max_body);
}

Server::~Server() {
  stop();
  wait();
}

int Server::start() {
  Impl& s = *impl_;
  // Threads for every slot and queued request, plus a few for /health, /metrics and refusals.
  const size_t threads = size_t(s.o.slots + s.o.queue + 4);
  s.http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  int port = s.o.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.o.host);
  } else if (!s.http.bind_to_port(s.o.host, port)) {
    port = -1;
  }
  SIGMA_CHECK(port > 0, "cannot listen on {}:{} (in use, or not a local address)", s.o.host, s.o.port);
  s.listener = std::thread([&s] {
    s.http.listen_after_bind();
    s.listen_done = true;
  });
  return port;
}

void Server::serve_model(Model& model, const data::Tokenizer* tok, const std::string& name) {
  Impl& s = *impl_;
  s.served.name = name;
  s.served.cfg = &model.config();
  s.served.tok = tok;
  s.served.max_tokens_limit = s.o.max_tokens;
  s.served.max_n = std::min(8, s.o.queue);  // a request's choices all queue before taking slots
  s.engine = std::make_unique<Engine>(model, s.o.slots, s.o.queue);
  s.ready = true;
}

void Server::stop() {
  Impl& s = *impl_;
  if (s.stopped.exchange(true)) return;
  // httplib's stop() does nothing before its loop runs: a signal right after start() waits.
  while (s.listener.joinable() && !s.http.is_running() && !s.listen_done)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.http.stop();
}

std::string Server::answer(const std::string& request) {
  MemoryStream conn(request);
  impl_->http.answer(conn);
  return conn.out;
}

void Server::wait() {
  Impl& s = *impl_;
  if (s.listener.joinable()) s.listener.join();  // returns once every handler has finished
  if (s.engine) s.engine->shutdown();
}

}  // namespace sigma::serve
