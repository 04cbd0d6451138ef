// `sigma serve`'s request handling: one HTTP request through Server::answer (the server's own
// request reader, src/serve/http_request.cpp; the framing-* seeds are RFC 9112 cases; Sigma's routes, the API key check, body parsing, the engine with a tiny byte-level model, and
// the JSON or event-stream response), without a socket. Every request must get a response: a
// 2xx with a body of its content type (JSON parses; an event stream is JSON events then
// [DONE]), or a 4xx/5xx whose body is the API's JSON error carrying the same status.
//
// Input: a raw HTTP request. Unless it starts with "RAW\n" (then it goes as is), the fuzzer
// sets Content-Length to the length of what follows the blank line, so that mutations of a
// JSON body reach the JSON parser instead of failing the length check.
#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "data/tokenizer.h"
#include "fuzz.h"
#include "model/model.h"
#include "serve/server.h"

namespace {

using nlohmann::json;

struct Served {
  sigma::data::Tokenizer tok;  // bytes, no merges
  sigma::Model model;
  sigma::serve::Server server;
  static sigma::ModelConfig config(const sigma::data::Tokenizer& tok) {
    sigma::ModelConfig c;
    c.vocab = int(tok.vocab_size());
    c.d_model = 8;
    c.heads = 2;
    c.context = 64;
    c.layers = 1;
    c.slots = 2;
    c.domains = {{"prose", "prose", 0}, {"code", "code", 1}};
    c.validate();
    return c;
  }
  static sigma::serve::ServerOptions options() {
    sigma::serve::ServerOptions o;
    o.api_key = "k";
    o.slots = 2;
    o.queue = 2;        // n up to 2
    o.max_tokens = 6;   // keeps each input's decoding short
    o.max_body = 4096;  // a larger body must get 413
    return o;
  }
  Served() : model(config(tok), 1), server(options()) { server.serve_model(model, &tok, "tiny"); }
};

sigma::serve::Server& server() {
  static Served* s = new Served;  // lives to the end of the process (its engine thread too)
  return s->server;
}

std::string with_content_length(const std::string& in) {
  const size_t end = in.find("\r\n\r\n");
  if (end == std::string::npos) return in;
  std::string head = in.substr(0, end), out;
  std::istringstream lines(head);
  for (std::string line; std::getline(lines, line, '\n');) {
    std::string lower = line;
    for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
    if (lower.rfind("content-length:", 0) == 0) continue;
    out += line + "\n";
  }
  if (!out.empty()) out.pop_back();
  return out + "\r\nContent-Length: " + std::to_string(in.size() - end - 4) + in.substr(end);
}

struct Reply {
  int status = 0;
  std::string head, body;
};

// The final response of what the server wrote (after any "100 Continue"); chunked bodies joined.
Reply parse_reply(std::string out) {
  Reply r;
  for (;;) {
    const size_t end = out.find("\r\n\r\n");
    if (out.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos || end < 12)
      sigma::fuzz::finding("the response does not start with a status line and headers");
    r.status = std::atoi(out.c_str() + 9);
    r.head = out.substr(0, end + 2);
    r.body = out.substr(end + 4);
    if (r.status != 100) break;
    out = r.body;
  }
  if (r.head.find("Transfer-Encoding: chunked\r\n") == std::string::npos) return r;
  std::string joined;
  for (size_t at = 0;;) {
    const size_t line = r.body.find("\r\n", at);
    if (line == std::string::npos) sigma::fuzz::finding("a chunked body ends without its last chunk");
    const size_t n = std::strtoul(r.body.c_str() + at, nullptr, 16);
    if (n == 0) break;
    joined += r.body.substr(line + 2, n);
    at = line + 2 + n + 2;
  }
  r.body = joined;
  return r;
}

bool has_type(const Reply& r, const char* type) {
  return r.head.find(std::string("Content-Type: ") + type) != std::string::npos;
}

void check_event_stream(const std::string& body) {
  std::istringstream events(body);
  bool done = false;
  for (std::string line; std::getline(events, line);) {
    if (line.empty()) continue;
    if (done || line.rfind("data: ", 0) != 0) sigma::fuzz::finding("an event stream line is not 'data: ' or follows [DONE]");
    if (line == "data: [DONE]") {
      done = true;
    } else if (json::parse(line.substr(6), nullptr, false).is_discarded()) {
      sigma::fuzz::finding("an event of the stream is not JSON");
    }
  }
  if (!done) sigma::fuzz::finding("an event stream without [DONE]");
}

void check(const std::string& request, const Reply& r) {
  // Requests come one at a time, so the engine is idle at each: "busy" would refuse a request
  // that no retry can get through.
  if (r.status == 503) sigma::fuzz::finding("503 busy from an idle server");
  // HEAD is answered with the headers of a body but without it (httplib also reads "\tHEAD" as
  // HEAD), OPTIONS without a body. A Range header gets slices of the body (httplib honours it on
  // any status, errors too): what the client asked for, not a whole JSON body.
  const bool headers_only = r.body.empty() && r.head.find("Content-Length: 0\r\n") == std::string::npos &&
                            r.head.find("Transfer-Encoding: chunked") == std::string::npos;
  if (headers_only || request.substr(0, request.find('\n')).find("OPTIONS") != std::string::npos || r.status == 206 ||
      r.head.find("Content-Range: ") != std::string::npos || has_type(r, "multipart/byteranges"))
    return;
  if (r.status >= 400) {
    const json j = json::parse(r.body, nullptr, false);
    if (j.is_discarded() || !j.contains("error") || !j["error"].is_object() ||
        !j["error"].value("message", json()).is_string() ||
        // The code is the status, or OpenAI's string code (404 "model_not_found").
        (j["error"].value("code", json()) != r.status &&
         !(r.status == 404 && j["error"].value("code", json()) == "model_not_found")))
      sigma::fuzz::finding("a refusal without the API's JSON error carrying its status");
  } else if (r.status < 200 || r.status > 299) {
    sigma::fuzz::finding("a status that is neither success nor an error");
  } else if (has_type(r, "application/json")) {
    if (json::parse(r.body, nullptr, false).is_discarded()) sigma::fuzz::finding("a JSON response that does not parse");
  } else if (has_type(r, "text/event-stream")) {
    check_event_stream(r.body);
  } else if (!has_type(r, "text/plain")) {  // /metrics
    sigma::fuzz::finding("a success of an unexpected content type");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string in(reinterpret_cast<const char*>(data), size);
  in = in.rfind("RAW\n", 0) == 0 ? in.substr(4) : with_content_length(in);
  const std::string out = server().answer(in);
  if (std::getenv("SIGMA_FUZZ_SHOW")) std::fwrite(out.data(), 1, out.size(), stderr);  // debugging
  if (out.empty()) {  // httplib answers nothing only to a connection that sent nothing
    if (!in.empty()) sigma::fuzz::finding("no response to a request");
    return 0;
  }
  check(in, parse_reply(out));
  return 0;
}
