// Measurement trust: contention marking with injected samples, tracked-memory pools, the paired
// A/B statistics on seeded synthetic noise, compare's noisy verdict and ISA-aware memory gate,
// the dashboard export shapes, and that the probe's CPU time brackets the sample alone. Nothing here
// times anything for a verdict.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "apps/bench/ab.hpp"
#include "apps/report/compare.hpp"
#include "apps/report/dashboard.hpp"
#include "lib/core/contention.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/paired.hpp"
#include "lib/core/timing.hpp"

using namespace xfb;

namespace {
SampleContention clean_sample(double cpu_ns = 0) {
  SampleContention s;
  s.cpu_ns = cpu_ns;
  return s;
}
SampleContention descheduled_sample() {
  SampleContention s;
  s.wait_ns = 4e6;
  s.descheduled = true;
  return s;
}
ResultRow measured_row(const std::string& model, double median_ns, bool contended) {
  ResultRow row;
  row.model = model;
  row.classes = {"exact"};
  row.batch = 1;
  row.heads = 2;
  row.seq_len = 64;
  row.head_dim = 16;
  for (int i = 0; i < 7; ++i) row.samples_ns.push_back(median_ns * (1 + 0.001 * i));
  row.median_ns = median_ns * 1.003;
  row.contended = contended;
  row.flops = 1000;
  row.peak_tensor_bytes = 5000;
  row.peak_owned_bytes = 4000;
  return row;
}
Report report_of(std::vector<ResultRow> rows, const std::string& isa) {
  Report r;
  r.context = {{"cpu_model", "cpu"},
               {"threads", 2},
               {"onednn_version", "2.6.3"},
               {"onednn_isa", isa},
               {"build_type", "Release"}};
  r.results = std::move(rows);
  return r;
}
// Log ratios of `rounds` A/B rounds: each side's median carries lognormal noise of `sigma`.
std::vector<double> synthetic_rounds(std::mt19937_64& rng, int rounds, double true_ratio, double sigma) {
  std::normal_distribution<double> noise(0.0, sigma);
  std::vector<double> d;
  for (int i = 0; i < rounds; ++i) d.push_back(std::log(true_ratio) + noise(rng) - noise(rng));
  return d;
}
AbVerdict verdict_of(const std::vector<double>& log_ratios, const AbSettings& settings) {
  AbPoint point;
  for (double d : log_ratios) point.rounds.push_back({false, 1e6, 1e6 * std::exp(d), false, false});
  judge_ab_point(point, settings);
  return point.verdict;
}
}  // namespace

TEST_SUITE("measurement") {
  TEST_CASE("a sample is descheduled past the wait floor and the wall fraction") {
    SampleContention s;
    s.wait_ns = 0.9 * kWaitFloorNs;
    CHECK_FALSE(is_descheduled(1e3, s, true));  // under the floor, however short the sample
    s.wait_ns = 1.1 * kWaitFloorNs;
    CHECK(is_descheduled(1e6, s, true));
    CHECK_FALSE(is_descheduled(1.1 * kWaitFloorNs / kWaitFraction * 1.01, s, true));  // < fraction of wall
    s.wait_ns = 0;
    s.involuntary_switches = 1;
    CHECK_FALSE(is_descheduled(1e6, s, true));
    CHECK(is_descheduled(1e6, s, false));  // fallback without schedstat
  }

  TEST_CASE("a one-thread sample's CPU time is at most its wall time: the probe's own reads are outside it") {
    // A single thread cannot use more CPU than wall time; the probe's /proc reads (tens of µs)
    // counted in a 20 µs sample's CPU time put the median ratio near 2.
    ContentionProbe probe;
    std::vector<double> ratios;
    volatile double sink = 0;
    for (int sample = 0; sample < 200; ++sample) {
      probe.start();
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - start < std::chrono::microseconds(20)) sink = sink + 1.0;
      const double wall_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
      ratios.push_back(probe.stop(wall_ns).cpu_ns / wall_ns);
    }
    std::sort(ratios.begin(), ratios.end());
    CHECK(ratios[ratios.size() / 2] < 1.1);
  }

  TEST_CASE("child runs settle after a child that used gigabytes, in proportion, up to a limit") {
    CHECK(settle_seconds(0) == 0);
    CHECK(settle_seconds(kSettleAfterBytes - 1) == 0);
    CHECK(settle_seconds(kSettleAfterBytes) == doctest::Approx(kSettleSecondsPerGiB));
    CHECK(settle_seconds(std::int64_t{8} << 30) == doctest::Approx(8 * kSettleSecondsPerGiB));
    CHECK(settle_seconds(std::int64_t{1} << 40) == kSettleMaxS);
    CHECK(settle_after(kSettleAfterBytes - 1) == 0);  // returns at once
  }

  TEST_CASE("a sample is descheduled when the hypervisor stole CPU time past the same limits") {
    SampleContention s;  // no run-queue wait, no switch: only steal
    s.steal_ns = 10e6;   // one 10 ms tick
    CHECK(is_descheduled(20e6, s, true));
    CHECK(is_descheduled(20e6, s, false));                              // whatever the run-queue source
    CHECK_FALSE(is_descheduled(10e6 / kWaitFraction * 1.01, s, true));  // < fraction of a long sample
    s.steal_ns = 0.9 * kWaitFloorNs;
    CHECK_FALSE(is_descheduled(1e3, s, true));  // under the floor
    s.steal_ns = 0;
    CHECK_FALSE(is_descheduled(20e6, s, true));
  }

  TEST_CASE("the collector keeps descheduled samples apart and re-measures them") {
    const TimingSettings settings{.warmup = 1, .min_reps = 3, .min_time_s = 0, .max_reps = 100};
    SampleCollector collector(settings);
    collector.add(1e6, clean_sample(2e6), {{"route", 4e5}});
    collector.add(5e6, descheduled_sample(), {{"route", 9e5}});
    collector.add(1.1e6, clean_sample(1.1e6));
    CHECK_FALSE(collector.done());  // two clean samples of three
    collector.add(0.9e6, clean_sample(1.8e6));
    CHECK(collector.done());
    const TimingResult result = collector.finish(2);
    CHECK(result.samples_ns == std::vector<double>{1e6, 1.1e6, 0.9e6});
    CHECK(result.contended_samples_ns == std::vector<double>{5e6});
    CHECK(result.stage_samples_ns.at("route") == std::vector<double>{4e5});
    CHECK_FALSE(result.contended);
    // On-CPU ratios of the clean samples: 1.0, 0.5, 1.0 → median 1.0.
    CHECK(result.contention.cpu_ratio == doctest::Approx(1.0));
  }

  TEST_CASE("a collector whose retry budget runs out flags the result contended") {
    const TimingSettings settings{.warmup = 1, .min_reps = 5, .min_time_s = 0.01, .max_reps = 1000};
    SampleCollector collector(settings);
    collector.add(1e6, clean_sample());
    int added = 0;
    while (!collector.done()) {
      collector.add(50e6, descheduled_sample());
      ++added;
    }
    // Budget: 2·min_time + 0.25 s = 0.27 s of descheduled samples, so 6 of 50 ms.
    CHECK(added == 6);
    const TimingResult result = collector.finish(2);
    CHECK(result.contended);
    CHECK(result.samples_ns.size() == 1);
  }

  TEST_CASE("a result with more descheduled than clean samples is contended, however many are clean") {
    const TimingSettings settings{.warmup = 1, .min_reps = 2, .min_time_s = 0, .max_reps = 1000};
    SampleCollector outnumbered(settings), ahead(settings);
    for (int i = 0; i < 6; ++i) outnumbered.add(1e6, descheduled_sample());
    for (int i = 0; i < 5; ++i) outnumbered.add(1e6, clean_sample());
    CHECK(outnumbered.finish(2).contended);
    for (int i = 0; i < 5; ++i) ahead.add(1e6, descheduled_sample());
    for (int i = 0; i < 5; ++i) ahead.add(1e6, clean_sample());
    CHECK_FALSE(ahead.finish(2).contended);
  }

  TEST_CASE("with no clean sample the stages come from the descheduled ones") {
    SampleCollector collector({.warmup = 1, .min_reps = 2, .min_time_s = 0, .max_reps = 2});
    collector.add(5e6, descheduled_sample(), {{"route", 1e6}, {"attend", 3e6}});
    collector.add(6e6, descheduled_sample(), {{"route", 2e6}, {"attend", 3e6}});
    const TimingResult result = collector.finish(2);
    CHECK(result.samples_ns.empty());
    CHECK(result.stage_samples_ns.at("route") == std::vector<double>{1e6, 2e6});
  }

  TEST_CASE("max_reps caps clean and descheduled samples together") {
    SampleCollector collector({.warmup = 1, .min_reps = 5, .min_time_s = 10, .max_reps = 4});
    for (int i = 0; i < 2; ++i) collector.add(1e3, clean_sample());
    for (int i = 0; i < 2; ++i) collector.add(1e3, descheduled_sample());
    CHECK(collector.done());
    CHECK(collector.finish(1).contended);
  }

  TEST_CASE("host busy is other processes' share of every CPU over the timed samples") {
    std::vector<SampleContention> samples(2);
    samples[0].other_busy_ns = 1e6;
    samples[1].other_busy_ns = 3e6;
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    const ContentionSummary summary = summarize_contention({2e6, 2e6}, samples, 1);
    CHECK(summary.host_busy == doctest::Approx(std::min(1.0, 4e6 / (4e6 * static_cast<double>(cpus)))));
    CHECK(contention_reason(3, 10, summary).rfind("contended: 3 of 10", 0) == 0);
  }

  TEST_CASE("owned bytes leave the library pool (oneDNN scratchpad) out") {
    auto& tracker = MemoryTracker::instance();
    const auto total = tracker.current_bytes(), owned = tracker.owned_current_bytes();
    tracker.reset_peak();
    void* library = tracker.allocate(1000, MemoryPool::Library);
    void* mine = tracker.allocate(300);
    CHECK(tracker.current_bytes() == total + 1300);
    CHECK(tracker.owned_current_bytes() == owned + 300);
    tracker.release(library, 1000, MemoryPool::Library);
    CHECK(tracker.peak_bytes() == total + 1300);
    CHECK(tracker.owned_peak_bytes() == owned + 300);
    tracker.release(mine, 300);
    CHECK(tracker.owned_current_bytes() == owned);
  }

  TEST_CASE("signed-rank statistics on known data") {
    const PairedResult r = paired_log_ratio_test({1, 2, 3, 4, 5}, 0.9);
    CHECK(r.rounds == 5);
    CHECK(r.w_plus == 15);
    CHECK(r.p_value == doctest::Approx(2.0 / 32));   // one pattern of 32 is as extreme, two-sided
    CHECK(std::log(r.ratio) == doctest::Approx(3));  // median of the 15 Walsh averages
    // 90%: P(W+ ≤ 0) = 1/32 ≤ 0.05 < P(W+ ≤ 1) = 2/32, so k = 1: the extreme Walsh averages.
    CHECK(std::log(r.ci_low) == doctest::Approx(1));
    CHECK(std::log(r.ci_high) == doctest::Approx(5));
    const PairedResult mixed = paired_log_ratio_test({-1, 2, -3, 4, 0}, 0.9);
    CHECK(mixed.rounds == 4);  // the zero is dropped
    CHECK(mixed.w_plus == 6);  // ranks 2 + 4
    // Five rounds cannot give a 99% interval: P(W+ ≤ 0) = 1/32 > 0.005.
    CHECK(std::isinf(paired_log_ratio_test({1, 2, 3, 4, 5}, 0.99).ci_high));
  }

  TEST_CASE("A/A is never a verdict at the default settings; a 12% shift is found") {
    std::mt19937_64 rng(20261130);
    AbSettings settings;  // 10 rounds, alpha 0.01, max_slowdown 5%
    int false_verdicts = 0, detected = 0;
    for (int trial = 0; trial < 2000; ++trial) {
      const auto verdict = verdict_of(synthetic_rounds(rng, settings.rounds, 1.0, 0.03), settings);
      false_verdicts += verdict == AbVerdict::Slower || verdict == AbVerdict::Faster;
    }
    for (int trial = 0; trial < 200; ++trial)
      detected += verdict_of(synthetic_rounds(rng, settings.rounds, 1.12, 0.03), settings) == AbVerdict::Slower;
    CHECK(false_verdicts == 0);
    CHECK(detected >= 190);
    int faster = 0;
    for (int trial = 0; trial < 200; ++trial)
      faster += verdict_of(synthetic_rounds(rng, settings.rounds, 1 / 1.12, 0.03), settings) == AbVerdict::Faster;
    CHECK(faster >= 190);
  }

  TEST_CASE("contended rounds are dropped; too many make the point noisy") {
    AbSettings settings;
    AbPoint point;
    for (int i = 0; i < 10; ++i) point.rounds.push_back({i % 2 == 1, 1e6, 1.2e6, i < 6, false});
    judge_ab_point(point, settings);
    CHECK(point.verdict == AbVerdict::Noisy);
    CHECK(point.usable_rounds == 4);
    AbPoint failed;
    failed.verdict = AbVerdict::Error;
    failed.rounds.push_back({false, 1e6, 2e6, false, false});
    judge_ab_point(failed, settings);
    CHECK(failed.verdict == AbVerdict::Error);
  }

  TEST_CASE("compare: a contended row gets no time verdict") {
    const Report base = report_of({measured_row("vanilla", 1e6, false)}, "avx2");
    const Report slow = report_of({measured_row("vanilla", 3e6, true)}, "avx2");
    const Comparison c = compare_reports(base, slow, CompareOptions{});
    CHECK(c.points.at(0).verdict == Verdict::Noisy);
    CHECK(c.time_regressions == 0);
    CHECK(compare_reports(base, report_of({measured_row("vanilla", 3e6, false)}, "avx2"), CompareOptions{})
              .time_regressions == 1);
  }

  TEST_CASE("compare: owned bytes are gated across ISAs, the scratchpad only within one") {
    CompareOptions memory_only;
    parse_metrics("memory,flops", memory_only);
    ResultRow grown_total = measured_row("vanilla", 1e6, false);
    grown_total.peak_tensor_bytes += 64;
    const Report base = report_of({measured_row("vanilla", 1e6, false)}, "avx2");
    CHECK(compare_reports(base, report_of({grown_total}, "avx2"), memory_only).memory_regressions == 1);
    const Comparison across = compare_reports(base, report_of({grown_total}, "avx512_core_bf16"), memory_only);
    CHECK(across.memory_regressions == 0);
    CHECK_FALSE(across.scratchpad_compared);
    ResultRow grown_owned = grown_total;
    grown_owned.peak_owned_bytes += 1;
    CHECK(compare_reports(base, report_of({grown_owned}, "avx512_core_bf16"), memory_only).memory_regressions == 1);
    // Time needs the same ISA; memory and FLOPs do not.
    CHECK_THROWS_AS(compare_reports(base, report_of({grown_owned}, "avx512_core_bf16"), CompareOptions{}), InputError);
  }

  TEST_CASE("dashboard exports have github-action-benchmark's and Bencher's shapes") {
    Report report = report_of({measured_row("vanilla", 2e6, false), measured_row("local", 1e6, false)}, "avx2");
    report.results[1].status = Status::Error;  // not exported
    report.results[0].mad_ns = 1e4;
    report.results[0].min_ns = 1.9e6;
    report.results[0].max_ns = 2.2e6;
    const auto entries = dashboard_entries(report);
    REQUIRE(entries.size() == 1);
    const auto gab = nlohmann::json::parse(github_benchmark_json(entries));
    REQUIRE(gab.is_array());
    REQUIRE(gab.size() == 1);
    CHECK(gab[0].size() == 4);
    CHECK(gab[0]["name"] == entries[0].name);
    CHECK(gab[0]["unit"] == "ms");
    CHECK(gab[0]["value"].get<double>() == doctest::Approx(report.results[0].median_ns * 1e-6));
    CHECK(gab[0]["range"] == "± 0.01");
    const auto bmf = nlohmann::json::parse(bencher_bmf_json(entries));
    REQUIRE(bmf.is_object());
    const auto& latency = bmf.at(entries[0].name).at("latency");
    CHECK(latency.size() == 3);
    CHECK(latency["value"].get<double>() == doctest::Approx(report.results[0].median_ns));
    CHECK(latency["lower_value"].get<double>() == doctest::Approx(1.9e6));
    CHECK(latency["upper_value"].get<double>() == doctest::Approx(2.2e6));
  }
}
