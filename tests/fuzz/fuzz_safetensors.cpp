// safetensors files: read fully or refused; what is read matches its index.
#include "fuzz.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sigma;
  const std::string path = fuzz::as_file(data, size);
  fuzz::expect_clean([&] {
    Safetensors st = read_safetensors(path);
    for (const auto& [name, t] : st.tensors) {
      const auto it = st.index.find(name);
      if (it == st.index.end() || it->second.shape != t.shape() || it->second.dtype != t.dtype())
        fuzz::finding("a tensor read differs from its index entry");
      if (t.nbytes() > size) fuzz::finding("a tensor larger than the file");
      check_finite(t, name, path);
    }
  });
  return 0;
}
