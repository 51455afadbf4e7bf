// The fixed-pattern + global-memory hybrids (memory-compressed, longformer, etc, bigbird) against
// naive double-precision attention restricted to exactly their patterns. The masks, the strided
// convolution and the global projections are written here from the papers' definitions,
// independently of the mechanisms; BigBird's random blocks are read from its parameters().
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>

#include "apps/bench/point.hpp"
#include "lib/core/dnnl_context.hpp"
#include "taxonomy/fixed_patterns/memory_compressed.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

struct Ran {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out;
};

Ran run_model(const std::string& model, const Problem& p, const AttentionInputs& in,
              const std::vector<std::string>& params, std::uint64_t seed = 42) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  Ran ran{info->impl.create(on_test_threads(p), resolve_params(model, info->impl.params, params), seed),
          Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim)};
  ran.mechanism->prepare(in.q, in.k, in.v);
  ran.out.fill(std::nanf(""));  // every element must be written
  ran.mechanism->forward(in.q, in.k, in.v, ran.out);
  return ran;
}

std::string describe(const std::string& model, const Problem& p, const std::vector<std::string>& params) {
  std::ostringstream text;
  text << model << " N=" << p.seq_len << " H=" << p.heads << (p.causal ? " causal" : "");
  for (const auto& assignment : params) text << " " << assignment;
  return text.str();
}

// Checks rows [begin, end) of head (b, h) against want ([N, D]).
void check_rows(const Tensor& got, std::int64_t b, std::int64_t h, const std::vector<double>& want, std::int64_t begin,
                std::int64_t end, double tolerance, const std::string& label) {
  const std::int64_t d = got.dim(3);
  const float* out = got.head(b, h);
  std::int64_t failures = 0;
  for (std::int64_t e = begin * d; e < end * d; ++e) {
    const double error = std::fabs(static_cast<double>(out[e]) - want[static_cast<std::size_t>(e)]);
    if (!(error <= tolerance) && failures++ < 3)
      FAIL_CHECK(label << ": b=" << b << " h=" << h << " token " << e / d << " feature " << e % d << ": got " << out[e]
                       << ", want " << want[static_cast<std::size_t>(e)] << " (tolerance " << tolerance << ")");
  }
  CHECK_MESSAGE(failures == 0, label << " h=" << h << ": " << failures << " elements out of tolerance");
}

// Every head of `got` against reference_attention with the head's own mask.
void check_masked(const Tensor& got, const AttentionInputs& in, const Problem& p,
                  const std::function<MaskFn(std::int64_t head)>& mask_of_head, const std::string& label,
                  std::int64_t rows_from = 0) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto want =
          reference_attention(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale, mask_of_head(h));
      const double tolerance = attention_tolerance(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale);
      check_rows(got, b, h, want, std::min(rows_from, n), n, tolerance, label);
    }
}

// y = x·w for x [n, d] and w [d, d] (row vector times matrix), in double.
std::vector<double> project(const float* x, const float* w, std::int64_t n, std::int64_t d) {
  std::vector<double> y(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < d; ++c)
      for (std::int64_t o = 0; o < d; ++o) y[i * d + o] += static_cast<double>(x[i * d + c]) * w[c * d + o];
  return y;
}

std::vector<float> to_float(const std::vector<double>& x) { return {x.begin(), x.end()}; }

// ---------------------------------------------------------------------------------------------
// Longformer: window of s = w/2 dilated steps each side (causal: past side), first g global.

MaskFn longformer_window_mask(std::int64_t window, std::int64_t dilation, std::int64_t globals, bool causal) {
  return [=](std::int64_t i, std::int64_t j) {
    if (causal && j > i) return false;
    if (j < globals) return true;
    const std::int64_t offset = i - j, reach = window / 2 * dilation;
    if (offset % dilation != 0) return false;
    return causal ? offset <= reach : std::abs(offset) <= reach;
  };
}

struct LongformerCase {
  std::int64_t window = 512, dilation = 1, dilated_heads = 2, globals = 1;
  std::vector<std::string> extra;  // e.g. tile
  std::vector<std::string> params() const {
    std::vector<std::string> list{"window=" + std::to_string(window), "dilation=" + std::to_string(dilation),
                                  "dilated_heads=" + std::to_string(dilated_heads),
                                  "globals=" + std::to_string(globals)};
    list.insert(list.end(), extra.begin(), extra.end());
    return list;
  }
};

// Global rows: softmax((q·Wq)(K·Wk)ᵀ/√D)(V·Wv) over every key (causal: j ≤ i), in double.
void check_longformer_globals(const Ran& ran, const AttentionInputs& in, const Problem& p, std::int64_t globals,
                              const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim, g = std::min(globals, n);
  if (g == 0) return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Tensor& wq = parameter(*ran.mechanism, "global_wq");
  const Tensor& wk = parameter(*ran.mechanism, "global_wk");
  const Tensor& wv = parameter(*ran.mechanism, "global_wv");
  REQUIRE(wq.shape() == Shape{p.heads, d, d});
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto q = to_float(project(in.q.head(b, h), wq.data() + h * d * d, n, d));
      const auto k = to_float(project(in.k.head(b, h), wk.data() + h * d * d, n, d));
      const auto v = to_float(project(in.v.head(b, h), wv.data() + h * d * d, n, d));
      const bool causal = p.causal;
      const auto want = reference_attention(q.data(), k.data(), v.data(), g, n, d, scale,
                                            [&](std::int64_t i, std::int64_t j) { return !causal || j <= i; });
      // The mechanism multiplies three more length-D products in float (q·Wq·Wkᵀ and ·Wv) than the
      // reference on projected inputs, each within D·eps relative: allow four times the budget.
      const double tolerance = 4 * attention_tolerance(q.data(), k.data(), v.data(), g, n, d, scale);
      std::vector<double> padded(static_cast<std::size_t>(n * d), 0.0);
      std::copy(want.begin(), want.end(), padded.begin());
      check_rows(ran.out, b, h, padded, 0, g, tolerance, label + " global rows");
    }
}

// y = x·w for x [n, d] and w [d, d], all in double.
std::vector<double> project(const double* x, const double* w, std::int64_t n, std::int64_t d) {
  std::vector<double> y(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < d; ++c)
      for (std::int64_t o = 0; o < d; ++o) y[i * d + o] += x[i * d + c] * w[c * d + o];
  return y;
}

// The whole longformer forward in double, from q, k, v and the global projections.
ModelReference longformer_reference(const Problem& p, const LongformerCase& c) {
  return [p, c](const NamedValues& x) {
    const std::int64_t n = p.seq_len, d = p.head_dim, g = std::min(c.globals, n);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> out(static_cast<std::size_t>(p.batch * p.heads * n * d));
    for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
      const std::int64_t h = head % p.heads, dilation = h >= p.heads - c.dilated_heads ? c.dilation : 1;
      const double *q = x.at("q").data() + head * n * d, *k = x.at("k").data() + head * n * d,
                   *v = x.at("v").data() + head * n * d;
      auto window =
          reference_attention(q, k, v, n, n, d, scale, longformer_window_mask(c.window, dilation, g, p.causal));
      if (g > 0) {
        const auto qg = project(q, x.at("global_wq").data() + h * d * d, g, d);
        const auto kg = project(k, x.at("global_wk").data() + h * d * d, n, d);
        const auto vg = project(v, x.at("global_wv").data() + h * d * d, n, d);
        const bool causal = p.causal;
        const auto global = reference_attention(qg.data(), kg.data(), vg.data(), g, n, d, scale,
                                                [=](std::int64_t i, std::int64_t j) { return !causal || j <= i; });
        std::copy(global.begin(), global.end(), window.begin());
      }
      std::copy(window.begin(), window.end(), out.begin() + head * n * d);
    }
    return out;
  };
}

void check_longformer(const Problem& p, const LongformerCase& c, std::uint64_t seed) {
  const auto in = random_inputs(p, seed);
  const auto params = c.params();
  const Ran ran = run_model("longformer", p, in, params);
  const std::string label = describe("longformer", p, params);
  auto mask_of_head = [&](std::int64_t h) {
    const std::int64_t dilation = h >= p.heads - c.dilated_heads ? c.dilation : 1;
    return longformer_window_mask(c.window, dilation, c.globals, p.causal);
  };
  check_masked(ran.out, in, p, mask_of_head, label, c.globals);
  check_longformer_globals(ran, in, p, c.globals, label);
}

// ---------------------------------------------------------------------------------------------
// BigBird: blocks of b; first ⌈g/2⌉ and last ⌊g/2⌋ blocks global; window blocks around the
// query block; random blocks as exposed.

struct BigBirdCase {
  std::int64_t block = 64, window = 3, random = 3, globals = 2;
  std::vector<std::string> params() const {
    return {"block=" + std::to_string(block), "window_blocks=" + std::to_string(window),
            "random_blocks=" + std::to_string(random), "global_blocks=" + std::to_string(globals)};
  }
};

struct BigBirdGeometry {
  std::int64_t n, block, blocks, front, back, before, after;
  BigBirdGeometry(std::int64_t tokens, const BigBirdCase& c)
      : n(tokens),
        block(c.block),
        blocks((tokens + c.block - 1) / c.block),
        front((c.globals + 1) / 2),
        back(c.globals / 2),
        before((c.window - 1) / 2),
        after(c.window / 2) {}
  bool global(std::int64_t blk) const { return front + back >= blocks || blk < front || blk >= blocks - back; }
  bool in_window(std::int64_t qb, std::int64_t kb) const { return kb >= qb - before && kb <= qb + after; }
  bool full(std::int64_t blk) const { return std::min((blk + 1) * block, n) - blk * block == block; }
};

std::set<std::int64_t> random_set(const Tensor& random, std::int64_t h, std::int64_t qb) {
  std::set<std::int64_t> chosen;
  const std::int64_t blocks = random.dim(1), r = random.dim(2);
  for (std::int64_t t = 0; t < r; ++t) {
    const float blk = random[(h * blocks + qb) * r + t];
    if (blk >= 0) chosen.insert(static_cast<std::int64_t>(blk));
  }
  return chosen;
}

// The pattern of head h given the random blocks the mechanism exposes.
MaskFn bigbird_mask(const Tensor& random, const BigBirdGeometry& geo, std::int64_t h) {
  std::vector<std::set<std::int64_t>> chosen;
  for (std::int64_t qb = 0; qb < geo.blocks; ++qb) chosen.push_back(random_set(random, h, qb));
  return [geo, chosen](std::int64_t i, std::int64_t j) {
    const std::int64_t qb = i / geo.block, kb = j / geo.block;
    return geo.global(qb) || geo.global(kb) || geo.in_window(qb, kb) || chosen[qb].count(kb) > 0;
  };
}

void check_bigbird(const Problem& p, const BigBirdCase& c, std::uint64_t seed) {
  const auto in = random_inputs(p, seed);
  const auto params = c.params();
  const Ran ran = run_model("bigbird", p, in, params);
  const Tensor& random = parameter(*ran.mechanism, "random_blocks");
  const BigBirdGeometry geo(p.seq_len, c);
  REQUIRE(random.shape() == Shape{p.heads, geo.blocks, c.random});
  check_masked(
      ran.out, in, p, [&](std::int64_t h) { return bigbird_mask(random, geo, h); }, describe("bigbird", p, params));
}

// Gradients against the reference with the pattern of the random blocks the same seed draws.
void check_bigbird_gradients(const Problem& p, const BigBirdCase& c) {
  const std::uint64_t seed = 7;
  const Ran ran = run_model("bigbird", p, random_inputs(p, seed), c.params(), seed);
  const Tensor& random = parameter(*ran.mechanism, "random_blocks");
  const BigBirdGeometry geo(p.seq_len, c);
  check_model_gradients(
      "bigbird", p, [&](std::int64_t h, std::int64_t i, std::int64_t j) { return bigbird_mask(random, geo, h)(i, j); },
      c.params(), seed);
}

// ---------------------------------------------------------------------------------------------
// Memory compressed: local blocks; strided convolution K̂[t,o] = Σ_u Σ_i W[o,i,u]·k[c·t+u, i].

struct Compressed {
  std::vector<double> keys, values;       // [N_c, D]
  double key_error = 0, value_error = 0;  // bound on |float result − exact| per element
};

// Naive convolution of one head (x: [N, D], w: [D_out, D_in, c]) and a float rounding bound
// (2·c·D·eps·Σ|terms|, the classical bound for a length c·D sum, doubled).
std::vector<double> convolve(const float* x, const float* w, std::int64_t n, std::int64_t d, std::int64_t c,
                             double& bound) {
  const std::int64_t slots = (n + c - 1) / c;
  std::vector<double> y(static_cast<std::size_t>(slots * d), 0.0);
  for (std::int64_t t = 0; t < slots; ++t)
    for (std::int64_t o = 0; o < d; ++o) {
      double magnitude = 0;
      for (std::int64_t u = 0; u < c; ++u) {
        if (c * t + u >= n) continue;  // zero padding after the last token
        for (std::int64_t i = 0; i < d; ++i) {
          const double term = static_cast<double>(w[(o * d + i) * c + u]) * x[(c * t + u) * d + i];
          y[t * d + o] += term;
          magnitude += std::fabs(term);
        }
      }
      bound = std::max(bound, 2.0 * static_cast<double>(c * d) * kFloatEps * magnitude);
    }
  return y;
}

// The whole memory-compressed forward in double, from q, k, v and the convolution weights.
ModelReference memory_compressed_reference(const Problem& p, std::int64_t local_heads, std::int64_t block,
                                           std::int64_t c) {
  return [=](const NamedValues& x) {
    const std::int64_t n = p.seq_len, d = p.head_dim, slots = (n + c - 1) / c;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> out(static_cast<std::size_t>(p.batch * p.heads * n * d));
    for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
      const std::int64_t h = head % p.heads;
      const double *q = x.at("q").data() + head * n * d, *k = x.at("k").data() + head * n * d,
                   *v = x.at("v").data() + head * n * d;
      std::vector<double> result;
      if (h < local_heads) {
        result = reference_attention(q, k, v, n, n, d, scale, [=](std::int64_t i, std::int64_t j) {
          return i / block == j / block && (!p.causal || j <= i);
        });
      } else {
        auto convolve = [&](const double* rows, const std::vector<double>& w) {
          std::vector<double> y(static_cast<std::size_t>(slots * d), 0.0);
          const double* wh = w.data() + (h - local_heads) * d * d * c;
          for (std::int64_t t = 0; t < slots; ++t)
            for (std::int64_t o = 0; o < d; ++o)
              for (std::int64_t u = 0; u < c && c * t + u < n; ++u)
                for (std::int64_t i = 0; i < d; ++i)
                  y[t * d + o] += wh[(o * d + i) * c + u] * rows[(c * t + u) * d + i];
          return y;
        };
        const auto keys = convolve(k, x.at("compress_wk")), values = convolve(v, x.at("compress_wv"));
        result = reference_attention(q, keys.data(), values.data(), n, slots, d, scale,
                                     [=](std::int64_t i, std::int64_t t) { return !p.causal || c * t + c - 1 <= i; });
      }
      std::copy(result.begin(), result.end(), out.begin() + head * n * d);
    }
    return out;
  };
}

struct MemoryCompressedCase {
  std::string mode = "split";
  std::int64_t block = 256, compression = 3;
  std::vector<std::string> extra;
  std::vector<std::string> params() const {
    std::vector<std::string> list{"mode=" + mode, "block=" + std::to_string(block),
                                  "compression=" + std::to_string(compression)};
    list.insert(list.end(), extra.begin(), extra.end());
    return list;
  }
  std::int64_t local_heads(std::int64_t heads) const {
    return mode == "local" ? heads : mode == "compressed" ? 0 : (heads + 1) / 2;
  }
};

// Compressed head: attention of q over the naive K̂, V̂; slot t visible to i when causal iff
// c·t + c − 1 ≤ i. The tolerance adds the convolution's rounding, carried through the scores.
void check_compressed_head(const Ran& ran, const AttentionInputs& in, const Problem& p, const MemoryCompressedCase& c,
                           std::int64_t b, std::int64_t h, const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim, k = c.compression, slots = (n + k - 1) / k;
  const std::int64_t hc = h - c.local_heads(p.heads);
  const Tensor& wk = parameter(*ran.mechanism, "compress_wk");
  const Tensor& wv = parameter(*ran.mechanism, "compress_wv");
  REQUIRE(wk.shape() == Shape{p.heads - c.local_heads(p.heads), d, d, k});
  double key_bound = 0, value_bound = 0;
  const auto keys = convolve(in.k.head(b, h), wk.data() + hc * d * d * k, n, d, k, key_bound);
  const auto values = convolve(in.v.head(b, h), wv.data() + hc * d * d * k, n, d, k, value_bound);

  // The mechanism's own compressed memories against the naive convolution.
  const auto* memories = dynamic_cast<const MemoryCompressedMemories*>(ran.mechanism.get());
  REQUIRE(memories != nullptr);
  const float* got_keys = memories->compressed_keys().head(b, hc);
  const float* got_values = memories->compressed_values().head(b, hc);
  std::int64_t bad = 0;
  for (std::int64_t e = 0; e < slots * d; ++e) {
    bad += std::fabs(got_keys[e] - keys[static_cast<std::size_t>(e)]) > key_bound;
    bad += std::fabs(got_values[e] - values[static_cast<std::size_t>(e)]) > value_bound;
  }
  CHECK_MESSAGE(bad == 0,
                label << " h=" << h << ": " << bad << " compressed entries differ from the naive convolution");

  const auto keys_f = to_float(keys), values_f = to_float(values);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const bool causal = p.causal;
  const auto want = reference_attention(in.q.head(b, h), keys_f.data(), values_f.data(), n, slots, d, scale,
                                        [&](std::int64_t i, std::int64_t t) { return !causal || k * t + k - 1 <= i; });
  double largest_q = 0, largest_v = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double row = 0;
    for (std::int64_t f = 0; f < d; ++f) row += std::fabs(in.q.head(b, h)[i * d + f]);
    largest_q = std::max(largest_q, row);
  }
  for (double value : values) largest_v = std::max(largest_v, std::fabs(value));
  // A score moves by at most |q|₁·δK·scale; softmax weights then move by at most twice that.
  const double carried = 2 * largest_v * largest_q * key_bound * scale + value_bound;
  const double tolerance =
      attention_tolerance(in.q.head(b, h), keys_f.data(), values_f.data(), n, slots, d, scale) + carried;
  check_rows(ran.out, b, h, want, 0, n, tolerance, label + " compressed");
}

void check_memory_compressed(const Problem& p, const MemoryCompressedCase& c, std::uint64_t seed) {
  const auto in = random_inputs(p, seed);
  const auto params = c.params();
  const Ran ran = run_model("memory-compressed", p, in, params);
  const std::string label = describe("memory-compressed", p, params);
  const std::int64_t n = p.seq_len, d = p.head_dim, local = c.local_heads(p.heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::int64_t block = c.block;
  const bool causal = p.causal;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      if (h >= local) {
        check_compressed_head(ran, in, p, c, b, h, label);
        continue;
      }
      const auto want = reference_attention(
          in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale,
          [&](std::int64_t i, std::int64_t j) { return i / block == j / block && (!causal || j <= i); });
      const double tolerance = attention_tolerance(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale);
      check_rows(ran.out, b, h, want, 0, n, tolerance, label + " local");
    }
}

// ---------------------------------------------------------------------------------------------

void check_future_invariance(const std::string& model, const std::vector<std::string>& params) {
  const Problem p{.batch = 1, .heads = 3, .seq_len = 150, .head_dim = 16, .causal = true};
  auto in = random_inputs(p, 8);
  const Tensor before = run_model(model, p, in, params).out;
  const std::int64_t cut = 77;
  for (std::int64_t h = 0; h < p.heads; ++h)
    for (std::int64_t e = cut * 16; e < p.seq_len * 16; ++e) {
      in.k.head(0, h)[e] += 3.0f;
      in.v.head(0, h)[e] -= 5.0f;
      in.q.head(0, h)[e] *= -1.0f;
    }
  const Tensor after = run_model(model, p, in, params).out;
  for (std::int64_t h = 0; h < p.heads; ++h) {
    CAPTURE(h);
    CHECK(std::memcmp(before.head(0, h), after.head(0, h), cut * 16 * sizeof(float)) == 0);
    CHECK(std::memcmp(before.head(0, h) + cut * 16, after.head(0, h) + cut * 16, 16 * sizeof(float)) != 0);
  }
}

PointConfig point(const std::string& model, std::int64_t n, std::vector<std::string> params) {
  return counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = false},
                       std::move(params));
}

struct Counters {
  double flops, workspace, peak;
};
Counters counters(const std::string& model, std::int64_t n, const std::vector<std::string>& params) {
  DnnlContext::instance().clear_cache();
  const ResultRow row = run_point(point(model, n, params));
  REQUIRE(row.status == Status::Ok);
  return {static_cast<double>(row.flops), static_cast<double>(row.workspace_bytes),
          static_cast<double>(row.peak_tensor_bytes)};
}

}  // namespace

TEST_SUITE("fixed_memory") {
  TEST_CASE("longformer: small window and tiles, at/±1 of window, tile and global counts, dilated heads") {
    for (std::int64_t n : {1, 7, 8, 9, 16, 17, 25, 100})
      for (std::int64_t globals : {0, 1, 3})
        for (std::int64_t dilation : {1, 3})
          for (bool causal : {false, true}) {
            const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
            LongformerCase c{
                .window = 16, .dilation = dilation, .dilated_heads = 1, .globals = globals, .extra = {"tile=8"}};
            check_longformer(p, c, static_cast<std::uint64_t>(n * 7 + globals));
          }
  }

  TEST_CASE("longformer: default window 512 around its half and full size, two batches") {
    for (std::int64_t n : {255, 256, 257, 511, 512, 513, 700})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        check_longformer(p, LongformerCase{}, static_cast<std::uint64_t>(n));
      }
    const Problem p{.batch = 1, .heads = 3, .seq_len = 700, .head_dim = 16, .causal = true};
    check_longformer(p, LongformerCase{.dilation = 2, .globals = 70, .extra = {}}, 9);
    check_longformer(p, LongformerCase{.window = 0, .globals = 2, .extra = {}}, 10);
  }

  TEST_CASE("longformer gradients of q, k, v and the global projections (central differences of the whole model)") {
    for (bool causal : {false, true}) {
      // Tiny: every element; window, dilation, globals and tile each cut at a non-multiple.
      const LongformerCase tiny{.window = 4, .dilation = 2, .dilated_heads = 1, .globals = 2, .extra = {"tile=4"}};
      for (std::int64_t n : {1, 5, 9}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
        check_composite_gradients("longformer", p, tiny.params(), longformer_reference(p, tiny), true);
      }
      // Larger: the directional derivative only.
      const LongformerCase c{.window = 16, .dilation = 3, .dilated_heads = 1, .globals = 3, .extra = {"tile=8"}};
      const Problem p{.batch = 2, .heads = 2, .seq_len = 70, .head_dim = 8, .causal = causal};
      check_composite_gradients("longformer", p, c.params(), longformer_reference(p, c), false);
    }
  }

  TEST_CASE("longformer: more globals than tokens makes every row global") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 20, .head_dim = 8, .causal = false};
    check_longformer(p, LongformerCase{.window = 4, .globals = 50, .extra = {"tile=8"}}, 4);
  }

  TEST_CASE("etc: global-local pattern at/±1 of the radius, the global count and the tile") {
    auto check = [](std::int64_t n, std::int64_t globals, std::int64_t radius, std::vector<std::string> extra) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false};
      const auto in = random_inputs(p, static_cast<std::uint64_t>(n + globals));
      std::vector<std::string> params{"globals=" + std::to_string(globals), "radius=" + std::to_string(radius)};
      params.insert(params.end(), extra.begin(), extra.end());
      const Tensor out = run_model("etc", p, in, params).out;
      const MaskFn mask = [=](std::int64_t i, std::int64_t j) {
        return i < globals || j < globals || std::abs(i - j) <= radius;
      };
      check_masked(
          out, in, p, [&](std::int64_t) { return mask; }, describe("etc", p, params));
    };
    for (std::int64_t n : {1, 3, 4, 5, 8, 9, 20, 41})
      for (std::int64_t globals : {0, 2, 5})
        for (std::int64_t radius : {0, 3}) check(n, globals, radius, {"tile=4"});
    for (std::int64_t n : {1, 84, 85, 229, 230, 231, 400, 500}) check(n, 230, 84, {});
  }

  TEST_CASE("etc gradients against the global-local mask, at/±1 of the radius, the global count and the tile") {
    auto check = [](std::int64_t n, std::int64_t globals, std::int64_t radius, std::vector<std::string> extra) {
      std::vector<std::string> params{"globals=" + std::to_string(globals), "radius=" + std::to_string(radius)};
      params.insert(params.end(), extra.begin(), extra.end());
      check_model_gradients(
          "etc", {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8},
          [=](std::int64_t, std::int64_t i, std::int64_t j) {
            return i < globals || j < globals || std::abs(i - j) <= radius;
          },
          params);
    };
    for (std::int64_t n : {1, 4, 5, 9, 20})
      for (std::int64_t globals : {0, 2, 5})
        for (std::int64_t radius : {0, 3}) check(n, globals, radius, {"tile=4"});
    for (std::int64_t n : {84, 85, 231, 300}) check(n, 230, 84, {});
  }

  TEST_CASE("bigbird: block-sparse pattern with the exposed random blocks, at/±1 of block multiples") {
    for (std::int64_t n : {1, 7, 8, 9, 40, 63, 64, 65, 100})
      for (const BigBirdCase& c : {BigBirdCase{.block = 8, .window = 3, .random = 2, .globals = 2},
                                   BigBirdCase{.block = 8, .window = 4, .random = 3, .globals = 1},
                                   BigBirdCase{.block = 8, .window = 1, .random = 1, .globals = 0},
                                   BigBirdCase{.block = 8, .window = 3, .random = 0, .globals = 3}}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false};
        check_bigbird(p, c, static_cast<std::uint64_t>(n));
      }
    for (std::int64_t n : {63, 64, 65, 511, 600, 1000}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_bigbird(p, BigBirdCase{}, static_cast<std::uint64_t>(n));
    }
  }

  TEST_CASE("bigbird gradients (random blocks held fixed) against the masked reference") {
    for (std::int64_t n : {1, 7, 8, 9, 40, 65})
      for (const BigBirdCase& c : {BigBirdCase{.block = 8, .window = 3, .random = 2, .globals = 2},
                                   BigBirdCase{.block = 8, .window = 4, .random = 3, .globals = 1},
                                   BigBirdCase{.block = 8, .window = 3, .random = 0, .globals = 3}})
        check_bigbird_gradients({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8}, c);
    check_bigbird_gradients({.batch = 1, .heads = 2, .seq_len = 200, .head_dim = 16}, BigBirdCase{});
  }

  TEST_CASE("bigbird: random blocks are distinct full candidates, as many as available, fixed by the seed") {
    const std::int64_t n = 1000;  // 16 blocks, the last one partial
    const Problem p{.batch = 1, .heads = 4, .seq_len = n, .head_dim = 8, .causal = false};
    const auto in = random_inputs(p, 1);
    for (const BigBirdCase& c : {BigBirdCase{}, BigBirdCase{.random = 20, .globals = 1}}) {
      const Ran first = run_model("bigbird", p, in, c.params(), 7);
      const Ran again = run_model("bigbird", p, in, c.params(), 7);
      const Ran other = run_model("bigbird", p, in, c.params(), 8);
      const Tensor& random = parameter(*first.mechanism, "random_blocks");
      const Tensor& random_again = parameter(*again.mechanism, "random_blocks");
      CHECK(std::memcmp(random.data(), random_again.data(), random.bytes()) == 0);
      const BigBirdGeometry geo(n, c);
      // Each query block has more than blocks/2 candidates here: small r draws a strict subset,
      // which another seed changes; r = 20 takes every candidate whatever the seed.
      if (c.random < geo.blocks / 2)
        CHECK(std::memcmp(random.data(), parameter(*other.mechanism, "random_blocks").data(), random.bytes()) != 0);
      for (std::int64_t h = 0; h < p.heads; ++h)
        for (std::int64_t qb = 0; qb < geo.blocks; ++qb) {
          std::int64_t candidates = 0, used = 0;
          for (std::int64_t kb = 0; kb < geo.blocks; ++kb)
            candidates += !geo.global(kb) && !geo.in_window(qb, kb) && geo.full(kb);
          for (std::int64_t t = 0; t < c.random; ++t) used += random[(h * geo.blocks + qb) * c.random + t] >= 0;
          const auto chosen = random_set(random, h, qb);
          CAPTURE(h);
          CAPTURE(qb);
          CHECK(static_cast<std::int64_t>(chosen.size()) == used);  // distinct
          CHECK(used == (geo.global(qb) ? 0 : std::min(c.random, candidates)));
          for (std::int64_t kb : chosen) {
            CHECK_FALSE(geo.global(kb));
            CHECK_FALSE(geo.in_window(qb, kb));
            CHECK(geo.full(kb));
          }
        }
    }
  }

  TEST_CASE("memory-compressed gradients of q, k, v and the convolution weights (central differences)") {
    for (bool causal : {false, true}) {
      for (std::int64_t n : {1, 3, 4, 5, 7}) {  // every element: stride 3 at/±1, a partial last window
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 3, .causal = causal};
        check_composite_gradients("memory-compressed", p, {"block=4", "compression=3", "tile=2"},
                                  memory_compressed_reference(p, 1, 4, 3), true);
      }
      const Problem p{.batch = 2, .heads = 3, .seq_len = 50, .head_dim = 8, .causal = causal};
      check_composite_gradients("memory-compressed", p, {"block=16", "compression=4", "tile=8"},
                                memory_compressed_reference(p, 2, 16, 4), false);
    }
  }

  TEST_CASE("memory-compressed: local blocks and the strided convolution, every mode, at/±1 of block and stride") {
    for (std::int64_t n : {1, 2, 3, 4, 15, 16, 17, 50})
      for (std::int64_t compression : {1, 3, 4})
        for (const char* mode : {"split", "local", "compressed"})
          for (bool causal : {false, true}) {
            const Problem p{.batch = 1, .heads = 3, .seq_len = n, .head_dim = 8, .causal = causal};
            MemoryCompressedCase c{.mode = mode, .block = 16, .compression = compression, .extra = {"tile=8"}};
            check_memory_compressed(p, c, static_cast<std::uint64_t>(n + compression));
          }
    for (std::int64_t n : {255, 256, 257, 600})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        check_memory_compressed(p, MemoryCompressedCase{}, static_cast<std::uint64_t>(n));
      }
  }

  TEST_CASE("causal: changing future tokens changes no earlier output") {
    check_future_invariance("longformer", {"window=16", "dilation=2", "dilated_heads=1", "globals=5", "tile=8"});
    check_future_invariance("longformer", {});
    check_future_invariance("memory-compressed", {"block=32", "tile=8"});
    check_future_invariance("memory-compressed", {"mode=compressed", "compression=4"});
  }

  TEST_CASE("FLOP and workspace counters scale like the survey's complexity") {
    // Longformer O(n(k+m)), ETC O(N_g² + N·N_g) + band, BigBird O(N): linear in N at fixed
    // pattern sizes; so is their peak tracked memory (inputs dominate; workspace grows at most
    // with the global rows' N-wide score tiles).
    for (const auto& [model, params] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"longformer", {"window=64", "globals=2"}},
             {"etc", {"globals=16", "radius=16"}},
             {"bigbird", {"block=32"}},
             {"memory-compressed", {"mode=local", "block=64"}}}) {
      CAPTURE(model);
      const Counters small = counters(model, 1024, params), large = counters(model, 4096, params);
      CHECK(large.flops / small.flops == doctest::Approx(4.0).epsilon(0.06));
      CHECK(large.peak / small.peak == doctest::Approx(4.0).epsilon(0.1));
      CHECK(large.workspace <= 4.2 * small.workspace + 65536);
    }
    // Memory compressed attention is quadratic in N (N·N/c) with O(N) memory.
    const std::vector<std::string> compressed{"mode=compressed"};
    const Counters n1 = counters("memory-compressed", 1024, compressed);
    const Counters n2 = counters("memory-compressed", 2048, compressed);
    const Counters n4 = counters("memory-compressed", 4096, compressed);
    CHECK(n2.flops / n1.flops == doctest::Approx(4.0).epsilon(0.1));
    CHECK(n4.flops / n2.flops == doctest::Approx(4.0).epsilon(0.1));
    // Workspace: constant weights plus parts linear in N, so equal steps in N add equal bytes.
    CHECK((n4.workspace - n2.workspace) / (n2.workspace - n1.workspace) == doctest::Approx(2.0).epsilon(0.1));
    // Against vanilla at the same size: far less memory.
    const Counters vanilla = counters("vanilla", 4096, {});
    for (const char* model : {"longformer", "bigbird", "etc", "memory-compressed"}) {
      CAPTURE(model);
      CHECK(counters(model, 4096, {}).peak < 0.25 * vanilla.peak);
    }
  }
}
