// The mixture-of-experts FFN of the layer (`--ffn switch|gshard`, the `switch` and `gshard` cards): the
// routing against an independent recomputation (capacity in row order, first choices before second
// ones, drops), the output against a double reference with the same routing, capacity edge cases
// (exactly full, one over, everything to one expert), GShard's renormalised gates and priority, the
// aux loss and every gradient by central differences with the routing held fixed, the whole encoder
// layer's gradients with the MoE in place (against a double layer with the same routing), the executed
// FLOPs and tracked bytes against the formulas, and the layer points (rows, unsupported, errors).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "taxonomy/layer/moe_ffn.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/layer_reference.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kEps = std::numeric_limits<float>::epsilon();

MoeSettings settings(FfnKind kind, std::int64_t experts, double cf, std::int64_t group = 0) {
  return {.kind = kind, .experts = experts, .capacity_factor = cf, .group_size = group};
}

Tensor seeded(Shape shape, const char* stream, std::uint64_t seed = 3) {
  Tensor t(std::move(shape));
  CounterRng(seed, stream).fill_normal(t);
  return t;
}

const Tensor& named(const std::vector<NamedTensor>& all, const std::string& name) {
  for (const auto& t : all)
    if (t.name == name) return *t.tensor;
  FAIL("no tensor " << name);
  throw std::logic_error(name);
}
Tensor& parameter(MoeFfn& moe, const std::string& name) { return const_cast<Tensor&>(named(moe.parameters(), name)); }

// The routing of a forward, as MoeFfn exposes it (choice, slot, gate per row and choice).
struct Routing {
  std::vector<std::int64_t> choice, slot;
  std::vector<double> gate;
};
Routing routing_of(const MoeFfn& moe) {
  const auto all = moe.parameters();
  const Tensor &c = named(all, "moe_choice"), &s = named(all, "moe_slot"), &g = named(all, "moe_gate");
  Routing r;
  for (std::int64_t i = 0; i < c.size(); ++i) {
    r.choice.push_back(static_cast<std::int64_t>(c[i]));
    r.slot.push_back(static_cast<std::int64_t>(s[i]));
    r.gate.push_back(g[i]);
  }
  return r;
}

// Everything of the layer's MoE in double, on a [T, d] input with the weights of `moe`.
struct Reference {
  const MoeSettings s;
  std::int64_t t, d, f, x, k;
  std::vector<double> w_router, w_1, w_2, draw;

  Reference(const MoeSettings& settings_, const MoeFfn& moe, std::int64_t rows, std::int64_t width, std::int64_t d_ff)
      : s(settings_), t(rows), d(width), f(d_ff), x(settings_.experts), k(ffn_top_k(settings_.kind)) {
    auto doubles = [&](const std::string& name) {
      const Tensor& w = named(moe.parameters(), name);
      return std::vector<double>(w.values().begin(), w.values().end());
    };
    w_router = doubles("moe_w_router");
    w_1 = doubles("moe_w_1");
    w_2 = doubles("moe_w_2");
    if (k == 2) draw = doubles("moe_second_draw");
  }

  std::vector<double> probabilities(const std::vector<double>& a) const {
    std::vector<double> p(t * x, 0.0);
    for (std::int64_t r = 0; r < t; ++r) {
      double peak = -1e300, sum = 0;
      for (std::int64_t e = 0; e < x; ++e) {
        double z = 0;
        for (std::int64_t i = 0; i < d; ++i) z += a[r * d + i] * w_router[i * x + e];
        p[r * x + e] = z;
        peak = std::max(peak, z);
      }
      for (std::int64_t e = 0; e < x; ++e) sum += p[r * x + e] = std::exp(p[r * x + e] - peak);
      for (std::int64_t e = 0; e < x; ++e) p[r * x + e] /= sum;
    }
    return p;
  }

  // The capacity pass recomputed from the choices and gates: slots (−1 dropped) in row order per group,
  // first choices before second ones, a second choice drawn when u < g₂/0.2.
  std::vector<std::int64_t> slots(const std::vector<std::int64_t>& choice, const std::vector<double>& gate) const {
    std::vector<std::int64_t> slot(t * k, -1), count(x, 0);
    const std::int64_t size = s.group_size > 0 ? std::min(s.group_size, t) : t;
    for (std::int64_t begin = 0; begin < t; begin += size) {
      const std::int64_t end = std::min(t, begin + size), rows = end - begin;
      const std::int64_t cap = std::min(
          rows, std::max<std::int64_t>(4, static_cast<std::int64_t>(std::floor(k * rows * s.capacity_factor / x))));
      std::vector<std::int64_t> taken(x, 0);
      for (std::int64_t j = 0; j < k; ++j)
        for (std::int64_t r = begin; r < end; ++r) {
          const std::int64_t e = choice[r * k + j];
          const bool drawn = j == 0 || draw[r] < gate[r * k + j] / 0.2;
          if (drawn && taken[e] < cap) {
            ++taken[e];
            slot[r * k + j] = count[e]++;
          }
        }
    }
    return slot;
  }

  // The routing exact arithmetic gives from probabilities p: the choices (the largest, ties to the lower
  // index), the capacity pass's slots; `gate` holds the gates before capacity.
  Routing routing(const std::vector<double>& p) const {
    Routing r{std::vector<std::int64_t>(t * k), {}, std::vector<double>(t * k)};
    for (std::int64_t row = 0; row < t; ++row) {
      const double* q = &p[row * x];
      std::int64_t first = 0, second = -1;
      for (std::int64_t e = 1; e < x; ++e)
        if (q[e] > q[first]) first = e;
      for (std::int64_t e = 0; e < x && k == 2; ++e)
        if (e != first && (second < 0 || q[e] > q[second])) second = e;
      r.choice[row * k] = first;
      r.gate[row * k] = k == 1 ? q[first] : q[first] / (q[first] + q[second]);
      if (k == 2) {
        r.choice[row * k + 1] = second;
        r.gate[row * k + 1] = q[second] / (q[first] + q[second]);
      }
    }
    r.slot = slots(r.choice, r.gate);
    return r;
  }

  // The gates of the given routing from probabilities p (dropped: 0).
  std::vector<double> gates(const std::vector<double>& p, const Routing& route) const {
    std::vector<double> g(t * k, 0.0);
    for (std::int64_t r = 0; r < t; ++r) {
      const double p1 = p[r * x + route.choice[r * k]];
      const double p2 = k == 2 ? p[r * x + route.choice[r * k + 1]] : 0;
      for (std::int64_t j = 0; j < k; ++j) {
        if (route.slot[r * k + j] < 0) continue;
        g[r * k + j] = k == 1 ? p1 : (j == 0 ? p1 : p2) / (p1 + p2);
      }
    }
    return g;
  }

  std::vector<double> expert(std::int64_t e, const double* row) const {
    std::vector<double> hidden(f, 0.0), out(d, 0.0);
    for (std::int64_t c = 0; c < f; ++c) {
      double z = 0;
      for (std::int64_t i = 0; i < d; ++i) z += row[i] * w_1[(e * d + i) * f + c];
      hidden[c] = 0.5 * z * (1 + std::erf(z / std::sqrt(2.0)));
    }
    for (std::int64_t i = 0; i < d; ++i)
      for (std::int64_t c = 0; c < f; ++c) out[i] += hidden[c] * w_2[(e * f + c) * d + i];
    return out;
  }

  // moe(a) with the routing held fixed (gates recomputed from a).
  std::vector<double> output(const std::vector<double>& a, const Routing& route) const {
    const auto g = gates(probabilities(a), route);
    std::vector<double> y(t * d, 0.0);
    for (std::int64_t r = 0; r < t; ++r)
      for (std::int64_t j = 0; j < k; ++j) {
        if (route.slot[r * k + j] < 0) continue;
        const auto out = expert(route.choice[r * k + j], &a[r * d]);
        for (std::int64_t i = 0; i < d; ++i) y[r * d + i] += g[r * k + j] * out[i];
      }
    return y;
  }

  // 0.01 · mean over groups of X·Σ_i f_i·P_i, f from the (fixed) first choices.
  double aux_loss(const std::vector<double>& a, const Routing& route) const {
    const auto p = probabilities(a);
    const std::int64_t size = s.group_size > 0 ? std::min(s.group_size, t) : t;
    double loss = 0;
    std::int64_t groups = 0;
    for (std::int64_t begin = 0; begin < t; begin += size, ++groups) {
      const std::int64_t end = std::min(t, begin + size), rows = end - begin;
      for (std::int64_t e = 0; e < x; ++e) {
        double fraction = 0, mean = 0;
        for (std::int64_t r = begin; r < end; ++r) {
          fraction += route.choice[r * k] == e ? 1.0 / rows : 0.0;
          mean += p[r * x + e] / rows;
        }
        loss += x * fraction * mean;
      }
    }
    return 0.01 * loss / groups;
  }
};

std::vector<double> doubles(const Tensor& t) { return {t.values().begin(), t.values().end()}; }

// One forward of a fresh MoE on a; y starts at 0.
struct Run {
  MoeFfn moe;
  Tensor y;
  Run(const MoeSettings& s, const Tensor& a, std::int64_t f, bool training = false, bool run = true)
      : moe(s, a.dim(0), a.dim(1), f, kTestThreads, 11), y(Shape{a.dim(0), a.dim(1)}) {
    if (training) moe.prepare_training();
    if (run) moe.forward(a.data(), y.data());
  }
};

// Router weights W_r = scale·[I; 0] (d ≥ X) so that a row a = basis vector i routes to expert i.
void identity_router(MoeFfn& moe, std::int64_t d, std::int64_t x, float scale) {
  Tensor& w = parameter(moe, "moe_w_router");
  w.fill(0.0f);
  for (std::int64_t i = 0; i < std::min(d, x); ++i) w[i * x + i] = scale;
}

// Rows a_t = basis vector experts_of[t] (width d).
Tensor basis_rows(const std::vector<std::int64_t>& experts_of, std::int64_t d) {
  Tensor a(Shape{static_cast<std::int64_t>(experts_of.size()), d});
  for (std::size_t t = 0; t < experts_of.size(); ++t) a[static_cast<std::int64_t>(t) * d + experts_of[t]] = 1.0f;
  return a;
}

void check_against_reference(const MoeSettings& s, std::int64_t t, std::int64_t d, std::int64_t f) {
  const Tensor a = seeded(Shape{t, d}, "test/moe_a");
  Run run(s, a, f);
  Reference ref(s, run.moe, t, d, f);
  const Routing route = routing_of(run.moe);
  const auto p = ref.probabilities(doubles(a));
  const std::int64_t k = ref.k, x = ref.x;
  // Choices: the largest probabilities (within float rounding of the runner-up), and the gates.
  for (std::int64_t r = 0; r < t; ++r) {
    std::vector<double> row(p.begin() + r * x, p.begin() + (r + 1) * x);
    std::vector<double> sorted = row;
    std::sort(sorted.rbegin(), sorted.rend());
    for (std::int64_t j = 0; j < k; ++j) CHECK(row[route.choice[r * k + j]] >= sorted[j] - 16 * kEps);
    if (k == 2) CHECK(route.choice[r * k] != route.choice[r * k + 1]);
  }
  // Capacity: the slots recomputed from the choices and the mechanism's own (undropped) gates.
  std::vector<double> raw_gate(t * k);
  for (std::int64_t r = 0; r < t; ++r) {
    const double p1 = p[r * x + route.choice[r * k]], p2 = k == 2 ? p[r * x + route.choice[r * k + 1]] : 0;
    for (std::int64_t j = 0; j < k; ++j) raw_gate[r * k + j] = k == 1 ? p1 : (j == 0 ? p1 : p2) / (p1 + p2);
  }
  CHECK(ref.slots(route.choice, raw_gate) == route.slot);
  const auto gates = ref.gates(p, route);
  std::int64_t dropped = 0, routed = 0;
  for (std::int64_t r = 0; r < t; ++r) {
    bool kept = false;
    for (std::int64_t j = 0; j < k; ++j) {
      CHECK(route.gate[r * k + j] == doctest::Approx(gates[r * k + j]).epsilon(8 * kEps));
      kept = kept || route.slot[r * k + j] >= 0;
      routed += route.slot[r * k + j] >= 0;
    }
    dropped += kept ? 0 : 1;
  }
  CHECK(run.moe.tokens_dropped() == dropped);
  CHECK(run.moe.routed_pairs() == routed);
  // Output: fp32 products of length d and F, GELU, at most two terms.
  const auto y = ref.output(doubles(a), route);
  double scale = 0;
  for (double v : y) scale = std::max(scale, std::abs(v));
  const double tolerance = 8 * kEps * static_cast<double>(d + f) * std::max(1.0, scale);
  for (std::int64_t i = 0; i < t * d; ++i) REQUIRE(std::abs(run.y[i] - y[i]) <= tolerance);
  CHECK(run.moe.aux_loss() == doctest::Approx(ref.aux_loss(doubles(a), route)).epsilon(64 * kEps));
}

}  // namespace

TEST_SUITE("moe") {
  TEST_CASE("moe: Switch and GShard against a double reference with the same routing, at awkward sizes") {
    for (FfnKind kind : {FfnKind::Switch, FfnKind::Gshard})
      for (std::int64_t t : {1, 7, 37, 130})
        for (std::int64_t group : {0, 16, 17}) {
          CAPTURE(ffn_name(kind));
          CAPTURE(t);
          CAPTURE(group);
          check_against_reference(settings(kind, 5, 1.0, group), t, 12, 20);
        }
    // A tight capacity (many drops) and a generous one (none).
    check_against_reference(settings(FfnKind::Switch, 4, 0.5), 90, 8, 16);
    check_against_reference(settings(FfnKind::Gshard, 3, 4.0), 90, 8, 16);
  }

  TEST_CASE("moe: capacity exactly full, one over, and everything to one expert (Switch)") {
    const std::int64_t d = 8, x = 4, f = 8;
    const MoeSettings s = settings(FfnKind::Switch, x, 1.0);  // 16 rows: C = max(4, 16·1/4) = 4
    CHECK(MoeFfn::capacity(s, 16) == 4);
    CHECK(MoeFfn::capacity(s, 3) == 3);  // never above the group
    auto route = [&](const std::vector<std::int64_t>& experts_of) {
      const Tensor a = basis_rows(experts_of, d);
      auto run = std::make_unique<Run>(s, a, f, false, false);
      identity_router(run->moe, d, x, 20.0f);
      run->moe.forward(a.data(), run->y.data());
      return run;
    };
    std::vector<std::int64_t> even;
    for (std::int64_t t = 0; t < 16; ++t) even.push_back(t % x);
    const auto full = route(even);
    CHECK(full->moe.tokens_dropped() == 0);
    CHECK(full->moe.expert_counts() == std::vector<std::int64_t>{4, 4, 4, 4});
    CHECK(full->moe.expert_load() == doctest::Approx(1.0));

    std::vector<std::int64_t> over = even;
    over[15] = 0;  // expert 0 gets a fifth row, the last in row order: dropped; expert 3 has 3
    const auto one_over = route(over);
    CHECK(one_over->moe.tokens_dropped() == 1);
    CHECK(one_over->moe.expert_counts() == std::vector<std::int64_t>{4, 4, 4, 3});
    CHECK(routing_of(one_over->moe).slot[15] == -1);
    for (std::int64_t i = 0; i < d; ++i) CHECK(one_over->y[15 * d + i] == 0.0f);  // residual only

    const auto all_one = route(std::vector<std::int64_t>(16, 2));
    CHECK(all_one->moe.tokens_dropped() == 12);
    CHECK(all_one->moe.expert_counts() == std::vector<std::int64_t>{0, 0, 4, 0});
    CHECK(all_one->moe.expert_load() == doctest::Approx(4.0));
    const Routing r = routing_of(all_one->moe);
    for (std::int64_t t = 0; t < 16; ++t) CHECK(r.slot[t] == (t < 4 ? t : -1));  // the first four rows win
  }

  TEST_CASE("moe: GShard's gates sum to 1 and first choices take capacity before second ones") {
    const std::int64_t d = 8, x = 4, f = 8, t = 16;
    const MoeSettings s = settings(FfnKind::Gshard, x, 0.5);  // C = max(4, ⌊2·16·0.5/4⌋) = 4
    CHECK(MoeFfn::capacity(s, t) == 4);
    // Rows 0..3: first expert 1, second expert 0 (logits 20 and 19.5: g₂ ≈ 0.38 > 0.2, always drawn);
    // rows 4..15: first expert 0 (second expert 1). Expert 0's capacity goes to rows 4..7's first choices.
    Tensor a(Shape{t, d});
    for (std::int64_t r = 0; r < t; ++r) {
      const bool early = r < 4;
      a[r * d + (early ? 1 : 0)] = 1.0f;
      a[r * d + (early ? 0 : 1)] = 0.975f;
    }
    Run run(s, a, f, false, false);
    identity_router(run.moe, d, x, 20.0f);
    run.moe.forward(a.data(), run.y.data());
    const Routing r = routing_of(run.moe);
    for (std::int64_t row = 0; row < t; ++row) {
      CAPTURE(row);
      CHECK(r.choice[row * 2] == (row < 4 ? 1 : 0));
      CHECK(r.choice[row * 2 + 1] == (row < 4 ? 0 : 1));
      const bool first_kept = r.slot[row * 2] >= 0, second_kept = r.slot[row * 2 + 1] >= 0;
      CHECK(first_kept == (row < 8));                       // expert 1: rows 0..3; expert 0: rows 4..7
      CHECK(second_kept == false);                          // both experts are full with first choices
      const double p1 = 1 / (1 + std::exp(-0.5)), g1 = p1;  // renormalised over the two: σ(20 − 19.5)
      if (first_kept) CHECK(r.gate[row * 2] == doctest::Approx(g1).epsilon(1e-5));
    }
    CHECK(run.moe.tokens_dropped() == 8);
    // With room (cf 4: C = 16), every row keeps both and the gates sum to 1.
    Run roomy(settings(FfnKind::Gshard, x, 4.0), a, f, false, false);
    identity_router(roomy.moe, d, x, 20.0f);
    roomy.moe.forward(a.data(), roomy.y.data());
    const Routing both = routing_of(roomy.moe);
    for (std::int64_t row = 0; row < t; ++row) {
      CHECK(both.slot[row * 2 + 1] >= 0);
      CHECK(both.gate[row * 2] + both.gate[row * 2 + 1] == doctest::Approx(1.0).epsilon(4 * kEps));
    }
  }

  TEST_CASE("moe: the aux loss and every gradient against central differences, the routing held fixed") {
    for (const MoeSettings& s : {settings(FfnKind::Switch, 3, 1.0, 5), settings(FfnKind::Gshard, 4, 1.0)}) {
      CAPTURE(ffn_name(s.kind));
      const std::int64_t t = 11, d = 6, f = 7;
      const Tensor a = seeded(Shape{t, d}, "test/moe_a"), dy = seeded(Shape{t, d}, "test/moe_dy");
      Run run(s, a, f, true);
      Tensor da(Shape{t, d});
      run.moe.backward(a.data(), dy.data(), da.data());
      Reference ref(s, run.moe, t, d, f);
      const Routing route = routing_of(run.moe);
      const auto dy_d = doubles(dy);
      // ⟨dy, y⟩ + L in double, of the inputs and weights of `ref`.
      auto objective = [&](const Reference& r, const std::vector<double>& in) {
        const auto y = r.output(in, route);
        double total = r.aux_loss(in, route);
        for (std::size_t i = 0; i < y.size(); ++i) total += dy_d[i] * y[i];
        return total;
      };
      const auto a_d = doubles(a);
      const double h = 1e-5;
      auto check = [&](const char* name, const Tensor& grad, auto perturb) {
        CAPTURE(name);
        double largest = 0;
        for (std::int64_t i = 0; i < grad.size(); ++i) largest = std::max(largest, std::abs(double(grad[i])));
        const double tolerance = 64 * kEps * static_cast<double>(d + f) * std::max(1.0, largest) + 1e-7;
        for (std::int64_t i = 0; i < grad.size(); ++i) {
          const double numeric = (perturb(i, h) - perturb(i, -h)) / (2 * h);
          CAPTURE(i);
          REQUIRE(std::abs(grad[i] - numeric) <= tolerance);
        }
      };
      check("da", da, [&](std::int64_t i, double step) {
        auto in = a_d;
        in[i] += step;
        return objective(ref, in);
      });
      const auto grads = run.moe.parameter_gradients();
      for (const char* weight : {"moe_w_router", "moe_w_1", "moe_w_2"}) {
        const std::string name = weight;
        check(weight, named(grads, "d" + name), [&](std::int64_t i, double step) {
          Reference moved = ref;
          auto& w = name == "moe_w_router" ? moved.w_router : name == "moe_w_1" ? moved.w_1 : moved.w_2;
          w[i] += step;
          return objective(moved, a_d);
        });
      }
      // The aux loss alone: its gradient joins the router's (dy = 0 leaves only L).
      Tensor zero(Shape{t, d}), da_aux(Shape{t, d});
      run.moe.backward(a.data(), zero.data(), da_aux.data());
      double norm = 0;
      for (float v : named(run.moe.parameter_gradients(), "dmoe_w_router").values()) norm += std::abs(v);
      CHECK(norm > 0);
    }
  }

  TEST_CASE(
      "moe: the whole layer's gradients (dx, W_qkv, W_o, both LayerNorms, router, experts) against central "
      "differences of ⟨dy, y⟩ + L of the double layer, the routing held fixed") {
    // Vanilla attention (the switch and gshard cards' layer); E = 8, F = 6. A tight capacity that must drop
    // (pigeonhole: fewer slots than first choices) and a roomy one with groups (5, 5, 3) that drops none.
    struct Case {
      MoeSettings s;
      std::int64_t batch, n;
      bool drops;
    };
    const Case cases[] = {
        {settings(FfnKind::Switch, 4, 0.5), 2, 10, true},      // C = 4: 16 slots for 20 rows
        {settings(FfnKind::Gshard, 3, 0.5), 2, 10, true},      // C = 6: 18 slots for 20 first choices
        {settings(FfnKind::Switch, 4, 4.0, 5), 1, 13, false},  // C = S_g: room for every row
        {settings(FfnKind::Gshard, 3, 4.0, 5), 1, 13, false},
    };
    const std::int64_t f = 6, e = 8;
    for (const Case& c : cases) {
      const MoeSettings& s = c.s;
      const std::int64_t n = c.n, t = c.batch * n, k = ffn_top_k(s.kind);
      const std::string label = std::string(ffn_name(s.kind)) + " cf=" + std::to_string(s.capacity_factor) +
                                " B=" + std::to_string(c.batch) + " N=" + std::to_string(n);
      CAPTURE(label);
      const Problem p{.batch = c.batch, .heads = 2, .seq_len = n, .head_dim = 4, .threads = kTestThreads};
      const ModelInfo& info = *find_model("vanilla");
      auto mechanism = info.impl.create(p, resolve_params("vanilla", info.impl.params, {}), 5);
      EncoderLayer layer(p, f, n, true, 5, s);
      Tensor x(Shape{c.batch, n, e}), dy(Shape{c.batch, n, e}), y(Shape{c.batch, n, e}), dx(Shape{c.batch, n, e});
      CounterRng(5, "x").fill_normal(x);
      CounterRng(5, "dy").fill_normal(dy);
      randomise_layer_norms(layer);
      layer.prepare(*mechanism, x);
      layer.prepare_backward(*mechanism);
      layer.forward(*mechanism, x, y);
      REQUIRE(layer.moe() != nullptr);
      const MoeFfn& moe = *layer.moe();
      const Routing route = routing_of(moe);
      std::int64_t firsts_dropped = 0;
      for (std::int64_t r = 0; r < t; ++r) firsts_dropped += route.slot[r * k] < 0 ? 1 : 0;
      if (c.drops) {
        REQUIRE(firsts_dropped > 0);
      } else {
        REQUIRE(firsts_dropped == 0);
        REQUIRE(moe.tokens_dropped() == 0);
      }
      NamedValues inputs{{"x", std::vector<double>(x.data(), x.data() + x.size())}};
      std::map<std::string, const Tensor*> grads{{"x", &dx}};
      for (const auto& parameter : layer.parameters())
        for (const auto& gradient : layer.parameter_gradients())
          if (gradient.name == "d" + parameter.name) {
            inputs[parameter.name] = doubles(*parameter.tensor);
            grads[parameter.name] = gradient.tensor;
          }
      CHECK(grads.size() == 10);  // x, W_qkv, W_o, γ₁, β₁, γ₂, β₂, W_r, W₁, W₂
      // The layer in double with the forward's routing (choices, slots) held fixed, the gates recomputed;
      // L appended as one more output, so ⟨(dy, 1), (y, L)⟩ is the objective the backward differentiates.
      // `flips` counts the evaluations at which exact arithmetic would route otherwise.
      const Reference base(s, moe, t, e, f);
      std::int64_t flips = 0;
      const ModelReference reference = [&](const NamedValues& values) {
        Reference experts = base;
        experts.w_router = values.at("moe_w_router");
        experts.w_1 = values.at("moe_w_1");
        experts.w_2 = values.at("moe_w_2");
        double loss = 0;
        auto out = layer_reference(p, f, values, false, [&](const std::vector<double>& a, std::int64_t rows) {
          REQUIRE(rows == t);
          const Routing exact = experts.routing(experts.probabilities(a));
          flips += exact.choice != route.choice || exact.slot != route.slot ? 1 : 0;
          loss = experts.aux_loss(a, route);
          return experts.output(a, route);
        });
        out.push_back(loss);
        return out;
      };
      // Tolerance factors: the dense layer check's log2(N + 1) plus the MoE's own E + F.
      const double factor = std::log2(static_cast<double>(n) + 1) + static_cast<double>(e + f);
      // The fp32 routing is the exact one here (else the seed sits on a near tie), and the forward agrees.
      const auto want = reference(inputs);
      REQUIRE_MESSAGE(flips == 0, label << ": the fp32 routing differs from the exact one (a near tie)");
      double scale = 0;
      for (std::int64_t i = 0; i < t * e; ++i) scale = std::max(scale, std::abs(want[i]));
      for (std::int64_t i = 0; i < t * e; ++i)
        REQUIRE(std::abs(y[i] - want[i]) <= 8 * kEps * factor * std::max(1.0, scale));
      CHECK(moe.aux_loss() == doctest::Approx(want.back()).epsilon(8 * kEps * factor));
      // ⟨dy, y⟩ + L, and L alone (dy = 0): the aux loss's gradient is ~0.01 of the rest, below the first
      // check's tolerance, so the second checks it through the router, LN₂, attention and LN₁ by itself.
      Tensor weights(Shape{t * e + 1}), aux_only(Shape{t * e + 1}), zero(Shape{c.batch, n, e});
      std::copy(dy.data(), dy.data() + dy.size(), weights.data());
      weights[t * e] = 1.0f;
      aux_only[t * e] = 1.0f;
      layer.backward(*mechanism, x, dy, dx);
      check_against_differences(label + " <dy, y> + L", inputs, grads, weights, reference, factor, true);
      layer.backward(*mechanism, x, zero, dx);
      check_against_differences(label + " L alone", inputs, grads, aux_only, reference, factor, true);
      // No perturbation of either check changed the exact routing: the fixed-routing derivative checked is
      // the layer's own there.
      CHECK_MESSAGE(flips == 0, label << ": " << flips << " perturbed evaluations route otherwise (a near tie)");
    }
  }

  TEST_CASE("moe: executed FLOPs and tracked bytes equal the formulas; they scale with the routed rows") {
    for (const MoeSettings& s : {settings(FfnKind::Switch, 8, 1.25), settings(FfnKind::Gshard, 8, 1.25, 64)})
      for (std::int64_t t : {100, 200}) {
        CAPTURE(ffn_name(s.kind));
        CAPTURE(t);
        const std::int64_t d = 16, f = 32;
        const Tensor a = seeded(Shape{t, d}, "test/moe_a"), dy = seeded(Shape{t, d}, "test/moe_dy");
        auto& tracker = MemoryTracker::instance();
        const std::int64_t before = tracker.owned_current_bytes();
        Run run(s, a, f, false, false);
        CHECK(tracker.owned_current_bytes() - before == MoeFfn::workspace_bytes(s, t, d, f) + run.y.bytes());
        const std::int64_t setup = tracker.owned_current_bytes();
        run.moe.prepare_training();
        CHECK(tracker.owned_current_bytes() - setup == MoeFfn::backward_workspace_bytes(s, t, d, f));
        FlopCounter::reset();
        run.moe.forward(a.data(), run.y.data());
        const std::int64_t routed = run.moe.routed_pairs();
        CHECK(FlopCounter::total() == MoeFfn::flops(s, t, d, f, routed));
        Tensor da(Shape{t, d});
        FlopCounter::reset();
        run.moe.backward(a.data(), dy.data(), da.data());
        CHECK(FlopCounter::total() == MoeFfn::backward_flops(s, t, d, f, routed));
        // The routed tokens' work, not X dense FFNs: at most k·T pairs, each 4·d·F + 5·F + 2·d.
        CHECK(routed <= ffn_top_k(s.kind) * t);
        CHECK(MoeFfn::flops(s, t, d, f, routed) <
              (ffn_top_k(s.kind) + 1) * t * (4 * d * f + 5 * f + 2 * d + 2 * d * 8));
        // Buffers linear in T: the slots are ≈ k·cf·T per expert set.
        CHECK(MoeFfn::slots(s, t) * s.experts <=
              static_cast<std::int64_t>(ffn_top_k(s.kind) * 1.25 * t) + 4 * s.experts * MoeFfn::groups(s, t));
      }
  }

  TEST_CASE(
      "moe: the layer's executed FLOPs and bytes: the attention sublayer's, the mechanism's and the routed experts'") {
    for (FfnKind kind : {FfnKind::Switch, FfnKind::Gshard})
      for (std::int64_t n : {31, 64}) {
        CAPTURE(ffn_name(kind));
        CAPTURE(n);
        const MoeSettings s = settings(kind, 4, 1.0, 24);
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .threads = kTestThreads};
        const std::int64_t f = 24;
        const ModelInfo& info = *find_model("performer");
        const ParamValues params = resolve_params("performer", info.impl.params, {});
        auto& tracker = MemoryTracker::instance();
        Tensor x(Shape{2, n, 16}), y(Shape{2, n, 16}), dy(Shape{2, n, 16}), dx(Shape{2, n, 16});
        CounterRng(5, "x").fill_normal(x);
        CounterRng(5, "dy").fill_normal(dy);
        const std::int64_t before = tracker.owned_current_bytes();
        auto mechanism = info.impl.create(p, params, 5);
        EncoderLayer layer(p, f, n, true, 5, s);
        layer.prepare_training();
        layer.prepare(*mechanism, x);
        layer.prepare_backward(*mechanism);
        CHECK(tracker.owned_current_bytes() - before ==
              EncoderLayer::workspace_bytes(p, f, n, s) + EncoderLayer::backward_workspace_bytes(p, f, n, s) +
                  info.impl.workspace_bytes(p, params) + info.impl.backward_workspace_bytes(p, params));
        FlopCounter::reset();
        layer.forward(*mechanism, x, y);
        const std::int64_t routed = layer.moe()->routed_pairs();
        CHECK(FlopCounter::total() ==
              info.impl.flops(p, params) + EncoderLayer::flops_outside_mechanism(p, f, n, s, routed));
        FlopCounter::reset();
        layer.backward(*mechanism, x, dy, dx);
        CHECK(FlopCounter::total() ==
              info.impl.backward_flops(p, params) + EncoderLayer::backward_flops_outside_mechanism(p, f, n, s, routed));
        // The FFN's share is the routed rows' work: below the dense FFN's at k = 1 plus the router.
        const std::int64_t dense_ffn =
            EncoderLayer::flops_outside_mechanism(p, f, n) - EncoderLayer::flops_outside_mechanism(p, 0, n);
        const std::int64_t moe_ffn =
            EncoderLayer::flops_outside_mechanism(p, f, n, s, routed) - EncoderLayer::flops_outside_mechanism(p, 0, n);
        CHECK(moe_ffn <= ffn_top_k(kind) * (dense_ffn + 2 * n * 2 * 16 * 2) + 2 * 2 * n * 16 * 4 + 8 * 2 * n * 4);
      }
  }

  TEST_CASE("moe: layer points with --ffn and the switch/gshard cards; rows, unsupported rows and errors") {
    PointConfig c;
    c.problem = {.batch = 2, .heads = 2, .seq_len = 33, .head_dim = 8, .threads = kTestThreads};
    c.scope = Scope::Layer;
    c.timing = {.warmup = 1, .min_reps = 1, .min_time_s = 0, .max_reps = 1};
    for (const std::string model : {"switch", "gshard"}) {
      c.model = model;
      for (Pass pass : {Pass::Forward, Pass::Train}) {
        c.pass = pass;
        const ResultRow row = run_point(c);
        CAPTURE(model);
        REQUIRE(row.status == Status::Ok);
        CHECK(row.ffn == model);
        CHECK(row.experts == 8);
        CHECK(row.expert_load >= 1.0);
        CHECK(row.peak_owned_bytes - point_io_bytes(c) == row.estimated_workspace_bytes);  // exact: no scratchpad
      }
    }
    c.pass = Pass::Forward;
    c.model = "performer";
    c.ffn = settings(FfnKind::Gshard, 4, 0.5, 16);
    const ResultRow row = run_point(c);
    REQUIRE(row.status == Status::Ok);
    CHECK(row.model == "performer");
    CHECK(row.ffn == "gshard");
    CHECK(row.group_size == 16);
    CHECK(row.tokens_dropped >= 0);
    // The executed FLOPs: the mechanism's, the layer's attention sublayer and the routed experts'.
    c.problem.causal = true;
    c.model = "switch";
    c.ffn = {};
    CHECK(run_point(c).status == Status::Ok);  // causal: the FFN is per token
    c.problem.causal = false;
    c.scope = Scope::Attention;
    const ResultRow attention = run_point(c);
    CHECK(attention.status == Status::Unsupported);
    CHECK(attention.reason.find("run with --scope layer, or --ffn switch") != std::string::npos);
    c.ffn.kind = FfnKind::Switch;
    c.model = "vanilla";
    CHECK_THROWS_AS(resolve_point(c), InputError);  // --ffn in attention scope
    c.scope = Scope::Layer;
    c.ffn.experts = 1;
    c.ffn.kind = FfnKind::Gshard;
    CHECK_THROWS_AS(resolve_point(c), InputError);  // top-2 over one expert
    c.ffn = settings(FfnKind::Switch, 8, 0.0);
    CHECK_THROWS_AS(resolve_point(c), InputError);  // capacity factor 0
    c.model = "gshard";
    c.ffn = settings(FfnKind::Switch, 8, 1.25);
    CHECK_THROWS_AS(resolve_point(c), InputError);  // the card's FFN and another
  }
}
