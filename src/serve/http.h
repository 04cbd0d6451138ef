// A small HTTP/1.1 server with every resource bounded (docs/serving.md, docs/dependencies.md for
// why not cpp-httplib): one epoll thread owns every socket, reads heads and bodies against
// deadlines and byte limits, answers cheap routes itself and hands complete requests to a fixed
// pool of worker threads through a bounded queue. A connection costs a few hundred bytes and no
// thread, so idle and slow clients cannot starve the others; past the connection cap a client
// gets 503 and the socket closes.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sigma::serve::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Limits {
  int max_connections = 4096;   // open client sockets; past it a 503 and close
  int backlog = 4096;           // listen(2) backlog (the kernel caps it at somaxconn)
  size_t max_head = 16 << 10;   // request line + headers (+ chunk trailers), bytes
  size_t max_body = 1 << 20;    // body bytes, counted as they arrive (chunked too)
  double head_timeout_s = 10;   // first byte of a request to the end of its head
  double request_timeout_s = 30;  // first byte to the end of its body (the total read deadline)
  double idle_timeout_s = 60;   // a keep-alive connection with no request in progress
  double write_timeout_s = 30;  // a response that makes no progress this long is cut
  size_t max_unsent = 1 << 20;  // bytes a response may buffer ahead of a slow reader; past it a
                                // worker waits and the loop reads no further pipelined request
  int workers = 8;              // threads running worker handlers
  int max_waiting = 64;         // complete requests waiting for a worker; past it a 503
};

struct Request {
  std::string method, target, path, version;  // path: target's path (origin or absolute form) without its query
  Headers headers;                            // names in lower case
  std::string body;
  std::string header(std::string_view lower_name) const;  // "" when absent
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  Headers headers;
};

// Where a worker handler writes its answer: one response, or a chunked stream of pieces.
class Responder {
 public:
  virtual ~Responder() = default;
  virtual void send(Response r) = 0;
  virtual void begin_stream(int status, std::string content_type, Headers headers) = 0;
  // False once the client is gone, too slow to read (max_unsent for write_timeout_s) or cut.
  virtual bool write(std::string_view piece) = 0;
  virtual void end_stream() = 0;
  // False once the client hung up or the connection was cut (a drain past its deadline).
  virtual bool alive() const = 0;
};

struct Handlers {
  // Called on the event loop with the head (no body yet): a response to answer at once (health,
  // a refusal such as 401 or 404, so an unauthorised body is never read), or nullopt to read the
  // body and queue the request for a worker. Must be quick and never block.
  std::function<std::optional<Response>(const Request& head)> head;
  // Called on a worker thread with the whole request.
  std::function<void(const Request&, Responder&)> handle;
  // Every response's status once its head is queued (for counters); any thread.
  std::function<void(const Request&, int status)> answered;
  // The response to a request the server itself refuses (malformed, too large, too slow, busy).
  std::function<Response(int status, const std::string& message)> error;
};

// Reads one request from bytes as they arrive: head, then (after accept_head()) the body,
// Content-Length or chunked, against the limits. Used by the server and by Server::answer.
// Strict where RFC 9110/9112 say MUST (src/serve/http_request.cpp, docs/serving.md): CRLF
// only, token methods and names, no control bytes in values, exactly one Host in HTTP/1.1,
// one framing header, chunked last and once.
class RequestReader {
 public:
  enum class State { Head, HeadDone, Body, Done, Failed };
  explicit RequestReader(const Limits& l) : limits_(&l) {}
  // Consumes bytes and returns how many it used (it stops at HeadDone, Done or Failed).
  size_t feed(const char* p, size_t n);
  void accept_head();  // HeadDone -> Body (or Done; or Failed with 413 past max_body)
  State state() const { return state_; }
  bool started() const { return state_ != State::Head || !buf_.empty(); }
  bool expects_continue() const { return expect_continue_; }
  bool keep_alive() const { return keep_alive_; }
  Request& request() { return req_; }
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_; }
  void reset();

 private:
  size_t fail(int status, std::string message);
  bool line_byte(char c, const char* where);
  bool parse_request_line(std::string_view line);
  bool parse_head();
  size_t feed_length(const char* p, size_t n);
  size_t feed_chunked(const char* p, size_t n);
  const Limits* limits_;
  State state_ = State::Head;
  Request req_;
  std::string buf_;  // the head so far, or the current chunk-size / trailer line
  size_t want_ = 0;  // Content-Length bytes still due, or bytes left in the current chunk
  size_t framing_bytes_ = 0;  // chunk size lines and trailers so far (bounded by max_head)
  bool chunked_ = false, expect_continue_ = false, keep_alive_ = true, http11_ = true;
  enum class Chunk { Size, Data, DataEnd, Trailer } chunk_ = Chunk::Size;
  int error_status_ = 0;
  std::string error_;
};

// The bytes of a response head (and body, unless it answers a HEAD: RFC 9110 9.3.2); keep_alive
// adds the matching Connection header.
std::string serialize(const Response& r, bool keep_alive, bool head_only = false);
// Status line and headers, without the blank line (a stream adds its Transfer-Encoding).
std::string response_head(int status, const std::string& content_type, const Headers& headers, bool keep_alive);
std::string reason_phrase(int status);

// Answers one request given as the bytes a client sent, through the same reader and handlers
// but without a socket, and returns the bytes of the response (the fuzzer's entry point).
std::string answer_bytes(const Limits& limits, const Handlers& handlers, const std::string& request);

class Server {
 public:
  Server(Limits limits, Handlers handlers);
  ~Server();
  // Binds and starts the loop and workers; returns the port. Throws sigma::Error on failure.
  int start(const std::string& host, int port);
  // Stops accepting, closes idle connections and lets requests in flight finish; at
  // `deadline` cuts whatever is left. Safe from any thread; returns at once.
  void drain(std::chrono::steady_clock::time_point deadline);
  // Blocks until drain() has finished: the loop and every worker have stopped.
  void wait();
  int connections() const;  // open client sockets (for tests and metrics)

  struct Impl;  // in http.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sigma::serve::http
