// The tidy CSV export (apps/report/tidy_csv.hpp): its columns, one line per row, quoting, the
// spread of the samples. tests/cli/cli_tables_test.sh reads it back with Python's csv module.
#include <doctest/doctest.h>

#include <algorithm>

#include "apps/report/point_fields.hpp"
#include "apps/report/tidy_csv.hpp"
#include "lib/core/stats.hpp"

using namespace xfb;

namespace {

ResultRow local_row(std::int64_t n, std::int64_t block, std::vector<double> samples) {
  ResultRow row;
  row.model = "local";
  row.classes = {"fixed_patterns"};
  row.batch = 1;
  row.heads = 2;
  row.head_dim = 16;
  row.seq_len = n;
  row.threads = 2;
  row.seed = 42;
  row.params = {{"block", block}, {"look_back", 1}};
  row.samples_ns = std::move(samples);
  row.median_ns = row.samples_ns.empty() ? 0 : row.samples_ns[row.samples_ns.size() / 2];
  row.min_ns = row.samples_ns.empty() ? 0 : row.samples_ns.front();
  row.max_ns = row.samples_ns.empty() ? 0 : row.samples_ns.back();
  row.flops = 1000;
  row.gflops_per_s = 0.5;
  row.peak_tensor_bytes = 4096;
  row.peak_owned_bytes = 4096;
  return row;
}

}  // namespace

TEST_SUITE("tidy_csv") {
  TEST_CASE("quantiles interpolate between order statistics") {
    CHECK(sample_quantile({4, 1, 3, 2}, 0.5) == doctest::Approx(2.5));
    CHECK(sample_quantile({4, 1, 3, 2}, 0.1) == doctest::Approx(1.3));
    CHECK(sample_quantile({4, 1, 3, 2}, 0.9) == doctest::Approx(3.7));
    CHECK(sample_quantile({4, 1, 3, 2}, 0) == 1);
    CHECK(sample_quantile({4, 1, 3, 2}, 1) == 4);
    CHECK(sample_quantile({7}, 0.9) == 7);
    CHECK(sample_quantile({}, 0.5) == 0);
  }

  TEST_CASE("one line per row: identity from the point's field table, a column per gridded parameter") {
    Report report;
    report.results.push_back(local_row(64, 32, {100, 200, 300, 400, 500}));
    ResultRow skipped = local_row(128, 64, {});
    skipped.status = Status::Skipped;
    skipped.reason = "estimated memory 5 GiB exceeds \"--memory-limit\", see docs/cli.md\nsecond line";
    report.results.push_back(skipped);
    const auto cells = tidy_cells(report);
    REQUIRE(cells.size() == 3);
    std::vector<std::string> identity;
    for (const auto& field : point_fields())
      if (field.from_row && field.key != "model") identity.push_back(field.key);
    CHECK(identity == std::vector<std::string>{"seq_len", "batch", "heads", "head_dim", "scope", "pass",
                                               "decode_tokens", "causal", "d_ff", "ffn", "experts", "capacity_factor",
                                               "group_size", "dtype", "threads", "seed"});
    const std::string csv = tidy_csv(report);
    CHECK(csv.substr(0, csv.find('\n')) ==
          "model,class,classes,seq_len,batch,heads,head_dim,scope,pass,decode_tokens,causal,d_ff,ffn,experts,"
          "capacity_factor,group_size,dtype,threads,seed,"
          "params,param_block,status,reason,samples,median_ns,p10_ns,p90_ns,min_ns,max_ns,cv,unstable,contended,"
          "contended_samples,prefill_ns,peak_tensor_bytes,peak_owned_bytes,workspace_bytes,saved_bytes,state_bytes,"
          "flops,gflops_per_s,tokens_per_s");
    const auto first_line = csv.find('\n') + 1;
    CHECK(csv.substr(first_line, csv.find('\n', first_line) - first_line) ==
          "local,fixed_patterns,fixed_patterns,64,1,2,16,attention,forward,0,false,0,dense,0,0.0,0,f32,2,42,"
          "\"block=32,look_back=1\",32,ok,"
          ",5,300.0,140.0,460.0,100.0,500.0,0.0,false,false,0,0.0,4096,4096,0,0,0,1000,0.5,0.0");
    // A row that is not ok keeps its identity, status and reason; its measurement cells are empty.
    const auto status =
        static_cast<std::size_t>(std::find(cells[0].begin(), cells[0].end(), "status") - cells[0].begin());
    CHECK(cells[2][status] == "skipped");
    for (std::size_t i = status + 2; i < cells[2].size(); ++i) CHECK(cells[2][i].empty());
    CHECK(csv.find(",skipped,\"estimated memory 5 GiB exceeds \"\"--memory-limit\"\", see docs/cli.md\nsecond "
                   "line\",,,") != std::string::npos);
    CHECK(csv.find(",\"block=64,look_back=1\",64,") != std::string::npos);
  }

  TEST_CASE("parameters fixed within each model are not columns; an empty report is its header") {
    Report report;
    report.results.push_back(local_row(64, 32, {1}));
    report.results.push_back(local_row(128, 32, {1}));
    CHECK(tidy_csv(report).find("param_") == std::string::npos);
    const std::string empty = tidy_csv(Report{});
    CHECK(empty.find("model,class,classes,seq_len,") == 0);
    CHECK(std::count(empty.begin(), empty.end(), '\n') == 1);
  }
}
