// The contract every registered model keeps: the executed FLOP count equals its analytic formula,
// the workspace estimate equals the tracked bytes (1 and 2 threads), resolved parameters run as
// requested, causal runs of models that cannot decode are unsupported rows, and layer scope wraps any.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/tile_kernels.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

TEST_SUITE("every_model") {
  TEST_CASE("the executed FLOP count equals the registry's analytic formula for every implemented model") {
    for (const auto& model : attention_models()) {
      for (std::int64_t n : {1, 100, 257})
        for (bool causal : {false, true})
          for (Scope scope : {Scope::Attention, Scope::Layer}) {
            if (causal && !model.decodes()) continue;
            const auto config = quick_point(model.name, n, causal, scope);
            const ResultRow row = run_point(config);
            CAPTURE(model.name);
            CAPTURE(n);
            CAPTURE(causal);
            CAPTURE(scope_name(scope));
            REQUIRE(row.status == Status::Ok);
            std::int64_t expected = model.impl.flops(config.problem, resolve_params(model.name, model.impl.params, {}));
            if (scope == Scope::Layer)
              expected += EncoderLayer::flops_outside_mechanism(config.problem, config.effective_d_ff(),
                                                                point_output_rows(resolve_point(config)));
            CHECK(row.flops == expected);
            // Inputs and output are the project's own tensors; the scratchpad is not.
            CHECK(row.peak_owned_bytes >= point_io_bytes(config));
            CHECK(row.peak_owned_bytes <= row.peak_tensor_bytes);
          }
    }
  }

  TEST_CASE("analytic workspace estimates track the measured tracked bytes") {
    for (const auto& model : attention_models()) {
      for (std::int64_t n : {512, 2048}) {
        DnnlContext::instance().clear_cache();
        const ResultRow row = run_point(quick_point(model.name, n, false));
        CAPTURE(model.name);
        CAPTURE(n);
        CHECK(static_cast<double>(row.workspace_bytes) <=
              1.25 * static_cast<double>(row.estimated_workspace_bytes) + 65536);
        CHECK(static_cast<double>(row.workspace_bytes) >=
              0.75 * static_cast<double>(row.estimated_workspace_bytes) - 65536);
      }
    }
  }

  TEST_CASE("resolved parameter values run as the requested ones, and resolving them again changes nothing") {
    // Resolution computes derived defaults (0 = from N) and clamps blocks to N: the values a dump
    // records must describe the same computation.
    for (const auto& model : attention_models())
      for (std::int64_t n : {1, 37, 100, 1000})
        for (bool causal : {false, true}) {
          if (causal && !model.decodes()) continue;
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal, .threads = 2};
          const ParamValues requested = resolve_params(model.name, model.impl.params, {});
          const ParamValues ran = model.impl.resolved(p, requested);
          CAPTURE(model.name);
          CAPTURE(n);
          CAPTURE(causal);
          CHECK(model.impl.flops(p, ran) == model.impl.flops(p, requested));
          CHECK(model.impl.workspace_bytes(p, ran) == model.impl.workspace_bytes(p, requested));
          CHECK(model.impl.resolved(p, ran).to_json() == ran.to_json());
        }
  }

  TEST_CASE("an integer parameter that runs clamped to N says so in its help") {
    // A value above N that runs as another one must not surprise: `list` and --help show the help,
    // which says "clamped" (or "unused" for a value the form at hand ignores).
    for (const auto& model : attention_models())
      for (const auto& spec : model.impl.params)
        for (bool causal : {false, true}) {
          if (spec.type != ParamType::Int || spec.max <= 64 || (causal && !model.decodes())) continue;
          const Problem p{.batch = 1, .heads = 2, .seq_len = 37, .head_dim = 16, .causal = causal, .threads = 2};
          ParamValues requested = resolve_params(model.name, model.impl.params, {});
          requested.set(spec.name, std::int64_t{64});
          if (model.impl.validate) {
            try {
              model.impl.validate(p, requested);
            } catch (const ParamError&) {
              continue;  // 64 is not a value this model takes here (a divisor, an order of its parameters)
            }
          }
          CAPTURE(model.name);
          CAPTURE(spec.name);
          CAPTURE(causal);
          const std::int64_t ran = model.impl.resolved(p, requested).get_int(spec.name);
          if (ran != 64)
            CHECK_MESSAGE(
                (spec.help.find("clamp") != std::string::npos || spec.help.find("unused") != std::string::npos),
                (spec.help + " ran as " + std::to_string(ran)));
        }
  }

  TEST_CASE("workspace estimates equal the tracked owned bytes at 1 and 2 threads") {
    // The estimate is what --memory-limit and estimated_workspace_bytes use; oneDNN's scratchpad
    // is outside it (library pool), so the owned pool is the one to match exactly.
    for (const auto& model : attention_models())
      for (int threads : {1, 2})
        for (bool causal : {false, true}) {
          if (causal && !model.decodes()) continue;
          PointConfig config = quick_point(model.name, 300, causal);
          config.problem.threads = threads;
          DnnlContext::instance().clear_cache();
          const ResultRow row = run_point(config);
          CAPTURE(model.name);
          CAPTURE(threads);
          CAPTURE(causal);
          REQUIRE(row.status == Status::Ok);
          CHECK(row.threads == threads);
          CHECK(row.peak_owned_bytes - point_io_bytes(config) == row.estimated_workspace_bytes);
        }
  }

  TEST_CASE("causal runs of models that cannot decode are unsupported rows with the reason") {
    for (const auto& model : attention_models()) {
      if (model.decodes()) continue;
      const ResultRow row = describe_point(quick_point(model.name, 64, true));
      CAPTURE(model.name);
      CHECK(row.status == Status::Unsupported);
      CHECK_FALSE(row.reason.empty());
      CHECK(row.reason.find("cannot decode") != std::string::npos);
    }
  }

  TEST_CASE("layer scope runs the encoder layer around the mechanism") {
    const auto row = run_point(quick_point("exact-tiled", 70, true, Scope::Layer));
    CHECK(row.status == Status::Ok);
    CHECK(row.d_ff == 4 * 2 * 32);
    CHECK(row.flops > 0);
    CHECK(row.reproducer.find("--scope layer") != std::string::npos);
  }
}
