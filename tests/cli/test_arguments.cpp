// A seeded fuzz of the whole command line (apps/cli): argument vectors made of every command and
// option, sizes at and past the limits, non-numbers and JSON, in which nothing but a usage error may
// escape the parser (parsing validates every option; nothing runs).
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "apps/cli/commands.hpp"
#include "lib/core/errors.hpp"

using namespace xfb;
using nlohmann::json;

TEST_SUITE("arguments") {
  TEST_CASE("fuzz: 10,000 seeded argument vectors through the whole command line") {
    // Words of every kind the parser meets: commands, every option of every command, sizes at and
    // past the limits, non-numbers, JSON for --point, separators.
    std::vector<std::string> vocabulary = {"run",
                                           "sweep",
                                           "ab",
                                           "env",
                                           "table",
                                           "compare",
                                           "merge",
                                           "plot",
                                           "complexity",
                                           "list",
                                           "taxonomy",
                                           "bogus",
                                           "-v",
                                           "-q",
                                           "--",
                                           "-",
                                           "=",
                                           "",
                                           "0",
                                           "1",
                                           "-1",
                                           "2",
                                           "64",
                                           "65",
                                           "1000",
                                           "4096",
                                           "2147483647",
                                           "2147483648",
                                           "9223372036854775807",
                                           "99999999999999999999",
                                           "18446744073709551616",
                                           "1e3",
                                           "0.5",
                                           "nan",
                                           "inf",
                                           "-inf",
                                           "1e309",
                                           "0x10",
                                           "local",
                                           "vanilla",
                                           "exact-tiled",
                                           "block=8",
                                           "block=-1",
                                           "block=",
                                           "=8",
                                           "nosuch=1",
                                           "local.block=8",
                                           "forward",
                                           "train",
                                           "decode",
                                           "forward,train",
                                           "forward,forward",
                                           "layer",
                                           "attention",
                                           "all",
                                           "class:fixed_patterns",
                                           "64,128",
                                           "64:256:x2",
                                           "1K:16K:x2",
                                           "16k",
                                           "1,2",
                                           "block=8,16",
                                           "*former",
                                           "vanilla, local",
                                           "1/2",
                                           "3/2",
                                           "lra",
                                           "{}",
                                           "[]",
                                           "{\"model\":\"local\"}",
                                           "--version",
                                           "--json",
                                           std::string(300, 'x'),
                                           "\xff\xfe",
                                           "--memory-limit",
                                           "--timeout",
                                           "--rounds",
                                           "--alpha",
                                           "--out",
                                           "--resume",
                                           "--shard",
                                           "--preset",
                                           "--models",
                                           "--seq-lens",
                                           "--exclude",
                                           "--dry-run",
                                           "--point",
                                           "--dump",
                                           "--measure",
                                           "--fail-on-error",
                                           "--no-measure",
                                           "--format",
                                           "--metric",
                                           "--baseline",
                                           "--max-slowdown",
                                           "--a-param",
                                           "--b-model",
                                           "--a-bin"};
    for (const auto& field : point_fields()) vocabulary.push_back(field.long_flag());
    {
      PointConfig c;
      c.model = "local";
      c.problem.seq_len = 64;
      vocabulary.push_back(point_to_json(c).dump());
      json doctored = point_to_json(c);
      doctored["seq_len"] = 0;
      vocabulary.push_back(doctored.dump());
    }
    std::mt19937_64 rng(2027);
    int usage_errors = 0, parsed = 0;
    const auto start = std::chrono::steady_clock::now();
    // Valid command lines, which half of the cases mutate a word or two of.
    const std::vector<std::vector<std::string>> valid = {
        {"run", "-m", "local", "-n", "64"},
        {"run", "--model", "vanilla", "--seq-len", "100", "--pass", "train", "--heads", "2"},
        {"sweep", "--models", "local", "--seq-lens", "64,128", "--out", "x.json", "--max-reps", "10"},
        {"ab", "--models", "local", "--seq-lens", "64", "--rounds", "4", "--pass", "forward,train"},
        {"env", "--threads", "1"}};
    auto any_word = [&] {
      return vocabulary[std::uniform_int_distribution<std::size_t>(0, vocabulary.size() - 1)(rng)];
    };
    for (int i = 0; i < 10000; ++i) {
      std::vector<std::string> words;
      if (i % 2 == 0) {
        words = valid[static_cast<std::size_t>(i / 2) % valid.size()];
        const int mutations = std::uniform_int_distribution<int>(0, 2)(rng);
        for (int m = 0; m < mutations; ++m) {
          const auto at = std::uniform_int_distribution<std::size_t>(0, words.size() - 1)(rng);
          if (rng() % 2 == 0)
            words[at] = any_word();
          else
            words.insert(words.begin() + static_cast<std::ptrdiff_t>(at), any_word());
        }
      } else {
        const int length = std::uniform_int_distribution<int>(0, 9)(rng);
        if (i % 3 != 0) words.push_back(i % 3 == 1 ? "run" : "sweep");
        for (int w = 0; w < length; ++w) words.push_back(any_word());
      }
      CLI::App app;
      cli::Action action;
      cli::build_app(app, action);
      std::vector<std::string> reversed(words.rbegin(), words.rend());
      try {
        app.parse(reversed);
        ++parsed;
      } catch (const CLI::ParseError&) {  // includes --help and --version (CLI::Success)
        ++usage_errors;
      } catch (const InputError&) {
        ++usage_errors;
      }
      // Anything else escapes and fails the test case.
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    MESSAGE(parsed << " parsed, " << usage_errors << " usage errors in " << seconds << " s");
    CHECK(usage_errors > 4000);  // most vectors are wrong, and are told so
    CHECK(parsed > 500);         // and the generator reaches valid ones
  }
}
