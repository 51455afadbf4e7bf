// JSON report round trip and schema checks, atomic writes, tables, .npy dumps, and the layer
// scope recomputed naively from a dump.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "apps/bench/point.hpp"
#include "apps/report/report.hpp"
#include "apps/report/table.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/npy.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("xfbench-test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

ResultRow sample_row(const std::string& model, std::int64_t n, double median_ns) {
  ResultRow row;
  row.model = model;
  row.classes = {"exact"};
  row.batch = 1;
  row.heads = 8;
  row.seq_len = n;
  row.head_dim = 64;
  row.samples_ns = {median_ns, median_ns * 1.01, median_ns * 0.99};
  row.median_ns = median_ns;
  row.min_ns = median_ns * 0.99;
  row.max_ns = median_ns * 1.01;
  row.flops = 123456789;
  row.gflops_per_s = median_ns > 0 ? static_cast<double>(row.flops) / median_ns : 0.0;
  row.peak_tensor_bytes = 1 << 20;
  row.reproducer = "xfbench run --model " + model;
  return row;
}

PointConfig point(const std::string& model, std::int64_t n, Scope scope) {
  PointConfig c;
  c.model = model;
  c.problem = {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = true};
  c.scope = scope;
  c.d_ff = 24;
  c.timing = {.warmup = 1, .min_reps = 2, .min_time_s = 0, .max_reps = 2};
  return c;
}
}  // namespace

TEST_SUITE("report") {
  TEST_CASE("a report survives a JSON round trip with every required field") {
    Report report;
    report.context = {{"cpu_model", "test"}, {"threads", 2}};
    report.settings = {{"seq_lens", {256}}};
    report.results.push_back(sample_row("vanilla", 256, 1e6));
    report.results.back().stage_median_ns = {{"route", 2.5e5}, {"attend", 7.5e5}};
    ResultRow skipped = sample_row("exact-tiled", 256, 0);
    skipped.status = Status::Skipped;
    skipped.reason = "memory";
    report.results.push_back(skipped);
    const auto j = report_to_json(report);
    CHECK(j["schema_version"] == kSchemaVersion);
    for (const char* field : {"model",
                              "classes",
                              "scope",
                              "causal",
                              "batch",
                              "heads",
                              "seq_len",
                              "head_dim",
                              "params",
                              "status",
                              "reason",
                              "samples_ns",
                              "median_ns",
                              "min_ns",
                              "mad_ns",
                              "cv",
                              "unstable",
                              "flops",
                              "gflops_per_s",
                              "tokens_per_s",
                              "peak_tensor_bytes",
                              "workspace_bytes",
                              "peak_rss_bytes",
                              "reproducer"})
      CHECK_MESSAGE(j["results"][0].contains(field), field);
    const Report back = report_from_json(nlohmann::json::parse(j.dump()));
    REQUIRE(back.results.size() == 2);
    CHECK(back.results[0].samples_ns == report.results[0].samples_ns);
    CHECK(back.results[0].stage_median_ns == report.results[0].stage_median_ns);
    CHECK(back.results[1].stage_median_ns.empty());
    CHECK(back.results[0].key() == report.results[0].key());
    CHECK(back.results[1].status == Status::Skipped);
    CHECK(back.context == report.context);
  }

  TEST_CASE("malformed reports and future schemas are input errors") {
    CHECK_THROWS_AS(report_from_json(nlohmann::json::array()), InputError);
    CHECK_THROWS_AS(report_from_json({{"schema_version", kSchemaVersion + 1}, {"results", nlohmann::json::array()}}),
                    InputError);
    CHECK_THROWS_AS(report_from_json({{"schema_version", kSchemaVersion}}), InputError);
    CHECK_THROWS_AS(report_from_json({{"schema_version", kSchemaVersion}, {"results", {{{"model", "x"}}}}}),
                    InputError);
    const auto dir = temp_dir("bad");
    std::ofstream(dir / "broken.json") << "{ not json";
    CHECK_THROWS_AS(load_report((dir / "broken.json").string()), InputError);
    CHECK_THROWS_AS(load_report((dir / "missing.json").string()), InputError);
    fs::remove_all(dir);
  }

  TEST_CASE("atomic save leaves no temporary file and replaces the old report") {
    const auto dir = temp_dir("atomic");
    const auto path = (dir / "r.json").string();
    Report report;
    report.results.push_back(sample_row("vanilla", 128, 5e5));
    save_report_atomically(report, path);
    report.results.push_back(sample_row("vanilla", 256, 9e5));
    save_report_atomically(report, path);
    CHECK(load_report(path).results.size() == 2);
    CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == 1);  // no temporary left
    fs::remove_all(dir);
  }

  TEST_CASE("tables: speed-up, memory, Markdown and CSV") {
    Report report;
    report.results.push_back(sample_row("vanilla", 1024, 4e6));
    report.results.push_back(sample_row("exact-tiled", 1024, 2e6));
    ResultRow failed = sample_row("exact-tiled", 2048, 0);
    failed.status = Status::Error;
    report.results.push_back(failed);
    report.results.push_back(sample_row("vanilla", 2048, 16e6));
    const auto speedup = render_table(report, {.metric = TableMetric::Speedup, .format = TableFormat::Markdown});
    CHECK(speedup.find("| exact") != std::string::npos);
    CHECK(speedup.find("2.00×") != std::string::npos);
    CHECK(speedup.find("error") != std::string::npos);
    const auto csv = render_table(report, {.metric = TableMetric::Memory, .format = TableFormat::Csv});
    CHECK(csv.find("scope,pass,causal,batch,heads,head_dim,class,model,N=1024,N=2048") == 0);
    CHECK(csv.find("exact,vanilla,1.0,1.0") != std::string::npos);
    Report sized;
    for (auto [model, bytes] : {std::pair{"vanilla", 4 << 20}, {"exact-tiled", 1 << 20}}) {
      ResultRow row = sample_row(model, 1024, 1e6);
      row.peak_tensor_bytes = bytes;
      sized.results.push_back(row);
    }
    const auto ratio = render_table(sized, {.metric = TableMetric::MemoryRatio, .format = TableFormat::Markdown});
    CHECK(ratio.find("0.250×") != std::string::npos);
    CHECK(ratio.find("1.000×") != std::string::npos);
    const auto text = render_table(report, {});
    CHECK(text.find("4.000") != std::string::npos);
  }

  TEST_CASE("tables: every measured figure carries its row's stability marks (~ unstable, ! contended)") {
    Report report;
    report.context["fma_peak_gflops"] = 100.0;
    report.results.push_back(sample_row("vanilla", 1024, 4e6));
    ResultRow shaky = sample_row("exact-tiled", 1024, 2e6);
    shaky.unstable = true;
    shaky.contended = true;
    report.results.push_back(shaky);
    const auto line_of = [](const std::string& table, const std::string& model) {
      const auto start = table.find("| " + model + " ");
      REQUIRE(start != std::string::npos);
      return table.substr(start, table.find('\n', start) - start);
    };
    const auto with = [&](TableMetric metric) {
      return render_table(report, {.metric = metric, .format = TableFormat::Markdown});
    };
    CHECK(line_of(with(TableMetric::Time), "exact-tiled").find("2.000~!") != std::string::npos);
    CHECK(line_of(with(TableMetric::Speedup), "exact-tiled").find("2.00×~!") != std::string::npos);
    CHECK(line_of(with(TableMetric::Gflops), "exact-tiled").find("61.7~! (62%)") != std::string::npos);
    for (TableMetric metric : {TableMetric::Time, TableMetric::Speedup, TableMetric::Gflops}) {
      const auto steady = line_of(with(metric), "vanilla");
      CHECK_MESSAGE(steady.find_first_of("~!") == std::string::npos, steady);
    }
    // A peak measured on a busy machine may read low: a share of it is an upper bound.
    report.context["machine_contended"] = true;
    CHECK(line_of(with(TableMetric::Gflops), "vanilla").find("30.9 (≤31%)") != std::string::npos);
  }

  TEST_CASE("npy files round trip") {
    const auto dir = temp_dir("npy");
    Tensor t(Shape{3, 1, 5});
    for (std::int64_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(i) * 0.5f - 2.0f;
    write_npy((dir / "t.npy").string(), t);
    const Tensor back = read_npy((dir / "t.npy").string());
    CHECK(back.shape() == t.shape());
    for (std::int64_t i = 0; i < t.size(); ++i) CHECK(back[i] == t[i]);
    const auto bytes = fs::file_size(dir / "t.npy");
    CHECK((bytes - static_cast<std::uintmax_t>(t.bytes())) % 64 == 0);
    fs::remove_all(dir);
  }

  TEST_CASE("--dump writes inputs, output and a manifest that reproduce the attention output") {
    const auto dir = temp_dir("dump");
    const auto row = run_point(point("vanilla", 19, Scope::Attention), dir.string());
    REQUIRE(row.status == Status::Ok);
    std::ifstream manifest_file(dir / "manifest.json");
    const auto manifest = nlohmann::json::parse(manifest_file);
    CHECK(manifest["seq_len"] == 19);
    CHECK(manifest["files"].size() == 4);
    const Tensor q = read_npy((dir / "q.npy").string()), k = read_npy((dir / "k.npy").string()),
                 v = read_npy((dir / "v.npy").string()), out = read_npy((dir / "out.npy").string());
    const Problem p{.batch = 2, .heads = 2, .seq_len = 19, .head_dim = 8, .causal = true};
    test::check_against_reference(out, {q.clone(), k.clone(), v.clone()}, p, test::causal_mask, "dumped vanilla");
    fs::remove_all(dir);
  }

  TEST_CASE("the manifest records the values that ran, derived defaults computed and blocks clamped") {
    struct Case {
      const char* model;
      std::vector<std::string> params;
      const char* key;
      std::int64_t requested, ran;
    };
    // N = 100: clusters round(√N) = 10, stride ⌈√N⌉ = 10, cols 10, chunk ⌈N/10⌉ = 10, block 50 → 50,
    // block 500 → N, linformer k 256 → N.
    for (const Case& c : {Case{"routing", {}, "clusters", 0, 10}, Case{"sparse-transformer", {}, "stride", 0, 10},
                          Case{"axial", {}, "cols", 0, 10}, Case{"reformer", {"chunk_len=0"}, "chunk_len", 0, 10},
                          Case{"local", {"block=500"}, "block", 500, 100}, Case{"linformer", {}, "k", 256, 100}}) {
      const auto dir = temp_dir("manifest");
      PointConfig config = point(c.model, 100, Scope::Attention);
      config.problem.causal = false;  // linformer has no causal mode
      config.params = c.params;
      REQUIRE(run_point(config, dir.string()).status == Status::Ok);
      std::ifstream manifest_file(dir / "manifest.json");
      const auto manifest = nlohmann::json::parse(manifest_file);
      CAPTURE(c.model);
      CHECK(manifest["requested_params"][c.key] == c.requested);
      CHECK(manifest["params"][c.key] == c.ran);
      fs::remove_all(dir);
    }
  }

  TEST_CASE("layer scope equals a naive pre-LN encoder layer recomputed from the dump") {
    const auto dir = temp_dir("layer");
    const std::int64_t n = 13, b = 2, h = 2, d = 8, e = h * d, f = 24;
    const auto row = run_point(point("exact-tiled", n, Scope::Layer), dir.string());
    REQUIRE(row.status == Status::Ok);
    auto load = [&](const char* name) { return read_npy((dir / (std::string(name) + ".npy")).string()); };
    const Tensor x = load("x"), out = load("out"), w_qkv = load("layer_w_qkv"), w_o = load("layer_w_o"),
                 w_1 = load("layer_w_1"), w_2 = load("layer_w_2");
    using Matrix = std::vector<double>;
    auto layer_norm = [&](const Matrix& in) {
      Matrix result(in.size());
      for (std::int64_t t = 0; t < b * n; ++t) {
        double mean = 0, var = 0;
        for (std::int64_t c = 0; c < e; ++c) mean += in[t * e + c];
        mean /= e;
        for (std::int64_t c = 0; c < e; ++c) var += (in[t * e + c] - mean) * (in[t * e + c] - mean);
        var /= e;
        for (std::int64_t c = 0; c < e; ++c) result[t * e + c] = (in[t * e + c] - mean) / std::sqrt(var + 1e-5);
      }
      return result;
    };
    auto product = [&](const Matrix& a, const Tensor& w, std::int64_t rows, std::int64_t inner, std::int64_t cols) {
      Matrix result(static_cast<std::size_t>(rows * cols), 0.0);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t p = 0; p < inner; ++p)
          for (std::int64_t c = 0; c < cols; ++c) result[r * cols + c] += a[r * inner + p] * w[p * cols + c];
      return result;
    };
    Matrix xs(x.values().begin(), x.values().end());
    const Matrix qkv = product(layer_norm(xs), w_qkv, b * n, e, 3 * e);
    Matrix attention(static_cast<std::size_t>(b * n * e), 0.0);
    for (std::int64_t bi = 0; bi < b; ++bi)
      for (std::int64_t head = 0; head < h; ++head) {
        std::vector<float> q(n * d), k(n * d), v(n * d);
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t c = 0; c < d; ++c) {
            const auto base = (bi * n + t) * 3 * e + head * d + c;
            q[t * d + c] = static_cast<float>(qkv[base]);
            k[t * d + c] = static_cast<float>(qkv[base + e]);
            v[t * d + c] = static_cast<float>(qkv[base + 2 * e]);
          }
        const auto o =
            test::reference_attention(q.data(), k.data(), v.data(), n, n, d, 1.0 / std::sqrt(8.0), test::causal_mask);
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t c = 0; c < d; ++c) attention[(bi * n + t) * e + head * d + c] = o[t * d + c];
      }
    Matrix hidden = product(attention, w_o, b * n, e, e);
    for (std::size_t i = 0; i < hidden.size(); ++i) hidden[i] += xs[i];
    Matrix ffn = product(layer_norm(hidden), w_1, b * n, e, f);
    for (auto& value : ffn) value = 0.5 * value * (1 + std::erf(value / std::sqrt(2.0)));
    Matrix y = product(ffn, w_2, b * n, f, e);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += hidden[i];
    double worst = 0, largest = 0;
    for (std::size_t i = 0; i < y.size(); ++i) {
      worst = std::max(worst, std::fabs(out[static_cast<std::int64_t>(i)] - y[i]));
      largest = std::max(largest, std::fabs(y[i]));
    }
    // Four chained products of width ≤ 48 and two normalisations in fp32.
    CHECK(worst <= 64 * test::kFloatEps * static_cast<double>(f) * (largest + 1));
    fs::remove_all(dir);
  }
}
