// `sigma serve`'s start and end under a live run (issue 39): the checkpoint it loads, with its
// tokenizer and data registry, comes whole from one checkpoint even when retention prunes the
// one `latest` named while it reads (retried from the next; anything else fails naming the
// file); SIGTERM with a request in flight announces the drain and lets the request finish; and
// `--kv-cache bf16` reaches the served model.
#include <gtest/gtest.h>
#include <httplib.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "cli_util.h"
#include "prose_python_run.h"
#include "infer/batch_decoder.h"
#include "io/checkpoint_dir.h"
#include "io/file.h"
#include "kernels/ops.h"
#include "run/checkpoint.h"
#include "run/checkpoint_bundle.h"
#include "test_util.h"
#include "train/checkpoint.h"

using namespace sigma;
using namespace sigma::testing;
using nlohmann::json;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// A run on prepared shards (a tokenizer and a data registry in every checkpoint) with
// checkpoints at steps 2 and 4.
class ServeLoad : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    dir = new TempDir("serve-load");
    ASSERT_EQ(make_prose_python_run(*dir, 300,
                                    "--set model.d_model=16 --set model.heads=2 --set model.layers=1 --set model.context=16 "
                                    "--set model.rre_layers=1 --set train.batch=2 --set train.steps=4 --set train.ckpt_every=2 --set train.eval_rows=2"),
              "");
  }
  static void TearDownTestSuite() { delete dir; }
  // A fresh copy of the run's checkpoints/ whose `latest` names step 2, as before step 4's save.
  static std::string root(const std::string& name) {
    const std::string out = *dir / name;
    fs::remove_all(out);
    fs::copy(*dir / "run/checkpoints", out, fs::copy_options::recursive);
    write_file_atomic(out + "/latest", "step-00000002\n");
    return out;
  }
  static TempDir* dir;
};
TempDir* ServeLoad::dir = nullptr;

void expect_same_weights(Model& a, Model& b) {
  auto& pa = a.params().all();
  auto& pb = b.params().all();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(same_bits(ops::to_host(pa[i].value), ops::to_host(pb[i].value))) << pa[i].name;
}

// A dense checkpoint of random weights with one domain, "prose", at dir; returns the model's config.
ModelConfig save_prose_checkpoint(const std::string& dir, int64_t vocab, int64_t d, int context,
                                  int layers, uint64_t seed) {
  Config cfg;
  ModelConfig& m = cfg.model;
  m.vocab = vocab;
  m.d_model = d;
  m.heads = 4;
  m.context = context;
  m.layers = layers;
  m.slots = 1;
  m.rre_layers = 0;
  m.groups.clear();
  m.domains = {{"prose", "prose", 0}};
  Model model(m, seed);
  save_checkpoint(dir, cfg, model, nullptr, TrainerState{});
  return m;
}

// `sigma serve --ckpt ckpt --port 0 ARGS...` with its output in `out` (and OMP_NUM_THREADS=1
// when one_thread); returns its pid, and its port once it is ready (-1 if it was not within
// `wait`, the process then killed).
struct Served {
  pid_t pid;
  int port;
};
Served start_serve(const std::string& ckpt, const std::string& out, std::vector<std::string> args,
                   bool one_thread, std::chrono::seconds wait) {
  args.insert(args.begin(), {SIGMA_BINARY, "serve", "--ckpt", ckpt, "--port", "0"});
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1), dup2(fd, 2);
    if (one_thread) setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(SIGMA_BINARY, argv.data());
    _exit(127);
  }
  const auto t0 = Clock::now();
  while (pid > 0 && slurp(out).find("sigma serve: ready") == std::string::npos && Clock::now() - t0 < wait)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const std::string log = slurp(out);
  const size_t at = log.find("listening on http://127.0.0.1:");
  if (pid > 0 && (at == std::string::npos || log.find("sigma serve: ready") == std::string::npos)) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return {pid, -1};
  }
  return {pid, at == std::string::npos ? -1 : std::stoi(log.substr(at + 30))};
}

}  // namespace

// Retention prunes step 2 after its model is read and before its tokenizer is: the load starts
// again from step 4, all three parts. Before, the tokenizer and registry of a vanished
// checkpoint were taken as absent: a model served without its tokenizer.
TEST_F(ServeLoad, APrunedCheckpointIsReadAgainWholeFromTheNextOne) {
  const std::string r = root("pruned");
  std::vector<std::string> models;
  ::testing::internal::CaptureStderr();
  CheckpointBundle b = load_checkpoint_bundle(r, [&](const std::string& d) {
    models.push_back(fs::path(d).filename().string());
    if (models.size() == 1) {  // the live run commits step 4 and prunes step 2 now
      write_file_atomic(r + "/latest", "step-00000004\n");
      EXPECT_EQ(prune_checkpoints(r, 1, 0), 1);
    }
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(models, (std::vector<std::string>{"step-00000002", "step-00000004"}));
  EXPECT_EQ(b.info.dir, r + "/step-00000004");
  EXPECT_EQ(b.info.state.step, 4);
  ASSERT_TRUE(b.tok.has_value()) << "served without its tokenizer";
  EXPECT_EQ(b.tok->hash(), data::Tokenizer::load(*dir / "tok.json").hash());
  ASSERT_TRUE(b.data_domains.has_value()) << "served without its data registry";
  EXPECT_NE(err.find("was deleted while it was read"), std::string::npos) << err;
  expect_same_weights(*b.model, *load_checkpoint_model(*dir / "run/checkpoints/step-00000004"));
}

// Retention deletes file by file: caught with step 2's tokenizer gone and its folder still there
// (and `latest` naming step 4), the load is retried too.
TEST_F(ServeLoad, ACheckpointCaughtHalfDeletedIsReadAgainFromTheNextOne) {
  const std::string r = root("half");
  int calls = 0;
  ::testing::internal::CaptureStderr();
  CheckpointBundle b = load_checkpoint_bundle(r, [&](const std::string&) {
    if (++calls == 1) {
      write_file_atomic(r + "/latest", "step-00000004\n");
      fs::remove(r + "/step-00000002/" + kTokenizerFile);
    }
  });
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(b.info.dir, r + "/step-00000004");
  EXPECT_TRUE(b.tok.has_value());
  EXPECT_TRUE(b.data_domains.has_value());
}

// Damaged in place, while `latest` still names it: no retry, an error naming the file. And a
// root whose every checkpoint goes while it is read: the error says what the root lacks.
TEST_F(ServeLoad, OtherwiseTheLoadFailsNamingWhatIsWrong) {
  std::string r = root("damaged");
  int calls = 0;
  std::string e = error_of([&] {
    load_checkpoint_bundle(r, [&](const std::string& d) {
      ++calls;
      std::ofstream(d + "/" + kTokenizerFile) << "{";
    });
  });
  EXPECT_EQ(calls, 1);
  EXPECT_NE(e.find(r + "/step-00000002/" + kTokenizerFile), std::string::npos) << e;
  r = root("gone");
  ::testing::internal::CaptureStderr();
  e = error_of([&] {
    load_checkpoint_bundle(r, [&](const std::string&) {
      for (const auto& entry : fs::directory_iterator(r)) fs::remove_all(entry.path());
    });
  });
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(e.find("'" + r + "' is not a checkpoint"), std::string::npos) << e;
  // sigma serve loads through it: the same checkpoint, its tokenizer and registry.
  const auto res = sigma_cmd("serve --ckpt " + *dir / "damaged" + " --port 0");
  EXPECT_NE(res.code, 0);
  EXPECT_NE(res.out.find("tokenizer.json"), std::string::npos) << res.out;
}

// SIGTERM while a request streams: the drain is announced with the count in flight, the request
// runs to its end (all max_tokens tokens, [DONE]), and the server exits 0. The model is large
// enough (d 256, 4 blocks, context 1024, one thread) that 1000 tokens take seconds, far longer
// than the signal takes to arrive after the first token.
TEST(ServeDrain, ARequestInFlightAtSigtermIsAnnouncedAndFinishes) {
  TempDir tmp("serve-drain");
  save_prose_checkpoint(tmp / "ckpt", 256, 256, 1024, 4, 7);
  const std::string out = tmp / "serve.out";
  const Served served = start_serve(tmp / "ckpt", out, {"--slots", "1", "--drain-timeout", "600"}, true,
                                    std::chrono::seconds(120));
  ASSERT_GT(served.pid, 0);
  ASSERT_GT(served.port, 0) << slurp(out);
  const pid_t pid = served.pid;
  const int port = served.port;
  const auto t0 = Clock::now();
  std::atomic<bool> first{false};
  std::string body;
  int status = 0;
  std::thread client([&] {
    httplib::Client cli("127.0.0.1", port);
    cli.set_read_timeout(600, 0);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = json{{"prompt", {5}}, {"max_tokens", 1000}, {"stream", true}}.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      body.append(data, n);
      first = true;
      return true;
    };
    const auto res = cli.send(req);
    status = res ? res->status : -1;
  });
  while (!first && Clock::now() - t0 < std::chrono::seconds(300))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  kill(pid, SIGTERM);
  client.join();
  int wst = 0;
  waitpid(pid, &wst, 0);
  const std::string log = slurp(out);
  EXPECT_TRUE(WIFEXITED(wst) && WEXITSTATUS(wst) == 0) << log;
  EXPECT_NE(log.find("SIGTERM received: finishing the 1 request in flight; any still running after "
                     "600 s is cut (--drain-timeout)"), std::string::npos) << log;
  EXPECT_EQ(log.find("no request in flight"), std::string::npos) << log;
  EXPECT_NE(log.find("sigma serve: stopped"), std::string::npos) << log;
  EXPECT_EQ(status, 200);
  // Every token streamed (a model without a tokenizer writes each as " ID"), then the end.
  std::string text, finish;
  for (size_t p = 0; (p = body.find("data: {", p)) != std::string::npos; ++p) {
    const json j = json::parse(body.substr(p + 6, body.find('\n', p) - p - 6));
    const json& c = j["choices"][0];
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) finish = c["finish_reason"];
    if (c.contains("text")) text += c["text"].get<std::string>();
  }
  EXPECT_EQ(finish, "length") << body.substr(body.size() > 2000 ? body.size() - 2000 : 0);
  EXPECT_EQ(std::count(text.begin(), text.end(), ' '), 1000) << "tokens streamed";
  EXPECT_NE(body.find("data: [DONE]"), std::string::npos);
}

// `sigma serve --kv-cache bf16` says so when ready and decodes through a bf16 cache: a greedy
// completion's log-probabilities are, to the bit, those of a BatchDecoder on the same checkpoint
// with Model::use_kv_cache(BF16) (prefill, then a step a token, as the engine runs), and not
// those of an fp32 cache; `sigma generate --kv-cache bf16` decodes the same tokens.
TEST(ServeKvCache, Bf16ServesWhatADecoderOnABf16CacheComputes) {
  TempDir tmp("serve-kv");
  const ModelConfig m = save_prose_checkpoint(tmp / "ckpt", 64, 32, 96, 2, 9);
  const std::string out = tmp / "serve.out", ckpt = tmp / "ckpt";
  const Served server = start_serve(ckpt, out, {"--kv-cache", "bf16"}, false, std::chrono::seconds(60));
  ASSERT_GT(server.pid, 0);
  ASSERT_GT(server.port, 0) << slurp(out);
  const pid_t pid = server.pid;
  EXPECT_NE(slurp(out).find("bf16 KV cache"), std::string::npos) << slurp(out);
  httplib::Client cli("127.0.0.1", server.port);
  cli.set_read_timeout(60, 0);
  const std::vector<int32_t> prompt = {5, 6, 7};
  const auto res = cli.Post("/v1/completions",
                            json{{"prompt", prompt}, {"max_tokens", 40}, {"temperature", 0}, {"logprobs", 0}}.dump(),
                            "application/json");
  kill(pid, SIGTERM);
  int wst = 0;
  waitpid(pid, &wst, 0);
  ASSERT_TRUE(res) << slurp(out);
  ASSERT_EQ(res->status, 200) << res->body;
  const json choice = json::parse(res->body)["choices"][0];
  const std::string served = choice["text"];
  std::vector<int32_t> tokens;
  for (std::istringstream in(served); in;) {
    int32_t t;
    if (in >> t) tokens.push_back(t);
  }
  const std::vector<double> logprobs = choice["logprobs"]["token_logprobs"];
  ASSERT_EQ(tokens.size(), 40u) << served;
  ASSERT_EQ(logprobs.size(), tokens.size());
  auto decoded = [&](DType kv) {  // the engine's order: the prompt in one prefill, then steps
    auto model = load_checkpoint_model(ckpt);
    model->use_kv_cache(kv);
    BatchDecoder dec(*model, 1);
    const int slot = 0, domain = 0;
    const float* logits = dec.prefill(slot, domain, prompt);
    std::vector<double> lp;
    for (int32_t t : tokens) {
      lp.push_back(token_logprob(logits, m.vocab, t));
      dec.step({&slot, 1}, {&domain, 1}, {&t, 1});
      logits = dec.logits(0);
    }
    return lp;
  };
  EXPECT_EQ(decoded(DType::BF16), logprobs);
  EXPECT_NE(decoded(DType::F32), logprobs) << "an fp32 cache computed the same: nothing rounded";
  const auto gen = sigma_cmd("generate --ckpt " + ckpt + " --prompt '5 6 7' --max-new 40 --kv-cache bf16");
  ASSERT_EQ(gen.code, 0) << gen.out;
  EXPECT_EQ(gen.out.substr(0, gen.out.find('\n')), served.substr(1)) << gen.out;  // served: " ID ID ..."
}
