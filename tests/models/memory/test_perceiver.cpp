// Perceiver (latents cross-attend to the inputs, one latent self-attention) and Perceiver AR (its
// causal form) against a naive double-precision reference, their backward against central
// differences, decoding against the last row of the causal forward, and the O(M·N) scaling.
// The output has M = min(latents, N) rows: these tests allocate [B, H, M, D] outputs themselves.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/models/memory/perceiver_reference.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

const ModelInfo& perceiver_info() {
  const ModelInfo* info = find_model("perceiver");
  REQUIRE(info != nullptr);
  return *info;
}

ParamValues values_of(const std::vector<std::string>& params) {
  return resolve_params("perceiver", perceiver_info().impl.params, params);
}

std::int64_t rows_of(const Problem& p, const std::vector<std::string>& params) {
  return output_rows_of(perceiver_info().impl, p, values_of(params));
}

PerceiverShape shape_of(const std::vector<std::string>& params) {
  const ParamValues v = values_of(params);
  return {v.get_int("latents"), v.get_int("cross_window")};
}

struct Run {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out;
};

// create, prepare (and prepare_backward / prepare_decode when asked), forward; out [B, H, M, D].
Run run_perceiver(const Problem& p, const AttentionInputs& in, const std::vector<std::string>& params,
                  bool backward = false, std::int64_t decode_tokens = 0) {
  const Problem problem = on_test_threads(p);
  Run run{perceiver_info().impl.create(problem, values_of(params), 42),
          Tensor::bhnd(p.batch, p.heads, rows_of(p, params), p.head_dim)};
  run.mechanism->prepare(in.q, in.k, in.v);
  if (backward) run.mechanism->prepare_backward();
  if (decode_tokens > 0) run.mechanism->prepare_decode(decode_tokens);
  run.out.fill(std::nanf(""));
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  return run;
}

std::string label_of(const Problem& p, const std::vector<std::string>& params) {
  std::ostringstream label;
  label << "perceiver B=" << p.batch << " H=" << p.heads << " N=" << p.seq_len << " D=" << p.head_dim
        << (p.causal ? " causal" : "");
  for (const auto& param : params) label << " " << param;
  return label.str();
}

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  const AttentionInputs in = random_inputs(p, 3);
  const Run run = run_perceiver(p, in, params);
  const std::int64_t m = rows_of(p, params);
  CHECK(m == std::min(shape_of(params).latents, p.seq_len));
  PerceiverErrors scale;
  const auto want = perceiver_reference(p, shape_of(params), named_inputs(in, *run.mechanism), &scale);
  check_head(run.out.data(), want, p.batch * p.heads * m, p.head_dim, perceiver_tolerance(p, m, scale),
             label_of(p, params));
}

}  // namespace

TEST_SUITE("perceiver") {
  TEST_CASE("latents around N: N = M − 1 (M clamps to N), M, M + 1, both forms, batch 2") {
    for (bool causal : {false, true})
      for (std::int64_t n : {15, 16, 17}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
        check_forward(p, {"latents=16", "block_rows=4", "block_keys=8"});
      }
  }

  TEST_CASE("around the tiles: block_rows and block_keys one below, at and above M and N, non-multiples") {
    for (bool causal : {false, true})
      for (std::int64_t n : {7, 8, 9, 23})
        for (const char* rows : {"block_rows=4", "block_rows=5", "block_rows=6"})
          for (const char* keys : {"block_keys=7", "block_keys=8", "block_keys=9"}) {
            const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
            check_forward(p, {"latents=5", rows, keys});
          }
  }

  TEST_CASE("default tiles and D = 64 at N = 600, M = 100 and the default M = 512") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 600, .head_dim = 64, .causal = causal};
      check_forward(p, {"latents=100"});
      check_forward(p, {});
    }
  }

  TEST_CASE("causal cross_window: 1, inside the tiles, across them, beyond N") {
    for (std::int64_t n : {9, 30})
      for (const char* window :
           {"cross_window=1", "cross_window=3", "cross_window=8", "cross_window=13", "cross_window=64"}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = true};
        check_forward(p, {"latents=7", "block_rows=3", "block_keys=4", window});
      }
  }

  TEST_CASE("non-causal cross_window resolves to 0 (it is the causal form's rule)") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 20, .head_dim = 8};
    const ParamValues ran = perceiver_info().impl.resolved(p, values_of({"cross_window=5"}));
    CHECK(ran.get_int("cross_window") == 0);
    check_forward(p, {"latents=6", "cross_window=5"});
  }

  TEST_CASE("causal: changing future tokens changes no earlier output row") {
    const Problem p{.batch = 2, .heads = 2, .seq_len = 40, .head_dim = 8, .causal = true};
    for (const auto& params :
         std::vector<std::vector<std::string>>{{"latents=12", "block_rows=5", "block_keys=6"},
                                               {"latents=12", "block_rows=5", "block_keys=6", "cross_window=9"},
                                               {"latents=40", "block_rows=16", "block_keys=16"}}) {
      const std::int64_t m = rows_of(p, params), d = p.head_dim;
      const AttentionInputs base = random_inputs(p, 5);
      const Run reference = run_perceiver(p, base, params);
      for (std::int64_t row : {std::int64_t{0}, m / 2, m - 2}) {
        const std::int64_t position = p.seq_len - m + row;
        AttentionInputs changed = random_inputs(p, 5);
        for (Tensor* t : {&changed.q, &changed.k, &changed.v})
          for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh)
            for (std::int64_t e = (position + 1) * d; e < p.seq_len * d; ++e) (*t)[bh * p.seq_len * d + e] += 3.0f;
        const Run run = run_perceiver(p, changed, params);
        std::int64_t differences = 0;
        for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh)
          for (std::int64_t e = 0; e < (row + 1) * d; ++e)
            differences += run.out[bh * m * d + e] != reference.out[bh * m * d + e];
        CHECK_MESSAGE(differences == 0, label_of(p, params) << ": rows up to " << row << " changed");
        double later = 0;  // and the change is seen later on
        for (std::int64_t e = (row + 1) * d; e < m * d; ++e)
          later = std::max(later, static_cast<double>(std::fabs(run.out[e] - reference.out[e])));
        CHECK(later > 0);
      }
    }
  }

  TEST_CASE("backward of both forms against central differences of the double reference") {
    for (bool causal : {false, true})
      for (const auto& params :
           std::vector<std::vector<std::string>>{{"latents=5", "block_rows=2", "block_keys=3"},
                                                 {"latents=7", "block_rows=3", "block_keys=4", "cross_window=3"},
                                                 {"latents=9", "block_rows=4", "block_keys=4"}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = 8, .head_dim = 4, .causal = causal};
        const std::int64_t m = rows_of(p, params);
        const AttentionInputs in = random_inputs(p, 7);
        Tensor dout = Tensor::bhnd(p.batch, p.heads, m, p.head_dim);
        CounterRng(7, "dout").fill_normal(dout);
        Run run = run_perceiver(p, in, params, true);
        auto shaped = [&] {
          Tensor t = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
          t.fill(std::nanf(""));
          return t;
        };
        Tensor dq = shaped(), dk = shaped(), dv = shaped();
        run.mechanism->backward(in.q, in.k, in.v, run.out, dout, dq, dk, dv);
        const NamedValues x = named_inputs(in, *run.mechanism);
        std::map<std::string, const Tensor*> grads{{"q", &dq}, {"k", &dk}, {"v", &dv}};
        for (const auto& g : run.mechanism->parameter_gradients()) grads[g.name.substr(1)] = g.tensor;
        CHECK(grads.size() == (causal ? 4u : 5u));
        const PerceiverShape shape = shape_of(params);
        const ModelReference reference = [&](const NamedValues& v) { return perceiver_reference(p, shape, v); };
        const double size_factor = std::log2(static_cast<double>(p.seq_len)) + static_cast<double>(p.head_dim);
        check_against_differences(label_of(p, params), x, grads, dout, reference, size_factor, true);
        if (causal)  // the q rows before the latents take no gradient
          for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh)
            for (std::int64_t e = 0; e < (p.seq_len - m) * p.head_dim; ++e)
              CHECK(dq[bh * p.seq_len * p.head_dim + e] == 0.0f);
      }
  }

  TEST_CASE("backward at the default tiles, D = 16, sampled elements") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16, .causal = causal};
      const std::vector<std::string> params{"latents=40", "cross_window=0"};
      const std::int64_t m = rows_of(p, params);
      const AttentionInputs in = random_inputs(p, 9);
      Tensor dout = Tensor::bhnd(p.batch, p.heads, m, p.head_dim);
      CounterRng(9, "dout").fill_normal(dout);
      Run run = run_perceiver(p, in, params, true);
      Tensor dq = Tensor::bhnd(1, 2, 300, 16), dk = Tensor::bhnd(1, 2, 300, 16), dv = Tensor::bhnd(1, 2, 300, 16);
      run.mechanism->backward(in.q, in.k, in.v, run.out, dout, dq, dk, dv);
      std::map<std::string, const Tensor*> grads{{"q", &dq}, {"k", &dk}, {"v", &dv}};
      for (const auto& g : run.mechanism->parameter_gradients()) grads[g.name.substr(1)] = g.tensor;
      const PerceiverShape shape = shape_of(params);
      const ModelReference reference = [&](const NamedValues& v) { return perceiver_reference(p, shape, v); };
      check_against_differences(label_of(p, params), named_inputs(in, *run.mechanism), grads, dout, reference,
                                std::log2(300.0) + 16, false);
    }
  }

  TEST_CASE("decode: prefill N, then T steps, each the last row of the causal forward over N + t + 1 tokens") {
    const std::int64_t steps = 9;
    for (const auto& params :
         std::vector<std::vector<std::string>>{{"latents=6", "block_rows=4", "block_keys=5"},
                                               {"latents=6", "block_rows=4", "block_keys=5", "cross_window=4"},
                                               {"latents=6", "block_rows=4", "block_keys=5", "cross_window=1"},
                                               {"latents=3", "cross_window=20"}})
      for (std::int64_t n : {1, 5, 6, 7, 13}) {
        const Problem full{.batch = 2, .heads = 2, .seq_len = n + steps, .head_dim = 8, .causal = true};
        const AttentionInputs all = random_inputs(full, 11);
        auto prefix = [&](std::int64_t tokens) {
          Problem p = full;
          p.seq_len = tokens;
          AttentionInputs in{Tensor::bhnd(2, 2, tokens, 8), Tensor::bhnd(2, 2, tokens, 8),
                             Tensor::bhnd(2, 2, tokens, 8)};
          for (std::int64_t bh = 0; bh < 4; ++bh)
            for (std::int64_t e = 0; e < tokens * 8; ++e) {
              in.q[bh * tokens * 8 + e] = all.q[bh * full.seq_len * 8 + e];
              in.k[bh * tokens * 8 + e] = all.k[bh * full.seq_len * 8 + e];
              in.v[bh * tokens * 8 + e] = all.v[bh * full.seq_len * 8 + e];
            }
          return std::make_pair(p, std::move(in));
        };
        auto [context, context_in] = prefix(n);
        Run decoder = run_perceiver(context, context_in, params, false, steps);
        const Tensor& projections = *decoder.mechanism->parameters().at(0).tensor;
        Tensor q = Tensor::bhnd(2, 2, 1, 8), k = Tensor::bhnd(2, 2, 1, 8), v = Tensor::bhnd(2, 2, 1, 8),
               out = Tensor::bhnd(2, 2, 1, 8);
        for (std::int64_t t = 0; t < steps; ++t) {
          for (std::int64_t bh = 0; bh < 4; ++bh)
            for (std::int64_t f = 0; f < 8; ++f) {
              const std::int64_t at = (bh * full.seq_len + n + t) * 8 + f;
              q[bh * 8 + f] = all.q[at];
              k[bh * 8 + f] = all.k[at];
              v[bh * 8 + f] = all.v[at];
            }
          out.fill(std::nanf(""));
          decoder.mechanism->decode_step(q, k, v, out);
          auto [seen, seen_in] = prefix(n + t + 1);
          const Run forward = run_perceiver(seen, seen_in, params);
          const Tensor& same = *forward.mechanism->parameters().at(0).tensor;
          REQUIRE(std::equal(same.data(), same.data() + same.size(), projections.data()));
          const std::int64_t m = rows_of(seen, params);
          PerceiverErrors scale;
          const auto want =
              perceiver_reference(seen, shape_of(params), named_inputs(seen_in, *forward.mechanism), &scale);
          const double tolerance = perceiver_tolerance(seen, m, scale);
          std::vector<double> last_rows, forward_rows;
          for (std::int64_t bh = 0; bh < 4; ++bh)
            for (std::int64_t f = 0; f < 8; ++f) {
              last_rows.push_back(want[static_cast<std::size_t>((bh * m + m - 1) * 8 + f)]);
              forward_rows.push_back(forward.out[(bh * m + m - 1) * 8 + f]);
            }
          std::ostringstream label;
          label << label_of(context, params) << " step " << t;
          check_head(out.data(), last_rows, 4, 8, tolerance, label.str() + " vs reference");
          check_head(out.data(), forward_rows, 4, 8, 2 * tolerance, label.str() + " vs forward");
        }
        CHECK(decoder.mechanism->state_bytes() ==
              perceiver_info().impl.decode_workspace_bytes(on_test_threads(context), values_of(params), steps) -
                  2 * 2 * 8 * 8 * 4);
      }
  }

  TEST_CASE("FLOP counters equal flops and backward_flops; workspace equals the tracked bytes") {
    for (bool causal : {false, true})
      for (const auto& params :
           std::vector<std::vector<std::string>>{{"latents=40", "block_rows=16", "block_keys=24"},
                                                 {"latents=40", "block_rows=7", "block_keys=9", "cross_window=30"},
                                                 {"latents=300"}})
        for (int threads : {1, 2}) {
          PointConfig config = quick_point("perceiver", 200, causal, Scope::Attention, params);
          config.problem.threads = threads;
          const ResultRow row = run_point(config);
          REQUIRE_MESSAGE(row.status == Status::Ok, row.reason);
          const ParamValues values = values_of(params);
          CAPTURE(label_of(config.problem, params));
          CHECK(row.flops == perceiver_info().impl.flops(config.problem, values));
          CHECK(row.peak_owned_bytes - point_io_bytes(config) == row.estimated_workspace_bytes);
          config.pass = Pass::Backward;
          CHECK(run_point(config).flops == perceiver_info().impl.backward_flops(config.problem, values));
        }
  }

  TEST_CASE("FLOPs and workspace linear in N at fixed M; no N×N buffer") {
    for (bool causal : {false, true}) {
      auto at = [&](std::int64_t n) {
        const Problem p{.batch = 1, .heads = 8, .seq_len = n, .head_dim = 64, .causal = causal, .threads = 2};
        const ParamValues v = values_of({});
        return std::make_pair(perceiver_info().impl.flops(p, v), perceiver_info().impl.workspace_bytes(p, v));
      };
      const auto [f4, w4] = at(4096);
      const auto [f8, w8] = at(8192);
      const auto [f16, w16] = at(16384);
      // cross-attention grows as N (causal: N − M/2 per latent), the latent layer is fixed
      CHECK(static_cast<double>(f16 - f8) == doctest::Approx(2.0 * static_cast<double>(f8 - f4)).epsilon(0.01));
      CHECK(static_cast<double>(f16) < 4.1 * static_cast<double>(f4));
      CHECK(w16 == w8);  // fixed tiles: no buffer grows with N
      CHECK(w8 == w4);
      CHECK(w16 < 16384LL * 16384LL);  // far below one N×N fp32 matrix (4·N² bytes)
      const Problem small{.batch = 1, .heads = 8, .seq_len = 4096, .head_dim = 64, .causal = causal, .threads = 2};
      const Problem large{.batch = 1, .heads = 8, .seq_len = 16384, .head_dim = 64, .causal = causal, .threads = 2};
      CHECK(perceiver_info().impl.backward_workspace_bytes(large, values_of({})) ==
            perceiver_info().impl.backward_workspace_bytes(small, values_of({})));
      CHECK(perceiver_info().impl.backward_flops(large, values_of({})) <
            4.1 * static_cast<double>(perceiver_info().impl.backward_flops(small, values_of({}))));
    }
  }

  TEST_CASE("decode state: the cross cache grows with the context, a cross_window ring and the latent ring do not") {
    const Problem small{.batch = 1, .heads = 8, .seq_len = 1024, .head_dim = 64, .causal = true, .threads = 2};
    Problem large = small;
    large.seq_len = 16384;
    const auto& impl = perceiver_info().impl;
    CHECK(impl.decode_workspace_bytes(large, values_of({"cross_window=512"}), 64) ==
          impl.decode_workspace_bytes(small, values_of({"cross_window=512"}), 64));
    CHECK(impl.decode_workspace_bytes(large, values_of({}), 64) >
          10 * impl.decode_workspace_bytes(small, values_of({}), 64));
  }
}
