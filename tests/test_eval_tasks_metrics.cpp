// The task metrics against values computed by hand (docs/evaluation.md shows the working):
// corpus BLEU and sacrebleu's tokenisers, pass@k, acc / acc_norm / acc_bytes, and the task
// file reader's one-line errors.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "cli_util.h"
#include "eval/bleu.h"
#include "eval/pass_at_k.h"
#include "eval/tasks.h"

using namespace sigma;
using namespace sigma::eval;

namespace {

TEST(Bleu13a, SplitsPunctuationLikeMteval) {
  EXPECT_EQ(tokenize_13a("I'm a student."), "I'm a student .");
  // Period and comma stay inside numbers; a dash after a digit is split off.
  EXPECT_EQ(tokenize_13a("3.14, 1,000 and 5-4."), "3.14 , 1,000 and 5 - 4 .");
  EXPECT_EQ(tokenize_13a("a &amp; b &lt;c&gt; (x)!"), "a & b < c > ( x ) !");
  EXPECT_EQ(tokenize_13a("  many   spaces\there  "), "many spaces here");
  EXPECT_EQ(tokenize_13a("It wasn't surprising."), "It wasn't surprising .");
}

TEST(BleuZh, SplitsEveryChineseCharacter) {
  EXPECT_EQ(tokenize_zh("我爱北京。Hello, world!"), "我 爱 北 京 。 Hello , world !");
  // sacrebleu's range table (read as Python reads it) counts U+2001..U+2A6D as Chinese, so an
  // em dash between words is split off, which 13a would not do.
  EXPECT_EQ(tokenize_zh("a\u2014b"), "a \u2014 b");
  EXPECT_EQ(tokenize_13a("a\u2014b"), "a\u2014b");
  EXPECT_EQ(tokenize_zh("全角ＡＢ"), "全 角 Ａ Ｂ");  // U+FF00..U+FFEF are in the table
}

// Equal lengths (BP = 1) except where said; precisions p_n = matches / hypothesis n-grams.
TEST(CorpusBleu, BrevityPenaltyByHand) {
  // hyp "the cat sat on the mat" (6 tokens), ref "the cat sat on the red mat" (7):
  // p1 = 6/6, p2 = 4/5, p3 = 3/4, p4 = 2/3; BP = exp(1 - 7/6).
  const BleuScore b = corpus_bleu({"the cat sat on the mat"}, {{"the cat sat on the red mat"}},
                                  BleuTokenizer::V13a);
  EXPECT_EQ(b.sys_len, 6);
  EXPECT_EQ(b.ref_len, 7);
  EXPECT_NEAR(b.bp, std::exp(-1.0 / 6.0), 1e-12);
  EXPECT_EQ(b.correct, (std::array<int64_t, 4>{6, 4, 3, 2}));
  EXPECT_EQ(b.total, (std::array<int64_t, 4>{6, 5, 4, 3}));
  EXPECT_NEAR(b.score, 100 * std::exp(-1.0 / 6.0) * std::pow(1.0 * 0.8 * 0.75 * (2.0 / 3.0), 0.25), 1e-9);
}

TEST(CorpusBleu, ZeroMatchesOfAnOrderAreSmoothedExponentially) {
  // hyp "a b x y", ref "a b y x": p1 = 4/4, p2 = 1/3; no 3- or 4-gram matches, so sacrebleu's
  // "exp" smoothing gives p3 = 100 / (2 * 2 trigrams) = 25 and p4 = 100 / (4 * 1) = 25.
  const BleuScore b = corpus_bleu({"a b x y"}, {{"a b y x"}}, BleuTokenizer::V13a);
  EXPECT_EQ(b.correct, (std::array<int64_t, 4>{4, 1, 0, 0}));
  EXPECT_NEAR(b.precisions[2], 25.0, 1e-12);
  EXPECT_NEAR(b.precisions[3], 25.0, 1e-12);
  EXPECT_NEAR(b.score, 100 * std::pow(1.0 * (1.0 / 3) * 0.25 * 0.25, 0.25), 1e-9);
  // No match of any order: 0, and a hypothesis without 4-grams scores 0 even when it is exact
  // (sacrebleu's corpus BLEU takes log 0 there; sentence scores need effective order).
  EXPECT_EQ(corpus_bleu({"x y"}, {{"a b"}}, BleuTokenizer::V13a).score, 0.0);
  EXPECT_EQ(corpus_bleu({"a b c"}, {{"a b c"}}, BleuTokenizer::V13a).score, 0.0);
  EXPECT_EQ(corpus_bleu({""}, {{"a b c"}}, BleuTokenizer::V13a).bp, 0.0);
}

TEST(CorpusBleu, ClosestReferenceLengthPrefersTheShorterOnATie) {
  // hyp of 5 tokens; references of 4 and 6 are equally close: ref_len = 4, so BP = 1.
  const BleuScore b = corpus_bleu({"a b c d e"}, {{"a b c d", "a b c d e f"}}, BleuTokenizer::V13a);
  EXPECT_EQ(b.ref_len, 4);
  EXPECT_EQ(b.bp, 1.0);
  // Clipping takes the most of an n-gram in any one reference: "a a a a" against "a a" and "a".
  const BleuScore c = corpus_bleu({"a a a a"}, {{"a a", "a"}}, BleuTokenizer::V13a);
  EXPECT_EQ(c.correct[0], 2);
  EXPECT_EQ(c.correct[1], 1);
}

// sacrebleu's README example: "BLEU = 48.53 82.4/50.0/45.5/37.5 (BP = 0.943 ratio = 0.944
// hyp_len = 17 ref_len = 18)"; docs/evaluation.md counts every n-gram by hand.
TEST(CorpusBleu, SacrebleuReadmeExample) {
  const std::vector<std::string> sys = {"The dog bit the man.", "It wasn't surprising.",
                                        "The man had just bitten him."};
  const std::vector<std::vector<std::string>> refs = {
      {"The dog bit the man.", "The dog had bit the man."},
      {"It was not unexpected.", "No one was surprised."},
      {"The man bit him first.", "The man had bitten the dog."}};
  const BleuScore b = corpus_bleu(sys, refs, BleuTokenizer::V13a);
  EXPECT_EQ(b.sys_len, 17);
  EXPECT_EQ(b.ref_len, 18);
  EXPECT_EQ(b.correct, (std::array<int64_t, 4>{14, 7, 5, 3}));
  EXPECT_EQ(b.total, (std::array<int64_t, 4>{17, 14, 11, 8}));
  EXPECT_EQ(std::round(b.score * 100) / 100, 48.53);
  EXPECT_NEAR(b.bp, 0.943, 5e-4);
}

TEST(CorpusBleu, ChineseWithTheZhTokeniser) {
  // Characters are the words: hyp 我 爱 北 京 (4) vs ref 我 爱 上 海 (4): p1 = 2/4, p2 = 1/3,
  // p3 = 100 / (2 * 2), p4 = 100 / (4 * 1).
  const BleuScore b = corpus_bleu({"我爱北京"}, {{"我爱上海"}}, BleuTokenizer::Zh);
  EXPECT_EQ(b.correct, (std::array<int64_t, 4>{2, 1, 0, 0}));
  EXPECT_NEAR(b.score, 100 * std::pow(0.5 * (1.0 / 3) * 0.25 * 0.25, 0.25), 1e-9);
  // Under 13a the whole line is one word, and nothing matches.
  EXPECT_EQ(corpus_bleu({"我爱北京"}, {{"我爱上海"}}, BleuTokenizer::V13a).score, 0.0);
}

TEST(PassAtK, UnbiasedEstimatorByHand) {
  // n = 5 samples, c = 2 correct: 1 - C(3,k)/C(5,k).
  EXPECT_NEAR(pass_at_k(5, 2, 1), 1.0 - 3.0 / 5.0, 1e-15);   // 0.4
  EXPECT_NEAR(pass_at_k(5, 2, 2), 1.0 - 3.0 / 10.0, 1e-15);  // 0.7
  EXPECT_EQ(pass_at_k(5, 2, 5), 1.0);                        // C(3,5) = 0
  EXPECT_EQ(pass_at_k(5, 0, 3), 0.0);
  EXPECT_EQ(pass_at_k(5, 5, 1), 1.0);
  // Against the binomial formula for every (n, c, k) up to 12.
  auto choose = [](int n, int k) {
    double r = 1;
    for (int i = 1; i <= k; ++i) r = r * (n - k + i) / i;
    return k > n ? 0.0 : r;
  };
  for (int n = 1; n <= 12; ++n)
    for (int c = 0; c <= n; ++c)
      for (int k = 1; k <= n; ++k)
        EXPECT_NEAR(pass_at_k(n, c, k), 1.0 - choose(n - c, k) / choose(n, k), 1e-12) << n << c << k;
  EXPECT_THROW(pass_at_k(5, 2, 6), Error);
}

TEST(Choice, AccAndAccNormDisagreeOnPurpose) {
  // "a" (1 character) at log-likelihood -2 beats "bbbbbb" (6 characters) at -3 by total, but
  // per character -3/6 = -0.5 beats -2/1.
  const std::vector<double> ll = {-2.0, -3.0};
  EXPECT_EQ(best_choice(ll, {1, 1}), 0);
  EXPECT_EQ(best_choice(ll, {double(utf8_chars("a")), double(utf8_chars("bbbbbb"))}), 1);
}

TEST(Choice, AccBytesCountsChineseCharactersAsThreeBytes) {
  // "猫" (1 character, 3 bytes) at -3 vs "cat" (3 characters, 3 bytes) at -4.
  EXPECT_EQ(utf8_chars("猫"), 1u);
  const std::vector<double> ll = {-3.0, -4.0};
  EXPECT_EQ(best_choice(ll, {1, 1}), 0);                              // acc: 猫
  EXPECT_EQ(best_choice(ll, {1, 3}), 1);                              // acc_norm: -4/3 > -3
  EXPECT_EQ(best_choice(ll, {double(std::string("猫").size()), 3}), 0);  // acc_bytes: -1 > -4/3
  EXPECT_EQ(best_choice({-1.0, -1.0}, {1, 1}), 0);  // ties go to the first
}

// Each bad file stops with one line naming the file and the line.
TEST(TaskFile, BadLinesAreOneLineErrorsNamingFileAndLine) {
  sigma::testing::TempDir dir("tasks");
  const std::string ok = R"({"type":"choice","domain":"qa","context":"c","choices":["x","y"],"answer":1})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"type":"choice","domain":"qa","context":"c","answer":0})", "missing \"choices\""},
      {R"({"type":"choice","domain":"nope","context":"c","choices":["x"],"answer":0})", "unknown domain 'nope'"},
      {R"({"type":"choice","domain":"qa","context":"c","choices":[],"answer":0})", "non-empty array"},
      {R"({"type":"choice","domain":"qa","context":"c","choices":["x",""],"answer":0})", "a choice is empty"},
      {R"({"type":"choice","domain":"qa","context":"c","choices":["x"],"answer":3})", "\"answer\""},
      {"{\"type\":\"generate\",\"domain\":\"qa\",\"prompt\":\"\xff\",\"references\":[\"a\"]}", "invalid UTF-8"},
      {R"({"type":"generate","domain":"qa","prompt":"p"})", "missing \"references\""},
      {R"({"type":"code","domain":"qa","prompt":"p","tests":1})", "\"tests\" must be a string"},
      {R"({"type":"essay","domain":"qa"})", "\"type\" must be"},
      {R"({"type":"choice","domain":"qa","context":"c","choices":["x"],"answer":0,"extra":1})", "unknown key \"extra\""},
      {"not json", "not a JSON object"}};
  for (const auto& [line, why] : cases) {
    const std::string path = dir / "t.jsonl";
    std::ofstream(path) << ok << "\n\n" << line << "\n";
    try {
      read_task_file(path, {"qa"});
      ADD_FAILURE() << "accepted: " << line;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(path + ":3: ", 0), 0u) << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  std::ofstream(dir / "empty.jsonl") << "\n";
  EXPECT_THROW(read_task_file(dir / "empty.jsonl", {"qa"}), Error);
  EXPECT_THROW(read_task_file(dir / "missing.jsonl", {"qa"}), Error);
  std::ofstream(dir / "good.jsonl") << ok << "\n";
  const auto items = read_task_file(dir / "good.jsonl", {"qa"});
  ASSERT_EQ(items.size(), 1u);
  EXPECT_EQ(items[0].answer, 1);
  EXPECT_EQ(items[0].line, 1u);
}

}  // namespace

namespace {

// sacrebleu right-strips a segment before tokenising, so 13a's "-\n" join never sees a final
// newline: "h-\n" keeps its dash. hyp "a b c d e f g h" against ref "a b c d e f g h-\n": the
// last token differs ("h" against "h-"): 7/8, 6/7, 5/6, 4/5, BLEU = (4/8)^(1/4) = 84.09.
// Joining first (the old behaviour) made the reference "... h" and scored 100.
TEST(CorpusBleu, AReferenceEndingInDashNewlineKeepsItsDash) {
  const BleuScore b = corpus_bleu({"a b c d e f g h"}, {{"a b c d e f g h-\n"}}, BleuTokenizer::V13a);
  EXPECT_NEAR(b.score, 100 * std::pow(0.5, 0.25), 1e-9);
  EXPECT_EQ(b.correct[0], 7);
  // Inside a line the join still applies: "sta-\ntion" is "station".
  EXPECT_EQ(tokenize_13a("sta-\ntion"), "station");
}

// chrF (sacrebleu CHRF defaults) by hand. "abc" against "abd": order 1 2/3 (a, b), order 2 1/2
// (ab), order 3 0/1, orders 4-6 have no n-grams and do not count (effective order 3):
// precision = recall = (2/3 + 1/2 + 0) / 3 = 7/18, F2 = 7/18 = 38.89.
TEST(Chrf, ByHand) {
  EXPECT_NEAR(corpus_chrf({"abc"}, {{"abd"}}), 100.0 * 7 / 18, 1e-9);
  EXPECT_NEAR(corpus_chrf({"a bc"}, {{"ab d"}}), 100.0 * 7 / 18, 1e-9);  // whitespace removed
  EXPECT_NEAR(corpus_chrf({"ab"}, {{"ab"}}), 100.0, 1e-9);
  EXPECT_EQ(corpus_chrf({"xyz"}, {{"abc"}}), 0.0);
  // Several references: the segment takes the best one.
  EXPECT_NEAR(corpus_chrf({"abc"}, {{"xyz", "abd"}}), 100.0 * 7 / 18, 1e-9);
  // Recall weighs 4x (beta = 2): hyp "ab", ref "abcd": order 1 p = 1, r = 1/2; order 2 p = 1,
  // r = 1/3; averaged p = 1, r = 5/12; F2 = 5 * p * r / (4p + r) = (25/12) / (53/12) = 25/53.
  EXPECT_NEAR(corpus_chrf({"ab"}, {{"abcd"}}), 100.0 * 25 / 53, 1e-9);
}

TEST(Signatures, NameTheSacrebleuSettings) {
  EXPECT_EQ(bleu_signature({{"a"}, {"b"}}, BleuTokenizer::V13a),
            "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0");
  EXPECT_EQ(bleu_signature({{"a"}, {"b", "c"}}, BleuTokenizer::Zh),
            "nrefs:var|case:mixed|eff:no|tok:zh|smooth:exp|version:2.6.0");
  EXPECT_EQ(chrf_signature({{"a", "b"}}), "nrefs:2|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0");
}

TEST(StopSequences, CutBeforeTheFirstAndDefaultForCode) {
  EXPECT_EQ(cut_at_stop("    return a + b\n\ndef junk():\n", kCodeStops), "    return a + b\n");
  EXPECT_EQ(cut_at_stop("    return 1\nprint(2)\n#x", kCodeStops), "    return 1");
  EXPECT_EQ(cut_at_stop("abc", {}), "abc");
  EXPECT_EQ(cut_at_stop("a STOP b END", {"END", "STOP"}), "a ");
  const nlohmann::json code = {{"domain", "python"}, {"prompt", "def f():\n"}, {"tests", "assert f()"}};
  EXPECT_EQ(parse_task_item(code, "t.jsonl", 1, {}).stop, kCodeStops);
  nlohmann::json own = code;
  own["stop"] = nlohmann::json::array({"\nEND"});
  EXPECT_EQ(parse_task_item(own, "t.jsonl", 1, {}).stop, std::vector<std::string>{"\nEND"});
  own["stop"] = nlohmann::json::array();  // [] turns the default off
  EXPECT_TRUE(parse_task_item(own, "t.jsonl", 1, {}).stop.empty());
  own["stop"] = "x";
  EXPECT_THROW(parse_task_item(own, "t.jsonl", 1, {}), std::exception);
}

}  // namespace

namespace {

TEST(FewShot, SeededShotsFromTheSameKindAndDomainNeverTheItemItself) {
  std::vector<TaskItem> items;
  for (int i = 0; i < 4; ++i) {
    TaskItem it;
    it.kind = TaskKind::Choice;
    it.domain = "english";
    it.source = "t.jsonl";
    it.line = uint64_t(i + 1);
    it.context = "Q" + std::to_string(i) + ":";
    it.choices = {" yes", " no"};
    it.answer = i % 2;
    items.push_back(it);
  }
  items[3].domain = "chinese";  // alone in its domain: no shot for it
  const auto three = std::vector<TaskItem>(items.begin(), items.begin() + 3);
  const auto a = with_fewshot(three, 2, 7), b = with_fewshot(three, 2, 7);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].context, b[i].context);  // seeded
    const std::string own = three[i].context;
    ASSERT_TRUE(a[i].context.ends_with("\n\n" + own)) << a[i].context;
    EXPECT_EQ(a[i].context.find(own), a[i].context.size() - own.size()) << "the item is its own shot";
    // Both other items, each followed by its right answer.
    for (size_t j = 0; j < three.size(); ++j) {
      if (j == i) continue;
      EXPECT_NE(a[i].context.find(three[j].context + three[j].choices[size_t(three[j].answer)] + "\n\n"),
                std::string::npos) << a[i].context;
    }
  }
  EXPECT_EQ(with_fewshot(three, 0, 7)[0].context, "Q0:");
  try {
    with_fewshot(items, 1, 7);
    ADD_FAILURE() << "no shot for the chinese item";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("t.jsonl:4: --num-fewshot 1: only 0 other choice items"), std::string::npos) << e.what();
  }
}

}  // namespace
