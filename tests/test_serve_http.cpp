// sigma serve's HTTP side in-process (serve/server.h) through cpp-httplib's client: /health
// while loading, every refusal as a JSON error with its 4xx status, completions (plain,
// streamed, stop strings, echo + logprobs), tokenize round trips and /metrics.
#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "data/tokenizer.h"
#include "kernels/ops.h"
#include "serve/choice.h"
#include "serve/json_prefix.h"
#include "serve/server.h"
#include "serve_test_util.h"

using namespace sigma;
using nlohmann::json;

namespace {

ModelConfig byte_config(const data::Tokenizer& tok) { return sigma::testing::two_domain_serve_config(tok, 40, 2); }

struct Fixture {
  data::Tokenizer tok;
  Model model{byte_config(tok), 3};
  serve::Server server;
  int port;
  httplib::Client cli;
  explicit Fixture(serve::ServerOptions o = {}, bool load = true)
      : server([&] {
          o.port = 0;
          return o;
        }()),
        port(server.start()), cli("127.0.0.1", port) {
    if (load) server.serve_model(model, &tok, "tiny");
  }
  httplib::Result post(const std::string& path, const std::string& body,
                       httplib::Headers h = {}) {
    return cli.Post(path, h, body, "application/json");
  }
};

// Status and the error object's message; fails when the body is not the JSON error shape.
std::pair<int, std::string> error_of(const httplib::Result& r) {
  if (!r) return {-1, "no response"};
  const json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded() || !j.contains("error") || !j["error"]["message"].is_string())
    return {r->status, "NOT A JSON ERROR: " + r->body};
  return {r->status, j["error"]["message"].get<std::string>()};
}

}  // namespace

TEST(ServeHttp, HealthSaysLoadingUntilTheModelIsServed) {
  Fixture f({}, false);
  auto r = f.cli.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_EQ(error_of(f.post("/v1/completions", R"({"prompt":"a"})")).first, 503);
  f.server.serve_model(f.model, &f.tok, "tiny");
  r = f.cli.Get("/health");
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["status"], "ok");
}

TEST(ServeHttp, EveryRefusalIsAJsonErrorWithItsStatus) {
  serve::ServerOptions o;
  o.max_body = 4096;
  o.max_tokens = 64;
  o.api_key = "k";
  Fixture f(o);
  const httplib::Headers key = {{"Authorization", "Bearer k"}};
  struct Case { std::string path, body; int status; std::string says; };
  const std::vector<Case> cases = {
      {"/v1/completions", "{\"prompt\": ", 400, "not valid JSON"},
      {"/v1/completions", "[1, 2]", 400, "JSON object"},
      {"/v1/completions", R"({"prompt": "a", "max_tokens": "ten"})", 400, "'max_tokens' must be an integer"},
      {"/v1/completions", R"({"prompt": "a", "temperature": [1]})", 400, "'temperature' must be a number"},
      {"/v1/completions", R"({"prompt": "a", "stream": 1})", 400, "'stream' must be a boolean"},
      {"/v1/completions", R"({"prompt": "a", "domain": "law"})", 400, "unknown domain 'law' (this model has: prose, code)"},
      {"/v1/completions", R"({"prompt": ")" + std::string(41, 'x') + R"("})", 400, "the prompt has 41 tokens; the model's context is 40"},
      {"/v1/completions", R"({"prompt": "a", "max_tokens": 65})", 400, "'max_tokens' = 65 is out of range [0, 64]"},
      {"/v1/completions", R"({"prompt": [1, 99999]})", 400, "not a token id"},
      {"/v1/completions", R"({"max_tokens": 3})", 400, "'prompt' is required"},
      {"/v1/completions", R"({"prompt": ["a", "b"]})", 400, "one prompt per request"},
      {"/v1/completions", "{\"prompt\": \"\xff\xfe\"}", 400, "not valid JSON"},  // invalid UTF-8
      {"/v1/completions", R"({"prompt": ")" + std::string(5000, 'x') + R"("})", 413, "larger than the limit of 4096 bytes"},
      {"/v1/chat/completions", R"({"messages": [{"role": "robot", "content": "x"}]})", 400, "role 'robot'"},
      {"/v1/chat/completions", R"({"messages": "hi"})", 400, "'messages' must be a non-empty array"},
      {"/v1/nothing", "{}", 404, "no route POST /v1/nothing"},
      {"/detokenize", R"({"tokens": "x"})", 400, "'tokens' must be an array"},
  };
  for (const Case& c : cases) {
    const auto [status, msg] = error_of(f.post(c.path, c.body, key));
    EXPECT_EQ(status, c.status) << c.body.substr(0, 80) << ": " << msg;
    EXPECT_NE(msg.find(c.says), std::string::npos) << c.body.substr(0, 80) << ": " << msg;
  }
  const auto [status, msg] = error_of(f.post("/v1/completions", R"({"prompt": "a"})", {{"Authorization", "Bearer wrong"}}));
  EXPECT_EQ(status, 401) << msg;
  EXPECT_EQ(error_of(f.post("/v1/completions", R"({"prompt": "a"})")).first, 401);  // no key
  // Nothing above reached the engine.
  const std::string m = f.cli.Get("/metrics")->body;
  EXPECT_NE(m.find("sigma_generated_tokens_total 0\n"), std::string::npos) << m;
}

TEST(ServeHttp, CompletionsStreamStopAndScore) {
  Fixture f;
  auto r = f.post("/v1/completions", R"({"prompt": "the cat", "max_tokens": 12, "temperature": 0})");
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
  const json j = json::parse(r->body);
  const std::string text = j["choices"][0]["text"];
  EXPECT_EQ(j["usage"]["prompt_tokens"], 7);  // byte tokenizer: one token per byte
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["usage"]["total_tokens"], 19);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  // Streamed: the same text in pieces, each event a JSON chunk, then [DONE].
  r = f.post("/v1/completions", R"({"prompt": "the cat", "max_tokens": 12, "temperature": 0, "stream": true})");
  ASSERT_TRUE(r && r->status == 200);
  std::string streamed, last;
  size_t pos = 0;
  while ((pos = r->body.find("data: ", pos)) != std::string::npos) {
    const size_t end = r->body.find("\n\n", pos);
    last = r->body.substr(pos + 6, end - pos - 6);
    if (last != "[DONE]") streamed += json::parse(last)["choices"][0]["text"].get<std::string>();
    pos = end;
  }
  EXPECT_EQ(last, "[DONE]");
  EXPECT_EQ(streamed, text);
  // A stop string cuts the text before it.
  if (text.size() > 3) {
    const std::string stop = text.substr(2, 2);
    r = f.post("/v1/completions", json{{"prompt", "the cat"}, {"max_tokens", 12}, {"temperature", 0}, {"stop", stop}}.dump());
    const json s = json::parse(r->body);
    EXPECT_EQ(s["choices"][0]["text"], text.substr(0, text.find(stop)));
    EXPECT_EQ(s["choices"][0]["finish_reason"], "stop");
  }
  // echo + logprobs with max_tokens 0 scores the prompt: null first, then one per token.
  r = f.post("/v1/completions", R"({"prompt": "abcd", "max_tokens": 0, "echo": true, "logprobs": 1})");
  const json e = json::parse(r->body);
  EXPECT_EQ(e["choices"][0]["text"], "abcd");
  const json& lp = e["choices"][0]["logprobs"]["token_logprobs"];
  ASSERT_EQ(lp.size(), 4u) << r->body;
  EXPECT_TRUE(lp[0].is_null());
  for (int i = 1; i < 4; ++i) EXPECT_LT(lp[i].get<double>(), 0.0);
  // Scoring alone takes context + 1 tokens (an evaluation window), not one more.
  const std::string window(41, 'w');
  r = f.post("/v1/completions", json{{"prompt", window}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}}.dump());
  EXPECT_EQ(json::parse(r->body)["choices"][0]["logprobs"]["token_logprobs"].size(), 41u) << r->body;
  r = f.post("/v1/completions", json{{"prompt", window + "w"}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}}.dump());
  EXPECT_EQ(error_of(r).second, "the prompt has 42 tokens; the model's context is 40 (+1 when only scoring)");
  // n = 3 seeded choices: distinct seeds, each reproducible.
  const std::string nreq = R"({"prompt": "x", "max_tokens": 8, "temperature": 1, "seed": 5, "n": 3})";
  const json a = json::parse(f.post("/v1/completions", nreq)->body), b = json::parse(f.post("/v1/completions", nreq)->body);
  ASSERT_EQ(a["choices"].size(), 3u);
  EXPECT_EQ(a["choices"], b["choices"]);
  EXPECT_NE(a["choices"][0]["text"], a["choices"][1]["text"]);
  // Streamed with n = 2: both choices end, each with its finish_reason, then [DONE].
  r = f.post("/v1/completions", R"({"prompt": "x", "max_tokens": 5, "seed": 5, "n": 2, "stream": true})");
  int finished[2] = {0, 0};
  pos = 0;
  while ((pos = r->body.find("data: {", pos)) != std::string::npos) {
    const size_t end = r->body.find("\n\n", pos);
    const json c = json::parse(r->body.substr(pos + 6, end - pos - 6))["choices"][0];
    if (!c["finish_reason"].is_null()) ++finished[c["index"].get<int>()];
    pos = end;
  }
  EXPECT_EQ(finished[0], 1);
  EXPECT_EQ(finished[1], 1);
  EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos);
  // Chat logprobs: one entry per generated token, each with its alternatives.
  r = f.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                         "temperature": 0, "logprobs": true, "top_logprobs": 2})");
  const json chat = json::parse(r->body);
  const json& content = chat["choices"][0]["logprobs"]["content"];
  EXPECT_EQ(content.size(), chat["usage"]["completion_tokens"].get<size_t>()) << r->body;
  for (const json& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(), t["top_logprobs"][1]["logprob"].get<double>());
    EXPECT_EQ(t["logprob"], t["top_logprobs"][0]["logprob"]);  // greedy picks the top one
  }
}

TEST(ServeHttp, TokenizeModelsAndMetrics) {
  Fixture f;
  auto r = f.post("/tokenize", R"({"text": "héllo"})");
  const json t = json::parse(r->body);
  EXPECT_EQ(t["count"], 6);  // é is two bytes
  r = f.post("/detokenize", json{{"tokens", t["tokens"]}}.dump());
  EXPECT_EQ(json::parse(r->body)["text"], "héllo");
  const json models = json::parse(f.cli.Get("/v1/models")->body);
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["data"][0]["domains"], json({"prose", "code"}));
  f.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "domain": "code"})");
  // A request is counted once its response is written, and its slot freed by the engine's
  // next step, both of which the client may see after its response.
  const std::string counted = "sigma_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 1";
  std::string m = f.cli.Get("/metrics")->body;
  auto settled = [&] {
    return m.find(counted) != std::string::npos && m.find("sigma_busy_slots 0") != std::string::npos;
  };
  for (int i = 0; i < 200 && !settled(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    m = f.cli.Get("/metrics")->body;
  }
  for (const char* name : {counted.c_str(),
                           "sigma_generated_tokens_total ", "sigma_decode_tokens_per_second ",
                           "sigma_busy_slots 0", "sigma_queue_length 0", "# TYPE sigma_prompt_tokens_total counter"})
    EXPECT_NE(m.find(name), std::string::npos) << name << "\n" << m;
}

TEST(ServeHttp, Utf8PrefixHoldsBackAnIncompleteCharacter) {
  EXPECT_EQ(serve::utf8_complete_prefix("ab"), 2u);
  EXPECT_EQ(serve::utf8_complete_prefix("a\xc3"), 1u);
  EXPECT_EQ(serve::utf8_complete_prefix("a\xc3\xa9"), 3u);
  EXPECT_EQ(serve::utf8_complete_prefix("a\xe2\x82"), 1u);
  EXPECT_EQ(serve::utf8_complete_prefix("a\xf0\x9f\x98\x80"), 5u);
}

// A client that closes the connection mid-stream frees its slot at once: the sequence would run
// for thousands of steps otherwise.
TEST(ServeHttp, AClientLeavingMidStreamFreesItsSlot) {
  data::Tokenizer tok;
  ModelConfig c = byte_config(tok);
  c.context = 4096;
  Model model(c, 4);
  serve::ServerOptions o;
  o.port = 0;
  o.slots = 1;
  serve::Server server(o);
  const int port = server.start();
  server.serve_model(model, nullptr, "long");  // no tokenizer, so no <EOT> to stop at
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string body = R"({"prompt": [5], "max_tokens": 4000, "stream": true})";
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(write(fd, req.data(), req.size()), ssize_t(req.size()));
  char buf[512];
  std::string got;
  while (got.find("data: ") == std::string::npos) {  // the stream has started
    const ssize_t n = read(fd, buf, sizeof buf);
    ASSERT_GT(n, 0);
    got.append(buf, size_t(n));
  }
  close(fd);
  httplib::Client cli("127.0.0.1", port);
  auto value = [&](const std::string& name) {
    const std::string m = cli.Get("/metrics")->body;
    const size_t p = m.find("\n" + name + " ");
    return std::stod(m.substr(p + name.size() + 2));
  };
  for (int i = 0; i < 500 && value("sigma_busy_slots") != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(value("sigma_busy_slots"), 0);
  EXPECT_LT(value("sigma_generated_tokens_total"), 4000);
  auto r = cli.Post("/v1/completions", R"({"prompt": [5], "max_tokens": 2})", "application/json");
  EXPECT_EQ(r->status, 200);  // the one slot serves again
}

// A fault inside the model ends the request with a 500 JSON error, and the server lives on.
TEST(ServeHttp, AModelFaultIsA500AndTheServerServesOn) {
  Fixture f;
  // The backend the model's tensors live on (the guard, in the guard suite), one op broken.
  const ops::Backend& before = ops::active_backend();
  ops::Backend broken = before;
  broken.flash_attention_forward = [](float*, float*, ops::AttnOperand, ops::AttnOperand,
                                      ops::AttnOperand, ops::AttnShape, float) {
    throw Error("injected attention fault");
  };
  ops::use_backend(broken);
  auto r = f.post("/v1/completions", R"({"prompt": "a", "max_tokens": 3})");
  ops::use_backend(before);
  const auto [status, msg] = error_of(r);
  EXPECT_EQ(status, 500);
  EXPECT_NE(msg.find("injected attention fault"), std::string::npos) << msg;
  r = f.post("/v1/completions", R"({"prompt": "a", "max_tokens": 3})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(f.cli.Get("/health")->status, 200);
}

// Domains and extracts as models: NAME and NAME:DOMAIN are listed and selectable; `domain` is a
// synonym; an unknown model is a 404 with OpenAI's model_not_found code.
TEST(ServeHttp, DomainsAreModels) {
  Fixture f;
  const json models = json::parse(f.cli.Get("/v1/models")->body);
  std::vector<std::string> ids;
  for (const json& m : models["data"]) ids.push_back(m["id"]);
  EXPECT_EQ(ids, (std::vector<std::string>{"tiny", "tiny:prose", "tiny:code"}));
  auto logprobs = [&](const json& body) {
    json b = body;
    b.update({{"prompt", "abcdef"}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}});
    auto r = f.post("/v1/completions", b.dump());
    return json::parse(r->body)["choices"][0]["logprobs"]["token_logprobs"];
  };
  const json by_model = logprobs({{"model", "tiny:code"}}), by_domain = logprobs({{"model", "tiny"}, {"domain", "code"}});
  EXPECT_EQ(by_model, by_domain);
  EXPECT_NE(by_model, logprobs({{"model", "tiny:prose"}}));
  EXPECT_EQ(logprobs({}), logprobs({{"model", "tiny:prose"}}));  // the first domain by default
  auto r = f.post("/v1/completions", R"({"model": "python", "prompt": "a"})");
  EXPECT_EQ(error_of(r).first, 404);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "model_not_found");
  EXPECT_NE(error_of(r).second.find("tiny, tiny:prose, tiny:code"), std::string::npos) << r->body;
  EXPECT_EQ(error_of(f.post("/v1/completions", R"({"model": "tiny:code", "domain": "prose", "prompt": "a"})")).first, 400);
}

// Every OpenAI field is honoured or refused by name; numbers out of range are 400s.
TEST(ServeHttp, OpenAIFieldsAreHonouredOrRefused) {
  Fixture f;
  struct Case { std::string body, param; };
  const std::vector<Case> refused = {
      {R"({"prompt": "a", "best_of": 2})", "best_of"},
      {R"({"prompt": "a", "suffix": "z"})", "suffix"},
      {R"({"prompt": "a", "frobnicate": true})", "frobnicate"},
      {R"({"prompt": "a", "temperature": 1e400})", ""},
      {R"({"prompt": "a", "temperature": 3})", "temperature"},
      {R"({"prompt": "a", "logit_bias": {"x": 1}})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"5": 101}})", "logit_bias"},
      {R"({"prompt": "a", "response_format": {"type": "json_schema"}})", "response_format"},
      {R"({"prompt": "a", "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": "a", "max_tokens": 3, "max_completion_tokens": 4})", "max_completion_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "echo": true})", "echo"},
  };
  for (const Case& c : refused) {
    const std::string path = c.body.find("messages") != std::string::npos ? "/v1/chat/completions" : "/v1/completions";
    auto r = f.post(path, c.body);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << c.body << ": " << r->body;
    const json e = json::parse(r->body);
    if (!c.param.empty()) {
      EXPECT_EQ(e["error"]["param"], c.param) << c.body;
    }
  }
  // best_of 1, tools [] and user are accepted (they change nothing).
  EXPECT_EQ(f.post("/v1/completions", R"({"prompt": "a", "max_tokens": 1, "best_of": 1, "user": "u"})")->status, 200);
  // max_completion_tokens, with <EOT> (id 0) banned so that the count is exact.
  auto r = f.post("/v1/completions", R"({"prompt": "a", "max_completion_tokens": 20, "logit_bias": {"0": -100}})");
  EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 20) << r->body;
  // logit_bias +100 on 'e' makes greedy decoding say only 'e'.
  const int e_id = int(f.tok.byte_id('e'));
  r = f.post("/v1/completions", json{{"prompt", "a"}, {"max_tokens", 6}, {"temperature", 0},
                                     {"logit_bias", {{std::to_string(e_id), 100}}}}.dump());
  EXPECT_EQ(json::parse(r->body)["choices"][0]["text"], "eeeeee") << r->body;
  // stop "" stops nothing.
  const std::string g = R"({"prompt": "the cat", "max_tokens": 10, "temperature": 0, "logit_bias": {"0": -100})";
  const std::string plain = json::parse(f.post("/v1/completions", g + "}")->body)["choices"][0]["text"];
  EXPECT_EQ(json::parse(f.post("/v1/completions", g + R"(, "stop": ""})")->body)["choices"][0]["text"], plain);
  // No seed: fresh entropy (two 24-token samples from a near-uniform model differ).
  const std::string free = R"({"prompt": "a", "max_tokens": 24, "temperature": 1, "logit_bias": {"0": -100}})";
  EXPECT_NE(json::parse(f.post("/v1/completions", free)->body)["choices"][0]["text"],
            json::parse(f.post("/v1/completions", free)->body)["choices"][0]["text"]);
  // Streams: logprobs per chunk and a usage chunk, equal to the plain response's.
  const std::string lp = R"({"prompt": "the", "max_tokens": 12, "temperature": 0, "logprobs": 3, "logit_bias": {"0": -100})";
  const json whole = json::parse(f.post("/v1/completions", lp + "}")->body);
  r = f.post("/v1/completions", lp + R"(, "stream": true, "stream_options": {"include_usage": true}})");
  json tokens = json::array(), values = json::array(), offsets = json::array(), usage;
  size_t pos = 0;
  while ((pos = r->body.find("data: {", pos)) != std::string::npos) {
    const size_t end = r->body.find("\n\n", pos);
    const json c = json::parse(r->body.substr(pos + 6, end - pos - 6));
    if (!c["usage"].is_null()) usage = c["usage"];
    for (const json& ch : c["choices"])
      for (size_t i = 0; i < ch["logprobs"]["tokens"].size(); ++i) {
        tokens.push_back(ch["logprobs"]["tokens"][i]);
        values.push_back(ch["logprobs"]["token_logprobs"][i]);
        offsets.push_back(ch["logprobs"]["text_offset"][i]);
      }
    pos = end;
  }
  EXPECT_EQ(tokens, whole["choices"][0]["logprobs"]["tokens"]);
  EXPECT_EQ(values, whole["choices"][0]["logprobs"]["token_logprobs"]);
  EXPECT_EQ(offsets, whole["choices"][0]["logprobs"]["text_offset"]);
  EXPECT_EQ(usage, whole["usage"]);
  // Chat streams carry logprobs too.
  r = f.post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                         "temperature": 0, "logprobs": true, "top_logprobs": 1, "stream": true})");
  EXPECT_NE(r->body.find("\"logprobs\":{\"content\":[{"), std::string::npos) << r->body;
}

// text_offset counts characters, and a token inside a character (byte fallback) is labelled by
// its bytes, so top_logprobs never merges two such tokens under U+FFFD.
TEST(ServeHttp, TextOffsetsAreCharactersAndPartialTokensKeepTheirBytes) {
  Fixture f;
  auto r = f.post("/v1/completions", R"({"prompt": "aéb€c", "max_tokens": 0, "echo": true, "logprobs": 0})");
  const json lp = json::parse(r->body)["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json({"a", "bytes:\\xc3", "bytes:\\xa9", "b", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac", "c"}));
  EXPECT_EQ(lp["text_offset"], json({0, 1, 1, 2, 3, 3, 3, 4}));
  r = f.post("/v1/completions", R"({"prompt": "a", "max_tokens": 2, "logprobs": 20})");
  for (const json& top : json::parse(r->body)["choices"][0]["logprobs"]["top_logprobs"])
    EXPECT_EQ(top.size(), 20u) << top.dump();
}

// response_format json_object: the text is always a prefix of a JSON object and, once finished
// with "stop", parses as one.
TEST(ServeHttp, JsonObjectDecodingKeepsTheTextJson) {
  Fixture f;
  const int open_id = int(f.tok.byte_id('{')), close_id = int(f.tok.byte_id('}'));
  auto r = f.post("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"max_tokens", 20},
                                               {"temperature", 0}, {"response_format", {{"type", "json_object"}}},
                                               {"logit_bias", {{std::to_string(open_id), 30}, {std::to_string(close_id), 30}}}}.dump());
  json j = json::parse(r->body);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << r->body;
  EXPECT_TRUE(json::parse(j["choices"][0]["message"]["content"].get<std::string>()).is_object()) << r->body;
  r = f.post("/v1/completions", R"({"prompt": "x", "max_tokens": 30, "temperature": 1, "seed": 3, "n": 4,
                                    "response_format": {"type": "json_object"}})");
  j = json::parse(r->body);
  for (const json& c : j["choices"]) {
    serve::JsonPrefix p;
    EXPECT_TRUE(p.push(c["text"].get<std::string>())) << c["text"];
    if (c["finish_reason"] == "stop") {
      EXPECT_TRUE(json::parse(c["text"].get<std::string>()).is_object());
    }
  }
}

TEST(ServeHttp, JsonPrefixAcceptsExactlyJsonObjects) {
  const std::vector<std::string> valid = {
      "{}", " {\"a\": 1}", "{\"a\":[1,2.5e-3,-0,true,false,null,{\"b\":\"\\u00e9\\n\"}]}\n", "{\"\xc3\xa9\": \"\xe2\x82\xac\"}"};
  for (const std::string& s : valid) {
    ASSERT_TRUE(json::parse(s).is_object());
    serve::JsonPrefix p;
    for (size_t i = 0; i < s.size(); ++i) {
      ASSERT_TRUE(p.push(s.substr(i, 1))) << s << " at " << i;
      const bool closed = s.find_first_not_of(" \n", i + 1) == std::string::npos;
      EXPECT_EQ(p.complete(), closed) << s << " at " << i;
    }
  }
  // Each is a valid prefix up to its last byte, which no JSON object allows there.
  const std::vector<std::string> invalid = {
      "[", "{\"a\":01", "{\"a\":1,}", "{,", "{\"a\" 1", "{\"a\":tru}", "{\"\x01", "{\"a\":\"\xff",
      "{\"a\":1}}", "{\"a\":-}", "{\"a\":1.}", "{\"a\":1e}", "{\"a\":\"\\u12G", "{\"a\":\"\\x", "{1", "{\"a\":]"};
  for (const std::string& s : invalid) {
    serve::JsonPrefix p;
    EXPECT_TRUE(p.push(s.substr(0, s.size() - 1))) << s;
    EXPECT_FALSE(p.push(s.substr(s.size() - 1))) << s;
  }
  serve::JsonPrefix deep;
  EXPECT_FALSE(deep.push("{\"a\":" + std::string(40, '[')));  // nesting is bounded
}

// Whitespace outside strings comes at most kMaxSpaceRun bytes in a row: unbounded, a small model
// spent most of a json_object request's tokens on blanks.
TEST(ServeHttp, JsonPrefixBoundsWhitespaceRuns) {
  const std::string run(serve::JsonPrefix::kMaxSpaceRun, ' ');
  for (const std::string& before : {std::string(), std::string("{"), std::string("{\"a\""), std::string("{\"a\":"),
                                    std::string("{\"a\":1"), std::string("{\"a\":[true")}) {
    serve::JsonPrefix p;
    ASSERT_TRUE(p.push(before + run)) << before;
    EXPECT_FALSE(p.push(" ")) << before;
    EXPECT_FALSE(p.push("\n")) << before;
  }
  serve::JsonPrefix p;  // runs reset at each token; blanks inside strings are text
  EXPECT_TRUE(p.push("{" + run + "\"a\"" + run + ":" + run + "\"" + std::string(100, ' ') + "\"" + run + "}"));
  EXPECT_TRUE(p.complete());
  serve::JsonPrefix pretty;  // indentation four levels deep, two spaces a level
  EXPECT_TRUE(pretty.push(json{{"a", {{"b", {{"c", {{"d", 1}}}}}}}}.dump(2)));
  EXPECT_TRUE(pretty.complete());
  // Through decoding: a space favoured by logit_bias still gets at most a run's worth.
  Fixture f;
  const json body = {{"prompt", "x"}, {"max_tokens", 30}, {"temperature", 0},
                     {"response_format", {{"type", "json_object"}}},
                     {"logit_bias", {{std::to_string(f.tok.byte_id(' ')), 40}}}};
  const json j = json::parse(f.post("/v1/completions", body.dump())->body);
  const std::string text = j["choices"][0]["text"];
  EXPECT_EQ(text.find(run + " "), std::string::npos) << text;
}

// What the SDKs and LangChain send: content as an array of text parts, and the `developer` role
// (OpenAI's newer name for system). Both got 400.
TEST(ServeHttp, ChatTakesTextPartsAndTheDeveloperRole) {
  Fixture f;
  auto chat = [&](const json& messages) {
    return f.post("/v1/chat/completions",
                  json{{"messages", messages}, {"max_tokens", 5}, {"temperature", 0}}.dump());
  };
  const json plain = json::parse(chat({{{"role", "system"}, {"content", "be"}},
                                       {{"role", "user"}, {"content", "hel\nlo"}}})->body);
  auto r = chat({{{"role", "developer"}, {"content", "be"}},
                 {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "hel"}}, {{"type", "text"}, {"text", "lo"}}}}}});
  ASSERT_EQ(r->status, 200) << r->body;
  const json parts = json::parse(r->body);
  EXPECT_EQ(parts["choices"][0]["message"], plain["choices"][0]["message"]);
  EXPECT_EQ(parts["usage"], plain["usage"]);
  const std::vector<std::pair<json, std::string>> refused = {
      {{{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "image_url"}, {"image_url", "x"}}}}}},
       "messages[0].content[1] is of type 'image_url'"},
      {{{{"role", "user"}, {"content", {{{"type", "text"}}}}}}, "messages[0].content[0] must have a string 'text'"},
      {{{{"role", "user"}, {"content", 3}}}, "messages[0]'s 'content' must be a string or an array"},
      {{{{"role", "tool"}, {"content", "x"}}}, "role 'tool'"},
  };
  for (const auto& [messages, says] : refused) {
    const auto [status, msg] = error_of(chat(messages));
    EXPECT_EQ(status, 400) << messages.dump();
    EXPECT_NE(msg.find(says), std::string::npos) << msg;
  }
}
