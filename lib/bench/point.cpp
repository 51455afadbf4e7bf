#include "lib/bench/point.hpp"

#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "lib/bench/encoder_layer.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/npy.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/stats.hpp"
#include "lib/report/files.hpp"
#include "lib/report/point_fields.hpp"
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
  manifest["params"] = point.running.to_json();
  manifest["requested_params"] = row.params;
  manifest["layout"] = "attention tensors are [B, H, N, D]; little-endian float32, C order";
  if (point.config.pass == Pass::Decode)
    manifest["decode"] = "q, k, v, out hold the " + std::to_string(point.config.problem.seq_len) +
                         " context rows, then the " + std::to_string(point.config.decode_tokens) +
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
  row.unstable = stats.cv > kUnstableCv;
  for (const auto& [stage, samples] : timed.stage_samples_ns) row.stage_median_ns[stage] = summarize(samples).median;
  if (timed.primitives_created_while_timed > 0)
    row.warnings.push_back(std::to_string(timed.primitives_created_while_timed) +
                           " oneDNN primitive(s) were created inside the timed region");
  if (!optimised_build()) row.warnings.push_back("this build is not optimised (" XFBENCH_BUILD_TYPE "): times are not representative");
}

// The decode pass. The context's q, k, v are rows [0, N) of the seeded N + T token sequence (the
// same draws as a causal forward over N + T tokens), step t's token is row N + t; all are drawn
// untimed. The first run is untimed (primitives; the steps' executed FLOPs), then time_decoding.
ResultRow run_decode_point(const Point& point, ResultRow row, const std::optional<std::string>& dump_dir) {
  const PointConfig& config = point.config;
  const Problem& p = config.problem;
  const std::int64_t tokens = config.decode_tokens, total = p.seq_len + tokens;
  DnnlContext::instance().set_threads(p.threads);
  auto& tracker = MemoryTracker::instance();
  const std::int64_t baseline = tracker.current_bytes();
  const std::int64_t owned_baseline = tracker.owned_current_bytes();
  tracker.reset_peak();

  constexpr std::array<const char*, 3> kStreams = {"input/q", "input/k", "input/v"};
  std::array<Tensor, 3> context;  // q, k, v of the N context tokens
  for (std::size_t i = 0; i < 3; ++i) {
    context[i] = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    CounterRng(config.seed, kStreams[i]).fill_normal_rows(context[i], total, 0);
  }
  Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  std::vector<std::array<Tensor, 3>> step_inputs(static_cast<std::size_t>(tokens));
  std::vector<Tensor> step_outputs(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::size_t i = 0; i < 3; ++i) {
      step_inputs[t][i] = Tensor::bhnd(p.batch, p.heads, 1, p.head_dim);
      CounterRng(config.seed, kStreams[i]).fill_normal_rows(step_inputs[t][i], total, p.seq_len + t);
    }
    step_outputs[t] = Tensor::bhnd(p.batch, p.heads, 1, p.head_dim);
  }
  auto mechanism = point.model->impl.create(p, point.requested, config.seed);
  mechanism->prepare(context[0], context[1], context[2]);
  mechanism->prepare_decode(tokens);
  auto prefill = [&] { mechanism->forward(context[0], context[1], context[2], out); };
  auto step = [&](std::int64_t t) {
    const auto& in = step_inputs[t];
    mechanism->decode_step(in[0], in[1], in[2], step_outputs[t]);
  };
  prefill();
  FlopCounter::reset();
  for (std::int64_t t = 0; t < tokens; ++t) step(t);
  row.flops = FlopCounter::total();

  TimingSettings timing = config.timing;
  timing.warmup -= 1;
  // A step's token arrives in cache, as a decoder's projection would leave it: read its q, k, v and
  // the output row untimed (after a long prefill they would otherwise come from memory).
  volatile float sink = 0;
  auto ready = [&](std::int64_t t) {
    float sum = 0;
    for (const Tensor* tensor : {&step_inputs[t][0], &step_inputs[t][1], &step_inputs[t][2], &step_outputs[t]})
      for (std::int64_t i = 0; i < tensor->size(); ++i) sum += (*tensor)[i];
    sink = sink + sum;
  };
  const DecodeTimingResult timed = time_decoding(timing, tokens, prefill, step, ready);

  row.peak_tensor_bytes = tracker.peak_bytes() - baseline;
  row.peak_owned_bytes = tracker.owned_peak_bytes() - owned_baseline;
  row.workspace_bytes = row.peak_tensor_bytes - point_io_bytes(config);
  row.state_bytes = mechanism->state_bytes();
  record_timing(row, timed.steps);
  row.prefill_ns = median_of(timed.prefill_ns);
  const double per_token_ns = row.median_ns;
  row.gflops_per_s = per_token_ns > 0 ? static_cast<double>(row.flops) / static_cast<double>(tokens) / per_token_ns : 0;
  row.tokens_per_s = per_token_ns > 0 ? static_cast<double>(p.batch) / (per_token_ns * 1e-9) : 0;

  if (dump_dir) {
    // The whole sequence, context rows then decoded rows: [B, H, N + T, D].
    auto sequence = [&](const Tensor& head_rows, auto&& token_row) {
      Tensor whole = Tensor::bhnd(p.batch, p.heads, total, p.head_dim);
      for (std::int64_t b = 0; b < p.batch; ++b)
        for (std::int64_t h = 0; h < p.heads; ++h) {
          float* dst = whole.head(b, h);
          std::copy_n(head_rows.head(b, h), p.seq_len * p.head_dim, dst);
          for (std::int64_t t = 0; t < tokens; ++t)
            std::copy_n(token_row(t).head(b, h), p.head_dim, dst + (p.seq_len + t) * p.head_dim);
        }
      return whole;
    };
    std::array<Tensor, 4> whole;
    for (std::size_t i = 0; i < 3; ++i)
      whole[i] = sequence(context[i], [&](std::int64_t t) -> const Tensor& { return step_inputs[t][i]; });
    whole[3] = sequence(out, [&](std::int64_t t) -> const Tensor& { return step_outputs[t]; });
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

Point resolve_point(const PointConfig& config) {
  for (const auto& field : point_fields()) check_field_value(field, field.get(config), field.long_flag());
  check_point_config(config);
  const ModelInfo& model = model_or_throw(config.model);
  Point point;
  point.model = &model;
  point.config = config;
  if (config.pass == Pass::Decode) point.config.problem.causal = true;  // decoding is causal by definition
  point.requested = resolve_params(config.model, model.impl.params, config.params);
  if (model.impl.validate) model.impl.validate(point.config.problem, point.requested);
  point.running = model.impl.resolved(point.config.problem, point.requested);
  return point;
}

void validate_point(const PointConfig& config) { resolve_point(config); }

std::int64_t point_io_bytes(const PointConfig& config) {
  const Problem& p = config.problem;
  const std::int64_t tensor = p.batch * p.heads * p.seq_len * p.head_dim * static_cast<std::int64_t>(sizeof(float));
  if (config.pass == Pass::Decode)  // the context's q, k, v, out and every step's
    return 4 * tensor + 4 * config.decode_tokens * p.batch * p.heads * p.head_dim * static_cast<std::int64_t>(sizeof(float));
  const bool training = config.pass != Pass::Forward;
  // Attention: q, k, v, out (+ dout, dq, dk, dv); layer: x, y (+ dy, dx).
  const std::int64_t tensors = config.scope == Scope::Layer ? (training ? 4 : 2) : (training ? 8 : 4);
  return tensors * tensor;
}

std::int64_t estimated_point_bytes(const Point& point) {
  const PointConfig& c = point.config;
  std::int64_t bytes = point_io_bytes(c) + point.model->impl.workspace_bytes(c.problem, point.requested);
  if (c.pass == Pass::Decode)
    bytes += point.model->impl.decode_workspace_bytes(c.problem, point.requested, c.decode_tokens);
  else if (c.pass != Pass::Forward)
    bytes += point.model->impl.backward_workspace_bytes(c.problem, point.requested);
  if (c.scope == Scope::Layer) bytes += EncoderLayer::workspace_bytes(c.problem, c.effective_d_ff());
  if (c.scope == Scope::Layer && c.pass != Pass::Forward)
    bytes += EncoderLayer::backward_workspace_bytes(c.problem, c.effective_d_ff());
  return bytes;
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
  row.kernel_isa = kernel_isa_name(kernel_isa());
  row.reproducer = reproducer_command(point);
  const std::string why = model.impl.unsupported ? model.impl.unsupported(config.problem, point.requested) : "";
  if (config.problem.causal && !model.decodes) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + " cannot decode (survey Table 1: Decode = no), so it has " +
                 (config.pass == Pass::Decode ? "no incremental form" : "no causal mode");
  } else if (!why.empty()) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + ": " + why;
  } else if (config.pass == Pass::Decode && !model.impl.has_decode()) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + " has no incremental form in this build, so no decode pass";
  } else if (config.pass != Pass::Forward && config.pass != Pass::Decode && !model.impl.has_backward()) {
    row.status = Status::Unsupported;
    row.reason = model.display_name + " has no backward pass in this build, so no " + row.pass + " pass";
  } else {
    const std::int64_t estimate = estimated_point_bytes(point);
    row.estimated_workspace_bytes = estimate - point_io_bytes(config);
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
  const ModelInfo& model = *point.model;
  const PointConfig& config = point.config;
  const ParamValues& values = point.requested;
  const Problem& p = config.problem;
  DnnlContext::instance().set_threads(p.threads);  // the team oneDNN and every OpenMP loop use

  auto& tracker = MemoryTracker::instance();
  const std::int64_t baseline = tracker.current_bytes();
  const std::int64_t owned_baseline = tracker.owned_current_bytes();
  tracker.reset_peak();

  // Untimed setup: inputs, output, parameters, buffers, primitives (first warm-up run).
  const bool layer = config.scope == Scope::Layer;
  Tensor q, k, v, x;
  if (layer) {
    x = Tensor(Shape{p.batch, p.seq_len, p.heads * p.head_dim});
    CounterRng(config.seed, "input/x").fill_normal(x);
  } else {
    q = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    k = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    v = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    CounterRng(config.seed, "input/q").fill_normal(q);
    CounterRng(config.seed, "input/k").fill_normal(k);
    CounterRng(config.seed, "input/v").fill_normal(v);
  }
  Tensor out = layer ? Tensor(Shape{p.batch, p.seq_len, p.heads * p.head_dim})
                     : Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  // Training passes: a seeded dO (of the output) and the input gradients (attention: dq, dk, dv;
  // layer: dx, the mechanism's inside the layer), allocated with the inputs, before any prepare
  // (so a model's setup-only buffers, like routing's fitting rows, peak over all of them).
  const bool training = config.pass != Pass::Forward;
  Tensor dout, dq, dk, dv, dx;
  if (training && layer) {
    dout = Tensor(out.shape());
    dx = Tensor(x.shape());
  } else if (training) {
    dout = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    dq = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    dk = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    dv = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  }
  if (training) CounterRng(config.seed, "input/dout").fill_normal(dout);
  const std::int64_t io_bytes = point_io_bytes(config);
  auto mechanism = model.impl.create(p, values, config.seed);
  std::unique_ptr<EncoderLayer> encoder;
  if (layer) {
    encoder = std::make_unique<EncoderLayer>(p, config.effective_d_ff(), config.seed);
    if (training) encoder->prepare_training();  // the layer's own buffers, before the mechanism's setup
    encoder->prepare(*mechanism, x);
    if (training) encoder->prepare_backward(*mechanism);
  } else {
    mechanism->prepare(q, k, v);
    if (training) mechanism->prepare_backward();
  }
  auto forward = [&] {
    if (layer)
      encoder->forward(*mechanism, x, out);
    else
      mechanism->forward(q, k, v, out);
  };
  auto backward = [&] {
    if (layer)
      encoder->backward(*mechanism, x, dout, dx);
    else
      mechanism->backward(q, k, v, out, dout, dq, dk, dv);
  };
  std::function<void()> body = forward;
  if (config.pass == Pass::Backward) {
    forward();  // untimed: saves what the timed backward reads (the backward leaves it unchanged)
    body = backward;
  } else if (config.pass == Pass::Train) {
    body = [&] {
      // Attention scope: a mechanism that splits its forward or backward into stages of its own
      // (route, attend) keeps them; the rest of that pass after its last lap is charged to no
      // stage, as in a forward pass. Layer scope: `forward` and `backward` are the whole layer's.
      stage_clock::mute(layer);
      forward();
      stage_clock::mute(false);
      if (stage_clock::stages() == 0)
        stage_clock::lap("forward");
      else
        stage_clock::restart();
      const std::size_t forward_stages = stage_clock::stages();
      stage_clock::mute(layer);
      backward();
      stage_clock::mute(false);
      if (stage_clock::stages() == forward_stages)
        stage_clock::lap("backward");
      else
        stage_clock::restart();
    };
  }
  FlopCounter::reset();
  body();
  row.flops = FlopCounter::total();
  if (training) {
    row.saved_bytes += mechanism->saved_bytes();
    row.gradient_note = mechanism->gradient_note();
    if (layer) row.saved_bytes += total_bytes(encoder->saved());
  }

  TimingSettings timing = config.timing;
  timing.warmup -= 1;
  const TimingResult timed = time_repeatedly(timing, body);

  row.peak_tensor_bytes = tracker.peak_bytes() - baseline;
  row.peak_owned_bytes = tracker.owned_peak_bytes() - owned_baseline;
  row.workspace_bytes = row.peak_tensor_bytes - io_bytes;
  record_timing(row, timed);
  row.gflops_per_s = row.median_ns > 0 ? static_cast<double>(row.flops) / row.median_ns : 0;
  row.tokens_per_s = row.median_ns > 0 ? static_cast<double>(p.batch * p.seq_len) / (row.median_ns * 1e-9) : 0;

  if (dump_dir) {
    std::vector<std::pair<std::string, const Tensor*>> files;
    if (layer) {
      files = {{"x", &x}, {"q", &encoder->q()}, {"k", &encoder->k()}, {"v", &encoder->v()},
               {"attention_out", &encoder->attention_output()}, {"out", &out}};
      for (const auto& named : encoder->parameters()) files.emplace_back(named.name, named.tensor);
    } else {
      files = {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}};
    }
    if (training && layer) {
      files.insert(files.end(), {{"dout", &dout}, {"dx", &dx}});
      for (const auto& named : encoder->attention_gradients()) files.emplace_back(named.name, named.tensor);
      for (const auto& named : encoder->parameter_gradients()) files.emplace_back(named.name, named.tensor);
    } else if (training) {
      files.insert(files.end(), {{"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
    }
    for (const auto& named : mechanism->parameters()) files.emplace_back(named.name, named.tensor);
    if (training)
      for (const auto& named : mechanism->parameter_gradients()) files.emplace_back(named.name, named.tensor);
    write_dump(*dump_dir, point, row, files);
  }
  row.peak_rss_bytes = peak_rss_of_self();
  return row;
}

}  // namespace xfb
