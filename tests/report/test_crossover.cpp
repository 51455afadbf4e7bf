// Crossover lengths and the time–memory front (apps/report/crossover.hpp) on synthetic reports
// whose crossings are known: `table --metric crossover|front` and `complexity --format json`.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "apps/report/complexity.hpp"
#include "apps/report/crossover.hpp"
#include "apps/report/table.hpp"
#include "taxonomy/cards.hpp"

using namespace xfb;

namespace {

// vanilla's time grows as N² from 1 ms at 1K, its memory as N² from 1 MiB.
double vanilla_ms(std::int64_t n) { return static_cast<double>(n * n) / (1024.0 * 1024.0); }

// A row of `model` at N whose time and memory are `time_ratio` and `memory_ratio` × vanilla's
// (status Skipped when time_ratio is 0).
ResultRow row_at(const std::string& model, std::int64_t n, double time_ratio, double memory_ratio = 1) {
  ResultRow row;
  row.model = model;
  for (auto c : find_card(model)->classes) row.classes.push_back(class_name(c));
  row.batch = 1;
  row.heads = 8;
  row.head_dim = 64;
  row.seq_len = n;
  if (time_ratio == 0) {
    row.status = Status::Skipped;
    row.reason = "estimated memory exceeds the limit";
    return row;
  }
  row.median_ns = time_ratio * vanilla_ms(n) * 1e6;
  row.samples_ns = {row.median_ns};
  row.min_ns = row.max_ns = row.median_ns;
  row.peak_tensor_bytes = static_cast<std::int64_t>(memory_ratio * vanilla_ms(n) * 1024 * 1024);
  return row;
}

// Rows of `model` at 1K, 4K, 16K with these time (and memory) ratios to vanilla.
void add_series(Report& report, const std::string& model, std::vector<double> time, std::vector<double> memory = {}) {
  const std::int64_t lengths[] = {1024, 4096, 16384};
  for (std::size_t i = 0; i < time.size(); ++i)
    report.results.push_back(row_at(model, lengths[i], time[i], memory.empty() ? 1 : memory[i]));
}

Report crossing_report() {
  Report report;
  add_series(report, "vanilla", {1, 1, 1});
  add_series(report, "exact-tiled", {2, 0.5, 0.25}, {2, 0.5, 0.5});  // crosses at 2K in both
  add_series(report, "performer", {3, 3, 3}, {0.5, 0.5, 0.5});       // never faster, always smaller
  add_series(report, "local", {0.5, 0.25, 0.1});                     // faster everywhere
  add_series(report, "linformer", {2, 0.5, 2});                      // crosses, then falls back
  add_series(report, "reformer", {0.5, 2, 0.5});                     // faster, slower, faster again
  add_series(report, "bigbird", {2, 0, 0.5});                        // skipped between the two
  add_series(report, "longformer", {0.5, 0.5, 0});                   // skipped at the largest
  return report;
}

CrossoverPoint point(std::int64_t n, double model, double reference) { return {n, model, reference, false}; }

}  // namespace

TEST_SUITE("crossover") {
  TEST_CASE("2× slower at 1K and 2× faster at 4K cross at 2K on the log-log line") {
    const Crossover c = find_crossover({point(1024, 2, 1), point(4096, 0.5, 1)});
    CHECK(c.kind == CrossoverKind::Interpolated);
    CHECK(c.n == 2048);
    CHECK(c.low == 1024);
    CHECK(c.high == 4096);
    CHECK(c.compared_to == 4096);
    CHECK_FALSE(c.partial);
    // Equal at a measured length: the crossing is that length.
    CHECK(find_crossover({point(1024, 1, 1), point(2048, 0.5, 1)}).n == 1024);
    // Not at the midpoint when the ratios are not symmetric: 4× slower, 2× faster → 2/3 of the way.
    CHECK(find_crossover({point(1000, 4, 1), point(8000, 0.5, 1)}).n == 4000);
  }

  TEST_CASE("never, faster everywhere, falling back, gaps and nothing compared") {
    CHECK(find_crossover({point(1024, 3, 1), point(4096, 3, 1)}).kind == CrossoverKind::Never);
    const Crossover everywhere = find_crossover({point(1024, 0.5, 1), point(4096, 0.5, 1)});
    CHECK(everywhere.kind == CrossoverKind::Below);
    CHECK(everywhere.n == 1024);
    // Faster at 1K, slower at 4K, faster at 16K: the chain starts above 4K.
    const Crossover again = find_crossover({point(1024, 0.5, 1), point(4096, 2, 1), point(16384, 0.5, 1)});
    CHECK(again.kind == CrossoverKind::Interpolated);
    CHECK(again.n == 8192);
    CHECK(find_crossover({point(1024, 2, 1), point(4096, 0.5, 1), point(16384, 2, 1)}).kind == CrossoverKind::Never);
    const Crossover gap = find_crossover({point(1024, 2, 1), {4096, std::nullopt, 1.0, false}, point(16384, 0.5, 1)});
    CHECK(gap.kind == CrossoverKind::AfterGap);
    CHECK(gap.n == 16384);
    CHECK(gap.low == 4096);
    const Crossover partial = find_crossover({point(1024, 0.5, 1), point(4096, 0.5, 1), {16384, 1.0, {}, false}});
    CHECK(partial.kind == CrossoverKind::Below);
    CHECK(partial.partial);
    CHECK(partial.compared_to == 4096);
    CHECK(find_crossover({{1024, 1.0, {}, false}}).kind == CrossoverKind::None);
    CHECK(find_crossover({}).kind == CrossoverKind::None);
  }

  TEST_CASE("a contended point the result rests on marks it; one below the chain does not") {
    std::vector<CrossoverPoint> points = {point(1024, 2, 1), point(4096, 0.5, 1), point(16384, 0.5, 1)};
    points[2].contended = true;
    CHECK(crossover_text(find_crossover(points)) == "2048!");
    points[2].contended = false;
    points[0].contended = true;  // the bracketing point below the crossing
    CHECK(crossover_text(find_crossover(points)) == "2048!");
    CHECK(crossover_text(find_crossover({points[0], point(4096, 0.5, 1), point(8192, 0.5, 1), point(16384, 0.5, 1)}))
              .back() == '!');
    std::vector<CrossoverPoint> everywhere = {point(512, 2, 1), point(1024, 0.5, 1), point(4096, 0.5, 1)};
    everywhere[0].contended = true;  // interpolation uses it
    CHECK(crossover_text(find_crossover(everywhere)) == "724!");
  }

  TEST_CASE("table --metric crossover: time and memory per model, exact text") {
    const std::string text = render_table(crossing_report(), {.metric = TableMetric::Crossover});
    CHECK(text ==
          "crossover length against vanilla: smallest N from which the model is faster (time) or smaller (memory) at "
          "every larger compared N — scope attention, B=1 H=8 D=64\n"
          "class               model                               time           memory  \n"
          "------------------  -----------  ---------------------------  ---------------  \n"
          "exact               vanilla                         baseline         baseline  \n"
          "exact               exact-tiled                         2048             2048  \n"
          "fixed_patterns      longformer              ≤ 1024 (to 4096)  never (to 4096)  \n"
          "fixed_patterns      bigbird      ≤ 16384 (4096 not compared)            never  \n"
          "fixed_patterns      local                             ≤ 1024            never  \n"
          "learnable_patterns  reformer                            8192            never  \n"
          "low_rank            linformer                          never            never  \n"
          "kernels             performer                          never           ≤ 1024  \n"
          "\n" +
              crossover_note() + "\n");
  }

  TEST_CASE("table --metric crossover --format csv: machine-readable columns, --baseline chooses the reference") {
    const std::string csv =
        render_table(crossing_report(), {.metric = TableMetric::Crossover, .format = TableFormat::Csv});
    const std::string header =
        "scope,pass,causal,batch,heads,head_dim,class,model,time_kind,time_seq_len,time_between,time_compared_to,"
        "time_partial,time_contended,memory_kind,memory_seq_len,memory_between,memory_compared_to,memory_partial,"
        "memory_contended\n";
    CHECK(csv.find(header) == 0);
    CHECK(csv.find("attention,forward,false,1,8,64,exact,vanilla,baseline,,,,,,baseline,,,,,\n") != std::string::npos);
    CHECK(csv.find("exact,exact-tiled,interpolated,2048,1024-4096,16384,false,false,interpolated,2048,1024-4096,16384,"
                   "false,false\n") != std::string::npos);
    CHECK(csv.find("longformer,below,1024,,4096,true,false,never,,,4096,true,false\n") != std::string::npos);
    CHECK(csv.find("bigbird,after_gap,16384,4096-16384,16384,false,false,never,,,16384,false,false\n") !=
          std::string::npos);
    const std::string against_tiled = render_table(
        crossing_report(), {.metric = TableMetric::Crossover, .format = TableFormat::Csv, .baseline = "exact-tiled"});
    CHECK(against_tiled.find(",vanilla,never,,,16384,false,false,") != std::string::npos);
    CHECK(against_tiled.find(",exact-tiled,baseline,") != std::string::npos);
  }

  TEST_CASE("Pareto front: dominated points leave it, ties in both stay") {
    // (time, memory): 0 and 1 tie in time, 1 is larger; 2 and 3 tie in both; 4 is beaten by 2.
    const std::vector<std::pair<double, double>> points = {{1, 5}, {1, 6}, {2, 3}, {2, 3}, {3, 4}, {4, 1}, {4, 1.5}};
    CHECK(pareto_front(points) == std::vector<std::size_t>{0, 2, 3, 5});
    CHECK(pareto_front({}).empty());
    CHECK(pareto_front({{7, 7}}) == std::vector<std::size_t>{0});
  }

  TEST_CASE("table --metric front: per N the models no other beats in both, fastest first") {
    Report report;
    for (std::int64_t n : {1024, 4096}) {
      report.results.push_back(row_at("vanilla", n, 1, 1));
      report.results.push_back(row_at("exact-tiled", n, 1, 0.25));  // beats vanilla: as fast, smaller
      report.results.push_back(row_at("local", n, 0.5, 0.5));
      report.results.push_back(row_at("longformer", n, 0.5, 0.5));  // ties local in both (registry order)
      report.results.push_back(row_at("performer", n, n == 1024 ? 2 : 0.25, 1));
    }
    report.results.push_back(row_at("linformer", 1024, 0));  // skipped: left out
    CHECK(render_table(report, {.metric = TableMetric::Front, .format = TableFormat::Markdown}) ==
          "**time–memory front (median ms, peak tracked MiB) — scope attention, B=1 H=8 D=64**\n\n"
          "| N    | class          | model       | time (ms) | memory (MiB) |\n"
          "|:-----|:---------------|:------------|----------:|-------------:|\n"
          "| 1024 | fixed_patterns | longformer  |     0.500 |          0.5 |\n"
          "|      | fixed_patterns | local       |     0.500 |          0.5 |\n"
          "|      | exact          | exact-tiled |     1.000 |          0.2 |\n"
          "| 4096 | kernels        | performer   |     4.000 |         16.0 |\n"
          "|      | fixed_patterns | longformer  |     8.000 |          8.0 |\n"
          "|      | fixed_patterns | local       |     8.000 |          8.0 |\n"
          "|      | exact          | exact-tiled |    16.000 |          4.0 |\n"
          "\n" +
              front_note() + "\n");
    const std::string csv = render_table(report, {.metric = TableMetric::Front, .format = TableFormat::Csv});
    CHECK(csv.find("scope,pass,causal,batch,heads,head_dim,seq_len,class,model,median_ns,peak_tensor_bytes\n") == 0);
    CHECK(csv.find("attention,forward,false,1,8,64,1024,fixed_patterns,longformer,500000.0,524288\n") !=
          std::string::npos);
  }

  TEST_CASE("complexity JSON: each series' crossover against the baseline, null for the baseline itself") {
    const Report report = crossing_report();
    const auto json = nlohmann::json::parse(render_complexity(analyse_complexity(report), {}, ComplexityFormat::Json));
    std::map<std::string, nlohmann::json> by_model;
    for (const auto& s : json["series"]) by_model[s["label"]] = s["crossover"];
    CHECK(by_model.at("vanilla").is_null());
    CHECK(by_model.at("exact-tiled") == nlohmann::json::parse(R"({"baseline": "vanilla",
            "time": {"kind": "interpolated", "seq_len": 2048, "between": [1024, 4096], "compared_to": 16384,
                     "partial": false, "contended": false},
            "memory": {"kind": "interpolated", "seq_len": 2048, "between": [1024, 4096], "compared_to": 16384,
                       "partial": false, "contended": false}})"));
    CHECK(by_model.at("performer")["time"]["kind"] == "never");
    CHECK(by_model.at("performer")["time"]["seq_len"].is_null());
    CHECK(by_model.at("performer")["memory"]["kind"] == "below");
    CHECK_FALSE(by_model.count("bigbird"));  // two ok lengths: not fitted
    const auto other = analyse_complexity(report, nullptr, "local");
    for (const auto& s : other)
      if (s.model == "exact-tiled") CHECK(s.crossover->time.kind == CrossoverKind::Never);
    for (const auto& s : analyse_complexity(report, nullptr, "nystromformer")) CHECK_FALSE(s.crossover);
  }
}
