// Learnable-pattern models (reformer, routing, sinkhorn): each output against a naive double
// reference that applies the pattern the mechanism exposed, the pattern itself against a naive
// recomputation from the dumped parameters, settings that reduce to exact softmax attention,
// causality, determinism, and how the counters scale with N.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <set>
#include <sstream>

#include "apps/bench/point.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/top_positions.hpp"
#include "taxonomy/learnable_patterns/reformer.hpp"
#include "taxonomy/learnable_patterns/routing.hpp"
#include "taxonomy/learnable_patterns/sinkhorn.hpp"
#include "taxonomy/registry.hpp"
#include "tests/models/learnable_patterns/routing_reference.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

template <class Model>
struct Run {
  std::unique_ptr<Mechanism> mechanism;
  Model* model = nullptr;
  Tensor out;
};

template <class Model>
Run<Model> run_model(const std::string& name, const Problem& p, const AttentionInputs& in,
                     const std::vector<std::string>& params = {}, std::uint64_t seed = 42) {
  const ModelInfo* info = find_model(name);
  REQUIRE(info != nullptr);
  Run<Model> run;
  run.mechanism = info->impl.create(on_test_threads(p), resolve_params(name, info->impl.params, params), seed);
  run.model = dynamic_cast<Model*>(run.mechanism.get());
  REQUIRE(run.model != nullptr);
  run.mechanism->prepare(in.q, in.k, in.v);
  run.out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  run.out.fill(std::nanf(""));
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  return run;
}

void check_close(const float* got, const std::vector<double>& want, std::int64_t d, double tolerance,
                 const std::string& label) {
  std::int64_t failures = 0;
  for (std::size_t e = 0; e < want.size(); ++e) {
    const double error = std::fabs(static_cast<double>(got[e]) - want[e]);
    if (!(error <= tolerance) && failures++ < 3) {
      std::ostringstream message;
      message << label << ": token " << e / d << " feature " << e % d << ": got " << got[e] << ", want " << want[e]
              << " (tolerance " << tolerance << ")";
      FAIL_CHECK(message.str());
    }
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
}

double head_tolerance(const AttentionInputs& in, std::int64_t b, std::int64_t h, const Problem& p,
                      const Tensor* keys = nullptr) {
  const Tensor& k = keys ? *keys : in.k;
  return attention_tolerance(in.q.head(b, h), k.head(b, h), in.v.head(b, h), p.seq_len, p.seq_len, p.head_dim,
                             1.0 / std::sqrt(static_cast<double>(p.head_dim)));
}

// Outputs of batch element 0 before rows >= cut changed equal those after, to rounding; later
// rows differ.
void check_changes_after(const Tensor& before, const Tensor& after, const AttentionInputs& in, const Problem& p,
                         std::int64_t cut, const std::string& label) {
  const std::int64_t d = p.head_dim;
  for (std::int64_t h = 0; h < p.heads; ++h) {
    const double tolerance = head_tolerance(in, 0, h, p);
    double earlier = 0, later = 0;
    for (std::int64_t e = 0; e < p.seq_len * d; ++e) {
      const double change = std::fabs(before.head(0, h)[e] - after.head(0, h)[e]);
      double& largest = e < cut * d ? earlier : later;
      largest = std::max(largest, change);
    }
    CAPTURE(label);
    CAPTURE(h);
    CHECK(earlier <= tolerance);
    CHECK(later > 100 * tolerance);
  }
}

// Changing tokens >= cut leaves earlier outputs unchanged (to rounding) and changes later ones,
// both through the same prepared mechanism and through a fresh one prepared on the changed input
// (so a parameter fitted in prepare() cannot carry the future either).
template <class Model>
void check_future_invariance(const std::string& name, const Problem& p, const std::vector<std::string>& params,
                             std::int64_t cut) {
  auto in = random_inputs(p, 5);
  auto run = run_model<Model>(name, p, in, params);
  const Tensor before = run.out.clone();
  const std::int64_t d = p.head_dim;
  for (std::int64_t h = 0; h < p.heads; ++h)
    for (std::int64_t e = cut * d; e < p.seq_len * d; ++e) {
      in.q.head(0, h)[e] = -in.q.head(0, h)[e] + 0.5f;
      in.k.head(0, h)[e] += 2.0f;
      in.v.head(0, h)[e] -= 3.0f;
    }
  Tensor after = Tensor::bhnd(p.batch, p.heads, p.seq_len, d);
  run.mechanism->forward(in.q, in.k, in.v, after);
  check_changes_after(before, after, in, p, cut, name + " (same prepare)");
  check_changes_after(before, run_model<Model>(name, p, in, params).out, in, p, cut, name + " (fresh prepare)");
}

std::string label_of(const std::string& model, std::int64_t n, bool causal, const std::vector<std::string>& params) {
  std::string label = model + " N=" + std::to_string(n) + (causal ? " causal" : "");
  for (const auto& param : params) label += " " + param;
  return label;
}

// ---- Reformer ----

// Visible keys of every token in one round, by the rule in reformer.hpp, from buckets and order.
std::vector<std::vector<std::int64_t>> reformer_pattern(const std::vector<std::int32_t>& bucket,
                                                        const std::vector<std::int32_t>& order, std::int64_t m,
                                                        bool causal) {
  const auto n = static_cast<std::int64_t>(bucket.size());
  std::vector<std::int64_t> sorted_at(n), rank(n);
  for (std::int64_t s = 0; s < n; ++s) sorted_at[order[s]] = s;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < i; ++j) rank[i] += bucket[j] == bucket[i];
  std::vector<std::vector<std::int64_t>> keys(n);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      if (j == i || bucket[j] != bucket[i]) continue;
      const bool visible = causal ? j < i && rank[j] / m + 1 >= rank[i] / m
                                  : sorted_at[j] / m == sorted_at[i] / m || sorted_at[j] / m + 1 == sorted_at[i] / m;
      if (visible) keys[i].push_back(j);
    }
    if (keys[i].empty()) keys[i].push_back(i);
  }
  return keys;
}

// k̂ = q / ‖q‖ per token, as a tensor shaped like q.
Tensor normalised(const Tensor& q, std::int64_t d) {
  Tensor keys = q.clone();
  for (std::int64_t row = 0; row < q.size() / d; ++row) {
    double squares = 0;
    for (std::int64_t c = 0; c < d; ++c) squares += static_cast<double>(q[row * d + c]) * q[row * d + c];
    for (std::int64_t c = 0; c < d; ++c)
      keys[row * d + c] = squares > 0 ? static_cast<float>(q[row * d + c] / std::sqrt(squares)) : 0.0f;
  }
  return keys;
}

// Buckets equal argmax([xR; −xR]) (up to fp32 near-ties) and the order is the stable sort by
// (bucket, position).
void check_reformer_hashing(ReformerAttention& model, const AttentionInputs& in, const Problem& p,
                            std::int64_t n_buckets, std::int64_t rounds) {
  const std::int64_t n = p.seq_len, d = p.head_dim, half = n_buckets / 2;
  const Tensor keys = normalised(in.q, d);
  const auto params = model.parameters();
  const Tensor* rotations = params.empty() ? nullptr : params[0].tensor;
  for (std::int64_t r = 0; r < rounds; ++r)
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.heads; ++h) {
        const auto bucket = model.buckets(r, b, h);
        const auto order = model.sort_order(r, b, h);
        for (std::int64_t s = 1; s < n; ++s)
          REQUIRE(std::make_pair(bucket[order[s - 1]], order[s - 1]) < std::make_pair(bucket[order[s]], order[s]));
        for (std::int64_t i = 0; i < n; ++i) {
          if (half == 0) {
            REQUIRE(bucket[i] == 0);
            continue;
          }
          std::vector<double> x(2 * half);
          for (std::int64_t j = 0; j < half; ++j) {
            for (std::int64_t c = 0; c < d; ++c)
              x[j] += static_cast<double>(keys.head(b, h)[i * d + c]) * (*rotations)[(c * rounds + r) * half + j];
            x[half + j] = -x[j];
          }
          const double best = *std::max_element(x.begin(), x.end());
          REQUIRE(bucket[i] >= 0);
          REQUIRE(bucket[i] < n_buckets);
          CHECK(x[bucket[i]] >= best - 1e-4);
        }
      }
}

// Every token's keys over the union of the rounds' patterns in head (b, h), each key once.
std::vector<std::vector<std::int64_t>> reformer_union(const ReformerAttention& model, const Problem& p,
                                                      std::int64_t rounds, std::int64_t b, std::int64_t h) {
  std::vector<std::set<std::int64_t>> seen(p.seq_len);
  for (std::int64_t r = 0; r < rounds; ++r) {
    const auto pattern = reformer_pattern(model.buckets(r, b, h), model.sort_order(r, b, h), model.chunk(), p.causal);
    for (std::int64_t i = 0; i < p.seq_len; ++i) seen[i].insert(pattern[i].begin(), pattern[i].end());
  }
  std::vector<std::vector<std::int64_t>> keys;
  for (const auto& set : seen) keys.emplace_back(set.begin(), set.end());
  return keys;
}

// Naive reformer: softmax over the union of every round's visible keys (each key once), from the
// exposed patterns.
void check_reformer(const Problem& p, const std::vector<std::string>& params, std::int64_t n_buckets,
                    std::int64_t rounds) {
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len * 7 + rounds));
  auto run = run_model<ReformerAttention>("reformer", p, in, params);
  check_reformer_hashing(*run.model, in, p, n_buckets, rounds);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const Tensor keys = normalised(in.q, d);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto q = widened(in.q.head(b, h), n * d), k = widened(keys.head(b, h), n * d),
                 v = widened(in.v.head(b, h), n * d);
      const auto seen = reformer_union(*run.model, p, rounds, b, h);
      const auto want = list_attention(q, k, v, n, d, [&](std::int64_t i) { return seen[i]; });
      check_close(run.out.head(b, h), want, d, 2 * head_tolerance(in, b, h, p, &keys),
                  label_of("reformer", n, p.causal, params));
    }
}

// ---- Routing ----

void check_routing(const Problem& p, const std::vector<std::string>& params) {
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len * 3 + 1));
  auto run = run_model<RoutingAttention>("routing", p, in, params);
  auto& model = *run.model;
  const std::int64_t n = p.seq_len, d = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto q = widened(in.q.head(b, h), n * d), k = widened(in.k.head(b, h), n * d),
                 v = widened(in.v.head(b, h), n * d);
      check_routing_pattern(model, p, in, b, h);
      const auto lists = routing_key_lists(model, p, b, h);
      check_close(run.out.head(b, h), list_attention(q, k, v, n, d, [&](std::int64_t i) { return lists[i]; }), d,
                  head_tolerance(in, b, h, p), label_of("routing", n, p.causal, params) + " h=" + std::to_string(h));
    }
}

// ---- Sinkhorn ----

// The sorting network's weights, in double.
struct SortingWeights {
  const double *w1, *b1, *w2, *b2;
};

// Soft permutation of one head ([nb, nb]) from its keys k [n, d] and the network, in double
// (sinkhorn.hpp).
std::vector<double> sinkhorn_permutation(const double* k, const SortingWeights& w, const Problem& p, std::int64_t bs,
                                         std::int64_t iterations, double tau) {
  const std::int64_t n = p.seq_len, d = p.head_dim, nb = (n + bs - 1) / bs;
  std::vector<double> sums(nb * d, 0.0), e(nb * d, 0.0), l(nb * nb);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t c = 0; c < d; ++c) sums[(t / bs) * d + c] += k[t * d + c];
  for (std::int64_t i = 0; i < nb; ++i)
    for (std::int64_t j = 0; j < nb; ++j)
      if (p.causal ? j < i : j == i)
        for (std::int64_t c = 0; c < d; ++c) e[i * d + c] += sums[j * d + c];
  for (std::int64_t i = 0; i < nb; ++i) {
    std::vector<double> hidden(d);
    for (std::int64_t o = 0; o < d; ++o) {
      double s = w.b1[o];
      for (std::int64_t c = 0; c < d; ++c) s += e[i * d + c] * w.w1[c * d + o];
      hidden[o] = std::max(s, 0.0);
    }
    for (std::int64_t j = 0; j < nb; ++j) {
      double s = w.b2[j];
      for (std::int64_t o = 0; o < d; ++o) s += hidden[o] * w.w2[o * nb + j];
      l[i * nb + j] = s / tau;
    }
  }
  auto log_sum = [](const std::vector<double>& x) -> double {
    if (x.empty()) return -INFINITY;
    const double peak = *std::max_element(x.begin(), x.end());
    double sum = 0;
    for (double value : x) sum += std::exp(value - peak);
    return peak + std::log(sum);
  };
  std::vector<double> perm(nb * nb, 0.0);
  if (p.causal) {
    for (std::int64_t i = 0; i < nb; ++i) {
      const double total = log_sum(std::vector<double>(l.begin() + i * nb, l.begin() + i * nb + i));
      for (std::int64_t j = 0; j < i; ++j) perm[i * nb + j] = std::exp(l[i * nb + j] - total);
    }
    return perm;
  }
  for (std::int64_t it = 0; it < iterations; ++it) {
    for (std::int64_t i = 0; i < nb; ++i) {
      const double total = log_sum(std::vector<double>(l.begin() + i * nb, l.begin() + (i + 1) * nb));
      for (std::int64_t j = 0; j < nb; ++j) l[i * nb + j] -= total;
    }
    for (std::int64_t j = 0; j < nb; ++j) {
      std::vector<double> column(nb);
      for (std::int64_t i = 0; i < nb; ++i) column[i] = l[i * nb + j];
      const double total = log_sum(column);
      for (std::int64_t i = 0; i < nb; ++i) l[i * nb + j] -= total;
    }
  }
  for (std::int64_t e2 = 0; e2 < nb * nb; ++e2) perm[e2] = std::exp(l[e2]);
  return perm;
}

// One head's output given its permutation perm [nb, nb], in double: keys are [K ; sorted blocks],
// each query's list per sinkhorn.hpp (cut: SortCut blocks, 0 off).
std::vector<double> sinkhorn_attention(const double* q_head, const double* k_head, const double* v_head,
                                       const std::vector<double>& perm, const Problem& p, std::int64_t bs,
                                       std::int64_t cut) {
  const std::int64_t n = p.seq_len, d = p.head_dim, nb = (n + bs - 1) / bs, rows = cut > 0 ? cut : nb;
  std::vector<double> q(q_head, q_head + n * d), k(k_head, k_head + n * d), v(v_head, v_head + n * d);
  k.resize((n + rows * bs) * d, 0.0);
  v.resize((n + rows * bs) * d, 0.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < nb; ++j)
      for (std::int64_t t = 0; t < bs && j * bs + t < n; ++t)
        for (std::int64_t c = 0; c < d; ++c) {
          k[(n + i * bs + t) * d + c] += perm[i * nb + j] * k_head[(j * bs + t) * d + c];
          v[(n + i * bs + t) * d + c] += perm[i * nb + j] * v_head[(j * bs + t) * d + c];
        }
  auto keys_of = [&](std::int64_t i) {
    std::vector<std::int64_t> keys;
    const std::int64_t block = i / bs;
    if (cut > 0) {
      for (std::int64_t t = 0; t < cut * bs; ++t) keys.push_back(n + t);
      return keys;
    }
    for (std::int64_t j = block * bs; j < std::min(n, (block + 1) * bs); ++j)
      if (!p.causal || j <= i) keys.push_back(j);
    if (!p.causal || block > 0)
      for (std::int64_t t = 0; t < bs; ++t) keys.push_back(n + block * bs + t);
    return keys;
  };
  return list_attention(q, k, v, n, d, keys_of);
}

// The permutation against one recomputed from the dumped network, and the output against one
// computed from the exposed permutation.
void check_sinkhorn(const Problem& p, const std::vector<std::string>& params, std::int64_t iterations = 7,
                    double tau = 0.75) {
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len * 5 + 2));
  auto run = run_model<SinkhornAttention>("sinkhorn", p, in, params);
  const auto& model = *run.model;
  const std::int64_t n = p.seq_len, d = p.head_dim, bs = model.block(), nb = model.blocks();
  const auto parameters = model.parameters();
  std::vector<std::vector<double>> weights;
  for (std::size_t i = 0; i < 4; ++i)
    weights.push_back(widened(parameters[i].tensor->data(), parameters[i].tensor->size()));
  const SortingWeights w{weights[0].data(), weights[1].data(), weights[2].data(), weights[3].data()};
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto q = widened(in.q.head(b, h), n * d), k = widened(in.k.head(b, h), n * d),
                 v = widened(in.v.head(b, h), n * d);
      const auto perm = model.permutation(b, h);
      const auto want_perm = sinkhorn_permutation(k.data(), w, p, bs, iterations, tau);
      for (std::int64_t e = 0; e < nb * nb; ++e)
        CHECK_MESSAGE(std::fabs(perm[e] - want_perm[e]) <= 1e-4 * (1 + want_perm[e]),
                      "permutation entry " << e << ": got " << perm[e] << ", want " << want_perm[e]);
      const auto want =
          sinkhorn_attention(q.data(), k.data(), v.data(), {perm.begin(), perm.end()}, p, bs, model.sortcut_blocks());
      check_close(run.out.head(b, h), want, d, 4 * head_tolerance(in, b, h, p),
                  label_of("sinkhorn", n, p.causal, params));
    }
}

PointConfig counter_point(const std::string& model, std::int64_t n, bool causal = false) {
  return test::counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal});
}

}  // namespace

TEST_SUITE("learnable") {
  TEST_CASE("reformer equals its naive LSH attention at, below and above the chunk length") {
    // Every kernel path (chunk tiles on the 512-bit kernels or on sgemm); D = 12 is sgemm throughout.
    const KernelIsa original = kernel_isa();
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      CAPTURE(kernel_isa_name(isa));
      for (bool causal : {false, true}) {
        for (std::int64_t n : {1, 7, 8, 9, 16, 17, 23, 24, 25, 100}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          check_reformer(p, {"chunk_len=8", "n_buckets=4"}, 4, 1);
        }
        for (std::int64_t n : {63, 64, 65, 129, 300}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          check_reformer(p, {}, 10, 1);
        }
        const Problem odd{.batch = 1, .heads = 2, .seq_len = 50, .head_dim = 12, .causal = causal};
        check_reformer(odd, {"chunk_len=8", "n_buckets=4"}, 4, 1);
      }
    }
    force_kernel_isa(original);
  }

  TEST_CASE("multi-round reformer equals softmax over the union of its rounds' keys, computed naively") {
    for (bool causal : {false, true})
      for (const char* rounds : {"2", "4", "8"}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = 77, .head_dim = 16, .causal = causal};
        check_reformer(p, {"chunk_len=10", "n_buckets=6", std::string("n_rounds=") + rounds}, 6, std::stoll(rounds));
      }
    const Problem lra{.batch = 1, .heads = 1, .seq_len = 95, .head_dim = 16, .causal = false};
    check_reformer(lra, {"chunk_len=0", "n_rounds=2"}, 10, 2);  // LRA's chunking: ceil(N / n_buckets)
  }

  TEST_CASE("reformer with one bucket and one chunk is softmax attention over k = q/|q| without self") {
    for (bool causal : {false, true})
      for (std::int64_t n : {1, 2, 50, 129}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        const auto in = random_inputs(p, 9);
        const Tensor out = run_model<ReformerAttention>("reformer", p, in, {"n_buckets=1", "chunk_len=0"}).out.clone();
        const AttentionInputs shared{in.q.clone(), normalised(in.q, p.head_dim), in.v.clone()};
        // Self only when nothing else is visible: token 0 when causal, the single token when N = 1.
        auto mask = [causal, n](std::int64_t i, std::int64_t j) {
          const bool alone = n == 1 || (causal && i == 0);
          return (causal ? j < i : j != i) || (alone && j == i);
        };
        check_against_reference(out, shared, p, mask, label_of("reformer exact", n, causal, {}));
      }
  }

  TEST_CASE("reformer gradients through the queries and the shared keys q/|q|, pattern held fixed, at chunk ± 1") {
    for (bool causal : {false, true})
      for (const auto& [n, rounds] : {std::pair{7, 1}, {8, 1}, {9, 2}, {17, 2}, {40, 4}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
        const std::vector<std::string> params{"chunk_len=8", "n_buckets=4", "n_rounds=" + std::to_string(rounds)};
        // The pattern the checked run makes (check_composite_gradients' inputs and seed), held fixed.
        const auto run = run_model<ReformerAttention>("reformer", p, random_inputs(p, 7), params, 7);
        std::vector<std::vector<std::vector<std::int64_t>>> unions;
        for (std::int64_t b = 0; b < p.batch; ++b)
          for (std::int64_t h = 0; h < p.heads; ++h) unions.push_back(reformer_union(*run.model, p, rounds, b, h));
        auto reference = [&](const NamedValues& x) {
          const std::int64_t size = p.seq_len * p.head_dim;
          std::vector<double> out;
          for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
            const std::vector<double> q(x.at("q").begin() + head * size, x.at("q").begin() + (head + 1) * size);
            const std::vector<double> v(x.at("v").begin() + head * size, x.at("v").begin() + (head + 1) * size);
            std::vector<double> keys(q);
            for (std::int64_t i = 0; i < p.seq_len; ++i) {
              double squares = 0;
              for (std::int64_t c = 0; c < p.head_dim; ++c) squares += q[i * p.head_dim + c] * q[i * p.head_dim + c];
              for (std::int64_t c = 0; c < p.head_dim; ++c) keys[i * p.head_dim + c] /= std::sqrt(squares);
            }
            const auto o =
                list_attention(q, keys, v, p.seq_len, p.head_dim, [&](std::int64_t i) { return unions[head][i]; });
            out.insert(out.end(), o.begin(), o.end());
          }
          return out;
        };
        check_composite_gradients("reformer", p, params, reference, n <= 17);
      }
  }

  TEST_CASE("sinkhorn gradients through attention, mixing, the Sinkhorn iterations and the sorting network") {
    // Block 4 at N = 3 (one short block), 4, 5 and beyond; SortCut; causal (row softmax only).
    auto reference = [](const Problem& p, std::int64_t iterations, std::int64_t cut) {
      return [=](const NamedValues& x) {
        const std::int64_t size = p.seq_len * p.head_dim;
        const SortingWeights w{x.at("w1").data(), x.at("b1").data(), x.at("w2").data(), x.at("b2").data()};
        std::vector<double> out;
        for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
          const double* k = x.at("k").data() + head * size;
          const std::int64_t bs = std::min<std::int64_t>(4, p.seq_len), blocks = (p.seq_len + bs - 1) / bs;
          const auto perm = sinkhorn_permutation(k, w, p, bs, iterations, 0.75);
          const auto o = sinkhorn_attention(x.at("q").data() + head * size, k, x.at("v").data() + head * size, perm, p,
                                            bs, std::min(cut, blocks));
          out.insert(out.end(), o.begin(), o.end());
        }
        return out;
      };
    };
    for (bool causal : {false, true})
      for (std::int64_t n : {3, 4, 5, 9, 14}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
        const std::int64_t iterations = n == 14 ? 7 : 3;
        check_composite_gradients("sinkhorn", p, {"block=4", "sinkhorn_iters=" + std::to_string(iterations)},
                                  reference(p, iterations, 0), n <= 9);
        if (!causal)
          check_composite_gradients("sinkhorn", p, {"block=4", "sinkhorn_iters=3", "sortcut_blocks=2"},
                                    reference(p, 3, 2), n <= 9);
      }
  }

  TEST_CASE("routing gradients with the pattern held fixed, balanced and causal, with local heads, at w ± 1") {
    for (bool causal : {false, true})
      for (const auto& [n, params] :
           {std::pair<std::int64_t, std::vector<std::string>>{11, {"clusters=4"}},  // w = 3, short last block
            {12, {"clusters=4"}},
            {13, {"clusters=4", "local_heads=true"}},
            {40, {"clusters=5", "local_heads=true"}}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
        const auto run = run_model<RoutingAttention>("routing", p, random_inputs(p, 7), params, 7);
        std::vector<std::vector<std::vector<std::int64_t>>> lists;
        for (std::int64_t b = 0; b < p.batch; ++b)
          for (std::int64_t h = 0; h < p.heads; ++h) lists.push_back(routing_key_lists(*run.model, p, b, h));
        auto reference = [&](const NamedValues& x) {
          const std::int64_t size = p.seq_len * p.head_dim;
          std::vector<double> out;
          for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
            auto slice = [&](const char* name) {
              return std::vector<double>(x.at(name).begin() + head * size, x.at(name).begin() + (head + 1) * size);
            };
            const auto o = list_attention(slice("q"), slice("k"), slice("v"), p.seq_len, p.head_dim,
                                          [&](std::int64_t i) { return lists[head][i]; });
            out.insert(out.end(), o.begin(), o.end());
          }
          return out;
        };
        check_composite_gradients("routing", p, params, reference, n <= 13);
      }
  }

  TEST_CASE("routing's training step updates the centroids by the paper's EMA over the nearest queries and keys") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 2, .heads = 4, .seq_len = 50, .head_dim = 8, .causal = causal};
      const std::vector<std::string> params{"clusters=5", "local_heads=true", "ema_decay=0.9"};
      const auto in = random_inputs(p, 3);
      const BackwardRun run = run_backward("routing", p, in, random_like(p, 3, "dout"), params);
      const Tensor* before = run.mechanism->parameters()[0].tensor;
      const Tensor* after = run.mechanism->parameter_gradients()[0].tensor;
      REQUIRE(run.mechanism->parameter_gradients()[0].name == "updated_centroids");
      const std::int64_t n = p.seq_len, d = p.head_dim, clusters = 5;
      for (std::int64_t h = 0; h < p.heads; ++h) {
        std::vector<double> sums(clusters * d, 0.0);
        for (std::int64_t b = 0; b < p.batch; ++b)
          for (const Tensor* x : {&in.q, &in.k}) {
            const auto affinity = cosine_affinities(x->head(b, h), *before, h, n, d, clusters);
            for (std::int64_t i = 0; i < n; ++i) {
              const auto first = affinity.begin() + i * clusters;
              const auto nearest = std::max_element(first, first + clusters) - first;
              double squares = 0;
              for (std::int64_t c = 0; c < d; ++c) squares += std::pow(x->head(b, h)[i * d + c], 2);
              for (std::int64_t c = 0; c < d; ++c)
                sums[nearest * d + c] += x->head(b, h)[i * d + c] / std::sqrt(squares);
            }
          }
        for (std::int64_t c = 0; c < clusters; ++c) {
          std::vector<double> want(d);
          double squares = 0;
          for (std::int64_t j = 0; j < d; ++j) {
            const double mu = (*before)[(h * clusters + c) * d + j];
            want[j] = h < 2 ? mu : 0.9 * mu + 0.05 * sums[c * d + j];  // heads 0, 1 are local: unchanged
            squares += want[j] * want[j];
          }
          for (std::int64_t j = 0; j < d; ++j)
            CHECK((*after)[(h * clusters + c) * d + j] ==
                  doctest::Approx(want[j] / std::sqrt(squares)).epsilon(1e-5).scale(1.0));
        }
      }
    }
  }

  TEST_CASE("reformer hashing and sorting are deterministic for a seed and change with it") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 200, .head_dim = 16, .causal = false};
    const auto in = random_inputs(p, 4);
    auto first = run_model<ReformerAttention>("reformer", p, in, {"n_rounds=2"}, 7);
    auto second = run_model<ReformerAttention>("reformer", p, in, {"n_rounds=2"}, 7);
    auto other = run_model<ReformerAttention>("reformer", p, in, {"n_rounds=2"}, 8);
    for (std::int64_t r = 0; r < 2; ++r) {
      CHECK(first.model->buckets(r, 0, 1) == second.model->buckets(r, 0, 1));
      CHECK(first.model->sort_order(r, 0, 1) == second.model->sort_order(r, 0, 1));
      CHECK(first.model->buckets(r, 0, 1) != other.model->buckets(r, 0, 1));
    }
    CHECK(std::equal(first.out.values().begin(), first.out.values().end(), second.out.values().begin()));
  }

  TEST_CASE("reformer rejects an odd bucket count") {
    const ModelInfo* info = find_model("reformer");
    REQUIRE(info != nullptr);
    const Problem p{.batch = 1, .heads = 1, .seq_len = 16, .head_dim = 8, .causal = false};
    CHECK_THROWS_AS(validate_point(counter_point("reformer", p, {"n_buckets=5"})), ParamError);
    CHECK_NOTHROW(validate_point(counter_point("reformer", p, {"n_buckets=6"})));
    CHECK_NOTHROW(validate_point(counter_point("reformer", p, {"n_buckets=1"})));
  }

  TEST_CASE("routing equals its naive cluster attention, balanced and causal, with and without local heads") {
    // Every kernel path (cluster tiles on the 512-bit kernels or on sgemm); N around the affinity
    // block of 256 tokens; D = 16, 32 (the kernels) and 12 (sgemm whatever the ISA).
    const KernelIsa original = kernel_isa();
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      CAPTURE(kernel_isa_name(isa));
      for (bool causal : {false, true}) {
        for (std::int64_t n : {1, 2, 15, 16, 17, 100})
          check_routing({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal}, {"clusters=4"});
        for (std::int64_t n : {63, 64, 65, 255, 256, 257, 513})
          check_routing({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal}, {});
        check_routing({.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 12, .causal = causal}, {"clusters=3"});
        check_routing({.batch = 1, .heads = 4, .seq_len = 90, .head_dim = 16, .causal = causal},
                      {"local_heads=true", "clusters=9"});
        check_routing({.batch = 1, .heads = 2, .seq_len = 60, .head_dim = 16, .causal = causal},
                      {"kmeans_updates=0", "clusters=60"});
      }
    }
    force_kernel_isa(original);
  }

  TEST_CASE("routing's top-w selection breaks ties by lower position") {
    // Zero queries and keys: every cosine affinity is 0, so each cluster takes positions 0 … w−1.
    const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16, .causal = false};
    auto in = random_inputs(p, 13);
    std::fill(in.q.data(), in.q.data() + in.q.size(), 0.0f);
    std::fill(in.k.data(), in.k.data() + in.k.size(), 0.0f);
    auto run = run_model<RoutingAttention>("routing", p, in, {"kmeans_updates=0"});
    std::vector<std::int32_t> first(static_cast<std::size_t>(run.model->window()));
    std::iota(first.begin(), first.end(), 0);
    for (std::int64_t h = 0; h < p.heads; ++h)
      for (std::int64_t c = 0; c < run.model->clusters(); ++c) {
        CHECK(run.model->query_members(0, h, c) == first);
        CHECK(run.model->key_members(0, h, c) == first);
      }
  }

  TEST_CASE("routing's streamed top-w selection equals a full sort, whatever the blocks and ties") {
    // The w largest by (value descending, position ascending), ascending: the rule by a full sort.
    auto by_sort = [](const std::vector<float>& values, std::int64_t w) {
      std::vector<std::int32_t> order(values.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::int32_t a, std::int32_t b) { return values[a] > values[b]; });
      order.resize(static_cast<std::size_t>(w));
      std::sort(order.begin(), order.end());
      return order;
    };
    // The values fed in blocks of `block` positions (the last one partial).
    auto selected = [](const std::vector<float>& values, std::int64_t w, std::int64_t block) {
      const auto n = static_cast<std::int64_t>(values.size());
      std::vector<std::int32_t> positions(static_cast<std::size_t>(TopPositions::capacity(w, block, n)));
      std::vector<std::int32_t> scratch_indices(positions.size()), members(static_cast<std::size_t>(w));
      std::vector<float> values_kept(positions.size()), scratch_values(positions.size());
      TopPositions top;
      top.reset(w, positions.data(), values_kept.data(), scratch_indices.data(), scratch_values.data());
      for (std::int64_t first = 0; first < n; first += block)
        top.add(values.data() + first, std::min(block, n - first), first);
      top.finish(members.data());
      return members;
    };
    const KernelIsa original = kernel_isa();
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      const CounterRng rng(3, "top-w");
      std::uint64_t draw = 0;
      for (std::int64_t n : {1, 2, 7, 8, 9, 15, 16, 17, 100, 255, 256, 257, 1000, 8192})
        for (std::int64_t w : {std::int64_t{1}, (n + 90) / 91, std::max<std::int64_t>(1, n / 3), n})
          for (std::int64_t block :
               {std::int64_t{1}, std::int64_t{15}, std::int64_t{16}, std::int64_t{17}, std::int64_t{256}, n}) {
            std::vector<float> values(static_cast<std::size_t>(n));
            // Coarse values (multiples of 1/8) so ties are frequent.
            for (float& value : values) value = std::round(static_cast<float>(rng.normal(draw++)) * 8.0f) / 8.0f;
            CHECK_MESSAGE(selected(values, w, block) == by_sort(values, w),
                          kernel_isa_name(isa) << " n=" << n << " w=" << w << " block=" << block);
          }
      // Ascending values: every block beats the bar, so the list is cut again and again; descending:
      // the first w stay; all equal: the first w by position.
      const std::int64_t n = 2000, w = 300;
      std::vector<float> rising(static_cast<std::size_t>(n)), falling(rising.size()), equal(rising.size(), 0.25f);
      for (std::int64_t i = 0; i < n; ++i) {
        rising[static_cast<std::size_t>(i)] = 0.001f * static_cast<float>(i) - 1.0f;
        falling[static_cast<std::size_t>(i)] = -rising[static_cast<std::size_t>(i)];
      }
      for (const auto* values : {&rising, &falling, &equal})
        for (std::int64_t block : {std::int64_t{7}, std::int64_t{256}})
          CHECK_MESSAGE(selected(*values, w, block) == by_sort(*values, w), kernel_isa_name(isa));
      // −0 and +0 are equal values: ties by position, also across a cut whose bar is just above 0;
      // infinities are values like any other.
      std::vector<float> zeros(100);
      for (std::size_t i = 0; i < zeros.size(); ++i) zeros[i] = i % 7 == 0 ? 1.0f : (i % 2 == 0 ? -0.0f : 0.0f);
      zeros[50] = std::numeric_limits<float>::infinity();
      zeros[51] = -std::numeric_limits<float>::infinity();
      for (std::int64_t w_zeros : {1, 15, 40, 99, 100})
        for (std::int64_t block : {std::int64_t{1}, std::int64_t{8}, std::int64_t{100}})
          CHECK_MESSAGE(selected(zeros, w_zeros, block) == by_sort(zeros, w_zeros),
                        kernel_isa_name(isa) << " w=" << w_zeros << " block=" << block);
    }
    force_kernel_isa(original);
  }

  TEST_CASE("routing with one cluster is exact softmax attention") {
    for (bool causal : {false, true})
      for (std::int64_t n : {1, 33, 200}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        const auto in = random_inputs(p, 12);
        const Tensor out = run_model<RoutingAttention>("routing", p, in, {"clusters=1"}).out.clone();
        check_against_reference(out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                label_of("routing exact", n, causal, {}));
      }
  }

  TEST_CASE("routing: each batch element's output depends on that element alone, k-means on") {
    for (bool causal : {false, true}) {
      const Problem pair{.batch = 2, .heads = 2, .seq_len = 97, .head_dim = 16, .causal = causal};
      const auto both = random_inputs(pair, 31);
      const Tensor together = run_model<RoutingAttention>("routing", pair, both, {"kmeans_updates=3"}).out.clone();
      Problem single = pair;
      single.batch = 1;
      for (std::int64_t b = 0; b < 2; ++b) {
        auto alone = random_inputs(single, 1);
        for (std::int64_t h = 0; h < pair.heads; ++h)
          for (auto [from, to] :
               {std::pair{&both.q, &alone.q}, std::pair{&both.k, &alone.k}, std::pair{&both.v, &alone.v}})
            std::copy_n(from->head(b, h), pair.seq_len * pair.head_dim, to->head(0, h));
        const auto run = run_model<RoutingAttention>("routing", single, alone, {"kmeans_updates=3"});
        for (std::int64_t h = 0; h < pair.heads; ++h) {
          CAPTURE(causal);
          CAPTURE(b);
          CAPTURE(h);
          double largest = 0;
          for (std::int64_t e = 0; e < pair.seq_len * pair.head_dim; ++e)
            largest = std::max(largest, std::fabs(double(run.out.head(0, h)[e]) - together.head(b, h)[e]));
          CHECK(largest <= head_tolerance(alone, 0, h, single));
        }
      }
    }
  }

  TEST_CASE("routing centroids move under the EMA update and the routing is deterministic") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 256, .head_dim = 16, .causal = false};
    const auto in = random_inputs(p, 21);
    auto fixed = run_model<RoutingAttention>("routing", p, in, {"kmeans_updates=0"});
    auto refined = run_model<RoutingAttention>("routing", p, in, {});
    auto again = run_model<RoutingAttention>("routing", p, in, {});
    const Tensor& before = *fixed.model->parameters()[0].tensor;
    const Tensor& after = *refined.model->parameters()[0].tensor;
    double moved = 0;
    for (std::int64_t e = 0; e < before.size(); ++e) moved = std::max(moved, std::fabs(double(before[e]) - after[e]));
    CHECK(moved > 1e-3);
    for (std::int64_t row = 0; row < after.size() / p.head_dim; ++row) {
      double squares = 0;
      for (std::int64_t c = 0; c < p.head_dim; ++c)
        squares += double(after[row * p.head_dim + c]) * after[row * p.head_dim + c];
      CHECK(std::fabs(squares - 1.0) < 1e-5);
    }
    for (std::int64_t c = 0; c < refined.model->clusters(); ++c) {
      CHECK(refined.model->query_members(0, 1, c) == again.model->query_members(0, 1, c));
      CHECK(refined.model->key_members(0, 1, c) == again.model->key_members(0, 1, c));
    }
    CHECK(std::equal(refined.out.values().begin(), refined.out.values().end(), again.out.values().begin()));
  }

  TEST_CASE("sinkhorn equals its naive sorted-block attention at, below and above the block size") {
    for (bool causal : {false, true}) {
      for (std::int64_t n : {1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 100}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        check_sinkhorn(p, {"block=8"});
      }
      for (std::int64_t n : {49, 50, 51, 333}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
        check_sinkhorn(p, {});
      }
      check_sinkhorn({.batch = 1, .heads = 2, .seq_len = 90, .head_dim = 16, .causal = causal},
                     {"block=10", "sinkhorn_iters=3", "temperature=2"}, 3, 2.0);
    }
  }

  TEST_CASE("sinkhorn SortCut attends to the first sorted blocks and is unsupported with causal") {
    for (std::int64_t n : {40, 41, 100}) {
      check_sinkhorn({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false},
                     {"block=8", "sortcut_blocks=2"});
      check_sinkhorn({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false},
                     {"block=8", "sortcut_blocks=1000"});
    }
    const Problem causal{.batch = 1, .heads = 1, .seq_len = 64, .head_dim = 8, .causal = true};
    const PointConfig point = counter_point("sinkhorn", causal, {"sortcut_blocks=2"});
    CHECK_NOTHROW(validate_point(point));  // a valid request the model cannot do: a row, not an error
    const ResultRow row = run_point(point);
    CHECK(row.status == Status::Unsupported);
    CHECK(row.reason.find("SortCut") != std::string::npos);
    CHECK(describe_point(counter_point("sinkhorn", causal, {"sortcut_blocks=0"})).status == Status::Ok);
  }

  TEST_CASE("sinkhorn with one block is exact softmax attention") {
    for (bool causal : {false, true})
      for (std::int64_t n : {1, 50, 130}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        const auto in = random_inputs(p, 14);
        for (const char* block : {"block=130", "block=4096"}) {
          const Tensor out = run_model<SinkhornAttention>("sinkhorn", p, in, {block}).out.clone();
          check_against_reference(out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                  label_of("sinkhorn exact", n, causal, {block}));
        }
      }
  }

  TEST_CASE("sinkhorn permutations: columns (non-causal) or past-only rows (causal) sum to one, deterministically") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 500, .head_dim = 16, .causal = causal};
      const auto in = random_inputs(p, 17);
      auto first = run_model<SinkhornAttention>("sinkhorn", p, in);
      auto second = run_model<SinkhornAttention>("sinkhorn", p, in);
      const std::int64_t nb = first.model->blocks();
      REQUIRE(nb == 10);
      const auto perm = first.model->permutation(0, 1);
      CHECK(perm == second.model->permutation(0, 1));
      for (std::int64_t j = 0; j < nb && !causal; ++j) {
        double column = 0;
        for (std::int64_t i = 0; i < nb; ++i) column += perm[i * nb + j];
        CHECK(std::fabs(column - 1.0) < 1e-4);
      }
      for (std::int64_t i = 0; i < nb && causal; ++i) {
        double row = 0, future = 0;
        for (std::int64_t j = 0; j < nb; ++j) (j < i ? row : future) += perm[i * nb + j];
        CHECK(future == 0.0);
        CHECK(std::fabs(row - (i > 0 ? 1.0 : 0.0)) < 1e-5);
      }
    }
  }

  TEST_CASE("causal learnable patterns: changing future tokens changes no earlier output") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 333, .head_dim = 16, .causal = true};
    check_future_invariance<ReformerAttention>("reformer", p, {"chunk_len=16", "n_buckets=4", "n_rounds=2"}, 150);
    check_future_invariance<ReformerAttention>("reformer", p, {}, 200);
    check_future_invariance<RoutingAttention>("routing", p, {}, 150);
    check_future_invariance<RoutingAttention>("routing", p, {"kmeans_updates=5", "clusters=8"}, 150);
    check_future_invariance<SinkhornAttention>("sinkhorn", p, {}, 150);
    check_future_invariance<SinkhornAttention>("sinkhorn", p, {"block=16"}, 200);
  }

  TEST_CASE("counters: FLOPs and tracked memory grow sub-quadratically with N") {
    struct Expect {
      const char* model;
      double flops_lo, flops_hi, memory_hi;  // bounds on the ratio between N = 4096 and N = 2048
    };
    // reformer O(N); routing O(N·√N); sinkhorn O(N·b) attention plus O(N²/b) soft-permutation mixing.
    for (bool causal : {false, true}) {
      const auto vanilla = run_point(counter_point("vanilla", 4096, causal));
      for (const Expect& e :
           {Expect{"reformer", 1.9, 2.1, 2.1}, Expect{"routing", 2.6, 3.0, 2.9}, Expect{"sinkhorn", 2.1, 3.0, 2.1}}) {
        const auto small = run_point(counter_point(e.model, 2048, causal));
        const auto large = run_point(counter_point(e.model, 4096, causal));
        CAPTURE(e.model);
        CAPTURE(causal);
        const double flops = double(large.flops) / double(small.flops);
        const double memory = double(large.peak_tensor_bytes) / double(small.peak_tensor_bytes);
        CHECK(flops > e.flops_lo);
        CHECK(flops < e.flops_hi);
        CHECK(memory < e.memory_hi);
        CHECK(large.flops < vanilla.flops);
        CHECK(large.peak_tensor_bytes < vanilla.peak_tensor_bytes / 4);
      }
    }
  }

  TEST_CASE("the routing step and the attention are timed as separate stages within the call") {
    for (const char* model : {"reformer", "routing", "sinkhorn"})
      for (bool causal : {false, true})
        for (Scope scope : {Scope::Attention, Scope::Layer}) {
          PointConfig config = counter_point(model, 1000, causal);
          config.scope = scope;
          const ResultRow row = run_point(config);
          CAPTURE(model);
          CAPTURE(causal);
          REQUIRE(row.samples_ns.size() == 1);
          REQUIRE(row.stage_median_ns.size() == 2);
          const double route = row.stage_median_ns.at("route"), attend = row.stage_median_ns.at("attend");
          CHECK(route > 0);
          CHECK(attend > 0);
          CHECK(route + attend <= row.samples_ns[0]);  // one call: its stages lie inside its window
        }
    CHECK(run_point(counter_point("vanilla", 100)).stage_median_ns.empty());
  }
}
