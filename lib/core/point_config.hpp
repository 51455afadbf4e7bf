#pragma once
// What a benchmark point is, as plain typed values: the model, the problem, what is timed (scope,
// pass) and how (timing settings, seed, threads), the mechanism's `key=value` parameters. The one
// table that spells these fields on the command line, in reports, in the child's protocol and in
// the reproducer is apps/report/point_fields.hpp.
#include <cstdint>
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/timing.hpp"

namespace xfb {

// Attention: the mechanism alone on q, k, v; layer: inside a pre-LN encoder layer (docs/layer.md).
enum class Scope { Attention, Layer };
std::string scope_name(Scope s);
Scope parse_scope(const std::string& name);  // InputError on an unknown name

// What a point times: the forward alone; the backward alone (after an untimed forward that saved
// what it needs); one training step, forward then backward; or incremental decoding: a prefill of
// the N-token context (its own stage), then decode_tokens steps of one token each, timed one by one
// (attention scope; always causal).
enum class Pass { Forward, Backward, Train, Decode };
std::string pass_name(Pass p);
Pass parse_pass(const std::string& name);  // InputError on an unknown name
// `forward`, `train` or a comma list `forward,train` (InputError on an unknown or repeated name).
std::vector<Pass> parse_passes(const std::string& list);
// The inverse: "forward,train".
std::string pass_list_name(const std::vector<Pass>& passes);

// How a point ended: measured; skipped by --memory-limit; not possible for this model (a reason
// says why); or failed while running (a crash, a timeout, an exception: the reason).
enum class Status { Ok, Skipped, Unsupported, Error };
std::string status_name(Status s);
Status parse_status(const std::string& name);  // InputError on an unknown name

// The layer's feed-forward sublayer (layer scope): the dense FFN, or a mixture of experts replacing it,
// routed top-1 (Switch) or top-2 (GShard): taxonomy/layer/moe_ffn.hpp, docs/layer.md#mixture-of-experts.
enum class FfnKind { Dense, Switch, Gshard };
std::string ffn_name(FfnKind kind);          // "dense", "switch", "gshard"
FfnKind parse_ffn(const std::string& name);  // InputError on an unknown name
int ffn_top_k(FfnKind kind);                 // experts per token: 0 dense, 1 Switch, 2 GShard

struct MoeSettings {
  FfnKind kind = FfnKind::Dense;
  std::int64_t experts = 8;       // experts X (the targets' 8; Mesh-TF's default is 16)
  double capacity_factor = 1.25;  // capacity as a multiple of a group's even share k·S/X (Mesh-TF's training value)
  std::int64_t group_size = 0;    // tokens S per routing group, consecutive rows; 0: all B·N rows of the call
};

struct PointConfig {
  std::string model;
  Problem problem;
  Scope scope = Scope::Attention;
  Pass pass = Pass::Forward;
  std::int64_t d_ff = 0;            // layer scope FFN width; 0 means 4·H·D
  std::int64_t decode_tokens = 64;  // decode pass: tokens generated after the context
  MoeSettings ffn;                  // layer scope: the FFN sublayer (dense unless --ffn or a feed-forward card)
  std::uint64_t seed = 42;
  std::vector<std::string> params;  // `key=value` assignments
  TimingSettings timing;

  std::int64_t effective_d_ff() const { return d_ff > 0 ? d_ff : 4 * problem.heads * problem.head_dim; }
};

}  // namespace xfb
