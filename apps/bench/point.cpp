#include "apps/bench/point.hpp"

#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "apps/bench/workload.hpp"
#include "apps/report/files.hpp"
#include "apps/report/point_fields.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/npy.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/stats.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "taxonomy/registry.hpp"

namespace xfb {

namespace {

const ModelInfo& model_or_throw(const std::string& name) {
  const ModelInfo* model = find_model(name);
  if (model == nullptr) {
    std::string known;
    for (const auto& m : registry()) known += (known.empty() ? "" : ", ") + m.name;
    throw InputError("unknown model '" + name + "' (known: " + known + ")");
  }
  return *model;
}

std::int64_t peak_rss_of_self() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

// The dump's manifest: the settings, the values that ran (`params`: derived defaults computed, blocks
// clamped), the row's as asked for (`requested_params`), the layout and every file with its shape.
nlohmann::json dump_manifest(const Point& point, const ResultRow& row,
                             const std::vector<std::pair<std::string, const Tensor*>>& files) {
  nlohmann::json manifest = point_settings(point.config);
  manifest["model"] = point.config.model;
  manifest["seq_len"] = point.config.problem.seq_len;
  manifest["out_len"] = row.out_len;
  manifest["params"] = point.running.to_json();
  manifest["requested_params"] = row.params;
  manifest["layout"] =
      "attention tensors are [B, H, N, D] (out and dout [B, H, M, D], M = out_len); little-endian float32, C order";
  if (point.config.problem.dtype == DType::BF16)
    manifest["dtype_note"] =
        point.config.scope == Scope::Layer
            ? "dtype bf16: x, out, dout, dx, q, k, v, attention_out, attention_dout, dq, dk, dv and the layer's weight "
              "matrices (layer_w_qkv, layer_w_o, layer_w_1, layer_w_2, moe_w_1, moe_w_2) hold bf16 values, written as "
              "the float32 values exactly equal to them (bf16 widens exactly); LayerNorm gains and shifts, "
              "moe_w_router, "
              "the routing, every weight's gradient and the mechanism's parameters are float32 as the layer holds them"
            : "dtype bf16: q, k, v, out, dout, dq, dk, dv and state_* hold bf16 values, written as the float32 values "
              "exactly equal to them (bf16 widens exactly); parameters are float32 as the model holds them";
  if (point.config.pass == Pass::Decode)
    manifest["decode"] = "q, k, v hold the " + std::to_string(point.config.problem.seq_len) +
                         " context rows and out the " + std::to_string(row.out_len) +
                         " rows of the prefill's output, then the " + std::to_string(point.config.decode_tokens) +
                         " decoded tokens' rows; state_* is the state after the last step";
  manifest["reproducer"] = row.reproducer;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [name, tensor] : files)
    list.push_back({{"name", name}, {"file", name + ".npy"}, {"shape", tensor->shape()}});
  manifest["files"] = list;
  return manifest;
}

// The folder `dir` (new, or an empty one) with every file as <name>.npy and manifest.json, whole or
// not at all: written into a temporary sibling folder that is renamed onto `dir` at the end and
// removed on any failure.
void write_dump(const std::string& dir, const Point& point, const ResultRow& row,
                const std::vector<std::pair<std::string, const Tensor*>>& files) {
  std::string pattern = std::filesystem::absolute(dir).lexically_normal().string();
  while (pattern.size() > 1 && pattern.back() == '/') pattern.pop_back();
  pattern += ".partial-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("cannot create a folder beside " + dir);
  const UnfinishedOutput unfinished(pattern, /*folder=*/true);
  try {
    for (const auto& [name, tensor] : files) write_npy(pattern + "/" + name + ".npy", *tensor);
    write_file_atomically(pattern + "/manifest.json", dump_manifest(point, row, files).dump(2) + "\n");
    if (std::rename(pattern.c_str(), dir.c_str()) != 0) throw std::runtime_error("cannot move the dump onto " + dir);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove_all(pattern, ignored);
    throw;
  }
}

// The timing figures of a row from its timed samples: statistics over the clean ones, contention,
// stage medians, and the warnings about the measurement.
void record_timing(ResultRow& row, const TimingResult& timed) {
  // With no clean sample at all, the statistics fall back to every sample (the row is contended).
  row.samples_ns = timed.samples_ns.empty() ? timed.contended_samples_ns : timed.samples_ns;
  row.contended_samples_ns = timed.samples_ns.empty() ? std::vector<double>{} : timed.contended_samples_ns;
  row.contended_samples = static_cast<std::int64_t>(timed.contended_samples_ns.size());
  row.contended = timed.contended;
  row.cpu_ratio = timed.contention.cpu_ratio;
  row.host_busy = timed.contention.host_busy;
  row.load_average = timed.contention.load_average;
  if (row.contended)
    row.warnings.push_back(contention_reason(row.contended_samples,
                                             row.contended_samples + static_cast<std::int64_t>(timed.samples_ns.size()),
                                             timed.contention));
  const SampleStats stats = summarize(row.samples_ns);
  row.median_ns = stats.median;
  row.min_ns = stats.min;
  row.max_ns = stats.max;
  row.mad_ns = stats.mad;
  row.cv = stats.cv;
  row.unstable = stats.cv > kUnstableCv || row.samples_ns.size() < 2;  // one sample: a spread never seen
  for (const auto& [stage, samples] : timed.stage_samples_ns) row.stage_median_ns[stage] = summarize(samples).median;
  if (timed.primitives_created_while_timed > 0)
    row.warnings.push_back(std::to_string(timed.primitives_created_while_timed) +
                           " oneDNN primitive(s) were created inside the timed region");
  if (!optimised_build())
    row.warnings.push_back("this build is not optimised (" XFBENCH_BUILD_TYPE "): times are not representative");
}

// The decode pass's inputs, drawn untimed: the context's q, k, v are rows [0, N) of the seeded
// N + T token sequence (the same draws as a causal forward over N + T tokens), step t's token is
// row N + t ([B, H, 1, D] each), with an output per step.
struct DecodeInputs {
  std::array<Tensor, 3> context;  // q, k, v of the N context tokens
  Tensor out;                     // the prefill's output
  std::vector<std::array<Tensor, 3>> steps;
  std::vector<Tensor> step_out;

  DecodeInputs(const Problem& p, std::int64_t out_rows, std::int64_t tokens, std::uint64_t seed) {
    constexpr std::array<const char*, 3> kStreams = {"input/q", "input/k", "input/v"};
    const std::int64_t total = p.seq_len + tokens;
    for (std::size_t i = 0; i < 3; ++i) {
      context[i] = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, p.dtype);
      CounterRng(seed, kStreams[i]).fill_normal_rows(context[i], total, 0);
    }
    out = Tensor::bhnd(p.batch, p.heads, out_rows, p.head_dim, p.dtype);
    steps.resize(static_cast<std::size_t>(tokens));
    step_out.resize(static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::size_t i = 0; i < 3; ++i) {
        steps[t][i] = Tensor::bhnd(p.batch, p.heads, 1, p.head_dim, p.dtype);
        CounterRng(seed, kStreams[i]).fill_normal_rows(steps[t][i], total, p.seq_len + t);
      }
      step_out[t] = Tensor::bhnd(p.batch, p.heads, 1, p.head_dim, p.dtype);
    }
  }

  // Reads step t's q, k, v and output row untimed: a step's token arrives in cache, as a decoder's
  // projection would leave it (after a long prefill they would otherwise come from memory).
  void bring_to_cache(std::int64_t t) const {
    static volatile unsigned sink = 0;
    unsigned sum = 0;
    for (const Tensor* tensor : {&steps[t][0], &steps[t][1], &steps[t][2], &step_out[t]}) {
      const auto* bytes = static_cast<const unsigned char*>(tensor->raw_data());  // f32 or bf16 alike
      for (std::int64_t i = 0; i < tensor->bytes(); i += 16) sum += bytes[i];     // every cache line (and more)
    }
    sink = sink + sum;
  }

  // Input i (0 q, 1 k, 2 v, 3 out) over the whole sequence, context rows then decoded rows:
  // [B, H, N + T, D] (out: [B, H, M + T, D], the prefill's M rows then the steps').
  Tensor whole_sequence(std::size_t i) const {
    const Tensor& head_rows = i < 3 ? context[i] : out;
    const std::int64_t b_count = head_rows.dim(0), h_count = head_rows.dim(1), n = head_rows.dim(2),
                       d = head_rows.dim(3), tokens = static_cast<std::int64_t>(steps.size());
    Tensor whole = Tensor::bhnd(b_count, h_count, n + tokens, d, head_rows.dtype());
    const auto row_bytes = static_cast<std::size_t>(d * element_bytes(head_rows.dtype()));
    auto head_of = [&](const Tensor& tensor, std::int64_t b, std::int64_t h, std::int64_t rows) {
      return static_cast<const unsigned char*>(tensor.raw_data()) + (b * h_count + h) * rows * row_bytes;
    };
    for (std::int64_t b = 0; b < b_count; ++b)
      for (std::int64_t h = 0; h < h_count; ++h) {
        auto* dst = static_cast<unsigned char*>(whole.raw_data()) + (b * h_count + h) * (n + tokens) * row_bytes;
        std::memcpy(dst, head_of(head_rows, b, h, n), n * row_bytes);
        for (std::int64_t t = 0; t < tokens; ++t)
          std::memcpy(dst + (n + t) * row_bytes, head_of(i < 3 ? steps[t][i] : step_out[t], b, h, 1), row_bytes);
      }
    return whole;
  }
};

// The decode pass: a prefill of the N-token context, then decode_tokens steps of one token each.
// The first run is untimed (primitives; the steps' executed FLOPs), then time_decoding.
ResultRow run_decode_point(const Point& point, ResultRow row, const std::optional<std::string>& dump_dir) {
  const PointConfig& config = point.config;
  const Problem& p = config.problem;
  const std::int64_t tokens = config.decode_tokens;
  DnnlContext::instance().set_threads(p.threads);
  auto& tracker = MemoryTracker::instance();
  const std::int64_t baseline = tracker.current_bytes();
  const std::int64_t owned_baseline = tracker.owned_current_bytes();
  tracker.reset_peak();

  DecodeInputs in(p, point_output_rows(point), tokens, config.seed);
  auto mechanism = point.model->impl.create(p, point.requested, config.seed);
  mechanism->prepare(in.context[0], in.context[1], in.context[2]);
  mechanism->prepare_decode(tokens);
  auto prefill = [&] { mechanism->forward(in.context[0], in.context[1], in.context[2], in.out); };
  auto step = [&](std::int64_t t) {
    const auto& token = in.steps[t];
    mechanism->decode_step(token[0], token[1], token[2], in.step_out[t]);
  };
  prefill();
  FlopCounter::reset();
  for (std::int64_t t = 0; t < tokens; ++t) step(t);
  row.flops = FlopCounter::total();

  TimingSettings timing = config.timing;
  timing.warmup -= 1;
  const DecodeTimingResult timed =
      time_decoding(timing, tokens, prefill, step, [&](std::int64_t t) { in.bring_to_cache(t); });

  row.peak_tensor_bytes = tracker.peak_bytes() - baseline;
  row.peak_owned_bytes = tracker.owned_peak_bytes() - owned_baseline;
  row.workspace_bytes = row.peak_tensor_bytes - point_io_bytes(point);
  row.state_bytes = mechanism->state_bytes();
  record_timing(row, timed.steps);
  row.prefill_ns = median_of(timed.prefill_ns);
  const double per_token_ns = row.median_ns;
  row.gflops_per_s = per_token_ns > 0 ? static_cast<double>(row.flops) / static_cast<double>(tokens) / per_token_ns : 0;
  row.tokens_per_s = per_token_ns > 0 ? static_cast<double>(p.batch) / (per_token_ns * 1e-9) : 0;

  if (dump_dir) {
    const std::array<Tensor, 4> whole = {in.whole_sequence(0), in.whole_sequence(1), in.whole_sequence(2),
                                         in.whole_sequence(3)};
    std::vector<std::pair<std::string, const Tensor*>> files = {
        {"q", &whole[0]}, {"k", &whole[1]}, {"v", &whole[2]}, {"out", &whole[3]}};
    for (const auto& named : mechanism->parameters()) files.emplace_back(named.name, named.tensor);
    for (const auto& named : mechanism->decode_parameters()) files.emplace_back("decode_" + named.name, named.tensor);
    for (const auto& named : mechanism->decode_state()) files.emplace_back("state_" + named.name, named.tensor);
    write_dump(*dump_dir, point, row, files);
  }
  row.peak_rss_bytes = peak_rss_of_self();
  return row;
}

}  // namespace

std::string bf16_unsupported(const ModelInfo& model, const PointConfig& config) {
  if (config.problem.dtype != DType::BF16) return "";
  const std::string name = model.display_name;
  if (!model.impl.bf16_forward) return name + " has no bf16 form yet (issue 31), so no bf16 point";
  if ((config.pass == Pass::Backward || config.pass == Pass::Train) && !model.impl.bf16_backward)
    return name + " has no bf16 backward yet, so no bf16 " + pass_name(config.pass) + " pass";
  return "";
}

Point resolve_point(const PointConfig& config) {
  for (const auto& field : point_fields()) check_field_value(field, field.get(config), field.long_flag());
  check_point_config(config);
  const ModelInfo& model = model_or_throw(config.model);
  Point point;
  point.model = &model;
  point.config = config;
  if (config.pass == Pass::Decode) point.config.problem.causal = true;  // decoding is causal by definition
  if (!model.ffn.empty() && config.scope == Scope::Layer) {             // a feed-forward card selects its FFN
    const FfnKind card_ffn = parse_ffn(model.ffn);
    if (config.ffn.kind != FfnKind::Dense && config.ffn.kind != card_ffn)
      throw InputError("model " + model.name + " is the layer with --ffn " + model.ffn + "; got --ffn " +
                       ffn_name(config.ffn.kind));
    point.config.ffn.kind = card_ffn;
    check_point_config(point.config);
  }
  point.requested = resolve_params(config.model, model.impl.params, config.params);
  if (model.impl.validate) model.impl.validate(point.config.problem, point.requested);
  point.running = model.impl.resolved(point.config.problem, point.requested);
  return point;
}

void validate_point(const PointConfig& config) { resolve_point(config); }

std::int64_t point_output_rows(const Point& point) {
  return output_rows_of(point.model->impl, point.config.problem, point.requested);
}

std::int64_t point_io_bytes(const Point& point) {
  const PointConfig& config = point.config;
  const Problem& p = config.problem;
  const std::int64_t row = p.batch * p.heads * p.head_dim * element_bytes(p.dtype);
  const std::int64_t inputs = p.seq_len * row, outputs = point_output_rows(point) * row;
  if (config.pass == Pass::Decode)  // the context's q, k, v, out and every step's
    return 3 * inputs + outputs + 4 * config.decode_tokens * row;
  const bool training = config.pass != Pass::Forward;
  // Attention: q, k, v, out (+ dout, dq, dk, dv); layer: x, y (+ dy, dx).
  if (config.scope == Scope::Layer) return training ? 2 * (inputs + outputs) : inputs + outputs;
  return training ? 6 * inputs + 2 * outputs : 3 * inputs + outputs;
}

std::int64_t point_io_bytes(const PointConfig& config) { return point_io_bytes(resolve_point(config)); }

std::int64_t estimated_point_bytes(const Point& point) {
  const PointConfig& c = point.config;
  std::int64_t bytes = point_io_bytes(point) + point.model->impl.workspace_bytes(c.problem, point.requested);
  if (c.pass == Pass::Decode)
    bytes += point.model->impl.decode_workspace_bytes(c.problem, point.requested, c.decode_tokens);
  else if (c.pass != Pass::Forward)
    bytes += point.model->impl.backward_workspace_bytes(c.problem, point.requested);
  const std::int64_t rows = point_output_rows(point);
  if (c.scope == Scope::Layer) bytes += EncoderLayer::workspace_bytes(c.problem, c.effective_d_ff(), rows, c.ffn);
  if (c.scope == Scope::Layer && c.pass != Pass::Forward)
    bytes += EncoderLayer::backward_workspace_bytes(c.problem, c.effective_d_ff(), rows, c.ffn);
  return bytes;
}

std::optional<std::int64_t> estimated_point_flops(const Point& point) {
  const PointConfig& c = point.config;
  const Implementation& impl = point.model->impl;
  if (c.pass == Pass::Decode || (c.pass != Pass::Forward && !impl.has_backward())) return std::nullopt;
  if (c.scope == Scope::Layer && c.ffn.kind != FfnKind::Dense) return std::nullopt;  // the routing decides
  const std::int64_t rows = point_output_rows(point), d_ff = c.effective_d_ff();
  const bool layer = c.scope == Scope::Layer;
  std::int64_t flops = 0;
  if (c.pass != Pass::Backward)
    flops += impl.flops(c.problem, point.requested) +
             (layer ? EncoderLayer::flops_outside_mechanism(c.problem, d_ff, rows) : 0);
  if (c.pass != Pass::Forward)
    flops += impl.backward_flops(c.problem, point.requested) +
             (layer ? EncoderLayer::backward_flops_outside_mechanism(c.problem, d_ff, rows) : 0);
  return flops;
}

std::string reproducer_command(const Point& point) {
  // A capped kernel ISA is part of what ran.
  std::string command = "xfbench";
  if (kernel_isa() != detected_kernel_isa()) command = "XFBENCH_MAX_ISA=" + kernel_isa_name(kernel_isa()) + " xfbench";
  for (const auto& arg : point_arguments(point.config)) command += " " + arg;
  return command;
}

ResultRow describe_point(const Point& point, std::int64_t memory_limit_bytes) {
  const ModelInfo& model = *point.model;
  const PointConfig& config = point.config;
  ResultRow row;
  set_row_identity(row, config);
  for (auto c : model.classes) row.classes.push_back(class_name(c));
  row.params = point.requested.to_json();
  row.out_len = point_output_rows(point);
  row.kernel_isa = kernel_isa_name(kernel_isa());
  row.reproducer = reproducer_command(point);
  const std::string why = model.impl.unsupported ? model.impl.unsupported(config.problem, point.requested) : "";
  if (!model.ffn.empty() && config.scope == Scope::Attention) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + ": a feed-forward layer: run with --scope layer, or --ffn " + model.ffn +
                 " with any attention model";
  } else if (const std::string bf16_why = bf16_unsupported(model, config); !bf16_why.empty()) {
    row.status = Status::Unsupported;
    row.reason = bf16_why;
  } else if (config.problem.causal && !model.decodes()) {
    row.status = Status::Unsupported;
    const std::string why_not = model.decode_note.empty() ? "survey Table 1: Decode = no" : model.decode_note;
    row.reason = model.display_name + " cannot decode (" + why_not + "), so it has " +
                 (config.pass == Pass::Decode ? "no incremental form" : "no causal mode");
  } else if (!why.empty()) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + ": " + why;
  } else if (config.pass == Pass::Decode && !model.impl.has_decode()) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + " has no incremental form in this build, so no decode pass";
  } else if (config.pass != Pass::Forward && config.pass != Pass::Decode && !model.impl.has_backward()) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + " has no backward pass in this build, so no " + pass_name(row.pass) + " pass";
  } else {
    const std::int64_t estimate = estimated_point_bytes(point);
    row.estimated_workspace_bytes = estimate - point_io_bytes(point);
    if (memory_limit_bytes > 0 && estimate > memory_limit_bytes) {
      row.status = Status::Skipped;
      row.reason = "estimated " + std::to_string(estimate) + " bytes exceed --memory-limit " +
                   std::to_string(memory_limit_bytes);
    }
  }
  return row;
}

ResultRow describe_point(const PointConfig& config, std::int64_t memory_limit_bytes) {
  return describe_point(resolve_point(config), memory_limit_bytes);
}

ResultRow run_point(const PointConfig& config, const std::optional<std::string>& dump_dir) {
  return run_point(resolve_point(config), dump_dir);
}

ResultRow run_point(const Point& point, const std::optional<std::string>& dump_dir) {
  ResultRow row = describe_point(point);
  if (row.status != Status::Ok) return row;
  if (point.config.pass == Pass::Decode) return run_decode_point(point, std::move(row), dump_dir);
  const PointConfig& config = point.config;
  DnnlContext::instance().set_threads(config.problem.threads);  // the team oneDNN and every OpenMP loop use
  auto& tracker = MemoryTracker::instance();
  const std::int64_t baseline = tracker.current_bytes();
  const std::int64_t owned_baseline = tracker.owned_current_bytes();
  tracker.reset_peak();

  // Untimed: inputs, parameters, buffers; then the first warm-up run creates the primitives and
  // gives the executed FLOPs.
  const auto workload = make_workload(point);
  const auto body = pass_body(config.pass, *workload);
  FlopCounter::reset();
  body();
  row.flops = FlopCounter::total();
  row.saved_bytes = workload->saved_bytes();
  if (const MoeFfn* moe = workload->moe()) {
    row.tokens_dropped = moe->tokens_dropped();
    row.expert_load = moe->expert_load();
  }
  if (config.pass != Pass::Forward) row.gradient_note = workload->mechanism().gradient_note();

  TimingSettings timing = config.timing;
  timing.warmup -= 1;
  const TimingResult timed = time_repeatedly(timing, body);

  row.peak_tensor_bytes = tracker.peak_bytes() - baseline;
  row.peak_owned_bytes = tracker.owned_peak_bytes() - owned_baseline;
  row.workspace_bytes = row.peak_tensor_bytes - point_io_bytes(point);
  record_timing(row, timed);
  row.gflops_per_s = row.median_ns > 0 ? static_cast<double>(row.flops) / row.median_ns : 0;
  const double tokens = static_cast<double>(config.problem.batch * config.problem.seq_len);
  row.tokens_per_s = row.median_ns > 0 ? tokens / (row.median_ns * 1e-9) : 0;
  if (dump_dir) write_dump(*dump_dir, point, row, workload->dump_files());
  row.peak_rss_bytes = peak_rss_of_self();
  return row;
}

}  // namespace xfb
