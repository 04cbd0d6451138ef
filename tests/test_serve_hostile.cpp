// Hostile requests to `sigma serve` that once crashed it or could never succeed, answered
// through Server::answer (the routes without a socket; tests/fuzz/fuzz_serve_request.cpp fuzzes
// the same path): each gets its HTTP status and the API's JSON error.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "serve/api.h"
#include "serve/server.h"
#include "serve_test_util.h"

using namespace sigma;
using nlohmann::json;

namespace {

using sigma::testing::tiny_serve_config;

// Status and error message of the response to a POST of `body` to `path`.
std::pair<int, std::string> post(serve::Server& s, const std::string& path, const std::string& body) {
  const std::string out = s.answer("POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                                   std::to_string(body.size()) + "\r\n\r\n" + body);
  if (out.rfind("HTTP/1.1 ", 0) != 0) return {-1, "no response"};
  const size_t head_end = out.find("\r\n\r\n");
  const json j = json::parse(out.substr(head_end + 4), nullptr, false);
  const int status = std::atoi(out.c_str() + 9);
  if (j.is_discarded() || !j.contains("error")) return {status, "NOT A JSON ERROR"};
  return {status, j["error"]["message"].get<std::string>()};
}

struct Served {
  data::Tokenizer tok;
  Model model{tiny_serve_config(tok), 1};
  serve::Server server;
  explicit Served(serve::ServerOptions o) : server(o) { server.serve_model(model, &tok, "tiny"); }
};

}  // namespace

// 200,000 nested arrays fit the default 1 MiB body; copying or printing them recursed once per
// level and overflowed the stack (a segfault of the whole server).
TEST(ServeHostile, DeeplyNestedJsonIsRefusedNotACrash) {
  const std::string nest = std::string(200000, '[') + std::string(200000, ']');
  EXPECT_THROW(serve::parse_body("{\"prompt\": " + nest + "}"), serve::ApiError);
  Served s({});
  for (const auto& [path, body] : {std::pair<std::string, std::string>{"/v1/completions", "{\"prompt\": " + nest + "}"},
                                   {"/detokenize", "{\"tokens\": [" + nest + "]}"},
                                   {"/tokenize", "{\"text\": " + nest + "}"}}) {
    const auto [status, msg] = post(s.server, path, body);
    EXPECT_EQ(status, 400) << path << ": " << msg;
    EXPECT_NE(msg.find("nested deeper than 64 levels"), std::string::npos) << path << ": " << msg;
  }
  // Nesting that requests use still parses.
  EXPECT_EQ(post(s.server, "/v1/completions", R"({"prompt": [[1, 2]], "max_tokens": 1})").first, 400);
  EXPECT_EQ(post(s.server, "/v1/completions", R"({"prompt": [1, 2], "max_tokens": 1})").first, 200);
}

// A request's choices all queue before any takes a slot: n above --queue got 503 "busy; retry"
// from an idle server, whatever the retries. It is a 400 naming the limit; n = queue is served.
TEST(ServeHostile, MoreChoicesThanTheQueueHoldsAreA400NotBusy) {
  serve::ServerOptions o;
  o.slots = 2;
  o.queue = 2;
  Served s(o);
  const auto [status, msg] = post(s.server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1, "n": 3})");
  EXPECT_EQ(status, 400) << msg;
  EXPECT_NE(msg.find("'n' = 3 is out of range [1, 2]"), std::string::npos) << msg;
  EXPECT_EQ(post(s.server, "/v1/completions", R"({"prompt": "a", "max_tokens": 1, "n": 2})").first, 200);
}
