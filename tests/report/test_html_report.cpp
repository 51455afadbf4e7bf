// The HTML page of `xfbench report`: well-formed, one sortable table per metric with each point's
// spread, plots inline, warnings with their reasons, every report string escaped, no URL in markup.
#include <doctest/doctest.h>

#include <pugixml.hpp>

#include <string>
#include <vector>

#include "apps/report/html_report.hpp"
#include "lib/core/stats.hpp"

using namespace xfb;

namespace {

const std::string kHostileModel = "a<b&\"c'";
const std::string kHostileReason = "<i>boom</i> & \"x\" https://example.com/?a=1&b=2";

// An ok row of `model` at `n` with samples `ms` (milliseconds).
ResultRow timed(const std::string& model, std::int64_t n, const std::vector<double>& ms) {
  ResultRow row;
  row.model = model;
  row.classes = {"exact"};
  row.batch = 1;
  row.heads = 2;
  row.head_dim = 16;
  row.seq_len = n;
  row.threads = 1;
  for (double t : ms) row.samples_ns.push_back(t * 1e6);
  const SampleStats stats = summarize(row.samples_ns);
  row.median_ns = stats.median;
  row.min_ns = stats.min;
  row.max_ns = stats.max;
  row.cv = stats.cv;
  row.unstable = stats.cv > kUnstableCv;
  row.flops = 1000 * n;
  row.gflops_per_s = 1.5;
  row.peak_tensor_bytes = 4096 * n;
  return row;
}

ResultRow failed(const std::string& model, std::int64_t n, Status status, const std::string& reason) {
  ResultRow row = timed(model, n, {});
  row.status = status;
  row.reason = reason;
  return row;
}

NamedReport named(const std::string& name, std::vector<ResultRow> rows) {
  Report report;
  report.context = {{"cpu_model", "Test CPU <x>"}, {"threads", 1}, {"git_commit", "abc123"}};
  report.settings = {{"seq_lens", {64, 128}}};
  report.results = std::move(rows);
  return {name, std::move(report)};
}

std::vector<ResultRow> forward_rows() {
  return {timed("vanilla", 64, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}),
          timed("vanilla", 128, {4, 4, 4}),
          timed("exact-tiled", 64, {2, 2, 2}),
          failed("exact-tiled", 128, Status::Error, kHostileReason),
          timed(kHostileModel, 64, {3, 3, 3}),
          failed(kHostileModel, 128, Status::Skipped, "estimated memory 2 GiB exceeds --memory-limit")};
}

pugi::xml_document parse(const std::string& page) {
  pugi::xml_document document;
  const pugi::xml_parse_result result = document.load_string(page.c_str());
  INFO(result.description(), " at ", result.offset, ": ",
       page.substr(result.offset > 80 ? result.offset - 80 : 0, 160));
  REQUIRE(result);
  return document;
}

std::vector<pugi::xml_node> select(const pugi::xml_node& node, const std::string& xpath) {
  std::vector<pugi::xml_node> nodes;
  for (const auto& hit : node.select_nodes(xpath.c_str())) nodes.push_back(hit.node());
  return nodes;
}

// The time table's cell of `label` at N=`n`.
pugi::xml_node time_cell(const pugi::xml_node& page, const std::string& label, std::int64_t n) {
  const auto tables = select(page, "//div[@data-metric='time']/table");
  REQUIRE(!tables.empty());
  const auto headers = select(tables.front(), "thead/tr/th");
  std::size_t column = headers.size(), model = headers.size();
  for (std::size_t i = 0; i < headers.size(); ++i) {
    if (std::string(headers[i].text().get()) == "N=" + std::to_string(n)) column = i;
    if (std::string(headers[i].text().get()) == "model") model = i;
  }
  REQUIRE(column < headers.size());
  REQUIRE(model < headers.size());
  for (const auto& row : select(tables.front(), "tbody/tr")) {
    const auto cells = select(row, "td");
    if (cells.size() > column && std::string(cells[model].text().get()) == label) return cells[column];
  }
  FAIL("no time row " << label);
  return {};
}

}  // namespace

TEST_SUITE("html_report") {
  TEST_CASE("one sortable table per metric with the spread, and a plot, per configuration") {
    const std::string page = render_html_report({named("a.json", forward_rows())}, {});
    const auto document = parse(page);
    for (const std::string metric : {"time", "speedup", "memory", "memory-ratio", "gflops", "crossover", "front"}) {
      INFO(metric);
      CHECK(select(document, "//div[@data-metric='" + metric + "']/table[@data-sortable='true']").size() == 1);
    }
    CHECK(select(document, "//div[@data-metric='state']").empty());  // no decode rows
    CHECK(select(document, "//section[@class='xr-configuration']").size() == 1);
    // Plots inline: an <svg> with its series, no XML declaration or namespace URL.
    CHECK(select(document, "//div[@data-metric='time']/figure[@class='xr-plot']/svg//g[@class='series']").size() == 3);
    CHECK(page.find("<?xml") == std::string::npos);

    // vanilla at 64: samples 1…10 ms, median 5.5, p10 1.9, p90 9.1; CV 55%.
    const pugi::xml_node cell = time_cell(document, "vanilla", 64);
    CHECK(std::string(cell.attribute("data-value").value()) == "5.5");
    const std::string tooltip = cell.attribute("title").value();
    CHECK(tooltip.find("median 5.500 ms; p10–p90 1.900–9.100 ms; min–max 1.000–10.00 ms") != std::string::npos);
    CHECK(tooltip.find("10 samples") != std::string::npos);
    CHECK(std::string(cell.child("span").text().get()) == "±55.0%");
    // A point that did not run: no value (sorted last), its reason on hover.
    const pugi::xml_node error = time_cell(document, "exact-tiled", 128);
    CHECK(std::string(error.text().get()) == "error");
    CHECK(!error.attribute("data-value"));
    CHECK(std::string(error.attribute("title").value()) == "error: " + kHostileReason);
    // Headers say which columns sort numerically.
    const auto headers = select(document, "//div[@data-metric='time']/table/thead/tr/th");
    REQUIRE(headers.size() >= 4);
    CHECK(std::string(headers[1].attribute("data-numeric").value()) == "false");  // model
    CHECK(std::string(headers[2].attribute("data-numeric").value()) == "true");   // N=64
  }

  TEST_CASE("report strings are escaped; the page names no URL in its markup and loads nothing") {
    const std::string page = render_html_report({named("<a>&.json", forward_rows())}, {});
    const auto document = parse(page);
    CHECK(page.find("<i>boom") == std::string::npos);
    CHECK(page.find("a<b") == std::string::npos);
    CHECK(page.find("Test CPU <x>") == std::string::npos);
    CHECK(page.find("&lt;i&gt;boom&lt;/i&gt; &amp; &quot;x&quot; https://example.com/?a=1&amp;b=2") !=
          std::string::npos);
    CHECK(select(document, "//td[text()='Test CPU <x>']").size() == 1);
    CHECK(select(document, "//section[@data-file='<a>&.json']").size() == 1);
    bool hostile_row = false;
    for (const auto& td : select(document, "//td")) hostile_row = hostile_row || td.text().get() == kHostileModel;
    CHECK(hostile_row);
    // The escaped reason is the only text with a URL; nothing refers outside the page.
    std::string rest = page;
    const std::string escaped = "https://example.com/?a=1&amp;b=2";
    for (auto at = rest.find(escaped); at != std::string::npos; at = rest.find(escaped)) rest.erase(at, escaped.size());
    CHECK(rest.find("http://") == std::string::npos);
    CHECK(rest.find("https://") == std::string::npos);
    CHECK(select(document, "//*[@src]").empty());
    CHECK(select(document, "//link").empty());
    for (const auto& a : select(document, "//*[@href]"))
      CHECK(std::string(a.attribute("href").value()).rfind("#", 0) == 0);
    CHECK(select(document, "//meta[@http-equiv='Content-Security-Policy']").size() == 1);
    // The sorting script is inline.
    const auto scripts = select(document, "//script");
    REQUIRE(scripts.size() == 1);
    CHECK(!scripts.front().attribute("src"));
  }

  TEST_CASE("warnings list skipped, error, contended and unstable points with their reasons") {
    std::vector<ResultRow> rows = forward_rows();
    rows[2].contended = true;
    rows[2].contended_samples = 3;
    rows[2].warnings = {"contended: 3 of 3 timed samples waited for a CPU"};
    const auto document = parse(render_html_report({named("a.json", rows)}, {}));
    const auto table = select(document, "//table[@class='xr-warnings']");
    REQUIRE(table.size() == 1);
    CHECK(std::string(table.front().attribute("data-sortable").value()) == "true");
    std::vector<std::string> kinds, reasons;
    for (const auto& row : select(table.front(), "tbody/tr")) {
      const auto cells = select(row, "td");
      REQUIRE(cells.size() == 5);
      kinds.push_back(cells[0].text().get());
      reasons.push_back(cells[4].text().get());
    }
    CHECK(kinds == std::vector<std::string>{"unstable", "contended", "error", "skipped"});
    CHECK(reasons[1] == "contended: 3 of 3 timed samples waited for a CPU");
    CHECK(reasons[2] == kHostileReason);
    CHECK(reasons[3] == "estimated memory 2 GiB exceeds --memory-limit");
  }

  TEST_CASE("decode rows get a state table; without baseline rows the ratio tables say so") {
    std::vector<ResultRow> rows = {timed("exact-tiled", 64, {0.01, 0.01}), timed("exact-tiled", 128, {0.02, 0.02})};
    for (auto& row : rows) {
      row.pass = Pass::Decode;
      row.causal = true;
      row.decode_tokens = 4;
      row.state_bytes = 1 << 20;
    }
    const std::string page = render_html_report({named("a.json", rows), named("b.json", forward_rows())}, {});
    const auto document = parse(page);
    CHECK(select(document, "//section[@class='xr-report']").size() == 2);
    const auto state = select(document, "//section[@id='r1']//div[@data-metric='state']/table");
    REQUIRE(state.size() == 1);
    CHECK(select(state.front(), ".//td[@data-value='1']").size() == 2);  // 1 MiB at both lengths
    CHECK(select(document, "//section[@id='r1']//div[@data-metric='speedup']/table").empty());
    CHECK(select(document, "//section[@id='r1']//div[@data-metric='speedup']/p[@class='xr-empty']").size() == 1);
    CHECK(select(document, "//section[@id='r2']//div[@data-metric='speedup']/table").size() == 1);
    // Decode time cells are µs per generated token.
    CHECK(select(document, "//section[@id='r1']//div[@data-metric='time']//td[@data-value='10']").size() == 1);
    // The contents link to both reports and their configurations.
    CHECK(select(document, "//nav//a[@href='#r2-c1']").size() == 1);
  }
}
