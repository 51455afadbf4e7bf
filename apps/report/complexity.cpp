#include "apps/report/complexity.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "apps/report/table.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {

std::string big_o_name(BigO c) {
  switch (c) {
    case BigO::N:
      return "N";
    case BigO::NLogN:
      return "N log N";
    case BigO::NSqrtN:
      return "N√N";
    case BigO::NSquared:
      return "N²";
  }
  return "?";
}

std::string per_token_name(BigO c) {
  switch (c) {
    case BigO::N:
      return "1";
    case BigO::NLogN:
      return "log N";
    case BigO::NSqrtN:
      return "√N";
    case BigO::NSquared:
      return "N";
  }
  return "?";
}

double big_o_value(BigO c, double n) {
  switch (c) {
    case BigO::N:
      return n;
    case BigO::NLogN:
      return n * std::log2(n);
    case BigO::NSqrtN:
      return n * std::sqrt(n);
    case BigO::NSquared:
      return n * n;
  }
  return 0;
}

BigOFit fit_big_o(const std::vector<double>& n, const std::vector<double>& y) {
  if (n.size() != y.size() || n.size() < 2) throw std::invalid_argument("fit_big_o needs at least two points");
  double mean = 0;
  for (double v : y) mean += v;
  mean /= static_cast<double>(y.size());
  BigOFit result;
  double best = INFINITY;
  for (std::size_t c = 0; c < kBigOCandidates.size(); ++c) {
    double gy = 0, gg = 0;
    for (std::size_t i = 0; i < n.size(); ++i) {
      const double g = big_o_value(kBigOCandidates[c], n[i]);
      gy += g * y[i];
      gg += g * g;
    }
    if (!(gg > 0)) throw std::invalid_argument("fit_big_o needs positive sequence lengths");
    const double coefficient = gy / gg;
    double squares = 0;
    for (std::size_t i = 0; i < n.size(); ++i) {
      const double residual = y[i] - coefficient * big_o_value(kBigOCandidates[c], n[i]);
      squares += residual * residual;
    }
    const double rms = std::sqrt(squares / static_cast<double>(n.size()));
    result.nrms[c] = mean != 0 ? rms / std::fabs(mean) : rms;
    if (result.nrms[c] < best) {
      best = result.nrms[c];
      result.best = kBigOCandidates[c];
      result.coefficient = coefficient;
    }
  }
  return result;
}

double loglog_exponent(const std::vector<double>& n, const std::vector<double>& y) {
  if (n.size() != y.size() || n.size() < 2) throw std::invalid_argument("loglog_exponent needs at least two points");
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < n.size(); ++i) {
    if (!(n[i] > 0 && y[i] > 0)) throw std::invalid_argument("loglog_exponent needs positive values");
    mx += std::log(n[i]);
    my += std::log(y[i]);
  }
  mx /= static_cast<double>(n.size());
  my /= static_cast<double>(n.size());
  double sxy = 0, sxx = 0;
  for (std::size_t i = 0; i < n.size(); ++i) {
    sxy += (std::log(n[i]) - mx) * (std::log(y[i]) - my);
    sxx += (std::log(n[i]) - mx) * (std::log(n[i]) - mx);
  }
  if (!(sxx > 0)) throw std::invalid_argument("loglog_exponent needs two distinct lengths");
  return sxy / sxx;
}

namespace {

std::string normalised(const std::string& printed) {
  std::string out;
  for (char c : printed)
    if (c != ' ') out += c == 'n' ? 'N' : c;
  return out;
}

struct Mapping {
  const char* printed;  // as normalised: no spaces, n → N
  BigO cls;
  bool ambiguous;
  const char* note;
};

// The survey's Table 1 strings (v1 and the revision's, and LRA's local attention) with hyperparameters held fixed.
constexpr Mapping kMappings[] = {
    {"O(N)", BigO::N, false, ""},
    {"O(kN)", BigO::N, false, "k fixed"},
    {"O(N·m)", BigO::N, false, "memory flange m fixed"},
    {"O(N·b)", BigO::N, false, "block b fixed"},
    {"O(N(k+m))", BigO::N, false, "window k and global tokens m fixed"},
    {"O(NlogN)", BigO::NLogN, false, ""},
    {"O(N√N)", BigO::NSqrtN, false, ""},
    {"O(N²)", BigO::NSquared, false, ""},
    {"O(N_c²)", BigO::NSquared, false, "N_c = N/c with compression c fixed"},
    {"O(B²)", BigO::NSquared, true,
     "B is a block size: block attention is O(N·B), only the block-sorting step grows as (N/B)²"},
    {"O(N_g²+N·N_g)", BigO::N, true, "linear when the global tokens N_g are fixed, quadratic when they grow with N"},
    {"O(k²)", BigO::N, false,
     "TokenLearner: attention over its k learned tokens is O(k²), constant in N; pooling N tokens into them is "
     "O(N·k), linear"},
};

// Per-token decoding costs (ModelCard::decode_cost), as the class of N tokens' cost.
constexpr Mapping kDecodeMappings[] = {
    {"O(1)", BigO::N, false, ""},
    {"O(b)", BigO::N, false, "block b fixed"},
    {"O(l)", BigO::N, false, "projected length l fixed"},
    {"O(l_q+l_m)", BigO::N, false, "query block and memory flange fixed"},
    {"O(w+g)", BigO::N, false, "window w and global tokens g fixed"},
    {"O(L+M)", BigO::N, false, "segment L and memory M fixed"},
    {"O(L+M+M_c)", BigO::N, false, "segment, memory and compressed memory fixed"},
    {"O(√N)", BigO::NSqrtN, false, ""},
    {"O(N)", BigO::NSquared, false, ""},
    {"O(N_c)", BigO::NSquared, false, "N_c = N/c with compression c fixed"},
    {"O(b+N/b)", BigO::NSquared, true,
     "Sinkhorn: its block (constant) plus each block opening's mixing of all past blocks (N/b per token, amortised): N "
     "only where the mixing dominates"},
    {"O(N_r·m)", BigO::N, false, "hash rounds n_r and chunk length m fixed"},
    {"O(N/k)", BigO::NSquared, true, "N when the cluster count k is fixed, √N when k grows as √N"},
    {"O(rN/l+w)", BigO::NSquared, true,
     "Long-Short: r compressed rows per complete chunk of l (growing with N) plus the fixed window w: N only once rN/l "
     "outweighs w (past 8K tokens at the defaults)"},
};

ExpectedComplexity lookup(const std::string& printed, const Mapping* begin, const Mapping* end) {
  const std::string key = normalised(printed);
  for (const Mapping* m = begin; m != end; ++m)
    if (key == m->printed) return {true, m->cls, m->ambiguous, m->note};
  return {};
}

}  // namespace

ExpectedComplexity expected_complexity(const std::string& printed) {
  return lookup(printed, std::begin(kMappings), std::end(kMappings));
}

ExpectedComplexity expected_decode_complexity(const std::string& printed) {
  return lookup(printed, std::begin(kDecodeMappings), std::end(kDecodeMappings));
}

std::string survey_text(const ComplexitySeries& s) {
  return s.survey_revision.empty() ? s.survey : s.survey + "; rev. " + s.survey_revision;
}

std::string verdict_name(ComplexityVerdict v) {
  switch (v) {
    case ComplexityVerdict::Match:
      return "match";
    case ComplexityVerdict::MatchRevision:
      return "match (revision)";
    case ComplexityVerdict::Mismatch:
      return "MISMATCH";
    case ComplexityVerdict::Ambiguous:
      return "ambiguous";
    case ComplexityVerdict::Unmapped:
      return "unmapped";
  }
  return "?";
}

namespace {

MetricFit fit_metric(const std::vector<double>& n, const std::vector<double>& y) {
  MetricFit fit;
  for (double v : y)
    if (!(v > 0)) return fit;
  fit.exponent = loglog_exponent(n, y);
  fit.fit = fit_big_o(n, y);
  return fit;
}

}  // namespace

ComplexitySeries analyse_series(const std::vector<const ResultRow*>& rows) {
  ComplexitySeries series;
  if (rows.empty()) return series;
  const ResultRow& first = *rows.front();
  series.model = first.model;
  series.label = first.model;
  series.configuration = configuration_text(first);
  const ModelCard* info = find_card(first.model);
  series.per_token = first.pass == Pass::Decode;
  series.survey = info ? (series.per_token ? info->decode_cost : info->complexity) : "?";
  series.expected = series.per_token ? expected_decode_complexity(series.survey) : expected_complexity(series.survey);
  if (info && !series.per_token && !info->revised_complexity.empty()) {
    series.survey_revision = info->revised_complexity;
    series.expected_revision = expected_complexity(series.survey_revision);
  }
  std::map<std::int64_t, const ResultRow*> by_length;
  for (const auto* row : rows)
    if (row->status == Status::Ok) by_length[row->seq_len] = row;
  std::vector<double> n, time, flops, workspace;
  for (const auto& [length, row] : by_length) {
    series.lengths.push_back(length);
    const double tokens = static_cast<double>(length);
    n.push_back(tokens);
    if (series.per_token) {  // N × the per-token figures (see per_token_name)
      time.push_back(row->median_ns * tokens);
      flops.push_back(static_cast<double>(row->flops) /
                      static_cast<double>(std::max<std::int64_t>(1, row->decode_tokens)) * tokens);
      workspace.push_back(static_cast<double>(row->state_bytes) * tokens);
    } else {
      time.push_back(row->median_ns);
      flops.push_back(static_cast<double>(row->flops));
      workspace.push_back(static_cast<double>(row->workspace_bytes));
    }
  }
  if (n.size() < 3) return series;
  series.time = fit_metric(n, time);
  series.flops = fit_metric(n, flops);
  series.workspace = fit_metric(n, workspace);
  if (series.per_token)  // log(N·y) has slope one more than log y
    for (MetricFit* fit : {&series.time, &series.flops, &series.workspace})
      if (fit->exponent) *fit->exponent -= 1.0;
  if (!series.expected.known || !series.flops.fit)
    series.verdict = ComplexityVerdict::Unmapped;
  else if (series.expected.ambiguous)
    series.verdict = ComplexityVerdict::Ambiguous;
  else if (series.flops.fit->best == series.expected.cls)
    series.verdict = ComplexityVerdict::Match;
  else if (series.expected_revision.known && !series.expected_revision.ambiguous &&
           series.flops.fit->best == series.expected_revision.cls)
    series.verdict = ComplexityVerdict::MatchRevision;
  else
    series.verdict = ComplexityVerdict::Mismatch;
  return series;
}

std::vector<ComplexitySeries> analyse_complexity(const Report& report, std::vector<std::string>* skipped,
                                                 const std::string& baseline) {
  std::map<std::string, std::vector<const ResultRow*>> groups;
  std::vector<std::string> order;
  std::map<std::string, std::set<std::string>> settings_per_model;
  std::map<std::string, RowsByLength> reference;  // by configuration: the baseline's first row per length
  for (const auto& row : report.results) {
    settings_per_model[configuration_text(row) + "|" + row.model].insert(row.params.dump());
    if (row.model == baseline) reference[configuration_text(row)].emplace(row.seq_len, &row);
  }
  for (const auto& row : report.results) {
    const std::string key = configuration_text(row) + "|" + row.model + "|" + row.params.dump();
    if (!groups.count(key)) order.push_back(key);
    groups[key].push_back(&row);
  }
  std::vector<ComplexitySeries> result;
  for (const auto& key : order) {
    ComplexitySeries series = analyse_series(groups[key]);
    const ResultRow& first = *groups[key].front();
    if (settings_per_model[configuration_text(first) + "|" + first.model].size() > 1)
      series.label += " (" + params_text(first.params) + ")";
    if (series.lengths.size() < 3) {
      if (skipped)
        skipped->push_back(series.label + " [" + series.configuration + "]: " + std::to_string(series.lengths.size()) +
                           " ok sequence length(s), needs 3");
      continue;
    }
    RowsByLength rows;
    for (const auto* row : groups[key]) rows[row->seq_len] = row;
    series.baseline = baseline;
    series.crossover = crossovers(rows, reference[series.configuration]);
    result.push_back(std::move(series));
  }
  return result;
}

namespace {

std::string fixed(double value, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

std::string exponent_text(const MetricFit& f) { return f.exponent ? fixed(*f.exponent, 2) : "-"; }

std::string class_text(BigO c, bool per_token) { return per_token ? per_token_name(c) : big_o_name(c); }

std::string fit_text(const MetricFit& f, bool per_token) {
  return f.fit ? class_text(f.fit->best, per_token) + " (" + fixed(f.fit->best_nrms(), 3) + ")" : "-";
}

nlohmann::json metric_json(const MetricFit& f, bool per_token) {
  if (!f.fit) return nullptr;
  nlohmann::json nrms = nlohmann::json::object();
  for (std::size_t c = 0; c < kBigOCandidates.size(); ++c)
    nrms[class_text(kBigOCandidates[c], per_token)] = f.fit->nrms[c];
  return {{"exponent", *f.exponent},
          {"best", class_text(f.fit->best, per_token)},
          {"coefficient", f.fit->coefficient},
          {"nrms", nrms}};
}

std::string expected_text(const ExpectedComplexity& e, bool per_token) {
  if (!e.known) return "?";
  return class_text(e.cls, per_token) + (e.ambiguous ? "?" : "");
}

std::string expected_cell(const ComplexitySeries& s) {
  const std::string v1 = expected_text(s.expected, s.per_token);
  return s.survey_revision.empty() ? v1 : v1 + "; rev. " + expected_text(s.expected_revision, s.per_token);
}

// The series' crossover against the baseline, null where there is none.
nlohmann::json crossover_field(const ComplexitySeries& s) {
  if (!s.crossover) return nullptr;
  return {{"baseline", s.baseline},
          {"time", crossover_json(s.crossover->time)},
          {"memory", crossover_json(s.crossover->memory)}};
}

}  // namespace

std::string render_complexity(const std::vector<ComplexitySeries>& series, const std::vector<std::string>& skipped,
                              ComplexityFormat format) {
  if (format == ComplexityFormat::Json) {
    nlohmann::json out = {{"series", nlohmann::json::array()}, {"skipped", skipped}};
    for (const auto& s : series)
      out["series"].push_back(
          {{"model", s.model},
           {"label", s.label},
           {"configuration", s.configuration},
           {"seq_lens", s.lengths},
           {"survey", s.survey},
           {"per_token", s.per_token},
           {"expected",
            s.expected.known ? nlohmann::json(class_text(s.expected.cls, s.per_token)) : nlohmann::json(nullptr)},
           {"expected_ambiguous", s.expected.ambiguous},
           {"expected_note", s.expected.note},
           {"survey_revision", s.survey_revision.empty() ? nlohmann::json(nullptr) : nlohmann::json(s.survey_revision)},
           {"expected_revision", s.expected_revision.known ? nlohmann::json(class_text(s.expected_revision.cls, false))
                                                           : nlohmann::json(nullptr)},
           {"time", metric_json(s.time, s.per_token)},
           {"flops", metric_json(s.flops, s.per_token)},
           {s.per_token ? "state_bytes" : "workspace_bytes", metric_json(s.workspace, s.per_token)},
           {"verdict", verdict_name(s.verdict)},
           {"crossover", crossover_field(s)}});
    return out.dump(2) + "\n";
  }
  const bool md = format == ComplexityFormat::Markdown;
  std::vector<std::vector<std::string>> cells = {{"model", "configuration", "N", "survey", "expected", "time ~N^k",
                                                  "time fit (nRMS)", "flops ~N^k", "flops fit (nRMS)", "workspace ~N^k",
                                                  "workspace fit (nRMS)", "verdict"}};
  for (const auto& s : series)
    cells.push_back({s.label, s.configuration,
                     std::to_string(s.lengths.front()) + "–" + std::to_string(s.lengths.back()) + " (" +
                         std::to_string(s.lengths.size()) + ")",
                     survey_text(s), expected_cell(s), exponent_text(s.time), fit_text(s.time, s.per_token),
                     exponent_text(s.flops), fit_text(s.flops, s.per_token), exponent_text(s.workspace),
                     fit_text(s.workspace, s.per_token), verdict_name(s.verdict)});
  std::ostringstream out;
  out << render_cells(cells, md ? TableFormat::Markdown : TableFormat::Text, 2);
  if (series.empty()) out << "(no model with three or more ok sequence lengths)\n";
  out << (md ? "\n" : "") << "verdict compares the FLOP-count fit with the survey's complexity (v1's, else the "
      << "revision's: 'match (revision)'); '?' marks an ambiguous "
      << "survey string (see docs/cli.md#complexity); decode rows fit per-token time and FLOPs and the state "
      << "(in the workspace columns) against 1, log N, √N, N\n";
  for (const auto& line : skipped) out << (md ? "- " : "") << "not fitted: " << line << "\n";
  return out.str();
}

}  // namespace xfb
