// Corpus BLEU as sacrebleu 2.x computes it by default (4-grams, "exp" smoothing, brevity
// penalty against the closest reference length), with its "13a" and "zh" tokenisers, so that a
// score here can be compared with published sacrebleu scores. docs/evaluation.md derives the
// test cases by hand.
#pragma once
#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace sigma::eval {

enum class BleuTokenizer { V13a, Zh, None };
// "13a", "zh" or "none"; throws naming the choices.
BleuTokenizer bleu_tokenizer(const std::string& name);

// sacrebleu's Tokenizer13a: mteval-v13a punctuation splitting (period and comma split unless
// next to a digit, a dash split after a digit), HTML entities &quot; &amp; &lt; &gt; decoded.
std::string tokenize_13a(std::string_view line);
// sacrebleu's TokenizerZh: every character in its CJK ranges becomes its own token, the rest
// goes through the same punctuation rules as 13a (without the entity decoding).
std::string tokenize_zh(std::string_view line);
std::string bleu_tokenize(std::string_view line, BleuTokenizer t);

struct BleuScore {
  double score = 0;                  // 0..100
  std::array<double, 4> precisions{};  // percent, after smoothing
  std::array<int64_t, 4> correct{}, total{};
  int64_t sys_len = 0, ref_len = 0;
  double bp = 0;
};

// hyps[i] is scored against refs[i] (one or more references each). Like sacrebleu, each
// segment is right-stripped (Python whitespace) before tokenising, so a reference ending in
// "-\n" keeps its dash.
BleuScore corpus_bleu(const std::vector<std::string>& hyps,
                      const std::vector<std::vector<std::string>>& refs, BleuTokenizer t);

// The sufficient statistics of one segment (summed over a corpus, or over a bootstrap
// resample of it) and the score from summed statistics.
struct BleuStats {
  std::array<int64_t, 4> correct{}, total{};
  int64_t sys_len = 0, ref_len = 0;
  BleuStats& operator+=(const BleuStats& o);
};
BleuStats bleu_segment(const std::string& hyp, const std::vector<std::string>& refs, BleuTokenizer t);
BleuScore bleu_from_stats(const BleuStats& s);

// chrF as sacrebleu 2.x's CHRF() computes it by default: character n-grams of orders 1-6 over
// the text with whitespace removed, beta = 2, precision and recall averaged over the orders
// present ("effective order"), statistics summed over the corpus; with several references a
// segment takes the statistics of the one with the best segment score.
struct ChrfStats {
  std::array<int64_t, 18> v{};  // per order: hypothesis n-grams, reference n-grams, matches
  ChrfStats& operator+=(const ChrfStats& o);
};
ChrfStats chrf_segment(const std::string& hyp, const std::vector<std::string>& refs);
double chrf_from_stats(const ChrfStats& s);  // 0..100
double corpus_chrf(const std::vector<std::string>& hyps, const std::vector<std::vector<std::string>>& refs);

// sacrebleu's signature strings for these settings ("nrefs:1|case:mixed|eff:no|tok:13a|
// smooth:exp|version:2.6.0"); nrefs is "var" when segments differ in their count.
std::string bleu_signature(const std::vector<std::vector<std::string>>& refs, BleuTokenizer t);
std::string chrf_signature(const std::vector<std::vector<std::string>>& refs);

}  // namespace sigma::eval
