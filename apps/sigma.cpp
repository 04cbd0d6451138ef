// sigma: the one CLI. Subcommands are registered here; each calls into the library.
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"Sigma: sparse multi-domain language models (PanGu-Sigma)"};
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const sigma::Error& e) {
    fmt::print(stderr, "sigma: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
