// Planted by tests/check_layers.sh: a call up into the training layer (train/run_dir.h), from
// code linked with the layers below it only. Its link must fail with an undefined reference.
// Declared by hand: an upward #include would already fail to compile.
#include <string>

namespace sigma {
bool holds_run(const std::string& out);
}  // namespace sigma

bool planted_upward_call() { return sigma::holds_run("planted"); }
