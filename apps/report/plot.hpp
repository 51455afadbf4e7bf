#pragma once
// Log-log SVG charts of a report: sequence length N on x (log₂), the metric on y (log₁₀), one
// series per model (and parameter setting), one panel per configuration (scope, pass, causal,
// batch, heads, head-dim, decode tokens, d_ff). Each series has its own colour (svg::series_colour,
// in class-then-registry order over the whole document, so a model keeps its colour in every panel;
// past the palette's size colours repeat with a dashed line) and its class's marker
// (svg::class_marker). Time and GFLOP/s series carry a band over the 10th–90th percentile of the
// clean samples (samples_ns) where a row has two samples or more. Every panel title names the
// pass ("forward" too); below it a subtitle gives the CPU, threads, dtype and commit. Groups of
// series every two of which lie within kCoincidePx at every N they share are tagged on the chart
// ("A ×6") and listed below it. Points that are not ok, and speed-ups without an ok baseline point, are
// absent and break the series' line; the legend (beside the chart, in columns when long) names them.
// Machine-readable structure (tests rely on it):
//   <g class="panel" data-configuration="…" data-metric="…"> <text class="title">…
//   <text class="subtitle">… <g class="series" data-model="…" data-label="…" data-class="…"
//   stroke="#colour"> <path class="band" …/>… <polyline class="line" …/>… <path class="point"
//   data-n="N" data-value="v" [data-low="lo" data-high="hi"] transform="translate(x,y)" d="marker"/>…
//   </g> <text class="coincide-tag" data-models="a;b;…">… <text class="coincide">…
#include <string>

#include "apps/report/report.hpp"

namespace xfb {

// time: ms per timed call (µs per generated token in decode panels); gflops: the row's executed
// GFLOP/s (gflops_per_s, as `table --metric gflops`); state: decode rows' state_bytes.
enum class PlotMetric { Time, Memory, Speedup, State, Gflops };

struct PlotOptions {
  PlotMetric metric = PlotMetric::Time;
  std::string baseline = "vanilla";  // speedup: baseline median / model median
};

// Pixels within which two series are said to coincide at an N.
inline constexpr double kCoincidePx = 3;

// Throws InputError when no point can be drawn.
std::string render_plot(const Report& report, const PlotOptions& options);

}  // namespace xfb
