#pragma once
// One self-contained HTML page of one or more reports (`xfbench report`): no network access, no
// external script, style or font (a Content-Security-Policy forbids loading anything), every string
// from a report escaped. Per report: its context and settings; its warnings (contended and
// unstable points, skipped, unsupported and error rows with their reasons); per configuration
// (configuration_text) every table `xfbench table` renders, with each timed point's spread (CV
// shown, p10–p90 and min–max in the cell's tooltip), next to the matching plot's SVG inline; and
// a table of every point with its spread as columns.
//
// The page is also well-formed XML (the script sits in a CDATA section), so tests can parse it.
// Structure tests and scripts rely on:
//   <section class="xr-report" data-file="…"> … <section class="xr-configuration"
//   data-configuration="…"> … <div class="xr-metric" data-metric="time|speedup|…">
//   <table class="xr-table" data-sortable="true"> … <td data-value="…"> (numeric cells) …
//   <figure class="xr-plot"><svg …>; <table class="xr-warnings" data-sortable="true">;
//   <table class="xr-points" data-sortable="true">. Clicking a header of a sortable table sorts by that
// column (numerically when its cells carry data-value; cells without a value last); the script
// marks each table it set up with data-sort-ready="true".
#include <string>
#include <vector>

#include "apps/report/merge.hpp"
#include "apps/report/report.hpp"

namespace xfb {

struct HtmlReportOptions {
  std::string baseline = "vanilla";  // of the speed-up and memory-ratio tables and the speed-up plot
  std::string generator;             // "xfbench 0.1.0 (commit …)": shown in the page's header
};

// Throws InputError when a table would be too large (render_table's limits).
std::string render_html_report(const std::vector<NamedReport>& reports, const HtmlReportOptions& options);

}  // namespace xfb
