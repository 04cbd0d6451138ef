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

// hyps[i] is scored against refs[i] (one or more references each).
BleuScore corpus_bleu(const std::vector<std::string>& hyps,
                      const std::vector<std::vector<std::string>>& refs, BleuTokenizer t);

}  // namespace sigma::eval
