// Seeded property test of the report reader: mutated valid reports (types, ranges, deleted
// fields, huge and non-finite numbers, deep nesting, random bytes in strings and in the text) are
// either refused with an InputError or accepted, and an accepted report renders as a table, a
// comparison, a chart, a complexity fit, an LRA table, a merge and dashboard exports with no nan
// or inf in the output and an output of bounded size. Any other exception fails the test.
#include <doctest/doctest.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "apps/report/compare.hpp"
#include "apps/report/complexity.hpp"
#include "apps/report/dashboard.hpp"
#include "apps/report/json_fields.hpp"
#include "apps/report/lra.hpp"
#include "apps/report/merge.hpp"
#include "apps/report/plot.hpp"
#include "apps/report/report.hpp"
#include "apps/report/table.hpp"
#include "lib/core/errors.hpp"

using namespace xfb;
using nlohmann::json;

namespace {

constexpr int kCases = 12000;
constexpr std::size_t kMaxOutputBytes = 8 << 20;

ResultRow seed_row(const std::string& model, std::int64_t n, double median, const std::string& pass = "forward") {
  ResultRow row;
  row.model = model;
  row.classes = {model == "local" ? "fixed_patterns" : "exact"};
  row.pass = parse_pass(pass);
  row.causal = pass == "decode";
  row.batch = 1;
  row.heads = 2;
  row.seq_len = n;
  row.head_dim = 16;
  row.params = model == "local" ? json{{"block", 50}} : json::object();
  row.samples_ns = {median * 0.99, median, median * 1.02};
  row.median_ns = median;
  row.min_ns = median * 0.99;
  row.max_ns = median * 1.02;
  row.cv = 0.01;
  row.flops = 1000 * n * n;
  row.gflops_per_s = static_cast<double>(row.flops) / median;
  row.tokens_per_s = static_cast<double>(n) / (median * 1e-9);
  row.peak_tensor_bytes = 4096 * n;
  row.peak_owned_bytes = 4000 * n;
  row.workspace_bytes = 1024 * n;
  row.decode_tokens = pass == "decode" ? 8 : 0;
  row.state_bytes = pass == "decode" ? 64 * n : 0;
  row.reproducer = "xfbench run --model " + model;
  return row;
}

// A small valid report: two exact models and a pattern at LRA lengths, an error row, a decode series.
json seed_report() {
  Report report;
  report.context = {{"cpu_model", "Fuzz CPU"}, {"threads", 2}, {"fma_peak_gflops", 100.0}, {"host", "h"}};
  report.settings = {{"models", {"vanilla", "exact-tiled", "local"}}, {"seq_lens", {1024, 2048, 4096}}};
  for (std::int64_t n : {1024, 2048, 4096}) {
    const double scale = static_cast<double>(n) * static_cast<double>(n);
    report.results.push_back(seed_row("vanilla", n, 2.0 * scale));
    report.results.push_back(seed_row("exact-tiled", n, 1.5 * scale));
    report.results.push_back(seed_row("local", n, 50.0 * static_cast<double>(n)));
    report.results.push_back(seed_row("vanilla", n, 3e3 * static_cast<double>(n), "decode"));
  }
  report.results[2].status = Status::Error;
  report.results[2].reason = "crashed";
  return report_to_json(report);
}

// Random bytes without ASCII letters: whatever lands in a string cannot spell "nan" or "inf".
std::string random_bytes(std::mt19937_64& rng) {
  std::string text(rng() % 12, ' ');
  for (auto& c : text) {
    do c = static_cast<char>(rng() % 256);
    while (std::isalpha(static_cast<unsigned char>(c)));
  }
  return text;
}

json random_value(std::mt19937_64& rng) {
  static const double numbers[] = {0.0,
                                   -0.0,
                                   -1.0,
                                   1.0,
                                   0.5,
                                   1e300,
                                   -1e300,
                                   5e-324,
                                   1e-300,
                                   1e18,
                                   1e19,
                                   std::numeric_limits<double>::infinity(),
                                   -std::numeric_limits<double>::infinity(),
                                   std::numeric_limits<double>::quiet_NaN(),
                                   1099511627777.0,
                                   64.0};
  static const std::int64_t integers[] = {0,
                                          -1,
                                          1,
                                          2,
                                          64,
                                          std::int64_t{1} << 40,
                                          (std::int64_t{1} << 40) + 1,
                                          std::numeric_limits<std::int64_t>::max(),
                                          std::numeric_limits<std::int64_t>::min()};
  switch (rng() % 9) {
    case 0:
      return nullptr;
    case 1:
      return rng() % 2 == 0;
    case 2:
      return numbers[rng() % std::size(numbers)];
    case 3:
      return integers[rng() % std::size(integers)];
    case 4:
      return std::numeric_limits<std::uint64_t>::max() - rng() % 3;
    case 5:
      return random_bytes(rng);
    case 6:
      return std::to_string(rng() % 5000);
    case 7:
      return json::array({random_bytes(rng), 1});
    default:
      return json{{random_bytes(rng), json::array({json::object()})}};
  }
}

// A node of the tree, biased towards the rows' fields.
json& pick_node(json& node, std::mt19937_64& rng) {
  json* at = &node;
  while (at->is_structured() && !at->empty() && rng() % 5 != 0) {
    auto it = at->begin();
    std::advance(it, static_cast<long>(rng() % at->size()));
    at = &*it;
  }
  return *at;
}

json nested(int depth) {
  json value = 1;
  for (int i = 0; i < depth; ++i) value = json::array({value});
  return value;
}

// Keeps a row consistent (min <= median <= max) while taking its figures to extremes the reader
// accepts: tiny or huge times, zero or maximal byte counts, a zero or tiny FMA peak.
void extreme_but_valid(json& report, std::mt19937_64& rng) {
  static const double times[] = {5e-324, 1e-300, 1e-3, 1.0, 1e17, 1e18};
  static const std::int64_t counts[] = {0, 1, std::numeric_limits<std::int64_t>::max()};
  json& rows = report["results"];
  json& row = rows[rng() % rows.size()];
  if (!row.is_object()) return;
  const double t = times[rng() % std::size(times)];
  if (rng() % 2)
    row.update({{"samples_ns", {t}}, {"median_ns", t}, {"min_ns", t}, {"max_ns", t}, {"mad_ns", 0}});
  else
    row.update(
        {{"peak_tensor_bytes", counts[rng() % 3]}, {"flops", counts[rng() % 3]}, {"state_bytes", counts[rng() % 3]}});
  if (rng() % 4 == 0 && report["context"].is_object()) report["context"]["fma_peak_gflops"] = times[rng() % 3];
}

void mutate_tree(json& report, std::mt19937_64& rng) {
  const bool has_rows = report.is_object() && report.contains("results") && report["results"].is_array() &&
                        !report["results"].empty() && report["results"][0].is_object();
  if (has_rows && rng() % 3 == 0) return extreme_but_valid(report, rng);
  json& node = pick_node(report, rng);
  switch (rng() % 6) {
    case 0:
    case 1:
      node = random_value(rng);
      break;
    case 2:
      if (node.is_object() && !node.empty()) {
        auto it = node.begin();
        std::advance(it, static_cast<long>(rng() % node.size()));
        node.erase(it);
      } else if (node.is_array() && !node.empty()) {
        node.erase(node.begin() + static_cast<long>(rng() % node.size()));
      }
      break;
    case 3:
      node = nested(static_cast<int>(rng() % 40));
      break;
    case 4:
      if (node.is_number()) node = node.get<double>() * (rng() % 2 ? 1e200 : -1.0);
      break;
    default:
      if (has_rows) report["results"].push_back(report["results"][rng() % report["results"].size()]);
  }
}

// The text a file would hold, sometimes with bytes overwritten, inserted or cut off.
std::string mutate_text(const json& report, std::mt19937_64& rng) {
  std::string text = report.dump(rng() % 2 ? 1 : -1, ' ', false, json::error_handler_t::replace);
  const auto choice = rng() % 8;
  if (choice == 0 && !text.empty()) text[rng() % text.size()] = static_cast<char>(rng() % 256);
  if (choice == 1) text.insert(rng() % (text.size() + 1), random_bytes(rng));
  if (choice == 2) text.resize(rng() % (text.size() + 1));
  return text;
}

// "nan" or "inf" as a word of their own, in any case: how printf and JSON writers spell non-finite numbers.
bool prints_non_finite(const std::string& output) {
  const auto letter = [&](std::size_t i) {
    return i < output.size() && std::isalpha(static_cast<unsigned char>(output[i]));
  };
  for (std::size_t i = 0; i + 3 <= output.size(); ++i) {
    const char a = static_cast<char>(std::tolower(output[i]));
    if (a != 'n' && a != 'i') continue;
    std::string word = output.substr(i, 3);
    for (auto& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if ((word == "nan" || word == "inf") && (i == 0 || !letter(i - 1)) && !letter(i + 3)) return true;
  }
  return false;
}

// Runs `render`; an InputError (a sentence about the input) is an acceptable answer.
template <class Render>
void expect_clean(const char* what, Render render, int case_index) {
  std::string output;
  try {
    output = render();
  } catch (const InputError&) {
    return;
  }
  INFO(std::string(what) << " of case " << case_index);
  CHECK(output.size() <= kMaxOutputBytes);
  if (prints_non_finite(output)) FAIL_CHECK(std::string(what) << " printed nan or inf: " << output.substr(0, 2000));
}

// Every renderer of reports, each a named callable on (report, seed).
using Renderer = std::pair<const char*, std::function<std::string(const Report&, const Report&)>>;
const std::vector<Renderer>& renderers() {
  static const CompareOptions options = [] {
    CompareOptions o;
    o.allow_different_context = true;
    return o;
  }();
  static const std::vector<Renderer> all = {
      {"time table", [](const Report& r, const Report&) { return render_table(r, {}); }},
      {"speed-up table",
       [](const Report& r, const Report&) { return render_table(r, {.metric = TableMetric::Speedup}); }},
      {"memory tables",
       [](const Report& r, const Report&) {
         return render_table(r, {.metric = TableMetric::Memory, .format = TableFormat::Csv}) +
                render_table(r, {.metric = TableMetric::MemoryRatio, .format = TableFormat::Markdown});
       }},
      {"gflops and state tables",
       [](const Report& r, const Report&) {
         return render_table(r, {.metric = TableMetric::Gflops}) + render_table(r, {.metric = TableMetric::State});
       }},
      {"complexity table",
       [](const Report& r, const Report&) {
         require_known_models(r, "fuzz");
         return render_table(r, {.format = TableFormat::Markdown, .complexity = true});
       }},
      {"complexity",
       [](const Report& r, const Report&) {
         std::vector<std::string> skipped;
         return render_complexity(analyse_complexity(r, &skipped), skipped, ComplexityFormat::Json);
       }},
      {"lra", [](const Report& r, const Report&) { return render_lra_comparison(r, TableFormat::Text); }},
      {"time plot", [](const Report& r, const Report&) { return render_plot(r, {}); }},
      {"other plots",
       [](const Report& r, const Report&) {
         std::string svg;
         for (PlotMetric metric : {PlotMetric::Memory, PlotMetric::Speedup, PlotMetric::State, PlotMetric::Gflops})
           try {
             svg += render_plot(r, {.metric = metric});
           } catch (const InputError&) {
           }
         return svg;
       }},
      {"compare",
       [](const Report& r, const Report& seed) {
         return render_comparison(compare_reports(seed, r, options), options, CompareFormat::Text);
       }},
      {"compare json",
       [](const Report& r, const Report& seed) {
         return render_comparison(compare_reports(r, seed, options), options, CompareFormat::Json);
       }},
      {"dashboards",
       [](const Report& r, const Report&) {
         return bencher_bmf_json(dashboard_entries(r)) + github_benchmark_json(dashboard_entries(r));
       }},
      {"merge",
       [](const Report& r, const Report& seed) {
         return report_to_json(merge_reports({{"a", r}, {"b", seed}})).dump();
       }},
  };
  return all;
}

// `count` renderers, chosen by the case number so that every renderer sees its share of cases.
void render(const Report& report, const Report& seed, int i, std::size_t count) {
  const auto& all = renderers();
  for (std::size_t k = 0; k < count; ++k) {
    const auto& [what, renderer] = all[(static_cast<std::size_t>(i) * count + k) % all.size()];
    expect_clean(
        what, [&] { return renderer(report, seed); }, i);
  }
}

}  // namespace

TEST_SUITE("report_fuzz") {
  TEST_CASE("the seed report is valid and renders") {
    const Report seed = report_from_json(seed_report());
    CHECK(seed.results.size() == 12);
    CHECK(render_table(seed, {.metric = TableMetric::Speedup}).find("1.00×") != std::string::npos);
    render(seed, seed, 0, renderers().size());
  }

  TEST_CASE("mutated reports are refused with an InputError or render cleanly") {
    const json seed_json = seed_report();
    const Report seed = report_from_json(seed_json);
    std::mt19937_64 rng(20240531);
    int accepted = 0, refused = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCases; ++i) {
      json mutated = seed_json;
      const int mutations = 1 + static_cast<int>(rng() % 3);
      for (int m = 0; m < mutations; ++m) mutate_tree(mutated, rng);
      const std::string text = mutate_text(mutated, rng);
      Report report;
      try {
        report = report_from_json(parse_json_text(text, "fuzz"));
      } catch (const InputError& e) {
        ++refused;
        CHECK(std::string(e.what()).find('\n') == std::string::npos);
        continue;
      } catch (const std::exception& e) {
        FAIL("case " << i << ": the reader let " << e.what() << " escape for " << text.substr(0, 500));
      }
      ++accepted;
      render(report, seed, i, 4);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    MESSAGE(kCases << " cases: " << accepted << " accepted, " << refused << " refused, " << seconds << " s");
    CHECK(accepted > kCases / 20);  // the mutations leave enough reports valid to exercise the renderers
    CHECK(refused > kCases / 2);
  }
}
