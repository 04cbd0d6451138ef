// Token shards: opened (every index and token checked, checksum matched) or refused; an opened
// shard reads every sample inside its bounds.
#include <xxhash.h>

#include <cstring>
#include <vector>

#include "data/shards.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sigma;
  // Inputs of odd size get a correct body checksum written into their header first, so that
  // mutations reach the index and token checks behind it; even ones test the checksum itself.
  std::string bytes(reinterpret_cast<const char*>(data), size);
  constexpr size_t kHeader = sizeof(data::ShardHeader);
  // (The seeds predate version 3: odd ones get the current version too.)
  if (size % 2 == 1 && size >= kHeader) {
    data::ShardHeader h;
    std::memcpy(&h, bytes.data(), kHeader);
    h.version = data::kShardVersion;
    h.checksum = data::shard_checksum(h, XXH3_64bits(bytes.data() + kHeader, size - kHeader));
    std::memcpy(bytes.data(), &h, kHeader);
  }
  const std::string path = fuzz::as_file(reinterpret_cast<const uint8_t*>(bytes.data()), size);
  fuzz::expect_clean([&] {
    auto s = data::Shard::open(path, 0);
    std::vector<int32_t> buf;
    for (uint64_t i = 0; i < s->n_samples() && i < 64; ++i) {
      const uint64_t b = s->sample_begin(i), e = s->sample_end(i);
      buf.resize(e - b);
      s->read(b, e - b, buf.data());
      for (int32_t t : buf)
        if (t < 0 || uint32_t(t) >= s->header().vocab_size) fuzz::finding("token outside the vocabulary");
    }
  });
  return 0;
}
