// The request reader of serve/http.h: RFC 9112 framing, strict where the RFCs say MUST (docs/
// serving.md, "Request framing", lists each rule and tests/test_serve_framing.cpp checks it),
// so that no request is read one way here and another way by a proxy in front.
#include <fmt/format.h>

#include <algorithm>

#include "serve/http.h"

namespace sigma::serve::http {

std::string Request::header(std::string_view lower_name) const {
  for (const auto& [k, v] : headers)
    if (k == lower_name) return v;
  return "";
}

std::string reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
  }
}

std::string response_head(int status, const std::string& content_type, const Headers& headers, bool keep_alive) {
  std::string h = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\n", status, reason_phrase(status), content_type);
  for (const auto& [k, v] : headers) h += k + ": " + v + "\r\n";
  h += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  return h;
}

std::string serialize(const Response& r, bool keep_alive, bool head_only) {
  std::string out = response_head(r.status, r.content_type, r.headers, keep_alive) +
                    fmt::format("Content-Length: {}\r\n\r\n", r.body.size());
  return head_only ? out : out + r.body;  // a HEAD answer says the length of the body it omits
}

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {  // OWS: spaces and tabs
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool digit(char c) { return c >= '0' && c <= '9'; }
bool alnum(char c) { return digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
// RFC 9110 5.6.2 tchar. A string_view, not strchr: strchr would find the terminator for NUL.
bool token_char(char c) { return alnum(c) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos; }
bool token(std::string_view s) { return !s.empty() && std::all_of(s.begin(), s.end(), token_char); }
// RFC 9110 5.5 field-vchar, SP and HTAB: no CR, LF, NUL or other control byte.
bool field_value(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == '\t' || (uint8_t(c) >= 0x20 && c != 0x7F); });
}
bool target_char(char c) { return uint8_t(c) > 0x20 && uint8_t(c) < 0x7F && c != '#'; }
// RFC 3986 host [":" port]: reg-name, IPv4 or an IP-literal in brackets.
bool host_value(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return alnum(c) || std::string_view("-._~!$&'()*+,;=:[]%").find(c) != std::string_view::npos;
  });
}

// The elements of a comma-separated list header, trimmed and lower-cased; empty ones dropped.
std::vector<std::string> list_of(std::string_view v) {
  std::vector<std::string> out;
  while (!v.empty()) {
    const size_t comma = std::min(v.find(','), v.size());
    const std::string_view e = trim(v.substr(0, comma));
    if (!e.empty()) out.push_back(lower(e));
    v.remove_prefix(std::min(comma + 1, v.size()));
  }
  return out;
}

}  // namespace

void RequestReader::reset() { *this = RequestReader(*limits_); }

size_t RequestReader::fail(int status, std::string message) {
  state_ = State::Failed;
  error_status_ = status;
  error_ = std::move(message);
  keep_alive_ = false;
  return 0;
}

// Appends one byte of a CRLF-terminated line to buf_; false (Failed) for a bare CR or LF, which
// RFC 9112 2.2 lets a recipient reject and a lenient proxy might read as a line end.
bool RequestReader::line_byte(char c, const char* where) {
  const bool after_cr = !buf_.empty() && buf_.back() == '\r';
  if (c == '\n' && !after_cr) return fail(400, fmt::format("a bare LF in {} (lines end with CRLF)", where)), false;
  if (after_cr && c != '\n') return fail(400, fmt::format("a bare CR in {}", where)), false;
  buf_.push_back(c);
  return true;
}

size_t RequestReader::feed(const char* p, size_t n) {
  if (state_ == State::Body) return chunked_ ? feed_chunked(p, n) : feed_length(p, n);
  if (state_ != State::Head) return 0;
  for (size_t i = 0; i < n; ++i) {
    if (!line_byte(p[i], "the request head")) return i + 1;
    if (buf_.size() > limits_->max_head)
      return fail(431, fmt::format("the request head is larger than {} bytes", limits_->max_head)), i + 1;
    if (p[i] != '\n') continue;
    if (buf_.size() == 2) {  // an empty line before the request line: ignored (RFC 9112 2.2)
      buf_.clear();
      continue;
    }
    if (buf_.size() < 4 || buf_.compare(buf_.size() - 4, 4, "\r\n\r\n") != 0) continue;
    buf_.resize(buf_.size() - 2);  // keep the last header's CRLF
    if (!parse_head()) return i + 1;
    buf_.clear();
    state_ = State::HeadDone;
    return i + 1;
  }
  return n;
}

size_t RequestReader::feed_length(const char* p, size_t n) {
  const size_t take = std::min(n, want_);
  req_.body.append(p, take);
  want_ -= take;
  if (want_ == 0) state_ = State::Done;
  return take;
}

// The request line: METHOD SP TARGET SP HTTP/d.d, one space each (RFC 9112 3).
bool RequestReader::parse_request_line(std::string_view line) {
  const size_t a = line.find(' '), b = a == std::string_view::npos ? a : line.find(' ', a + 1);
  if (b == std::string_view::npos || line.find(' ', b + 1) != std::string_view::npos)
    return fail(400, "malformed request line (METHOD SP TARGET SP VERSION)"), false;
  req_.method = line.substr(0, a);
  req_.target = line.substr(a + 1, b - a - 1);
  req_.version = line.substr(b + 1);
  if (!token(req_.method)) return fail(400, "malformed method (not a token)"), false;
  if (req_.target.empty() || !std::all_of(req_.target.begin(), req_.target.end(), target_char))
    return fail(400, "malformed request target (a control byte, space, '#' or non-ASCII byte)"), false;
  const std::string& v = req_.version;
  if (v.size() != 8 || v.compare(0, 5, "HTTP/") != 0 || !digit(v[5]) || v[6] != '.' || !digit(v[7]))
    return fail(400, fmt::format("malformed HTTP version '{}'", v.substr(0, 16))), false;
  if (v[5] != '1') return fail(505, fmt::format("HTTP version '{}' is not supported", v)), false;
  http11_ = v[7] != '0';  // HTTP/1.2 and later minors are read as 1.1 (RFC 9110 2.5)
  keep_alive_ = http11_;
  // Origin form /path?query; absolute form http://authority/path?query (a server MUST accept
  // it: RFC 9112 3.2.2); asterisk form for OPTIONS.
  const std::string& t = req_.target;
  std::string path;
  if (t[0] == '/') {
    path = t;
  } else if (const std::string l = lower(t); l.rfind("http://", 0) == 0 || l.rfind("https://", 0) == 0) {
    const size_t auth = l.find("//") + 2, end = std::min(t.find_first_of("/?", auth), t.size());
    if (end == auth) return fail(400, "an absolute request target without a host"), false;
    path = t.substr(end);
    if (path.empty() || path[0] == '?') path.insert(path.begin(), '/');
  } else if (t == "*" && req_.method == "OPTIONS") {
    path = t;
  } else {
    return fail(400, "the request target must be a path (/...), an absolute http(s) URL, or * for OPTIONS"), false;
  }
  req_.path = path.substr(0, path.find('?'));
  return true;
}

bool RequestReader::parse_head() {
  const size_t line_end = buf_.find("\r\n");
  if (!parse_request_line(std::string_view(buf_).substr(0, line_end))) return false;
  for (size_t at = line_end + 2; at < buf_.size();) {
    const size_t e = buf_.find("\r\n", at);
    const std::string_view h(buf_.data() + at, e - at);
    at = e + 2;
    const size_t colon = h.find(':');
    // No space before the colon (RFC 9112 5.1) and no obsolete line folding (5.2): both fail
    // the token check on the name.
    if (colon == std::string_view::npos || !token(h.substr(0, colon)))
      return fail(400, "malformed header line (NAME: VALUE, the name a token)"), false;
    const std::string name = lower(h.substr(0, colon));
    const std::string_view value = trim(h.substr(colon + 1));
    if (!field_value(value))
      return fail(400, fmt::format("header '{}' holds a control byte (NUL, CR, LF ...)", name.substr(0, 64))), false;
    req_.headers.emplace_back(name, std::string(value));
  }
  int lengths = 0, hosts = 0;
  bool has_te = false;
  std::vector<std::string> codings;
  for (const auto& [k, v] : req_.headers) {
    if (k == "host") {
      ++hosts;
      if (!host_value(v)) return fail(400, "malformed Host header"), false;
    } else if (k == "content-length") {
      ++lengths;
      if (v.empty() || v.size() > 18 || !std::all_of(v.begin(), v.end(), digit))
        return fail(400, "Content-Length must be a decimal number"), false;
      want_ = std::stoull(v);
    } else if (k == "transfer-encoding") {
      has_te = true;
      for (std::string& c : list_of(v)) codings.push_back(std::move(c));
    } else if (k == "connection") {
      for (const std::string& o : list_of(v)) {
        if (o == "close") keep_alive_ = false;
        if (o == "keep-alive" && !http11_) keep_alive_ = true;
      }
    } else if (k == "expect" && http11_) {  // an HTTP/1.0 expectation is ignored (RFC 9110 10.1.1)
      if (lower(v) != "100-continue") return fail(417, "only 'Expect: 100-continue' is understood"), false;
      expect_continue_ = true;
    }
  }
  // RFC 9112 3.2: exactly one Host in an HTTP/1.1 request, at most one in any.
  if (hosts > 1) return fail(400, "more than one Host header"), false;
  if (hosts == 0 && http11_) return fail(400, "an HTTP/1.1 request without a Host header"), false;
  if (lengths > 1) return fail(400, "more than one Content-Length"), false;
  if (has_te) {
    // RFC 9112 6.1 and 6.3: chunked must be the last coding, once; framing from an HTTP/1.0
    // message's Transfer-Encoding cannot be trusted; both headers together are refused.
    if (!http11_) return fail(400, "Transfer-Encoding in an HTTP/1.0 request"), false;
    if (lengths) return fail(400, "both Content-Length and Transfer-Encoding"), false;
    if (codings.empty() || codings.back() != "chunked" || std::count(codings.begin(), codings.end(), "chunked") > 1)
      return fail(400, "Transfer-Encoding must end with chunked, once"), false;
    if (codings.size() > 1)
      return fail(501, fmt::format("Transfer-Encoding '{}' is not supported (only chunked)", codings[0].substr(0, 32))), false;
    chunked_ = true;
  }
  return true;
}

void RequestReader::accept_head() {
  if (state_ != State::HeadDone) return;
  // Checked here, after the head handler, so that a request without the key gets its 401 even
  // when its declared body is over the limit.
  if (want_ > limits_->max_body) {
    fail(413, fmt::format("the body is larger than the limit of {} bytes", limits_->max_body));
    return;
  }
  state_ = chunked_ || want_ > 0 ? State::Body : State::Done;
  if (!chunked_) req_.body.reserve(want_);
}

// Chunked body: SIZE[;ext]\r\n DATA \r\n ... 0\r\n [trailers] \r\n. Every data byte counts
// against max_body as it arrives; size lines and trailers together against max_head.
size_t RequestReader::feed_chunked(const char* p, size_t n) {
  size_t used = 0;
  while (used < n && state_ == State::Body) {
    if (chunk_ == Chunk::Data) {
      const size_t take = std::min(n - used, want_);
      req_.body.append(p + used, take);
      used += take;
      want_ -= take;
      if (want_ == 0) chunk_ = Chunk::DataEnd;
      continue;
    }
    if (!line_byte(p[used++], "the chunked body")) return used;
    if (++framing_bytes_ > limits_->max_head) return fail(400, "the chunk size lines and trailers are too long"), used;
    if (p[used - 1] != '\n') continue;
    const std::string_view line = std::string_view(buf_).substr(0, buf_.size() - 2);
    if (chunk_ == Chunk::DataEnd) {
      if (!line.empty()) return fail(400, "a chunk's data does not end with CRLF"), used;
      chunk_ = Chunk::Size;
    } else if (chunk_ == Chunk::Size) {
      // 1*HEXDIG, then nothing or BWS ";" extensions (RFC 9112 7.1), no leading whitespace.
      const size_t digits = std::min(line.find_first_not_of("0123456789abcdefABCDEF"), line.size());
      const std::string_view ext = line.substr(digits), rest = trim(ext);
      if (digits == 0 || digits > 15 || (!ext.empty() && (rest.empty() || rest[0] != ';')) || !field_value(rest))
        return fail(400, "malformed chunk size line"), used;
      want_ = std::stoull(std::string(line.substr(0, digits)), nullptr, 16);
      if (want_ > limits_->max_body - std::min(req_.body.size(), limits_->max_body))
        return fail(413, fmt::format("the body is larger than the limit of {} bytes", limits_->max_body)), used;
      chunk_ = want_ == 0 ? Chunk::Trailer : Chunk::Data;
    } else if (line.empty()) {  // the blank line after the trailers
      state_ = State::Done;
    } else {  // a trailer field: checked as a header, then dropped
      const size_t colon = line.find(':');
      if (colon == std::string_view::npos || !token(line.substr(0, colon)) || !field_value(line.substr(colon + 1)))
        return fail(400, "malformed trailer line"), used;
    }
    buf_.clear();
  }
  return used;
}

// ---- answering without a socket ----------------------------------------------------------------

namespace {

class MemoryResponder : public Responder {
 public:
  MemoryResponder(std::string& out, bool head_only) : out_(out), head_only_(head_only) {}
  void send(Response r) override {
    status = r.status;
    out_ += serialize(r, false, head_only_);
  }
  void begin_stream(int s, std::string content_type, Headers headers) override {
    status = s;
    out_ += response_head(s, content_type, headers, false) + "Transfer-Encoding: chunked\r\n\r\n";
  }
  bool write(std::string_view piece) override {
    if (!piece.empty() && !head_only_) out_ += fmt::format("{:x}\r\n{}\r\n", piece.size(), piece);
    return true;
  }
  void end_stream() override {
    if (!head_only_) out_ += "0\r\n\r\n";
  }
  bool alive() const override { return true; }
  int status = 0;

 private:
  std::string& out_;
  bool head_only_;
};

}  // namespace

std::string answer_bytes(const Limits& limits, const Handlers& h, const std::string& request) {
  RequestReader reader(limits);
  size_t at = reader.feed(request.data(), request.size());
  std::string out;
  const Request& req = reader.request();
  auto refuse = [&](int status, const std::string& msg) {
    if (h.answered) h.answered(req, status);
    out += serialize(h.error(status, msg), false, req.method == "HEAD");
    return out;
  };
  if (reader.state() == RequestReader::State::Head) return refuse(400, "the request ended inside its head");
  if (reader.state() == RequestReader::State::Failed) return refuse(reader.error_status(), reader.error_message());
  if (auto r = h.head(req)) {
    if (h.answered) h.answered(req, r->status);
    return serialize(*r, false, req.method == "HEAD");
  }
  reader.accept_head();
  while (reader.state() == RequestReader::State::Body && at < request.size())
    at += reader.feed(request.data() + at, request.size() - at);
  if (reader.state() == RequestReader::State::Failed) return refuse(reader.error_status(), reader.error_message());
  if (reader.state() != RequestReader::State::Done) return refuse(400, "the request ended inside its body");
  MemoryResponder res(out, req.method == "HEAD");
  h.handle(req, res);
  if (res.status == 0) res.send(h.error(500, "the handler sent no response"));
  if (h.answered) h.answered(req, res.status);
  return out;
}

}  // namespace sigma::serve::http
