// Tracker, tensors, RNG, statistics, parameters, sweep argument parsing and the registry.
#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "apps/bench/sweep.hpp"
#include "lib/core/decimal.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/params.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stats.hpp"
#include "lib/core/tensor.hpp"
#include "taxonomy/registry.hpp"

using namespace xfb;

TEST_SUITE("core") {
  TEST_CASE("tracker records current and peak bytes; tensors are 64-byte aligned") {
    auto& tracker = MemoryTracker::instance();
    const auto base = tracker.current_bytes();
    tracker.reset_peak();
    {
      Tensor a(Shape{3, 5});
      CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 64 == 0);
      CHECK(tracker.current_bytes() == base + 60);
      {
        Tensor b(Shape{100});
        CHECK(tracker.current_bytes() == base + 460);
      }
      Tensor c = a.clone();
      CHECK(tracker.current_bytes() == base + 120);
      Tensor moved = std::move(c);
      CHECK(tracker.current_bytes() == base + 120);
    }
    CHECK(tracker.current_bytes() == base);
    CHECK(tracker.peak_bytes() == base + 460);
  }

  TEST_CASE("tensor shapes and head views") {
    Tensor t = Tensor::bhnd(2, 3, 4, 5);
    CHECK(t.size() == 120);
    CHECK(t.head(1, 2) - t.data() == (1 * 3 + 2) * 20);
    CHECK(shape_string(t.shape()) == "[2,3,4,5]");
    CHECK_THROWS(Tensor(Shape{2, -1}));
  }

  TEST_CASE("rng: same seed gives bit-identical fills whatever the thread count") {
    Tensor one(Shape{10007}), two(Shape{10007}), other(Shape{10007});
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    CounterRng(5, "x").fill_normal(one);
    omp_set_num_threads(2);
    CounterRng(5, "x").fill_normal(two);
    CounterRng(6, "x").fill_normal(other);
    omp_set_num_threads(threads);
    CHECK(std::memcmp(one.data(), two.data(), static_cast<std::size_t>(one.bytes())) == 0);
    CHECK(std::memcmp(one.data(), other.data(), static_cast<std::size_t>(one.bytes())) != 0);
    double mean = 0, square = 0;
    for (float v : one.values()) {
      mean += v;
      square += static_cast<double>(v) * v;
    }
    mean /= one.size();
    square /= one.size();
    CHECK(std::fabs(mean) < 0.05);
    CHECK(std::fabs(square - 1.0) < 0.05);
    const CounterRng rng(1, "u");
    for (std::uint64_t i = 0; i < 1000; ++i) {
      CHECK(rng.uniform(i) > 0.0);
      CHECK(rng.uniform(i) < 1.0);
    }
  }

  TEST_CASE("statistics on known data") {
    CHECK(median_of({1, 2, 3, 4}) == 2.5);
    CHECK(median_of({5, 1, 3}) == 3);
    const auto s = summarize({1, 2, 3, 4, 100});
    CHECK(s.median == 3);
    CHECK(s.min == 1);
    CHECK(s.max == 100);
    CHECK(s.mad == 1);  // deviations 2,1,0,1,97 → median 1
    CHECK(s.mean == doctest::Approx(22));
    CHECK(s.stddev == doctest::Approx(std::sqrt(7610.0 / 4)).epsilon(1e-12));  // squares 441+400+361+324+6084
    CHECK(s.cv == doctest::Approx(std::sqrt(7610.0 / 4) / 22).epsilon(1e-12));
    const auto flat = summarize({7, 7, 7});
    CHECK(flat.cv == 0);
    CHECK(flat.mad == 0);
    CHECK(summarize({4}).stddev == 0);
  }

  TEST_CASE("decimal numbers: whole plain decimals; subnormals are numbers, overflow and hex are not") {
    CHECK(parse_decimal("0.05") == 0.05);
    CHECK(parse_decimal("-3") == -3.0);
    CHECK(parse_decimal("1E+3") == 1000.0);
    CHECK(parse_decimal("1e-320") == 1e-320);  // subnormal: from_chars alone reports it out of range
    CHECK(parse_decimal("4.9406564584124654e-324") == std::numeric_limits<double>::denorm_min());
    CHECK(parse_decimal("1e-400") == 0.0);  // below the smallest subnormal: rounds to zero
    CHECK(parse_decimal("1.7976931348623157e308") == std::numeric_limits<double>::max());
    for (const char* bad : {"", "1e400", "-1e400", "inf", "nan", "0x10", "0x1p-2", "+1", " 1", "1 ", "1,5", "1%", "."})
      CHECK_MESSAGE(!parse_decimal(bad), bad);
  }

  TEST_CASE("parameters: defaults, overrides, types, ranges, unknown names") {
    const std::vector<ParamSpec> specs = {
        {"block", ParamType::Int, "64", 1, 4096, {}, "tokens"},
        {"temperature", ParamType::Float, "0.75", 0.01, 10, {}, "unitless"},
        {"shared", ParamType::Bool, "false", 0, 0, {}, ""},
        {"mode", ParamType::Choice, "split", 0, 0, {"local", "compressed", "split"}, ""},
    };
    const auto defaults = resolve_params("m", specs, {});
    CHECK(defaults.get_int("block") == 64);
    CHECK(defaults.get_float("temperature") == 0.75);
    CHECK_FALSE(defaults.get_bool("shared"));
    CHECK(defaults.get_choice("mode") == "split");
    const auto set = resolve_params("m", specs, {"block=128", "mode=local", "shared=true", "temperature=2"});
    CHECK(set.get_int("block") == 128);
    CHECK(set.get_choice("mode") == "local");
    CHECK(set.get_bool("shared"));
    CHECK(set.to_strings() == std::vector<std::string>{"block=128", "mode=local", "shared=true", "temperature=2"});
    CHECK_THROWS_AS(resolve_params("m", specs, {"block=0"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"block=12x"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"block=1.5"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"temperature=nan"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"mode=other"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"shared=maybe"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"nope=1"}), InputError);
    CHECK_THROWS_AS(resolve_params("m", specs, {"block"}), InputError);
  }

  TEST_CASE("sweep arguments: sequence lengths and model selections") {
    CHECK(parse_seq_lens("256,512,1000") == std::vector<std::int64_t>{256, 512, 1000});
    CHECK(parse_seq_lens("256:4096:x2") == std::vector<std::int64_t>{256, 512, 1024, 2048, 4096});
    CHECK(parse_seq_lens("1000:4000:+1000") == std::vector<std::int64_t>{1000, 2000, 3000, 4000});
    for (const char* bad : {"", "0", "-5", "abc", "256:128:x2", "256:512:x1", "256:512:2", "1,,2", "1:2"})
      CHECK_THROWS_AS(parse_seq_lens(bad), InputError);
    const auto all = parse_model_selection("all");
    CHECK(std::find(all.begin(), all.end(), "vanilla") != all.end());
    for (const auto& name : all) CHECK(find_model(name)->implemented());
    CHECK(parse_model_selection("vanilla,exact-tiled").size() == 2);
    CHECK(parse_model_selection("class:exact").size() >= 2);
    CHECK_THROWS_AS(parse_model_selection("nosuch"), InputError);
    CHECK_THROWS_AS(parse_model_selection("class:nosuch"), InputError);
    CHECK(params_for_model("exact-tiled", {"block_q=32", "vanilla.x=1", "exact-tiled.block_k=64"}) ==
          std::vector<std::string>{"block_q=32", "block_k=64"});
    CHECK(params_for_model("vanilla", {"block_q=32"}).empty());
  }

  TEST_CASE("registry: the cards in their order, each with its implementation") {
    const auto& cards = model_cards();
    REQUIRE(cards.size() == registry().size());
    for (std::size_t i = 0; i < cards.size(); ++i) {
      CAPTURE(cards[i].name);
      CHECK(registry()[i].name == cards[i].name);
      CHECK(registry()[i].decode_cost == cards[i].decode_cost);
      CHECK(registry()[i].implemented() == cards[i].has_implementation);
      CHECK(find_card(cards[i].name) == &cards[i]);
    }
    CHECK(find_card("nosuch") == nullptr);
  }

  TEST_CASE("registry: the revision's models with its Table 1's classes, complexity and decode column") {
    struct Expect {
      const char* name;
      const char* complexity;
      bool survey_decodes;  // the revision's Decode mark
      std::vector<ModelClass> classes;
    };
    using C = ModelClass;
    // arXiv 2009.06732v3, Table 1 (../shared/SURVEY.md, "Added in the revision").
    const Expect expected[] = {
        {"funnel", "O(N²)", true, {C::FixedPatterns, C::Downsampling}},
        {"rfa", "O(N)", true, {C::Kernels}},
        {"long-short", "O(kN)", true, {C::FixedPatterns, C::LowRank}},
        {"poolingformer", "O(N)", false, {C::FixedPatterns, C::Memory}},
        {"nystromformer", "O(kN)", false, {C::Memory, C::Downsampling}},
        {"perceiver", "O(kN)", true, {C::Memory, C::Downsampling}},
        {"cluster-former", "O(N log N)", false, {C::LearnablePatterns}},
        {"luna", "O(kN)", true, {C::Memory}},
        {"tokenlearner", "O(k²)", false, {C::Downsampling}},
        {"adaptive-sparse", "O(N²)", true, {C::Sparse}},
        {"switch", "O(N²)", true, {C::Sparse}},
        {"gshard", "O(N²)", true, {C::Sparse}},
    };
    int revision_models = 0;
    for (const auto& m : registry()) revision_models += m.revision ? 1 : 0;
    CHECK(revision_models == static_cast<int>(std::size(expected)));
    for (const auto& e : expected) {
      CAPTURE(e.name);
      const ModelInfo* m = find_model(e.name);
      REQUIRE(m != nullptr);
      CHECK(m->revision);
      CHECK(m->survey_row == 0);
      CHECK(m->complexity == e.complexity);
      CHECK(m->classes == e.classes);
      CHECK(m->implemented());
      // Where xfbench's decode differs from the mark, the card says why (Funnel).
      CHECK((m->decodes() == e.survey_decodes || !m->decode_note.empty()));
    }
  }

  TEST_CASE("registry: the survey's Table 1 with its classes, complexity and decode column") {
    std::set<int> rows;
    for (const auto& m : registry())
      if (m.survey_row > 0) rows.insert(m.survey_row);
    CHECK(rows.size() == 17);
    CHECK(*rows.begin() == 1);
    CHECK(*rows.rbegin() == 17);
    struct Expect {
      const char* name;
      const char* complexity;
      bool decodes;
      std::vector<ModelClass> classes;
    };
    using C = ModelClass;
    const Expect expected[] = {
        {"memory-compressed", "O(N_c²)", true, {C::FixedPatterns, C::Memory}},
        {"set-transformer", "O(kN)", false, {C::Memory}},
        {"transformer-xl", "O(N²)", true, {C::Recurrence}},
        {"sparse-transformer", "O(N√N)", true, {C::FixedPatterns}},
        {"reformer", "O(N log N)", true, {C::LearnablePatterns}},
        {"sinkhorn", "O(B²)", true, {C::LearnablePatterns}},
        {"etc", "O(N_g² + N·N_g)", false, {C::FixedPatterns, C::Memory}},
        {"synthesizer", "O(N²)", true, {C::LowRank, C::LearnablePatterns}},
        {"linformer", "O(N)", false, {C::LowRank}},
        {"bigbird", "O(N)", false, {C::FixedPatterns, C::Memory}},
    };
    for (const auto& e : expected) {
      const ModelInfo* m = find_model(e.name);
      REQUIRE(m != nullptr);
      CHECK(m->complexity == e.complexity);
      CHECK(m->decodes() == e.decodes);
      CHECK(m->classes == e.classes);
    }
    for (const auto& m : registry()) {
      CHECK(m.implemented());
      CAPTURE(m.name);
      // The card's decode cost is the one statement of decoding: the implementation's decode
      // contract follows it, and every implementation has its training step.
      CHECK(m.impl.has_decode() == m.decodes());
      CHECK(m.impl.has_backward());
      CHECK((m.impl.flops != nullptr));
      CHECK((m.impl.workspace_bytes != nullptr));
      for (const auto& spec : m.impl.params) CHECK_FALSE(spec.help.empty());
      CHECK_NOTHROW(resolve_params(m.name, m.impl.params, {}));
    }
  }
}
