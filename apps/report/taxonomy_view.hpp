#pragma once
// The registry rendered as the survey's Table 1 (Markdown, JSON) and as a diagram of the classes
// with every model placed in its class or in the overlap of its classes, after the survey's
// Figure 2 (SVG). Structure the tests rely on: <ellipse class="class-region" data-class="…" cx cy
// rx ry/> per class, <text class="model" data-model="…" data-classes="FP+M" data-implemented=…
// x y>, the anchor (x, y) inside exactly the regions of the model's classes.
#include <string>

namespace xfb {

enum class TaxonomyFormat { Markdown, Json, Svg };

std::string render_taxonomy(TaxonomyFormat format);

}  // namespace xfb
