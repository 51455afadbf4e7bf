// Cluster-Former: the output against dense double attention restricted to exactly the chunks the
// mechanism chose (the pattern it exposes and dumps), the assignment against a naive nearest-centroid
// search, the sort's stability, the centroids against a naive Lloyd iteration on the seeded fitting
// rows, settings that reduce to exact or local attention, gradients with the pattern held fixed,
// the causal `unsupported` row and how the counters scale with N.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/learnable_patterns/cluster_former.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

const ClusterFormerAttention& model_of(const MechanismRun& run) {
  const auto* model = dynamic_cast<const ClusterFormerAttention*>(run.mechanism.get());
  REQUIRE(model != nullptr);
  return *model;
}

std::string label_of(std::int64_t n, std::int64_t d, const std::vector<std::string>& params) {
  std::string label = "cluster-former N=" + std::to_string(n) + " D=" + std::to_string(d);
  for (const auto& param : params) label += " " + param;
  return label;
}

// Sorted position of every token of head (b, h), checking the order is a permutation.
std::vector<std::int64_t> positions_of(const ClusterFormerAttention& model, std::int64_t b, std::int64_t h,
                                       std::int64_t n) {
  const auto order = model.sort_order(b, h);
  std::vector<std::int64_t> position(n, -1);
  for (std::int64_t s = 0; s < n; ++s) {
    REQUIRE(order[s] >= 0);
    REQUIRE(order[s] < n);
    REQUIRE(position[order[s]] == -1);
    position[order[s]] = s;
  }
  return position;
}

// The mask of head (b, h): query i sees key j iff their sorted positions share a chunk.
MaskFn chunk_mask(const ClusterFormerAttention& model, std::int64_t b, std::int64_t h, std::int64_t n) {
  const auto position = positions_of(model, b, h, n);
  const std::int64_t c = model.chunk();
  return [position, c](std::int64_t i, std::int64_t j) { return position[i] / c == position[j] / c; };
}

// ‖x − μ_c‖² in double for every centroid c of head h.
std::vector<double> distances(const float* x, const Tensor& centroids, std::int64_t h, std::int64_t clusters,
                              std::int64_t d) {
  std::vector<double> out(clusters);
  for (std::int64_t c = 0; c < clusters; ++c) {
    double sum = 0;
    for (std::int64_t j = 0; j < d; ++j) {
      const double diff = double(x[j]) - centroids[(h * clusters + c) * d + j];
      sum += diff * diff;
    }
    out[c] = sum;
  }
  return out;
}

// Checks the pattern (assignment, stable sort, dumps) and the output of one run.
void check_cluster_former(const Problem& p, const std::vector<std::string>& params) {
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len * 5 + p.head_dim));
  const MechanismRun run = run_keeping("cluster-former", p, in, params);
  const auto& model = model_of(run);
  const std::int64_t n = p.seq_len, d = p.head_dim, clusters = model.clusters();
  const Tensor& centroids = run.parameter("centroids");
  const Tensor& assignments = run.parameter("assignments");
  const Tensor& permutation = run.parameter("permutation");
  REQUIRE(centroids.size() == p.heads * clusters * d);
  const std::string label = label_of(n, d, params);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto cluster = model.token_clusters(b, h);
      const auto order = model.sort_order(b, h);
      const std::int64_t head = b * p.heads + h;
      for (std::int64_t i = 0; i < n; ++i) {
        // The nearest centroid of the key row, up to fp32 rounding of the distances.
        const auto dist = distances(in.k.head(b, h) + i * d, centroids, h, clusters, d);
        const double best = *std::min_element(dist.begin(), dist.end());
        const double slack = 16 * kFloatEps * (dist[0] + 2 * d);
        CHECK_MESSAGE(dist[cluster[i]] <= best + slack, label << " token " << i);
        CHECK(assignments[head * n + i] == float(cluster[i]));
        CHECK(permutation[head * n + i] == float(order[i]));
      }
      // Stable: sorted by (cluster, position).
      for (std::int64_t s = 1; s < n; ++s) {
        const auto before = std::pair{cluster[order[s - 1]], order[s - 1]};
        const auto after = std::pair{cluster[order[s]], order[s]};
        CHECK_MESSAGE(before < after, label << " sorted position " << s);
      }
      const MaskFn mask = chunk_mask(model, b, h, n);
      const float* q = in.q.head(b, h);
      const float* k = in.k.head(b, h);
      const float* v = in.v.head(b, h);
      const double scale = 1.0 / std::sqrt(double(d));
      check_head(run.out.head(b, h), reference_attention(q, k, v, n, n, d, scale, mask), n, d,
                 attention_tolerance(q, k, v, n, n, d, scale), label + " h=" + std::to_string(h));
    }
}

// The naive Lloyd k-means of head h on the seeded fitting rows (2N rows of N(0, 1), stream
// "cluster-former/fit"), from its first p rows, in double.
std::vector<double> naive_centroids(std::uint64_t seed, std::int64_t h, std::int64_t n, std::int64_t d,
                                    std::int64_t clusters, std::int64_t iterations) {
  const std::int64_t rows = 2 * n;
  const CounterRng rng(seed, "cluster-former/fit");
  std::vector<double> fit(rows * d);
  for (std::int64_t e = 0; e < rows * d; ++e)
    fit[e] = static_cast<float>(rng.normal(static_cast<std::uint64_t>(h * rows * d + e)));
  std::vector<double> mu(fit.begin(), fit.begin() + clusters * d);
  for (std::int64_t iteration = 0; iteration < iterations; ++iteration) {
    std::vector<double> sum(clusters * d, 0.0);
    std::vector<std::int64_t> count(clusters, 0);
    for (std::int64_t i = 0; i < rows; ++i) {
      std::int64_t nearest = 0;
      double best = INFINITY;
      for (std::int64_t c = 0; c < clusters; ++c) {
        double dist = 0;
        for (std::int64_t j = 0; j < d; ++j)
          dist += (fit[i * d + j] - mu[c * d + j]) * (fit[i * d + j] - mu[c * d + j]);
        if (dist < best) best = dist, nearest = c;
      }
      ++count[nearest];
      for (std::int64_t j = 0; j < d; ++j) sum[nearest * d + j] += fit[i * d + j];
    }
    for (std::int64_t c = 0; c < clusters; ++c)
      if (count[c] > 0)
        for (std::int64_t j = 0; j < d; ++j) mu[c * d + j] = sum[c * d + j] / double(count[c]);
  }
  return mu;
}

}  // namespace

TEST_SUITE("cluster_former") {
  TEST_CASE("cluster-former equals dense attention restricted to its chunks, at chunk ± 1 and non-multiples") {
    for (std::int64_t n : {15, 16, 17, 47, 100})
      check_cluster_former({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16},
                           {"chunk_len=16", "clusters=4", "kmeans_iterations=3"});
    for (std::int64_t chunk : {1, 7, 31})
      check_cluster_former({.batch = 1, .heads = 2, .seq_len = 93, .head_dim = 12},
                           {"chunk_len=" + std::to_string(chunk), "clusters=6"});
    check_cluster_former({.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16}, {"chunk_len=64", "clusters=16"});
    check_cluster_former({.batch = 1, .heads = 1, .seq_len = 40, .head_dim = 8}, {});  // defaults clamped to N
  }

  TEST_CASE("one chunk over the whole sequence is exact softmax attention; one cluster is local attention") {
    for (std::int64_t n : {1, 9, 64}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16};
      const auto in = random_inputs(p, 11);
      check_against_reference(run_keeping("cluster-former", p, in, {"chunk_len=" + std::to_string(n)}).out, in, p,
                              full_mask, label_of(n, 16, {"exact"}));
    }
    // With one cluster the stable sort keeps position order: chunks of consecutive positions.
    const Problem p{.batch = 1, .heads = 2, .seq_len = 50, .head_dim = 16};
    const auto in = random_inputs(p, 12);
    const MechanismRun run = run_keeping("cluster-former", p, in, {"clusters=1", "chunk_len=8"});
    for (std::int64_t i = 0; i < p.seq_len; ++i) CHECK(model_of(run).sort_order(0, 1)[i] == i);
    check_against_reference(
        run.out, in, p, [](std::int64_t i, std::int64_t j) { return i / 8 == j / 8; },
        label_of(50, 16, {"clusters=1"}));
  }

  TEST_CASE("centroids: Lloyd k-means on the seeded fitting rows, never the input; deterministic per seed") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 30, .head_dim = 8};
    for (std::int64_t iterations : {0, 1, 4}) {
      const std::vector<std::string> params{"clusters=5", "kmeans_iterations=" + std::to_string(iterations)};
      const MechanismRun run = run_keeping("cluster-former", p, random_inputs(p, 1), params, 42);
      const Tensor& centroids = run.parameter("centroids");
      for (std::int64_t h = 0; h < p.heads; ++h) {
        const auto want = naive_centroids(42, h, p.seq_len, p.head_dim, 5, iterations);
        for (std::int64_t e = 0; e < 5 * p.head_dim; ++e)
          CHECK(centroids[h * 5 * p.head_dim + e] == doctest::Approx(want[e]).epsilon(1e-5).scale(1.0));
      }
      // Other inputs: the same centroids.
      const MechanismRun other = run_keeping("cluster-former", p, random_inputs(p, 2), params, 42);
      const Tensor& again = other.parameter("centroids");
      CHECK(std::equal(centroids.data(), centroids.data() + centroids.size(), again.data()));
    }
    const MechanismRun a = run_keeping("cluster-former", p, random_inputs(p, 1), {"clusters=5"}, 1);
    const MechanismRun b = run_keeping("cluster-former", p, random_inputs(p, 1), {"clusters=5"}, 2);
    const Tensor &ca = a.parameter("centroids"), &cb = b.parameter("centroids");
    CHECK_FALSE(std::equal(ca.data(), ca.data() + ca.size(), cb.data()));
  }

  TEST_CASE("each batch element's output depends on that element alone") {
    const Problem pair{.batch = 2, .heads = 2, .seq_len = 70, .head_dim = 16};
    const std::vector<std::string> params{"clusters=6", "chunk_len=16"};
    const auto both = random_inputs(pair, 21);
    const Tensor together = run_keeping("cluster-former", pair, both, params).out.clone();
    const Problem single{.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 16};
    for (std::int64_t b = 0; b < 2; ++b) {
      AttentionInputs alone{Tensor::bhnd(1, 2, 70, 16), Tensor::bhnd(1, 2, 70, 16), Tensor::bhnd(1, 2, 70, 16)};
      for (auto [from, to] : {std::pair{&both.q, &alone.q}, {&both.k, &alone.k}, {&both.v, &alone.v}})
        std::copy_n(from->head(b, 0), 2 * 70 * 16, to->data());
      const Tensor out = run_keeping("cluster-former", single, alone, params).out.clone();
      CHECK(std::equal(out.data(), out.data() + out.size(), together.head(b, 0)));
    }
  }

  TEST_CASE("gradients through the chunks' attention, assignment held fixed, at chunk ± 1") {
    for (std::int64_t n : {7, 8, 9, 17, 40})
      for (std::int64_t d : {8, 16}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = d};
        const std::vector<std::string> params{"chunk_len=8", "clusters=3"};
        // The pattern of the checked run (check_model_gradients' inputs and seed 7).
        const MechanismRun run = run_keeping("cluster-former", p, random_inputs(p, 7), params, 7);
        std::vector<MaskFn> masks;
        for (std::int64_t h = 0; h < p.heads; ++h) masks.push_back(chunk_mask(model_of(run), 0, h, n));
        check_model_gradients(
            "cluster-former", p, [&](std::int64_t h, std::int64_t i, std::int64_t j) { return masks[h](i, j); },
            params);
      }
  }

  TEST_CASE("causal is unsupported with the reason; bad parameters are a one-line error") {
    const ResultRow row = run_point(quick_point("cluster-former", 64, true));
    CHECK(row.status == Status::Unsupported);
    CHECK(row.reason.find("cannot decode") != std::string::npos);
    const Problem p{.batch = 1, .heads = 1, .seq_len = 64, .head_dim = 16};
    for (const char* bad : {"clusters=0", "chunk_len=0", "kmeans_iterations=-1"})
      CHECK_THROWS_AS(validate_point(counter_point("cluster-former", p, {bad})), ParamError);
  }

  TEST_CASE("counters: FLOPs and tracked memory grow as N·(c + p)·D, far below vanilla") {
    const std::vector<std::string> params{"kmeans_iterations=1"};
    const auto point = [&](std::int64_t n) {
      return run_point(quick_point("cluster-former", n, false, Scope::Attention, params));
    };
    const ResultRow small = point(1024), middle = point(2048), large = point(4096);
    const ResultRow vanilla = run_point(quick_point("vanilla", 4096, false));
    for (const auto& [lo, hi] : {std::pair{&small, &middle}, std::pair{&middle, &large}}) {
      const double flops = double(hi->flops) / double(lo->flops);
      const double memory = double(hi->peak_tensor_bytes) / double(lo->peak_tensor_bytes);
      CHECK(flops > 1.95);
      CHECK(flops < 2.05);
      CHECK(memory < 2.05);
    }
    CHECK(large.flops * 4 < vanilla.flops);
    CHECK(large.peak_tensor_bytes * 4 < vanilla.peak_tensor_bytes);
    REQUIRE(large.stage_median_ns.size() == 2);
    CHECK(large.stage_median_ns.at("route") > 0);
    CHECK(large.stage_median_ns.at("attend") > 0);
  }
}
