#pragma once
// Log-log SVG charts of a report: sequence length N on x (log₂), the metric on y (log₁₀), one
// series per model (and parameter setting), coloured by the model's first survey class, one panel
// per configuration (scope, pass, causal, batch, heads, head-dim, decode tokens, d_ff). Points that are not ok, and
// speed-ups without an ok baseline point, are absent and break the series' line; the legend
// names them. Machine-readable structure (tests rely on it):
//   <g class="panel" data-configuration="…">  … <g class="series" data-model="…" data-label="…"
//   data-class="…"> <polyline class="line" …/>… <path class="point" data-n="N" data-value="v"
//   transform="translate(x,y)" …/>… </g>
#include <string>

#include "apps/report/report.hpp"

namespace xfb {

// time: ms per timed call (µs per generated token in decode panels); state: decode rows' state_bytes.
enum class PlotMetric { Time, Memory, Speedup, State };

struct PlotOptions {
  PlotMetric metric = PlotMetric::Time;
  std::string baseline = "vanilla";  // speedup: baseline median / model median
};

// Throws InputError when no point can be drawn.
std::string render_plot(const Report& report, const PlotOptions& options);

}  // namespace xfb
