// Evaluation that can be audited (issue 28): `--log-samples` keeps every item's prompt, outputs
// and outcomes, and the printed metrics are recomputed here from that file alone;
// `--score-generations` scores the file again without a model; the checkpoint carries its data
// registry, so deleting the training shards changes nothing; and the small errors.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <regex>

#include <filesystem>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "cli_util.h"
#include "eval/bleu.h"
#include "eval/pass_at_k.h"

using namespace sigma::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Pair {
  const char *q, *a;
};
const Pair kColours[] = {{"zorp", "red"}, {"blick", "blue"}, {"quan", "green"}, {"mif", "yellow"}};
const Pair kWords[] = {{"the cat is sleeping", "猫在睡觉"}, {"the dog runs fast", "狗跑得很快"},
                       {"good morning teacher", "老师早上好"}};
const Pair kCode[] = {{"add(a, b)", "a + b"}, {"sub(a, b)", "a - b"}};

std::string question(const Pair& p) { return std::string("Q: what colour is a ") + p.q + "?\nA:"; }

class Audit : public ::testing::Test {
 public:
  // A few steps of fine-tuning on prefixed (<Python>) and bilingual (<EN>/<CN>) domains: the
  // scores do not matter, the prompt format does.
  static void SetUpTestSuite() {
    dir = new TempDir("audit");
    std::ofstream c(*dir / "pairs.jsonl");
    for (const Pair& p : kColours)
      c << json{{"domain", "dialogue"}, {"prompt", question(p)}, {"answer", std::string(" ") + p.a}}.dump() << "\n";
    for (const Pair& p : kWords)
      c << json{{"domain", "translation"}, {"prompt", p.q}, {"answer", p.a}}.dump() << "\n";
    for (const Pair& p : kCode)
      c << json{{"domain", "python"}, {"prompt", std::string("def ") + p.q + ":\n"},
                {"answer", std::string("    return ") + p.a + "\n"}}.dump() << "\n";
    c.close();
    auto r = sigma_cmd("tokenizer train --corpus " + *dir / "pairs.jsonl" + " --vocab-size 300 --out " + *dir / "tok.json");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream(*dir / "data.json") << json{
        {"tokenizer", "tok.json"}, {"corpus", {"pairs.jsonl"}},
        {"domains", {{{"name", "dialogue"}},
                     {{"name", "translation"}, {"format", "bilingual"}},
                     {{"name", "python"}, {"prefix", {"<Python>"}}}}}}.dump();
    r = sigma_cmd("prepare --config " + *dir / "data.json" + " --out " + *dir / "shards");
    ASSERT_EQ(r.code, 0) << r.out;
    std::ofstream t(*dir / "tasks.jsonl");
    for (const Pair& p : kColours)
      t << json{{"domain", "dialogue"}, {"context", question(p)},
                {"choices", {" red", " blue", " green", " yellow"}}, {"answer", 1}}.dump() << "\n";
    for (const Pair& p : kWords)
      t << json{{"domain", "translation"}, {"prompt", p.q}, {"references", {p.a}}, {"tokenize", "zh"}}.dump() << "\n";
    for (const Pair& p : kCode)
      t << json{{"domain", "python"}, {"prompt", std::string("def ") + p.q + ":\n"},
                {"tests", "assert add(2, 3) == 5" + std::string(p.q[0] == 's' ? "\ndef add(a, b): return a + b" : "")}}.dump() << "\n";
    t.close();
    r = sigma_cmd("train --quiet --set data.source=shards --set data.path=" + *dir / "shards" +
                  " --set data.finetune=true --set model.d_model=32 --set model.heads=2"
                  " --set model.layers=2 --set model.context=32 --set model.rre_layers=1"
                  " --set 'model.groups=[{\"name\":\"dialogue\",\"experts\":1},{\"name\":"
                  "\"translation\",\"experts\":1},{\"name\":\"python\",\"experts\":1}]'"
                  " --set train.batch=4 --set train.steps=4 --set train.eval_rows=2 --out " + *dir / "run");
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static void TearDownTestSuite() { delete dir; }
  static std::string ckpt() { return *dir / "run/checkpoints"; }
  static TempDir* dir;
};
TempDir* Audit::dir = nullptr;

json last_json(const CmdResult& r) { return json::parse(r.out.substr(r.out.rfind("\n{") + 1)); }

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

int argmax(const std::vector<double>& v, const std::vector<double>& div) {
  int best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] / div[i] > v[size_t(best)] / div[size_t(best)]) best = int(i);
  return best;
}

TEST_F(Audit, LogSamplesReproduceThePrintedScoresAndScoreGenerationsAgrees) {
  const std::string log = *dir / "log.jsonl";
  const auto r = run_cmd("SIGMA_PROGRESS_SECONDS=0 " + std::string(SIGMA_BINARY) + " eval --ckpt " +
                         ckpt() + " --task " + *dir / "tasks.jsonl" +
                         " --samples 2 --k 1,2 --temperature 1 --seed 5 --max-new 12"
                         " --timeout 30 --json --log-samples " + log);
  ASSERT_EQ(r.code, 0) << r.out;
  // Progress lines with an ETA (here every update; by default every 10 s off a terminal).
  for (const char* line : {"sigma eval: choices: 4/4 units (100%)", "sigma eval: generation: 7/7 answers (100%)",
                           "sigma eval: code runs: 4/4 samples (100%)", "| ETA 0m00s"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  const json printed = last_json(r);
  const auto lines = read_json_lines(log);
  ASSERT_EQ(lines.size(), 9u);
  // Recomputed from the file alone: the items ("doc") and the model's outputs.
  double acc = 0, norm = 0, bytes = 0, exact = 0, pass1 = 0, pass2 = 0;
  int nc = 0, ng = 0, nk = 0;
  std::vector<std::string> hyps;
  std::vector<std::vector<std::string>> refs;
  for (const json& l : lines) {
    const json& doc = l["doc"];
    EXPECT_FALSE(l["prompt"].get<std::string>().empty());
    if (l["type"] == "choice") {
      const auto ll = l["loglik"].get<std::vector<double>>();
      std::vector<double> ones(ll.size(), 1), chars, nbytes;
      for (const auto& c : doc["choices"]) {
        chars.push_back(double(code_points(c.get<std::string>())));
        nbytes.push_back(double(c.get<std::string>().size()));
      }
      const int answer = doc["answer"];
      acc += argmax(ll, ones) == answer, norm += argmax(ll, chars) == answer;
      bytes += argmax(ll, nbytes) == answer, ++nc;
      EXPECT_EQ(l["tokens"].size(), ll.size());
    } else if (l["type"] == "generate") {
      const std::string h = trim(l["generations"][0].get<std::string>());
      const auto rs = doc["references"].get<std::vector<std::string>>();
      exact += std::any_of(rs.begin(), rs.end(), [&](const std::string& x) { return trim(x) == h; });
      hyps.push_back(h), refs.push_back(rs), ++ng;
    } else {
      ASSERT_EQ(l["generations"].size(), 2u);
      ASSERT_EQ(l["outcomes"].size(), 2u);
      int c = 0;
      for (const json& o : l["outcomes"]) {
        c += o["outcome"] == "passed";
        EXPECT_FALSE(o["why"].get<std::string>().empty());
      }
      // The "stop" default: no completion carries on past the function.
      for (const json& g : l["generations"]) EXPECT_EQ(g.get<std::string>().find("\ndef"), std::string::npos);
      pass1 += sigma::eval::pass_at_k(2, c, 1), pass2 += sigma::eval::pass_at_k(2, c, 2), ++nk;
    }
  }
  EXPECT_EQ(printed["choice"]["acc"].get<double>(), acc / nc);
  EXPECT_EQ(printed["choice"]["acc_norm"].get<double>(), norm / nc);
  EXPECT_EQ(printed["choice"]["acc_bytes"].get<double>(), bytes / nc);
  EXPECT_EQ(printed["generate"]["exact_match"].get<double>(), exact / ng);
  const auto bleu = sigma::eval::corpus_bleu(hyps, refs, sigma::eval::BleuTokenizer::Zh);
  EXPECT_EQ(printed["generate"]["bleu"]["zh"]["score"].get<double>(), bleu.score);
  EXPECT_EQ(printed["generate"]["chrf"]["score"].get<double>(), sigma::eval::corpus_chrf(hyps, refs));
  EXPECT_EQ(printed["code"]["pass@1"].get<double>(), pass1 / nk);
  EXPECT_EQ(printed["code"]["pass@2"].get<double>(), pass2 / nk);
  EXPECT_TRUE(printed["choice"].contains("acc_stderr"));

  // Without a model (--ckpt not given): the same scores, standard errors included.
  const auto again = sigma_cmd("eval --score-generations " + log + " --k 1,2 --timeout 30 --json");
  ASSERT_EQ(again.code, 0) << again.out;
  const json rescored = last_json(again);
  for (const char* kind : {"choice", "generate", "code"}) {
    json a = printed[kind], b = rescored[kind];
    a.erase("sandbox"), b.erase("sandbox");
    EXPECT_EQ(a, b) << kind;
  }
}

// The prompt format comes from the checkpoint: with the shards gone, eval prints the same.
TEST_F(Audit, DeletingTheTrainingShardsChangesNothing) {
  ASSERT_TRUE(fs::exists(ckpt() + "/latest/data_domains.json") ||
              fs::exists(fs::path(ckpt()) / "step-00000004" / "data_domains.json"));
  const std::string cmd = "eval --ckpt " + ckpt() + " --task " + *dir / "tasks.jsonl" +
                          " --max-new 12 --timeout 30 --json --log-samples ";
  const auto before = sigma_cmd(cmd + *dir / "before.jsonl");
  ASSERT_EQ(before.code, 0) << before.out;
  EXPECT_EQ(before.out.find("warning"), std::string::npos) << before.out;
  fs::rename(*dir / "shards", *dir / "shards.moved");
  const auto after = sigma_cmd(cmd + *dir / "after.jsonl");
  fs::rename(*dir / "shards.moved", *dir / "shards");
  ASSERT_EQ(after.code, 0) << after.out;
  json x = last_json(before), y = last_json(after);
  x.erase("date"), y.erase("date");  // the one field that names when it ran
  EXPECT_EQ(x, y);
  const auto a = read_json_lines(*dir / "before.jsonl"), b = read_json_lines(*dir / "after.jsonl");
  EXPECT_EQ(a, b);
  // The format was applied: the code prompt starts with its domain's prefix control.
  EXPECT_EQ(a.back()["prompt"].get<std::string>().rfind("<Python>", 0), 0u) << a.back().dump();
}

// A prompt longer than the context less --max-new is cut at its start, keeping the domain's
// prefix control, and counted: a warning on stderr, "prompts_cut" in --json (per kind and in
// all, kept by --score-generations), and the log shows the prompt as the model saw it.
TEST_F(Audit, CutPromptsAreCountedReportedAndLoggedAsSeen) {
  std::string comment = "#";
  for (int i = 0; i < 12; ++i) comment += " zorp blick quan";
  const std::string own = "def add(a, b):\n";
  std::ofstream(*dir / "cut.jsonl")
      << json{{"domain", "python"}, {"prompt", comment + "\n" + own}, {"tests", "assert add(2, 3) == 5"}}.dump() << "\n"
      << json{{"domain", "python"}, {"prompt", own}, {"tests", "assert add(2, 3) == 5"}}.dump() << "\n";
  const std::string log = *dir / "cut-log.jsonl";
  auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + *dir / "cut.jsonl" +
                     " --max-new 8 --timeout 30 --json --log-samples " + log);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sigma eval: warning: 1 of 2 prompts were cut at their start to fit the "
                       "model's context of 32 tokens, less --max-new 8 for generated answers"),
            std::string::npos) << r.out;
  const json printed = last_json(r);
  EXPECT_EQ(printed.value("prompts_cut", -1), 1) << printed.dump();
  EXPECT_EQ(printed["code"].value("prompts_cut", -1), 1) << printed.dump();
  const auto lines = read_json_lines(log);
  ASSERT_EQ(lines.size(), 2u);
  const std::string seen = lines[0]["prompt"].get<std::string>();
  EXPECT_EQ(seen.rfind("<Python>", 0), 0u) << seen;  // the domain's control kept
  EXPECT_TRUE(seen.ends_with(own)) << seen;         // the start of the text cut, not its end
  EXPECT_LT(seen.size(), comment.size()) << seen;
  EXPECT_GT(lines[0]["prompt_cut_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(lines[1]["prompt"], "<Python>" + own);
  EXPECT_EQ(lines[1]["prompt_cut_tokens"], 0);
  r = run_cmd("SIGMA_PROGRESS_SECONDS=0 " + std::string(SIGMA_BINARY) + " eval --score-generations " +
              log + " --timeout 30 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_json(r).value("prompts_cut", -1), 1) << r.out;
  EXPECT_NE(r.out.find("sigma eval: code runs: 2/2 samples (100%)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 of 2 prompts were cut"), std::string::npos) << r.out;
}

// --json describes the run: build, date, the task file's hash and every setting that changes a
// score; --limit N scores the first N items and says so.
TEST_F(Audit, JsonResultsDescribeThemselvesAndLimitIsStated) {
  const std::string task = *dir / "tasks.jsonl";
  const auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + task + " --limit 5 --num-fewshot 1"
                           " --max-new 7 --bootstrap 10 --timeout 30 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = last_json(r);
  EXPECT_EQ(j["items"], 5) << j.dump();
  EXPECT_EQ(j["choice"]["items"], 4) << j.dump();  // the file's first 5: 4 choice, 1 generation
  EXPECT_EQ(j["generate"]["items"], 1) << j.dump();
  const json& s = j["settings"];
  EXPECT_EQ(s["limit"], 5);
  EXPECT_EQ(s["items_in_file"], 9);
  EXPECT_EQ(s["num_fewshot"], 1);
  EXPECT_EQ(s["fewshot_seed"], 1234);
  EXPECT_EQ(s["max_new"], 7);
  EXPECT_EQ(s["bootstrap"], 10);
  EXPECT_EQ(s["temperature"], 0.0);
  EXPECT_EQ(s["k"], json::array({1}));
  EXPECT_EQ(j["sigma"]["version"], "0.1.0");
  EXPECT_FALSE(j["sigma"]["git"].get<std::string>().empty());
  // `sigma --version` names the same build, on stdout, exit 0 (with or without a subcommand).
  const std::string version = fmt::format("sigma {} ({})\n", j["sigma"]["version"].get<std::string>(),
                                          j["sigma"]["git"].get<std::string>());
  for (const char* args : {"--version", "--version eval"}) {
    const auto v = sigma_cmd(args);
    EXPECT_EQ(v.code, 0) << args << ": " << v.out;
    EXPECT_EQ(v.out, version) << args;
  }
  EXPECT_TRUE(std::regex_match(j["date"].get<std::string>(),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)"))) << j["date"];
  std::ifstream in(task, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(j["task_xxh3_64"], fmt::format("{:016x}", XXH3_64bits(bytes.data(), bytes.size())));
}

// A choice's log-likelihood has the same bits whatever batch it is scored in (--score-batch 1
// included) and whatever items share its passes (tasks.cpp choice_logliks, ops::BatchInvariant),
// on a model with an RRE block, over prompts that fit, prompts cut for some choices, several
// domains and 2-4 choices.
std::vector<double> logliks_of(const std::string& log, const std::string& context) {
  for (const json& l : read_json_lines(log))
    if (l["doc"]["context"] == context) return l["loglik"].get<std::vector<double>>();
  ADD_FAILURE() << context << " not in " << log;
  return {};
}

TEST_F(Audit, ChoiceLogLikelihoodsAreBitIdenticalAtAnyBatchAndInAnyMix) {
  // A model wide and long enough for the kernels that give a row other bits in another shape
  // (oneDNN below 16 rows, the GEMVs, attention's many-row products) to matter.
  const std::string model = *dir / "run-wide";
  if (!fs::exists(model + "/checkpoints")) {
    const auto t = sigma_cmd("train --quiet --set data.source=shards --set data.path=" + *dir / "shards" +
                             " --set data.finetune=true --set model.d_model=128 --set model.heads=4"
                             " --set model.layers=3 --set model.context=96 --set model.rre_layers=1"
                             " --set 'model.groups=[{\"name\":\"dialogue\",\"experts\":2},{\"name\":"
                             "\"translation\",\"experts\":3},{\"name\":\"python\",\"experts\":1}]'"
                             " --set train.batch=2 --set train.steps=2 --set train.eval_rows=2 --out " + model);
    ASSERT_EQ(t.code, 0) << t.out;
  }
  const char* words[] = {"zorp", "blick", "quan", "mif", "red", "blue", "the", "cat", "is", "green"};
  std::vector<json> items;
  for (int i = 0; i < 24; ++i) {
    std::string context = "Q:";
    for (int w = 0; w < 1 + (i * 11) % 40; ++w)  // up to 40 words: cut at the context of 96
      context += std::string(" ") + words[(i + w * 3) % 10];
    json choices = json::array();
    for (int c = 0; c < 2 + i % 3; ++c) {
      std::string choice;
      for (int w = 0; w <= (i + c) % 4; ++w) choice += std::string(" ") + words[(i * 5 + c + w) % 10];
      choices.push_back(choice);
    }
    items.push_back(json{{"domain", i % 3 ? "dialogue" : "translation"},
                         {"context", context + " " + std::to_string(i)}, {"choices", choices}, {"answer", 0}});
  }
  auto write = [&](const std::string& name, const std::vector<size_t>& which) {
    std::ofstream f(*dir / name);
    for (size_t i : which) f << items[i].dump() << "\n";
  };
  std::vector<size_t> all(items.size()), odd, reversed;
  for (size_t i = 0; i < items.size(); ++i) all[i] = i;
  for (size_t i = 1; i < items.size(); i += 2) odd.push_back(i);
  reversed.assign(all.rbegin(), all.rend());
  write("inv-all.jsonl", all), write("inv-odd.jsonl", odd), write("inv-rev.jsonl", reversed);
  // Passes run on as many threads as OpenMP has, each pass on one thread (eval/tasks.cpp):
  // one thread and more threads than passes must give the same bits too.
  auto score = [&](const std::string& task, int batch, int threads) {
    const std::string log = *dir / (task + "-" + std::to_string(batch) + "-" + std::to_string(threads) + ".log.jsonl");
    const auto r = run_cmd("OMP_NUM_THREADS=" + std::to_string(threads) + " " + SIGMA_BINARY + " eval --ckpt " +
                           model + "/checkpoints --task " + *dir / (task + ".jsonl") +
                           " --bootstrap 0 --json --score-batch " + std::to_string(batch) +
                           " --log-samples " + log);
    EXPECT_EQ(r.code, 0) << r.out;
    return log;
  };
  const std::string reference = score("inv-all", 1, 1);
  const std::vector<std::string> others = {score("inv-all", 1, 3),  score("inv-all", 3, 2),
                                           score("inv-all", 32, 1), score("inv-all", 2, 16),
                                           score("inv-odd", 5, 2),  score("inv-rev", 7, 3)};
  for (const std::string& log : others)
    for (const json& l : read_json_lines(log)) {
      const auto want = logliks_of(reference, l["doc"]["context"]);
      const auto got = l["loglik"].get<std::vector<double>>();
      ASSERT_EQ(got.size(), want.size()) << log;
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(double)), 0)
          << log << ": " << l["doc"]["context"] << ": " << json(got) << " vs " << json(want);
    }
}

// A checkpoint from before the registry was saved with it, its shards gone: eval says the
// prompts are plain text instead of changing them silently.
TEST_F(Audit, ACheckpointWithoutItsRegistryIsWarnedAbout) {
  const fs::path old = *dir / "old-ckpt";
  fs::remove_all(old);
  fs::copy(ckpt(), old, fs::copy_options::recursive);
  std::vector<fs::path> registries;  // as written before issue 28: no file, not in the manifest
  for (const auto& e : fs::recursive_directory_iterator(old))
    if (e.path().filename() == "data_domains.json") registries.push_back(e.path());
  ASSERT_FALSE(registries.empty());
  for (const fs::path& p : registries) {
    fs::remove(p);
    std::ifstream in(p.parent_path() / "manifest.json");
    json m = json::parse(in);
    in.close();
    ASSERT_EQ(m["files"].erase("data_domains.json"), 1u);
    std::ofstream(p.parent_path() / "manifest.json") << m.dump(2);
  }
  fs::rename(*dir / "shards", *dir / "shards.away");
  const auto r = sigma_cmd("eval --ckpt " + old.string() + " --task " + *dir / "tasks.jsonl" +
                           " --max-new 4 --timeout 30 --bootstrap 0");
  fs::rename(*dir / "shards.away", *dir / "shards");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: " + old.string()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("carries no data registry (data_domains.json)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("formatted as plain text"), std::string::npos) << r.out;
}

TEST_F(Audit, SmallMistakesAreClearErrors) {
  auto r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + *dir / "tasks.jsonl --k ''");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--k: '' names no k"), std::string::npos) << r.out;
  std::string long_choice;
  for (int i = 0; i < 60; ++i) long_choice += " zorp blick";
  std::ofstream(*dir / "long.jsonl") << "\n" << json{{"domain", "dialogue"}, {"context", "Q:"},
      {"choices", {" red", long_choice}}, {"answer", 0}}.dump() << "\n";
  r = sigma_cmd("eval --ckpt " + ckpt() + " --task " + *dir / "long.jsonl");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(*dir / "long.jsonl:2: the choice"), std::string::npos) << r.out;
  r = sigma_cmd("eval --task " + *dir / "tasks.jsonl");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--ckpt is required"), std::string::npos) << r.out;
}

// Saved completions are cut at the item's stop sequences when scored: a right function
// followed by more text passes by default, and fails where the item turns the stops off.
TEST(ScoreGenerations, StopSequencesApplyToSavedCompletions) {
  TempDir d("stops");
  const json doc = {{"domain", "python"}, {"prompt", "def add(a, b):\n"}, {"tests", "assert add(2, 3) == 5"}};
  json no_stops = doc;
  no_stops["stop"] = json::array();
  const std::string completion = "    return a + b\nprint(undefined_name)\n";
  std::ofstream(d / "gen.jsonl") << json{{"doc", doc}, {"generations", {completion}}}.dump() << "\n"
                                 << json{{"doc", no_stops}, {"generations", {completion}}}.dump() << "\n";
  const auto r = sigma_cmd("eval --score-generations " + d / "gen.jsonl" + " --json --log-samples " + d / "out.jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_json(r)["code"]["pass@1"].get<double>(), 0.5) << r.out;
  const auto lines = read_json_lines(d / "out.jsonl");
  EXPECT_EQ(lines[0]["outcomes"][0]["outcome"], "passed");
  EXPECT_EQ(lines[1]["outcomes"][0]["outcome"], "failed");
  EXPECT_NE(lines[1]["outcomes"][0]["why"].get<std::string>().find("NameError"), std::string::npos);
  // A line that is not a log line names the file and line.
  std::ofstream(d / "bad.jsonl") << json{{"doc", doc}}.dump() << "\n";
  const auto bad = sigma_cmd("eval --score-generations " + d / "bad.jsonl");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find(d / "bad.jsonl:1: a code line needs \"generations\""), std::string::npos) << bad.out;
}

}  // namespace
