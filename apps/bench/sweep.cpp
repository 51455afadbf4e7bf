#include "apps/bench/sweep.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "apps/bench/child_process.hpp"
#include "apps/bench/system_info.hpp"
#include "apps/report/compare.hpp"
#include "apps/report/files.hpp"
#include "apps/report/merge.hpp"
#include "apps/report/point_fields.hpp"
#include "apps/report/table.hpp"
#include "lib/core/contention.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/registry.hpp"

namespace xfb {
namespace {

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, separator)) parts.push_back(part);
  return parts;
}

std::int64_t parse_positive(const std::string& text, const std::string& what) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw InputError(what + ": '" + text + "' is not an integer");
  if (value <= 0) throw InputError(what + ": " + text + " must be positive");
  return value;
}

std::string last_line(const std::string& text) {
  auto end = text.find_last_not_of("\n\r ");
  if (end == std::string::npos) return "";
  auto start = text.rfind('\n', end);
  return text.substr(start == std::string::npos ? 0 : start + 1,
                     end - (start == std::string::npos ? 0 : start + 1) + 1);
}

std::string signal_text(int signal) {
  const char* name = strsignal(signal);
  return "killed by signal " + std::to_string(signal) + " (" + (name ? name : "?") + ")" +
         (signal == 9 ? ", possibly out of memory" : "");
}

std::string format_duration(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%dm%02ds", static_cast<int>(seconds) / 60, static_cast<int>(seconds) % 60);
  return text;
}

}  // namespace

std::vector<std::string> params_for_model(const std::string& model, const std::vector<std::string>& params) {
  std::vector<std::string> own, qualified_keys;
  const ModelInfo* info = find_model(model);
  for (const auto& param : params) {
    const auto eq = param.find('=');
    const auto dot = param.find('.');
    if (dot != std::string::npos && dot < eq && param.substr(0, dot) == model)
      qualified_keys.push_back(param.substr(dot + 1, eq - dot - 1));
  }
  for (const auto& param : params) {
    const auto eq = param.find('=');
    const auto dot = param.find('.');
    if (dot != std::string::npos && dot < eq) {
      if (param.substr(0, dot) == model) own.push_back(param.substr(dot + 1));
      continue;
    }
    const std::string key = param.substr(0, eq);
    if (std::find(qualified_keys.begin(), qualified_keys.end(), key) != qualified_keys.end()) continue;
    for (const auto& spec : info->impl.params)
      if (spec.name == key) own.push_back(param);
  }
  return own;
}

std::vector<std::vector<std::string>> param_grid(const std::vector<std::string>& own) {
  std::vector<std::pair<std::string, std::vector<std::string>>> keys;  // key → values, first-given order
  for (const auto& param : own) {
    const auto eq = param.find('=');
    const std::string key = param.substr(0, eq);
    auto entry = std::find_if(keys.begin(), keys.end(), [&](const auto& k) { return k.first == key; });
    if (entry == keys.end()) entry = keys.insert(keys.end(), {key, {}});
    if (eq == std::string::npos) continue;  // no value: resolve_params names the mistake
    for (const auto& value : comma_items(param.substr(eq + 1))) {
      if (value.empty()) throw InputError("--param " + param + " has an empty value");
      if (std::find(entry->second.begin(), entry->second.end(), value) != entry->second.end())
        throw InputError("--param " + key + " is given the value " + value + " twice");
      entry->second.push_back(value);
    }
  }
  std::vector<std::vector<std::string>> sets = {{}};
  for (const auto& [key, values] : keys) {
    if (values.empty()) {  // `key` without `=`: kept as given, for resolve_params's message
      for (auto& set : sets) set.push_back(key);
      continue;
    }
    std::vector<std::vector<std::string>> expanded;
    for (const auto& set : sets)
      for (const auto& value : values) {
        expanded.push_back(set);
        expanded.back().push_back(key + "=" + value);
      }
    sets = std::move(expanded);
  }
  return sets;
}

std::pair<int, int> parse_shard(const std::string& text) {
  const auto parts = split(text, '/');
  if (parts.size() != 2) throw InputError("--shard expects i/n (e.g. 2/4), got '" + text + "'");
  const auto index = parse_positive(parts[0], "--shard index"), count = parse_positive(parts[1], "--shard count");
  if (index > count) throw InputError("--shard " + text + ": the index must be between 1 and " + parts[1]);
  if (count > 100000) throw InputError("--shard " + text + ": too many shards");
  return {static_cast<int>(index), static_cast<int>(count)};
}

std::vector<int> assign_shards(const std::vector<std::int64_t>& costs, int shards) {
  std::vector<std::size_t> order(costs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return costs[a] > costs[b]; });
  std::vector<std::int64_t> load(static_cast<std::size_t>(shards), 0);
  std::vector<std::size_t> count(static_cast<std::size_t>(shards), 0);
  std::vector<int> shard_of(costs.size(), 0);
  for (std::size_t point : order) {
    std::size_t best = 0;
    for (std::size_t s = 1; s < load.size(); ++s)
      if (load[s] < load[best] || (load[s] == load[best] && count[s] < count[best])) best = s;
    shard_of[point] = static_cast<int>(best);
    load[best] += costs[point];
    ++count[best];
  }
  return shard_of;
}

namespace {

// A point of the sweep, resolved and described once: `row` has its identity, and its status and
// reason when it will not run here (unsupported, over --memory-limit).
struct PlannedPoint {
  Point point;
  ResultRow row;
};

constexpr std::size_t kMaxSweepPoints = 100'000;  // models × grid × parameter sets × passes × lengths

// The grid's base points: every combination of the gridded fields, or the base alone.
std::vector<PointConfig> base_points(const SweepSettings& s) {
  return s.grid.empty() ? std::vector<PointConfig>{s.base} : s.grid;
}

// Every point of the grid — per model, each base point, parameter set, pass and length — resolved
// (InputError on any invalid one, before anything is written).
std::vector<PlannedPoint> plan_points(const SweepSettings& s) {
  std::size_t total = 0;
  for (const auto& model : s.models)
    total += base_points(s).size() * param_grid(params_for_model(model, s.params)).size() * s.passes.size() *
             s.seq_lens.size();
  if (total > kMaxSweepPoints)
    throw InputError("the sweep has " + std::to_string(total) + " points, more than " +
                     std::to_string(kMaxSweepPoints) + ": select fewer models, lengths or grid values");
  std::vector<PlannedPoint> planned;
  for (const auto& model : s.models) {
    const auto param_sets = param_grid(params_for_model(model, s.params));
    for (const auto& base : base_points(s))
      for (const auto& params : param_sets)
        for (Pass pass : s.passes)
          for (auto n : s.seq_lens) {
            PointConfig config = base;
            config.model = model;
            config.problem.seq_len = n;
            config.params = params;
            config.pass = pass;
            Point point = resolve_point(config);
            ResultRow row = describe_point(point, s.memory_limit_bytes);
            planned.push_back({std::move(point), std::move(row)});
          }
  }
  for (const auto& param : s.params) {
    bool used = false;
    for (const auto& model : s.models) used = used || !params_for_model(model, {param}).empty();
    if (!used) throw InputError("--param " + param + " matches no parameter of the selected models");
  }
  return planned;
}

// The shard's part of the points, dealt by estimated FLOPs (0 for points that will not run).
std::vector<PlannedPoint> points_of_shard(const std::vector<PlannedPoint>& points, int index, int count) {
  if (index < 1 || index > count) throw InputError("--shard index out of range");
  if (count <= 1) return points;
  std::vector<std::int64_t> costs;
  for (const auto& [point, row] : points)
    costs.push_back(row.status == Status::Ok ? point.model->impl.flops(point.config.problem, point.requested) : 0);
  const auto shard_of = assign_shards(costs, count);
  std::vector<PlannedPoint> mine;
  for (std::size_t i = 0; i < points.size(); ++i)
    if (shard_of[i] == index - 1) mine.push_back(points[i]);
  return mine;
}

// This shard's points of the sweep, planned and validated (InputError before anything is written).
std::vector<PlannedPoint> shard_points(const SweepSettings& s) {
  return points_of_shard(plan_points(s), s.shard_index, s.shard_count);
}

void print_progress(std::size_t index, std::size_t total, std::size_t ran, double elapsed, const PointConfig& c) {
  const double remaining = static_cast<double>(total - index + 1);
  const std::string eta = ran > 0 ? format_duration(elapsed / static_cast<double>(ran) * remaining) : "?";
  std::fprintf(stderr, "[%zu/%zu] %s N=%lld%s%s  elapsed %s  eta %s\n", index, total, c.model.c_str(),
               static_cast<long long>(c.problem.seq_len), c.problem.causal ? " causal" : "",
               c.pass == Pass::Forward ? "" : (" " + pass_name(c.pass)).c_str(), format_duration(elapsed).c_str(),
               eta.c_str());
}

// "12.3 ms": a duration with the unit its size needs.
std::string time_text(double ns) {
  const char* unit = ns < 1e3 ? "ns" : ns < 1e6 ? "µs" : ns < 1e9 ? "ms" : "s";
  const double scaled = ns < 1e3 ? ns : ns < 1e6 ? ns * 1e-3 : ns < 1e9 ? ns * 1e-6 : ns * 1e-9;
  char text[32];
  std::snprintf(text, sizeof text, "%.4g %s", scaled, unit);
  return text;
}

// The landed point's figures under its progress line, as hyperfine prints them: the median (bold
// green on a terminal), its spread, samples, GFLOP/s and memory; or its status and reason.
void print_finished(const ResultRow& row, bool colour) {
  const char* on = colour ? "\033[1;32m" : "";
  const char* warn = colour ? "\033[33m" : "";
  const char* off = colour ? "\033[0m" : "";
  if (row.status != Status::Ok) {
    std::fprintf(stderr, "        %s%s%s: %s\n", warn, status_name(row.status).c_str(), off, row.reason.c_str());
    return;
  }
  std::fprintf(stderr, "        %s%s: %s%s%s (min %s, max %s, CV %.1f%%%s, %zu samples), %.1f GFLOP/s, %.1f MiB\n",
               row.pass == Pass::Decode ? "per token" : "median", row.unstable ? " ~" : "", on,
               time_text(row.median_ns).c_str(), off, time_text(row.min_ns).c_str(), time_text(row.max_ns).c_str(),
               100 * row.cv, row.contended ? ", contended" : "", row.samples_ns.size(), row.gflops_per_s,
               static_cast<double>(row.peak_tensor_bytes) / (1024.0 * 1024.0));
}

// The distinct thread counts of the grid, ascending.
std::vector<int> grid_threads(const SweepSettings& s) {
  std::set<int> threads;
  for (const auto& base : base_points(s)) threads.insert(base.problem.threads);
  return {threads.begin(), threads.end()};
}

// The report settings of a sweep: the base point's (a gridded field: the list of its values, in
// the grid's order), then the sweep's own.
nlohmann::json sweep_settings(const SweepSettings& s) {
  nlohmann::json settings = point_settings(s.base);
  for (const auto& key : s.gridded) {
    nlohmann::json values = nlohmann::json::array();
    for (const auto& base : base_points(s)) {
      const auto value = point_settings(base)[key];
      if (std::find(values.begin(), values.end(), value) == values.end()) values.push_back(value);
    }
    settings[key] = values;
  }
  settings["pass"] = pass_list_name(s.passes);
  const bool decode_gridded = std::find(s.gridded.begin(), s.gridded.end(), "decode_tokens") != s.gridded.end();
  if (std::find(s.passes.begin(), s.passes.end(), Pass::Decode) != s.passes.end() && !decode_gridded)
    settings["decode_tokens"] = s.base.decode_tokens;
  settings["models"] = s.models;
  settings["seq_lens"] = s.seq_lens;
  settings["params"] = s.params;
  settings["timeout_s"] = s.timeout_s;
  settings["memory_limit_bytes"] = s.memory_limit_bytes;
  if (s.shard_count > 1) settings["shard"] = std::to_string(s.shard_index) + "/" + std::to_string(s.shard_count);
  if (!s.preset.empty()) settings["preset"] = s.preset;
  return settings;
}

// The context of a sweep on the machine: `threads` is the grid's largest thread count; with more
// than one, `machine_by_threads` holds the measured peaks and bandwidth per thread count (what a
// row's GFLOP/s share is quoted against) and the top-level figures are the largest count's.
nlohmann::json sweep_context(const SweepSettings& s, const std::string& command_line) {
  const auto threads = grid_threads(s);
  nlohmann::json context = capture_context(threads.back());
  context["command_line"] = command_line;
  context["seed"] = s.base.seed;
  if (!s.measure_machine) return context;
  for (const int t : threads) {
    const nlohmann::json figures = machine_figures(measure_machine(t));
    if (threads.size() > 1) context["machine_by_threads"][std::to_string(t)] = figures;
    if (t == threads.back()) context.update(figures);
  }
  return context;
}

// Whether every entry of `old_list` is in `new_list` (both JSON arrays).
bool extends(const nlohmann::json& new_list, const nlohmann::json& old_list) {
  if (!new_list.is_array() || !old_list.is_array()) return false;
  for (const auto& entry : old_list)
    if (std::find(new_list.begin(), new_list.end(), entry) == new_list.end()) return false;
  return true;
}

// --resume continues the same sweep only: on the same machine and build (kMergeContextFields), with
// the same settings, except that the grid's axes (models, seq_lens) may add entries. InputError
// naming the first field that differs.
void check_resumable(const Report& previous, const nlohmann::json& settings, const nlohmann::json& context,
                     const std::string& path) {
  const auto differences = context_differences(previous.context, context, kMergeContextFields);
  if (!differences.empty())
    throw InputError("--resume: " + path + " was made with another " + differences.front() +
                     " (context); write a new report");
  const auto& old = previous.settings;
  for (const auto& [key, value] : settings.items()) {
    const bool axis = key == "models" || key == "seq_lens";
    if (old.contains(key) && (old[key] == value || (axis && extends(value, old[key])))) continue;
    throw InputError("--resume: " + path + " has settings." + key + " = " +
                     (old.contains(key) ? old[key].dump() : "(none)") + ", this sweep " + value.dump() +
                     (axis ? " (a resumed sweep may only add models and lengths)" : "") + "; write a new report");
  }
  for (const auto& [key, value] : old.items())
    if (!settings.contains(key))
      throw InputError("--resume: " + path + " has settings." + key + ", this sweep has none");
}

// The finished rows of a resumed report that this run keeps. Every row must be a
// point of this sweep, once (else the report was not written by it: InputError). A row that is
// another shard's now (a grown grid deals the points anew) is dropped, as are error rows under
// --retry-errors: both run again.
std::vector<ResultRow> resumed_rows(std::vector<ResultRow> previous, const std::vector<PlannedPoint>& sweep,
                                    const std::vector<PlannedPoint>& shard, const SweepSettings& s) {
  std::set<std::string> sweep_keys, shard_keys, seen;
  for (const auto& planned : sweep) sweep_keys.insert(planned.row.key());
  for (const auto& planned : shard) shard_keys.insert(planned.row.key());
  std::vector<ResultRow> kept;
  std::size_t moved = 0;
  for (std::size_t i = 0; i < previous.size(); ++i) {
    ResultRow& row = previous[i];
    const std::string key = row.key();
    const std::string which = "--resume: " + s.out_path + ": results[" + std::to_string(i) + "] (" + row.model +
                              " N=" + std::to_string(row.seq_len) + ", " + configuration_text(row) + ")";
    if (sweep_keys.count(key) == 0) throw InputError(which + " is not a point of this sweep; write a new report");
    if (!seen.insert(key).second) throw InputError(which + " repeats a point; write a new report");
    if (shard_keys.count(key) == 0)
      ++moved;
    else if (!(s.retry_errors && row.status == Status::Error))
      kept.push_back(std::move(row));
  }
  if (moved > 0)
    spdlog::warn("--resume: {} finished point(s) of {} belong to another shard of the grown sweep; dropped here", moved,
                 s.out_path);
  return kept;
}

}  // namespace

ResultRow run_point_in_child(const Point& point, const ResultRow& described, double timeout_s,
                             const std::string& program) {
  // After a child that used gigabytes, the host's reclaim of that memory steals CPU time for
  // seconds (contention.hpp): the next child starts after it.
  static std::int64_t previous_peak_rss = 0;
  settle_after(previous_peak_rss);
  ResultRow row = described;
  // This build reads the point as data; another build (ab's --a-bin, --b-bin, perhaps older) its
  // reproducer's words, which every build understands. The parent checked memory already.
  std::vector<std::string> args = {"-q", "run", "--point", point_to_json(point.config).dump(), "--memory-limit", "0"};
  if (!program.empty()) {
    args = point_arguments(point.config);
    args.insert(args.begin(), "-q");
  }
  args.push_back("--json");
  const ChildResult child = program.empty() ? run_self(args, timeout_s) : run_program(program, args, timeout_s);
  if (child.timed_out) {
    row.status = Status::Error;
    row.reason = "timed out after " + std::to_string(static_cast<int>(timeout_s)) + " s (--timeout)";
  } else if (child.signal != 0) {
    row.status = Status::Error;
    row.reason = signal_text(child.signal);
  } else {
    try {
      row = nlohmann::json::parse(child.out).get<ResultRow>();
    } catch (const std::exception&) {
      row.status = Status::Error;
      const std::string detail = last_line(child.err);
      row.reason = "child exited with code " + std::to_string(child.exit_code) + (detail.empty() ? "" : ": " + detail);
    }
  }
  row.peak_rss_bytes = std::max(row.peak_rss_bytes, child.peak_rss_bytes);
  previous_peak_rss = row.peak_rss_bytes;
  return row;
}

std::string render_dry_run(const SweepSettings& s) {
  const std::vector<PlannedPoint> points = shard_points(s);
  std::vector<std::string> header = {"#", "model", "N", "pass", "causal"};
  header.insert(header.end(), s.gridded.begin(), s.gridded.end());
  header.insert(header.end(), {"params", "est. MiB", "est. GFLOP", "would"});
  std::vector<std::vector<std::string>> cells = {header};
  std::size_t runs = 0, skipped = 0, unsupported = 0;
  double gflop = 0;
  for (const auto& [point, row] : points) {
    const auto flops = estimated_point_flops(point);
    const bool ok = row.status == Status::Ok;
    runs += ok;
    skipped += row.status == Status::Skipped;
    unsupported += row.status == Status::Unsupported;
    if (ok && flops) gflop += static_cast<double>(*flops) * 1e-9;
    char mib[32] = "-", giga[32] = "-";
    if (ok || row.status == Status::Skipped)
      std::snprintf(mib, sizeof mib, "%.1f", static_cast<double>(estimated_point_bytes(point)) / (1024.0 * 1024.0));
    if (flops && row.status != Status::Unsupported)
      std::snprintf(giga, sizeof giga, "%.3f", static_cast<double>(*flops) * 1e-9);
    std::vector<std::string> line = {std::to_string(cells.size()), row.model, std::to_string(row.seq_len),
                                     pass_name(row.pass), row.causal ? "yes" : "no"};
    for (const auto& key : s.gridded) {
      const auto value = point_field(key).get(point.config);
      line.push_back(value.is_string() ? value.get<std::string>() : value.dump());
    }
    line.insert(line.end(),
                {params_text(row.params), mib, giga, ok ? "run" : status_name(row.status) + ": " + row.reason});
    cells.push_back(std::move(line));
  }
  std::string summary = "dry run: " + std::to_string(points.size()) + " points";
  if (s.shard_count > 1) summary += " in shard " + std::to_string(s.shard_index) + "/" + std::to_string(s.shard_count);
  char total[64];
  std::snprintf(total, sizeof total, "%.3f", gflop);
  summary += "; " + std::to_string(runs) + " would run (" + total + " GFLOP estimated, decode steps not counted), " +
             std::to_string(skipped) + " skipped over --memory-limit, " + std::to_string(unsupported) +
             " unsupported; nothing was run\n";
  return render_cells(cells, TableFormat::Text, 6) + "\n" + summary;
}

Report run_sweep(const SweepSettings& s, const std::string& command_line) {
  // Validate everything before writing anything.
  if (s.out_path == "-") throw InputError("--out -: a sweep rewrites its report after every point; name a file");
  check_output_path(s.out_path, {self_path()});  // not the binary that runs the points
  if (s.retry_errors && !s.resume) throw InputError("--retry-errors needs --resume");
  const std::vector<PlannedPoint> sweep = plan_points(s);
  const std::vector<PlannedPoint> points = points_of_shard(sweep, s.shard_index, s.shard_count);

  Report report;
  report.settings = sweep_settings(s);
  std::set<std::string> done;
  if (s.resume && std::filesystem::exists(s.out_path)) {
    Report previous = load_report(s.out_path);
    check_resumable(previous, report.settings, capture_context(grid_threads(s).back()), s.out_path);
    report.context = previous.context;
    report.results = resumed_rows(std::move(previous.results), sweep, points, s);
    for (const auto& row : report.results) done.insert(row.key());
  }
  if (report.context.empty()) report.context = sweep_context(s, command_line);
  save_report_atomically(report, s.out_path);

  const auto start = std::chrono::steady_clock::now();
  std::size_t index = 0, ran = 0;
  for (const auto& [point, described] : points) {
    ++index;
    if (done.count(described.key())) continue;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s.progress) print_progress(index, points.size(), ran, elapsed, point.config);
    ResultRow row = described;
    if (row.status == Status::Ok) {
      row = run_point_in_child(point, described, s.timeout_s);
      ++ran;
    }
    if (s.progress) print_finished(row, s.colour);
    if (row.contended) spdlog::warn("{} N={}: {}", row.model, row.seq_len, contended_warning(row));
    report.results.push_back(std::move(row));
    save_report_atomically(report, s.out_path);
  }
  return report;
}

}  // namespace xfb
