#pragma once
// The interface every attention mechanism implements, and the registry entry that describes it.
//
// A mechanism computes O = attention(Q, K, V) for per-head tensors of shape [B, H, N, D]
// (batch, heads, tokens, features per head; row-major), optionally causal (token i depends only
// on tokens j <= i). Parameters (projections, random features, centroids …) are made from the seed
// in the untimed `prepare`; `forward` is the timed work.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/params.hpp"
#include "lib/tensor.hpp"

namespace xfb {

struct Problem {
  std::int64_t batch = 1;      // sequences per call
  std::int64_t heads = 8;      // attention heads
  std::int64_t seq_len = 1024; // tokens, N
  std::int64_t head_dim = 64;  // features per head, D
  bool causal = false;         // token i attends only to j <= i
  int threads = 1;             // OpenMP threads the mechanism runs on; per-thread buffers are sized
                               // for exactly this many (the harness sets the OpenMP team to match)
};

struct NamedTensor {
  std::string name;  // file stem for --dump, e.g. "random_features"
  const Tensor* tensor = nullptr;
};

class Mechanism {
 public:
  virtual ~Mechanism() = default;
  // Untimed. q, k, v: [B, H, N, D]. Builds parameters, buffers and oneDNN primitives; models that
  // fit to their input (k-means routing, say) may read the inputs here.
  virtual void prepare(const Tensor& q, const Tensor& k, const Tensor& v) = 0;
  // Timed. Writes every element of out: [B, H, N, D].
  virtual void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) = 0;
  // Every parameter tensor the mechanism used (for --dump).
  virtual std::vector<NamedTensor> parameters() const { return {}; }
};

// Survey class tags (the survey's letters in brackets).
enum class ModelClass { Exact, FixedPatterns, LearnablePatterns, Memory, LowRank, Kernels, Recurrence };
std::string class_name(ModelClass c);    // "fixed_patterns", …: the folder under taxonomy/
std::string class_letter(ModelClass c);  // "FP", …; "X" for the exact baselines
bool parse_class(const std::string& name, ModelClass& out);
const std::vector<ModelClass>& all_classes();

using CreateFn = std::unique_ptr<Mechanism> (*)(const Problem&, const ParamValues&, std::uint64_t seed);
// FLOPs one forward executes (conventions in lib/flop_counter.hpp); equals the counter exactly.
using FlopsFn = std::int64_t (*)(const Problem&, const ParamValues&);
// Tracked bytes one forward needs beyond its inputs and output (parameters, buffers, scratchpad),
// with per-thread buffers for Problem::threads threads.
using WorkspaceFn = std::int64_t (*)(const Problem&, const ParamValues&);
// Throws ParamError (one line) for values the model rejects for this problem. Called before
// anything runs or is written; create, flops and workspace may assume it passed.
using ValidateFn = void (*)(const Problem&, const ParamValues&);
// Why the model cannot run this valid problem ("" when it can): the point becomes an `unsupported`
// row with that reason.
using UnsupportedFn = std::string (*)(const Problem&, const ParamValues&);

struct Implementation {
  std::vector<ParamSpec> params;
  CreateFn create = nullptr;
  FlopsFn flops = nullptr;
  WorkspaceFn workspace_bytes = nullptr;
  ValidateFn validate = nullptr;        // optional: parameter ranges alone suffice without it
  UnsupportedFn unsupported = nullptr;  // optional: beyond the survey's Decode column
};

struct ModelInfo {
  std::string name;          // command-line name, e.g. "sparse-transformer"
  std::string display_name;  // e.g. "Sparse Transformer"
  std::vector<ModelClass> classes;
  std::string complexity;    // as printed in the survey's Table 1
  bool decodes = false;      // survey's Table 1 "Decode" column: supports causal attention
  std::string paper;         // authors and year
  std::string arxiv;         // arXiv id
  int year = 0;
  int survey_row = 0;        // row in the survey's Table 1 (v1); 0 when not in it
  Implementation impl;       // empty until the model is implemented

  bool implemented() const { return impl.create != nullptr; }
  bool has_class(ModelClass c) const;
};

}  // namespace xfb
