#include "taxonomy/sparse_models/adaptive_sparse.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {
namespace {

// Candidates beyond which the sort solver first narrows the bracket (each step O(candidates) and
// cheap, a sort O(c log c)), and the most steps it takes for that.
constexpr std::int64_t kSortCandidates = 32;
constexpr int kSortNarrowingSteps = 8;
// The bisection's stopping width (in the library's τ units, where the bracket starts ≤ 1 wide) and
// Newton's relative step at convergence: at double precision where the power is exact (α = 1.5,
// 2), at float precision where it is fast_power's.
constexpr double kBracketWidth = 1e-14, kFloatBracketWidth = 1e-7;
constexpr double kNewtonStep = 1e-15, kFloatNewtonStep = 1e-7;

// ln x for a float x > 0 (normal), to about 2 ulp: x = 2^e·m with m ∈ [√½, √2), ln m = 2·atanh(u),
// u = (m − 1)/(m + 1), |u| ≤ 0.172, by its series to u⁹. Branch-free, so loops over it vectorise.
inline float fast_log(float x) {
  const int bits = __builtin_bit_cast(int, x);
  const float mantissa = __builtin_bit_cast(float, (bits & 0x007fffff) | 0x3f800000);  // [1, 2)
  const bool high = mantissa > 1.41421356f;
  const float m = high ? 0.5f * mantissa : mantissa;
  const float exponent = static_cast<float>(((bits >> 23) & 0xff) - 127 + (high ? 1 : 0));
  const float u = (m - 1.0f) / (m + 1.0f), u2 = u * u;
  const float series = u * (2.0f + u2 * (2.0f / 3.0f + u2 * (2.0f / 5.0f + u2 * (2.0f / 7.0f + u2 * (2.0f / 9.0f)))));
  return series + exponent * 0.693147181f;
}

// t^e in float: e^(e·ln t) (fast_log, ops::fast_exp; relative error ≈ 2·eps·(1 + e·|ln t|)), and 0
// for t ≤ 1e-30 (then t^e ≤ 1e-30 for the e ≥ 1 of p; the weights p^(2−α) read only p > 0).
inline float fast_power(float t, float e) {
  const float safe = std::max(t, 1e-30f);
  return t > 1e-30f ? ops::fast_exp(e * fast_log(safe)) : 0.0f;
}

// t^(1/a) for t > 0: a square at α = 1.5, t itself at α = 2, else fast_power.
inline double power(double t, double a) {
  if (a == 0.5) return t * t;
  if (a == 1.0) return t;
  return fast_power(static_cast<float>(t), static_cast<float>(1.0 / a));
}

// Σ_j [a·y_j − τ]₊^(1/a) over y[0..n) (a·y in the library's units, a = α − 1), and in `above` how
// many y have a·y > τ; in float terms (fast_power) but for α = 1.5 and 2.
double mass(const float* y, std::int64_t n, double a, double tau, std::int64_t& above) {
  double sum = 0;
  std::int64_t count = 0;
  if (a == 0.5 || a == 1.0) {
    for (std::int64_t j = 0; j < n; ++j) {
      const double t = a * y[j] - tau;
      if (t > 0) {
        sum += power(t, a);
        ++count;
      }
    }
  } else {
    const float af = static_cast<float>(a), tf = static_cast<float>(tau), inverse = static_cast<float>(1.0 / a);
#pragma omp simd reduction(+ : sum, count)
    for (std::int64_t j = 0; j < n; ++j) {
      const float t = af * y[j] - tf;
      sum += fast_power(t, inverse);
      count += t > 0.0f ? 1 : 0;
    }
  }
  above = count;
  return sum;
}

// Keeps at the front the y with a·y > lo, compared in float as y > lo/a lowered by 1e-6 relative
// (a superset: a key kept in excess adds nothing). Returns how many, and their least a·y.
std::int64_t keep_above(float* y, std::int64_t n, double a, double lo, double& smallest) {
  const float cut = static_cast<float>(lo / a * (1.0 + 1e-6));
  std::int64_t kept = 0;
  float least = 0.0f;
  for (std::int64_t j = 0; j < n; ++j) {
    const float value = y[j];
    y[kept] = value;
    kept += value > cut ? 1 : 0;
    least = value > cut ? std::min(least, value) : least;
  }
  smallest = a * least;
  return kept;
}

// τ by sorting the candidates (α = 1.5: a = 0.5; α = 2: a = 1), after narrowing [lo, hi] while
// many remain. y: the candidates (z − max z), overwritten.
double sort_threshold(float* y, std::int64_t n, double a, double lo, double hi) {
  for (int step = 0; step < kSortNarrowingSteps && n > kSortCandidates; ++step) {
    const double mid = 0.5 * (lo + hi);
    std::int64_t above = 0;
    if (mass(y, n, a, mid, above) >= 1.0) {
      lo = mid;
      double smallest = 0;
      n = keep_above(y, n, a, lo, smallest);
    } else {
      hi = mid;
    }
  }
  std::sort(y, y + n, std::greater<float>());
  double sum = 0, sum_sq = 0, tau = 0;
  for (std::int64_t k = 1; k <= n; ++k) {
    const double x = a * y[k - 1], count = static_cast<double>(k);
    sum += x;
    sum_sq += x * x;
    double tau_k;
    bool in_support;
    if (a == 0.5) {  // entmax15: τ_k = μ_k − √((1 − k·σ_k²)/k)
      const double mean = sum / count, spread = sum_sq - sum * mean;
      tau_k = mean - std::sqrt(std::max(0.0, (1.0 - spread) / count));
      in_support = tau_k <= x;
    } else {  // sparsemax: τ_k = (Σ_k − 1)/k
      tau_k = (sum - 1.0) / count;
      in_support = tau_k < x;
    }
    if (!in_support) break;
    tau = tau_k;
  }
  return tau;
}

// τ by the library's bisection over the candidates above the lower bound, then Newton's method
// from the lower bound (f(τ) = Σ[x − τ]₊^(1/a) − 1 is convex and decreasing, so the iterates rise
// to the root without passing it).
double bisect_threshold(float* y, std::int64_t n, double a, double lo, double hi) {
  const bool exact_power = a == 0.5 || a == 1.0;
  const double width = exact_power ? kBracketWidth : kFloatBracketWidth;
  const double newton_step = exact_power ? kNewtonStep : kFloatNewtonStep;
  double smallest = -1.0;  // below or at the least candidate's a·y
  for (int step = 0; step < 200 && hi - lo > width; ++step) {
    if (smallest >= hi) break;  // the support is settled: every candidate left is in it
    const double mid = 0.5 * (lo + hi);
    std::int64_t above = 0;
    if (mass(y, n, a, mid, above) >= 1.0) {
      lo = mid;
      // Compacting is a scalar pass: worth it when it drops a quarter of the candidates.
      if (4 * above < 3 * n) n = keep_above(y, n, a, lo, smallest);
    } else {
      hi = mid;
    }
  }
  const double inverse = 1.0 / a;
  double tau = lo;
  for (int step = 0; step < 100; ++step) {
    double f = -1.0, slope = 0;
#pragma omp simd reduction(+ : f, slope)
    for (std::int64_t k = 0; k < n; ++k) {
      const double t = a * y[k] - tau;
      const double p = t > 0 ? power(t, a) : 0.0;
      f += p;
      slope += t > 0 ? p / t : 0.0;
    }
    const double change = f / (inverse * slope);
    tau = std::min(tau + change, hi);
    if (!(change > newton_step * (1.0 + std::fabs(tau)))) break;
  }
  return tau;
}

}  // namespace

float entmax_threshold(const float* z, std::int64_t n, double alpha, bool sort, float* scratch) {
  const double a = alpha - 1.0;
  const float peak = ops::row_max(z, n, z[0]);
  // τ ≥ −1 in the library's units: keys with (α−1)(z − max) ≤ −1 have p = 0. The cut is widened by
  // 1e-6 relative, so no key is lost to float rounding (a superset is as exact).
  const float cut = static_cast<float>(-(1.0 + 1e-6) / a);
  std::int64_t count = 0;
  for (std::int64_t j = 0; j < n; ++j) {  // branch-free: each y written, kept if above the cut
    const float y = z[j] - peak;
    scratch[count] = y;
    count += y > cut ? 1 : 0;
  }
  const double lo = -1.0, hi = -std::pow(1.0 / static_cast<double>(n), a);
  const double tau = sort ? sort_threshold(scratch, count, a, lo, hi) : bisect_threshold(scratch, count, a, lo, hi);
  return static_cast<float>(peak + tau / a);
}

void entmax_probabilities(const float* z, std::int64_t n, double alpha, float theta, float* p) {
  if (alpha == 1.5) {
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) {
      const float t = std::max(0.5f * (z[j] - theta), 0.0f);
      p[j] = t * t;
    }
  } else if (alpha == 2.0) {
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) p[j] = std::max(z[j] - theta, 0.0f);
  } else {
    const float a = static_cast<float>(alpha - 1.0), inverse = static_cast<float>(1.0 / (alpha - 1.0));
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) p[j] = fast_power(a * (z[j] - theta), inverse);
  }
}

AdaptiveSparseConfig resolve(const Problem& p, AdaptiveSparseConfig c) {
  c.block_q = std::min(c.block_q, p.seq_len);
  return c;
}

void validate(const Problem&, const AdaptiveSparseConfig& c) {
  if (c.learn_alpha && !(c.alpha >= 1.01 && c.alpha < 2.0))
    throw ParamError("adaptive-sparse: learn_alpha needs alpha in [1.01, 2) (alpha = 1 + sigmoid(a)), got " +
                     std::to_string(c.alpha));
}

namespace {

constexpr double kAlphaFloor = 1.01;  // the paper's clamp of a learned α from below

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double learned_alpha(double logit) { return std::clamp(1.0 + sigmoid(logit), kAlphaFloor, 2.0); }

// Key columns of the block at q0 with `rows` rows, and the keys row i sees.
std::int64_t block_columns(const Problem& p, std::int64_t q0, std::int64_t rows) {
  return p.causal ? q0 + rows : p.seq_len;
}
std::int64_t valid_keys(const Problem& p, std::int64_t i) { return p.causal ? i + 1 : p.seq_len; }

// The bf16 form's fp32 rows per thread in the forward: a head's K and V, a block's q and output.
std::int64_t bf16_forward_floats(const Problem& p, const AdaptiveSparseConfig& c) {
  return 2 * p.seq_len * p.head_dim + 2 * c.block_q * p.head_dim;
}

// Σ over the rows of [q0, q0 + rows) of the keys they see.
std::int64_t block_valid(const Problem& p, std::int64_t q0, std::int64_t rows) {
  return p.causal ? rows * q0 + rows * (rows + 1) / 2 : rows * p.seq_len;
}

// Σ over blocks of f(rows, cols, valid) for one head.
template <class F>
std::int64_t over_blocks(const Problem& p, const AdaptiveSparseConfig& c, F f) {
  std::int64_t total = 0;
  for (std::int64_t q0 = 0; q0 < p.seq_len; q0 += c.block_q) {
    const std::int64_t rows = std::min(c.block_q, p.seq_len - q0);
    total += f(rows, block_columns(p, q0, rows), block_valid(p, q0, rows));
  }
  return total;
}

class AdaptiveSparse final : public Mechanism {
 public:
  AdaptiveSparse(const Problem& problem, const AdaptiveSparseConfig& config) : p_(problem), c_(config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    alpha_ = Tensor(Shape{p_.heads});
    if (c_.learn_alpha) {
      alpha_logit_ = Tensor(Shape{p_.heads});
      alpha_logit_.fill(static_cast<float>(std::log((c_.alpha - 1.0) / (2.0 - c_.alpha))));
    } else {
      alpha_.fill(static_cast<float>(c_.alpha));
    }
    update_alphas();
    ld_ = ops::padded_ld(p_.seq_len);
    scores_ = Tensor(Shape{p_.threads, c_.block_q, ld_});
    candidates_ = Tensor(Shape{p_.threads, p_.seq_len});
    if (bf16_form()) widened_ = Tensor(Shape{p_.threads, bf16_forward_floats(p_, c_)});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    update_alphas();
    const std::int64_t n = p_.seq_len, d = p_.head_dim, blocks = (n + c_.block_q - 1) / c_.block_q;
    const std::int64_t tasks = p_.batch * p_.heads * blocks;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t head = task / blocks;
        // Causal blocks near the end of a head are the longest: start them first.
        const std::int64_t block = p_.causal ? blocks - 1 - task % blocks : task % blocks;
        const std::int64_t offset = head * n * d, q0 = block * c_.block_q;
        flops += bf16_form() ? widened_block(head, q, k, v, out, q0, thread)
                             : query_block(head, q.data() + offset + q0 * d, k.data() + offset, v.data() + offset,
                                           out.data() + offset + q0 * d, q0, thread);
      }
    }
    FlopCounter::add(flops);
    if (cache_.capacity() > 0) cache_.load_context(k, v, p_.threads);  // the prefill of a decode
    length_ = n;
  }

  std::vector<NamedTensor> parameters() const override {
    if (c_.learn_alpha) return {{"alpha", &alpha_}, {"alpha_logit", &alpha_logit_}};
    return {{"alpha", &alpha_}};
  }

  void prepare_backward() override {
    thresholds_ = Tensor(Shape{p_.batch * p_.heads * p_.seq_len});
    score_grads_ = Tensor(Shape{p_.threads, c_.block_q, ld_});
    if (bf16_form()) widened_heads_ = Tensor(Shape{p_.threads, 7, p_.seq_len, p_.head_dim});
    if (c_.learn_alpha) {
      dalpha_logit_ = Tensor(Shape{p_.heads});
      alpha_partials_ = Tensor(Shape{p_.batch * p_.heads});
    }
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t head = 0; head < heads; ++head) {
        const std::int64_t offset = head * n * d;
        if (bf16_form()) {
          flops += widened_head_backward(head, {&q, &k, &v, &dout}, {&dq, &dk, &dv}, thread);
          continue;
        }
        flops += head_backward(head,
                               {q.data() + offset, k.data() + offset, v.data() + offset, dout.data() + offset,
                                dq.data() + offset, dk.data() + offset, dv.data() + offset},
                               thread);
      }
    }
    FlopCounter::add(flops);
    if (c_.learn_alpha) {
      for (std::int64_t h = 0; h < p_.heads; ++h) {
        double total = 0;
        for (std::int64_t b = 0; b < p_.batch; ++b) total += alpha_partials_[b * p_.heads + h];
        const double s = sigmoid(alpha_logit_[h]);
        const bool clamped = 1.0 + s < kAlphaFloor;
        dalpha_logit_[h] = clamped ? 0.0f : static_cast<float>(total * s * (1.0 - s));
      }
    }
  }

  std::vector<NamedTensor> saved() const override { return {{"threshold", &thresholds_}}; }

  std::vector<NamedTensor> parameter_gradients() const override {
    if (c_.learn_alpha) return {{"dalpha_logit", &dalpha_logit_}};
    return {};
  }

  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t heads = p_.batch * p_.heads, capacity = p_.seq_len + tokens;
    cache_ = KvCache(heads, capacity, p_.head_dim, p_.dtype);
    step_scores_ = Tensor(Shape{heads, ops::padded_ld(capacity)});
    step_candidates_ = Tensor(Shape{heads, capacity});
    if (bf16_form()) step_rows_ = Tensor(Shape{heads, 2, p_.head_dim});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (length_ >= cache_.capacity()) throw std::logic_error("adaptive-sparse: decode step past the prepared capacity");
    if (bf16_form())
      step_heads<bf16>(q, k, v, out);
    else
      step_heads<float>(q, k, v, out);
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"key_cache", &cache_.key_tensor()}, {"value_cache", &cache_.value_tensor()}};
  }

 private:
  // One head's tensors for the backward, each [N, D].
  struct HeadGrads {
    const float *q, *k, *v, *dout;
    float *dq, *dk, *dv;
  };

  bool bf16_form() const { return p_.dtype == DType::BF16; }

  // The bf16 form (adaptive_sparse.hpp): one block with the head's visible K, V rows and the
  // block's q rows widened into the thread's fp32 rows (bf16_forward_floats), the output rounded once.
  std::int64_t widened_block(std::int64_t head, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                             std::int64_t q0, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, rows = std::min(c_.block_q, n - q0);
    const std::int64_t cols = block_columns(p_, q0, rows), offset = head * n * d;
    float* keys = widened_.data() + thread * widened_.dim(1);
    float* values = keys + n * d;
    float* queries = values + n * d;
    float* outputs = queries + c_.block_q * d;
    widen(k.bf16_data() + offset, keys, cols * d);
    widen(v.bf16_data() + offset, values, cols * d);
    widen(q.bf16_data() + offset + q0 * d, queries, rows * d);
    const std::int64_t flops = query_block(head, queries, keys, values, outputs, q0, thread);
    narrow(outputs, out.bf16_data() + offset + q0 * d, rows * d);
    return flops;
  }

  // The bf16 backward of one head: its q, k, v, dO widened, the fp32 backward into the thread's
  // fp32 dQ, dK, dV, each rounded once.
  std::int64_t widened_head_backward(std::int64_t head, const std::array<const Tensor*, 4>& inputs,
                                     const std::array<Tensor*, 3>& grads, int thread) {
    const std::int64_t size = p_.seq_len * p_.head_dim, offset = head * size;
    float* rows = widened_heads_.data() + thread * 7 * size;
    widen_spans(inputs, offset, size, rows, size);
    const std::int64_t flops = head_backward(
        head, {rows, rows + size, rows + 2 * size, rows + 3 * size, rows + 4 * size, rows + 5 * size, rows + 6 * size},
        thread);
    narrow_spans(rows + 4 * size, size, grads, offset, size);
    return flops;
  }

  // One step of every head on T = float or bf16 tensors and cache: the key and value appended, the
  // scores and entmax in fp32 (a bf16 query widened into step_rows_), P·V on the cached values
  // (decode_common's row_scores and weigh_rows), the output rounded once in bf16.
  template <class T>
  void step_heads(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t d = p_.head_dim, keys = length_ + 1, ld = step_scores_.dim(1);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    // The step reads every head's cached K and V once; below kParallelStepFloats a team costs more than it saves.
    const bool parallel = 2 * p_.batch * p_.heads * keys * d >= kParallelStepFloats;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops) if (parallel)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      cache_.store(head, length_, elements<T>(k) + head * d, elements<T>(v) + head * d, 1);
      const double alpha = alpha_[head % p_.heads];
      float* scores = step_scores_.data() + head * ld;
      float* rows = std::is_same_v<T, float> ? nullptr : step_rows_.data() + head * 2 * d;  // query, output
      const float* query = fp32_elements(elements<T>(q) + head * d, d, rows);
      flops += row_scores(query, cache_.keys<T>(head), keys, d, scale, scores);
      const float theta =
          entmax_threshold(scores, keys, alpha, sorts(alpha), step_candidates_.data() + head * step_candidates_.dim(1));
      entmax_probabilities(scores, keys, alpha, theta, scores);
      T* dst = elements<T>(out) + head * d;
      float* result = fp32_target(dst, 0, d, rows == nullptr ? nullptr : rows + d);
      flops += kEntmaxFlopsPerElement * keys + weigh_rows(scores, cache_.values<T>(head), keys, d, result);
      store_rows(result, dst, 0, 1, d);
    }
    FlopCounter::add(flops);
  }

  bool sorts(double alpha) const { return c_.algorithm == EntmaxAlgorithm::Auto && (alpha == 1.5 || alpha == 2.0); }

  void update_alphas() {
    if (!c_.learn_alpha) return;
    for (std::int64_t h = 0; h < p_.heads; ++h) alpha_[h] = static_cast<float>(learned_alpha(alpha_logit_[h]));
  }

  // The entmax rows of the block's scores [rows, cols] at (head, q0), in place: each row's θ found
  // (and saved when training) or, with `saved_thresholds`, read back; keys beyond a causal row's
  // last get 0.
  void entmax_rows(std::int64_t head, std::int64_t q0, std::int64_t rows, std::int64_t cols, float* scores, int thread,
                   bool saved_thresholds) {
    const double alpha = alpha_[head % p_.heads];
    float* theta = thresholds_.empty() ? nullptr : thresholds_.data() + head * p_.seq_len + q0;
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * ld_;
      const std::int64_t valid = valid_keys(p_, q0 + r);
      const float t = saved_thresholds
                          ? theta[r]
                          : entmax_threshold(row, valid, alpha, sorts(alpha), candidates_.data() + thread * p_.seq_len);
      if (theta != nullptr && !saved_thresholds) theta[r] = t;
      entmax_probabilities(row, valid, alpha, t, row);
      std::fill(row + valid, row + cols, 0.0f);
    }
  }

  // Rows [q0, q0 + block_q) of one head: q and out point at row q0, k and v at the head's row 0.
  // Returns the FLOPs it executed outside oneDNN.
  std::int64_t query_block(std::int64_t head, const float* q, const float* k, const float* v, float* out,
                           std::int64_t q0, int thread) {
    const std::int64_t d = p_.head_dim, rows = std::min(c_.block_q, p_.seq_len - q0);
    const std::int64_t cols = block_columns(p_, q0, rows);
    float* scores = scores_.data() + thread * c_.block_q * ld_;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, rows, cols, d, scale, q, d, k, d, 0.0f, scores, ld_);
    entmax_rows(head, q0, rows, cols, scores, thread, false);
    ops::gemm(false, false, rows, d, cols, 1.0f, scores, ld_, v, d, 0.0f, out, d);
    return kEntmaxFlopsPerElement * block_valid(p_, q0, rows);
  }

  // The whole backward of one head, block by block. Returns the FLOPs it executed outside oneDNN.
  std::int64_t head_backward(std::int64_t head, const HeadGrads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* probs = scores_.data() + thread * c_.block_q * ld_;
    float* grads = score_grads_.data() + thread * c_.block_q * ld_;
    std::fill(g.dk, g.dk + n * d, 0.0f);
    std::fill(g.dv, g.dv + n * d, 0.0f);
    double dalpha = 0;
    std::int64_t flops = 0;
    for (std::int64_t q0 = 0; q0 < n; q0 += c_.block_q) {
      const std::int64_t rows = std::min(c_.block_q, n - q0), cols = block_columns(p_, q0, rows);
      ops::gemm(false, true, rows, cols, d, scale, g.q + q0 * d, d, g.k, d, 0.0f, probs, ld_);
      ops::gemm(false, true, rows, cols, d, 1.0f, g.dout + q0 * d, d, g.v, d, 0.0f, grads, ld_);
      entmax_rows(head, q0, rows, cols, probs, thread, true);
      for (std::int64_t r = 0; r < rows; ++r)
        dalpha += score_gradient_row(head, probs + r * ld_, grads + r * ld_, valid_keys(p_, q0 + r), cols);
      ops::gemm(true, false, cols, d, rows, 1.0f, probs, ld_, g.dout + q0 * d, d, 1.0f, g.dv, d);
      ops::gemm(false, false, rows, d, cols, scale, grads, ld_, g.k, d, 0.0f, g.dq + q0 * d, d);
      ops::gemm(true, false, cols, d, rows, scale, grads, ld_, g.q + q0 * d, d, 1.0f, g.dk, d);
      const std::int64_t valid = block_valid(p_, q0, rows);
      flops += (kEntmaxFlopsPerElement + kEntmaxBackwardFlopsPerElement +
                (c_.learn_alpha ? kEntmaxAlphaGradFlopsPerElement : 0)) *
               valid;
    }
    if (c_.learn_alpha) alpha_partials_[head] = static_cast<float>(dalpha);
    return flops;
  }

  // One row: dp [cols] (dO·Vᵀ) becomes dZ = g⊙dp − g·(Σg⊙dp/Σg), g = p^(2−α) on the support (0
  // beyond `valid`). Returns the row's ∂L/∂α when α is learned, else 0.
  double score_gradient_row(std::int64_t head, const float* p, float* dp, std::int64_t valid, std::int64_t cols) const {
    const double alpha = alpha_[head % p_.heads], a = alpha - 1.0;
    auto weight = [alpha](float prob) -> float {
      if (prob <= 0.0f) return 0.0f;
      if (alpha == 1.5) return std::sqrt(prob);
      if (alpha == 2.0) return 1.0f;
      return fast_power(prob, static_cast<float>(2.0 - alpha));
    };
    double sum_g = 0, sum_gdp = 0, entropy_sum = 0;
    for (std::int64_t j = 0; j < valid; ++j) {
      const float w = weight(p[j]);
      sum_g += w;
      sum_gdp += w * dp[j];
      if (c_.learn_alpha && p[j] > 0.0f) entropy_sum += p[j] * std::log(static_cast<double>(p[j]));
    }
    const double mean = sum_gdp / sum_g;
    double dalpha = 0;
    for (std::int64_t j = 0; j < valid; ++j) {
      const float w = weight(p[j]);
      if (c_.learn_alpha && p[j] > 0.0f) {
        const double skewed = w / sum_g, s = p[j] * std::log(static_cast<double>(p[j]));
        dalpha += dp[j] * ((p[j] - skewed) / (a * a) - (s - skewed * entropy_sum) / a);
      }
      dp[j] = static_cast<float>(w * (dp[j] - mean));
    }
    std::fill(dp + valid, dp + cols, 0.0f);
    return dalpha;
  }

  Problem p_;
  AdaptiveSparseConfig c_;
  std::int64_t ld_ = 0;
  Tensor alpha_, alpha_logit_;  // [H]: each head's α; the learned a (learn_alpha)
  Tensor scores_, candidates_;  // per thread: a block's scores [block_q, ld], a row's candidates [N]
  Tensor thresholds_;           // training: θ of every row, [B·H·N]
  Tensor score_grads_;          // training: per thread dP/dZ of a block, [block_q, ld]
  Tensor dalpha_logit_;         // training with learn_alpha: [H]
  Tensor alpha_partials_;       // training with learn_alpha: ∂L/∂α per (batch, head), [B·H]
  KvCache cache_;               // decode: every token's keys and values, [B·H, N + T, D] each
  Tensor step_scores_;          // decode: a score row per head, [B·H, padded(N + T)]
  Tensor step_candidates_;      // decode: a candidate buffer per head, [B·H, N + T]
  Tensor step_rows_;            // bf16 decode: per head the widened query and the fp32 output, [B·H, 2, D]
  Tensor widened_;              // bf16: per thread bf16_forward_floats
  Tensor widened_heads_;        // bf16 training: per thread a head's q, k, v, dO, dQ, dK, dV, [7, N, D]
  std::int64_t length_ = 0;     // decode: tokens in the cache
};

constexpr std::int64_t kFloat = sizeof(float);

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const AdaptiveSparseConfig& c, std::uint64_t) {
  return std::make_unique<AdaptiveSparse>(problem, c);
}

std::int64_t flops(const Problem& p, const AdaptiveSparseConfig& c) {
  const std::int64_t d = p.head_dim;
  return p.batch * p.heads * over_blocks(p, c, [d](std::int64_t rows, std::int64_t cols, std::int64_t valid) {
           return 2 * matmul_flops(rows, cols, d) + kEntmaxFlopsPerElement * valid;
         });
}

std::int64_t workspace(const Problem& p, const AdaptiveSparseConfig& c) {
  const std::int64_t parameters = c.learn_alpha ? 2 * p.heads : p.heads;
  const std::int64_t widened = p.dtype == DType::BF16 ? p.threads * bf16_forward_floats(p, c) : 0;
  return (parameters + p.threads * (c.block_q * ops::padded_ld(p.seq_len) + p.seq_len) + widened) * kFloat;
}

std::int64_t backward_flops(const Problem& p, const AdaptiveSparseConfig& c) {
  const std::int64_t d = p.head_dim;
  const std::int64_t per_entry =
      kEntmaxFlopsPerElement + kEntmaxBackwardFlopsPerElement + (c.learn_alpha ? kEntmaxAlphaGradFlopsPerElement : 0);
  return p.batch * p.heads *
         over_blocks(p, c, [d, per_entry](std::int64_t rows, std::int64_t cols, std::int64_t valid) {
           return 5 * matmul_flops(rows, cols, d) + per_entry * valid;
         });
}

std::int64_t backward_workspace(const Problem& p, const AdaptiveSparseConfig& c) {
  const std::int64_t alpha = c.learn_alpha ? p.heads + p.batch * p.heads : 0;
  const std::int64_t widened = p.dtype == DType::BF16 ? p.threads * 7 * p.seq_len * p.head_dim : 0;
  return (p.batch * p.heads * p.seq_len + p.threads * c.block_q * ops::padded_ld(p.seq_len) + alpha + widened) * kFloat;
}

std::int64_t decode_workspace(const Problem& p, const AdaptiveSparseConfig&, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, capacity = p.seq_len + tokens;
  const std::int64_t step_rows = p.dtype == DType::BF16 ? heads * 2 * p.head_dim : 0;
  return KvCache::bytes(heads, capacity, p.head_dim, p.dtype) +
         (heads * (ops::padded_ld(capacity) + capacity) + step_rows) * kFloat;
}

FieldTable<AdaptiveSparseConfig> config_fields(const AdaptiveSparseConfig*) {
  return {real_field("alpha", &AdaptiveSparseConfig::alpha, 1.01, 2,
                     "entmax alpha of every head (1: softmax, 2: sparsemax; the initial alpha when learned)"),
          flag_field("learn_alpha", &AdaptiveSparseConfig::learn_alpha,
                     "learn alpha per head as clamp(1 + sigmoid(a), 1.01, 2), a initialised from alpha"),
          choice_field("algorithm", &AdaptiveSparseConfig::algorithm,
                       {{"auto", EntmaxAlgorithm::Auto}, {"bisect", EntmaxAlgorithm::Bisect}},
                       "threshold solver: auto sorts the candidates at alpha 1.5 or 2 and bisects otherwise; "
                       "bisect always bisects"),
          int_field("block_q", &AdaptiveSparseConfig::block_q, 1, 4096, "query rows per task (tokens, clamped to N)")};
}

template <>
Implementation implementation<AdaptiveSparseConfig>() {
  Implementation impl = implement<AdaptiveSparseConfig>();
  impl.bf16_forward = true;  // storage only (adaptive_sparse.hpp): forward, decode and backward
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
