// Checkpoint manifests: parsed and verified against the directory, or refused.
#include <filesystem>
#include <fstream>

#include "fuzz.h"
#include "io/checkpoint_dir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sigma;
  static const std::string dir = [] {
    const std::string d = fuzz::scratch_dir() + "/ckpt";
    std::filesystem::create_directories(d);
    std::ofstream(d + "/model.safetensors") << "0123456789";  // a file entries may name
    return d;
  }();
  {
    std::ofstream out(dir + "/manifest.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  fuzz::expect_clean([&] {
    read_manifest(dir);
    verify_checkpoint(dir);
  });
  fuzz::expect_clean([&] { resolve_checkpoint(dir); });
  return 0;
}
