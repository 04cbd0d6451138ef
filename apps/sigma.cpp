// sigma: the one CLI. Subcommands live in apps/cmd_*.cpp and register themselves.
#include <fmt/core.h>
#include <unistd.h>

#include <cstdlib>

#include "command.h"
#include "core/error.h"
#include "core/refusal.h"
#include "dist/communicator.h"

namespace sigma::cli {
std::vector<AddCommand>& commands() {
  static std::vector<AddCommand> all;
  return all;
}
}  // namespace sigma::cli

int main(int argc, char** argv) {
  // OpenMP threads that spin at barriers collapse when the cores are shared: measured 1,800
  // against 51,000 tokens/s for the main job on 2 busy cores. libgomp reads its environment
  // before main, so set a passive wait policy (unless the user chose one) and re-execute.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
  }
  CLI::App app{"Sigma: sparse multi-domain language models (PanGu-Sigma)"};
  app.require_subcommand(1);
  for (auto& add : sigma::cli::commands()) add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // one line, like every other error
    fmt::print(stderr, "sigma: error: {} (see --help)\n", e.what());
    return e.get_exit_code() ? e.get_exit_code() : 2;
  } catch (const sigma::Refusal& e) {  // every rank refuses alike: rank 0 says it, once
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (rank && size && std::atoi(size) > 1 && std::atoi(rank) != 0)
      sleep(10);  // rank 0's abort ends this rank first; if rank 0 went on, it differed: say it
    else
      rank = nullptr;
    fmt::print(stderr, "sigma: error: {}{}\n", rank ? fmt::format("rank {}: ", rank) : "", e.what());
    std::fflush(stderr);
    sigma::abort_run(1);
    return 1;
  } catch (const std::exception& e) {  // sigma::Error and the rest: one line
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    fmt::print(stderr, "sigma: error: {}{}\n", rank ? fmt::format("rank {}: ", rank) : "", e.what());
    std::fflush(stderr);
    sigma::abort_run(1);  // a distributed run ends on every rank now, not at the timeout
    return 1;
  }
  return 0;
}
