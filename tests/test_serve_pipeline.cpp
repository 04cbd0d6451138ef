// sigma serve over real sockets, issue 37 items 14-16: a client that pipelines requests and
// never reads holds at most --max-unsent of answers (back-pressure, then the write timeout);
// HEAD keeps a kept-alive connection's framing; a bare-LF request is answered at once; /metrics
// counts a response before its client has it; /health waits for the last model.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "data/tokenizer.h"
#include "serve/server.h"
#include "serve_test_util.h"

using namespace sigma;
using Clock = std::chrono::steady_clock;

namespace {

using sigma::testing::tiny_serve_config;

struct Served {
  data::Tokenizer tok;
  Model model{tiny_serve_config(tok), 1};
  serve::Server server;
  int port;
  explicit Served(serve::ServerOptions o)
      : server([&] {
          o.port = 0;
          return o;
        }()),
        port(server.start()) {
    server.serve_model(model, &tok, "tiny");
  }
};

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void send_all(int fd, const std::string& s) {
  for (size_t at = 0; at < s.size();) {
    const ssize_t w = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (w <= 0) return;
    at += size_t(w);
  }
}

// What the server sends until it closes, or until `seconds` pass.
std::string read_until_closed(int fd, double seconds) {
  std::string out;
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  char buf[16 << 10];
  while (Clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  return out;
}

size_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  size_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

int64_t tokenize_200s(const std::string& metrics) {
  const std::string key = "sigma_requests_total{route=\"/tokenize\",status=\"200\"} ";
  const size_t at = metrics.find(key);
  return at == std::string::npos ? 0 : std::stoll(metrics.substr(at + key.size()));
}

}  // namespace

// 4 MB of pipelined GET /metrics from a client that never reads took the server's memory up by
// hundreds of MiB (8 MB: 57 -> 509 MiB RSS). Now the loop stops reading a connection whose
// unsent answers pass --max-unsent (1 MiB), and the write timeout closes it.
TEST(ServePipeline, AClientThatPipelinesAndNeverReadsIsBounded) {
  serve::ServerOptions o;
  o.write_timeout = 2;
  Served s(o);
  std::string burst;
  const std::string one = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  while (burst.size() < (4u << 20)) burst += one;
  const size_t before = rss_bytes();
  const int fd = connect_to(s.port);
  ASSERT_GE(fd, 0);
  fcntl(fd, F_SETFL, O_NONBLOCK);
  size_t sent = 0, peak = 0;
  const auto until = Clock::now() + std::chrono::seconds(6);
  while (sent < burst.size() && Clock::now() < until) {
    const ssize_t w = ::send(fd, burst.data() + sent, burst.size() - sent, MSG_NOSIGNAL);
    if (w > 0) {
      sent += size_t(w);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the server stopped reading
    } else {
      break;  // closed by the server
    }
    peak = std::max(peak, rss_bytes());
  }
  // Other clients are served meanwhile, and the non-reader is closed by the write timeout.
  httplib::Client cli("127.0.0.1", s.port);
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  for (int i = 0; i < 100 && s.server.connections() > 0; ++i) {
    peak = std::max(peak, rss_bytes());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(s.server.connections(), 0);
  const double grew_mib = double(peak > before ? peak - before : 0) / double(1 << 20);
  EXPECT_LT(grew_mib, 48) << "sent " << sent << " bytes of requests";
  std::printf("pipelined %zu bytes of GET /metrics without reading: RSS grew %.1f MiB\n", sent, grew_mib);
  ::close(fd);
}

// Back-pressure must not stall a client that pipelines and does read.
TEST(ServePipeline, AReadingPipelinerGetsEveryAnswer) {
  Served s({});
  const int fd = connect_to(s.port);
  ASSERT_GE(fd, 0);
  const int n = 3000;
  std::string burst;
  for (int i = 0; i < n; ++i) burst += "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  burst += "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  std::thread writer([&] { send_all(fd, burst); });
  const std::string out = read_until_closed(fd, 20);
  writer.join();
  ::close(fd);
  size_t answers = 0;
  for (size_t at = 0; (at = out.find("HTTP/1.1 200 OK\r\n", at)) != std::string::npos; at += 8) ++answers;
  EXPECT_EQ(answers, size_t(n + 1));
}

// HEAD got 405 with a body on a kept-alive connection, so the next response was misread. Now a
// HEAD on a GET route answers its head (Content-Length of the body it leaves out), a HEAD on a
// POST route 405 with Allow, neither with a body, and the next response follows at once.
TEST(ServePipeline, HeadLeavesAKeptAliveConnectionFramed) {
  Served s({});
  const int fd = connect_to(s.port);
  ASSERT_GE(fd, 0);
  send_all(fd, "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nHEAD /tokenize HTTP/1.1\r\nHost: x\r\n\r\n"
               "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  const std::string out = read_until_closed(fd, 5);
  ::close(fd);
  const size_t first = out.find("\r\n\r\n");
  ASSERT_NE(first, std::string::npos) << out;
  EXPECT_EQ(out.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << out;
  const size_t second_end = out.find("\r\n\r\n", first + 4);
  ASSERT_EQ(out.compare(first + 4, 31, "HTTP/1.1 405 Method Not Allowed"), 0) << out;
  EXPECT_NE(out.substr(first + 4, second_end - first).find("\r\nAllow: POST\r\n"), std::string::npos) << out;
  EXPECT_EQ(out.compare(second_end + 4, 17, "HTTP/1.1 200 OK\r\n"), 0) << out;
  EXPECT_NE(out.find("{\"status\":\"ok\"}", second_end), std::string::npos) << out;
}

// A request with bare-LF line ends waited for the head timeout (10 s); it is a 400 at once.
TEST(ServePipeline, ABareLfRequestIsAnsweredAtOnce) {
  Served s({});
  const int fd = connect_to(s.port);
  ASSERT_GE(fd, 0);
  const auto t0 = Clock::now();
  send_all(fd, "GET /health HTTP/1.1\nHost: x\n\n");
  const std::string out = read_until_closed(fd, 3);
  ::close(fd);
  EXPECT_EQ(out.rfind("HTTP/1.1 400 ", 0), 0u) << out;
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
}

// Over a socket too: without the key, a declared body over --max-body is 401 (it was 413, and the
// docs promise 401); with it, 413 and no "100 Continue" for a body that will be refused.
TEST(ServePipeline, TheKeyIsCheckedBeforeTheBodySize) {
  serve::ServerOptions o;
  o.api_key = "k";
  o.max_body = 4096;
  Served s(o);
  for (const auto& [key, want] : {std::pair<std::string, int>{"", 401}, {"Authorization: Bearer k\r\n", 413}}) {
    const int fd = connect_to(s.port);
    ASSERT_GE(fd, 0);
    send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + key +
                     "Expect: 100-continue\r\nContent-Length: 50000000\r\n\r\n");
    const std::string out = read_until_closed(fd, 3);
    ::close(fd);
    EXPECT_EQ(out.rfind(fmt::format("HTTP/1.1 {} ", want), 0), 0u) << out;
  }
}

// A client that has its answer finds it counted: the count is taken before the bytes are queued
// (it was taken after the handler returned, and lagged 4 of 60 times).
TEST(ServePipeline, MetricsCountAResponseBeforeItsClientHasIt) {
  Served s({});
  httplib::Client cli("127.0.0.1", s.port);
  int lagged = 0;
  for (int i = 1; i <= 200; ++i) {
    auto r = cli.Post("/tokenize", R"({"text": "ab"})", "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    auto m = cli.Get("/metrics");
    ASSERT_TRUE(m);
    if (tokenize_200s(m->body) != i) ++lagged;
  }
  EXPECT_EQ(lagged, 0);
}

// `sigma serve --model` registers its models one by one: /health said 200 after the first, and a
// request for the second 20-80 ms later got 404. It says 503 until the last is served.
TEST(ServePipeline, HealthWaitsForTheLastModel) {
  data::Tokenizer tok;
  Model a(tiny_serve_config(tok), 1), b(tiny_serve_config(tok), 2);
  serve::Server server(serve::ServerOptions{});
  auto status = [&](const std::string& head) {
    const std::string out = server.answer(head + "Host: x\r\n\r\n");
    return std::atoi(out.c_str() + 9);
  };
  server.serve_model(a, &tok, "a", /*last=*/false);
  EXPECT_EQ(status("GET /health HTTP/1.1\r\n"), 503);
  EXPECT_EQ(status("GET /v1/models HTTP/1.1\r\n"), 503);
  server.serve_model(b, &tok, "b");
  EXPECT_EQ(status("GET /health HTTP/1.1\r\n"), 200);
  const std::string models = server.answer("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(models.find("\"id\":\"b\""), std::string::npos) << models;
}
