// cluster-former in bf16 (taxonomy/learnable_patterns/cluster_former.hpp): the assignment is the fp32
// form's on the same (widened) values, and the output is softmax attention restricted to each
// query's chunk of the model's own sorted order, within the bf16 forward bound 2u(1 + u)·max|v| + the
// fp32 bound (tests/support/bf16_check.hpp); the gradients are float64 attention gradients under the same
// chunk mask, within the per-rounding bf16 gradient bound of check_bf16_run_gradients.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "taxonomy/learnable_patterns/cluster_former.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

// Heads of one batch element (the mask is per head).
void check_case(const Problem& shape, std::int64_t clusters, std::int64_t chunk, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  REQUIRE(p.batch == 1);
  const std::vector<std::string> params{"clusters=" + std::to_string(clusters), "chunk_len=" + std::to_string(chunk)};
  const std::string label = "cluster-former bf16 N=" + std::to_string(p.seq_len) + " p=" + std::to_string(clusters) +
                            " c=" + std::to_string(chunk);
  const Bf16Inputs in = bf16_inputs(p, seed);
  auto mechanism = bf16_mechanism("cluster-former", p, params);
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  const auto* model = dynamic_cast<const ClusterFormerAttention*>(mechanism.get());
  REQUIRE(model != nullptr);

  const ModelInfo* info = find_model("cluster-former");
  REQUIRE(info != nullptr);
  auto fp32 = info->impl.create(p, resolve_params("cluster-former", info->impl.params, params), 42);
  Tensor out32 = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  fp32->prepare(in.widened.q, in.widened.k, in.widened.v);
  fp32->forward(in.widened.q, in.widened.k, in.widened.v, out32);
  const auto* reference = dynamic_cast<const ClusterFormerAttention*>(fp32.get());
  for (std::int64_t h = 0; h < p.heads; ++h)
    CHECK_MESSAGE(model->sort_order(0, h) == reference->sort_order(0, h), label);

  const std::int64_t c = model->chunk();
  check_bf16_masked(
      got, in.widened, p,
      [&](std::int64_t h) {
        std::vector<std::int64_t> position(static_cast<std::size_t>(p.seq_len));
        const auto order = model->sort_order(0, h);
        for (std::int64_t s = 0; s < p.seq_len; ++s) position[static_cast<std::size_t>(order[s])] = s;
        return MaskFn([position, c](std::int64_t i, std::int64_t j) {
          return position[static_cast<std::size_t>(i)] / c == position[static_cast<std::size_t>(j)] / c;
        });
      },
      0, label);
}

// The chunk mask of head h of a cluster-former: i sees j when their sorted positions share a chunk.
MaskFn chunk_mask(const ClusterFormerAttention& model, std::int64_t n, std::int64_t h) {
  std::vector<std::int64_t> position(static_cast<std::size_t>(n));
  const auto order = model.sort_order(0, h);
  for (std::int64_t s = 0; s < n; ++s) position[static_cast<std::size_t>(order[s])] = s;
  const std::int64_t c = model.chunk();
  return MaskFn([position, c](std::int64_t i, std::int64_t j) {
    return position[static_cast<std::size_t>(i)] / c == position[static_cast<std::size_t>(j)] / c;
  });
}

// The bf16 training step's dq, dk, dv against float64 attention gradients under the model's chunk mask
// (check_bf16_run_gradients: the gathered tile's backward rounds P and dS once each, δ from the bf16 output).
void check_gradients(const Problem& shape, std::int64_t clusters, std::int64_t chunk, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  REQUIRE(p.batch == 1);
  const std::vector<std::string> params{"clusters=" + std::to_string(clusters), "chunk_len=" + std::to_string(chunk)};
  const std::string label =
      "cluster-former bf16 gradients N=" + std::to_string(p.seq_len) + " c=" + std::to_string(chunk);
  const Bf16GradientRun run = run_bf16_gradients("cluster-former", p, params, seed);
  const auto* model = dynamic_cast<const ClusterFormerAttention*>(run.mechanism.get());
  REQUIRE(model != nullptr);
  check_bf16_run_gradients(
      run, p, [&](std::int64_t h) { return chunk_mask(*model, p.seq_len, h); }, label);
}

}  // namespace

TEST_SUITE("cluster_former_bf16") {
  TEST_CASE("cluster-former in bf16: the fp32 assignment, attention within each sorted chunk, every path") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      // Chunks one below, at and above 16 rows; N not a multiple of the chunk.
      for (std::int64_t n : {1, 2, 15, 16, 17, 31, 32, 33, 100})
        check_case({.batch = 1, .heads = 3, .seq_len = n, .head_dim = 16}, 4, 16, static_cast<std::uint64_t>(n));
      // The assignment's 256-row blocks one below, at and above; the default chunk.
      for (std::int64_t n : {255, 256, 257, 520})
        check_case({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32}, 8, 256, static_cast<std::uint64_t>(n));
    });
  }

  TEST_CASE("cluster-former in bf16: gradients within each sorted chunk against float64, every path") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (std::int64_t n : {1, 2, 15, 16, 17, 33, 100})
        check_gradients({.batch = 1, .heads = 3, .seq_len = n, .head_dim = 16}, 4, 16, static_cast<std::uint64_t>(n));
      check_gradients({.batch = 1, .heads = 2, .seq_len = 257, .head_dim = 32}, 8, 256, 5);
    });
  }

  TEST_CASE("cluster-former bf16 rows: FLOPs as fp32's, halved inputs, estimates exact (forward, backward, train)") {
    for (std::int64_t n : {100, 300})
      for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train})
        check_bf16_rows("cluster-former", n, false, pass, {"clusters=16"});
    check_bf16_head_dim_unsupported("cluster-former");
  }
}
