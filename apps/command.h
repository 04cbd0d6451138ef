// Subcommand registry: each apps/cmd_*.cpp registers its subcommands at static-init time, so
// adding a command never touches another command's file.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <vector>

namespace sigma::cli {

// `add` creates the subcommand on the root app and sets its callback (which may throw sigma::Error).
using AddCommand = std::function<void(CLI::App& root)>;

std::vector<AddCommand>& commands();

struct RegisterCommand {
  explicit RegisterCommand(AddCommand add) { commands().push_back(std::move(add)); }
};

}  // namespace sigma::cli
