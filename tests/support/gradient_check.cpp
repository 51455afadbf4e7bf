#include "tests/support/gradient_check.hpp"

#include <cmath>
#include <sstream>

#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/mechanism_run.hpp"

namespace xfb::test {

BackwardRun run_backward(const std::string& model, const Problem& p, const AttentionInputs& in, const Tensor& dout,
                         const std::vector<std::string>& params, std::uint64_t seed) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  REQUIRE(info->impl.has_backward());
  auto shaped = [&](std::int64_t rows) {
    Tensor t = Tensor::bhnd(p.batch, p.heads, rows, p.head_dim);
    t.fill(std::nanf(""));
    return t;
  };
  BackwardRun run{info->impl.create(on_test_threads(p), resolve_params(model, info->impl.params, params), seed),
                  shaped(model_output_rows(model, p, params)), shaped(p.seq_len), shaped(p.seq_len), shaped(p.seq_len)};
  run.mechanism->prepare(in.q, in.k, in.v);
  run.mechanism->prepare_backward();
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  run.mechanism->backward(in.q, in.k, in.v, run.out, dout, run.dq, run.dk, run.dv);
  return run;
}

Tensor random_like(const Problem& p, std::uint64_t seed, const char* name) {
  Tensor t = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  CounterRng(seed, name).fill_normal(t);
  return t;
}

Tensor random_output(const std::string& model, const Problem& p, const std::vector<std::string>& params,
                     std::uint64_t seed, const char* name) {
  Tensor t = Tensor::bhnd(p.batch, p.heads, model_output_rows(model, p, params), p.head_dim);
  CounterRng(seed, name).fill_normal(t);
  return t;
}

namespace {

struct HeadCheck {
  const float* got;
  const std::vector<double>& want;
  const std::vector<double>& terms;
  const char* name;
};

double check_head_gradient(const HeadCheck& c, std::int64_t n, std::int64_t d, double factor, const std::string& label,
                           bool report) {
  double worst = 0;
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < n * d; ++e) {
    const auto i = static_cast<std::size_t>(e);
    const double error = std::fabs(static_cast<double>(c.got[e]) - c.want[i]), tolerance = factor * c.terms[i];
    worst = std::max(worst, error == 0 ? 0.0 : error / tolerance);
    if (!(error <= tolerance) && failures++ < 3 && report)
      FAIL_CHECK(label << " " << c.name << ": token " << e / d << " feature " << e % d << ": got " << c.got[e]
                       << ", want " << c.want[i] << " (tolerance " << tolerance << ")");
  }
  if (report) CHECK_MESSAGE(failures == 0, label << " " << c.name << ": " << failures << " elements out of tolerance");
  return failures > 0 && worst <= 1 ? INFINITY : worst;  // NaN compares false
}

std::vector<double> shifted(const float* x, const float* direction, double h, std::int64_t count) {
  std::vector<double> out(static_cast<std::size_t>(count));
  for (std::int64_t e = 0; e < count; ++e) out[static_cast<std::size_t>(e)] = x[e] + h * direction[e];
  return out;
}

}  // namespace

double check_gradients(const BackwardRun& run, const AttentionInputs& in, const Tensor& dout, const Problem& p,
                       const HeadMask& allowed, const std::string& label, bool report) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double worst = 0;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const MaskFn head_mask = [&](std::int64_t i, std::int64_t j) { return allowed(h, i, j); };
      const auto want = reference_attention_backward(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), dout.head(b, h),
                                                     n, n, d, scale, head_mask);
      const double factor = gradient_error_factor(in.q.head(b, h), in.k.head(b, h), n, n, d, scale);
      std::ostringstream head;
      head << label << " b=" << b << " h=" << h;
      for (const HeadCheck& c : {HeadCheck{run.dq.head(b, h), want.dq, want.dq_terms, "dq"},
                                 HeadCheck{run.dk.head(b, h), want.dk, want.dk_terms, "dk"},
                                 HeadCheck{run.dv.head(b, h), want.dv, want.dv_terms, "dv"}})
        worst = std::max(worst, check_head_gradient(c, n, d, factor, head.str(), report));
    }
  return worst;
}

void check_directional_derivative(const BackwardRun& run, const AttentionInputs& in, const Tensor& dout,
                                  const Problem& p, const HeadMask& allowed, const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim, count = n * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d)), step = 1e-5;
  const Tensor dir_q = random_like(p, 11, "direction/q"), dir_k = random_like(p, 11, "direction/k"),
               dir_v = random_like(p, 11, "direction/v");
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const MaskFn head_mask = [&](std::int64_t i, std::int64_t j) { return allowed(h, i, j); };
      // ⟨dO, reference(x + s·δ)⟩ in double.
      auto objective = [&](double s) {
        const auto q = shifted(in.q.head(b, h), dir_q.head(b, h), s, count);
        const auto k = shifted(in.k.head(b, h), dir_k.head(b, h), s, count);
        const auto v = shifted(in.v.head(b, h), dir_v.head(b, h), s, count);
        const auto out = reference_attention(q.data(), k.data(), v.data(), n, n, d, scale, head_mask);
        double sum = 0;
        for (std::int64_t e = 0; e < count; ++e) sum += dout.head(b, h)[e] * out[static_cast<std::size_t>(e)];
        return sum;
      };
      const double numeric = (objective(step) - objective(-step)) / (2 * step);
      const auto want = reference_attention_backward(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), dout.head(b, h),
                                                     n, n, d, scale, head_mask);
      const double factor = gradient_error_factor(in.q.head(b, h), in.k.head(b, h), n, n, d, scale);
      double analytic = 0, tolerance = 0;
      for (std::int64_t e = 0; e < count; ++e) {
        const auto i = static_cast<std::size_t>(e);
        const double dq = dir_q.head(b, h)[e], dk = dir_k.head(b, h)[e], dv = dir_v.head(b, h)[e];
        analytic += run.dq.head(b, h)[e] * dq + run.dk.head(b, h)[e] * dk + run.dv.head(b, h)[e] * dv;
        tolerance += factor * (want.dq_terms[i] * std::fabs(dq) + want.dk_terms[i] * std::fabs(dk) +
                               want.dv_terms[i] * std::fabs(dv));
      }
      tolerance += 1e-7 * (1 + std::fabs(numeric));  // the central difference's own error
      CHECK_MESSAGE(std::fabs(analytic - numeric) <= tolerance,
                    label << " b=" << b << " h=" << h << ": ⟨∇, δ⟩ = " << analytic << ", difference quotient "
                          << numeric << " (tolerance " << tolerance << ")");
    }
}

double check_model_gradients(const std::string& model, const Problem& p, const HeadMask& allowed,
                             const std::vector<std::string>& params, std::uint64_t seed) {
  const auto in = random_inputs(p, seed);
  const Tensor dout = random_like(p, seed, "dout");
  const BackwardRun run = run_backward(model, p, in, dout, params, seed);
  std::ostringstream label;
  label << model << " N=" << p.seq_len << " D=" << p.head_dim << (p.causal ? " causal" : "");
  for (const auto& param : params) label << " " << param;
  const double worst = check_gradients(run, in, dout, p, allowed, label.str());
  check_directional_derivative(run, in, dout, p, allowed, label.str());
  return worst;
}

namespace {

std::vector<double> widen(const Tensor& t) { return widened(t.data(), t.size()); }
double largest(const Tensor& t) { return max_abs(t.data(), t.size()); }

}  // namespace

void check_composite_gradients(const std::string& model, const Problem& p, const std::vector<std::string>& params,
                               const ModelReference& reference, bool every_element, std::uint64_t seed) {
  const auto in = random_inputs(p, seed);
  const Tensor dout = random_output(model, p, params, seed, "dout");
  const BackwardRun run = run_backward(model, p, in, dout, params, seed);
  NamedValues inputs{{"q", widen(in.q)}, {"k", widen(in.k)}, {"v", widen(in.v)}};
  std::map<std::string, const Tensor*> grads{{"q", &run.dq}, {"k", &run.dk}, {"v", &run.dv}};
  for (const auto& parameter : run.mechanism->parameters())
    for (const auto& gradient : run.mechanism->parameter_gradients())
      if (gradient.name == "d" + parameter.name) {
        inputs[parameter.name] = widen(*parameter.tensor);
        grads[parameter.name] = gradient.tensor;
      }
  std::ostringstream label;
  label << model << " N=" << p.seq_len << " D=" << p.head_dim << (p.causal ? " causal" : "");
  for (const auto& param : params) label << " " << param;
  const double size_factor = std::log2(static_cast<double>(std::max<std::int64_t>(p.seq_len, 2))) + p.head_dim;
  check_against_differences(label.str(), inputs, grads, dout, reference, size_factor, every_element);
}

void check_against_differences(const std::string& label, const NamedValues& inputs,
                               const std::map<std::string, const Tensor*>& grads, const Tensor& dout,
                               const ModelReference& reference, double size_factor, bool every_element) {
  const double step = 1e-5;
  auto objective = [&](const NamedValues& x) {
    const auto out = reference(x);
    double sum = 0;
    for (std::int64_t e = 0; e < dout.size(); ++e) sum += dout[e] * out[static_cast<std::size_t>(e)];
    return sum;
  };
  // The scale of a tensor's rounding: its largest gradient, or the largest of all inputs' gradients
  // when that is larger (a gradient that is exactly 0, like dq of a single key, still carries the
  // rounding of the terms that cancel).
  double overall = 0;
  for (const auto& [name, grad] : grads) overall = std::max(overall, largest(*grad));
  std::map<std::string, double> tolerance;
  for (const auto& [name, grad] : grads)
    tolerance[name] = 64 * kFloatEps * size_factor * std::max(largest(*grad), overall);
  // Every element, or a seeded sample of kSampled per tensor (the directional check below alone is
  // loose for an error confined to a few elements of a large tensor).
  constexpr std::int64_t kSampled = 24;
  for (const auto& [name, grad] : grads) {
    const CounterRng sample(13, "sample/" + name);
    const std::int64_t count = every_element ? grad->size() : std::min(kSampled, grad->size());
    for (std::int64_t i = 0; i < count; ++i) {
      const auto index = static_cast<std::uint64_t>(i);
      const auto e = static_cast<std::int64_t>(
          every_element ? index : sample.bits(index) % static_cast<std::uint64_t>(grad->size()));
      NamedValues x = inputs;
      x[name][static_cast<std::size_t>(e)] += step;
      const double up = objective(x);
      x[name][static_cast<std::size_t>(e)] -= 2 * step;
      const double numeric = (up - objective(x)) / (2 * step);
      CHECK_MESSAGE(std::fabs((*grad)[e] - numeric) <= tolerance[name] + 1e-6 * (1 + std::fabs(numeric)),
                    label << " d" << name << "[" << e << "]: got " << (*grad)[e] << ", difference quotient " << numeric
                          << " (tolerance " << tolerance[name] << ")");
    }
  }
  NamedValues up = inputs, down = inputs;
  double analytic = 0, bound = 0;
  for (const auto& [name, grad] : grads) {
    const CounterRng rng(11, "direction/" + name);
    for (std::int64_t e = 0; e < grad->size(); ++e) {
      const double direction = rng.normal(static_cast<std::uint64_t>(e));
      up[name][static_cast<std::size_t>(e)] += step * direction;
      down[name][static_cast<std::size_t>(e)] -= step * direction;
      analytic += (*grad)[e] * direction;
      bound += tolerance[name] * std::fabs(direction);
    }
  }
  const double numeric = (objective(up) - objective(down)) / (2 * step);
  CHECK_MESSAGE(
      std::fabs(analytic - numeric) <= bound + 1e-6 * (1 + std::fabs(numeric)),
      label << ": ⟨∇, δ⟩ = " << analytic << ", difference quotient " << numeric << " (tolerance " << bound << ")");
}

}  // namespace xfb::test
