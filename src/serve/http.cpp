#include "serve/http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/error.h"

namespace sigma::serve::http {

using Clock = std::chrono::steady_clock;

// ---- the server ---------------------------------------------------------------------------------

namespace {

double seconds_since(Clock::time_point t, Clock::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

// What the loop and a worker share about one connection (the loop alone owns the fd).
struct Conn {
  uint64_t id = 0;
  int fd = -1;
  // Loop only.
  RequestReader reader;
  // Reading a request (or idle), Handling it on a worker, or Lingering: the answer is written
  // and our side shut, and whatever the client still sends is read and dropped for a moment
  // (closing with unread bytes would reset the connection and could lose the answer).
  enum class Phase { Reading, Handling, Lingering } phase = Phase::Reading;
  std::string pending;  // bytes read past the end of the request being handled (pipelining)
  Clock::time_point idle_since, request_start, linger_since;
  uint32_t interest = 0;
  bool close_after = false;  // close once the queued bytes are written
  bool peer_eof = false;     // the client will send nothing more
  // Shared (mutex m).
  std::mutex m;
  std::condition_variable cv;  // room in `out`, or the connection is gone
  std::string out;
  size_t sent = 0;
  Clock::time_point progress;  // last time bytes left, or were queued into an empty buffer
  bool gone = false;           // closed by the loop, or the peer hung up
  bool handled = false;        // the worker's response is complete in `out`
  bool keep_alive = true;      // for the worker's response

  explicit Conn(const Limits& l) : reader(l) {}
  size_t unsent() const { return out.size() - sent; }
  size_t unsent_now() {
    std::lock_guard<std::mutex> lock(m);
    return unsent();
  }
};

}  // namespace

struct Server::Impl {
  Limits lim;
  Handlers h;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1, reserve_fd = -1;
  std::thread loop_thread;
  std::vector<std::thread> workers;
  std::unordered_map<uint64_t, std::shared_ptr<Conn>> conns;  // loop only
  std::atomic<int> open_conns{0};
  uint64_t next_id = 1;

  std::mutex m;  // guards the fields below
  std::deque<std::pair<std::shared_ptr<Conn>, Request>> work;
  std::condition_variable work_cv;
  std::vector<std::shared_ptr<Conn>> dirty;  // connections a worker touched since the loop looked
  bool draining = false, workers_stop = false;
  Clock::time_point drain_deadline;
  std::atomic<bool> stopped{false};

  ~Impl() {
    for (int fd : {listen_fd, epoll_fd, wake_fd, reserve_fd})
      if (fd >= 0) ::close(fd);
  }
  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(wake_fd, &one, sizeof one);
  }
  void touched(const std::shared_ptr<Conn>& c) {
    {
      std::lock_guard<std::mutex> lock(m);
      dirty.push_back(c);
    }
    wake();
  }
  void loop();
  void worker();
  void accept_all();
  void on_readable(Conn& c);
  void process(const std::shared_ptr<Conn>& c);  // read_requests, then flush, while both progress
  void read_requests(const std::shared_ptr<Conn>& c);
  void queue_response(Conn& c, const Response& r, bool keep_alive, bool head_only);
  void flush(Conn& c);
  void close_conn(Conn& c);
  void update_interest(Conn& c);
  void after_handled(const std::shared_ptr<Conn>& c);
  void scan(Clock::time_point now, bool drain);
};

// A worker's view of its connection.
class SocketResponder : public Responder {
 public:
  SocketResponder(Server::Impl& s, std::shared_ptr<Conn> c, const Request& req)
      : s_(s), c_(std::move(c)), req_(req), head_only_(req.method == "HEAD") {}
  // Counted before the bytes are queued: a client that has its answer finds it in /metrics.
  void send(Response r) override {
    answered(r.status);
    queue(serialize(r, keep_alive(), head_only_), true);
  }
  void begin_stream(int st, std::string content_type, Headers headers) override {
    answered(st);
    queue(response_head(st, content_type, headers, keep_alive()) + "Transfer-Encoding: chunked\r\n\r\n", false);
  }
  bool write(std::string_view piece) override {
    if (piece.empty() || head_only_) return alive();
    return queue(fmt::format("{:x}\r\n{}\r\n", piece.size(), piece), false);
  }
  void end_stream() override { queue(head_only_ ? "" : "0\r\n\r\n", true); }
  bool alive() const override {
    std::lock_guard<std::mutex> lock(c_->m);
    return !c_->gone;
  }
  int status = 0;

 private:
  void answered(int st) {
    status = st;
    if (s_.h.answered) s_.h.answered(req_, st);
  }
  bool keep_alive() const {
    std::lock_guard<std::mutex> lock(c_->m);
    return c_->keep_alive;
  }
  // Appends bytes for the loop to write, waiting (up to the write timeout) while a slow reader
  // has more than max_unsent bytes queued; false when the connection is gone or too slow.
  bool queue(std::string bytes, bool last) {
    {
      std::unique_lock<std::mutex> lock(c_->m);
      const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(s_.lim.write_timeout_s));
      if (!c_->cv.wait_until(lock, until, [&] { return c_->gone || c_->unsent() <= s_.lim.max_unsent; }))
        c_->gone = true;  // the loop closes it when it next looks
      if (c_->gone) return false;
      if (c_->unsent() == 0) c_->progress = Clock::now();
      c_->out += bytes;
      if (last) c_->handled = true;
    }
    s_.touched(c_);
    return true;
  }
  Server::Impl& s_;
  std::shared_ptr<Conn> c_;
  const Request& req_;
  const bool head_only_;
};

void Server::Impl::worker() {
  for (;;) {
    std::shared_ptr<Conn> c;
    Request req;
    {
      std::unique_lock<std::mutex> lock(m);
      work_cv.wait(lock, [&] { return !work.empty() || workers_stop; });
      if (work.empty()) return;
      c = std::move(work.front().first);
      req = std::move(work.front().second);
      work.pop_front();
    }
    SocketResponder res(*this, c, req);
    if (res.alive()) {
      try {
        h.handle(req, res);
      } catch (const std::exception& e) {
        if (res.status == 0) res.send(h.error(500, fmt::format("internal error: {}", e.what())));
      }
      if (res.status == 0) res.send(h.error(500, "the handler sent no response"));
    }
    {
      std::lock_guard<std::mutex> lock(c->m);
      c->handled = true;
    }
    touched(c);
  }
}

void Server::Impl::update_interest(Conn& c) {
  const size_t unsent = c.unsent_now();
  const bool reading = (c.phase == Conn::Phase::Reading && !c.close_after) || c.phase == Conn::Phase::Lingering;
  const uint32_t in = reading ? uint32_t(EPOLLIN) : 0u, out = unsent > 0 ? uint32_t(EPOLLOUT) : 0u;
  uint32_t ev = (c.peer_eof ? 0u : uint32_t(EPOLLRDHUP) | in) | out;
  // Back-pressure: a client with more than max_unsent of answers unread is not read from (nor
  // woken by its pending bytes) until it reads.
  if (c.phase == Conn::Phase::Reading && unsent > lim.max_unsent) ev = out;
  if (ev == c.interest) return;
  epoll_event e{};
  e.events = ev;
  e.data.u64 = c.id;
  epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &e);
  c.interest = ev;
}

void Server::Impl::close_conn(Conn& c) {
  if (c.fd < 0) return;
  epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
  ::close(c.fd);
  c.fd = -1;
  {
    std::lock_guard<std::mutex> lock(c.m);
    c.gone = true;
  }
  c.cv.notify_all();
  open_conns -= 1;
  conns.erase(c.id);  // may free c: nothing after this
}

// An answer of the loop's own. Back-pressure keeps the loop from answering a connection with
// more than max_unsent unsent; past twice that (a refusal behind a large worker answer) the
// answer is dropped and the connection closes once the rest is written or the write times out.
void Server::Impl::queue_response(Conn& c, const Response& r, bool keep_alive, bool head_only) {
  {
    std::lock_guard<std::mutex> lock(c.m);
    if (c.unsent() > 2 * lim.max_unsent) {
      keep_alive = false;
    } else {
      if (c.unsent() == 0) c.progress = Clock::now();
      c.out += serialize(r, keep_alive, head_only);
    }
  }
  if (!keep_alive) c.close_after = true;
}

// Writes what it can; closes the connection when it is done with it or the peer is gone.
void Server::Impl::flush(Conn& c) {
  bool done = false, failed = false;
  {
    std::lock_guard<std::mutex> lock(c.m);
    while (c.unsent() > 0) {
      const ssize_t w = ::send(c.fd, c.out.data() + c.sent, c.unsent(), MSG_NOSIGNAL);
      if (w > 0) {
        c.sent += size_t(w);
        c.progress = Clock::now();
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      failed = true;
      break;
    }
    if (c.unsent() == 0) {
      c.out.clear();
      c.sent = 0;
    } else if (c.sent > (64 << 10)) {
      c.out.erase(0, c.sent);
      c.sent = 0;
    }
    done = c.unsent() == 0;
  }
  c.cv.notify_all();
  if (failed) return close_conn(c);
  if (done && c.phase == Conn::Phase::Reading && (c.close_after || c.peer_eof)) {
    if (c.peer_eof) return close_conn(c);
    ::shutdown(c.fd, SHUT_WR);
    c.phase = Conn::Phase::Lingering;
    c.linger_since = Clock::now();
  }
  update_interest(c);
}

// Feeds buffered bytes to the reader and acts on what it finds: a head to check, a request to
// queue, or a refusal.
void Server::Impl::process(const std::shared_ptr<Conn>& cp) {
  Conn& c = *cp;
  do {
    read_requests(cp);
    flush(c);
    // Writing may have brought the unsent answers back under the limit with requests already
    // read and pending: no EPOLLIN will come for those.
  } while (c.fd >= 0 && c.phase == Conn::Phase::Reading && !c.close_after && !c.pending.empty() &&
           c.unsent_now() <= lim.max_unsent);
}

void Server::Impl::read_requests(const std::shared_ptr<Conn>& cp) {
  Conn& c = *cp;
  using S = RequestReader::State;
  // Back-pressure: no further pipelined request is read while the answers before it are unsent.
  while (c.phase == Conn::Phase::Reading && !c.close_after && !c.pending.empty() &&
         c.unsent_now() <= lim.max_unsent) {
    if (!c.reader.started()) c.request_start = Clock::now();
    const size_t used = c.reader.feed(c.pending.data(), c.pending.size());
    c.pending.erase(0, used);
    Request& req = c.reader.request();
    const bool head_only = req.method == "HEAD";
    auto refuse = [&] {
      if (h.answered) h.answered(req, c.reader.error_status());
      queue_response(c, h.error(c.reader.error_status(), c.reader.error_message()), false, head_only);
    };
    if (c.reader.state() == S::Failed) {
      refuse();
      break;
    }
    if (c.reader.state() == S::HeadDone) {
      if (auto r = h.head(req)) {
        // A refused request's body is never read: the connection closes after the answer.
        const bool bodyless = req.header("content-length").empty() || req.header("content-length") == "0";
        const bool keep = bodyless && req.header("transfer-encoding").empty() && c.reader.keep_alive();
        if (h.answered) h.answered(req, r->status);
        queue_response(c, *r, keep, head_only);
        c.reader.reset();
        c.idle_since = Clock::now();
        continue;
      }
      c.reader.accept_head();
      if (c.reader.state() == S::Failed) {  // a declared body over max_body
        refuse();
        break;
      }
      if (c.reader.expects_continue() && c.reader.state() == S::Body) {
        std::lock_guard<std::mutex> lock(c.m);
        if (c.unsent() == 0) c.progress = Clock::now();
        c.out += "HTTP/1.1 100 Continue\r\n\r\n";
      }
    }
    if (c.reader.state() == S::Done) {
      bool queued = false;
      {
        std::lock_guard<std::mutex> lock(m);
        if (int(work.size()) < lim.max_waiting) {
          work.emplace_back(cp, std::move(req));
          queued = true;
        }
      }
      if (!queued) {
        if (h.answered) h.answered(req, 503);
        Response busy = h.error(503, "the server is busy (every worker and its queue are full); retry");
        busy.headers.emplace_back("Retry-After", "1");
        queue_response(c, busy, false, head_only);
        break;
      }
      {
        std::lock_guard<std::mutex> lock(c.m);
        c.handled = false;
        c.keep_alive = c.reader.keep_alive();
      }
      c.phase = Conn::Phase::Handling;
      c.reader.reset();
      work_cv.notify_one();
    }
  }
  // A client that stopped sending inside a request can never finish it.
  if (c.phase == Conn::Phase::Reading && c.peer_eof && c.pending.empty() && c.reader.started()) c.close_after = true;
}

void Server::Impl::on_readable(Conn& c) {
  char buf[64 << 10];
  // Reads at most a little past one request before processing it: a client cannot make the
  // loop buffer more than max_head + 64 KiB ahead of what the reader consumed; and nothing
  // while its unread answers are over max_unsent.
  if (c.unsent_now() > lim.max_unsent) return;
  while (c.pending.size() < lim.max_head + sizeof buf) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n > 0) {
      c.pending.append(buf, size_t(n));
      if (size_t(n) < sizeof buf) break;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    c.peer_eof = true;  // EOF or error: nothing more will come
    if (c.pending.empty() && c.unsent_now() == 0) return close_conn(c);  // else after the answers
    break;
  }
}

void Server::Impl::after_handled(const std::shared_ptr<Conn>& cp) {
  Conn& c = *cp;
  bool handled, keep;
  {
    std::lock_guard<std::mutex> lock(c.m);
    handled = c.handled;
    keep = c.keep_alive;
    if (c.gone && c.fd >= 0) handled = true, keep = false;  // a worker found it too slow
  }
  if (c.phase == Conn::Phase::Handling && handled) {
    c.phase = Conn::Phase::Reading;
    c.idle_since = Clock::now();
    bool draining_now;
    {
      std::lock_guard<std::mutex> lock(m);
      draining_now = draining;
    }
    if (!keep || draining_now) c.close_after = true;
    return process(cp);
  }
  flush(c);
}

void Server::Impl::accept_all() {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && reserve_fd >= 0) {
        // Out of descriptors: free the reserve to take the connection and refuse it.
        ::close(reserve_fd);
        fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
          const std::string busy = serialize(h.error(503, "too many connections; retry"), false);
          [[maybe_unused]] ssize_t w = ::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL);
          ::close(fd);
        }
        reserve_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        continue;
      }
      return;  // EAGAIN, or an error the next readiness retries
    }
    if (int(conns.size()) >= lim.max_connections) {
      Response r = h.error(503, fmt::format("too many connections (the limit is {}); retry", lim.max_connections));
      r.headers.emplace_back("Retry-After", "1");
      const std::string busy = serialize(r, false);
      [[maybe_unused]] ssize_t w = ::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL);
      ::close(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto c = std::make_shared<Conn>(lim);
    c->id = next_id++;
    c->fd = fd;
    c->idle_since = c->progress = Clock::now();
    c->interest = EPOLLIN | EPOLLRDHUP;
    epoll_event e{};
    e.events = c->interest;
    e.data.u64 = c->id;
    if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &e) != 0) {
      ::close(fd);
      continue;
    }
    conns.emplace(c->id, c);
    open_conns += 1;
  }
}

// Deadlines: idle keep-alive, head, whole request, stalled writes; and the drain.
void Server::Impl::scan(Clock::time_point now, bool drain) {
  std::vector<std::shared_ptr<Conn>> all;
  all.reserve(conns.size());
  for (auto& [id, c] : conns) all.push_back(c);
  for (auto& c : all) {
    if (c->fd < 0) continue;
    bool stalled;
    {
      std::lock_guard<std::mutex> lock(c->m);
      stalled = c->unsent() > 0 && seconds_since(c->progress, now) > lim.write_timeout_s;
    }
    if (stalled || (c->phase == Conn::Phase::Lingering && seconds_since(c->linger_since, now) > 2)) {
      close_conn(*c);
      continue;
    }
    if (drain && c->phase == Conn::Phase::Handling) {
      std::lock_guard<std::mutex> lock(c->m);
      c->keep_alive = false;  // responses not yet begun say Connection: close
    }
    if (c->phase != Conn::Phase::Reading || c->close_after) continue;
    using S = RequestReader::State;
    if (!c->reader.started()) {
      if (drain || seconds_since(c->idle_since, now) > lim.idle_timeout_s) close_conn(*c);
      continue;
    }
    const double t = seconds_since(c->request_start, now);
    const bool in_head = c->reader.state() == S::Head;
    if (drain || (in_head && t > lim.head_timeout_s) || t > lim.request_timeout_s) {
      const std::string what = in_head ? fmt::format("the request head did not arrive within {} s", lim.head_timeout_s)
                                       : fmt::format("the request did not arrive within {} s", lim.request_timeout_s);
      if (h.answered) h.answered(c->reader.request(), 408);
      queue_response(*c, h.error(408, drain ? "the server is shutting down" : what), false,
                     c->reader.request().method == "HEAD");
      c->reader.reset();
      flush(*c);
    }
  }
}

void Server::Impl::loop() {
  std::vector<epoll_event> events(256);
  auto last_scan = Clock::now();
  bool drain_started = false;
  for (;;) {
    const int n = epoll_wait(epoll_fd, events.data(), int(events.size()), 50);
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[size_t(i)].data.u64;
      const uint32_t ev = events[size_t(i)].events;
      if (id == 0) {
        accept_all();
        continue;
      }
      if (id == UINT64_MAX) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wake_fd, &v, sizeof v);
        continue;
      }
      auto it = conns.find(id);
      if (it == conns.end()) continue;
      std::shared_ptr<Conn> c = it->second;
      if (c->phase == Conn::Phase::Handling && (ev & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
        close_conn(*c);  // the client left while its request runs: the handler sees !alive()
        continue;
      }
      if (c->phase == Conn::Phase::Lingering) {
        char sink[16 << 10];
        ssize_t r;
        while ((r = ::recv(c->fd, sink, sizeof sink, 0)) > 0) {
        }
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) ||
            (ev & (EPOLLHUP | EPOLLERR)))
          close_conn(*c);
        continue;
      }
      if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
        if (c->phase == Conn::Phase::Reading) on_readable(*c);
        if (c->fd < 0) continue;
      }
      process(c);
    }
    std::vector<std::shared_ptr<Conn>> touched_now;
    bool drain;
    Clock::time_point deadline;
    {
      std::lock_guard<std::mutex> lock(m);
      touched_now.swap(dirty);
      drain = draining;
      deadline = drain_deadline;
    }
    for (auto& c : touched_now)
      if (c->fd >= 0) after_handled(c);
    const auto now = Clock::now();
    if (drain && !drain_started) {
      drain_started = true;
      epoll_ctl(epoll_fd, EPOLL_CTL_DEL, listen_fd, nullptr);
      ::close(listen_fd);
      listen_fd = -1;
      scan(now, true);
      last_scan = now;
    }
    if (seconds_since(last_scan, now) >= 0.05) {
      scan(now, drain);
      last_scan = now;
    }
    if (drain && (conns.empty() || now >= deadline)) {
      std::vector<std::shared_ptr<Conn>> left;
      for (auto& [cid, c] : conns) left.push_back(c);
      for (auto& c : left) close_conn(*c);  // past the deadline: cut
      return;
    }
  }
}

Server::Server(Limits limits, Handlers handlers) : impl_(std::make_unique<Impl>()) {
  impl_->lim = limits;
  impl_->h = std::move(handlers);
  SIGMA_CHECK(impl_->lim.workers >= 1 && impl_->lim.max_connections >= 1, "the HTTP server needs a worker and a connection");
}

Server::~Server() {
  if (impl_->loop_thread.joinable()) {
    drain(Clock::now());
    wait();
  }
}

int Server::start(const std::string& host, int port) {
  Impl& s = *impl_;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  const std::string service = std::to_string(port);
  SIGMA_CHECK(getaddrinfo(host.c_str(), service.c_str(), &hints, &res) == 0 && res,
              "cannot listen on {}:{}: the address does not resolve", host, port);
  int fd = -1;
  std::string why;
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, s.lim.backlog) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  SIGMA_CHECK(fd >= 0, "cannot listen on {}:{} ({})", host, port, why);
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                     : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  s.listen_fd = fd;
  s.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  s.reserve_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  SIGMA_CHECK(s.epoll_fd >= 0 && s.wake_fd >= 0, "cannot create the server's epoll or eventfd: {}", std::strerror(errno));
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = 0;
  epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, s.listen_fd, &e);
  e.data.u64 = UINT64_MAX;
  epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, s.wake_fd, &e);
  for (int i = 0; i < s.lim.workers; ++i) s.workers.emplace_back([&s] { s.worker(); });
  s.loop_thread = std::thread([&s] { s.loop(); });
  return bound;
}

void Server::drain(Clock::time_point deadline) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.m);
    if (s.draining) {
      s.drain_deadline = std::min(s.drain_deadline, deadline);
    } else {
      s.draining = true;
      s.drain_deadline = deadline;
    }
  }
  if (s.wake_fd >= 0) s.wake();
}

void Server::wait() {
  Impl& s = *impl_;
  if (s.stopped.exchange(true)) return;
  if (s.loop_thread.joinable()) s.loop_thread.join();
  {
    std::lock_guard<std::mutex> lock(s.m);
    s.workers_stop = true;
  }
  s.work_cv.notify_all();
  for (auto& w : s.workers) w.join();  // handlers of cut connections see !alive() and return
}

int Server::connections() const { return impl_->open_conns; }

}  // namespace sigma::serve::http
