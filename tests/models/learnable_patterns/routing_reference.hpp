#pragma once
// Routing's double references for the tests (test_learnable.cpp, test_routing_bf16.cpp): attention
// over each query's key list, the cosine affinities to the centroids, the key lists of the pattern
// a RoutingAttention exposed, and that pattern checked against the affinities.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "taxonomy/learnable_patterns/routing.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

// The keys query i may attend to, as indices into the key rows (repeats allowed).
using KeysOf = std::function<std::vector<std::int64_t>(std::int64_t i)>;

// out_i = Σ_j softmax(q_i·k_j/√d over keys_of(i)) v_j in double; zero when the list is empty.
// lse (optional) receives log Σ exp of the scores (−inf when empty).
inline std::vector<double> list_attention(const std::vector<double>& q, const std::vector<double>& k,
                                          const std::vector<double>& v, std::int64_t n, std::int64_t d,
                                          const KeysOf& keys_of, std::vector<double>* lse = nullptr) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(n * d, 0.0);
  if (lse) lse->assign(n, -INFINITY);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto keys = keys_of(i);
    if (keys.empty()) continue;
    std::vector<double> scores;
    for (auto j : keys) {
      double s = 0;
      for (std::int64_t c = 0; c < d; ++c) s += q[i * d + c] * k[j * d + c];
      scores.push_back(s * scale);
    }
    const double peak = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (double s : scores) sum += std::exp(s - peak);
    for (std::size_t e = 0; e < keys.size(); ++e)
      for (std::int64_t c = 0; c < d; ++c) out[i * d + c] += std::exp(scores[e] - peak) / sum * v[keys[e] * d + c];
    if (lse) (*lse)[i] = peak + std::log(sum);
  }
  return out;
}

// Cosine affinities x̂·μ_c of every token (rows of x) to every centroid of head h, in double.
inline std::vector<double> cosine_affinities(const float* x, const Tensor& centroids, std::int64_t h, std::int64_t n,
                                             std::int64_t d, std::int64_t clusters) {
  std::vector<double> a(n * clusters);
  for (std::int64_t i = 0; i < n; ++i) {
    double squares = 0;
    for (std::int64_t c = 0; c < d; ++c) squares += static_cast<double>(x[i * d + c]) * x[i * d + c];
    for (std::int64_t cl = 0; cl < clusters; ++cl) {
      double s = 0;
      for (std::int64_t c = 0; c < d; ++c)
        s += x[i * d + c] * static_cast<double>(centroids[(h * clusters + cl) * d + c]);
      a[i * clusters + cl] = s / std::sqrt(squares);
    }
  }
  return a;
}

// Every token's keys in head (b, h) by the pattern the model exposed (repeats kept: a query taken
// by several clusters sees each cluster's keys).
inline std::vector<std::vector<std::int64_t>> routing_key_lists(const RoutingAttention& model, const Problem& p,
                                                                std::int64_t b, std::int64_t h) {
  const std::int64_t n = p.seq_len, w = model.window();
  std::vector<std::vector<std::int64_t>> lists(n);
  if (model.is_local_head(h)) {
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < n; ++j)
        if ((j / w == i / w || j / w + 1 == i / w) && (!p.causal || j <= i)) lists[i].push_back(j);
  } else if (!p.causal) {
    for (std::int64_t c = 0; c < model.clusters(); ++c) {
      const auto queries = model.query_members(b, h, c), keys = model.key_members(b, h, c);
      for (auto i : queries) lists[i].insert(lists[i].end(), keys.begin(), keys.end());
    }
  } else {
    const auto qc = model.query_clusters(b, h), kc = model.key_clusters(b, h);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = i; j >= 0 && static_cast<std::int64_t>(lists[i].size()) < w; --j)
        if (kc[j] == qc[i]) lists[i].push_back(j);
  }
  return lists;
}

// Head (b, h)'s pattern against the double cosine affinities of its inputs (fp32, or the widened
// bf16 ones): non-causal, each cluster's w query and key members are its top-w tokens; causal,
// every query and key went to its nearest centroid.
inline void check_routing_pattern(const RoutingAttention& model, const Problem& p, const AttentionInputs& in,
                                  std::int64_t b, std::int64_t h) {
  const std::int64_t n = p.seq_len, d = p.head_dim, clusters = model.clusters(), w = model.window();
  const Tensor& centroids = *model.parameters()[0].tensor;
  const auto qa = cosine_affinities(in.q.head(b, h), centroids, h, n, d, clusters);
  const auto ka = cosine_affinities(in.k.head(b, h), centroids, h, n, d, clusters);
  if (!model.is_local_head(h) && !p.causal) {
    // Each cluster's members are its top-w tokens by cosine affinity.
    for (std::int64_t c = 0; c < clusters; ++c)
      for (const auto& [members, affinity] :
           {std::pair{model.query_members(b, h, c), &qa}, std::pair{model.key_members(b, h, c), &ka}}) {
        REQUIRE(static_cast<std::int64_t>(members.size()) == w);
        REQUIRE(std::is_sorted(members.begin(), members.end()));
        REQUIRE(std::adjacent_find(members.begin(), members.end()) == members.end());
        std::vector<bool> taken(n);
        double weakest_taken = INFINITY, strongest_left = -INFINITY;
        for (auto i : members) taken[i] = true;
        for (std::int64_t i = 0; i < n; ++i) {
          const double a = (*affinity)[i * clusters + c];
          if (taken[i])
            weakest_taken = std::min(weakest_taken, a);
          else
            strongest_left = std::max(strongest_left, a);
        }
        CHECK(weakest_taken >= strongest_left - 1e-5);
      }
  } else if (!model.is_local_head(h)) {
    // Nearest centroids; query i sees the w most recent keys j <= i of its cluster.
    const auto qc = model.query_clusters(b, h), kc = model.key_clusters(b, h);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto best = [&](const std::vector<double>& a) {
        return *std::max_element(a.begin() + i * clusters, a.begin() + (i + 1) * clusters);
      };
      CHECK(qa[i * clusters + qc[i]] >= best(qa) - 1e-5);
      CHECK(ka[i * clusters + kc[i]] >= best(ka) - 1e-5);
    }
  }
}

}  // namespace xfb::test
