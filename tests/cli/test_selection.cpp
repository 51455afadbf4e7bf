// What a sweep runs (apps/bench/selection, apps/cli point grids): model selection with globs,
// classes and exclusions, token counts with K and M, grids of point fields and of parameters, and
// the dry run's listing.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "apps/bench/sweep.hpp"
#include "apps/cli/commands.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/token_count.hpp"
#include "taxonomy/registry.hpp"

using namespace xfb;

namespace {

using Names = std::vector<std::string>;

// The implemented registry names for which `keep` holds, in registry order.
Names registry_names(const std::function<bool(const ModelInfo&)>& keep) {
  Names names;
  for (const auto& model : registry())
    if (model.implemented() && keep(model)) names.push_back(model.name);
  return names;
}

bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

TEST_SUITE("selection") {
  TEST_CASE("token counts: digits with an optional K or M (binary), nothing else") {
    CHECK(parse_token_count("4096") == 4096);
    CHECK(parse_token_count("1K") == 1024);
    CHECK(parse_token_count("16k") == 16384);
    CHECK(parse_token_count("1M") == 1048576);
    CHECK(parse_token_count("0") == 0);
    for (const char* bad :
         {"", "K", "1.5K", "-1", "+1", "1KK", " 1", "1 ", "1e3", "0x10", "1G", "9223372036854775807K"})
      CHECK_MESSAGE(!parse_token_count(bad), bad);
  }

  TEST_CASE("sequence lengths: lists and ranges take 1K, spaces around items are trimmed") {
    CHECK(parse_seq_lens("256,512,1000") == std::vector<std::int64_t>{256, 512, 1000});
    CHECK(parse_seq_lens(" 1K, 2K ,4k") == std::vector<std::int64_t>{1024, 2048, 4096});
    CHECK(parse_seq_lens("1K:16K:x2") == std::vector<std::int64_t>{1024, 2048, 4096, 8192, 16384});
    CHECK(parse_seq_lens("1K:4K:+1K") == std::vector<std::int64_t>{1024, 2048, 3072, 4096});
    CHECK(parse_seq_lens("1000:4500:+1000") == std::vector<std::int64_t>{1000, 2000, 3000, 4000});
    CHECK(parse_seq_lens("1:9223372036854775807:x2").back() == 4611686018427387904);  // no overflow past hi
    for (const char* bad : {"", "0", "-5", "abc", "1.5K", "256:128:x2", "256:512:x1", "256:512:2", "1,,2", "1,", "1:2"})
      CHECK_THROWS_AS(parse_seq_lens(bad), InputError);
  }

  TEST_CASE("model selection: names, globs and classes mixed, in order without repeats; exclusions") {
    CHECK(parse_model_selection("vanilla, local") == Names{"vanilla", "local"});
    const Names formers = registry_names([](const ModelInfo& m) { return ends_with(m.name, "former"); });
    REQUIRE(formers.size() >= 4);  // performer, longformer, reformer, nystromformer, ...
    CHECK(parse_model_selection("*former") == formers);
    Names local_formers = {"local"};
    local_formers.insert(local_formers.end(), formers.begin(), formers.end());
    CHECK(parse_model_selection("local,*former") == local_formers);
    std::erase(local_formers, std::string("longformer"));
    CHECK(parse_model_selection("local,*former", "longformer") == local_formers);

    Names fixed = registry_names([](const ModelInfo& m) { return m.has_class(ModelClass::FixedPatterns); });
    fixed.push_back("performer");
    CHECK(parse_model_selection("class:fixed_patterns,performer") == fixed);
    CHECK(parse_model_selection("class:FP,performer") == fixed);
    CHECK(parse_model_selection("vanilla,class:exact,vanilla") == Names{"vanilla", "exact-tiled"});
    CHECK(parse_model_selection("all", "class:exact").size() == parse_model_selection("all").size() - 2);
    CHECK(parse_model_selection("v?nilla") == Names{"vanilla"});

    CHECK_THROWS_WITH_AS(parse_model_selection("nosuch"), doctest::Contains("unknown model 'nosuch'"), InputError);
    CHECK_THROWS_WITH_AS(parse_model_selection("class:nosuch"), doctest::Contains("unknown class"), InputError);
    CHECK_THROWS_WITH_AS(parse_model_selection("zz*"), doctest::Contains("selects no implemented model"), InputError);
    CHECK_THROWS_WITH_AS(parse_model_selection("vanilla,,local"), doctest::Contains("empty entry"), InputError);
    CHECK_THROWS_WITH_AS(parse_model_selection(""), doctest::Contains("empty entry"), InputError);
    CHECK_THROWS_WITH_AS(parse_model_selection("vanilla", "vanilla"), doctest::Contains("removes every model"),
                         InputError);
    CHECK_THROWS_WITH_AS(parse_model_selection("vanilla", "nosuch"), doctest::Contains("in --exclude"), InputError);
  }

  TEST_CASE("parameter grids: listed values and repeated keys expand into their product") {
    using Sets = std::vector<std::vector<std::string>>;
    CHECK(param_grid({}) == Sets{{}});
    CHECK(param_grid({"block=32"}) == Sets{{"block=32"}});
    CHECK(param_grid({"block=32,64", "window=3"}) == Sets{{"block=32", "window=3"}, {"block=64", "window=3"}});
    CHECK(param_grid({"block=32", "window=3,5", "block=64"}) ==
          Sets{{"block=32", "window=3"}, {"block=32", "window=5"}, {"block=64", "window=3"}, {"block=64", "window=5"}});
    CHECK_THROWS_WITH_AS(param_grid({"block=32,32"}), doctest::Contains("twice"), InputError);
    CHECK_THROWS_WITH_AS(param_grid({"block=32", "block=32"}), doctest::Contains("twice"), InputError);
    CHECK_THROWS_WITH_AS(param_grid({"block=32,,64"}), doctest::Contains("empty value"), InputError);
    // A model-qualified key replaces the bare one for that model only.
    CHECK(params_for_model("exact-tiled", {"block_q=32", "exact-tiled.block_q=64"}) == Names{"block_q=64"});
    CHECK(params_for_model("exact-tiled", {"block_q=32", "vanilla.block_q=64"}) == Names{"block_q=32"});
  }

  TEST_CASE("point grids: every field given as a list varies, the first field of the table slowest") {
    cli::PointOptions options;
    options.texts = {{"threads", {"1,2"}}, {"heads", {"4, 8"}}, {"batch", {"3"}}};
    std::vector<Pass> passes;
    std::vector<std::string> gridded;
    const auto grid = cli::point_grid_of(options, passes, gridded);
    CHECK(gridded == Names{"heads", "threads"});
    REQUIRE(grid.size() == 4);
    const std::vector<std::pair<std::int64_t, int>> expected = {{4, 1}, {4, 2}, {8, 1}, {8, 2}};
    for (std::size_t i = 0; i < grid.size(); ++i) {
      CHECK(grid[i].problem.heads == expected[i].first);
      CHECK(grid[i].problem.threads == expected[i].second);
      CHECK(grid[i].problem.batch == 3);
    }
    CHECK(passes == std::vector<Pass>{Pass::Forward});
    const auto refused = [&](FieldTexts texts, const std::string& message) {
      cli::PointOptions bad;
      bad.texts = std::move(texts);
      std::vector<std::string> keys;
      CHECK_THROWS_WITH_AS(cli::point_grid_of(bad, passes, keys), doctest::Contains(message.c_str()), InputError);
    };
    refused({{"min_reps", {"1,2"}}}, "--min-reps takes one value");
    refused({{"heads", {"4,4"}}}, "lists 4 twice");
    refused({{"heads", {"4,"}}}, "empty entry");
    refused({{"heads", {"4,0"}}}, "--heads must be");
    refused({{"seq_len", {"1,2"}}, {"heads", {"1,2"}}}, "--seq-len");  // run's field: no grid
  }

  TEST_CASE("the dry run lists every point with its estimates and runs none") {
    SweepSettings s;
    s.models = {"vanilla", "local"};
    s.seq_lens = {64, 1024};
    s.base.problem = {.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 16, .threads = 1};
    s.params = {"local.block=16,32"};
    s.memory_limit_bytes = 4 << 20;  // vanilla at 1024: 2·1024² scores of 4 bytes exceed it
    const std::string text = render_dry_run(s);
    CAPTURE(text);
    CHECK(text.find("dry run: 6 points; 5 would run") != std::string::npos);
    CHECK(text.find("1 skipped over --memory-limit, 0 unsupported; nothing was run") != std::string::npos);
    CHECK(text.find("block=32") != std::string::npos);
    CHECK(text.find("skipped: estimated") != std::string::npos);
    SweepSettings causal = s;
    causal.models = {"synthesizer", "linformer"};
    causal.params.clear();
    causal.base.problem.causal = true;
    const std::string unsupported = render_dry_run(causal);
    CHECK(unsupported.find("unsupported: Linformer cannot decode") != std::string::npos);
  }
}
