// Request framing against RFC 9110 / 9112 (issue 37 item 15): each MUST the server's request
// reader (src/serve/http_request.cpp) keeps, as a request and the status it must get through
// sigma serve's routes (Server::answer, no socket); the same requests fed a byte at a time and
// in random pieces must read the same; and a deterministic fuzz of the reader over mutations of
// these cases (never a crash, every failure a 4xx/5xx, the same result however split).
// docs/serving.md, "Request framing", lists the rules.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "model/model.h"
#include "serve/http.h"
#include "serve/server.h"
#include "serve_test_util.h"

using namespace sigma;
using namespace std::string_literals;

namespace {

using sigma::testing::tiny_serve_config;

struct Served {
  data::Tokenizer tok;
  Model model{tiny_serve_config(tok), 1};
  serve::Server server;
  explicit Served(serve::ServerOptions o) : server(o) { server.serve_model(model, &tok, "tiny"); }
};

serve::ServerOptions options() {
  serve::ServerOptions o;
  o.api_key = "k";
  o.max_body = 4096;
  o.max_tokens = 4;
  return o;
}

struct Reply {
  int status = -1;
  std::string head, body;
};

Reply reply_of(const std::string& out) {
  Reply r;
  const size_t end = out.find("\r\n\r\n");
  if (out.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::atoi(out.c_str() + 9);
  r.head = out.substr(0, end + 2);
  r.body = out.substr(end + 4);
  return r;
}

struct Case {
  const char* rule;
  std::string request;
  int status;
};

const std::string kGet = "GET /health HTTP/1.1\r\nHost: x\r\n";
const std::string kPost = "POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n";

// Accepted framings answer 200 (or the route's own status); refused ones the status named.
std::vector<Case> cases() {
  return {
      {"origin form", kGet + "\r\n", 200},
      {"absolute form is accepted (RFC 9112 3.2.2 MUST)", "GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n", 200},
      {"absolute form, port and query, scheme in capitals", "GET HTTP://x:8000/health?a=1 HTTP/1.1\r\nHost: y\r\n\r\n", 200},
      {"absolute form without a host", "GET http:///health HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {"an empty line before the request line is ignored (9112 2.2)", "\r\n" + kGet + "\r\n", 200},
      {"HTTP/1.0 needs no Host", "GET /health HTTP/1.0\r\n\r\n", 200},
      {"a later 1.x minor is read as 1.1 (9110 2.5)", "GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 200},
      {"optional whitespace around a value", "GET /health HTTP/1.1\r\nHost: \t x \t\r\n\r\n", 200},
      {"obs-text in a value", kGet + "X-A: caf\xc3\xa9\r\n\r\n", 200},
      {"HEAD on a GET route (9110 9.1 MUST)", "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", 200},
      {"asterisk form is framed (and has no route)", "OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 404},
      {"methods are case-sensitive", "get /health HTTP/1.1\r\nHost: x\r\n\r\n", 405},
      // Line endings (9112 2.2): CRLF only; a bare LF or CR is refused, not waited on.
      {"bare LF line ends", "GET /health HTTP/1.1\nHost: x\n\n", 400},
      {"bare LF ending the head", kGet + "\n", 400},
      {"bare CR in a value", kGet + "X-A: a\rb\r\n\r\n", 400},
      // Tokens and values (9110 5.1, 5.5, 9.1).
      {"NUL in the method", "G\0T /health HTTP/1.1\r\nHost: x\r\n\r\n"s, 400},
      {"NUL in a header name", kGet + "X-\0A: 1\r\n\r\n"s, 400},
      {"NUL in a header value (5.5 MUST)", kGet + "X-A: a\0b\r\n\r\n"s, 400},
      {"DEL in a header value", kGet + "X-A: a\x7f" "b\r\n\r\n", 400},
      {"a control byte in a value", kGet + "X-A: a\x01" "b\r\n\r\n", 400},
      {"whitespace before the colon (9112 5.1 MUST)", "GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400},
      {"obsolete line folding (9112 5.2)", kGet + "X-A: 1\r\n 2\r\n\r\n", 400},
      {"whitespace before the first header (9112 2.2)", "GET /health HTTP/1.1\r\n Host: x\r\n\r\n", 400},
      {"an empty header name", kGet + ": x\r\n\r\n", 400},
      // The request line (9112 3).
      {"two spaces", "GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {"a trailing space", "GET /health HTTP/1.1 \r\nHost: x\r\n\r\n", 400},
      {"no version", "GET /health\r\nHost: x\r\n\r\n", 400},
      {"a malformed version", "GET /health HTXP/1.1\r\nHost: x\r\n\r\n", 400},
      {"a two-digit minor", "GET /health HTTP/1.10\r\nHost: x\r\n\r\n", 400},
      {"another major version", "GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505},
      {"a control byte in the target", "GET /hea\x01lth HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {"a fragment in the target", "GET /health#x HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {"a non-ASCII target", "GET /h\xc3\xa9 HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      {"a target that is neither path nor URL", "GET health HTTP/1.1\r\nHost: x\r\n\r\n", 400},
      // Host (9112 3.2 MUST).
      {"HTTP/1.1 without Host", "GET /health HTTP/1.1\r\n\r\n", 400},
      {"two Host headers", kGet + "Host: y\r\n\r\n", 400},
      {"two Host headers in HTTP/1.0", "GET /health HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n", 400},
      {"an invalid Host", "GET /health HTTP/1.1\r\nHost: a b\r\n\r\n", 400},
      {"an IPv6 Host with a port", "GET /health HTTP/1.1\r\nHost: [::1]:8000\r\n\r\n", 200},
      // Body framing (9112 6).
      {"Content-Length", kPost + "Content-Length: 12\r\n\r\n{\"text\":\"a\"}", 200},
      {"chunked", kPost + "Transfer-Encoding: chunked\r\n\r\nc\r\n{\"text\":\"a\"}\r\n0\r\n\r\n", 200},
      {"chunked in capitals, an extension and a trailer",
       kPost + "Transfer-Encoding: Chunked\r\n\r\nc;x=1\r\n{\"text\":\"a\"}\r\n0\r\nX-T: 1\r\n\r\n", 200},
      {"both Content-Length and Transfer-Encoding", kPost + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {"two Content-Lengths", kPost + "Content-Length: 12\r\nContent-Length: 12\r\n\r\n{\"text\":\"a\"}", 400},
      {"a Content-Length list", kPost + "Content-Length: 12, 12\r\n\r\n{\"text\":\"a\"}", 400},
      {"a signed Content-Length", kPost + "Content-Length: +12\r\n\r\n{\"text\":\"a\"}", 400},
      {"chunked not last (6.3 MUST)", kPost + "Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n", 400},
      {"chunked twice", kPost + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {"a coding before chunked", kPost + "Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501},
      {"identity is no coding", kPost + "Transfer-Encoding: identity\r\n\r\n", 400},
      {"Transfer-Encoding in HTTP/1.0 (6.1 MUST)",
       "POST /tokenize HTTP/1.0\r\nAuthorization: Bearer k\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {"a chunk size with leading whitespace", kPost + "Transfer-Encoding: chunked\r\n\r\n c\r\n{\"text\":\"a\"}\r\n0\r\n\r\n", 400},
      {"a chunk size with trailing junk", kPost + "Transfer-Encoding: chunked\r\n\r\nc x\r\n{\"text\":\"a\"}\r\n0\r\n\r\n", 400},
      {"a bare LF after a chunk size", kPost + "Transfer-Encoding: chunked\r\n\r\nc\n{\"text\":\"a\"}\r\n0\r\n\r\n", 400},
      {"chunk data longer than its size", kPost + "Transfer-Encoding: chunked\r\n\r\n2\r\n{\"text\":\"a\"}\r\n0\r\n\r\n", 400},
      {"a NUL in a chunk extension", kPost + "Transfer-Encoding: chunked\r\n\r\nc;a\0\r\n{\"text\":\"a\"}\r\n0\r\n\r\n"s, 400},
      {"a malformed trailer", kPost + "Transfer-Encoding: chunked\r\n\r\nc\r\n{\"text\":\"a\"}\r\n0\r\nno colon\r\n\r\n", 400},
      // Expectations (9110 10.1.1) and the order of refusals.
      {"an unknown expectation", kGet + "Expect: fast\r\n\r\n", 417},
      {"an HTTP/1.0 expectation is ignored", "GET /health HTTP/1.0\r\nExpect: fast\r\n\r\n", 200},
      {"a body over the limit without the key is 401, not 413",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n", 401},
      {"a body over the limit with the key", kPost + "Content-Length: 50000000\r\n\r\n", 413},
      {"a head over 16 KiB", kGet + "X-A: " + std::string(17 << 10, 'a') + "\r\n\r\n", 431},
  };
}

}  // namespace

TEST(ServeFraming, EveryRuleGetsItsStatus) {
  Served s(options());
  for (const Case& c : cases()) {
    const Reply r = reply_of(s.server.answer(c.request));
    EXPECT_EQ(r.status, c.status) << c.rule << "\n" << r.head << r.body;
    if (r.status >= 400) {
      EXPECT_NE(r.body.find("\"error\""), std::string::npos) << c.rule;
    }
  }
}

// RFC 9110 9.3.2 and 15.5.6: HEAD gets a GET's head without its body; a 405 says Allow.
TEST(ServeFraming, HeadHasNoBodyAndA405SaysAllow) {
  Served s(options());
  const Reply get = reply_of(s.server.answer(kGet + "\r\n"));
  const Reply head = reply_of(s.server.answer("HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  ASSERT_EQ(head.status, 200) << head.head;
  EXPECT_EQ(head.body, "");
  EXPECT_NE(head.head.find(fmt::format("Content-Length: {}\r\n", get.body.size())), std::string::npos) << head.head;
  struct Want { std::string request, allow; };
  for (const Want& w : {Want{"HEAD /tokenize HTTP/1.1\r\nHost: x\r\n\r\n", "POST"},
                        Want{"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", "POST"},
                        Want{"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", "GET, HEAD"}}) {
    const Reply r = reply_of(s.server.answer(w.request));
    EXPECT_EQ(r.status, 405) << w.request;
    EXPECT_NE(r.head.find("\r\nAllow: " + w.allow + "\r\n"), std::string::npos) << w.request << r.head;
    if (w.request.rfind("HEAD", 0) == 0) {
      EXPECT_EQ(r.body, "") << w.request;
    }
  }
}

namespace {

// The reader's verdict on `bytes` fed in the given piece sizes (0 = all at once).
struct Verdict {
  serve::http::RequestReader::State state;
  int status;
  std::string method, path, body;
  bool operator==(const Verdict&) const = default;
};

Verdict read_request(const serve::http::Limits& lim, const std::string& bytes, std::mt19937* split) {
  using S = serve::http::RequestReader::State;
  serve::http::RequestReader r(lim);
  size_t at = 0;
  while (at < bytes.size() && r.state() != S::Failed && r.state() != S::Done) {
    if (r.state() == S::HeadDone) {
      r.accept_head();
      continue;
    }
    size_t piece = bytes.size() - at;
    if (split) piece = std::min(piece, size_t(1 + (*split)() % 7));
    const size_t used = r.feed(bytes.data() + at, piece);
    EXPECT_LE(used, piece);
    at += used;
    if (used == 0 && r.state() != S::HeadDone) break;
  }
  if (r.state() == S::HeadDone) r.accept_head();
  if (r.state() == S::Failed) {
    EXPECT_GE(r.error_status(), 400);
    EXPECT_LT(r.error_status(), 600);
    EXPECT_FALSE(r.error_message().empty());
  }
  return {r.state(), r.error_status(), r.request().method, r.request().path, r.request().body};
}

}  // namespace

// The reader keeps its state across reads: a request split anywhere reads as it does whole.
TEST(ServeFraming, ARequestSplitAnywhereReadsTheSame) {
  serve::http::Limits lim;
  lim.max_body = 4096;
  std::mt19937 rng(7);
  for (const Case& c : cases()) {
    const Verdict whole = read_request(lim, c.request, nullptr);
    for (int t = 0; t < 4; ++t) EXPECT_TRUE(read_request(lim, c.request, &rng) == whole) << c.rule;
  }
}

// A deterministic fuzz of the framing, seeded with the cases above: byte flips, CR/LF/NUL/space
// insertions and cuts. Every input ends Done, in a 4xx/5xx, or waiting for more; never a crash
// or a body past the limit; and split reading agrees with whole reading.
TEST(ServeFraming, MutatedRequestsAreReadTheSameHoweverSplit) {
  serve::http::Limits lim;
  lim.max_body = 4096;
  lim.max_head = 2048;
  const std::vector<Case> seeds = cases();
  std::mt19937 rng(37);
  const char special[] = {'\r', '\n', '\0', ' ', '\t', ':', ';', ',', '0', 'f', '\x7f', '\xff'};
  for (int i = 0; i < 20000; ++i) {
    std::string b = seeds[rng() % seeds.size()].request;
    for (int e = 1 + int(rng() % 3); e > 0 && !b.empty(); --e) {
      const size_t at = rng() % b.size();
      switch (rng() % 4) {
        case 0: b[at] = special[rng() % sizeof special]; break;
        case 1: b.insert(at, 1, special[rng() % sizeof special]); break;
        case 2: b.erase(at, 1 + rng() % 4); break;
        default: b[at] = char(b[at] ^ (1 << (rng() % 8))); break;
      }
    }
    const Verdict whole = read_request(lim, b, nullptr);
    ASSERT_LE(whole.body.size(), lim.max_body);
    ASSERT_TRUE(read_request(lim, b, &rng) == whole) << ::testing::PrintToString(b);
  }
}
