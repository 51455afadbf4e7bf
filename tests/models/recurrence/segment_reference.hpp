#pragma once
// The naive double-precision recurrence of Transformer-XL and the Compressive Transformer
// (taxonomy/recurrence/segment_attention.hpp) that the fp32 and bf16 tests check the engine against,
// and the registry runs they compare.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "taxonomy/recurrence/segment_attention.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

using Rows = std::vector<std::vector<double>>;

// A mechanism from the registry, prepared and run once; keeps the mechanism for its state.
struct Run {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out;
  SegmentAttention& state() { return dynamic_cast<SegmentAttention&>(*mechanism); }
};

inline Run run_model(const std::string& model, const Problem& p, const AttentionInputs& in,
                     const std::vector<std::string>& params, std::uint64_t seed = 42) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  Run run{info->impl.create(on_test_threads(p), resolve_params(model, info->impl.params, params), seed),
          Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim)};
  run.mechanism->prepare(in.q, in.k, in.v);
  run.out.fill(std::nanf(""));
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  return run;
}

inline Run run_direct(const SegmentAttentionConfig& config, const Problem& p, const AttentionInputs& in) {
  Run run{std::make_unique<SegmentAttention>(on_test_threads(p), config, 7),
          Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim)};
  run.mechanism->prepare(in.q, in.k, in.v);
  run.out.fill(std::nanf(""));
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  return run;
}

// The paper's relative key W_R,h·R_δ for one head, computed naively from the sinusoid formula.
class RelativeKeys {
 public:
  RelativeKeys(const Tensor& w_r, std::int64_t head) : w_r_(w_r), head_(head) {}
  const std::vector<double>& operator()(std::int64_t delta) {
    auto [it, inserted] = cache_.try_emplace(delta);
    if (!inserted) return it->second;
    const std::int64_t d_r = w_r_.dim(1), d = w_r_.dim(2);
    it->second.assign(static_cast<std::size_t>(d), 0.0);
    for (std::int64_t k = 0; k < d_r; ++k) {
      const double omega = std::pow(10000.0, -static_cast<double>(k - k % 2) / d_r);
      const double r = k % 2 == 0 ? std::sin(delta * omega) : std::cos(delta * omega);
      for (std::int64_t j = 0; j < d; ++j) it->second[j] += r * w_r_[(head_ * d_r + k) * d + j];
    }
    return it->second;
  }

 private:
  const Tensor& w_r_;
  std::int64_t head_;
  std::map<std::int64_t, std::vector<double>> cache_;
};

// Naive f_c of one group of rows (rows.size() <= rate); conv: [rate·d, d] weights of one head.
inline std::vector<double> naive_compress(Compression f, const Rows& group, const float* conv) {
  const std::size_t d = group[0].size();
  std::vector<double> out(d, f == Compression::MaxPool ? -INFINITY : 0.0);
  for (std::size_t t = 0; t < group.size(); ++t)
    for (std::size_t j = 0; j < d; ++j) {
      if (f == Compression::MaxPool) out[j] = std::max(out[j], group[t][j]);
      if (f == Compression::MeanPool) out[j] += group[t][j] / group.size();
      if (f == Compression::Conv)
        for (std::size_t i = 0; i < d; ++i) out[j] += group[t][i] * conv[(t * d + i) * d + j];
    }
  return out;
}

struct HeadParams {
  const float *u, *v, *conv_k, *conv_v;
  RelativeKeys relative;
};

// One head through the documented recurrence, naively: per segment the explicit concatenation
// [compressed ; memory ; segment], scores with index distance δ = n_context + i − j, masks, then
// the FIFO updates. Also returns the final caches and a tolerance for the output. With `slots`
// ([2] rows: keys, values), compressed slot number t (in creation order) is slots[·][t] instead of
// f_c of its rows: the bf16 test passes the model's own rounded slots (all of them, n_cm ≥ every
// slot made).
struct NaiveResult {
  std::vector<double> out;
  Rows memory_k, memory_v, compressed_k, compressed_v;
  double tolerance = 0;
};

inline NaiveResult naive_segments(const float* q, const float* k, const float* v, std::int64_t n, std::int64_t d,
                                  const SegmentAttentionConfig& c, bool causal, HeadParams& hp,
                                  const Rows* slots = nullptr) {
  NaiveResult result;
  result.out.assign(static_cast<std::size_t>(n * d), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto row = [d](const float* x, std::int64_t i) { return std::vector<double>(x + i * d, x + (i + 1) * d); };
  double largest_terms = 0, largest_value = 0;
  std::int64_t largest_context = 1;
  std::size_t made = 0;  // slots taken from `slots`
  for (std::int64_t s0 = 0; s0 < n; s0 += c.segment_len) {
    const std::int64_t rows = std::min(c.segment_len, n - s0);
    Rows keys = result.compressed_k, values = result.compressed_v;
    keys.insert(keys.end(), result.memory_k.begin(), result.memory_k.end());
    values.insert(values.end(), result.memory_v.begin(), result.memory_v.end());
    const std::int64_t context = static_cast<std::int64_t>(keys.size());
    for (std::int64_t i = 0; i < rows; ++i) {
      keys.push_back(row(k, s0 + i));
      values.push_back(row(v, s0 + i));
    }
    for (const auto& value : values)
      for (double x : value) largest_value = std::max(largest_value, std::fabs(x));
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t visible = context + (causal ? i + 1 : rows);
      largest_context = std::max(largest_context, visible);
      std::vector<double> scores(static_cast<std::size_t>(visible));
      double peak = -INFINITY;
      for (std::int64_t j = 0; j < visible; ++j) {
        const auto& r = hp.relative(context + i - j);
        double s = 0, terms = 0;
        for (std::int64_t f = 0; f < d; ++f) {
          const double query = q[(s0 + i) * d + f];
          s += (query + hp.u[f]) * keys[j][f] + (query + hp.v[f]) * r[f];
          terms += std::fabs((query + hp.u[f]) * keys[j][f]) + std::fabs((query + hp.v[f]) * r[f]);
        }
        scores[j] = s * scale;
        largest_terms = std::max(largest_terms, terms * scale);
        peak = std::max(peak, scores[j]);
      }
      double sum = 0;
      for (double s : scores) sum += std::exp(s - peak);
      for (std::int64_t j = 0; j < visible; ++j)
        for (std::int64_t f = 0; f < d; ++f)
          result.out[(s0 + i) * d + f] += std::exp(scores[j] - peak) / sum * values[j][f];
    }
    // FIFO: the last M rows of [memory ; segment] stay, the rest is evicted oldest first.
    Rows all_k(keys.begin() + static_cast<std::ptrdiff_t>(result.compressed_k.size()), keys.end());
    Rows all_v(values.begin() + static_cast<std::ptrdiff_t>(result.compressed_v.size()), values.end());
    const std::int64_t evicted = std::max<std::int64_t>(0, static_cast<std::int64_t>(all_k.size()) - c.memory_len);
    if (c.compression != Compression::None)
      for (std::int64_t g = 0; g < evicted; g += c.rate) {
        const auto end = std::min(g + c.rate, evicted);
        if (slots != nullptr) {
          REQUIRE(made < slots[0].size());
          result.compressed_k.push_back(slots[0][made]);
          result.compressed_v.push_back(slots[1][made++]);
          continue;
        }
        result.compressed_k.push_back(
            naive_compress(c.compression, Rows(all_k.begin() + g, all_k.begin() + end), hp.conv_k));
        result.compressed_v.push_back(
            naive_compress(c.compression, Rows(all_v.begin() + g, all_v.begin() + end), hp.conv_v));
      }
    while (static_cast<std::int64_t>(result.compressed_k.size()) > c.compressed_len) {
      result.compressed_k.erase(result.compressed_k.begin());
      result.compressed_v.erase(result.compressed_v.begin());
    }
    result.memory_k.assign(all_k.begin() + evicted, all_k.end());
    result.memory_v.assign(all_v.begin() + evicted, all_v.end());
  }
  // fp32 error of the scores (products of d terms, plus c·d-term convolutions feeding the keys)
  // and of the softmax-weighted sum, as in attention_tolerance.
  const double conv_terms = c.compression == Compression::Conv ? static_cast<double>(c.rate * d) : 0.0;
  result.tolerance =
      8 * kFloatEps *
      (largest_terms * (1 + conv_terms) + std::log2(static_cast<double>(largest_context)) + 1 + conv_terms) *
      largest_value;
  return result;
}

inline HeadParams head_params(const Mechanism& m, const SegmentAttentionConfig& c, std::int64_t heads, std::int64_t h,
                              std::int64_t d) {
  const float* conv = c.compression == Compression::Conv ? parameter(m, "conv_weights").data() : nullptr;
  return {parameter(m, "pos_bias_u").data() + h * d, parameter(m, "pos_bias_v").data() + h * d,
          conv ? conv + h * c.rate * d * d : nullptr, conv ? conv + (heads + h) * c.rate * d * d : nullptr,
          RelativeKeys(parameter(m, "w_r"), h)};
}

inline void check_close(const float* got, const std::vector<double>& want, double tolerance, const std::string& label) {
  std::int64_t failures = 0;
  for (std::size_t e = 0; e < want.size(); ++e) {
    const double error = std::fabs(got[e] - want[e]);
    if (!(error <= tolerance) && failures++ < 3)
      FAIL_CHECK(label << ": element " << e << ": got " << got[e] << ", want " << want[e] << " (tolerance " << tolerance
                       << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
}

inline void check_rows(const float* got, const Rows& want, double tolerance, const std::string& label) {
  std::vector<double> flat;
  for (const auto& r : want) flat.insert(flat.end(), r.begin(), r.end());
  check_close(got, flat, tolerance, label);
}

}  // namespace xfb::test
