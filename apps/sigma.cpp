// sigma: the one CLI. Subcommands live in apps/cmd_*.cpp and register themselves.
#include <fmt/core.h>
#include <malloc.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "command.h"
#include "core/error.h"
#include "core/passive_wait.h"
#include "core/quiet_signals.h"
#include "core/refusal.h"
#include "dist/communicator.h"
#include "sigma_git_version.h"  // generated at build time: SIGMA_GIT_HASH

namespace sigma::cli {
std::vector<AddCommand>& commands() {
  static std::vector<AddCommand> all;
  return all;
}
}  // namespace sigma::cli

// Under mpirun, for an error every rank reaches alike: rank 0 says it and exits, which ends
// the other ranks (mpirun aborts the job, or rank 0's MPI_Abort); they wait for that, and say
// their own only if rank 0 went on (it differed), with their rank. "" on rank 0 and alone.
namespace {
std::string label_after_rank0() {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (!rank || !size || std::atoi(size) <= 1 || std::atoi(rank) == 0) return "";
  sleep(10);
  return fmt::format("rank {}: ", rank);
}
}  // namespace

int main(int argc, char** argv) {
  sigma::ensure_passive_omp_wait(argv);  // core/passive_wait.h
  // Keep freed memory for the next step instead of handing it back to the kernel: a training
  // step frees and reallocates the same buffers (exchange buckets, collective temporaries), and
  // glibc's defaults unmap or trim them each time, so every step faulted them in again, ~8,000
  // page faults per step on 2 ranks of d 256; at the 12 us a fault costs on this machine's
  // virtual machines that was 100 ms of a 170 ms step (docs/distributed.md). Allocations up to
  // 32 MiB (glibc's own cap for its adaptive threshold) come from the heap, which keeps up to
  // 512 MiB free. A user's GLIBC_TUNABLES for malloc take precedence.
  if (const char* t = std::getenv("GLIBC_TUNABLES"); !t || !std::strstr(t, "malloc")) {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
  }
  sigma::route_signals_to_quiet_thread();  // before any thread starts (core/quiet_signals.h)
  CLI::App app{"Sigma: sparse multi-domain language models (PanGu-Sigma)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", fmt::format("sigma {} ({})", SIGMA_VERSION, SIGMA_GIT_HASH));
  for (auto& add : sigma::cli::commands()) add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // one line, like every other error; once, as a refusal
    fmt::print(stderr, "sigma: error: {}{} (see --help)\n", label_after_rank0(), e.what());
    return e.get_exit_code() ? e.get_exit_code() : 2;
  } catch (const sigma::Refusal& e) {  // every rank refuses alike: rank 0 says it, once
    fmt::print(stderr, "sigma: error: {}{}\n", label_after_rank0(), e.what());
    std::fflush(stderr);
    sigma::abort_run(1);
    return 1;
  } catch (const std::exception& e) {  // sigma::Error and the rest: one line
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    fmt::print(stderr, "sigma: error: {}{}\n", rank ? fmt::format("rank {}: ", rank) : "", e.what());
    std::fflush(stderr);
    // Ranks that fail together (an agreed failure, e.g. a save one rank could not write) all
    // say why: rank 0 aborts at once, the others a moment later, so that no rank's abort ends
    // rank 0 before it has printed (its abort then ends them). A lone failure waits 2 s more.
    if (rank && std::atoi(rank) != 0) sleep(2);
    sigma::abort_run(1);  // a distributed run ends on every rank now, not at the timeout
    return 1;
  }
  return 0;
}
