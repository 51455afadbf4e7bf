#include "apps/report/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "apps/report/json_fields.hpp"
#include "apps/report/point_fields.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {

std::string ResultRow::key() const { return point_key(*this); }

RowsVary rows_vary(const Report& report) {
  RowsVary vary;
  for (const auto& row : report.results) {
    vary.threads = vary.threads || row.threads != report.results.front().threads;
    vary.seed = vary.seed || row.seed != report.results.front().seed;
  }
  return vary;
}

namespace {

// The object that holds the machine figures measured on `threads` threads: the context's
// `machine_by_threads` entry for that count, else the context itself when it ran on that count
// (or `threads` is 0); nullptr when the report measured nothing there.
const nlohmann::json* machine_entry_for_threads(const nlohmann::json& context, int threads) {
  const std::string key = std::to_string(threads);
  if (context.contains("machine_by_threads") && context["machine_by_threads"].contains(key))
    return &context["machine_by_threads"][key];
  if (threads == 0 || context.value("threads", 0) == threads) return &context;
  return nullptr;
}

// The machine figure `field` measured on `threads` threads (see fma_peak_for_threads); 0 when absent.
double machine_figure_for_threads(const nlohmann::json& context, int threads, const char* field) {
  const nlohmann::json* entry = machine_entry_for_threads(context, threads);
  return entry != nullptr ? entry->value(field, 0.0) : 0.0;
}

}  // namespace

double fma_peak_for_threads(const nlohmann::json& context, int threads) {
  return machine_figure_for_threads(context, threads, "fma_peak_gflops");
}

bool peak_contended_for_row(const nlohmann::json& context, const ResultRow& row) {
  const nlohmann::json* entry = machine_entry_for_threads(context, row.threads);
  return entry != nullptr && entry->value(kMachineContendedField, false);
}

double dot_peak_for_row(const nlohmann::json& context, const ResultRow& row) {
  if (row.dtype == DType::BF16) return machine_figure_for_threads(context, row.threads, "bf16_dot_peak_gflops");
  return fma_peak_for_threads(context, row.threads);
}

std::string configuration_text(const ResultRow& row) {
  std::ostringstream out;
  out << scope_name(row.scope) << (row.pass != Pass::Forward ? ", " + pass_name(row.pass) + " pass" : "")
      << (row.causal ? ", causal" : "") << (row.dtype == DType::BF16 ? ", bf16" : "") << ", B=" << row.batch
      << " H=" << row.heads << " D=" << row.head_dim;
  if (row.pass == Pass::Decode) out << ", T=" << row.decode_tokens;
  if (row.d_ff) out << ", d_ff=" << row.d_ff;
  if (row.ffn != "dense")
    out << ", ffn=" << row.ffn << " X=" << row.experts << " cf=" << row.capacity_factor << " S=" << row.group_size;
  return out.str();
}

std::string params_text(const nlohmann::json& params) {
  std::string text;
  for (const auto& [key, value] : params.items())
    text += (text.empty() ? "" : ",") + key + "=" + (value.is_string() ? value.get<std::string>() : value.dump());
  return text;
}

std::string format_number(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

std::optional<double> finite_ratio(double numerator, double denominator) {
  if (!(denominator > 0)) return std::nullopt;
  const double ratio = numerator / denominator;
  if (!std::isfinite(ratio)) return std::nullopt;
  return ratio;
}

std::string contended_warning(const ResultRow& row) {
  for (const auto& warning : row.warnings)
    if (warning.rfind("contended:", 0) == 0) return warning;
  return "contended: " + std::to_string(row.contended_samples) + " timed samples waited for a CPU";
}

void to_json(nlohmann::json& j, const ResultRow& r) {
  j = nlohmann::json{{"model", r.model},
                     {"classes", r.classes},
                     {"scope", scope_name(r.scope)},
                     {"pass", pass_name(r.pass)},
                     {"causal", r.causal},
                     {"dtype", dtype_name(r.dtype)},
                     {"batch", r.batch},
                     {"heads", r.heads},
                     {"seq_len", r.seq_len},
                     {"out_len", r.out_len > 0 ? r.out_len : r.seq_len},
                     {"head_dim", r.head_dim},
                     {"d_ff", r.d_ff},
                     {"ffn", r.ffn},
                     {"experts", r.experts},
                     {"capacity_factor", r.capacity_factor},
                     {"group_size", r.group_size},
                     {"params", r.params},
                     {"threads", r.threads},
                     {"kernel_isa", r.kernel_isa},
                     {"seed", r.seed},
                     {"status", status_name(r.status)},
                     {"reason", r.reason},
                     {"samples_ns", r.samples_ns},
                     {"median_ns", r.median_ns},
                     {"min_ns", r.min_ns},
                     {"max_ns", r.max_ns},
                     {"mad_ns", r.mad_ns},
                     {"cv", r.cv},
                     {"unstable", r.unstable},
                     {"contended_samples", r.contended_samples},
                     {"contended_samples_ns", r.contended_samples_ns},
                     {"contended", r.contended},
                     {"cpu_ratio", r.cpu_ratio},
                     {"host_busy", r.host_busy},
                     {"load_average", r.load_average},
                     {"stage_median_ns", r.stage_median_ns},
                     {"flops", r.flops},
                     {"gflops_per_s", r.gflops_per_s},
                     {"tokens_per_s", r.tokens_per_s},
                     {"peak_tensor_bytes", r.peak_tensor_bytes},
                     {"peak_owned_bytes", r.peak_owned_bytes},
                     {"workspace_bytes", r.workspace_bytes},
                     {"saved_bytes", r.saved_bytes},
                     {"tokens_dropped", r.tokens_dropped},
                     {"expert_load", r.expert_load},
                     {"gradient_note", r.gradient_note},
                     {"decode_tokens", r.decode_tokens},
                     {"prefill_ns", r.prefill_ns},
                     {"state_bytes", r.state_bytes},
                     {"estimated_workspace_bytes", r.estimated_workspace_bytes},
                     {"peak_rss_bytes", r.peak_rss_bytes},
                     {"warnings", r.warnings},
                     {"reproducer", r.reproducer}};
}

namespace {

// Sanity bounds (docs/report-schema.md#validation): sizes up to 2^40, times up to 1e18 ns
// (about 31 years), other figures up to 1e18; byte and FLOP counts any non-negative int64.
constexpr std::int64_t kMaxSize = std::int64_t{1} << 40;
constexpr std::int64_t kMaxCount = std::numeric_limits<std::int64_t>::max();
constexpr double kMaxNs = 1e18, kMaxFigure = 1e18;

void check_sizes(const ResultRow& r, const FieldReader& f) {
  if (checked_product({r.batch, r.heads, r.seq_len, r.head_dim}) < 0)
    throw InputError(f.path("batch") + " × heads × seq_len × head_dim: overflows a 64-bit integer");
}

// An ok row carries a measurement: samples, a positive median between min and max.
void check_measurement(const ResultRow& r, const FieldReader& f) {
  if (r.status != Status::Ok) return;
  if (r.samples_ns.empty()) throw InputError(f.path("samples_ns") + ": must hold at least one sample for an ok row");
  if (!(r.median_ns > 0)) throw InputError(f.path("median_ns") + ": must be > 0 for an ok row, got 0");
  if (r.min_ns > r.median_ns)
    throw InputError(f.path("min_ns") + ": must be <= median_ns for an ok row, got " + describe_json(r.min_ns));
  if (f.has("max_ns") && r.max_ns < r.median_ns)
    throw InputError(f.path("max_ns") + ": must be >= median_ns for an ok row, got " + describe_json(r.max_ns));
}

void read_identity(ResultRow& r, const FieldReader& f) {
  r.model = f.name("model");
  r.classes = f.texts("classes");
  r.scope = parse_scope(f.choice("scope", {"attention", "layer"}));
  r.pass = parse_pass(f.choice("pass", {"forward", "backward", "train", "decode"}, "forward"));
  r.causal = f.flag("causal");
  r.dtype = parse_dtype(f.choice("dtype", {"f32", "bf16"}, "f32"));
  r.batch = f.integer("batch", 1, kMaxSize);
  r.heads = f.integer("heads", 1, kMaxSize);
  r.seq_len = f.integer("seq_len", 1, kMaxSize);
  r.head_dim = f.integer("head_dim", 1, kMaxSize);
  check_sizes(r, f);
  r.out_len = f.integer("out_len", 1, r.seq_len, r.seq_len);
  r.d_ff = f.integer("d_ff", 0, kMaxSize, 0);
  r.ffn = f.choice("ffn", {"dense", "switch", "gshard"}, "dense");
  r.experts = f.integer("experts", 0, kMaxSize, 0);
  r.capacity_factor = f.number("capacity_factor", 0, kMaxFigure, 0.0);
  r.group_size = f.integer("group_size", 0, kMaxSize, 0);
  r.params = f.scalar_object("params");
  r.threads = static_cast<int>(f.integer("threads", 0, 1 << 20, 0));
  r.kernel_isa = f.text("kernel_isa", "");
  r.seed = f.unsigned_integer("seed", 0);
  r.status = parse_status(f.choice("status", {"ok", "skipped", "unsupported", "error"}));
  r.reason = f.text("reason");
}

void read_timing(ResultRow& r, const FieldReader& f) {
  r.samples_ns = f.numbers("samples_ns", 0, kMaxNs);
  r.median_ns = f.number("median_ns", 0, kMaxNs);
  r.min_ns = f.number("min_ns", 0, kMaxNs);
  r.max_ns = f.number("max_ns", 0, kMaxNs, 0.0);
  r.mad_ns = f.number("mad_ns", 0, kMaxNs);
  r.cv = f.number("cv", 0, kMaxFigure);
  r.unstable = f.flag("unstable");
  r.contended_samples = f.integer("contended_samples", 0, kMaxCount, 0);
  r.contended_samples_ns = f.numbers("contended_samples_ns", 0, kMaxNs, true);
  r.contended = f.flag("contended", false);
  r.cpu_ratio = f.number("cpu_ratio", 0, kMaxFigure, 0.0);
  r.host_busy = f.number("host_busy", 0, 1, 0.0);
  r.load_average = f.number("load_average", 0, kMaxFigure, 0.0);
  r.stage_median_ns = f.number_map("stage_median_ns", 0, kMaxNs, true);
  check_measurement(r, f);
}

void read_work(ResultRow& r, const FieldReader& f) {
  r.flops = f.integer("flops", 0, kMaxCount);
  r.gflops_per_s = f.number("gflops_per_s", 0, kMaxFigure);
  r.tokens_per_s = f.number("tokens_per_s", 0, kMaxFigure);
  r.peak_tensor_bytes = f.integer("peak_tensor_bytes", 0, kMaxCount);
  r.peak_owned_bytes = f.integer("peak_owned_bytes", -1, kMaxCount, -1);
  r.workspace_bytes = f.integer("workspace_bytes", 0, kMaxCount);
  r.saved_bytes = f.integer("saved_bytes", 0, kMaxCount, 0);
  r.tokens_dropped = f.integer("tokens_dropped", 0, kMaxCount, 0);
  r.expert_load = f.number("expert_load", 0, kMaxFigure, 0.0);
  r.gradient_note = f.text("gradient_note", "");
  r.decode_tokens = f.integer("decode_tokens", 0, kMaxSize, 0);
  r.prefill_ns = f.number("prefill_ns", 0, kMaxNs, 0.0);
  r.state_bytes = f.integer("state_bytes", 0, kMaxCount, 0);
  r.estimated_workspace_bytes = f.integer("estimated_workspace_bytes", 0, kMaxCount, 0);
  r.peak_rss_bytes = f.integer("peak_rss_bytes", 0, kMaxCount);
  r.warnings = f.texts("warnings", true);
  r.reproducer = f.text("reproducer");
}

void check_machine_figures(const FieldReader& f) {
  for (const char* field : kMachineFigureFields)
    if (f.has(field)) f.number(field, 0, kMaxFigure);
  if (f.has(kMachineContendedField)) f.flag(kMachineContendedField);
}

// The context fields commands read or compare, where present: strings, non-negative numbers;
// `machine_by_threads` keyed by thread counts (1 … 2^20, decimal), each entry's figures numbers.
void check_context(const nlohmann::json& context) {
  const FieldReader f(context, "context");
  for (const char* field : {"cpu_model", "onednn_version", "onednn_commit", "onednn_isa", "kernel_isa", "compiler",
                            "cxx_flags", "build_type", "xfbench_version", "git_commit", "date", "host", "command_line"})
    if (f.has(field)) f.text(field);
  check_machine_figures(f);
  const nlohmann::json by_threads = f.object("machine_by_threads", true);
  for (const auto& [threads, figures] : by_threads.items()) {
    const bool digits = !threads.empty() && threads.size() <= 7 &&
                        std::all_of(threads.begin(), threads.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (!digits || std::stol(threads) < 1 || std::stol(threads) > (1 << 20))
      f.fail("machine_by_threads", "must be keyed by thread counts from 1 to 1048576", nullptr);
    check_machine_figures(FieldReader(figures, f.path("machine_by_threads." + threads)));
  }
  for (const char* field : {"logical_cores", "threads"})
    if (f.has(field)) f.integer(field, 0, 1 << 20);
  if (f.has("isa_flags")) f.texts("isa_flags");
}

void check_settings(const nlohmann::json& settings) {
  const FieldReader f(settings, "settings");
  for (const char* field : {"shard", "preset", "pass"})
    if (f.has(field)) f.text(field);
  if (f.has("scope") && settings["scope"].is_array())  // a grid over scopes lists them
    f.texts("scope");
  else if (f.has("scope"))
    f.text("scope");
  if (f.has("models")) f.texts("models");
}

}  // namespace

ResultRow read_result_row(const nlohmann::json& j, const std::string& where) {
  const FieldReader f(j, where);
  ResultRow r;
  read_identity(r, f);
  read_timing(r, f);
  read_work(r, f);
  return r;
}

void from_json(const nlohmann::json& j, ResultRow& r) { r = read_result_row(j, "result row"); }

nlohmann::json report_to_json(const Report& report) {
  return nlohmann::json{{"schema_version", kSchemaVersion},
                        {"tool", "xfbench"},
                        {"context", report.context},
                        {"settings", report.settings},
                        {"results", report.results}};
}

Report report_from_json(const nlohmann::json& j) {
  const FieldReader f(j, "");
  if (f.text("tool") != "xfbench") f.fail("tool", "\"xfbench\"", &j["tool"]);
  const auto version = f.integer("schema_version", 1, std::numeric_limits<std::int64_t>::max());
  if (version > kSchemaVersion)
    throw InputError("schema_version " + std::to_string(version) + " is newer than this build's " +
                     std::to_string(kSchemaVersion) + "; use a newer xfbench");
  Report report;
  report.context = f.object("context");
  report.settings = f.object("settings");
  check_context(report.context);
  check_settings(report.settings);
  if (!f.has("results") || !j["results"].is_array())
    f.fail("results", "an array of result rows", f.has("results") ? &j["results"] : nullptr);
  const auto& rows = j["results"];
  report.results.reserve(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i)
    report.results.push_back(read_result_row(rows[i], "results[" + std::to_string(i) + "]"));
  return report;
}

Report load_report(const std::string& path) {
  const nlohmann::json j = parse_json_text(read_input_file(path), path);
  try {
    return report_from_json(j);
  } catch (const InputError& e) {
    throw InputError(path + ": " + e.what());
  }
}

Report load_nonempty_report(const std::string& path) {
  Report report = load_report(path);
  if (report.results.empty()) throw InputError(path + ": report has no results");
  return report;
}

void require_known_models(const Report& report, const std::string& path) {
  for (std::size_t i = 0; i < report.results.size(); ++i)
    if (find_card(report.results[i].model) == nullptr)
      throw InputError(path + ": results[" + std::to_string(i) + "].model: unknown model " +
                       quoted(report.results[i].model) + " (not in this build's registry)");
}

void require_model(const Report& report, const std::string& model, const std::string& path, const std::string& option) {
  for (const auto& row : report.results)
    if (row.model == model) return;
  throw InputError(option + " " + quoted(model) + ": " + path + " has no row of that model");
}

void save_report_atomically(const Report& report, const std::string& path) {
  write_file_atomically(path, report_to_json(report).dump(2) + "\n");
}

}  // namespace xfb
