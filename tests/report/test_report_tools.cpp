// Report tooling: statistics on textbook data, compare's verdicts and gates on doctored reports,
// sharding and merging, complexity fits, the LRA preset and table, SVG plots and the taxonomy.
#include <doctest/doctest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>

#include "apps/bench/ab.hpp"
#include "apps/bench/presets.hpp"
#include "apps/bench/sweep.hpp"
#include "apps/bench/system_info.hpp"
#include "apps/report/compare.hpp"
#include "apps/report/complexity.hpp"
#include "apps/report/lra.hpp"
#include "apps/report/merge.hpp"
#include "apps/report/plot.hpp"
#include "apps/report/table.hpp"
#include "apps/report/taxonomy_view.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/stats.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/svg_xml.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

ResultRow make_row(const std::string& model, std::int64_t n, std::vector<double> samples) {
  ResultRow row;
  row.model = model;
  const ModelInfo* info = find_model(model);
  if (info)
    for (auto c : info->classes) row.classes.push_back(class_name(c));
  row.batch = 1;
  row.heads = 2;
  row.seq_len = n;
  row.head_dim = 16;
  row.samples_ns = std::move(samples);
  row.median_ns = row.samples_ns.empty() ? 0 : median_of(row.samples_ns);
  row.flops = 1000 * n;
  row.peak_tensor_bytes = 4096 * n;
  row.workspace_bytes = 1024 * n;
  return row;
}

// Ten samples around `median` with a deterministic ±3% spread.
std::vector<double> noisy(double median) {
  std::vector<double> samples;
  for (int i = 0; i < 10; ++i) samples.push_back(median * (1 + 0.03 * std::sin(1.7 * i)));
  return samples;
}

Report report_of(std::vector<ResultRow> rows) {
  Report report;
  report.context = {{"cpu_model", "Test CPU"}, {"threads", 2}, {"onednn_version", "2.6.3"}, {"build_type", "Release"}};
  report.settings = {{"models", {"vanilla", "exact-tiled"}}, {"seq_lens", {64, 128, 256}}};
  report.results = std::move(rows);
  return report;
}

// Two-sided exact p-value by enumerating every split of the pooled values (independent of the
// library's counting recursion); ties get mid-ranks.
double brute_force_p(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> pooled = a;
  pooled.insert(pooled.end(), b.begin(), b.end());
  const auto ranks = average_ranks(pooled);
  double observed = 0;
  for (std::size_t i = 0; i < a.size(); ++i) observed += ranks[i];
  const std::size_t n = pooled.size();
  double all = 0, below = 0, above = 0;
  for (unsigned mask = 0; mask < (1u << n); ++mask) {
    if (static_cast<std::size_t>(__builtin_popcount(mask)) != a.size()) continue;
    double sum = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (mask & (1u << i)) sum += ranks[i];
    all += 1;
    below += sum <= observed + 1e-9;
    above += sum >= observed - 1e-9;
  }
  return std::min(1.0, 2 * std::min(below, above) / all);
}

const PointComparison& only_point(const Comparison& c) {
  REQUIRE(c.points.size() == 1);
  return c.points.front();
}

}  // namespace

TEST_SUITE("report_tools") {
  TEST_CASE("ab's dashboard exports leave out noisy and error points and contended rounds, and count them") {
    // Three clean rounds (B: 2, 3, 4 ms) and one where A was contended (B: 9 ms).
    auto point = [](const std::string& model, AbVerdict verdict) {
      AbPoint p;
      p.a.model = p.b.model = model;
      p.a.seq_len = p.b.seq_len = 64;
      p.rounds = {{false, 1e6, 2e6, false, false},
                  {true, 1e6, 3e6, false, false},
                  {false, 1e6, 4e6, false, false},
                  {true, 1e6, 9e6, true, false}};
      p.stats.ratio = 3;
      p.verdict = verdict;
      return p;
    };
    AbReport report;
    report.points = {point("vanilla", AbVerdict::Slower), point("local", AbVerdict::Noisy),
                     point("axial", AbVerdict::Error), point("performer", AbVerdict::Same)};
    AbDashboardOmissions omitted;
    const auto entries = ab_dashboard_entries(report, &omitted);
    REQUIRE(entries.size() == 2);
    CHECK(entries[0].name == dashboard_name(report.points[0].b));
    CHECK(entries[1].name == dashboard_name(report.points[3].b));
    for (const auto& entry : entries) {
      CHECK(entry.median_ns == 3e6);
      CHECK(entry.max_ns == 4e6);
    }
    CHECK(omitted.noisy == 1);
    CHECK(omitted.error == 1);
    CHECK(ab_omission_note(omitted) == "left out 2 A/B point(s): 1 noisy, 1 error; they have no trustworthy time");
    for (const AbFormat format : {AbFormat::GithubBenchmark, AbFormat::Bencher}) {
      const std::string exported = render_ab(report, format);
      CHECK(exported.find("vanilla N=64") != std::string::npos);
      CHECK(exported.find("local N=64") == std::string::npos);
      CHECK(exported.find("axial N=64") == std::string::npos);
    }
  }

  TEST_CASE("average ranks share tied positions") {
    CHECK(average_ranks({10, 20, 20, 5, 20}) == std::vector<double>{2, 4, 4, 1, 4});
    CHECK(average_ranks({}).empty());
  }

  TEST_CASE("Mann–Whitney U: exact distribution on textbook examples") {
    // Hollander & Wolfe (1973) p. 110, R's wilcox.test example: W = 35, one-sided p = 0.1272,
    // so two-sided p = 0.2544 (764 of C(15, 5) = 3003 splits).
    const std::vector<double> x = {0.80, 0.83, 1.89, 1.04, 1.45, 1.38, 1.91, 1.64, 0.73, 1.46};
    const std::vector<double> y = {1.15, 0.88, 0.90, 0.74, 1.21};
    const auto r = mann_whitney_u(x, y);
    CHECK(r.exact);
    CHECK(r.u_a == 35);
    CHECK(r.u_b == 15);
    CHECK(r.p_value == doctest::Approx(764.0 / 3003).epsilon(1e-12));
    // SciPy's documentation example: U = 17, p = 2·7/126.
    const auto s = mann_whitney_u({19, 22, 16, 29, 24}, {20, 11, 17, 12});
    CHECK(s.u_a == 17);
    CHECK(s.p_value == doctest::Approx(14.0 / 126).epsilon(1e-12));
    // Complete separation of 5 and 5: the smallest two-sided p, 2/C(10, 5).
    CHECK(mann_whitney_u({1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}).p_value == doctest::Approx(2.0 / 252));
    CHECK(mann_whitney_u({1, 2}, {3, 4}).p_value == doctest::Approx(2.0 / 6));
  }

  TEST_CASE("Mann–Whitney U: ties, exactly and by the normal approximation") {
    // a = {1,2,2,3}, b = {2,3,4,4,5}: mid-ranks 1 | 3 3 3 | 5.5 5.5 | 7.5 7.5 | 9, R_a = 12.5,
    // U_a = 2.5. Tie groups 3, 2, 2: Σ(t³ − t) = 36, σ² = 20/12 · (10 − 36/72) = 15.8333…,
    // z = (2.5 − 10 + 0.5)/σ = −1.759186…, p = erfc(|z|/√2) = 0.078545851…
    const std::vector<double> a = {1, 2, 2, 3}, b = {2, 3, 4, 4, 5};
    const auto normal = mann_whitney_u(a, b, UTestMethod::Normal);
    CHECK_FALSE(normal.exact);
    CHECK(normal.u_a == 2.5);
    CHECK(normal.z == doctest::Approx(-1.759186414825121).epsilon(1e-12));
    CHECK(normal.p_value == doctest::Approx(0.0785458509511907).epsilon(1e-12));
    const auto exact = mann_whitney_u(a, b, UTestMethod::Exact);
    CHECK(exact.p_value == doctest::Approx(brute_force_p(a, b)).epsilon(1e-12));
    // More ties and unequal sizes against enumeration.
    const std::vector<double> c = {3, 3, 1, 7, 7, 7}, d = {3, 7, 9, 9, 2, 3, 1};
    CHECK(mann_whitney_u(c, d).p_value == doctest::Approx(brute_force_p(c, d)).epsilon(1e-12));
    CHECK(mann_whitney_u(d, c).p_value == doctest::Approx(brute_force_p(d, c)).epsilon(1e-12));
    // Every value equal: no evidence, either way.
    CHECK(mann_whitney_u({5, 5, 5}, {5, 5}, UTestMethod::Normal).p_value == 1.0);
    CHECK(mann_whitney_u({5, 5, 5}, {5, 5}).p_value == 1.0);
    CHECK(mann_whitney_u({}, {1, 2}).p_value == 1.0);
  }

  TEST_CASE("Mann–Whitney U: the normal approximation approaches the exact p for larger samples") {
    std::vector<double> a, b;
    for (int i = 0; i < 20; ++i) {
      a.push_back(10 + std::sin(3.1 * i));
      b.push_back(10.5 + std::cos(2.3 * i));
    }
    const auto exact = mann_whitney_u(a, b, UTestMethod::Exact), normal = mann_whitney_u(a, b, UTestMethod::Normal);
    CHECK(exact.u_a == normal.u_a);
    CHECK(normal.p_value == doctest::Approx(exact.p_value).epsilon(0.05));
    a.push_back(11);  // 41 values in all: Auto stays exact up to kExactUTestMaxTotal = 50
    CHECK(mann_whitney_u(a, b).exact);
    for (int i = 0; i < 10; ++i) a.push_back(9 + 0.1 * i);
    CHECK_FALSE(mann_whitney_u(a, b).exact);
  }

  TEST_CASE("Spearman's ρ and the geometric mean on known values") {
    // SciPy's spearmanr example (with a tie): 0.8207826816681233.
    CHECK(spearman_rho({1, 2, 3, 4, 5}, {5, 6, 7, 8, 7}) == doctest::Approx(0.8207826816681233).epsilon(1e-12));
    CHECK(spearman_rho({1, 2, 3}, {30, 20, 10}) == doctest::Approx(-1));
    CHECK(spearman_rho({1, 2, 3}, {4, 4, 4}) == 0);
    CHECK_THROWS(spearman_rho({1}, {2}));
    CHECK(geometric_mean({2, 8}) == doctest::Approx(4));
    CHECK(geometric_mean({1, 1, 1}) == doctest::Approx(1));
    CHECK_THROWS(geometric_mean({1, 0}));
  }

  TEST_CASE("compare: 2× slower is a time regression, same samples are not") {
    const Report base = report_of({make_row("vanilla", 256, noisy(1e6))});
    const Report slower = report_of({make_row("vanilla", 256, noisy(2e6))});
    const auto c = compare_reports(base, slower, {});
    const auto& p = only_point(c);
    CHECK(p.verdict == Verdict::Slower);
    CHECK(p.time_ratio == doctest::Approx(2).epsilon(0.01));
    CHECK(p.test.p_value < 0.01);
    CHECK(p.time_regression);
    CHECK(c.regressions == 1);
    CHECK(c.time_geomean == doctest::Approx(2).epsilon(0.01));
    // The reverse is faster, not a regression.
    const auto back = compare_reports(slower, base, {});
    CHECK(only_point(back).verdict == Verdict::Faster);
    CHECK(back.regressions == 0);
    // Identical samples.
    const auto same = compare_reports(base, base, {});
    CHECK(only_point(same).verdict == Verdict::Same);
    CHECK(only_point(same).test.p_value == doctest::Approx(1));
    CHECK(same.regressions == 0);
    CHECK(same.time_geomean == doctest::Approx(1));
    // Significant but within --max-slowdown: slower, yet no regression.
    const auto slightly =
        compare_reports(base, report_of({make_row("vanilla", 256, noisy(1.1e6))}), {.max_slowdown = 0.2});
    CHECK(only_point(slightly).verdict == Verdict::Slower);
    CHECK(slightly.regressions == 0);
    // Without the time gate the 2× point is reported but does not fail.
    CompareOptions memory_only;
    parse_metrics("memory,flops", memory_only);
    CHECK(compare_reports(base, slower, memory_only).regressions == 0);
  }

  TEST_CASE("compare: memory +1 byte, FLOP changes, ok→error, new and missing points") {
    const Report base = report_of({make_row("vanilla", 256, noisy(1e6)), make_row("vanilla", 512, noisy(4e6)),
                                   make_row("exact-tiled", 256, noisy(1e6))});
    Report now = base;
    now.results[0].peak_tensor_bytes += 1;
    now.results[1].flops -= 8;
    now.results[2].status = Status::Error;
    now.results[2].reason = "crashed";
    now.results.push_back(make_row("exact-tiled", 512, noisy(2e6)));
    const auto c = compare_reports(base, now, {});
    REQUIRE(c.points.size() == 4);
    CHECK(c.points[0].memory_regression);
    CHECK(c.points[0].memory_delta == 1);
    CHECK(c.points[0].verdict == Verdict::Same);
    CHECK(c.points[1].flops_regression);
    CHECK(c.points[1].flops_delta == -8);
    CHECK(c.points[2].verdict == Verdict::Error);
    CHECK(c.points[2].error_regression);
    CHECK(c.points[3].verdict == Verdict::New);
    CHECK_FALSE(c.points[3].regression());
    CHECK(c.regressions == 3);
    CHECK(c.memory_regressions == 1);
    CHECK(c.flops_regressions == 1);
    CHECK(c.error_regressions == 1);
    // Growth allowance and gates.
    CompareOptions lenient;
    lenient.max_memory_growth = parse_fraction("1%", "--max-memory-growth");
    parse_metrics("time,memory", lenient);
    const auto l = compare_reports(base, now, lenient);
    CHECK(l.regressions == 1);  // ok→error is always a regression
    CHECK(l.flops_changes == 1);
    // Points dropped from NEW are missing, not regressions.
    const auto m = compare_reports(now, report_of({now.results[0]}), {});
    CHECK(m.points[1].verdict == Verdict::Missing);
    CHECK(m.regressions == 0);
    // ... unless fail_on_missing (CI baselines): the two points ok in BASE fail, absent or skipped
    // in NEW; the one that was an error in BASE does not.
    CompareOptions strict;
    strict.fail_on_missing = true;
    Report skipped = report_of({now.results[0], now.results[3]});
    skipped.results[1].status = Status::Skipped;
    const auto f = compare_reports(now, skipped, strict);
    CHECK(f.points[1].missing_regression);
    CHECK_FALSE(f.points[2].missing_regression);
    CHECK(f.points[3].verdict == Verdict::Missing);
    CHECK(f.points[3].missing_regression);
    CHECK(f.regressions == 2);
    CHECK(f.missing_regressions == 2);
    // Error in both: still reported as error, not a regression.
    const auto e = compare_reports(report_of({now.results[2]}), report_of({now.results[2]}), {});
    CHECK(only_point(e).verdict == Verdict::Error);
    CHECK(e.regressions == 0);
  }

  TEST_CASE("compare refuses different contexts, naming the fields, unless allowed") {
    const Report base = report_of({make_row("vanilla", 256, noisy(1e6))});
    Report other = base;
    other.context["threads"] = 4;
    other.context["build_type"] = "Debug";
    other.context["host"] = "elsewhere";  // not a compared field
    try {
      compare_reports(base, other, {});
      FAIL("no error");
    } catch (const InputError& e) {
      const std::string message = e.what();
      CHECK(message.find("threads (2 vs 4)") != std::string::npos);
      CHECK(message.find("build_type ('Release' vs 'Debug')") != std::string::npos);
      CHECK(message.find("host") == std::string::npos);
      CHECK(message.find("--allow-different-context") != std::string::npos);
    }
    CHECK(compare_reports(base, other, {.allow_different_context = true}).regressions == 0);
  }

  TEST_CASE("compare options and renderings") {
    CHECK(parse_fraction("5%", "x") == doctest::Approx(0.05));
    CHECK(parse_fraction("0.05", "x") == doctest::Approx(0.05));
    CHECK(parse_fraction("0", "x") == 0);
    CHECK_THROWS_AS(parse_fraction("-1%", "x"), InputError);
    CHECK_THROWS_AS(parse_fraction("five", "x"), InputError);
    CompareOptions o;
    CHECK_THROWS_AS(parse_metrics("time,speed", o), InputError);
    CHECK_THROWS_AS(parse_metrics("", o), InputError);
    parse_metrics("flops", o);
    CHECK((!o.gate_time && !o.gate_memory && o.gate_flops));

    const Report base = report_of({make_row("vanilla", 256, noisy(1e6))});
    const Report slower = report_of({make_row("vanilla", 256, noisy(2e6))});
    const auto c = compare_reports(base, slower, {});
    const auto text = render_comparison(c, {}, CompareFormat::Text);
    CHECK(text.find("vanilla N=256") != std::string::npos);
    CHECK(text.find("slower") != std::string::npos);
    CHECK(text.find("REGRESSION: time") != std::string::npos);
    CHECK(text.find("geometric mean over 1 point(s)") != std::string::npos);
    const auto md = render_comparison(c, {}, CompareFormat::Markdown);
    CHECK(md.find("| vanilla N=256") != std::string::npos);
    const auto j = nlohmann::json::parse(render_comparison(c, {}, CompareFormat::Json));
    CHECK(j["summary"]["regressions"] == 1);
    CHECK(j["points"][0]["verdict"] == "slower");
    CHECK(j["points"][0]["test"] == "exact");
    CHECK(j["points"][0]["regressions"] == nlohmann::json::array({"time"}));
  }

  TEST_CASE("shards partition the points, balanced by estimated cost") {
    const std::vector<std::int64_t> costs = {100, 1, 50, 50, 3, 0, 0, 7, 90, 10};
    for (int shards : {1, 2, 3, 4, 11}) {
      const auto assignment = assign_shards(costs, shards);
      REQUIRE(assignment.size() == costs.size());
      std::vector<std::int64_t> load(static_cast<std::size_t>(shards), 0);
      for (std::size_t i = 0; i < costs.size(); ++i) {
        REQUIRE(assignment[i] >= 0);
        REQUIRE(assignment[i] < shards);
        load[static_cast<std::size_t>(assignment[i])] += costs[i];
      }
      CHECK(assign_shards(costs, shards) == assignment);  // deterministic
      if (shards == 2) CHECK(std::abs(load[0] - load[1]) <= 10);
    }
    CHECK(parse_shard("2/4") == std::pair<int, int>{2, 4});
    CHECK_THROWS_AS(parse_shard("0/4"), InputError);
    CHECK_THROWS_AS(parse_shard("5/4"), InputError);
    CHECK_THROWS_AS(parse_shard("2"), InputError);
    CHECK_THROWS_AS(parse_shard("a/b"), InputError);
  }

  TEST_CASE("merge joins shards in sweep order and rejects duplicates and mismatches") {
    Report a = report_of({make_row("exact-tiled", 128, noisy(1e6)), make_row("vanilla", 256, noisy(1e6))});
    Report b = report_of({make_row("vanilla", 64, noisy(1e6)), make_row("exact-tiled", 64, noisy(1e6))});
    a.settings["shard"] = "1/2";
    b.settings["shard"] = "2/2";
    a.context["host"] = "node1";
    b.context["host"] = "node2";
    const Report merged = merge_reports({{"a.json", a}, {"b.json", b}});
    REQUIRE(merged.results.size() == 4);
    std::vector<std::string> order;
    for (const auto& row : merged.results) order.push_back(row.model + "@" + std::to_string(row.seq_len));
    CHECK(order == std::vector<std::string>{"vanilla@64", "vanilla@256", "exact-tiled@64", "exact-tiled@128"});
    CHECK_FALSE(merged.settings.contains("shard"));
    CHECK(merged.context["merged_from"].size() == 2);
    CHECK(merged.context["merged_from"][1]["host"] == "node2");

    CHECK_THROWS_WITH_AS(merge_reports({{"a.json", a}, {"a2.json", a}}), doctest::Contains("duplicate point"),
                         InputError);
    Report other_cpu = b;
    other_cpu.context["cpu_model"] = "Other CPU";
    CHECK_THROWS_WITH_AS(merge_reports({{"a.json", a}, {"b.json", other_cpu}}), doctest::Contains("cpu_model"),
                         InputError);
    Report other_settings = b;
    other_settings.settings["min_reps"] = 32;
    CHECK_THROWS_WITH_AS(merge_reports({{"a.json", a}, {"b.json", other_settings}}), doctest::Contains("min_reps"),
                         InputError);
  }

  TEST_CASE("the machine figures a measurement records are the ones the reader checks and merge carries") {
    MachineMeasurement m;
    m.fma_peak_gflops = m.fma_peak_512_gflops = 100;
    m.bf16_dot_peak_gflops = 180;
    const nlohmann::json figures = machine_figures(m);
    std::set<std::string> written, listed(std::begin(kMachineFigureFields), std::end(kMachineFigureFields));
    listed.insert(kMachineContendedField);
    for (const auto& [field, value] : figures.items()) written.insert(field);
    CHECK(written == listed);
    CHECK(figures["bf16_dot_peak_gflops"] == 180.0);
    Report report = report_of({make_row("vanilla", 64, noisy(1e6))});
    report.context.update(figures);
    report.context["bf16_dot_peak_gflops"] = "fast";
    CHECK_THROWS_WITH_AS(report_from_json(report_to_json(report)), doctest::Contains("bf16_dot_peak_gflops"),
                         InputError);
  }

  TEST_CASE("merge joins reports that differ in what a grid varies; the settings list every value") {
    Report one = report_of({make_row("vanilla", 64, noisy(1e6))});
    one.settings.update({{"models", {"vanilla"}}, {"threads", 1}, {"batch", 1}, {"pass", "forward"}});
    one.context.update({{"threads", 1}, {"fma_peak_gflops", 50.0}});
    one.results[0].threads = 1;
    Report two = report_of({make_row("vanilla", 64, noisy(6e5)), make_row("local", 64, noisy(3e5))});
    two.settings.update({{"models", {"local", "vanilla"}}, {"threads", 2}, {"batch", 1}, {"pass", "forward,train"}});
    two.context.update({{"threads", 2}, {"fma_peak_gflops", 100.0}});
    for (auto& row : two.results) row.threads = 2;
    const Report merged = merge_reports({{"one.json", one}, {"two.json", two}});
    CHECK(merged.results.size() == 3);
    CHECK(merged.settings["models"] == nlohmann::json({"vanilla", "local"}));
    CHECK(merged.settings["threads"] == nlohmann::json({1, 2}));
    CHECK(merged.settings["batch"] == 1);
    CHECK(merged.settings["pass"] == "forward,train");
    CHECK(merged.context["threads"] == 2);
    CHECK(merged.context["fma_peak_gflops"] == 100.0);
    CHECK(merged.context["machine_by_threads"]["1"]["fma_peak_gflops"] == 50.0);
    CHECK(merged.context["machine_by_threads"]["2"]["fma_peak_gflops"] == 100.0);
    // The same model, length and threads twice is one point measured twice: refused.
    Report again = one;
    again.settings["batch"] = 4;
    CHECK_THROWS_WITH_AS(merge_reports({{"one.json", one}, {"again.json", again}}),
                         doctest::Contains("duplicate point"), InputError);
    // Another thread count in the context alone (the settings agree) is another machine setup.
    Report other_threads = two;
    other_threads.settings["threads"] = 1;
    CHECK_THROWS_WITH_AS(merge_reports({{"one.json", one}, {"t.json", other_threads}}), doctest::Contains("threads"),
                         InputError);
  }

  TEST_CASE("merge keeps, per thread count, a measurement taken undisturbed over a contended one") {
    const auto shard = [](const char* model, double peak, bool contended) {
      Report report = report_of({make_row(model, 64, noisy(1e6))});
      report.settings.update({{"models", {model}}, {"threads", 2}});
      report.context.update({{"threads", 2},
                             {"fma_peak_gflops", peak},
                             {"triad_bandwidth_gbs", peak / 10},
                             {kMachineContendedField, contended}});
      return report;
    };
    const Report busy = shard("vanilla", 40.0, true), quiet = shard("local", 100.0, false);
    for (const auto& merged : {merge_reports({{"busy.json", busy}, {"quiet.json", quiet}}),
                               merge_reports({{"quiet.json", quiet}, {"busy.json", busy}})}) {
      CHECK(merged.context["fma_peak_gflops"] == 100.0);
      CHECK(merged.context["triad_bandwidth_gbs"] == 10.0);
      CHECK(merged.context[kMachineContendedField] == false);
      CHECK_FALSE(merged.context.contains("machine_by_threads"));
    }
    // Both contended: the first input's figures, still flagged.
    const Report busier = shard("local", 30.0, true);
    const Report both = merge_reports({{"busy.json", busy}, {"busier.json", busier}});
    CHECK(both.context["fma_peak_gflops"] == 40.0);
    CHECK(both.context[kMachineContendedField] == true);
    // A count measured only on a busy host keeps its flag in machine_by_threads.
    Report one_thread = shard("vanilla", 20.0, true);
    one_thread.settings["threads"] = 1;
    one_thread.context["threads"] = 1;
    one_thread.results[0].threads = 1;
    const Report counts = merge_reports({{"one.json", one_thread}, {"quiet.json", quiet}});
    CHECK(counts.context["threads"] == 2);
    CHECK(counts.context[kMachineContendedField] == false);
    CHECK(counts.context["machine_by_threads"]["1"][kMachineContendedField] == true);
    CHECK(counts.context["machine_by_threads"]["2"]["fma_peak_gflops"] == 100.0);
    // The largest count not measured: no top-level figures (none of the smaller count's), the
    // measured count still listed.
    Report unmeasured = shard("local", 0, false);
    for (const char* field : {"fma_peak_gflops", "triad_bandwidth_gbs", kMachineContendedField})
      unmeasured.context.erase(field);
    const Report partly = merge_reports({{"one.json", one_thread}, {"unmeasured.json", unmeasured}});
    CHECK(partly.context["threads"] == 2);
    CHECK_FALSE(partly.context.contains("fma_peak_gflops"));
    CHECK_FALSE(partly.context.contains(kMachineContendedField));
    CHECK(partly.context["machine_by_threads"]["1"]["fma_peak_gflops"] == 20.0);
  }

  TEST_CASE("big-O fits and log-log exponents of exact curves") {
    const std::vector<double> n = {256, 512, 1024, 2048, 4096};
    for (BigO c : kBigOCandidates) {
      std::vector<double> y;
      for (double v : n) y.push_back(3.5 * big_o_value(c, v));
      const auto fit = fit_big_o(n, y);
      CHECK_MESSAGE(fit.best == c, big_o_name(c));
      CHECK(fit.best_nrms() == doctest::Approx(0).epsilon(1e-9));
      CHECK(fit.coefficient == doctest::Approx(3.5));
    }
    std::vector<double> y;
    for (double v : n) y.push_back(7 * std::pow(v, 1.5));
    CHECK(loglog_exponent(n, y) == doctest::Approx(1.5));
    // A quadratic with a linear term (like attention plus projections) still fits N².
    y.clear();
    for (double v : n) y.push_back(v * v + 64 * v);
    CHECK(fit_big_o(n, y).best == BigO::NSquared);
    CHECK_THROWS(fit_big_o({1}, {1}));
    CHECK_THROWS(loglog_exponent({4, 4}, {1, 2}));
  }

  TEST_CASE("every complexity string of the registry maps to an expected class") {
    for (const auto& model : registry()) {
      const auto e = expected_complexity(model.complexity);
      CHECK_MESSAGE(e.known, (model.name + ": " + model.complexity));
    }
    CHECK(expected_complexity("O(N²)").cls == BigO::NSquared);
    CHECK(expected_complexity("O(n(k+m))").cls == BigO::N);
    CHECK(expected_complexity("O(N log N)").cls == BigO::NLogN);
    CHECK(expected_complexity("O(N√N)").cls == BigO::NSqrtN);
    CHECK(expected_complexity("O(N_c²)").cls == BigO::NSquared);
    CHECK(expected_complexity("O(B²)").ambiguous);
    CHECK(expected_complexity("O(N_g² + N·N_g)").ambiguous);
    CHECK_FALSE(expected_complexity("O(N³)").known);
  }

  TEST_CASE("complexity analysis marks matches and mismatches from the FLOP count") {
    std::vector<ResultRow> rows;
    for (std::int64_t n : {256, 512, 1024, 2048}) {
      auto quadratic = make_row("vanilla", n, {1e-3 * static_cast<double>(n * n)});
      quadratic.flops = 4 * n * n;
      quadratic.workspace_bytes = 16 * n * n;
      rows.push_back(quadratic);
      auto claimed_linear = make_row("performer", n, {static_cast<double>(n * n)});
      claimed_linear.flops = n * n;  // quadratic work for a model the survey calls O(N)
      rows.push_back(claimed_linear);
    }
    rows.push_back(make_row("exact-tiled", 256, {1}));
    rows.push_back(make_row("exact-tiled", 512, {2}));
    std::vector<std::string> skipped;
    const auto series = analyse_complexity(report_of(rows), &skipped);
    REQUIRE(series.size() == 2);
    CHECK(series[0].model == "vanilla");
    CHECK(series[0].verdict == ComplexityVerdict::Match);
    CHECK(*series[0].flops.exponent == doctest::Approx(2));
    CHECK(*series[0].time.exponent == doctest::Approx(2));
    CHECK(series[0].workspace.fit->best == BigO::NSquared);
    CHECK(series[1].verdict == ComplexityVerdict::Mismatch);
    REQUIRE(skipped.size() == 1);
    CHECK(skipped[0].find("exact-tiled") == 0);
    const auto text = render_complexity(series, skipped, ComplexityFormat::Text);
    CHECK(text.find("MISMATCH") != std::string::npos);
    const auto j = nlohmann::json::parse(render_complexity(series, skipped, ComplexityFormat::Json));
    CHECK(j["series"][0]["flops"]["best"] == "N²");
    CHECK(j["series"][1]["verdict"] == "MISMATCH");
    // The table's complexity column.
    const auto table = render_table(report_of(rows), {.complexity = true});
    CHECK(table.find("N² ✓") != std::string::npos);
    CHECK(table.find("N² ✗") != std::string::npos);
    CHECK(table.find("N^2.00") != std::string::npos);
  }

  TEST_CASE("a v1 figure the revision changed: a fit of the revision's class is 'match (revision)'") {
    for (const auto& model : registry())
      if (!model.revised_complexity.empty())
        CHECK_MESSAGE(expected_complexity(model.revised_complexity).known, model.name);
    const auto routing_series = [](double (*flops_of)(double)) {
      std::vector<ResultRow> rows;
      for (std::int64_t n : {1024, 2048, 4096, 8192}) {
        auto row = make_row("routing", n, {static_cast<double>(n)});
        row.flops = static_cast<std::int64_t>(flops_of(static_cast<double>(n)));
        rows.push_back(row);
      }
      return analyse_complexity(report_of(rows));
    };
    const auto sqrt_n = routing_series([](double n) { return 100 * n * std::sqrt(n); });
    REQUIRE(sqrt_n.size() == 1);
    CHECK(sqrt_n[0].verdict == ComplexityVerdict::MatchRevision);
    CHECK(sqrt_n[0].survey_revision == "O(N√N)");
    CHECK(routing_series([](double n) { return 100 * n * std::log2(n); })[0].verdict == ComplexityVerdict::Match);
    CHECK(routing_series([](double n) { return 100 * n * n; })[0].verdict == ComplexityVerdict::Mismatch);
    const auto text = render_complexity(sqrt_n, {}, ComplexityFormat::Text);
    CHECK(text.find("O(N log N); rev. O(N√N)") != std::string::npos);
    CHECK(text.find("match (revision)") != std::string::npos);
    const auto j = nlohmann::json::parse(render_complexity(sqrt_n, {}, ComplexityFormat::Json));
    CHECK(j["series"][0]["verdict"] == "match (revision)");
    CHECK(j["series"][0]["expected_revision"] == "N√N");
    CHECK(j["series"][0]["survey_revision"] == "O(N√N)");
    std::vector<ResultRow> rows;
    for (std::int64_t n : {1024, 2048, 4096}) {
      rows.push_back(make_row("routing", n, {static_cast<double>(n)}));
      rows.back().flops = static_cast<std::int64_t>(100 * static_cast<double>(n) * std::sqrt(static_cast<double>(n)));
    }
    CHECK(render_table(report_of(rows), {.complexity = true}).find("N√N ✓ (rev.)") != std::string::npos);
  }

  TEST_CASE("decode rows: every decode cost maps; per-token fits, tables and plots in per-token terms") {
    for (const auto& model : registry()) {
      if (model.decodes())
        CHECK_MESSAGE(expected_decode_complexity(model.decode_cost).known, (model.name + ": " + model.decode_cost));
    }
    std::vector<ResultRow> rows;
    for (std::int64_t n : {1024, 2048, 4096, 8192}) {
      auto decode_row = [&](const std::string& model, double per_token_ns, std::int64_t per_token_flops,
                            std::int64_t state) {
        ResultRow row = make_row(model, n, {per_token_ns});
        row.pass = Pass::Decode;
        row.causal = true;
        row.decode_tokens = 10;
        row.flops = 10 * per_token_flops;
        row.state_bytes = state;
        return row;
      };
      rows.push_back(decode_row("vanilla", 2.0 * static_cast<double>(n), 4 * 64 * n, 512 * n));  // a KV cache
      rows.push_back(decode_row("linear-transformer", 4500, 70000, 167936));                     // a recurrent state
      rows.push_back(decode_row("performer", 10.0 * static_cast<double>(n), 3 * n, 600000));     // claims O(1), grows
    }
    const auto series = analyse_complexity(report_of(rows));
    REQUIRE(series.size() == 3);
    CHECK(series[0].per_token);
    CHECK(series[0].survey == "O(N)");
    CHECK(series[0].verdict == ComplexityVerdict::Match);
    CHECK(*series[0].flops.exponent == doctest::Approx(1));  // per token, not per N tokens
    CHECK(series[0].workspace.fit->best == BigO::NSquared);  // the state: "N" per token
    CHECK(series[1].verdict == ComplexityVerdict::Match);
    CHECK(*series[1].time.exponent == doctest::Approx(0).epsilon(1e-9));
    CHECK(series[2].verdict == ComplexityVerdict::Mismatch);
    const auto j = nlohmann::json::parse(render_complexity(series, {}, ComplexityFormat::Json));
    CHECK(j["series"][0]["flops"]["best"] == "N");
    CHECK(j["series"][0]["expected"] == "N");
    CHECK(j["series"][1]["flops"]["best"] == "1");
    CHECK(j["series"][1]["state_bytes"]["best"] == "1");
    CHECK(j["series"][1]["per_token"] == true);
    const auto table = render_table(report_of(rows), {.complexity = true});
    CHECK(table.find("per generated token (µs") != std::string::npos);
    CHECK(table.find("T=10") != std::string::npos);
    CHECK(table.find("4.5") != std::string::npos);  // linear-transformer's 4500 ns in µs
    CHECK(table.find("1 ✓") != std::string::npos);
    CHECK(table.find("N ✓") != std::string::npos);
    const auto state = render_table(report_of(rows), {.metric = TableMetric::State});
    CHECK(state.find("0.160") != std::string::npos);  // 167936 bytes in MiB
    const std::string svg = render_plot(report_of(rows), {.metric = PlotMetric::State});
    CHECK(svg.find("context length N") != std::string::npos);
    CHECK(svg.find("decode state kept between steps") != std::string::npos);
    CHECK(render_plot(report_of(rows), {}).find("per generated token (µs") != std::string::npos);
  }

  TEST_CASE("the LRA preset and LRA's published table") {
    const auto& preset = lra_preset();
    CHECK(preset.scope == "layer");
    CHECK(preset.batch == 32);
    CHECK(preset.heads * preset.head_dim == 256);
    CHECK(preset.d_ff == 1024);
    CHECK(preset.seq_lens == std::vector<std::int64_t>{1024, 2048, 3072, 4096});
    for (const auto& model : preset.models) CHECK_MESSAGE(find_model(model) != nullptr, model);
    // Every implemented model of the preset accepts the preset's parameter names; the others'
    // parameters are dropped (their points are unsupported rows).
    const auto params = preset_params(preset, preset.models);
    for (const auto& assignment : params) {
      const auto model = assignment.substr(0, assignment.find('.'));
      CHECK_MESSAGE(find_model(model)->implemented(), assignment);
    }
    CHECK(preset_params(preset, {"vanilla"}).empty());
    CHECK(lra_table2().size() == preset.models.size());
    CHECK(lra_table2().front().steps_per_s[3] == 1.4);
    CHECK(find_preset("nosuch") == nullptr);
  }

  TEST_CASE("table --paper lra: our ratios next to LRA's and Spearman's ρ") {
    // Our memory ratios in exactly LRA's order at 1K → ρ = 1; time the reverse → ρ = −1.
    std::vector<ResultRow> rows;
    for (const auto& published : lra_table2()) {
      auto row = make_row(published.model, 1024, {1.0 / published.steps_per_s[0] * 1e9});
      row.median_ns = 1e9 * published.steps_per_s[0];  // faster in LRA → slower here
      row.peak_tensor_bytes = static_cast<std::int64_t>(published.memory_gb[0] * 1e9);
      row.scope = Scope::Layer;
      rows.push_back(row);
    }
    const auto text = render_lra_comparison(report_of(rows), TableFormat::Text);
    CHECK(text.find("Spearman") != std::string::npos);
    CHECK(text.find("-1.00") != std::string::npos);
    CHECK(text.find("1.00") != std::string::npos);
    CHECK(text.find("arXiv 2011.04006") != std::string::npos);
    const auto md = render_lra_comparison(report_of(rows), TableFormat::Markdown);
    CHECK(md.find("| linformer (Linformer)") != std::string::npos);
    CHECK_THROWS_AS(render_lra_comparison(report_of({make_row("vanilla", 100, {1})}), TableFormat::Text), InputError);
  }

  TEST_CASE("the SVG tests' parse_xml rejects malformed XML, also where pugixml alone is lenient") {
    CHECK(std::string(parse_xml("<?xml version=\"1.0\"?>\n<a x=\"&lt;&#38;&#x26;\"><b/>&amp;</a>\n")
                          .document_element()
                          .attribute("x")
                          .value()) == "<&&");
    for (const char* bad : {"<a><b></a>", "<a x=1/>", "<a x=\"1\" x=\"2\"/>", "<a x=\"<\"/>", "<a>&nbsp;</a>",
                            "<a x=\"A & B\"/>", "<a/><b/>", "<a/>tail", ""})
      CHECK_THROWS_AS_MESSAGE(parse_xml(bad), std::runtime_error, bad);
    CHECK_THROWS_AS(at(parse_xml("<a/>").document_element(), "x"), std::runtime_error);
  }

  TEST_CASE("plot: the SVG parses and its series are the report's ok points on log-log axes") {
    std::vector<ResultRow> rows;
    for (std::int64_t n : {256, 512, 1024, 2048}) {
      rows.push_back(make_row("vanilla", n, {1e3 * static_cast<double>(n * n)}));
      rows.push_back(make_row("exact-tiled", n, {7e2 * static_cast<double>(n * n)}));
    }
    rows[5].status = Status::Error;  // exact-tiled N=1024
    rows[5].reason = "crashed";
    rows.push_back(make_row("linformer", 256, {}));
    rows.back().status = Status::Unsupported;
    const Report report = report_of(rows);
    for (PlotMetric metric : {PlotMetric::Time, PlotMetric::Memory, PlotMetric::Speedup}) {
      const std::string svg = render_plot(report, {.metric = metric});
      const pugi::xml_document document = parse_xml(svg);
      const pugi::xml_node root = document.document_element();
      REQUIRE(std::string(root.name()) == "svg");
      std::map<std::pair<std::string, std::int64_t>, double> drawn;
      std::vector<std::pair<double, double>> positions;  // (log value, y) of vanilla
      std::set<std::string> colours;                     // of the series: one per model
      for (const pugi::xml_node series : find_all(root, "g", "series")) {
        for (const pugi::xml_node point : find_all(series, "path", "point")) {
          const auto key = std::make_pair(at(series, "data-label"), std::stoll(at(point, "data-n")));
          CHECK(drawn.count(key) == 0);
          drawn[key] = std::stod(at(point, "data-value"));
          const auto xy = doubles(at(point, "transform").substr(10));
          if (at(series, "data-model") == "vanilla") positions.emplace_back(std::log(drawn[key]), xy.at(1));
        }
        const ModelInfo* model = find_model(at(series, "data-model"));
        CHECK(at(series, "data-class") == class_name(model->classes.front()));
        colours.insert(at(series, "stroke"));
      }
      CHECK(colours.size() == 3);  // vanilla, exact-tiled and linformer, each its own colour
      std::set<std::pair<std::string, std::int64_t>> expected;
      for (const auto& row : report.results)
        if (row.status == Status::Ok) expected.insert({row.model, row.seq_len});
      std::set<std::pair<std::string, std::int64_t>> got;
      for (const auto& [key, value] : drawn) got.insert(key);
      CHECK(got == expected);  // the error and unsupported points are absent, not zero
      for (const auto& row : report.results) {
        if (row.status != Status::Ok) continue;
        const double value = drawn.at({row.model, row.seq_len});
        if (metric == PlotMetric::Time) CHECK(value == doctest::Approx(row.median_ns * 1e-6).epsilon(1e-5));
        if (metric == PlotMetric::Memory)
          CHECK(value == doctest::Approx(row.peak_tensor_bytes / 1048576.0).epsilon(1e-5));
        if (metric == PlotMetric::Speedup && row.model == "exact-tiled")
          CHECK(value == doctest::Approx(1e3 / 7e2).epsilon(1e-5));
      }
      // y is linear in log(value), decreasing: equal slopes between consecutive vanilla points.
      if (metric != PlotMetric::Speedup) {
        REQUIRE(positions.size() == 4);
        std::sort(positions.begin(), positions.end());
        const double slope = (positions[1].second - positions[0].second) / (positions[1].first - positions[0].first);
        CHECK(slope < 0);
        for (std::size_t i = 2; i < positions.size(); ++i)
          CHECK((positions[i].second - positions[i - 1].second) / (positions[i].first - positions[i - 1].first) ==
                doctest::Approx(slope).epsilon(0.01));
      }
      // exact-tiled's line breaks at its error point (N=1024): 256–512 is one line, 2048 stands
      // alone as a marker without a line.
      for (const pugi::xml_node series : find_all(root, "g", "series"))
        if (at(series, "data-model") == "exact-tiled") CHECK(find_all(series, "polyline", "line").size() == 1);
      CHECK(svg.find("absent: 1K error") != std::string::npos);
      CHECK(find_all(root, "text", "axis-title").size() == 2);
      CHECK(find_all(root, "text", "tick").size() >= 6);
    }
    CHECK_THROWS_AS(render_plot(report_of({rows[5]}), {}), InputError);
  }

  TEST_CASE("taxonomy: Table 1 as Markdown and JSON, and the class diagram places every model") {
    const auto md = render_taxonomy(TaxonomyFormat::Markdown);
    for (const auto& model : registry())
      CHECK_MESSAGE(md.find("`" + model.name + "`") != std::string::npos, model.name);
    CHECK(md.find("| 17 | v1 | Big Bird") != std::string::npos);
    const auto j = nlohmann::json::parse(render_taxonomy(TaxonomyFormat::Json));
    REQUIRE(j["models"].size() == registry().size());
    CHECK(j["models"][0]["survey_row"] == 1);
    CHECK(j["models"][0]["class_letters"] == "FP+M");

    const pugi::xml_document document = parse_xml(render_taxonomy(TaxonomyFormat::Svg));
    const pugi::xml_node root = document.document_element();
    struct Ellipse {
      double cx, cy, rx, ry;
      bool contains(double x, double y) const {
        return (x - cx) * (x - cx) / (rx * rx) + (y - cy) * (y - cy) / (ry * ry) < 1;
      }
    };
    std::map<std::string, Ellipse> regions;
    for (const pugi::xml_node e : find_all(root, "ellipse", "class-region"))
      regions[at(e, "data-class")] = {std::stod(at(e, "cx")), std::stod(at(e, "cy")), std::stod(at(e, "rx")),
                                      std::stod(at(e, "ry"))};
    CHECK(regions.size() == all_classes().size() - 1);  // every class but the exact baselines
    const auto labels = find_all(root, "text", "model");
    REQUIRE(labels.size() == registry().size());
    for (const pugi::xml_node label : labels) {
      const ModelInfo* model = find_model(at(label, "data-model"));
      REQUIRE(model != nullptr);
      CHECK(at(label, "data-implemented") == (model->implemented() ? "true" : "false"));
      const double x = std::stod(at(label, "x")), y = std::stod(at(label, "y"));
      for (const auto& [name, ellipse] : regions) {
        ModelClass c;
        REQUIRE(parse_class(name, c));
        CHECK_MESSAGE(ellipse.contains(x, y) == model->has_class(c), (model->name + " vs " + name));
      }
    }
  }

  TEST_CASE("analysing an empty report is an input error") {
    CHECK_THROWS_AS(render_plot(report_of({}), {}), InputError);
    CHECK(analyse_complexity(report_of({})).empty());
  }
}
