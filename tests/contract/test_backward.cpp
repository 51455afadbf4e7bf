// The backward contract: gradients against the double-precision reference and its directional
// derivative, the causal zero-gradient property, repeatability, the backward FLOP counters against
// their formulas, and the memory of a training step (saved bytes, tracked peak = estimate).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/layer_reference.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

HeadMask mask_for(bool causal) { return same_for_every_head(causal ? MaskFn(causal_mask) : MaskFn(full_mask)); }

ResultRow pass_row(const std::string& model, const Problem& p, Pass pass, std::vector<std::string> params = {}) {
  PointConfig c = counter_point(model, p, std::move(params));
  c.pass = pass;
  const ResultRow row = run_point(c);
  REQUIRE_MESSAGE(row.status == Status::Ok, row.reason);
  return row;
}

// Implemented models with a backward pass and a causal mode.
std::vector<std::string> decoders_with_backward() {
  std::vector<std::string> names;
  for (const auto& model : attention_models())
    if (model.implemented() && model.impl.has_backward() && model.decodes()) names.push_back(model.name);
  return names;
}

}  // namespace

TEST_SUITE("backward") {
  TEST_CASE("layer-scope backward: dx and every weight's gradient against central differences of a double layer") {
    // vanilla (causal and not), and funnel: a downsampling mechanism, M = ⌈N/2⌉ rows, no attention residual.
    const std::int64_t f = 12;
    for (const char* model : {"vanilla", "funnel"})
      for (bool causal : {false, true})
        for (auto [n, every_element] : {std::pair<std::int64_t, bool>{3, true}, {9, false}}) {
          const bool pooled = std::string(model) == "funnel";
          if (pooled && causal) continue;
          const std::int64_t m = pooled ? (n + 1) / 2 : n;
          const Problem p{
              .batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal, .threads = kTestThreads};
          const ModelInfo& info = *find_model(model);
          REQUIRE(output_rows_of(info.impl, p, resolve_params(model, info.impl.params, {})) == m);
          auto mechanism = info.impl.create(p, resolve_params(model, info.impl.params, {}), 5);
          EncoderLayer layer(p, f, m, !pooled, 5);
          Tensor x(Shape{2, n, 8}), dy(Shape{2, m, 8}), y(Shape{2, m, 8}), dx(Shape{2, n, 8});
          CounterRng(5, "x").fill_normal(x);
          CounterRng(5, "dy").fill_normal(dy);
          randomise_layer_norms(layer);
          layer.prepare(*mechanism, x);
          layer.prepare_backward(*mechanism);
          layer.forward(*mechanism, x, y);
          layer.backward(*mechanism, x, dy, dx);
          NamedValues inputs{{"x", std::vector<double>(x.data(), x.data() + x.size())}};
          std::map<std::string, const Tensor*> grads{{"x", &dx}};
          for (const auto& parameter : layer.parameters())
            for (const auto& gradient : layer.parameter_gradients())
              if (gradient.name == "d" + parameter.name) {
                inputs[parameter.name] =
                    std::vector<double>(parameter.tensor->data(), parameter.tensor->data() + parameter.tensor->size());
                grads[parameter.name] = gradient.tensor;
              }
          CHECK(grads.size() == 9);
          check_against_differences(
              std::string(model) + " layer N=" + std::to_string(n) + (causal ? " causal" : ""), inputs, grads, dy,
              [&](const NamedValues& values) { return layer_reference(p, f, values, pooled); },
              std::log2(static_cast<double>(n) + 1) + f, every_element);
        }
  }

  TEST_CASE("the reference's analytic gradient is its own derivative (central differences, tiny problem)") {
    const Problem p{.batch = 1, .heads = 1, .seq_len = 5, .head_dim = 3};
    for (bool causal : {false, true}) {
      const auto in = random_inputs(p, 5);
      const Tensor dout = random_like(p, 5, "dout");
      const double scale = 1.0 / std::sqrt(3.0), step = 1e-6;
      const auto grads = reference_attention_backward(in.q.data(), in.k.data(), in.v.data(), dout.data(), 5, 5, 3,
                                                      scale, causal ? MaskFn(causal_mask) : MaskFn(full_mask));
      // d⟨dO, O⟩/dx_e for every element of q, k and v.
      for (int which = 0; which < 3; ++which)
        for (std::int64_t e = 0; e < 15; ++e) {
          auto objective = [&](double s) {
            std::vector<double> x[3] = {std::vector<double>(in.q.data(), in.q.data() + 15),
                                        std::vector<double>(in.k.data(), in.k.data() + 15),
                                        std::vector<double>(in.v.data(), in.v.data() + 15)};
            x[which][static_cast<std::size_t>(e)] += s;
            const auto out = reference_attention(x[0].data(), x[1].data(), x[2].data(), 5, 5, 3, scale,
                                                 causal ? MaskFn(causal_mask) : MaskFn(full_mask));
            double sum = 0;
            for (std::int64_t i = 0; i < 15; ++i) sum += dout[i] * out[static_cast<std::size_t>(i)];
            return sum;
          };
          const double numeric = (objective(step) - objective(-step)) / (2 * step);
          const auto& analytic = which == 0 ? grads.dq : which == 1 ? grads.dk : grads.dv;
          CHECK(analytic[static_cast<std::size_t>(e)] == doctest::Approx(numeric).epsilon(1e-7).scale(1));
        }
    }
  }

  TEST_CASE("vanilla and exact-tiled gradients, causal and not, batch 2, at and around block sizes") {
    double worst = 0;
    // exact-tiled defaults: block_q 64, backward_block_k 512; on the tile kernels (D = 32) forward
    // strips of 32 rows and backward strips of 128.
    for (std::int64_t n : {1, 7, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513})
      for (bool causal : {false, true})
        for (const char* model : {"vanilla", "exact-tiled"})
          worst = std::max(worst, check_model_gradients(
                                      model, {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal},
                                      mask_for(causal)));
    CHECK(worst <= 1);
  }

  TEST_CASE("the gradient check passes the true gradient and fails one that is 0.1% off") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 100, .head_dim = 32, .causal = true};
    const auto in = random_inputs(p, 3);
    const Tensor dout = random_like(p, 3, "dout");
    const BackwardRun run = run_backward("exact-tiled", p, in, dout);
    const double ratio = check_gradients(run, in, dout, p, mask_for(true), "true gradient", false);
    CHECK(ratio <= 1);
    // The gradients of dO·1.001 are the true ones 0.1% off.
    Tensor scaled = dout.clone();
    for (float& x : scaled.values()) x *= 1.001f;
    const BackwardRun off = run_backward("exact-tiled", p, in, scaled);
    CHECK(check_gradients(off, in, dout, p, mask_for(true), "0.1% off", false) > 1);
  }

  TEST_CASE("causal backward: dO zero after token i gives exactly zero dQ, dK, dV after i (every model)") {
    for (const std::string& model : decoders_with_backward())
      for (std::int64_t n : {37, 100, 300}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true};
        const std::int64_t last = n / 3;  // a non-multiple of every block
        const auto in = random_inputs(p, 9);
        Tensor dout = random_like(p, 9, "dout");
        for (std::int64_t b = 0; b < 2; ++b)
          for (std::int64_t h = 0; h < 2; ++h)
            std::fill(dout.head(b, h) + (last + 1) * 16, dout.head(b, h) + n * 16, 0.0f);
        const BackwardRun run = run_backward(model, p, in, dout);
        std::int64_t nonzero_after = 0, nonzero_before = 0;
        for (const Tensor* g : {&run.dq, &run.dk, &run.dv})
          for (std::int64_t b = 0; b < 2; ++b)
            for (std::int64_t h = 0; h < 2; ++h)
              for (std::int64_t e = 0; e < n * 16; ++e)
                (e / 16 > last ? nonzero_after : nonzero_before) += g->head(b, h)[e] != 0.0f;
        CHECK_MESSAGE(nonzero_after == 0, model << " N=" << n);
        CHECK(nonzero_before > 0);
      }
  }

  TEST_CASE("a backward leaves the saved state unchanged: repeating it gives the same gradients, parameters' too") {
    for (const auto& model : attention_models()) {
      if (!model.implemented() || !model.impl.has_backward()) continue;
      const Problem p{.batch = 2, .heads = 3, .seq_len = 130, .head_dim = 16, .causal = model.decodes()};
      const auto in = random_inputs(p, 4);
      const Tensor dout = random_like(p, 4, "dout");
      BackwardRun run = run_backward(model.name, p, in, dout);
      std::vector<const Tensor*> grads = {&run.dq, &run.dk, &run.dv};
      for (const auto& named : run.mechanism->parameter_gradients()) grads.push_back(named.tensor);
      std::vector<Tensor> first;
      for (const Tensor* grad : grads) first.push_back(grad->clone());
      run.mechanism->backward(in.q, in.k, in.v, run.out, dout, run.dq, run.dk, run.dv);
      for (std::size_t i = 0; i < grads.size(); ++i)
        CHECK_MESSAGE(std::memcmp(first[i].data(), grads[i]->data(), static_cast<std::size_t>(first[i].bytes())) == 0,
                      model.name << " gradient " << i);
    }
  }

  TEST_CASE("backward and train FLOP counters equal the formulas; train = forward + backward") {
    for (const auto& model : attention_models()) {
      if (!model.implemented() || !model.impl.has_backward()) continue;
      for (bool causal : {false, true})
        for (std::int64_t n : {1, 37, 100, 300}) {
          if (causal && !model.decodes()) continue;
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          const ParamValues values = resolve_params(model.name, model.impl.params, {});
          const std::int64_t forward = model.impl.flops(on_test_threads(p), values);
          const std::int64_t backward = model.impl.backward_flops(on_test_threads(p), values);
          CAPTURE(model.name);
          CAPTURE(n);
          CAPTURE(causal);
          CHECK(pass_row(model.name, p, Pass::Backward).flops == backward);
          CHECK(pass_row(model.name, p, Pass::Train).flops == forward + backward);
          for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train}) {  // what `sweep --dry-run` prints
            PointConfig c = counter_point(model.name, p);
            c.pass = pass;
            CHECK(estimated_point_flops(resolve_point(c)) == (pass == Pass::Forward    ? forward
                                                              : pass == Pass::Backward ? backward
                                                                                       : forward + backward));
          }
        }
    }
  }

  TEST_CASE("layer-scope train: FLOPs = forward + backward of layer and mechanism; tracked peak = estimate") {
    for (const char* model : {"vanilla", "local", "longformer", "routing", "reformer", "funnel", "tokenlearner"})
      for (bool causal : {false, true}) {
        if (causal && !find_model(model)->decodes()) continue;
        const Problem p = on_test_threads({.batch = 2, .heads = 2, .seq_len = 70, .head_dim = 16, .causal = causal});
        PointConfig c = counter_point(model, p, {}, Scope::Layer);
        c.pass = Pass::Train;
        const ResultRow row = run_point(c);
        CAPTURE(model);
        REQUIRE(row.status == Status::Ok);
        const ModelInfo& info = *find_model(model);
        const ParamValues values = resolve_params(model, info.impl.params, {});
        const std::int64_t f = c.effective_d_ff();
        const std::int64_t rows = point_output_rows(resolve_point(c));
        CHECK(row.flops == info.impl.flops(p, values) + info.impl.backward_flops(p, values) +
                               EncoderLayer::flops_outside_mechanism(p, f, rows) +
                               EncoderLayer::backward_flops_outside_mechanism(p, f, rows));
        CHECK(estimated_point_flops(resolve_point(c)) == row.flops);
        CHECK(row.peak_owned_bytes - point_io_bytes(c) == row.estimated_workspace_bytes);
        CHECK(row.saved_bytes > 0);
      }
  }

  TEST_CASE("training memory: tracked owned peak equals the estimate; saved bytes as the model says") {
    for (const auto& model : attention_models()) {
      if (!model.implemented() || !model.impl.has_backward()) continue;
      for (bool causal : {false, true})
        for (std::int64_t n : {100, 300}) {
          if (causal && !model.decodes()) continue;
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          PointConfig c = counter_point(model.name, p);
          c.pass = Pass::Train;
          const ResultRow row = run_point(c);
          CAPTURE(model.name);
          CAPTURE(n);
          REQUIRE(row.status == Status::Ok);
          CHECK(row.peak_owned_bytes - point_io_bytes(c) == row.estimated_workspace_bytes);
          CHECK(row.saved_bytes > 0);
          CHECK(row.saved_bytes <= row.workspace_bytes);
        }
    }
    // exact-tiled saves the row log-sum-exp (linear in N); vanilla the probabilities (quadratic).
    const Problem small{.batch = 1, .heads = 2, .seq_len = 512, .head_dim = 32};
    Problem large = small;
    large.seq_len = 1024;
    CHECK(pass_row("exact-tiled", small, Pass::Train).saved_bytes == 2 * 512 * 4);
    CHECK(pass_row("exact-tiled", large, Pass::Train).saved_bytes == 2 * 1024 * 4);
    const double vanilla_growth = static_cast<double>(pass_row("vanilla", large, Pass::Train).saved_bytes) /
                                  static_cast<double>(pass_row("vanilla", small, Pass::Train).saved_bytes);
    CHECK(vanilla_growth > 3.9);
    CHECK(vanilla_growth < 4.1);
    CHECK(pass_row("vanilla", small, Pass::Forward).saved_bytes == 0);
  }

  TEST_CASE("non-default backward settings: FLOPs equal the formulas and the tracked peak the estimate") {
    // Settings the registry-wide loops above do not reach (they run every model's defaults).
    const std::vector<std::pair<std::string, std::vector<std::string>>> cases{
        {"compressive", {"segment_len=64", "memory_len=32", "compressed_len=16", "aux_loss=on"}},
        {"compressive", {"segment_len=64", "memory_len=32", "compressed_len=16", "compression=max"}},
        {"reformer", {"n_rounds=4", "chunk_len=32"}},
        {"sinkhorn", {"sortcut_blocks=2", "block=32"}},
        {"routing", {"local_heads=true", "clusters=8"}}};
    for (const auto& [model, params] : cases)
      for (bool causal : {false, true}) {
        if (causal && model == "sinkhorn") continue;  // SortCut is encoder only
        const Problem p = on_test_threads({.batch = 2, .heads = 4, .seq_len = 200, .head_dim = 16, .causal = causal});
        const ModelInfo& info = *find_model(model);
        const ParamValues values = resolve_params(model, info.impl.params, params);
        CAPTURE(model);
        CAPTURE(causal);
        PointConfig c = counter_point(model, p, params);
        c.pass = Pass::Train;
        const ResultRow row = run_point(c);
        REQUIRE_MESSAGE(row.status == Status::Ok, row.reason);
        CHECK(row.flops == info.impl.flops(p, values) + info.impl.backward_flops(p, values));
        CHECK(row.peak_owned_bytes - point_io_bytes(c) == row.estimated_workspace_bytes);
      }
    // Routing where its setup-only fitting rows are the peak and the backward's buffers fit under
    // them, in layer scope too (the layer's training buffers exist before the fitting).
    for (Scope scope : {Scope::Attention, Scope::Layer}) {
      PointConfig c = counter_point("routing", {.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 32}, {}, scope);
      c.pass = Pass::Train;
      const ResultRow row = run_point(c);
      REQUIRE_MESSAGE(row.status == Status::Ok, row.reason);
      CHECK(row.peak_owned_bytes - point_io_bytes(c) == row.estimated_workspace_bytes);
    }
  }

  TEST_CASE("training rows say what the backward holds constant; forward rows say nothing") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 256, .head_dim = 32};
    CHECK(pass_row("transformer-xl", p, Pass::Train).gradient_note.find("stop-gradient") != std::string::npos);
    CHECK(pass_row("compressive", p, Pass::Backward, {"aux_loss=on"}).gradient_note.find("reconstruction") !=
          std::string::npos);
    CHECK(pass_row("routing", p, Pass::Train).gradient_note.find("EMA") != std::string::npos);
    CHECK(pass_row("transformer-xl", p, Pass::Forward).gradient_note.empty());
    CHECK(pass_row("exact-tiled", p, Pass::Train).gradient_note.empty());
  }

  TEST_CASE("train rows time forward and backward stages, or the stages a model splits its passes into") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 256, .head_dim = 32};
    auto stage_names = [](const ResultRow& row) {
      std::vector<std::string> names;
      for (const auto& [name, ns] : row.stage_median_ns) names.push_back(name);
      return names;
    };
    CHECK(stage_names(pass_row("exact-tiled", p, Pass::Train)) == std::vector<std::string>{"backward", "forward"});
    CHECK(stage_names(pass_row("reformer", p, Pass::Train)) == std::vector<std::string>{"attend", "backward", "route"});
    CHECK(stage_names(pass_row("reformer", p, Pass::Forward)) == std::vector<std::string>{"attend", "route"});
    // Layer scope: the whole layer's forward and backward, whatever stages the mechanism laps inside.
    PointConfig layer = counter_point("reformer", p, {}, Scope::Layer);
    layer.pass = Pass::Train;
    CHECK(stage_names(run_point(layer)) == std::vector<std::string>{"backward", "forward"});
  }

  TEST_CASE("saved bytes and the training step's tracked peak grow linearly in N for every sub-quadratic model") {
    for (const auto& model : attention_models()) {
      // Skipped: vanilla and synthesizer keep N² per head by design; exact-tiled's saved bytes are
      // checked exactly in the test above. (Transformer-XL and compressive, O(N²) in the survey for
      // their span, save a row log-sum-exp and replay fixed-size windows: linear, checked here.)
      const bool quadratic = model.name == "vanilla" || model.name == "synthesizer" || model.name == "exact-tiled";
      if (!model.implemented() || !model.impl.has_backward() || quadratic) continue;
      std::vector<ResultRow> rows;
      for (std::int64_t n : {512, 1024, 2048})
        rows.push_back(pass_row(model.name, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32}, Pass::Train));
      // Routing's forward keeps per-thread affinities [C, N] with C = √N clusters, so its peak grows
      // as N√N by design; its pattern holds C·⌈N/C⌉ ≥ N slots (up to C − 1 extra).
      const bool routing = model.name == "routing";
      const double saved_growth = routing ? 2.05 : 2.0, peak_growth = routing ? 2.0 * std::sqrt(2.0) * 1.05 : 2.0;
      for (std::size_t i = 1; i < rows.size(); ++i) {
        CAPTURE(model.name);
        CAPTURE(rows[i].seq_len);
        CHECK(static_cast<double>(rows[i].saved_bytes) <= saved_growth * static_cast<double>(rows[i - 1].saved_bytes));
        CHECK(static_cast<double>(rows[i].peak_owned_bytes) <=
              peak_growth * static_cast<double>(rows[i - 1].peak_owned_bytes));
      }
    }
    // vanilla saves its probabilities: N² per head.
    const ResultRow small = pass_row("vanilla", {.batch = 1, .heads = 2, .seq_len = 512, .head_dim = 32}, Pass::Train);
    const ResultRow large = pass_row("vanilla", {.batch = 1, .heads = 2, .seq_len = 2048, .head_dim = 32}, Pass::Train);
    CHECK(static_cast<double>(large.saved_bytes) >= 15.0 * static_cast<double>(small.saved_bytes));
  }

  TEST_CASE("every implemented model of the registry has a backward pass (Table 1's training steps)") {
    // A model registered without one would give `unsupported` backward and train rows
    // (point.cpp); none is left, and a new one should not arrive without its training step.
    for (const auto& model : attention_models()) {
      CAPTURE(model.name);
      CHECK((!model.implemented() || model.impl.has_backward()));
    }
  }
}
