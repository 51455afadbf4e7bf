// --dtype bf16 (issue 31, first increment): the bf16 type's rounding, vanilla in bf16 against the
// float64 reference with a bound from bf16's unit roundoff, its decode against its causal forward,
// the halved bytes, FLOPs unchanged, every other model refusing bf16, and the setting itself.
//
// The forward bound, |o − o_ref| ≤ 2u(1 + u)·max|v| + the fp32 bound, is derived in
// tests/support/bf16_check.hpp.
#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "apps/report/point_fields.hpp"
#include "apps/report/table.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/npy.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/tile_kernels.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

TEST_SUITE("bf16") {
  TEST_CASE("bf16 rounds to nearest even, widens exactly, keeps NaN and infinities") {
    CHECK(to_float(to_bf16(1.0f)) == 1.0f);
    CHECK(round_to_bf16(1.0f + 1.0f / 256) == 1.0f);                       // a tie: to the even neighbour 1
    CHECK(round_to_bf16(1.0f + 3.0f / 256) == 1.0f + 4.0f / 256);          // a tie: to the even neighbour 1 + 2⁻⁶
    CHECK(round_to_bf16(1.0f + 1.0f / 256 + 1e-6f) == 1.0f + 2.0f / 256);  // above the tie: up
    CHECK(round_to_bf16(-3.0f) == -3.0f);
    CHECK(std::isinf(round_to_bf16(std::numeric_limits<float>::infinity())));
    CHECK(std::isinf(round_to_bf16(std::numeric_limits<float>::max())));  // beyond bf16's largest: rounds to ∞
    CHECK(std::isnan(round_to_bf16(std::nanf(""))));
    CHECK(std::isnan(to_float(to_bf16(std::bit_cast<float>(0x7f800001u)))));  // a NaN that truncation would make ∞
    for (float x : {0.1f, -7.3f, 123456.0f, 1e-30f}) {
      const float rounded = round_to_bf16(x);
      CHECK(std::fabs(rounded - x) <= kBf16Roundoff * std::fabs(x));
      CHECK(round_to_bf16(rounded) == rounded);
    }
    // A bf16 tensor holds 2 bytes per element and refuses the fp32 view.
    Tensor t(Shape{3, 5}, DType::BF16);
    CHECK(t.bytes() == 30);
    CHECK_THROWS_AS(t.data(), std::logic_error);
    CHECK_THROWS_AS(Tensor(Shape{2}).bf16_data(), std::logic_error);
  }

  TEST_CASE("vanilla in bf16 equals the float64 reference within the bf16 bound, causal and not, at awkward sizes") {
    for (std::int64_t d : {16, 13})
      for (std::int64_t n : {1, 2, 7, 31, 33, 63, 64, 65, 129, 255, 256, 257})
        for (bool causal : {false, true}) {
          if (d == 13 && n > 65) continue;
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = causal};
          const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n + d));
          const std::string label =
              "vanilla bf16 N=" + std::to_string(n) + " D=" + std::to_string(d) + (causal ? " causal" : "");
          const double over_fp32 =
              check_bf16_head_errors(run_bf16("vanilla", p, in.bf16), in.widened, p, causal, label);
          // Not fp32 in disguise: past a few keys, the bf16 rounding of P and of O shows.
          if (n >= 31) CHECK_MESSAGE(over_fp32 > 1, label << ": the error never exceeds the fp32 bound");
        }
  }

  TEST_CASE("vanilla in bf16: rows whose scores would overflow a naive exp stay finite and within the bound") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16, .causal = causal};
      auto in = bf16_inputs(p, 11);
      for (std::int64_t i = 0; i < p.seq_len; i += 7)  // scores reach ~±400; ×128 is exact in bf16
        for (std::int64_t c = 0; c < p.head_dim; ++c) in.widened.q.head(0, 1)[i * p.head_dim + c] *= 128.0f;
      in.bf16.q = to_bf16(in.widened.q);
      const Tensor out = run_bf16("vanilla", p, in.bf16);
      for (float value : out.values()) REQUIRE(std::isfinite(value));
      check_bf16_head_errors(out, in.widened, p, causal, std::string("overflow rows") + (causal ? " causal" : ""));
    }
  }

  TEST_CASE("vanilla's bf16 decode, on its bf16 KV cache, equals its bf16 causal forward") {
    // D = 16: the cache in the tile kernels' layouts (key panels of 16 tokens, value row pairs);
    // D = 13: plain rows [N + T, D] on the convert-and-FMA loops.
    for (std::int64_t context : {1, 16, 33}) {
      const std::int64_t tokens = context + 20;
      CHECK(check_bf16_decode("vanilla", {.batch = 1, .heads = 3, .head_dim = 16}, context, 20) ==
            3 * (tiles::panels_for(tokens) * 16 + (tokens + 1) / 2 * 2) * 16 * 2);
      CHECK(check_bf16_decode("vanilla", {.batch = 1, .heads = 3, .head_dim = 13}, context, 20) ==
            2 * 3 * tokens * 13 * 2);
    }
  }

  TEST_CASE("vanilla's bf16 gradients equal the float64 reference's within the bf16 bound, causal and not") {
    for (std::int64_t n : {1, 7, 33, 64, 65, 129})
      for (bool causal : {false, true})
        check_bf16_gradients("vanilla", {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal}, {},
                             static_cast<std::uint64_t>(n) + 5, "N=" + std::to_string(n) + (causal ? " causal" : ""));
  }

  TEST_CASE("vanilla's bf16 backward and train rows: FLOPs as fp32's, bf16 gradients, the estimate exact") {
    for (Pass pass : {Pass::Backward, Pass::Train})
      for (bool causal : {false, true}) {
        const ResultRow b = check_bf16_rows("vanilla", 100, causal, pass).bf16;
        CHECK(b.saved_bytes == 2 * 100 * 100 * 4);  // the dense fp32 score buffer holding bf16 P
      }
  }

  TEST_CASE("bf16 halves q, k, v, out and the KV cache, keeps the FLOPs, and the estimate stays exact") {
    for (bool causal : {false, true}) {
      for (std::int64_t n : {100, 257}) {
        PointConfig f32 = quick_point("vanilla", n, causal), bf16 = bf16_point("vanilla", n, causal);
        CAPTURE(n);
        CAPTURE(causal);
        CHECK(2 * point_io_bytes(bf16) == point_io_bytes(f32));
        const ResultRow a = run_point(f32), b = run_point(bf16);
        REQUIRE(a.status == Status::Ok);
        REQUIRE(b.status == Status::Ok);
        CHECK(b.dtype == DType::BF16);
        CHECK(b.flops == a.flops);
        // Owned bytes: the inputs and output halve; the workspace is the fp32 score buffer, dense in bf16.
        CHECK(b.peak_owned_bytes - point_io_bytes(bf16) == b.estimated_workspace_bytes);
        CHECK(a.peak_owned_bytes - point_io_bytes(f32) == a.estimated_workspace_bytes);
        CHECK(b.estimated_workspace_bytes == 2 * n * n * 4);
      }
      if (!causal) continue;
      const ResultRow a = run_point([] {
        PointConfig c = quick_point("vanilla", 100, true);
        c.pass = Pass::Decode;
        c.decode_tokens = 5;
        return c;
      }());
      const ResultRow b = run_point(bf16_point("vanilla", 100, true, Pass::Decode));
      REQUIRE(a.status == Status::Ok);
      REQUIRE(b.status == Status::Ok);
      // Half the cache, to the panel padding (105 tokens in 7 panels of 16, 53 value pairs).
      CHECK(a.state_bytes == 2 * 2 * 105 * 32 * 4);
      CHECK(b.state_bytes == 2 * (112 + 106) * 32 * 2);
      CHECK(b.flops == a.flops);
      const std::int64_t io = point_io_bytes(bf16_point("vanilla", 100, true, Pass::Decode));
      CHECK(b.peak_owned_bytes - io == b.estimated_workspace_bytes);
    }
  }

  TEST_CASE("every model has a bf16 forward and backward; a model without one gets an unsupported row saying so") {
    for (const auto& model : registry()) {
      if (!model.implemented()) continue;
      CAPTURE(model.name);
      CHECK(model.impl.bf16_forward);
      CHECK(model.impl.bf16_backward);
    }
    // The harness's guard, on a registered model with its flags cleared (as a newcomer's model starts).
    REQUIRE(find_model("poolingformer") != nullptr);
    ModelInfo model = *find_model("poolingformer");
    PointConfig point = bf16_point("poolingformer", 64, false);
    CHECK(bf16_unsupported(model, point).empty());
    model.impl.bf16_backward = false;
    CHECK(bf16_unsupported(model, point).empty());
    point.pass = Pass::Train;
    CHECK(bf16_unsupported(model, point).find("no bf16 backward") != std::string::npos);
    model.impl.bf16_forward = false;
    point.pass = Pass::Forward;
    CHECK(bf16_unsupported(model, point).find("no bf16 form yet") != std::string::npos);
    point.problem.dtype = DType::F32;
    CHECK(bf16_unsupported(model, point).empty());
    // The encoder layer around a model with a bf16 backward trains in bf16 (tests/models/layer/test_layer_bf16.cpp).
    PointConfig layer = bf16_point("tokenlearner", 64, false, Pass::Train);
    layer.scope = Scope::Layer;
    CHECK(run_point(layer).status == Status::Ok);
  }

  TEST_CASE("--dtype: parsed from the field table, part of the key, a row field that predates it reads f32") {
    const PointField& field = point_field("dtype");
    CHECK(parse_field_text(field, "bf16") == "bf16");
    CHECK_THROWS_AS(parse_field_text(field, "f16"), InputError);
    CHECK_THROWS_AS(parse_field_text(field, "BF16"), InputError);
    nlohmann::json point = point_to_json(bf16_point("vanilla", 64, false));
    CHECK(point_from_json(point).problem.dtype == DType::BF16);
    point["dtype"] = "fp8";
    CHECK_THROWS_AS(point_from_json(point), InputError);

    const ResultRow f32 = describe_point(quick_point("vanilla", 64, false));
    const ResultRow bf16 = describe_point(bf16_point("vanilla", 64, false));
    CHECK(f32.key() != bf16.key());
    CHECK(f32.reproducer.find("--dtype") == std::string::npos);  // f32 reproducers read as before
    CHECK(bf16.reproducer.find("--dtype bf16") != std::string::npos);
    auto unmeasured = [](ResultRow row) {  // an ok row must carry samples; the key does not depend on the status
      row.status = Status::Skipped;
      row.reason = "not run";
      return nlohmann::json(row);
    };
    nlohmann::json old = unmeasured(f32);
    old.erase("dtype");
    CHECK(read_result_row(old, "row").dtype == DType::F32);
    CHECK(read_result_row(old, "row").key() == f32.key());
    CHECK(read_result_row(unmeasured(bf16), "row").key() == bf16.key());
    nlohmann::json wrong = unmeasured(bf16);
    wrong["dtype"] = "f16";
    CHECK_THROWS_AS(read_result_row(wrong, "row"), InputError);
  }

  TEST_CASE("table --metric gflops quotes a bf16 row against the bf16 peak, and says when there is none") {
    Report report;
    report.context = {{"threads", 2}, {"fma_peak_gflops", 500.0}};
    ResultRow row = describe_point(bf16_point("vanilla", 64, false));
    row.status = Status::Ok;
    row.samples_ns = {1000};
    row.median_ns = row.min_ns = row.max_ns = 1000;
    row.threads = 2;
    row.gflops_per_s = 100;
    report.results = {row};
    const TableOptions gflops{.metric = TableMetric::Gflops};
    const std::string without = render_table(report, gflops);
    CHECK(without.find("no bf16 peak") != std::string::npos);
    CHECK(without.find("(20%)") == std::string::npos);  // never against the fp32 peak
    CHECK(without.find("bf16") != std::string::npos);   // its own table
    report.context["bf16_dot_peak_gflops"] = 1000.0;
    CHECK(render_table(report, gflops).find("100.0 (10%)") != std::string::npos);
  }

  TEST_CASE("--dump of a bf16 point writes the bf16 values as float32 and says dtype bf16") {
    const auto dir = std::filesystem::temp_directory_path() / ("xfbench_bf16_dump_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    const ResultRow row = run_point(bf16_point("vanilla", 33, true, Pass::Decode), dir.string());
    REQUIRE(row.status == Status::Ok);
    for (const char* name : {"q", "out", "state_key_cache"}) {
      const Tensor t = read_npy((dir / (std::string(name) + ".npy")).string());
      for (float x : t.values()) REQUIRE(round_to_bf16(x) == x);
    }
    std::ifstream manifest(dir / "manifest.json");
    const auto json = nlohmann::json::parse(manifest);
    CHECK(json["dtype"] == "bf16");
    CHECK(json.contains("dtype_note"));
    std::filesystem::remove_all(dir);
  }
}
