#include "lib/report/report.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "lib/core/errors.hpp"
#include "lib/report/point_fields.hpp"

namespace xfb {

std::string status_name(Status s) {
  switch (s) {
    case Status::Ok: return "ok";
    case Status::Skipped: return "skipped";
    case Status::Unsupported: return "unsupported";
    case Status::Error: return "error";
  }
  return "error";
}

Status parse_status(const std::string& s) {
  if (s == "ok") return Status::Ok;
  if (s == "skipped") return Status::Skipped;
  if (s == "unsupported") return Status::Unsupported;
  if (s == "error") return Status::Error;
  throw InputError("unknown status '" + s + "'");
}

std::string ResultRow::key() const { return point_key(*this); }

std::string configuration_text(const ResultRow& row) {
  std::ostringstream out;
  out << row.scope << (row.pass != "forward" ? ", " + row.pass + " pass" : "") << (row.causal ? ", causal" : "")
      << ", B=" << row.batch << " H=" << row.heads << " D=" << row.head_dim;
  if (row.pass == "decode") out << ", T=" << row.decode_tokens;
  if (row.d_ff) out << ", d_ff=" << row.d_ff;
  return out.str();
}

std::string params_text(const nlohmann::json& params) {
  std::string text;
  for (const auto& [key, value] : params.items())
    text += (text.empty() ? "" : ",") + key + "=" + (value.is_string() ? value.get<std::string>() : value.dump());
  return text;
}

std::string contended_warning(const ResultRow& row) {
  for (const auto& warning : row.warnings)
    if (warning.rfind("contended:", 0) == 0) return warning;
  return "contended: " + std::to_string(row.contended_samples) + " timed samples waited for a CPU";
}

void to_json(nlohmann::json& j, const ResultRow& r) {
  j = nlohmann::json{{"model", r.model},
                     {"classes", r.classes},
                     {"scope", r.scope},
                     {"pass", r.pass},
                     {"causal", r.causal},
                     {"batch", r.batch},
                     {"heads", r.heads},
                     {"seq_len", r.seq_len},
                     {"head_dim", r.head_dim},
                     {"d_ff", r.d_ff},
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
                     {"gradient_note", r.gradient_note},
                     {"decode_tokens", r.decode_tokens},
                     {"prefill_ns", r.prefill_ns},
                     {"state_bytes", r.state_bytes},
                     {"estimated_workspace_bytes", r.estimated_workspace_bytes},
                     {"peak_rss_bytes", r.peak_rss_bytes},
                     {"warnings", r.warnings},
                     {"reproducer", r.reproducer}};
}

void from_json(const nlohmann::json& j, ResultRow& r) {
  try {
    j.at("model").get_to(r.model);
    j.at("classes").get_to(r.classes);
    j.at("scope").get_to(r.scope);
    r.pass = j.value("pass", std::string("forward"));
    j.at("causal").get_to(r.causal);
    j.at("batch").get_to(r.batch);
    j.at("heads").get_to(r.heads);
    j.at("seq_len").get_to(r.seq_len);
    j.at("head_dim").get_to(r.head_dim);
    r.d_ff = j.value("d_ff", std::int64_t{0});
    r.params = j.at("params");
    r.threads = j.value("threads", 0);
    r.kernel_isa = j.value("kernel_isa", std::string{});
    r.seed = j.value("seed", std::uint64_t{0});
    r.status = parse_status(j.at("status").get<std::string>());
    j.at("reason").get_to(r.reason);
    j.at("samples_ns").get_to(r.samples_ns);
    j.at("median_ns").get_to(r.median_ns);
    j.at("min_ns").get_to(r.min_ns);
    r.max_ns = j.value("max_ns", 0.0);
    j.at("mad_ns").get_to(r.mad_ns);
    j.at("cv").get_to(r.cv);
    j.at("unstable").get_to(r.unstable);
    r.contended_samples = j.value("contended_samples", std::int64_t{0});
    r.contended_samples_ns = j.value("contended_samples_ns", std::vector<double>{});
    r.contended = j.value("contended", false);
    r.cpu_ratio = j.value("cpu_ratio", 0.0);
    r.host_busy = j.value("host_busy", 0.0);
    r.load_average = j.value("load_average", 0.0);
    r.stage_median_ns = j.value("stage_median_ns", std::map<std::string, double>{});
    j.at("flops").get_to(r.flops);
    j.at("gflops_per_s").get_to(r.gflops_per_s);
    j.at("tokens_per_s").get_to(r.tokens_per_s);
    j.at("peak_tensor_bytes").get_to(r.peak_tensor_bytes);
    r.peak_owned_bytes = j.value("peak_owned_bytes", std::int64_t{-1});
    j.at("workspace_bytes").get_to(r.workspace_bytes);
    r.saved_bytes = j.value("saved_bytes", std::int64_t{0});
    r.gradient_note = j.value("gradient_note", std::string{});
    r.decode_tokens = j.value("decode_tokens", std::int64_t{0});
    r.prefill_ns = j.value("prefill_ns", 0.0);
    r.state_bytes = j.value("state_bytes", std::int64_t{0});
    r.estimated_workspace_bytes = j.value("estimated_workspace_bytes", std::int64_t{0});
    j.at("peak_rss_bytes").get_to(r.peak_rss_bytes);
    r.warnings = j.value("warnings", std::vector<std::string>{});
    j.at("reproducer").get_to(r.reproducer);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(std::string("malformed result row: ") + e.what());
  }
}

nlohmann::json report_to_json(const Report& report) {
  return nlohmann::json{{"schema_version", kSchemaVersion},
                        {"tool", "xfbench"},
                        {"context", report.context},
                        {"settings", report.settings},
                        {"results", report.results}};
}

Report report_from_json(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("schema_version")) throw InputError("not an xfbench report (no schema_version)");
  if (!j["schema_version"].is_number_integer()) throw InputError("schema_version is not an integer");
  const int version = j["schema_version"].get<int>();
  if (version > kSchemaVersion)
    throw InputError("report has schema_version " + std::to_string(version) + ", newer than this build's " +
                     std::to_string(kSchemaVersion));
  if (version < 1) throw InputError("invalid schema_version " + std::to_string(version));
  if (!j.contains("results") || !j["results"].is_array()) throw InputError("report has no results array");
  Report report;
  report.context = j.value("context", nlohmann::json::object());
  report.settings = j.value("settings", nlohmann::json::object());
  for (const auto& row : j["results"]) report.results.push_back(row.get<ResultRow>());
  return report;
}

Report load_report(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot read report " + path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": invalid JSON (" + std::string(e.what()) + ")");
  }
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

void write_file_atomically(const std::string& path, const std::string& content) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    if (!out) throw InputError("cannot write " + path);
    out << content;
    out.flush();
    if (!out) throw std::runtime_error("failed writing " + temporary);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename onto " + path);
}

void save_report_atomically(const Report& report, const std::string& path) {
  write_file_atomically(path, report_to_json(report).dump(2) + "\n");
}

}  // namespace xfb
