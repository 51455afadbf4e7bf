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

std::vector<std::string> parse_model_selection(const std::string& text) {
  std::vector<std::string> names;
  if (text == "all" || text == "implemented") {
    for (const auto& model : registry())
      if (model.implemented()) names.push_back(model.name);
    return names;
  }
  if (text.rfind("class:", 0) == 0) {
    ModelClass wanted;
    if (!parse_class(text.substr(6), wanted)) throw InputError("unknown class '" + text.substr(6) + "'");
    for (const auto& model : registry())
      if (model.implemented() && model.has_class(wanted)) names.push_back(model.name);
    if (names.empty()) throw InputError("no implemented model in class " + text.substr(6));
    return names;
  }
  for (const auto& name : split(text, ',')) {
    if (find_model(name) == nullptr) throw InputError("unknown model '" + name + "' in --models");
    names.push_back(name);
  }
  if (names.empty()) throw InputError("--models is empty");
  return names;
}

std::vector<std::int64_t> parse_seq_lens(const std::string& text) {
  std::vector<std::int64_t> lens;
  const auto range = split(text, ':');
  if (range.size() == 3) {
    const std::int64_t lo = parse_positive(range[0], "--seq-lens"), hi = parse_positive(range[1], "--seq-lens");
    const std::string& step = range[2];
    if (step.size() < 2 || (step[0] != 'x' && step[0] != '+'))
      throw InputError("--seq-lens step must be xK (geometric) or +K (arithmetic), got '" + step + "'");
    const std::int64_t k = parse_positive(step.substr(1), "--seq-lens step");
    if (step[0] == 'x' && k < 2) throw InputError("--seq-lens geometric step must be at least x2");
    if (lo > hi) throw InputError("--seq-lens range is empty");
    for (std::int64_t n = lo; n <= hi; n = step[0] == 'x' ? n * k : n + k) lens.push_back(n);
    return lens;
  }
  if (range.size() != 1) throw InputError("--seq-lens expects a,b,c or lo:hi:xK, got '" + text + "'");
  for (const auto& part : split(text, ',')) lens.push_back(parse_positive(part, "--seq-lens"));
  if (lens.empty()) throw InputError("--seq-lens is empty");
  return lens;
}

std::vector<std::string> params_for_model(const std::string& model, const std::vector<std::string>& params) {
  std::vector<std::string> own;
  const ModelInfo* info = find_model(model);
  for (const auto& param : params) {
    const auto eq = param.find('=');
    const auto dot = param.find('.');
    if (dot != std::string::npos && dot < eq) {
      if (param.substr(0, dot) == model) own.push_back(param.substr(dot + 1));
      continue;
    }
    const std::string key = param.substr(0, eq);
    for (const auto& spec : info->impl.params)
      if (spec.name == key) own.push_back(param);
  }
  return own;
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

// Every point of the grid, resolved (InputError on any invalid one, before anything is written).
std::vector<PlannedPoint> plan_points(const SweepSettings& s) {
  std::vector<PlannedPoint> planned;
  for (const auto& model : s.models) {
    const auto own = params_for_model(model, s.params);
    for (Pass pass : s.passes)
      for (auto n : s.seq_lens) {
        PointConfig config = s.base;
        config.model = model;
        config.problem.seq_len = n;
        config.params = own;
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
std::vector<PlannedPoint> points_of_shard(std::vector<PlannedPoint> points, int index, int count) {
  if (count <= 1) return points;
  std::vector<std::int64_t> costs;
  for (const auto& [point, row] : points)
    costs.push_back(row.status == Status::Ok ? point.model->impl.flops(point.config.problem, point.requested) : 0);
  const auto shard_of = assign_shards(costs, count);
  std::vector<PlannedPoint> mine;
  for (std::size_t i = 0; i < points.size(); ++i)
    if (shard_of[i] == index - 1) mine.push_back(std::move(points[i]));
  return mine;
}

void print_progress(std::size_t index, std::size_t total, std::size_t ran, double elapsed, const PointConfig& c) {
  const double remaining = static_cast<double>(total - index + 1);
  const std::string eta = ran > 0 ? format_duration(elapsed / static_cast<double>(ran) * remaining) : "?";
  std::fprintf(stderr, "[%zu/%zu] %s N=%lld%s%s  elapsed %s  eta %s\n", index, total, c.model.c_str(),
               static_cast<long long>(c.problem.seq_len), c.problem.causal ? " causal" : "",
               c.pass == Pass::Forward ? "" : (" " + pass_name(c.pass)).c_str(), format_duration(elapsed).c_str(),
               eta.c_str());
}

// The report settings of a sweep: the base point's, then the sweep's own.
nlohmann::json sweep_settings(const SweepSettings& s) {
  nlohmann::json settings = point_settings(s.base);
  settings["pass"] = pass_list_name(s.passes);
  if (std::find(s.passes.begin(), s.passes.end(), Pass::Decode) != s.passes.end())
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

nlohmann::json sweep_context(const SweepSettings& s, const std::string& command_line) {
  const int threads = s.base.problem.threads;
  nlohmann::json context = capture_context(threads);
  context["command_line"] = command_line;
  context["seed"] = s.base.seed;
  if (s.measure_machine) {
    const auto m = measure_machine(threads);
    context["fma_peak_gflops"] = m.fma_peak_gflops;
    context["fma_peak_256_gflops"] = m.fma_peak_256_gflops;
    context["fma_peak_512_gflops"] = m.fma_peak_512_gflops;
    context["triad_bandwidth_gbs"] = m.triad_bandwidth_gbs;
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

Report run_sweep(const SweepSettings& s, const std::string& command_line) {
  // Validate everything before writing anything.
  if (s.out_path == "-") throw InputError("--out -: a sweep rewrites its report after every point; name a file");
  check_output_path(s.out_path);
  if (s.shard_index < 1 || s.shard_index > s.shard_count) throw InputError("--shard index out of range");
  const std::vector<PlannedPoint> points = points_of_shard(plan_points(s), s.shard_index, s.shard_count);

  Report report;
  report.settings = sweep_settings(s);
  std::set<std::string> done;
  if (s.resume && std::filesystem::exists(s.out_path)) {
    Report previous = load_report(s.out_path);
    check_resumable(previous, report.settings, capture_context(s.base.problem.threads), s.out_path);
    report.context = previous.context;
    report.results = std::move(previous.results);
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
    if (s.progress && row.status != Status::Ok)
      std::fprintf(stderr, "        %s: %s\n", status_name(row.status).c_str(), row.reason.c_str());
    if (row.contended) spdlog::warn("{} N={}: {}", row.model, row.seq_len, contended_warning(row));
    report.results.push_back(std::move(row));
    save_report_atomically(report, s.out_path);
  }
  return report;
}

}  // namespace xfb
