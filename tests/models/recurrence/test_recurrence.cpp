// Transformer-XL and the Compressive Transformer against naive double-precision references: the
// segment-wise computation equals one naive pass over [compressed memory ; memory ; segment] with
// the same masks and relative-position terms, one segment equals causal attention with relative
// terms, compression functions, FIFO state, causality, FLOP and memory scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include "apps/bench/point.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/recurrence/compressive.hpp"
#include "taxonomy/recurrence/segment_attention.hpp"
#include "taxonomy/recurrence/transformer_xl.hpp"
#include "taxonomy/registry.hpp"
#include "tests/models/recurrence/segment_reference.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

// Runs `model` with `params` and checks every head against the naive recurrence, including the
// final memory and compressed-memory contents.
void check_model(const std::string& model, const Problem& p, const std::vector<std::string>& params) {
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len * 7 + p.causal));
  Run run = run_model(model, p, in, params);
  const ModelInfo* info = find_model(model);
  const ParamValues values = resolve_params(model, info->impl.params, params);
  const SegmentAttentionConfig c = model == "compressive" ? compressive_config(values) : transformer_xl_config(values);
  std::ostringstream label;
  label << model << " N=" << p.seq_len << (p.causal ? " causal" : "");
  for (const auto& param : params) label << " " << param;
  const std::int64_t d = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      HeadParams hp = head_params(*run.mechanism, c, p.heads, h, d);
      const auto want =
          naive_segments(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), p.seq_len, d, c, p.causal, hp);
      check_close(run.out.head(b, h), want.out, want.tolerance, label.str());
      REQUIRE(run.state().memory_length() == static_cast<std::int64_t>(want.memory_k.size()));
      REQUIRE(run.state().compressed_length() == static_cast<std::int64_t>(want.compressed_k.size()));
      // Compressed slots: fp32 sums of up to c·d products (conv) or c rows (mean).
      double largest_input = 0, largest_weight = 0;
      for (const Tensor* t : {&in.k, &in.v})
        for (float x : t->values()) largest_input = std::max(largest_input, std::fabs(double(x)));
      if (c.compression == Compression::Conv)
        for (float w : parameter(*run.mechanism, "conv_weights").values())
          largest_weight = std::max(largest_weight, std::fabs(double(w)));
      const double cache_tolerance =
          c.compression == Compression::Conv
              ? 2 * kFloatEps * double(c.rate * d) * double(c.rate * d) * largest_input * largest_weight
              : 2 * kFloatEps * double(c.rate) * largest_input;
      check_rows(run.state().memory_rows(false, b, h), want.memory_k, 0, label.str() + " memory keys");
      check_rows(run.state().memory_rows(true, b, h), want.memory_v, 0, label.str() + " memory values");
      check_rows(run.state().compressed_rows(false, b, h), want.compressed_k, cache_tolerance,
                 label.str() + " compressed keys");
      check_rows(run.state().compressed_rows(true, b, h), want.compressed_v, cache_tolerance,
                 label.str() + " compressed values");
    }
}

// The recurrence in double as the backward differentiates it: the queries, the current segment's
// keys and values and the parameters u, v, W_R come from x; every cached slot (memory and
// compressed memory) is built from the fixed inputs — the paper's stop-gradient on its memory.
std::vector<double> stopped_recurrence(const NamedValues& x, const AttentionInputs& fixed, const Mechanism& m,
                                       const SegmentAttentionConfig& c, const Problem& p) {
  const std::int64_t n = p.seq_len, d = p.head_dim, d_r = p.heads * d, segment = std::min(c.segment_len, n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.heads * n * d), 0.0);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const double* q = x.at("q").data() + at;
      const double* u = x.at("pos_bias_u").data() + h * d;
      const double* bias_v = x.at("pos_bias_v").data() + h * d;
      auto relative_key = [&](std::int64_t delta) {
        std::vector<double> r(static_cast<std::size_t>(d), 0.0);
        for (std::int64_t k = 0; k < d_r; ++k) {
          const double omega = std::pow(10000.0, -static_cast<double>(k - k % 2) / static_cast<double>(d_r));
          const double sinusoid = k % 2 == 0 ? std::sin(delta * omega) : std::cos(delta * omega);
          for (std::int64_t j = 0; j < d; ++j) r[j] += sinusoid * x.at("w_r")[(h * d_r + k) * d + j];
        }
        return r;
      };
      HeadParams hp = head_params(m, c, p.heads, h, d);
      auto row = [d](const double* rows, std::int64_t i) {
        return std::vector<double>(rows + i * d, rows + (i + 1) * d);
      };
      const std::vector<double> fixed_k = widened(fixed.k.head(b, h), n * d),
                                fixed_v = widened(fixed.v.head(b, h), n * d);
      Rows memory_k, memory_v, compressed_k, compressed_v;
      for (std::int64_t s0 = 0; s0 < n; s0 += segment) {
        const std::int64_t rows = std::min(segment, n - s0);
        Rows keys = compressed_k, values = compressed_v;
        keys.insert(keys.end(), memory_k.begin(), memory_k.end());
        values.insert(values.end(), memory_v.begin(), memory_v.end());
        const auto context = static_cast<std::int64_t>(keys.size());
        for (std::int64_t i = 0; i < rows; ++i) {
          keys.push_back(row(x.at("k").data() + at, s0 + i));
          values.push_back(row(x.at("v").data() + at, s0 + i));
        }
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int64_t visible = context + (p.causal ? i + 1 : rows);
          std::vector<double> scores(static_cast<std::size_t>(visible));
          for (std::int64_t j = 0; j < visible; ++j) {
            const auto r = relative_key(context + i - j);
            for (std::int64_t f = 0; f < d; ++f)
              scores[j] +=
                  ((q[(s0 + i) * d + f] + u[f]) * keys[j][f] + (q[(s0 + i) * d + f] + bias_v[f]) * r[f]) * scale;
          }
          const double peak = *std::max_element(scores.begin(), scores.end());
          double sum = 0;
          for (double score : scores) sum += std::exp(score - peak);
          for (std::int64_t j = 0; j < visible; ++j)
            for (std::int64_t f = 0; f < d; ++f)
              out[at + (s0 + i) * d + f] += std::exp(scores[j] - peak) / sum * values[j][f];
        }
        // The caches from the fixed rows.
        Rows all_k = memory_k, all_v = memory_v;
        for (std::int64_t i = 0; i < rows; ++i) {
          all_k.push_back(row(fixed_k.data(), s0 + i));
          all_v.push_back(row(fixed_v.data(), s0 + i));
        }
        const std::int64_t evicted = std::max<std::int64_t>(0, static_cast<std::int64_t>(all_k.size()) - c.memory_len);
        if (c.compression != Compression::None)
          for (std::int64_t g = 0; g < evicted; g += c.rate) {
            const auto end = std::min(g + c.rate, evicted);
            compressed_k.push_back(
                naive_compress(c.compression, Rows(all_k.begin() + g, all_k.begin() + end), hp.conv_k));
            compressed_v.push_back(
                naive_compress(c.compression, Rows(all_v.begin() + g, all_v.begin() + end), hp.conv_v));
          }
        while (static_cast<std::int64_t>(compressed_k.size()) > c.compressed_len) {
          compressed_k.erase(compressed_k.begin());
          compressed_v.erase(compressed_v.begin());
        }
        memory_k.assign(all_k.begin() + evicted, all_k.end());
        memory_v.assign(all_v.begin() + evicted, all_v.end());
      }
    }
  return out;
}

// The gradients of q, k, v, u, v, W_R against central differences of stopped_recurrence.
void check_recurrence_gradients(const std::string& model, const Problem& p, const std::vector<std::string>& params,
                                const SegmentAttentionConfig& c) {
  const auto fixed = random_inputs(p, 7);  // check_composite_gradients' inputs and seed
  const Run run = run_model(model, p, fixed, params, 7);
  check_composite_gradients(
      model, p, params, [&](const NamedValues& x) { return stopped_recurrence(x, fixed, *run.mechanism, c, p); }, true);
}

// The attention-reconstruction loss Σ over (batch, head) and evicting segments of
// ‖attn(Q_s, K_e, V_e) − attn(Q_s, f_c(K_e), f_c(V_e))‖², in double, as a function of the conv
// weights x["conv_weights"] [2, H, c·D, D]; the caches from the inputs.
double reconstruction_loss(const NamedValues& x, const AttentionInputs& in, const SegmentAttentionConfig& c,
                           const Problem& p) {
  const std::int64_t n = p.seq_len, d = p.head_dim, segment = std::min(c.segment_len, n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto attend = [&](const std::vector<double>& q, const Rows& keys, const Rows& values) {
    std::vector<double> scores(keys.size()), out(static_cast<std::size_t>(d), 0.0);
    for (std::size_t j = 0; j < keys.size(); ++j)
      for (std::int64_t f = 0; f < d; ++f) scores[j] += q[f] * keys[j][f] * scale;
    const double peak = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (double score : scores) sum += std::exp(score - peak);
    for (std::size_t j = 0; j < keys.size(); ++j)
      for (std::int64_t f = 0; f < d; ++f) out[f] += std::exp(scores[j] - peak) / sum * values[j][f];
    return out;
  };
  double loss = 0;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      auto compress = [&](const Rows& rows, std::int64_t tensor) {
        const double* weights = x.at("conv_weights").data() + (tensor * p.heads + h) * c.rate * d * d;
        Rows slots;
        for (std::size_t g = 0; g < rows.size(); g += static_cast<std::size_t>(c.rate)) {
          std::vector<double> slot(static_cast<std::size_t>(d), 0.0);
          for (std::size_t t = g; t < std::min(rows.size(), g + static_cast<std::size_t>(c.rate)); ++t)
            for (std::int64_t i = 0; i < d; ++i)
              for (std::int64_t j = 0; j < d; ++j) slot[j] += rows[t][i] * weights[((t - g) * d + i) * d + j];
          slots.push_back(slot);
        }
        return slots;
      };
      auto row = [&](const Tensor& t, std::int64_t i) {
        return std::vector<double>(t.head(b, h) + i * d, t.head(b, h) + (i + 1) * d);
      };
      Rows memory_k, memory_v;
      for (std::int64_t s0 = 0; s0 < n; s0 += segment) {
        const std::int64_t rows = std::min(segment, n - s0);
        Rows all_k = memory_k, all_v = memory_v;
        for (std::int64_t i = 0; i < rows; ++i) {
          all_k.push_back(row(in.k, s0 + i));
          all_v.push_back(row(in.v, s0 + i));
        }
        const std::int64_t evicted = std::max<std::int64_t>(0, static_cast<std::int64_t>(all_k.size()) - c.memory_len);
        if (evicted > 0) {
          const Rows old_k(all_k.begin(), all_k.begin() + evicted), old_v(all_v.begin(), all_v.begin() + evicted);
          const Rows new_k = compress(old_k, 0), new_v = compress(old_v, 1);
          for (std::int64_t i = 0; i < rows; ++i) {
            const auto query = row(in.q, s0 + i);
            const auto target = attend(query, old_k, old_v), rebuilt = attend(query, new_k, new_v);
            for (std::int64_t f = 0; f < d; ++f) loss += (target[f] - rebuilt[f]) * (target[f] - rebuilt[f]);
          }
        }
        memory_k.assign(all_k.begin() + evicted, all_k.end());
        memory_v.assign(all_v.begin() + evicted, all_v.end());
      }
    }
  return loss;
}

std::string param(const char* name, std::int64_t value) { return std::string(name) + "=" + std::to_string(value); }

PointConfig quick_point(const std::string& model, std::int64_t n, bool causal, std::vector<std::string> params = {},
                        std::int64_t heads = 2, std::int64_t d = 32) {
  return counter_point(model, {.batch = 1, .heads = heads, .seq_len = n, .head_dim = d, .causal = causal},
                       std::move(params));
}

}  // namespace

TEST_SUITE("recurrence") {
  TEST_CASE("transformer-xl: segment-wise output equals one naive pass over [memory ; segment]") {
    // L = 16; N at, one below and one above 1, 2 and 3 segments; memory equal to, below, above L, none.
    for (std::int64_t memory : {16, 7, 24, 0})
      for (std::int64_t n : {1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 70})
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
          check_model("transformer-xl", p, {"segment_len=16", param("memory_len", memory), "block_q=5"});
        }
  }

  TEST_CASE(
      "transformer-xl and compressive gradients: u, v, W_R, and K, V within their segment (memory stop-gradient)") {
    for (bool causal : {false, true})
      for (std::int64_t n : {3, 4, 5, 11}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
        const std::vector<std::string> xl{"segment_len=4", "memory_len=3", "block_q=3"};
        check_recurrence_gradients(
            "transformer-xl", p, xl,
            transformer_xl_config(resolve_params("transformer-xl", find_model("transformer-xl")->impl.params, xl)));
        for (const char* f : {"conv", "max", "mean"}) {
          const std::vector<std::string> cm{"segment_len=4",    "memory_len=3",       "block_q=3",
                                            "compressed_len=2", "compression_rate=2", std::string("compression=") + f};
          check_recurrence_gradients(
              "compressive", p, cm,
              compressive_config(resolve_params("compressive", find_model("compressive")->impl.params, cm)));
        }
      }
  }

  TEST_CASE("compressive aux_loss=on: the conv weights' gradient is that of the attention-reconstruction loss") {
    for (bool causal : {false, true})
      for (const auto& [n, rate] : {std::pair<std::int64_t, std::int64_t>{11, 2}, {13, 3}, {9, 1}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
        const std::vector<std::string> params{
            "segment_len=4", "memory_len=3", "block_q=3", "compressed_len=2", param("compression_rate", rate),
            "aux_loss=on"};
        const SegmentAttentionConfig c =
            compressive_config(resolve_params("compressive", find_model("compressive")->impl.params, params));
        const auto in = random_inputs(p, 5);
        const BackwardRun run = run_backward("compressive", p, in, random_like(p, 5, "dout"), params);
        const Tensor* grad = nullptr;
        for (const auto& named : run.mechanism->parameter_gradients())
          if (named.name == "dconv_weights") grad = named.tensor;
        REQUIRE(grad != nullptr);
        CHECK(max_abs(grad->data(), grad->size()) > 0);
        Tensor one(Shape{1});
        one[0] = 1.0f;
        const Tensor& weights = parameter(*run.mechanism, "conv_weights");
        check_against_differences(
            "compressive aux_loss N=" + std::to_string(n), {{"conv_weights", widened(weights.data(), weights.size())}},
            {{"conv_weights", grad}}, one,
            [&](const NamedValues& x) { return std::vector<double>{reconstruction_loss(x, in, c, p)}; },
            std::log2(static_cast<double>(n)) + p.head_dim * rate, true);
      }
    const Problem p{.batch = 1, .heads = 1, .seq_len = 16, .head_dim = 4};
    CHECK_THROWS_AS(validate_point(counter_point("compressive", p, {"compression=max", "aux_loss=on"})), ParamError);
  }

  TEST_CASE("transformer-xl: query tiles at, below and above the segment length") {
    for (std::int64_t block : {1, 11, 12, 13, 64})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 1, .heads = 3, .seq_len = 41, .head_dim = 16, .causal = causal};
        check_model("transformer-xl", p, {"segment_len=12", "memory_len=12", param("block_q", block)});
      }
  }

  TEST_CASE("transformer-xl: one segment covering the sequence equals attention with relative terms on positions") {
    // Reference on absolute positions over the whole sequence: causal j <= i, or all j (δ < 0 too).
    for (std::int64_t n : {1, 37, 64})
      for (std::int64_t segment : {n, n + 1, std::int64_t{512}})
        for (bool causal : {true, false}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const auto in = random_inputs(p, 99);
          Run run = run_model("transformer-xl", p, in, {param("segment_len", segment)});
          const double scale = 0.25;
          for (std::int64_t h = 0; h < p.heads; ++h) {
            const float* u = parameter(*run.mechanism, "pos_bias_u").data() + h * 16;
            const float* v = parameter(*run.mechanism, "pos_bias_v").data() + h * 16;
            RelativeKeys relative(parameter(*run.mechanism, "w_r"), h);
            const float *q = in.q.head(0, h), *k = in.k.head(0, h), *val = in.v.head(0, h);
            std::vector<double> want(static_cast<std::size_t>(n * 16), 0.0);
            double largest_terms = 0, largest_value = 0;
            for (std::int64_t e = 0; e < n * 16; ++e)
              largest_value = std::max(largest_value, std::fabs(double(val[e])));
            for (std::int64_t i = 0; i < n; ++i) {
              const std::int64_t end = causal ? i + 1 : n;
              std::vector<double> scores(static_cast<std::size_t>(end));
              for (std::int64_t j = 0; j < end; ++j) {
                const auto& r = relative(i - j);
                double s = 0, terms = 0;
                for (std::int64_t f = 0; f < 16; ++f) {
                  s += q[i * 16 + f] * k[j * 16 + f] + q[i * 16 + f] * r[f] + u[f] * k[j * 16 + f] + v[f] * r[f];
                  terms += std::fabs((q[i * 16 + f] + u[f]) * k[j * 16 + f]) + std::fabs((q[i * 16 + f] + v[f]) * r[f]);
                }
                scores[j] = s * scale;
                largest_terms = std::max(largest_terms, terms * scale);
              }
              const double peak = *std::max_element(scores.begin(), scores.end());
              double sum = 0;
              for (double s : scores) sum += std::exp(s - peak);
              for (std::int64_t j = 0; j < end; ++j)
                for (std::int64_t f = 0; f < 16; ++f)
                  want[i * 16 + f] += std::exp(scores[j] - peak) / sum * val[j * 16 + f];
            }
            const double tolerance = 8 * kFloatEps * (largest_terms + std::log2(double(n)) + 1) * largest_value;
            check_close(
                run.out.head(0, h), want, tolerance,
                "one segment N=" + std::to_string(n) + " L=" + std::to_string(segment) + (causal ? " causal" : ""));
          }
          CHECK(run.state().memory_length() == n);
        }
  }

  TEST_CASE("compression functions equal naive pooling and convolution, ragged last group included") {
    const std::int64_t d = 5;
    Tensor rows(Shape{9, d}), weights(Shape{4 * d, d}), out(Shape{9, d});
    for (std::int64_t e = 0; e < rows.size(); ++e) rows[e] = std::sin(1.7 * e) * 3;
    for (std::int64_t e = 0; e < weights.size(); ++e) weights[e] = std::cos(0.9 * e) / 4;
    for (Compression f : {Compression::MaxPool, Compression::MeanPool, Compression::Conv})
      for (std::int64_t rate : {1, 2, 3, 4})
        for (std::int64_t count : {1, 2, 3, 4, 5, 7, 9}) {
          FlopCounter::reset();
          const std::int64_t other = compress_rows(f, rows.data(), count, d, rate, weights.data(), out.data());
          CHECK(FlopCounter::total() + other == compress_flops(f, count, d, rate));
          Rows want;
          for (std::int64_t g = 0; g < count; g += rate) {
            Rows group;
            for (std::int64_t t = g; t < std::min(g + rate, count); ++t)
              group.emplace_back(rows.data() + t * d, rows.data() + (t + 1) * d);
            want.push_back(naive_compress(f, group, weights.data()));
          }
          REQUIRE(static_cast<std::int64_t>(want.size()) == (count + rate - 1) / rate);
          check_rows(out.data(), want, 8 * kFloatEps * rate * d * 3,
                     "compress f=" + std::to_string(int(f)) + " rate=" + std::to_string(rate) +
                         " count=" + std::to_string(count));
        }
  }

  TEST_CASE("compressive: segment-wise output equals one naive pass over [compressed ; memory ; segment]") {
    // L = 12; memory at, below L; compressed memory 5 or 6 slots; rates 2, 3; N around multiples.
    for (const char* f : {"max", "mean", "conv"})
      for (std::int64_t memory : {12, 7})
        for (std::int64_t n : {11, 12, 13, 24, 25, 36, 37, 61, 100})
          for (bool causal : {false, true}) {
            const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
            check_model(
                "compressive", p,
                {"segment_len=12", param("memory_len", memory), param("compressed_len", memory == 12 ? 6 : 5),
                 param("compression_rate", memory == 12 ? 3 : 2), std::string("compression=") + f, "block_q=5"});
          }
  }

  TEST_CASE("compressive: no memory, every segment compressed straight away; rates above the segment") {
    for (std::int64_t rate : {1, 4, 13})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 1, .heads = 1, .seq_len = 50, .head_dim = 8, .causal = causal};
        check_model("compressive", p,
                    {"segment_len=12", "memory_len=0", "compressed_len=7", param("compression_rate", rate),
                     "compression=conv"});
      }
  }

  TEST_CASE("compressive with rate 1 and pooling is transformer-xl with memory M + n_cm, bit for bit") {
    for (Compression f : {Compression::MaxPool, Compression::MeanPool})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = 77, .head_dim = 16, .causal = causal};
        const auto in = random_inputs(p, 8);
        const Run compressive = run_direct({.model = "x",
                                            .segment_len = 10,
                                            .memory_len = 6,
                                            .compressed_len = 9,
                                            .rate = 1,
                                            .compression = f,
                                            .block_q = 4},
                                           p, in);
        const Run xl = run_direct({.model = "x", .segment_len = 10, .memory_len = 15, .block_q = 4}, p, in);
        CHECK(std::memcmp(compressive.out.data(), xl.out.data(), static_cast<std::size_t>(xl.out.bytes())) == 0);
      }
  }

  TEST_CASE("whole heads per thread and threads sharing a segment's tiles give identical results") {
    // B·H = 1 below the thread count runs the shared-segment schedule; one thread runs whole heads.
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 1, .seq_len = 70, .head_dim = 8, .causal = causal};
      const auto in = random_inputs(p, 12);
      const std::vector<std::string> params{"segment_len=16", "memory_len=9", "compressed_len=4", "block_q=5"};
      const ModelInfo* info = find_model("compressive");
      REQUIRE(info != nullptr);
      auto run_on = [&](int threads) {
        Problem on = p;
        on.threads = threads;
        auto mechanism = info->impl.create(on, resolve_params("compressive", info->impl.params, params), 42);
        mechanism->prepare(in.q, in.k, in.v);
        Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
        mechanism->forward(in.q, in.k, in.v, out);
        return out;
      };
      const Tensor shared = run_on(2);
      const Tensor whole = run_on(1);
      CHECK(std::memcmp(shared.data(), whole.data(), static_cast<std::size_t>(whole.bytes())) == 0);
    }
  }

  TEST_CASE("the memory FIFO keeps exactly M slots and the compressed memory exactly n_cm") {
    const Problem p{.batch = 2, .heads = 2, .seq_len = 95, .head_dim = 8, .causal = true};
    const auto in = random_inputs(p, 4);
    Run xl = run_model("transformer-xl", p, in, {"segment_len=10", "memory_len=7"});
    CHECK(xl.state().memory_length() == 7);
    CHECK(xl.state().compressed_length() == 0);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 2; ++h) {
        CHECK(std::memcmp(xl.state().memory_rows(false, b, h), in.k.head(b, h) + 88 * 8, 7 * 8 * sizeof(float)) == 0);
        CHECK(std::memcmp(xl.state().memory_rows(true, b, h), in.v.head(b, h) + 88 * 8, 7 * 8 * sizeof(float)) == 0);
      }
    Run compressive =
        run_model("compressive", p, in,
                  {"segment_len=10", "memory_len=7", "compressed_len=4", "compression_rate=3", "compression=max"});
    CHECK(compressive.state().memory_length() == 7);
    CHECK(compressive.state().compressed_length() == 4);
    // The last segment (90 … 94) evicted positions 83 … 87 of [83 … 89 ; 90 … 94]: groups
    // {83, 84, 85} and {86, 87}; the slots before came from segment 80 … 89 evicting 73 … 82:
    // {73, 74, 75}, {76, 77, 78}, {79, 80, 81}, {82}. The newest four: {79..81}, {82}, {83..85}, {86, 87}.
    const std::vector<std::pair<int, int>> groups{{79, 82}, {82, 83}, {83, 86}, {86, 88}};
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::size_t s = 0; s < groups.size(); ++s)
        for (std::int64_t j = 0; j < 8; ++j) {
          float want = -INFINITY;
          for (int t = groups[s].first; t < groups[s].second; ++t) want = std::max(want, in.k.head(1, h)[t * 8 + j]);
          CHECK(compressive.state().compressed_rows(false, 1, h)[s * 8 + j] == want);
        }
    Run early = run_model("compressive", {.batch = 1, .heads = 1, .seq_len = 5, .head_dim = 8, .causal = true},
                          random_inputs({.batch = 1, .heads = 1, .seq_len = 5, .head_dim = 8}, 1),
                          {"segment_len=10", "memory_len=7", "compressed_len=4"});
    CHECK(early.state().memory_length() == 5);
    CHECK(early.state().compressed_length() == 0);
  }

  TEST_CASE("causal: changing future tokens changes no earlier output") {
    for (const char* model : {"transformer-xl", "compressive"}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 90, .head_dim = 8, .causal = true};
      const std::vector<std::string> params{"segment_len=16", "memory_len=9"};
      auto in = random_inputs(p, 5);
      const Tensor before = run_model(model, p, in, params).out.clone();
      const std::int64_t cut = 37;  // inside the third segment
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t e = cut * 8; e < p.seq_len * 8; ++e) {
          in.k.head(0, h)[e] += 3.0f;
          in.v.head(0, h)[e] -= 5.0f;
          in.q.head(0, h)[e] *= -1.0f;
        }
      const Tensor after = run_model(model, p, in, params).out.clone();
      for (std::int64_t h = 0; h < 2; ++h) {
        CHECK(std::memcmp(before.head(0, h), after.head(0, h), cut * 8 * sizeof(float)) == 0);
        CHECK(std::memcmp(before.head(0, h) + cut * 8, after.head(0, h) + cut * 8, 8 * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("not causal: a query sees its whole segment and the memory, never a later segment") {
    for (const char* model : {"transformer-xl", "compressive"}) {
      const Problem p{.batch = 1, .heads = 1, .seq_len = 64, .head_dim = 8, .causal = false};
      const std::vector<std::string> params{"segment_len=16", "memory_len=16"};
      auto in = random_inputs(p, 6);
      const Tensor before = run_model(model, p, in, params).out.clone();
      for (std::int64_t e = 0; e < 8; ++e) in.k.head(0, 0)[40 * 8 + e] += 2.0f;  // token 40: segment 32 … 47
      const Tensor after = run_model(model, p, in, params).out.clone();
      CHECK(std::memcmp(before.data(), after.data(), 32 * 8 * sizeof(float)) == 0);
      CHECK(std::memcmp(before.data() + 32 * 8, after.data() + 32 * 8, 8 * sizeof(float)) != 0);
    }
  }

  TEST_CASE("executed FLOPs equal the analytic count over several segments, compressions and tiles") {
    for (const char* f : {"max", "mean", "conv"})
      for (bool causal : {false, true})
        for (std::int64_t n : {1, 47, 100}) {
          const std::vector<std::string> params{"segment_len=16",
                                                "memory_len=9",
                                                "compressed_len=5",
                                                "compression_rate=3",
                                                std::string("compression=") + f,
                                                "block_q=7"};
          const auto config = quick_point("compressive", n, causal, params);
          const ModelInfo* info = find_model("compressive");
          CAPTURE(f);
          CAPTURE(n);
          CAPTURE(causal);
          CHECK(run_point(config).flops ==
                info->impl.flops(config.problem, resolve_params("compressive", info->impl.params, params)));
        }
    for (bool causal : {false, true}) {
      const std::vector<std::string> params{"segment_len=16", "memory_len=20", "block_q=6"};
      const auto config = quick_point("transformer-xl", 83, causal, params);
      const ModelInfo* info = find_model("transformer-xl");
      CHECK(run_point(config).flops ==
            info->impl.flops(config.problem, resolve_params("transformer-xl", info->impl.params, params)));
    }
  }

  TEST_CASE("default segment and memory sizes: workspace constant in N, FLOPs linear") {
    for (const char* model : {"transformer-xl", "compressive"}) {
      CAPTURE(model);
      const ModelInfo* info = find_model(model);
      const auto small = run_point(quick_point(model, 2048, true, {}, 1, 16));
      const auto large = run_point(quick_point(model, 16384, true, {}, 1, 16));
      CHECK(large.workspace_bytes <= 2 * small.workspace_bytes);
      CHECK(static_cast<double>(large.workspace_bytes) <=
            1.05 * static_cast<double>(large.estimated_workspace_bytes) + 65536);
      const ParamValues defaults = resolve_params(model, info->impl.params, {});
      CHECK(large.flops == info->impl.flops(quick_point(model, 16384, true, {}, 1, 16).problem, defaults));
      // Once the caches are full (compressive: after 2560 tokens) every segment costs the same:
      // 8192 more tokens cost exactly twice what 4096 more cost.
      auto flops = [&](std::int64_t n) {
        return static_cast<double>(info->impl.flops(quick_point(model, n, true, {}, 1, 16).problem, defaults));
      };
      CHECK((flops(16384) - flops(8192)) == doctest::Approx(2 * (flops(8192) - flops(4096))).epsilon(1e-12));
      const double flop_ratio = flops(16384) / flops(2048);
      CHECK(flop_ratio > 8);
      CHECK(flop_ratio < 16);
    }
  }
}
