#include "serve/server.h"

#include <atomic>

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "serve/api.h"
#include "serve/choice.h"
#include "serve/engine.h"
#include "serve/http.h"

namespace sigma::serve {

using nlohmann::json;

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

// Invalid UTF-8 (a token that is part of a character) becomes U+FFFD instead of an exception.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

http::Response json_response(int status, const json& j) { return {status, "application/json", dump(j), {}}; }

http::Response error_response(const ApiError& e) {
  http::Response r = json_response(e.status, e.body());
  if (e.status == 503) r.headers.emplace_back("Retry-After", "1");
  return r;
}

struct Served {
  ServedModel api;
  std::unique_ptr<Engine> engine;
};

// A request's choices in flight: the engine's events turned into text per choice.
struct Run {
  GenerationRequest r;
  const ServedModel& m;
  std::string model_id;  // as the client named it (or the default model's name)
  std::shared_ptr<Channel> ch;
  std::vector<ChoiceText> choices;
  std::vector<size_t> tokens_sent;  // per choice: tokens whose logprobs a stream has sent
  std::vector<std::string> bytes_sent;  // per choice: bytes of the tokens a stream has sent (text_offset)
  std::string id;
  int64_t created = unix_now();

  Run(GenerationRequest req, const ServedModel& model, std::string name, std::string id_)
      : r(std::move(req)), m(model), model_id(std::move(name)), ch(std::make_shared<Channel>(r.n)),
        tokens_sent(size_t(r.n), 0), bytes_sent(size_t(r.n)), id(std::move(id_)) {
    for (int i = 0; i < r.n; ++i) choices.emplace_back(m, r);
  }
  json usage() const {
    int64_t completion = 0;
    for (const ChoiceText& c : choices) completion += int64_t(c.ids().size());
    const int64_t prompt = int64_t(r.prompt.size());
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  }
};

// OpenAI's text_offset: characters before a token in the text so far (`bytes`). A token inside
// a character (byte fallback) points at that character's start.
size_t text_offset(const std::string& bytes) {
  return utf8_chars(bytes) - (utf8_complete_prefix(bytes) < bytes.size() ? 1 : 0);
}

// Completions logprobs of tokens [from, to) of a choice; `text` holds the bytes before them.
json completion_logprobs(const Run& run, const ChoiceText& c, size_t from, size_t to, std::string& text,
                         bool with_prompt) {
  json tokens = json::array(), values = json::array(), top = json::array(), offsets = json::array();
  auto bytes = [&](int32_t id) { return run.m.tok ? run.m.tok->token_bytes(uint32_t(id)) : fmt::format(" {}", id); };
  if (with_prompt) {
    const auto& lp = run.ch->prompt_logprobs[0];
    for (size_t i = 0; i < run.r.prompt.size(); ++i) {
      tokens.push_back(token_label(run.m, run.r.prompt[i]));
      values.push_back(i == 0 || i > lp.size() ? json(nullptr) : json(lp[i - 1]));
      top.push_back(nullptr);
      offsets.push_back(text_offset(text));
      text += bytes(run.r.prompt[i]);
    }
  }
  for (size_t t = from; t < to; ++t) {
    const TokenEvent& e = c.tokens()[t];
    tokens.push_back(token_label(run.m, e.token));
    values.push_back(e.logprob);
    json alt = json::object();
    for (const auto& [id, lp] : e.top) {  // distinct tokens with the same text keep distinct keys
      std::string key = token_label(run.m, id);
      if (alt.contains(key)) key += fmt::format(" [id {}]", id);
      alt[key] = lp;
    }
    top.push_back(alt);
    offsets.push_back(text_offset(text));
    text += bytes(e.token);
  }
  return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json chat_logprobs(const Run& run, const ChoiceText& c, size_t from, size_t to) {
  json content = json::array();
  auto entry = [&](int32_t id, double lp) {
    const std::string& b = run.m.tok->token_bytes(uint32_t(id));
    return json{{"token", token_label(run.m, id)}, {"logprob", lp}, {"bytes", std::vector<int>(b.begin(), b.end())}};
  };
  for (size_t t = from; t < to; ++t) {
    const TokenEvent& e = c.tokens()[t];
    json alts = json::array();
    for (const auto& [id, lp] : e.top) alts.push_back(entry(id, lp));
    json tok = entry(e.token, e.logprob);
    tok["top_logprobs"] = alts;
    content.push_back(tok);
  }
  return {{"content", content}};
}

const char* const kRoutes[] = {"/health", "/metrics", "/v1/models", "/v1/completions",
                               "/v1/chat/completions", "/tokenize", "/detokenize"};

}  // namespace

struct Server::Impl {
  ServerOptions o;
  http::Limits limits;
  http::Handlers handlers;
  std::unique_ptr<http::Server> http;
  std::atomic<bool> ready{false}, stopped{false};
  mutable std::mutex models_m;
  std::vector<std::unique_ptr<Served>> models;  // appended only; entries never move
  std::atomic<int64_t> next_id{1};
  std::mutex counts_m;
  std::map<std::pair<std::string, int>, int64_t> counts;  // (route, status) -> requests

  explicit Impl(ServerOptions opt) : o(std::move(opt)) {}
  std::atomic<int> in_flight{0};  // requests whose handler runs
  std::vector<Served*> snapshot() const {
    std::lock_guard<std::mutex> lock(models_m);
    std::vector<Served*> out;
    for (const auto& m : models) out.push_back(m.get());
    return out;
  }
  std::optional<http::Response> head(const http::Request& req);
  void handle(const http::Request& req, http::Responder& res);
  void generation(const http::Request& req, http::Responder& res, bool chat);
  json final_response(Run& run) const;
  void stream(Run& run, http::Responder& res);
  json models_list() const;
  std::string metrics();
};

// On the event loop, before any body is read: routes, the key, readiness, and the cheap GETs.
std::optional<http::Response> Server::Impl::head(const http::Request& req) {
  try {
    const std::string& p = req.path;
    const bool known = std::find(std::begin(kRoutes), std::end(kRoutes), p) != std::end(kRoutes);
    if (!known) throw ApiError{404, fmt::format("no route {} {}", req.method, p.substr(0, 200)), ""};
    // GET routes answer HEAD too (RFC 9110 9.1; the HTTP layer leaves the body out); a 405
    // names the methods a route takes in Allow (RFC 9110 15.5.6).
    const bool get = p == "/health" || p == "/metrics" || p == "/v1/models";
    if (get ? req.method != "GET" && req.method != "HEAD" : req.method != "POST") {
      http::Response r = error_response(ApiError{
          405, fmt::format("{} takes {}, not {}", p, get ? "GET" : "POST", req.method.substr(0, 16)), ""});
      r.headers.emplace_back("Allow", get ? "GET, HEAD" : "POST");
      return r;
    }
    if (p == "/health") return json_response(ready ? 200 : 503, {{"status", ready ? "ok" : "loading"}});
    if (p == "/metrics") return http::Response{200, "text/plain; version=0.0.4", metrics(), {}};
    if (!o.api_key.empty() && req.header("authorization") != "Bearer " + o.api_key)
      throw ApiError{401, "missing or wrong API key (send 'Authorization: Bearer KEY')", ""};
    if (!ready) throw ApiError{503, "the model is still loading", ""};
    if (p == "/v1/models") return json_response(200, models_list());
    return std::nullopt;
  } catch (const ApiError& e) {
    return error_response(e);
  }
}

void Server::Impl::handle(const http::Request& req, http::Responder& res) {
  try {
    const std::vector<Served*> ms = snapshot();
    const ServedModel& def = ms.at(0)->api;
    if (req.path == "/v1/completions") return generation(req, res, false);
    if (req.path == "/v1/chat/completions") return generation(req, res, true);
    const json j = parse_body(req.body);
    if (req.path == "/tokenize") {
      const char* key = j.contains("prompt") ? "prompt" : "text";
      if (!j.contains(key) || !j[key].is_string())
        throw ApiError{400, "'text' (or 'prompt') must be a string", key};
      std::vector<const ServedModel*> apis;
      for (Served* s : ms) apis.push_back(&s->api);
      const ServedModel& m = ms[resolve_model(j, apis).model]->api;
      const auto ids = tokens_of(j[key], m, key);
      return res.send(json_response(200, {{"tokens", ids}, {"count", ids.size()}}));
    }
    if (req.path == "/detokenize") {
      if (!j.contains("tokens")) throw ApiError{400, "'tokens' is required", "tokens"};
      if (!j["tokens"].is_array()) throw ApiError{400, "'tokens' must be an array of token ids", "tokens"};
      std::vector<const ServedModel*> apis;
      for (Served* s : ms) apis.push_back(&s->api);
      const ServedModel& m = ms[resolve_model(j, apis).model]->api;
      return res.send(json_response(200, {{"text", detokenize(m, tokens_of(j["tokens"], m, "tokens"))}}));
    }
    (void)def;
    throw ApiError{404, fmt::format("no route {} {}", req.method, req.path), ""};
  } catch (const ApiError& e) {
    res.send(error_response(e));
  } catch (const std::exception& e) {
    res.send(error_response(ApiError{500, fmt::format("internal error: {}", e.what()), ""}));
  }
}

void Server::Impl::generation(const http::Request& req, http::Responder& res, bool chat) {
  const json j = parse_body(req.body);
  const std::vector<Served*> ms = snapshot();
  std::vector<const ServedModel*> apis;
  for (Served* s : ms) apis.push_back(&s->api);
  const ModelRef ref = resolve_model(j, apis);
  Served& served = *ms[ref.model];
  GenerationRequest r = parse_generation(j, chat, served.api, ref.domain);
  if (r.stream && r.echo) throw ApiError{400, "'echo' is not supported with 'stream'", "echo"};
  const std::string name = j.contains("model") ? j["model"].get<std::string>() : served.api.name;
  Run run(std::move(r), served.api, name, fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id++));
  std::vector<Job> jobs;
  for (int i = 0; i < run.r.n; ++i) {
    Job jb;
    jb.index = i;
    jb.domain = run.r.domain;
    jb.prompt = run.r.prompt;
    jb.s = run.r.s;
    jb.s.seed = run.r.s.seed + uint64_t(i);  // choice i: its own stream of draws
    jb.stop_tokens = run.r.stop_tokens;
    jb.top_logprobs = run.r.logprobs;
    jb.prompt_logprobs = run.r.echo && run.r.logprobs >= 0;
    jb.logit_bias = run.r.logit_bias;
    jb.json_object = run.r.json_object;
    jb.out = run.ch;
    jobs.push_back(std::move(jb));
  }
  if (!served.engine->submit(std::move(jobs)))
    throw ApiError{503, fmt::format("the server is busy ({} slots and the queue are full); retry",
                                    served.engine->slots()), ""};
  if (run.r.stream) return stream(run, res);
  int open = run.r.n;  // finish events still due from the engine
  while (open > 0) {
    // Checked before every event, not only when none comes: tokens arrive faster than the pop's
    // timeout, so a client that left (or a drain that cut it) would otherwise hold its slots
    // until max_tokens.
    if (!res.alive()) {
      run.ch->cancel_all();
      return;
    }
    auto e = run.ch->pop(100);
    if (!e) continue;
    if (!e->finish_reason.empty()) --open;
    ChoiceText& c = run.choices[size_t(e->index)];
    if (c.apply(*e) && e->finish_reason.empty()) run.ch->cancelled[e->index] = true;
  }
  for (const ChoiceText& c : run.choices)
    if (c.finish_reason() == "error") {
      std::lock_guard<std::mutex> lock(run.ch->m);
      throw ApiError{500, "generation failed: " + run.ch->error, ""};
    }
  res.send(json_response(200, final_response(run)));
}

json Server::Impl::final_response(Run& run) const {
  json choices = json::array();
  for (int i = 0; i < run.r.n; ++i) {
    ChoiceText& c = run.choices[size_t(i)];
    json ch = {{"index", i}, {"finish_reason", c.finish_reason()}};
    if (run.r.chat) {
      ch["message"] = {{"role", "assistant"}, {"content", c.text()}};
      ch["logprobs"] = run.r.logprobs >= 0 ? chat_logprobs(run, c, 0, c.tokens().size()) : json(nullptr);
    } else {
      ch["text"] = (run.r.echo ? detokenize(run.m, run.r.prompt) : "") + c.text();
      std::string text;
      ch["logprobs"] = run.r.logprobs >= 0 ? completion_logprobs(run, c, 0, c.tokens().size(), text, run.r.echo)
                                           : json(nullptr);
    }
    choices.push_back(ch);
  }
  return {{"id", run.id}, {"object", run.r.chat ? "chat.completion" : "text_completion"},
          {"created", run.created}, {"model", run.model_id}, {"choices", choices}, {"usage", run.usage()}};
}

// Server-sent events: one chunk per piece of text (with the logprobs of the tokens it completes
// when asked), a last chunk per choice with its finish_reason, a usage chunk when
// stream_options.include_usage, then "data: [DONE]". A failed write (the client left, or reads
// too slowly) cancels every choice.
void Server::Impl::stream(Run& run, http::Responder& res) {
  res.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
  auto event = [&](json choices, const json& usage) {
    json j = {{"id", run.id}, {"object", run.r.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", run.created}, {"model", run.model_id}, {"choices", std::move(choices)}};
    if (run.r.include_usage) j["usage"] = usage;
    return res.write("data: " + dump(j) + "\n\n");
  };
  auto chunk = [&](int i, const std::string& text, const json& finish, bool first) {
    ChoiceText& c = run.choices[size_t(i)];
    const size_t from = run.tokens_sent[size_t(i)], to = c.tokens().size();
    json ch = {{"index", i}, {"finish_reason", finish}};
    if (run.r.chat) {
      json delta = json::object();
      if (first) delta["role"] = "assistant";
      if (!text.empty() || first) delta["content"] = text;
      ch["delta"] = delta;
      ch["logprobs"] = run.r.logprobs >= 0 && !first ? chat_logprobs(run, c, from, to) : json(nullptr);
    } else {
      ch["text"] = text;
      ch["logprobs"] = run.r.logprobs >= 0 ? completion_logprobs(run, c, from, to, run.bytes_sent[size_t(i)], false)
                                           : json(nullptr);
    }
    if (!first) run.tokens_sent[size_t(i)] = to;
    return event(json::array({ch}), nullptr);
  };
  bool ok = true;
  if (run.r.chat)
    for (int i = 0; i < run.r.n && ok; ++i) ok = chunk(i, "", nullptr, true);
  int open = run.r.n;
  while (ok && open > 0) {
    if (!(ok = res.alive())) break;  // before every event: tokens that yield no text write nothing
    auto e = run.ch->pop(100);
    if (!e) continue;
    if (!e->finish_reason.empty()) --open;
    ChoiceText& c = run.choices[size_t(e->index)];
    const bool was_done = c.done();
    if (c.apply(*e) && e->finish_reason.empty()) run.ch->cancelled[e->index] = true;
    if (was_done) continue;
    const std::string text = c.take_ready();
    if (!text.empty()) ok = chunk(e->index, text, nullptr, false);
    if (ok && c.done()) ok = chunk(e->index, "", c.finish_reason(), false);
  }
  if (ok && run.r.include_usage) ok = event(json::array(), run.usage());
  if (!ok) {  // the client is gone: free its slots; the engine's finish events are dropped
    run.ch->cancel_all();
    return;
  }
  res.write("data: [DONE]\n\n");
  res.end_stream();
}

json Server::Impl::models_list() const {
  json data = json::array();
  for (const Served* s : snapshot()) {
    const ServedModel& m = s->api;
    json domains = json::array();
    for (const auto& d : m.cfg->domains) domains.push_back(d.name);
    const std::vector<std::string> ids = model_ids(m);
    for (size_t i = 0; i < ids.size(); ++i)
      data.push_back({{"id", ids[i]}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "sigma"},
                      {"root", m.name}, {"domain", i == 0 ? json(nullptr) : json(m.cfg->domains[i - 1].name)},
                      {"domains", domains}, {"context", m.cfg->context}});
  }
  return {{"object", "list"}, {"data", data}};
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
  EngineStats s;  // every model's engine together
  for (const Served* m : snapshot()) {
    const EngineStats e = m->engine->stats();
    s.prompt_tokens += e.prompt_tokens, s.generated_tokens += e.generated_tokens;
    s.prefix_tokens_reused += e.prefix_tokens_reused;
    s.decode_steps += e.decode_steps, s.decode_tokens += e.decode_tokens, s.decode_seconds += e.decode_seconds;
    s.busy_slots += e.busy_slots, s.queued += e.queued;
    for (size_t b = 0; b < s.time_to_first_token.counts.size(); ++b) {
      s.time_to_first_token.counts[b] += e.time_to_first_token.counts[b];
      s.inter_token.counts[b] += e.inter_token.counts[b];
    }
    s.time_to_first_token.sum += e.time_to_first_token.sum, s.time_to_first_token.count += e.time_to_first_token.count;
    s.inter_token.sum += e.inter_token.sum, s.inter_token.count += e.inter_token.count;
  }
  metric("sigma_prompt_tokens_total", "counter", "Prompt tokens run through the model.",
         fmt::format("sigma_prompt_tokens_total {}\n", s.prompt_tokens));
  metric("sigma_prefix_cache_tokens_total", "counter",
         "Prompt tokens whose keys and values were reused from an earlier prompt (prefix cache).",
         fmt::format("sigma_prefix_cache_tokens_total {}\n", s.prefix_tokens_reused));
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
  metric("sigma_time_to_first_token_seconds", "histogram",
         "From a choice's submission (queueing included) to its first token.",
         s.time_to_first_token.prometheus("sigma_time_to_first_token_seconds"));
  metric("sigma_inter_token_seconds", "histogram", "Between two consecutive tokens of a choice.",
         s.inter_token.prometheus("sigma_inter_token_seconds"));
  metric("sigma_busy_slots", "gauge", "Slots decoding a sequence.", fmt::format("sigma_busy_slots {}\n", s.busy_slots));
  metric("sigma_slots", "gauge", "Slots (sequences decoded together).", fmt::format("sigma_slots {}\n", o.slots));
  metric("sigma_queue_length", "gauge", "Choices waiting for a slot.", fmt::format("sigma_queue_length {}\n", s.queued));
  metric("sigma_open_connections", "gauge", "Open client connections.",
         fmt::format("sigma_open_connections {}\n", http ? http->connections() : 0));
  return out;
}

Server::Server(ServerOptions o) : impl_(std::make_unique<Impl>(std::move(o))) {
  Impl& s = *impl_;
  SIGMA_CHECK(s.o.slots >= 1 && s.o.queue >= 1, "--slots and --queue must be at least 1");
  SIGMA_CHECK(s.o.max_connections >= 1, "--max-connections must be at least 1");
  http::Limits& l = s.limits;
  l.max_connections = s.o.max_connections;
  l.backlog = std::max(128, s.o.max_connections);
  l.max_body = s.o.max_body;
  l.head_timeout_s = s.o.head_timeout;
  l.request_timeout_s = s.o.request_timeout;
  l.idle_timeout_s = s.o.idle_timeout;
  l.write_timeout_s = s.o.write_timeout;
  // A worker for every slot and queued choice, plus a few for tokenize and refusals.
  l.workers = s.o.slots + s.o.queue + 4;
  l.max_waiting = 64;
  s.handlers.head = [&s](const http::Request& req) { return s.head(req); };
  s.handlers.handle = [&s](const http::Request& req, http::Responder& res) {
    struct Count {  // requests_in_flight(), on every way out
      std::atomic<int>& n;
      explicit Count(std::atomic<int>& c) : n(c) { n.fetch_add(1); }
      ~Count() { n.fetch_sub(1); }
    } count(s.in_flight);
    s.handle(req, res);
  };
  s.handlers.error = [](int status, const std::string& msg) { return error_response(ApiError{status, msg, ""}); };
  s.handlers.answered = [&s](const http::Request& req, int status) {
    std::string route = "other";
    for (const char* k : kRoutes)
      if (req.path == k) route = k;
    std::lock_guard<std::mutex> lock(s.counts_m);
    s.counts[{route, status}] += 1;
  };
}

Server::~Server() {
  stop();
  wait();
}

int Server::start() {
  Impl& s = *impl_;
  s.http = std::make_unique<http::Server>(s.limits, s.handlers);
  return s.http->start(s.o.host, s.o.port);
}

void Server::serve_model(Model& model, const data::Tokenizer* tok, const std::string& name, bool last,
                         const DomainRegistry* data_domains) {
  Impl& s = *impl_;
  auto m = std::make_unique<Served>();
  m->api.name = name;
  m->api.cfg = &model.config();
  m->api.tok = tok;
  m->api.data_domains = data_domains;
  m->api.max_tokens_limit = s.o.max_tokens;
  m->api.max_n = std::min(8, s.o.queue);  // a request's choices all queue before taking slots
  SIGMA_CHECK(!name.empty() && name.find(':') == std::string::npos,
              "a served model's name must be non-empty and without ':' (NAME:DOMAIN names a domain), not '{}'", name);
  for (const Served* other : s.snapshot())
    SIGMA_CHECK(other->api.name != name, "two models are named '{}'", name);
  m->engine = std::make_unique<Engine>(model, s.o.slots, s.o.queue, tok, s.o.prefix_cache);
  {
    std::lock_guard<std::mutex> lock(s.models_m);
    s.models.push_back(std::move(m));
  }
  if (last) s.ready = true;
}

void Server::stop() {
  Impl& s = *impl_;
  if (s.stopped.exchange(true)) return;
  if (s.http)
    s.http->drain(std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(s.o.drain_timeout)));
}

std::string Server::answer(const std::string& request) {
  return http::answer_bytes(impl_->limits, impl_->handlers, request);
}

int Server::connections() const { return impl_->http ? impl_->http->connections() : 0; }

int Server::requests_in_flight() const { return impl_->in_flight.load(); }

void Server::wait() {
  Impl& s = *impl_;
  if (s.http) s.http->wait();  // returns once every handler has finished
  for (Served* m : s.snapshot()) m->engine->shutdown();
}

}  // namespace sigma::serve
