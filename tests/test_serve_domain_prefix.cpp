// `sigma serve` formats a text prompt as training and `sigma eval` do (issue 39): a domain with
// prefix controls (<Python>) gets them before the prompt, so the log-probabilities served for a
// code domain's text are those sigma eval computes; a prompt of token ids is taken as it is.
// And the drain message of SIGTERM is printed only when requests are in flight.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli_util.h"
#include "prose_python_run.h"
#include "data/tokenizer.h"
#include "run/checkpoint.h"
#include "serve/server.h"
#include "test_util.h"

using namespace sigma;
using namespace sigma::testing;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

class ServePrefix : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    dir = new TempDir("serve-prefix");
    ASSERT_EQ(make_prose_python_run(*dir, 320,
                                    "--set model.d_model=32 --set model.heads=2 --set model.layers=2 --set model.context=32 "
                                    "--set model.rre_layers=1 --set train.batch=4 --set train.steps=3 --set train.eval_rows=2"),
              "");
  }
  static void TearDownTestSuite() { delete dir; }
  static std::string ckpt() { return *dir / "run/checkpoints"; }
  static TempDir* dir;
};
TempDir* ServePrefix::dir = nullptr;

}  // namespace

TEST_F(ServePrefix, ATextPromptGetsItsDomainsPrefixAndEvalsLogProbabilities) {
  const std::string text = "def add(a, b):";
  // sigma eval: the text as a choice after an empty context: log p(text | <Python>).
  const std::string task = *dir / "score.jsonl";
  std::ofstream(task) << json{{"domain", "python"}, {"context", ""}, {"choices", {text}}, {"answer", 0}}.dump() << "\n";
  auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + task + " --json --log-samples " + *dir / "score.log");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(*dir / "score.log");
  std::string line;
  std::getline(in, line);
  const json logged = json::parse(line);
  const double loglik = logged["loglik"][0].get<double>();
  const int64_t tokens = logged["tokens"][0].get<int64_t>();
  EXPECT_EQ(logged["prompt"], "<Python>");

  // The same checkpoint served as `sigma serve` loads it: model, tokenizer, data registry.
  CheckpointInfo info;
  auto model = load_checkpoint_model(ckpt(), &info);
  const data::Tokenizer tok = data::Tokenizer::load(checkpoint_tokenizer_path(info.dir));
  const auto own = checkpoint_data_domains(info.dir);
  ASSERT_TRUE(own.has_value());
  const DomainRegistry reg = DomainRegistry::from_json(*own, "data_domains.json", DomainForm::Data);
  serve::ServerOptions o;
  o.port = 0;
  serve::Server server(o);
  httplib::Client cli("127.0.0.1", server.start());
  server.serve_model(*model, &tok, "m", true, &reg);
  auto res = cli.Post("/v1/completions", json{{"prompt", text}, {"domain", "python"}, {"max_tokens", 0},
                                               {"echo", true}, {"logprobs", 0}}.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json c = json::parse(res->body)["choices"][0];
  EXPECT_EQ(c["text"], "<Python>" + text) << "the prompt as the model saw it";
  const json& lp = c["logprobs"]["token_logprobs"];
  ASSERT_EQ(int64_t(lp.size()), tokens + 1) << res->body;  // <Python>, then the text's tokens
  EXPECT_TRUE(lp[0].is_null());
  double sum = 0;
  for (size_t i = 1; i < lp.size(); ++i) sum += lp[i].get<double>();
  EXPECT_DOUBLE_EQ(sum, loglik) << "served log-probabilities differ from sigma eval's";
  // A prose prompt has no prefix; a prompt of token ids is taken as it is.
  res = cli.Post("/v1/completions", json{{"prompt", "the cat"}, {"domain", "prose"}, {"max_tokens", 0}, {"echo", true}}.dump(),
                 "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["choices"][0]["text"], "the cat") << res->body;
  std::vector<int32_t> ids;
  for (uint32_t id : tok.encode(text)) ids.push_back(int32_t(id));
  res = cli.Post("/v1/completions", json{{"prompt", ids}, {"domain", "python"}, {"max_tokens", 0}, {"echo", true}}.dump(),
                 "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["choices"][0]["text"], text) << res->body;
  server.stop();
  server.wait();
}

// SIGTERM with nothing in flight says so, without the drain's "cut after N s" line.
TEST_F(ServePrefix, TheDrainMessageOnlyWhenRequestsAreInFlight) {
  const std::string out = *dir / "serve.out";
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1), dup2(fd, 2);
    const std::string c = ckpt();
    execl(SIGMA_BINARY, SIGMA_BINARY, "serve", "--ckpt", c.c_str(), "--port", "0", nullptr);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  const auto t0 = Clock::now();
  while (slurp(out).find("sigma serve: ready") == std::string::npos && Clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string log = slurp(out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  EXPECT_NE(log.find("SIGTERM received: stopping (no request in flight)"), std::string::npos) << log;
  EXPECT_EQ(log.find("--drain-timeout"), std::string::npos) << log;
  EXPECT_EQ(log.find("in flight; any still"), std::string::npos) << log;
}
