#pragma once
// The versioned JSON report: { schema_version, tool, context, settings, results: [ResultRow] }.
// docs/report-schema.md documents every field; bump kSchemaVersion on any incompatible change.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lib/core/point_config.hpp"

#include "apps/report/files.hpp"

namespace xfb {

inline constexpr int kSchemaVersion = 1;

struct ResultRow {
  std::string model;
  std::vector<std::string> classes;  // class names, e.g. {"fixed_patterns", "memory"}
  Scope scope = Scope::Attention;
  Pass pass = Pass::Forward;  // what was timed
  bool causal = false;
  DType dtype = DType::F32;  // element type of q, k, v, out and the decode state; f32 in reports that predate it
  std::int64_t batch = 0, heads = 0, seq_len = 0, head_dim = 0;
  // M, output rows per (batch, head): seq_len but for a downsampling model (0, unset, is written as seq_len).
  std::int64_t out_len = 0;
  std::int64_t d_ff = 0;  // layer scope only; 0 otherwise
  // The layer's FFN (docs/layer.md#mixture-of-experts): "dense", "switch" or "gshard"; a mixture's settings
  // (0 for dense) and, once run, its routing: rows whose every choice was dropped past capacity, and the
  // experts' load, max over mean of the token-expert pairs each expert ran (1 = balanced; 0 for dense).
  std::string ffn = "dense";
  std::int64_t experts = 0, group_size = 0;
  double capacity_factor = 0;
  std::int64_t tokens_dropped = 0;
  double expert_load = 0;
  nlohmann::json params = nlohmann::json::object();  // resolved mechanism parameters
  int threads = 0;
  std::string kernel_isa;  // vector ISA of the project's kernels that ran (lib/core/cpu_isa.hpp)
  std::uint64_t seed = 0;
  Status status = Status::Ok;
  std::string reason;              // why the point is not ok; empty when ok
  std::vector<double> samples_ns;  // every timed repetition, nanoseconds
  double median_ns = 0, min_ns = 0, max_ns = 0, mad_ns = 0, cv = 0;
  bool unstable = false;  // cv > 5%, or a single sample (its spread unknown)
  // Contention (lib/core/contention.hpp): samples during which the point's threads waited for a CPU
  // are kept apart in `contended_samples_ns` and left out of the statistics above.
  std::int64_t contended_samples = 0;             // timed repetitions marked descheduled
  std::vector<double> contended_samples_ns;       // their wall times, nanoseconds
  bool contended = false;                         // too few clean samples: time figures are not trustworthy
  double cpu_ratio = 0;                           // median over clean samples of cpu time / (wall · threads)
  double host_busy = 0;                           // other processes' + steal share of all CPUs while timed
  double load_average = 0;                        // 1-minute load average after timing
  std::map<std::string, double> stage_median_ns;  // median per stage (see stage_clock.hpp); often empty
  std::int64_t flops = 0;                         // executed in one timed call (counter): forward, backward, or both
  double gflops_per_s = 0;                        // flops / median
  double tokens_per_s = 0;                        // batch·seq_len / median
  std::int64_t peak_tensor_bytes = 0;             // tracked bytes live at the peak, inputs and output included
  std::int64_t peak_owned_bytes = -1;             // same, the project's own tensors only (no oneDNN scratchpad):
                                                  // machine-independent; -1 in reports that predate it
  std::int64_t workspace_bytes = 0;               // peak_tensor_bytes minus inputs and output (and, for the
                                                  // backward and train passes, dO and the input gradients:
                                                  // dq, dk, dv in attention scope, dx in layer scope)
  std::int64_t saved_bytes = 0;                   // tracked bytes the forward keeps for the backward (0: forward pass)
  std::string gradient_note;  // what the backward holds constant (Mechanism::gradient_note); "" if nothing
  // Decode pass: samples and statistics above are per generated token (one step of B sequences),
  // flops those of the decode_tokens steps (prefill excluded), gflops_per_s = flops / tokens / median,
  // tokens_per_s = batch / median.
  std::int64_t decode_tokens = 0;              // tokens generated after the N-token context (0: other passes)
  double prefill_ns = 0;                       // median time of the prefill (the context's forward + state)
  std::int64_t state_bytes = 0;                // tracked bytes kept between steps at the end of the run
  std::int64_t estimated_workspace_bytes = 0;  // the registry's analytic estimate
  std::int64_t peak_rss_bytes = 0;             // of the process that ran the point
  std::vector<std::string> warnings;
  std::string reproducer;  // the `xfbench run …` command for this point

  // Points are matched across reports by this key.
  std::string key() const;
};

// "attention, B=1 H=8 D=64" (+ ", train pass", ", causal", ", bf16", ", T=…", ", d_ff=…"): everything of the key but
// model, N, params.
std::string configuration_text(const ResultRow& row);
// "block_k=512,block_q=64"; empty for no parameters.
std::string params_text(const nlohmann::json& params);

// One number through a printf pattern ("%.2f×"): how report code spells the figures it prints.
std::string format_number(const char* pattern, double value);

// numerator / denominator when the denominator is positive and the quotient finite: the one way
// report code divides figures it prints, so no table or chart shows nan or inf.
std::optional<double> finite_ratio(double numerator, double denominator);

// The machine figures a context carries when measured (apps/bench/system_info.hpp's
// MachineMeasurement), top level or per thread count under `machine_by_threads`.
inline constexpr const char* kMachineFigureFields[] = {"fma_peak_gflops", "fma_peak_256_gflops", "fma_peak_512_gflops",
                                                       "bf16_dot_peak_gflops", "triad_bandwidth_gbs"};
// Beside them, a boolean: true when some figure had no undisturbed trial (MachineMeasurement).
inline constexpr const char* kMachineContendedField = "machine_contended";

// The measured FMA peak (GFLOP/s) a row that ran on `threads` threads is quoted against: the
// context's `machine_by_threads` entry for that count, else `fma_peak_gflops` when the context ran
// that count (or the row predates the field, threads 0); 0 when not measured for it.
double fma_peak_for_threads(const nlohmann::json& context, int threads);
// The peak a row's GFLOP/s is quoted against, by its dtype: fma_peak_for_threads for an f32 row,
// the context's `bf16_dot_peak_gflops` (top level or per thread count, as above) for a bf16 row;
// 0 when that figure is not measured (the caller says so rather than using the fp32 peak).
double dot_peak_for_row(const nlohmann::json& context, const ResultRow& row);
// Whether that peak was measured with no undisturbed trial (`machine_contended`): it may read low,
// so a share of it is an upper bound.
bool peak_contended_for_row(const nlohmann::json& context, const ResultRow& row);

// The row's contention warning (the one in `warnings` that starts "contended:"), or a summary.
std::string contended_warning(const ResultRow& row);

void to_json(nlohmann::json& j, const ResultRow& row);
// The reader of rows: every field checked for type and range (docs/report-schema.md#validation);
// throws InputError "<where>.<field>: must be …, got …" on the first violation.
ResultRow read_result_row(const nlohmann::json& j, const std::string& where);
void from_json(const nlohmann::json& j, ResultRow& row);  // read_result_row(j, "result row")

struct Report {
  nlohmann::json context = nlohmann::json::object();
  nlohmann::json settings = nlohmann::json::object();
  std::vector<ResultRow> results;
};

nlohmann::json report_to_json(const Report& report);
// The one reader of reports: tool "xfbench", schema_version 1…kSchemaVersion, context and
// settings objects (the fields commands use type-checked), every row through read_result_row.
// Throws InputError with a one-line message naming the field.
Report report_from_json(const nlohmann::json& j);
// report_from_json of a file read with read_input_file (regular, non-empty, bounded size; never
// blocks); every message starts with the path.
Report load_report(const std::string& path);
// load_report, and an InputError when the report has no results (for commands that analyse one).
Report load_nonempty_report(const std::string& path);
// For commands that need registry facts: InputError "PATH: results[i].model: unknown model …"
// for the first row whose model this build does not know.
void require_known_models(const Report& report, const std::string& path);
// InputError "OPTION 'model': PATH has no row of that model" unless a row has it.
void require_model(const Report& report, const std::string& model, const std::string& path, const std::string& option);
// Whether the rows differ in threads or seed (a grid, or merged runs): tables and plots then split
// by them, one table or panel per value.
struct RowsVary {
  bool threads = false, seed = false;
};
RowsVary rows_vary(const Report& report);

// write_file_atomically of the report's JSON.
void save_report_atomically(const Report& report, const std::string& path);

}  // namespace xfb
