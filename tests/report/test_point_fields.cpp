// The point field table: each field's range at and past its ends, the size limits, and the child's
// JSON and the reproducer's words read back to the same point.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "apps/cli/commands.hpp"
#include "apps/report/point_fields.hpp"
#include "lib/core/errors.hpp"

using namespace xfb;
using nlohmann::json;

namespace {

// Parses `words` (after the program name) with the point options of `use` alone.
PointConfig parse_words(const std::vector<std::string>& words, FieldUse use, const PointConfig& defaults = {}) {
  CLI::App app;
  auto options = std::make_shared<cli::PointOptions>();
  options->defaults = defaults;
  cli::add_point_options(app, options, use);
  std::vector<std::string> reversed(words.rbegin(), words.rend());
  app.parse(reversed);
  return cli::point_of(*options);
}

PointConfig random_point(std::mt19937_64& rng) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  PointConfig c;
  c.model = pick(0, 1) ? "local" : "vanilla";
  c.problem.seq_len = pick(1, 5000);
  c.problem.batch = pick(1, 4);
  c.problem.heads = pick(1, 16);
  c.problem.head_dim = pick(1, 128);
  c.problem.causal = pick(0, 1) == 1;
  c.problem.threads = static_cast<int>(pick(1, 64));
  c.scope = pick(0, 1) ? Scope::Layer : Scope::Attention;
  c.pass = static_cast<Pass>(pick(0, c.scope == Scope::Layer ? 2 : 3));
  c.d_ff = pick(0, 1) ? 0 : pick(1, 4096);
  c.decode_tokens = pick(1, 300);
  c.seed = rng();
  if (pick(0, 1)) c.params = {"block=" + std::to_string(pick(1, 64))};
  c.timing.warmup = static_cast<int>(pick(1, 5));
  c.timing.min_reps = static_cast<int>(pick(1, 20));
  c.timing.max_reps = static_cast<int>(pick(c.timing.min_reps, 5000));
  c.timing.min_time_s = static_cast<double>(pick(0, 1000)) / 7.0;
  return c;
}

}  // namespace

TEST_SUITE("point_fields") {
  TEST_CASE("every integer field takes its ends and refuses one past them, exactly") {
    for (const auto& field : point_fields()) {
      if (field.type != FieldType::Integer && field.type != FieldType::Length) continue;
      CAPTURE(field.key);
      CHECK(parse_field_text(field, std::to_string(field.min)).get<std::int64_t>() == field.min);
      CHECK(parse_field_text(field, std::to_string(field.max)).get<std::int64_t>() == field.max);
      CHECK_THROWS_AS(parse_field_text(field, std::to_string(field.min - 1)), InputError);
      CHECK_THROWS_AS(parse_field_text(field, std::to_string(field.max + 1)), InputError);
      for (const char* bad : {"", " 1", "1 ", "1.0", "1e3", "0x10", "+1", "nan", "99999999999999999999", "-"})
        CHECK_THROWS_AS(parse_field_text(field, bad), InputError);
    }
  }

  TEST_CASE("length fields take K and M suffixes within their range") {
    const auto& seq_len = point_field("seq_len");
    CHECK(seq_len.type == FieldType::Length);
    CHECK(point_field("decode_tokens").type == FieldType::Length);
    CHECK(parse_field_text(seq_len, "16K").get<std::int64_t>() == 16384);
    CHECK(parse_field_text(seq_len, "1m").get<std::int64_t>() == 1048576);
    for (const char* bad : {"0K", "2097152K", "1.5K", "K", "1KB", "1,2"})
      CHECK_THROWS_AS(parse_field_text(seq_len, bad), InputError);
    CHECK(point_field("batch").type == FieldType::Integer);  // a count of sequences takes no suffix
    CHECK_THROWS_AS(parse_field_text(point_field("batch"), "1K"), InputError);
  }

  TEST_CASE("the seed takes the whole unsigned range and nothing else; reals must be finite") {
    const auto& seed = point_field("seed");
    CHECK(parse_field_text(seed, "18446744073709551615").get<std::uint64_t>() == UINT64_MAX);
    CHECK(parse_field_text(seed, "0").get<std::uint64_t>() == 0);
    for (const char* bad : {"-1", "18446744073709551616", "1.5", ""})
      CHECK_THROWS_AS(parse_field_text(seed, bad), InputError);
    const auto& min_time = point_field("min_time_s");
    CHECK(parse_field_text(min_time, "0").get<double>() == 0);
    CHECK(parse_field_text(min_time, "0.25").get<double>() == 0.25);
    for (const char* bad : {"nan", "inf", "-inf", "-0.5", "1e309", "86401", "0.5s", ""})
      CHECK_THROWS_AS(parse_field_text(min_time, bad), InputError);
  }

  TEST_CASE("the messages name the option and its range") {
    try {
      parse_field_text(point_field("batch"), "0");
      FAIL("accepted");
    } catch (const InputError& e) {
      CHECK(std::string(e.what()) == "--batch must be an integer in [1, 1048576], got '0'");
    }
  }

  TEST_CASE("relations and size limits are refused before anything runs") {
    PointConfig c;
    c.model = "vanilla";
    c.timing.min_reps = 10;
    c.timing.max_reps = 9;
    CHECK_THROWS_AS(check_point_config(c), InputError);
    c.timing.max_reps = 10;
    CHECK_NOTHROW(check_point_config(c));
    c.problem = {.batch = 1, .heads = 8, .seq_len = 1 << 23, .head_dim = 64};  // B·H·N²·D = 2^55
    CHECK_NOTHROW(check_point_config(c));
    c.problem.heads = 16;  // 2^56
    CHECK_NOTHROW(check_point_config(c));
    c.problem.heads = 17;
    CHECK_THROWS_AS(check_point_config(c), InputError);
    c.problem = {.batch = 1 << 20, .heads = 1 << 20, .seq_len = 1 << 20, .head_dim = 1 << 20};  // overflows int64
    CHECK_THROWS_AS(check_point_config(c), InputError);
    c.problem = {};
    c.pass = Pass::Decode;
    c.scope = Scope::Layer;
    CHECK_THROWS_AS(check_point_config(c), InputError);
    c.scope = Scope::Attention;
    c.decode_tokens = 1 << 20;
    c.timing.max_reps = 1000;  // 2^20 tokens × 1000 runs of samples > 2^27
    CHECK_THROWS_AS(check_point_config(c), InputError);
  }

  TEST_CASE("a point survives the child's JSON and the reproducer's words unchanged") {
    std::mt19937_64 rng(7);
    for (int i = 0; i < 300; ++i) {
      const PointConfig c = random_point(rng);
      const json expected = point_to_json(c);
      CHECK(point_to_json(point_from_json(expected)) == expected);
      auto words = point_arguments(c);
      REQUIRE(words.front() == "run");
      words.erase(words.begin());
      PointConfig parsed = parse_words(words, FieldUse::RunOnly);
      // The reproducer spells d_ff as it runs (4·H·D filled in) and only in layer scope, and
      // decode_tokens only for the decode pass: compare what it records.
      CHECK(point_settings(parsed) == point_settings(c));
      CHECK(parsed.params == c.params);
      CHECK(parsed.model == c.model);
      CHECK(parsed.problem.seq_len == c.problem.seq_len);
    }
  }

  TEST_CASE("the child's JSON is validated as the command line is") {
    PointConfig c;
    c.model = "local";
    json good = point_to_json(c);
    CHECK_NOTHROW(point_from_json(good));
    const std::vector<std::pair<std::string, json>> bad = {{"batch", 0},
                                                           {"batch", "1"},
                                                           {"batch", 1.5},
                                                           {"seed", -1},
                                                           {"min_time_s", "nan"},
                                                           {"min_time_s", -1.0},
                                                           {"scope", "bogus"},
                                                           {"causal", 1},
                                                           {"dtype", "f16"},
                                                           {"params", "block=8"},
                                                           {"params", {1}},
                                                           {"model", ""},
                                                           {"threads", 1e10},
                                                           {"seq_len", 9223372036854775807LL},
                                                           {"heads", json::object()}};
    for (const auto& [key, value] : bad) {
      CAPTURE(key);
      json doctored = good;
      doctored[key] = value;
      CHECK_THROWS_AS(point_from_json(doctored), InputError);
    }
    json extra = good;
    extra["bogus"] = 1;
    CHECK_THROWS_AS(point_from_json(extra), InputError);
    json missing = good;
    missing.erase("heads");
    CHECK_THROWS_AS(point_from_json(missing), InputError);
    CHECK_THROWS_AS(point_from_json(json::array()), InputError);
  }
}
