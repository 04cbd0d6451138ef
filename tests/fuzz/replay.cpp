// The in-ctest fuzz driver: replays every file of a seed corpus through the target, then a
// fixed number of deterministic mutations of them (bit flips, interesting bytes, cut, copy,
// insert, splice), so every CI run covers the same inputs and a failure reproduces exactly.
// Usage: fuzz_NAME CORPUS_DIR [MUTATIONS] [SEED]   (a file instead of a dir runs just it)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using Bytes = std::string;

struct Rng {  // splitmix64: fixed sequence for a seed
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n ? size_t(next() % n) : 0; }
};

Bytes slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

// Bytes that parsers treat specially: JSON structure, digits, signs, NUL, limits of integers.
constexpr char kInteresting[] = "{}[]\":,.-+eE0123456789\\ \n\t\x00\x7f\x80\xff";

Bytes mutate(const std::vector<Bytes>& corpus, Rng& r) {
  Bytes b = corpus[r.below(corpus.size())];
  const int edits = 1 + int(r.below(4));
  for (int e = 0; e < edits; ++e) {
    const size_t n = b.size(), at = r.below(n + 1);
    switch (r.below(7)) {
      case 0:  // flip a bit
        if (n) b[r.below(n)] ^= char(1u << r.below(8));
        break;
      case 1:  // an interesting byte
        if (n) b[r.below(n)] = kInteresting[r.below(sizeof kInteresting - 1)];
        break;
      case 2:  // cut a range
        b.erase(at, r.below(std::min<size_t>(n - std::min(at, n), 64) + 1));
        break;
      case 3:  // copy a range elsewhere
        if (n) {
          const size_t from = r.below(n), len = r.below(std::min<size_t>(n - from, 64) + 1);
          b.insert(r.below(b.size() + 1), b.substr(from, len));
        }
        break;
      case 4:  // insert random bytes
        for (size_t k = r.below(8) + 1; k > 0; --k) b.insert(b.begin() + long(r.below(b.size() + 1)), char(r.next()));
        break;
      case 5:  // truncate
        b.resize(r.below(n + 1));
        break;
      case 6: {  // splice with another input
        const Bytes& o = corpus[r.below(corpus.size())];
        b = b.substr(0, at) + o.substr(std::min(r.below(o.size() + 1), o.size()));
        break;
      }
    }
  }
  return b;
}

void run(const Bytes& b) { LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(b.data()), b.size()); }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR|FILE [MUTATIONS] [SEED]\n", argv[0]);
    return 2;
  }
  const std::filesystem::path src = argv[1];
  const long mutations = argc > 2 ? std::atol(argv[2]) : 2000;
  Rng rng{argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1};
  std::vector<Bytes> corpus;
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(src)) {
    for (const auto& e : std::filesystem::directory_iterator(src)) files.push_back(e.path());
  } else {
    files.push_back(src);
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) corpus.push_back(slurp(f));
  if (corpus.empty()) {
    std::fprintf(stderr, "%s: no seed inputs in %s\n", argv[0], argv[1]);
    return 2;
  }
  for (const Bytes& b : corpus) run(b);
  for (long i = 0; i < mutations; ++i) {
    const Bytes b = mutate(corpus, rng);
    if (std::getenv("SIGMA_FUZZ_SAVE")) {  // keeps the input about to run, to reproduce a crash
      std::ofstream(std::getenv("SIGMA_FUZZ_SAVE"), std::ios::binary) << b;
    }
    run(b);
  }
  std::printf("%s: %zu seeds and %ld mutations, no finding\n", argv[0], corpus.size(), mutations);
  return 0;
}
