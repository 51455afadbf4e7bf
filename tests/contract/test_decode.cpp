// Incremental decoding: for every model with an incremental form, a prefill of N context tokens
// followed by T single-token steps must reproduce the causal forward over N + T tokens (the same
// model: same seed, parameters resolved for the context; a downsampling model's step t, the last row
// of its causal forward over N + t + 1 tokens), at sizes around each model's blocks;
// and the decode pass of the harness: its memory estimate, state and FLOP counters.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/memory_tracker.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {
namespace {

struct Decoded {
  Tensor context_out;             // [B, H, M, D]: the prefill's output (M = N but for a downsampling model)
  std::vector<Tensor> steps;      // [B, H, 1, D] per token
  std::int64_t decode_bytes = 0;  // tracked bytes prepare_decode allocated
  std::int64_t state_bytes = 0;
  std::unique_ptr<Mechanism> mechanism;  // as the last step left it
};

// Prefill N tokens of `whole`, then decode `tokens` more, one at a time; `runs` times over (a new
// forward restarts the state), keeping the last run.
Decoded decode(const ModelInfo& model, const Problem& context, const ParamValues& values, const AttentionInputs& whole,
               std::int64_t tokens, int runs = 1) {
  const std::int64_t n = context.seq_len;
  auto mechanism = model.impl.create(context, values, 42);
  const Tensor q = rows_of(whole.q, 0, n), k = rows_of(whole.k, 0, n), v = rows_of(whole.v, 0, n);
  mechanism->prepare(q, k, v);
  Decoded result;
  const std::int64_t before = MemoryTracker::instance().current_bytes();
  mechanism->prepare_decode(tokens);
  result.decode_bytes = MemoryTracker::instance().current_bytes() - before;
  result.context_out =
      Tensor::bhnd(context.batch, context.heads, output_rows_of(model.impl, context, values), context.head_dim);
  for (int run = 0; run < runs; ++run) {
    result.context_out.fill(std::nanf(""));
    mechanism->forward(q, k, v, result.context_out);
    result.steps.clear();
    for (std::int64_t t = 0; t < tokens; ++t) {
      Tensor out = Tensor::bhnd(context.batch, context.heads, 1, context.head_dim);
      out.fill(std::nanf(""));
      mechanism->decode_step(rows_of(whole.q, n + t, 1), rows_of(whole.k, n + t, 1), rows_of(whole.v, n + t, 1), out);
      result.steps.push_back(std::move(out));
    }
  }
  result.state_bytes = mechanism->state_bytes();
  result.mechanism = std::move(mechanism);
  return result;
}

// Largest |got − want| of rows [first, first + rows) against the reference [B, H, L, D].
double row_error(const Tensor& got, const Tensor& want, std::int64_t first) {
  const std::int64_t rows = got.dim(2), d = got.dim(3);
  double worst = 0;
  for (std::int64_t b = 0; b < got.dim(0); ++b)
    for (std::int64_t h = 0; h < got.dim(1); ++h)
      for (std::int64_t e = 0; e < rows * d; ++e) {
        const double error = std::fabs(static_cast<double>(got.head(b, h)[e]) - want.head(b, h)[first * d + e]);
        worst = std::isnan(error) ? INFINITY : std::max(worst, error);
      }
  return worst;
}

// The tolerance of one output element of the N + T causal problem: the exact-attention rounding
// bound (attention_tolerance over the whole sequence), doubled for the two computations compared.
double decode_tolerance(const AttentionInputs& whole, const Problem& p) {
  double tolerance = 0;
  const std::int64_t l = p.seq_len, d = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h)
      tolerance = std::max(tolerance, attention_tolerance(whole.q.head(b, h), whole.k.head(b, h), whole.v.head(b, h), l,
                                                          l, d, 1.0 / std::sqrt(static_cast<double>(d))));
  return 2 * tolerance;
}

struct DecodeCase {
  std::string model;
  std::vector<std::string> params;
  std::vector<std::int64_t> contexts;  // one below, at and above the model's block, and others
  std::int64_t tokens;                 // enough to cross a block boundary from every context
  double tolerance_factor = 1;         // approximations: see the case
};

// Cases at awkward sizes, one below, at and above each model's blocks (every model that decodes is
// also checked at its defaults by the generic case).
const std::vector<DecodeCase>& decode_cases() {
  static const std::vector<DecodeCase> cases = {
      {"vanilla", {}, {1, 16, 33}, 20},
      // adaptive-sparse: contexts one below, at and above its query block; the bisection's α and a learned α.
      {"adaptive-sparse", {"block_q=8"}, {1, 7, 8, 9, 21}, 12},
      {"adaptive-sparse", {"block_q=8", "alpha=1.3"}, {8, 9}, 9},
      {"adaptive-sparse", {"learn_alpha=true", "alpha=1.7", "block_q=5"}, {4, 5, 6}, 7},
      {"exact-tiled", {"block_q=16", "block_k=16"}, {1, 15, 16, 17, 40}, 20},
      {"exact-tiled", {}, {3, 70}, 9},
      {"local", {"block=8"}, {7, 8, 9, 21}, 19},
      {"axial", {"cols=4"}, {1, 3, 4, 5, 13}, 14},
      {"axial", {}, {16, 23}, 12},
      {"memory-compressed", {"block=8", "compression=3", "mode=split"}, {1, 2, 3, 4, 7, 8, 9, 22}, 13},
      {"memory-compressed", {"block=5", "compression=4", "mode=compressed"}, {6}, 11},
      {"memory-compressed", {"block=6", "compression=2", "mode=local"}, {6, 11}, 7},
      {"sparse-transformer", {"pattern=strided", "stride=4"}, {3, 4, 5, 13}, 11},
      {"longformer", {"window=6", "globals=2"}, {2, 3, 4, 5, 11}, 13},
      {"longformer", {"window=4", "dilation=3", "dilated_heads=1", "globals=1"}, {1, 7, 20}, 17},
      {"longformer", {"window=0", "globals=0"}, {5}, 6},
      {"sparse-transformer", {"pattern=fixed", "stride=4", "summary=2"}, {1, 3, 4, 5, 13}, 11},
      {"sparse-transformer", {"pattern=fixed", "stride=5", "summary=1"}, {9}, 12},
      {"image-transformer", {"query_block=8", "memory_flange=4"}, {3, 7, 8, 9, 21}, 19},
      {"image-transformer", {"query_block=6", "memory_flange=9"}, {5, 13}, 15},
      // Large enough that the B=2 H=2 step reads ≥ kParallelStepFloats: its heads run in parallel.
      {"image-transformer", {"query_block=1024", "memory_flange=512"}, {1100}, 3},
      {"transformer-xl", {"segment_len=5", "memory_len=4"}, {1, 4, 5, 6, 13}, 12},
      {"transformer-xl", {"segment_len=16", "memory_len=3", "block_q=4"}, {7}, 14},
      {"compressive", {"segment_len=4", "memory_len=3", "compressed_len=2", "compression_rate=2"}, {3, 4, 5, 11}, 13},
      {"compressive",
       {"segment_len=5", "memory_len=2", "compressed_len=3", "compression_rate=3", "compression=max"},
       {6},
       12},
      {"compressive",
       {"segment_len=3", "memory_len=3", "compressed_len=4", "compression_rate=2", "compression=mean"},
       {8},
       10},
      {"synthesizer", {"variant=dense"}, {1, 9}, 7},
      {"synthesizer", {"variant=dense", "vanilla_weight=0.5"}, {5}, 6},
      {"synthesizer", {"variant=random"}, {4}, 6},
      {"synthesizer", {"variant=random", "vanilla_weight=0.25"}, {3}, 5},
      {"synthesizer", {"variant=factorized-random", "factor_rank=3"}, {2, 8}, 7},
      {"synthesizer", {"variant=factorized-random", "factor_rank=2", "vanilla_weight=1"}, {6}, 4},
      {"reformer", {"n_buckets=4", "chunk_len=4"}, {1, 3, 4, 5, 17}, 21},
      {"sinkhorn", {"block=4"}, {1, 3, 4, 5, 13}, 14},
      // Routing decodes the model of its context (centroids fitted on 2N rows, w = ⌈N/C⌉): the causal
      // forward over N + T tokens is the same model when the centroids are not fitted and w agrees.
      {"routing", {"clusters=4", "kmeans_updates=0"}, {13}, 3},
      {"routing", {"clusters=3", "kmeans_updates=0", "local_heads=true"}, {10}, 2},
      {"sinkhorn", {"block=5", "temperature=0.5"}, {12}, 9},
      {"reformer", {"n_buckets=2", "n_rounds=2", "chunk_len=3"}, {9}, 15},
      {"reformer", {"n_buckets=6", "n_rounds=4", "chunk_len=5"}, {12}, 11},
      {"reformer", {"n_buckets=1", "chunk_len=6"}, {7}, 9},
      // Kernel models: a ratio of sums of positive features, within the same rounding bound.
      {"linear-transformer", {"chunk=8"}, {1, 7, 8, 9, 20}, 19},
      {"performer", {"features=48", "chunk=8"}, {1, 7, 8, 9, 20}, 19},
      {"performer", {"features=40", "chunk=8", "kernel=relu"}, {9}, 12},
      // RFA: signed sin/cos features, the denominator clamped below (floor=1: the authors' causal clamp).
      {"rfa", {"chunk=8"}, {1, 7, 8, 9, 20}, 19},
      {"rfa", {"chunk=8", "gate=1"}, {1, 7, 8, 9, 20}, 19},
      {"rfa", {"features=16", "chunk=5", "gate=1", "floor=1"}, {4, 5, 6}, 9},
      // Long-Short: contexts one below, at and above the chunk l and the window w.
      {"long-short", {"window=6", "chunk=4", "chunk_rank=2"}, {3, 4, 5, 6, 7, 11}, 13},
      {"long-short", {"window=16", "chunk=16"}, {15, 16, 17}, 18},
      // Perceiver AR: contexts below, at and above the latents (M = min(latents, N) grows as tokens arrive).
      {"perceiver", {"latents=6", "block_rows=4", "block_keys=5"}, {1, 5, 6, 7, 13}, 9},
      {"perceiver", {"latents=6", "block_rows=4", "block_keys=5", "cross_window=4"}, {1, 5, 6, 7, 13}, 9},
  };
  return cases;
}

// The parameter names a decode parameter's name mentions: its '_'-separated words ("w2_b2": w2, b2).
std::vector<std::string> named_parameters(const std::string& name) {
  std::vector<std::string> words;
  std::istringstream in(name);
  for (std::string word; std::getline(in, word, '_');) words.push_back(word);
  return words;
}

std::map<std::string, const Tensor*> by_name(const std::vector<NamedTensor>& tensors) {
  std::map<std::string, const Tensor*> map;
  for (const auto& named : tensors) map[named.name] = named.tensor;
  return map;
}

bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  for (std::int64_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Tensors in parameters() that decoding does not read, with the reason.
bool not_read_by_decoding(const std::string& model, const std::string& name) {
  return model == "sinkhorn" && name == "permutation";  // the last forward's soft permutation, not a draw
}

// The causal forward of the model (parameters `values`) over the first `length` tokens of `whole`:
// [B, H, M, D], M the model's output rows for that length.
Tensor causal_forward(const ModelInfo& model, const Problem& context, const ParamValues& values,
                      const AttentionInputs& whole, std::int64_t length) {
  Problem p = context;
  p.seq_len = length;
  const Tensor q = rows_of(whole.q, 0, length), k = rows_of(whole.k, 0, length), v = rows_of(whole.v, 0, length);
  auto mechanism = model.impl.create(p, values, 42);
  mechanism->prepare(q, k, v);
  Tensor out = Tensor::bhnd(p.batch, p.heads, output_rows_of(model.impl, p, values), p.head_dim);
  mechanism->forward(q, k, v, out);
  return out;
}

// Prefill + T steps of the case's model against its causal forward, for every context and two
// shapes, and the decode workspace estimate against the tracked bytes. Step t's output is the last
// output row of the causal forward over the N + t + 1 tokens so far: for a model that does not
// downsample, the row N + t of the one forward over N + T tokens.
void check_decode_case(const DecodeCase& c) {
  const ModelInfo* model = find_model(c.model);
  REQUIRE(model != nullptr);
  REQUIRE(model->impl.has_decode());
  for (const std::int64_t n : c.contexts) {
    for (const Problem shape :
         {Problem{.batch = 2, .heads = 2, .head_dim = 16}, Problem{.batch = 1, .heads = 1, .head_dim = 24}}) {
      Problem context = on_test_threads(shape);
      context.seq_len = n;
      context.causal = true;
      Problem whole_problem = context;
      whole_problem.seq_len = n + c.tokens;
      const ParamValues values = model->impl.resolved(context, resolve_params(c.model, model->impl.params, c.params));
      const AttentionInputs whole = random_inputs(whole_problem, 7);
      const bool downsamples = model->impl.downsamples();
      const Tensor want = causal_forward(*model, context, values, whole, downsamples ? n : n + c.tokens);

      const Decoded got = decode(*model, context, values, whole, c.tokens, 2);
      const double tolerance = c.tolerance_factor * decode_tolerance(whole, whole_problem);
      const std::string label = c.model + " " + params_text(values.to_json()) + " N=" + std::to_string(n) +
                                " T=" + std::to_string(c.tokens) + " B=" + std::to_string(context.batch) +
                                " H=" + std::to_string(context.heads) + " D=" + std::to_string(context.head_dim);
      CAPTURE(label);
      CHECK(row_error(got.context_out, want, 0) <= tolerance);
      for (std::int64_t t = 0; t < c.tokens; ++t) {
        CAPTURE(t);
        if (!downsamples) {
          CHECK(row_error(got.steps[t], want, n + t) <= tolerance);
          continue;
        }
        const Tensor window = causal_forward(*model, context, values, whole, n + t + 1);
        CHECK(row_error(got.steps[t], window, window.dim(2) - 1) <= tolerance);
      }
      CHECK(got.decode_bytes == model->impl.decode_workspace_bytes(context, values, c.tokens));
    }
  }
}

// The generic case of a registered model: its defaults at contexts 1 and 37, 9 tokens. Routing's
// incremental form is the causal forward over N + T tokens only for a model of the same clusters
// and window (centroids unfitted, ⌈N/C⌉ = ⌈(N + T)/C⌉), which its defaults derive from N.
DecodeCase generic_decode_case(const std::string& model) {
  if (model == "routing") return {model, {"clusters=4", "kmeans_updates=0"}, {13}, 3};
  return {model, {}, {1, 37}, 9};
}

}  // namespace

TEST_SUITE("decode") {
  TEST_CASE("every registered incremental form, at its defaults, reproduces the causal forward over N + T") {
    for (const auto& model : attention_models())
      if (model.implemented() && model.impl.has_decode()) check_decode_case(generic_decode_case(model.name));
  }

  TEST_CASE("the incremental forms reproduce the causal forward at sizes around their blocks") {
    for (const auto& c : decode_cases()) check_decode_case(c);
  }

  TEST_CASE("a model without an incremental form gives unsupported decode rows with a reason") {
    for (const auto& model : attention_models()) {
      if (model.impl.has_decode()) CHECK(model.decodes());
      PointConfig config;
      config.model = model.name;
      config.pass = Pass::Decode;
      config.problem = {.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 16};
      const ResultRow row = describe_point(config);
      CHECK(row.causal);
      if (!model.decodes()) {
        CHECK(row.status == Status::Unsupported);
        // The survey's mark, or the card's note where xfbench differs from it (Funnel).
        CHECK(row.reason.find(model.decode_note.empty() ? "Decode = no" : model.decode_note) != std::string::npos);
      } else if (!model.impl.has_decode()) {
        CHECK(row.status == Status::Unsupported);
        CHECK(row.reason.find("no incremental form in this build") != std::string::npos);
      } else {
        CHECK(row.status == Status::Ok);
      }
    }
  }

  TEST_CASE("routing decodes its context's model: fitted centroids, the w most recent keys of the query's cluster") {
    const ModelInfo* model = find_model("routing");
    REQUIRE(model != nullptr);
    for (const bool local : {false, true}) {
      Problem context = on_test_threads(Problem{.batch = 2, .heads = 2, .head_dim = 16});
      context.seq_len = 40;
      context.causal = true;
      const std::int64_t tokens = 30, total = context.seq_len + tokens, d = context.head_dim;
      Problem whole_problem = context;
      whole_problem.seq_len = total;
      std::vector<std::string> params = {"clusters=5"};
      if (local) params.push_back("local_heads=true");
      const ParamValues values = model->impl.resolved(context, resolve_params("routing", model->impl.params, params));
      const AttentionInputs whole = random_inputs(whole_problem, 11);
      auto mechanism = model->impl.create(context, values, 42);
      const Tensor q = rows_of(whole.q, 0, context.seq_len), k = rows_of(whole.k, 0, context.seq_len),
                   v = rows_of(whole.v, 0, context.seq_len);
      mechanism->prepare(q, k, v);
      mechanism->prepare_decode(tokens);
      Tensor out = Tensor::bhnd(2, 2, context.seq_len, d);
      mechanism->forward(q, k, v, out);
      const Tensor* centroids = nullptr;
      for (const auto& named : mechanism->parameters())
        if (named.name == "centroids") centroids = named.tensor;
      REQUIRE(centroids != nullptr);
      const std::int64_t clusters = centroids->dim(1), w = (context.seq_len + clusters - 1) / clusters;
      auto nearest = [&](const float* x, std::int64_t h) {
        std::int64_t best = 0;
        double best_dot = -INFINITY;
        for (std::int64_t c = 0; c < clusters; ++c) {
          double dot = 0;
          for (std::int64_t j = 0; j < d; ++j)
            dot += static_cast<double>(x[j]) * (*centroids)[(h * clusters + c) * d + j];
          if (dot > best_dot) best_dot = dot, best = c;
        }
        return best;
      };
      const double tolerance = decode_tolerance(whole, whole_problem);
      for (std::int64_t t = 0; t < tokens; ++t) {
        const std::int64_t i = context.seq_len + t;
        Tensor step_out = Tensor::bhnd(2, 2, 1, d);
        mechanism->decode_step(rows_of(whole.q, i, 1), rows_of(whole.k, i, 1), rows_of(whole.v, i, 1), step_out);
        for (std::int64_t b = 0; b < 2; ++b)
          for (std::int64_t h = 0; h < 2; ++h) {
            const float *qh = whole.q.head(b, h), *kh = whole.k.head(b, h), *vh = whole.v.head(b, h);
            std::vector<std::int64_t> visible;
            if (local && h == 0) {
              for (std::int64_t j = std::max<std::int64_t>(0, (i / w - 1) * w); j <= i; ++j) visible.push_back(j);
            } else {
              const std::int64_t cluster = nearest(qh + i * d, h);
              for (std::int64_t j = i; j >= 0 && static_cast<std::int64_t>(visible.size()) < w; --j)
                if (nearest(kh + j * d, h) == cluster) visible.push_back(j);
            }
            std::vector<double> want(static_cast<std::size_t>(d), 0.0);
            if (!visible.empty()) {
              std::vector<double> keys, vals;
              for (const std::int64_t j : visible) {
                keys.insert(keys.end(), kh + j * d, kh + (j + 1) * d);
                vals.insert(vals.end(), vh + j * d, vh + (j + 1) * d);
              }
              const std::vector<double> query(qh + i * d, qh + (i + 1) * d);
              want = reference_attention(query.data(), keys.data(), vals.data(), 1,
                                         static_cast<std::int64_t>(visible.size()), d,
                                         1.0 / std::sqrt(static_cast<double>(d)), full_mask);
            }
            CAPTURE(local);
            CAPTURE(t);
            for (std::int64_t c = 0; c < d; ++c)
              CHECK(std::fabs(step_out.head(b, h)[c] - want[static_cast<std::size_t>(c)]) <= tolerance);
          }
      }
    }
  }

  TEST_CASE("after decoding, parameters() and decode_parameters() hold every parameter at the size N + T reads") {
    // The model built for N + T tokens is what decoding must equal: each of its parameters is held
    // by the decoder's parameters() at its shape and values, or else (a position axis) by a decode
    // parameter of its name (whole, same values) or one naming it whose axes reach its extent
    // e = N + T (or the blocks of N + T), directly or past the context's c positions (e − c rows).
    constexpr std::int64_t kContext = 50, kTokens = 23;
    for (const auto& c : decode_cases()) {
      const ModelInfo* model = find_model(c.model);
      REQUIRE(model != nullptr);
      Problem context = on_test_threads(Problem{.batch = 1, .heads = 3, .seq_len = kContext, .head_dim = 16});
      context.causal = true;
      Problem whole_problem = context;
      whole_problem.seq_len = kContext + kTokens;
      const ParamValues values = model->impl.resolved(context, resolve_params(c.model, model->impl.params, c.params));
      const std::string label = c.model + " " + params_text(values.to_json());
      CAPTURE(label);
      const AttentionInputs whole = random_inputs(whole_problem, 7);
      const Decoded got = decode(*model, context, values, whole, kTokens);
      auto extended = model->impl.create(whole_problem, values, 42);
      extended->prepare(whole.q, whole.k, whole.v);
      const auto held = by_name(got.mechanism->parameters());
      const auto decoding = by_name(got.mechanism->decode_parameters());
      const auto wanted = extended->parameters();
      for (const auto& named : got.mechanism->decode_parameters()) {
        CAPTURE(named.name);
        bool names_a_parameter = false;
        for (const auto& word : named_parameters(named.name))
          for (const auto& parameter : wanted) names_a_parameter = names_a_parameter || parameter.name == word;
        CHECK(names_a_parameter);
      }
      for (const auto& want : wanted) {
        CAPTURE(want.name);
        if (not_read_by_decoding(c.model, want.name)) continue;
        REQUIRE(held.count(want.name) == 1);
        const Tensor& mine = *held.at(want.name);
        REQUIRE(mine.rank() == want.tensor->rank());
        if (mine.shape() == want.tensor->shape()) {
          CHECK(same_values(mine, *want.tensor));
          continue;
        }
        if (decoding.count(want.name) == 1) {
          CHECK(same_values(*decoding.at(want.name), *want.tensor));
          continue;
        }
        std::vector<const Tensor*> holders;
        for (const auto& named : got.mechanism->decode_parameters())
          for (const auto& word : named_parameters(named.name))
            if (word == want.name) holders.push_back(named.tensor);
        REQUIRE_MESSAGE(!holders.empty(), "no decode parameter holds " << want.name << " at N + T");
        for (std::size_t axis = 0; axis < mine.shape().size(); ++axis) {
          const std::int64_t extent = want.tensor->dim(axis), past = extent - mine.dim(axis);
          if (past == 0) continue;
          bool reached = false;
          for (const Tensor* holder : holders)
            for (const std::int64_t size : holder->shape()) reached = reached || size == extent || size == past;
          CAPTURE(axis);
          CHECK(reached);
        }
      }
    }
  }

  TEST_CASE("the decode pass runs in attention scope only and needs a positive token count") {
    PointConfig config;
    config.model = "vanilla";
    config.pass = Pass::Decode;
    config.scope = Scope::Layer;
    CHECK_THROWS_AS(resolve_point(config), InputError);
    config.scope = Scope::Attention;
    config.decode_tokens = 0;
    CHECK_THROWS_AS(resolve_point(config), InputError);
  }

  TEST_CASE("decode rows: exact memory estimate, per-token FLOPs and state as the design says") {
    auto decode_row = [](const std::string& model, std::int64_t n, std::vector<std::string> params = {}) {
      PointConfig c;
      c.model = model;
      c.pass = Pass::Decode;
      c.decode_tokens = 8;
      c.problem = {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .threads = kTestThreads};
      c.params = std::move(params);
      c.timing = {.warmup = 1, .min_reps = 1, .min_time_s = 0, .max_reps = 1};
      const ResultRow row = run_point(c);
      REQUIRE(row.status == Status::Ok);
      CHECK(row.pass == Pass::Decode);
      CHECK(row.causal);
      CHECK(row.decode_tokens == 8);
      // One sample per token of the one timed run (a descheduled one is kept apart: ctest -j runs
      // other tests beside this one).
      CHECK(row.samples_ns.size() + row.contended_samples_ns.size() == 8);
      CHECK(row.prefill_ns > 0);
      CHECK(row.workspace_bytes == row.estimated_workspace_bytes);
      return row;
    };
    // vanilla: 4·n·D + 5·n per head and step, n = the tokens in the cache; its cache grows with N.
    for (const std::int64_t n : {64, 256}) {
      const ResultRow row = decode_row("vanilla", n);
      std::int64_t want = 0;
      for (std::int64_t t = 0; t < 8; ++t) want += 4 * (4 * (n + t + 1) * 32 + 5 * (n + t + 1));
      CHECK(row.flops == want);
      CHECK(row.state_bytes == 2 * 4 * (n + 8) * 32 * 4);
    }
    // Constant-state models: the same state and per-token FLOPs at every context length.
    for (const auto& [model, params] : std::vector<std::pair<std::string, std::vector<std::string>>>{
             {"linear-transformer", {}},
             {"local", {"block=16"}},
             {"image-transformer", {"query_block=16", "memory_flange=8"}}}) {
      CAPTURE(model);
      const ResultRow short_context = decode_row(model, 64, params), long_context = decode_row(model, 512, params);
      CHECK(short_context.state_bytes > 0);
      CHECK(short_context.state_bytes == long_context.state_bytes);
      CHECK(short_context.flops == long_context.flops);
    }
    const ResultRow performer_short = decode_row("performer", 64), performer_long = decode_row("performer", 512);
    CHECK(performer_short.state_bytes == performer_long.state_bytes);
    // Every incremental form: the harness's tracked workspace (state and step buffers, the
    // prefill's peak included) is the registry's estimate, and the state is reported.
    for (const auto& model : attention_models()) {
      if (!model.impl.has_decode()) continue;
      CAPTURE(model.name);
      const ResultRow row = decode_row(model.name, 100);
      CHECK(row.state_bytes > 0);
      CHECK(row.flops > 0);
    }
  }
}

}  // namespace xfb::test
