// The JSONL corpus reader: any file is read to the end; bad lines are counted, never fatal
// and never passed on (every record has UTF-8 text and a declared domain).
#include "data/jsonl.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sigma;
  const std::string path = fuzz::as_file(data, size);
  data::ReadOptions opt;
  opt.max_line_bytes = 256;
  opt.domains = {"en", "python"};
  data::ReadStats stats;
  fuzz::expect_clean([&] {
    data::read_source({path, "", false}, opt, stats, [&](data::Record& r) {
      if (r.domain != "en" && r.domain != "python") fuzz::finding("a record of an undeclared domain");
    });
  });
  if (stats.messages.size() > opt.max_messages) fuzz::finding("more skip messages kept than allowed");
  return 0;
}
