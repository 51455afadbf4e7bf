// plot's SVG on small fixed reports: a colour per model and a marker per class for a whole
// registry's worth of models, the spread band, the subtitle, the pass in every panel title, the
// GFLOP/s metric and the tags of coinciding series.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>

#include "apps/report/plot.hpp"
#include "apps/report/svg.hpp"
#include "taxonomy/cards.hpp"
#include "tests/support/svg_xml.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

// An ok row of `model` at N whose samples are `samples_ns` (median, min and max of them).
ResultRow row(const std::string& model, std::int64_t n, std::vector<double> samples_ns, Pass pass = Pass::Forward) {
  ResultRow r;
  r.model = model;
  if (const ModelCard* card = find_card(model))
    for (ModelClass c : card->classes) r.classes.push_back(class_name(c));
  r.pass = pass;
  r.batch = 1;
  r.heads = 2;
  r.head_dim = 16;
  r.seq_len = n;
  r.threads = 2;
  if (pass == Pass::Decode) {
    r.causal = true;
    r.decode_tokens = 4;
  }
  std::sort(samples_ns.begin(), samples_ns.end());
  r.samples_ns = samples_ns;
  r.median_ns = samples_ns[samples_ns.size() / 2];
  r.min_ns = samples_ns.front();
  r.max_ns = samples_ns.back();
  r.flops = 1000 * n;
  r.gflops_per_s = static_cast<double>(r.flops) / r.median_ns;
  r.peak_tensor_bytes = 4096 * n;
  return r;
}

Report report_of(std::vector<ResultRow> rows) {
  Report report;
  report.context = {
      {"cpu_model", "Test CPU"}, {"threads", 2}, {"git_commit", "0123456789abcdef0123456789abcdef01234567"}};
  report.results = std::move(rows);
  return report;
}

// The SVG of `report`, parsed (so every test also checks that it is well-formed XML).
pugi::xml_document plot(const Report& report, PlotOptions options = {}) {
  return parse_xml(render_plot(report, options));
}

std::vector<std::string> texts(const pugi::xml_document& document, const std::string& css_class) {
  std::vector<std::string> found;
  for (const auto node : find_all(document.document_element(), "text", css_class)) found.push_back(node.text().get());
  return found;
}

}  // namespace

TEST_SUITE("plot") {
  TEST_CASE("every model has its own colour and its class's marker, and the legend lists them all in columns") {
    const std::size_t models = std::min(model_cards().size(), svg::kPaletteSize);
    REQUIRE(models >= 25);
    std::vector<ResultRow> rows;
    for (std::size_t i = 0; i < models; ++i)
      for (std::int64_t n : {1024, 2048})
        rows.push_back(row(model_cards()[i].name, n, {1e6 * static_cast<double>((i + 1) * n) / 1024}));
    const auto document = plot(report_of(rows));
    std::set<std::string> colours;
    std::map<std::string, std::set<std::string>> markers;  // class → marker paths
    for (const auto series : find_all(document.document_element(), "g", "series")) {
      colours.insert(at(series, "stroke"));
      CHECK(at(series, "fill") == at(series, "stroke"));
      for (const auto point : find_all(series, "path", "point"))
        markers[at(series, "data-class")].insert(at(point, "d"));
    }
    CHECK(colours.size() == models);
    std::set<std::string> shapes;
    for (const auto& [cls, paths] : markers) {
      CHECK_MESSAGE(paths.size() == 1, cls);
      CHECK(*paths.begin() == svg::class_marker(cls));
      shapes.insert(*paths.begin());
    }
    std::set<std::string> classes_drawn;  // every class of the models plotted
    for (std::size_t i = 0; i < models; ++i) classes_drawn.insert(class_name(model_cards()[i].classes.front()));
    CHECK(markers.size() == classes_drawn.size());
    CHECK(shapes.size() == markers.size());  // one shape per class, none shared
    const auto entries = find_all(document.document_element(), "g", "legend-entry");
    CHECK(entries.size() == models);
    std::set<std::string> columns;
    for (const auto entry : entries) columns.insert(at(entry.child("line"), "x1"));
    CHECK(columns.size() >= 2);  // too many for one column beside a 400 px chart
    const double width = std::stod(at(document.document_element(), "width"));
    for (const auto& x : columns) CHECK(std::stod(x) + 150 <= width);
    for (std::size_t i = 0; i < svg::kPaletteSize; ++i)
      for (std::size_t j = 0; j < i; ++j) CHECK(svg::series_colour(i) != svg::series_colour(j));
  }

  TEST_CASE("past the palette, colours repeat with a dashed line") {
    std::vector<ResultRow> rows;
    for (std::size_t i = 0; i < svg::kPaletteSize + 2; ++i) {
      rows.push_back(row("vanilla", 1024, {1e6 + 1e5 * static_cast<double>(i)}));
      rows.back().params = {{"k", i}};
      rows.push_back(row("vanilla", 2048, {4e6 + 1e5 * static_cast<double>(i)}));
      rows.back().params = {{"k", i}};
    }
    const auto document = plot(report_of(rows));
    std::map<std::string, std::set<std::string>> dashes;  // colour → dash patterns
    for (const auto series : find_all(document.document_element(), "g", "series"))
      dashes[at(series, "stroke")].insert(at(series.child("polyline"), "stroke-dasharray"));
    CHECK(dashes.size() == svg::kPaletteSize);
    for (const auto& [colour, patterns] : dashes) CHECK(patterns.count("none") == 1);
    CHECK(std::count_if(dashes.begin(), dashes.end(), [](const auto& d) { return d.second.size() == 2; }) == 2);
  }

  TEST_CASE("the subtitle gives the CPU, threads, dtype (f32 unless the report names one) and commit") {
    Report report = report_of({row("vanilla", 1024, {1e6}), row("vanilla", 2048, {4e6})});
    CHECK(texts(plot(report), "subtitle") ==
          std::vector<std::string>{"CPU: Test CPU · threads: 2 · dtype: f32 · commit 0123456789ab"});
    report.settings["dtype"] = "bf16";
    report.context["git_commit"] = "0123456789abcdef0123456789abcdef01234567-dirty";
    report.results[1].threads = 1;  // a grid over threads: a panel per thread count
    CHECK(texts(plot(report), "subtitle") ==
          std::vector<std::string>{"CPU: Test CPU · threads: 2 · dtype: bf16 · commit 0123456789ab-dirty",
                                   "CPU: Test CPU · threads: 1 · dtype: bf16 · commit 0123456789ab-dirty"});
    report.context = nlohmann::json::object();
    for (auto& r : report.results) r.threads = 0;
    report.settings = nlohmann::json::object();
    CHECK(texts(plot(report), "subtitle") ==
          std::vector<std::string>{"CPU: unknown · threads: unknown · dtype: f32 · commit unknown"});
  }

  TEST_CASE("every panel title names its pass, forward included") {
    std::vector<ResultRow> rows;
    for (Pass pass : {Pass::Forward, Pass::Train, Pass::Decode})
      for (std::int64_t n : {1024, 2048}) rows.push_back(row("vanilla", n, {1e6 * static_cast<double>(n)}, pass));
    const auto titles = texts(plot(report_of(rows)), "title");
    CHECK(titles == std::vector<std::string>{"Median time — attention, forward pass, B=1 H=2 D=16",
                                             "Median time — attention, train pass, B=1 H=2 D=16",
                                             "Median time — attention, decode pass, causal, B=1 H=2 D=16, T=4"});
    const auto gflops = texts(plot(report_of(rows), {.metric = PlotMetric::Gflops}), "title");
    CHECK(gflops.front() == "Executed GFLOP/s — attention, forward pass, B=1 H=2 D=16");
  }

  TEST_CASE("time and GFLOP/s points carry a p10-p90 band of their samples; memory none") {
    const Report report = report_of({row("vanilla", 1024, {0.9e6, 1e6, 1.2e6}), row("vanilla", 2048, {4e6, 4.4e6, 5e6}),
                                     row("local", 1024, {2e6}), row("local", 2048, {3e6})});
    const auto time = plot(report);
    for (const auto series : find_all(time.document_element(), "g", "series")) {
      const auto points = find_all(series, "path", "point");
      REQUIRE(points.size() == 2);
      if (at(series, "data-model") == "vanilla") {
        CHECK(find_all(series, "path", "band").size() == 1);
        CHECK(at(points[0], "data-low") == "0.92");  // p10 of 0.9, 1, 1.2 ms
        CHECK(at(points[0], "data-value") == "1");
        CHECK(at(points[0], "data-high") == "1.16");  // p90
        CHECK(at(points[1], "data-high") == "4.88");
      } else {  // one sample per point: no spread
        CHECK(find_all(series, "path", "band").empty());
        CHECK(!points[0].attribute("data-low"));
      }
    }
    const auto gflops = plot(report, {.metric = PlotMetric::Gflops});
    const auto vanilla = find_all(gflops.document_element(), "g", "series").at(0);  // exact, before local (FP)
    REQUIRE(at(vanilla, "data-model") == "vanilla");
    const auto point = find_all(vanilla, "path", "point").at(0);
    CHECK(at(point, "data-value") == "1.024");  // 1000·1024 FLOPs in 1 ms: gflops_per_s
    CHECK(std::stod(at(point, "data-low")) == doctest::Approx(1.024 / 1.16).epsilon(1e-5));
    CHECK(std::stod(at(point, "data-high")) == doctest::Approx(1.024 / 0.92).epsilon(1e-5));
    CHECK(find_all(plot(report, {.metric = PlotMetric::Memory}).document_element(), "path", "band").empty());
  }

  TEST_CASE("series drawn on top of each other are tagged on the chart and listed under it") {
    std::vector<ResultRow> rows;
    for (std::int64_t n : {1024, 2048, 4096}) {
      for (const char* model : {"vanilla", "local", "performer"}) {
        rows.push_back(row(model, n, {1e6}));
        rows.back().peak_tensor_bytes = 4096 * n + (model[0] == 'l' ? 64 : 0);  // well under a pixel apart
      }
      rows.push_back(row("linformer", n, {1e6}));
      rows.back().peak_tensor_bytes = 40960 * n;
    }
    const auto document = plot(report_of(rows), {.metric = PlotMetric::Memory});
    const auto tags = find_all(document.document_element(), "text", "coincide-tag");
    REQUIRE(tags.size() == 1);
    CHECK(std::string(tags[0].text().get()) == "A ×3");
    CHECK(at(tags[0], "data-models") == "vanilla;local;performer");
    CHECK(texts(document, "coincide") ==
          std::vector<std::string>{"A ×3 coincide (within 3 px at every N they share): vanilla, local, performer"});
    // The time plot has every model at 1 ms too: all four coincide.
    CHECK(texts(plot(report_of(rows)), "coincide-tag") == std::vector<std::string>{"A ×4"});
  }
}
