// sigma plot RUN_DIR: figures of a training run from its metrics.jsonl and summary.json, drawn
// by gnuplot (docs/dependencies.md says why): per-domain training loss with the held-out loss
// (train.eval_every's and the end's), learning rate, tokens/s, and per RRE block a heatmap of each expert's share of its
// group's tokens over the logging windows. Writes SVG (or PNG) files into RUN_DIR/plots.
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "command.h"
#include "core/error.h"
#include "core/json_depth.h"

extern char** environ;

namespace sigma::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct PlotArgs {
  std::string run, out, format = "svg";
};

std::vector<json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  SIGMA_CHECK(in.good(), "cannot read {}: is this a run directory (sigma train --out DIR)?", path);
  std::vector<json> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    json j = parse_json_or_discard(line);
    SIGMA_CHECK(!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number(),
                "{}:{}: not a metrics record (a JSON object with \"step\")", path, n);
    out.push_back(std::move(j));
  }
  SIGMA_CHECK(!out.empty(), "{} holds no records (the run logged nothing yet)", path);
  return out;
}

// A gnuplot string literal.
std::string quote(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

double num(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : NAN;
}

std::string cell(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : "?"; }

struct Figure {
  std::string data;    // the data file's text
  std::string script;  // gnuplot commands after the terminal and output are set
};

// Training loss per domain over steps, and beside it each domain's held-out loss: the
// train.eval_every records' "held_out" (issue 39) and summary.json's end-of-run losses as the
// point at the last step (when no record evaluated that step). The data file holds two blocks:
// index 0 the training rows, index 1 the held-out rows.
Figure loss_figure(const std::vector<json>& m, const json& summary, const std::string& dat) {
  std::set<std::string> names;
  for (const json& r : m)
    if (r.contains("domains") && r["domains"].is_object())
      for (const auto& [d, v] : r["domains"].items()) names.insert(d);
  Figure f;
  const std::vector<std::string> doms(names.begin(), names.end());
  for (const json& r : m) {
    f.data += cell(num(r, "step"));
    for (const auto& d : doms)
      f.data += fmt::format(" {}", cell(r.contains("domains") ? num(r["domains"], d.c_str()) : NAN));
    f.data += "\n";
  }
  // Held-out rows: (step, {domain: loss}) in step order.
  std::map<double, std::map<std::string, double>> held;
  for (const json& r : m)
    if (r.contains("held_out") && r["held_out"].is_object())
      for (const auto& [d, v] : r["held_out"].items())
        if (v.is_number()) held[num(r, "step")][d] = v.get<double>();
  const double last = num(m.back(), "step");
  if (summary.contains("domains") && summary["domains"].is_object() && !held.contains(last))
    for (const auto& [d, v] : summary["domains"].items())
      if (v.is_object() && v.contains("loss") && v["loss"].is_number()) held[last][d] = v["loss"].get<double>();
  std::set<std::string> held_names;
  for (const auto& [step, losses] : held)
    for (const auto& [d, l] : losses) held_names.insert(d);
  const std::vector<std::string> hdoms(held_names.begin(), held_names.end());
  f.data += "\n\n";
  for (const auto& [step, losses] : held) {
    f.data += cell(step);
    for (const auto& d : hdoms) f.data += " " + cell(losses.contains(d) ? losses.at(d) : NAN);
    f.data += "\n";
  }
  std::vector<std::string> plots;
  for (size_t i = 0; i < doms.size(); ++i)
    plots.push_back(fmt::format("{} index 0 using 1:{} with lines lw 2 lc {} title {}", quote(dat),
                                i + 2, i + 1, quote(doms[i] + " (train)")));
  size_t k = 0;
  for (size_t i = 0; i < hdoms.size(); ++i) {  // a domain's held-out line in its training colour
    const auto it = std::find(doms.begin(), doms.end(), hdoms[i]);
    const size_t colour = it == doms.end() ? doms.size() + ++k : size_t(it - doms.begin()) + 1;
    plots.push_back(fmt::format("{} index 1 using 1:{} with linespoints dt 2 lw 2 pt 7 ps 1.2 lc {} "
                                "title {}", quote(dat), i + 2, colour, quote(hdoms[i] + " (held-out)")));
  }
  SIGMA_CHECK(!plots.empty(), "no per-domain losses in the metrics records");
  f.script = "set title 'Loss per domain (nats/token)'\nset xlabel 'step'\nset ylabel 'loss'\n"
             "set datafile missing '?'\nset key outside right\nplot " +
             fmt::format("{}", fmt::join(plots, ", \\\n  ")) + "\n";
  return f;
}

Figure series_figure(const std::vector<json>& m, const char* key, const std::string& title,
                     const std::string& ylabel, const std::string& dat) {
  Figure f;
  for (const json& r : m) f.data += fmt::format("{} {}\n", cell(num(r, "step")), cell(num(r, key)));
  f.script = fmt::format("set title {}\nset xlabel 'step'\nset ylabel {}\nset key off\n"
                         "plot {} using 1:2 with linespoints lw 2 pt 7 ps 0.5\n",
                         quote(title), quote(ylabel), quote(dat));
  return f;
}

// Rows: logging windows; columns: the block's experts, group by group; value: the expert's
// share of its group's tokens in that window (1/experts when balanced).
Figure load_figure(const std::vector<json>& m, const std::string& block, const std::string& dat) {
  std::vector<std::string> labels;
  std::vector<std::string> ytics;
  Figure f;
  for (const json& r : m) {
    if (!r.contains("expert_load") || !r["expert_load"].contains(block)) continue;
    std::vector<std::string> row, names;
    for (const auto& [g, tokens] : r["expert_load"][block].items()) {
      double total = 0;
      for (const json& t : tokens) total += t.get<double>();
      for (size_t e = 0; e < tokens.size(); ++e) {
        row.push_back(cell(total > 0 ? tokens[e].get<double>() / total : NAN));
        names.push_back(fmt::format("{}:{}", g, e));
      }
    }
    if (labels.empty()) labels = names;
    SIGMA_CHECK(names == labels, "metrics.jsonl: block {} changes its experts between records", block);
    ytics.push_back(fmt::format("{} {}", quote(fmt::format("{:.0f}", num(r, "step"))), ytics.size()));
    f.data += fmt::format("{}\n", fmt::join(row, " "));
  }
  std::vector<std::string> xtics;
  for (size_t i = 0; i < labels.size(); ++i) xtics.push_back(fmt::format("{} {}", quote(labels[i]), i));
  const size_t every = std::max<size_t>(1, ytics.size() / 12);  // at most ~12 step labels
  std::vector<std::string> shown;
  for (size_t i = 0; i < ytics.size(); i += every) shown.push_back(ytics[i]);
  f.script = fmt::format(
      "set title {}\nset xlabel 'expert (group:index)'\nset ylabel 'step'\nset key off\n"
      "set xtics rotate by -45 ({})\nset ytics ({})\nset cblabel 'share of the group''s tokens'\n"
      "set palette rgbformulae 33,13,10\nset datafile missing '?'\n"
      "plot {} matrix with image\n",
      quote(fmt::format("Expert load, RRE block {}", block)), fmt::join(xtics, ", "),
      fmt::join(shown, ", "), quote(dat));
  return f;
}

void run_gnuplot(const std::string& script) {
  const char* argv[] = {"gnuplot", script.c_str(), nullptr};
  pid_t pid;
  // gnuplot gets the signals sigma routes to its quiet thread (core/quiet_signals.h) unblocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  const int e = posix_spawnp(&pid, "gnuplot", nullptr, &attr, const_cast<char**>(argv), environ);
  posix_spawnattr_destroy(&attr);
  SIGMA_CHECK(e == 0, "cannot run gnuplot ({}): install it with scripts/install-deps.sh "
              "(Debian package gnuplot-nox)", std::strerror(e));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  SIGMA_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "gnuplot failed on {} (its message "
              "is above)", script);
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream out(p);
  out << text;
  SIGMA_CHECK(out.good(), "cannot write {}", p.string());
}

void run_plot(const PlotArgs& a) {
  const fs::path run = a.run, out = a.out.empty() ? run / "plots" : fs::path(a.out);
  const auto metrics = read_metrics((run / "metrics.jsonl").string());
  json summary = json::object();
  if (std::ifstream in(run / "summary.json"); in.good()) {
    summary = parse_json_or_discard(in);
    SIGMA_CHECK(!summary.is_discarded() && summary.is_object(), "{}: not valid JSON",
                (run / "summary.json").string());
  }
  fs::create_directories(out);
  std::map<std::string, Figure> figures;
  figures["loss"] = loss_figure(metrics, summary, (out / "loss.dat").string());
  figures["lr"] = series_figure(metrics, "lr", "Learning rate", "lr", (out / "lr.dat").string());
  figures["tokens_per_s"] = series_figure(metrics, "tokens_per_s", "Throughput (this run's mean so far)",
                                          "tokens/s", (out / "tokens_per_s.dat").string());
  std::set<std::string> blocks;
  for (const json& r : metrics)
    if (r.contains("expert_load") && r["expert_load"].is_object())
      for (const auto& [b, v] : r["expert_load"].items()) blocks.insert(b);
  for (const std::string& b : blocks)
    figures["expert_load_block" + b] = load_figure(metrics, b, (out / ("expert_load_block" + b + ".dat")).string());
  const std::string term = a.format == "png" ? "pngcairo size 900,540 font 'sans,10'"
                                             : "svg size 900,540 dynamic font 'sans,12' background rgb 'white'";
  for (const auto& [name, f] : figures) {
    write(out / (name + ".dat"), f.data);
    const fs::path image = out / (name + "." + a.format), gp = out / (name + ".gp");
    write(gp, fmt::format("set terminal {}\nset output {}\nset grid\n{}", term, quote(image.string()), f.script));
    run_gnuplot(gp.string());
    fmt::print("{}\n", image.string());
  }
  if (blocks.empty()) fmt::print(stderr, "sigma plot: no expert load in the metrics (a dense model): no heatmaps\n");
}

const RegisterCommand reg_plot([](CLI::App& root) {
  auto a = std::make_shared<PlotArgs>();
  CLI::App* c = root.add_subcommand("plot", "Plot a run's loss per domain, learning rate, tokens/s "
                                    "and expert load (needs gnuplot)");
  c->add_option("RUN_DIR", a->run, "Run directory (sigma train --out): metrics.jsonl, summary.json")->required();
  c->add_option("--out", a->out, "Folder for the figures (default RUN_DIR/plots)");
  c->add_option("--format", a->format, "svg (default) or png")->check(CLI::IsMember({"svg", "png"}));
  c->callback([a] { run_plot(*a); });
});

}  // namespace
}  // namespace sigma::cli
