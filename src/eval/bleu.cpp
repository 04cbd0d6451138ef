#include "eval/bleu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>

#include "core/error.h"
#include "data/tokenizer.h"

namespace sigma::eval {

namespace {

// One code point at s[i] and its length; an invalid byte stands for itself (length 1).
uint32_t next_cp(std::string_view s, size_t i, size_t& len) {
  uint32_t cp = 0;
  len = data::utf8_next(s, i, cp);
  if (len == 0) {
    len = 1;
    return 0xFFFFFFFFu;  // matches no class below
  }
  return cp;
}

// Python's str.isspace(), which str.split() and str.strip() use.
bool py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

// sacrebleu's _UCODE_RANGES. Two entries there are written '\u20000'..'\u2a6d6' and
// '\u2f800'..'\u2fa1d': Python reads each as a 4-digit escape plus a character, and string
// comparison then makes them U+2001..U+2A6D and U+2F81..U+2FA1 (general punctuation, arrows,
// symbols...). We reproduce what sacrebleu does, not what its comment meant.
bool zh_char(uint32_t c) {
  static constexpr uint32_t ranges[][2] = {
      {0x3400, 0x4DB5}, {0x4E00, 0x9FA5}, {0x9FA6, 0x9FBB}, {0xF900, 0xFA2D}, {0xFA30, 0xFA6A},
      {0xFA70, 0xFAD9}, {0x2001, 0x2A6D}, {0x2F81, 0x2FA1}, {0xFF00, 0xFFEF}, {0x2E80, 0x2EFF},
      {0x3000, 0x303F}, {0x31C0, 0x31EF}, {0x2F00, 0x2FDF}, {0x2FF0, 0x2FFF}, {0x3100, 0x312F},
      {0x31A0, 0x31BF}, {0xFE10, 0xFE1F}, {0xFE30, 0xFE4F}, {0x2600, 0x26FF}, {0x2700, 0x27BF},
      {0x3200, 0x32FF}, {0x3300, 0x33FF}};
  for (const auto& r : ranges)
    if (c >= r[0] && c <= r[1]) return true;
  return false;
}

// The tokens of `s` split at Python whitespace.
std::vector<std::string_view> py_split(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = std::string_view::npos;
  for (size_t i = 0, len = 0; i < s.size(); i += len) {
    const bool space = py_space(next_cp(s, i, len));
    if (space && start != std::string_view::npos) {
      out.push_back(s.substr(start, i - start));
      start = std::string_view::npos;
    } else if (!space && start == std::string_view::npos) {
      start = i;
    }
  }
  if (start != std::string_view::npos) out.push_back(s.substr(start));
  return out;
}

bool digit(char c) { return c >= '0' && c <= '9'; }
bool period_comma(char c) { return c == '.' || c == ','; }
// [{-~[-` -&(-+:-@/]: the punctuation mteval splits off everywhere.
bool split_always(char c) {
  const auto u = static_cast<unsigned char>(c);
  return (u >= 0x7B && u <= 0x7E) || (u >= 0x5B && u <= 0x60) || (u >= 0x20 && u <= 0x26) ||
         (u >= 0x28 && u <= 0x2B) || (u >= 0x3A && u <= 0x40) || u == '/';
}

// One left-to-right pass of a two-character rule `(A)(B)` -> rewrite, as Python's re.sub
// applies it: non-overlapping matches, scanning on after each match. The classes involved are
// ASCII or "anything but a digit", so working on bytes gives the same result as on code points.
template <class First, class Second, class Emit>
std::string pair_pass(const std::string& s, First first, Second second, Emit emit) {
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  for (size_t i = 0; i < s.size();) {
    if (i + 1 < s.size() && first(s[i]) && second(s[i + 1])) {
      emit(out, s[i], s[i + 1]);
      i += 2;
    } else {
      out += s[i++];
    }
  }
  return out;
}

// sacrebleu's TokenizerRegexp: the four rules, then single spaces between tokens.
std::string regexp_tokenize(const std::string& line) {
  std::string s;
  for (char c : line) {
    if (split_always(c)) (s += ' ') += c, s += ' ';
    else s += c;
  }
  auto not_digit = [](char c) { return !digit(c); };
  s = pair_pass(s, not_digit, period_comma,
                [](std::string& o, char a, char b) { o += a, o += ' ', o += b, o += ' '; });
  s = pair_pass(s, period_comma, not_digit,
                [](std::string& o, char a, char b) { o += ' ', o += a, o += ' ', o += b; });
  s = pair_pass(s, digit, [](char c) { return c == '-'; },
                [](std::string& o, char a, char b) { o += a, o += ' ', o += b, o += ' '; });
  std::string out;
  for (std::string_view t : py_split(s)) {
    if (!out.empty()) out += ' ';
    out += t;
  }
  return out;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size()))
    s.replace(p, from.size(), to);
}

using Ngrams = std::map<std::vector<std::string_view>, int64_t>;

Ngrams ngrams(const std::vector<std::string_view>& w) {
  Ngrams out;
  for (size_t n = 1; n <= 4; ++n)
    for (size_t i = 0; i + n <= w.size(); ++i)
      ++out[std::vector<std::string_view>(w.begin() + i, w.begin() + i + n)];
  return out;
}

}  // namespace

BleuTokenizer bleu_tokenizer(const std::string& name) {
  if (name == "13a") return BleuTokenizer::V13a;
  if (name == "zh") return BleuTokenizer::Zh;
  if (name == "none") return BleuTokenizer::None;
  fail("unknown BLEU tokeniser '{}' (choose 13a, zh or none)", name);
}

std::string tokenize_13a(std::string_view line) {
  std::string s(line);
  replace_all(s, "<skipped>", "");
  replace_all(s, "-\n", "");
  replace_all(s, "\n", " ");
  replace_all(s, "&quot;", "\"");
  replace_all(s, "&amp;", "&");
  replace_all(s, "&lt;", "<");
  replace_all(s, "&gt;", ">");
  return regexp_tokenize(" " + s + " ");
}

std::string tokenize_zh(std::string_view line) {
  std::string s;
  for (size_t i = 0, len = 0; i < line.size(); i += len) {
    const bool zh = zh_char(next_cp(line, i, len));
    if (zh) s += ' ';
    s.append(line.substr(i, len));
    if (zh) s += ' ';
  }
  return regexp_tokenize(s);  // the strip() before is subsumed by the final split
}

std::string bleu_tokenize(std::string_view line, BleuTokenizer t) {
  switch (t) {
    case BleuTokenizer::V13a: return tokenize_13a(line);
    case BleuTokenizer::Zh: return tokenize_zh(line);
    case BleuTokenizer::None: break;
  }
  return std::string(line);
}

namespace {

// Python's str.rstrip(): sacrebleu strips each segment before tokenising.
std::string_view rstrip_py(std::string_view s) {
  size_t end = 0;
  for (size_t i = 0, len = 0; i < s.size(); i += len)
    if (!py_space(next_cp(s, i, len))) end = i + len;
  return s.substr(0, end);
}

}  // namespace

BleuStats& BleuStats::operator+=(const BleuStats& o) {
  for (size_t n = 0; n < 4; ++n) correct[n] += o.correct[n], total[n] += o.total[n];
  sys_len += o.sys_len, ref_len += o.ref_len;
  return *this;
}

BleuStats bleu_segment(const std::string& hyp, const std::vector<std::string>& refs, BleuTokenizer t) {
  SIGMA_CHECK(!refs.empty(), "BLEU: a hypothesis has no reference");
  BleuStats b;
  const std::string h = bleu_tokenize(rstrip_py(hyp), t);
  const auto hw = py_split(h);
  Ngrams best;  // the most times each n-gram occurs in any one reference (clipping)
  int64_t closest = -1;
  std::vector<std::string> toks(refs.size());
  for (size_t r = 0; r < refs.size(); ++r) {
    toks[r] = bleu_tokenize(rstrip_py(refs[r]), t);
    const auto rw = py_split(toks[r]);
    const int64_t len = int64_t(rw.size()), diff = std::llabs(len - int64_t(hw.size()));
    const int64_t cdiff = std::llabs(closest - int64_t(hw.size()));
    if (closest < 0 || diff < cdiff || (diff == cdiff && len < closest)) closest = len;
    for (const auto& [g, c] : ngrams(rw)) best[g] = std::max(best[g], c);
  }
  b.sys_len = int64_t(hw.size());
  b.ref_len = closest;
  for (const auto& [g, c] : ngrams(hw)) {
    const size_t n = g.size() - 1;
    b.total[n] += c;
    auto it = best.find(g);
    if (it != best.end()) b.correct[n] += std::min(c, it->second);
  }
  return b;
}

// sacrebleu BLEU.compute_bleu with smooth_method="exp", effective_order=False.
BleuScore bleu_from_stats(const BleuStats& s) {
  BleuScore b;
  b.correct = s.correct, b.total = s.total, b.sys_len = s.sys_len, b.ref_len = s.ref_len;
  b.bp = b.sys_len < b.ref_len
             ? (b.sys_len > 0 ? std::exp(1.0 - double(b.ref_len) / double(b.sys_len)) : 0.0)
             : 1.0;
  if (std::all_of(b.correct.begin(), b.correct.end(), [](int64_t c) { return c == 0; })) return b;
  double smooth = 1, log_sum = 0;
  for (size_t n = 0; n < 4; ++n) {
    if (b.total[n] == 0) break;  // precision stays 0: sacrebleu's log(0) = -9999999999
    if (b.correct[n] == 0) {
      smooth *= 2;
      b.precisions[n] = 100.0 / (smooth * double(b.total[n]));
    } else {
      b.precisions[n] = 100.0 * double(b.correct[n]) / double(b.total[n]);
    }
  }
  for (double p : b.precisions) log_sum += p > 0 ? std::log(p) : -9999999999.0;
  b.score = b.bp * std::exp(log_sum / 4.0);
  return b;
}

BleuScore corpus_bleu(const std::vector<std::string>& hyps,
                      const std::vector<std::vector<std::string>>& refs, BleuTokenizer t) {
  SIGMA_CHECK(hyps.size() == refs.size(), "BLEU: {} hypotheses but {} reference sets",
              hyps.size(), refs.size());
  BleuStats sum;
  for (size_t i = 0; i < hyps.size(); ++i) sum += bleu_segment(hyps[i], refs[i], t);
  return bleu_from_stats(sum);
}

namespace {

constexpr int kChrOrder = 6;
constexpr double kChrBeta = 2;

// Code points of `s` with Python whitespace removed (sacrebleu: ''.join(s.split())).
std::vector<uint32_t> chrf_chars(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0, len = 0; i < s.size(); i += len) {
    const uint32_t c = next_cp(s, i, len);
    if (!py_space(c)) out.push_back(c == 0xFFFFFFFFu ? 0xFFFFFF00u + uint8_t(s[i]) : c);
  }
  return out;
}

std::map<std::vector<uint32_t>, int64_t> char_ngrams(const std::vector<uint32_t>& c, int n) {
  std::map<std::vector<uint32_t>, int64_t> out;
  for (size_t i = 0; i + size_t(n) <= c.size(); ++i) ++out[std::vector<uint32_t>(c.begin() + i, c.begin() + i + n)];
  return out;
}

ChrfStats chrf_pair(const std::vector<uint32_t>& h, const std::vector<uint32_t>& r) {
  ChrfStats s;
  for (int n = 1; n <= kChrOrder; ++n) {
    const auto hg = char_ngrams(h, n), rg = char_ngrams(r, n);
    int64_t nh = 0, nr = 0, m = 0;
    for (const auto& [g, c] : hg) {
      nh += c;
      if (auto it = rg.find(g); it != rg.end()) m += std::min(c, it->second);
    }
    for (const auto& [g, c] : rg) nr += c;
    s.v[size_t(3 * (n - 1))] = nh, s.v[size_t(3 * (n - 1) + 1)] = nr, s.v[size_t(3 * (n - 1) + 2)] = m;
  }
  return s;
}

}  // namespace

ChrfStats& ChrfStats::operator+=(const ChrfStats& o) {
  for (size_t i = 0; i < v.size(); ++i) v[i] += o.v[i];
  return *this;
}

double chrf_from_stats(const ChrfStats& s) {
  double prec = 0, rec = 0;
  int effective = 0;
  for (size_t n = 0; n < size_t(kChrOrder); ++n) {
    const int64_t nh = s.v[3 * n], nr = s.v[3 * n + 1], m = s.v[3 * n + 2];
    if (nh > 0 && nr > 0) {
      prec += double(m) / double(nh);
      rec += double(m) / double(nr);
      ++effective;
    }
  }
  if (effective == 0) return 0;
  prec /= effective, rec /= effective;
  if (prec + rec == 0) return 0;
  const double f = kChrBeta * kChrBeta;
  return 100 * (1 + f) * prec * rec / (f * prec + rec);
}

ChrfStats chrf_segment(const std::string& hyp, const std::vector<std::string>& refs) {
  SIGMA_CHECK(!refs.empty(), "chrF: a hypothesis has no reference");
  const auto h = chrf_chars(hyp);
  ChrfStats best;
  double best_f = -1;
  for (const std::string& r : refs) {
    const ChrfStats s = chrf_pair(h, chrf_chars(r));
    const double f = chrf_from_stats(s);
    if (f > best_f) best = s, best_f = f;
  }
  return best;
}

double corpus_chrf(const std::vector<std::string>& hyps, const std::vector<std::vector<std::string>>& refs) {
  SIGMA_CHECK(hyps.size() == refs.size(), "chrF: {} hypotheses but {} reference sets", hyps.size(), refs.size());
  ChrfStats sum;
  for (size_t i = 0; i < hyps.size(); ++i) sum += chrf_segment(hyps[i], refs[i]);
  return chrf_from_stats(sum);
}

namespace {
std::string nrefs(const std::vector<std::vector<std::string>>& refs) {
  for (const auto& r : refs)
    if (r.size() != refs.front().size()) return "var";
  return refs.empty() ? "0" : std::to_string(refs.front().size());
}
}  // namespace

std::string bleu_signature(const std::vector<std::vector<std::string>>& refs, BleuTokenizer t) {
  const char* tok = t == BleuTokenizer::V13a ? "13a" : t == BleuTokenizer::Zh ? "zh" : "none";
  return fmt::format("nrefs:{}|case:mixed|eff:no|tok:{}|smooth:exp|version:2.6.0", nrefs(refs), tok);
}

std::string chrf_signature(const std::vector<std::vector<std::string>>& refs) {
  return fmt::format("nrefs:{}|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0", nrefs(refs));
}

}  // namespace sigma::eval
