#pragma once
// What a point of the forward, backward and train passes runs, one workload per scope: the seeded
// inputs, the mechanism (and in layer scope the encoder layer around it) prepared untimed, the
// forward and backward calls the pass times, what the forward saves, and the files of a dump.
//   attention  q, k, v [B, H, N, D], out [B, H, M, D] (training: dout like out; dq, dk, dv like q)
//   layer      x [B, N, H·D], y [B, M, H·D] (training: dy like y, dx like x); the layer's own q, k, v inside
// M = N but for a downsampling model (point_output_rows).
// Every tensor is allocated before the mechanism is prepared, so a model's setup-only buffers peak
// over the inputs, as they do in a real step. The decode pass has its own runner (point.cpp).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "apps/bench/point.hpp"
#include "taxonomy/layer/moe_ffn.hpp"

namespace xfb {

using DumpFiles = std::vector<std::pair<std::string, const Tensor*>>;

class Workload {
 public:
  virtual ~Workload() = default;
  virtual void forward() = 0;
  virtual void backward() = 0;  // after a forward; reads what it saved
  // Bytes the forward keeps for the backward (0 unless training).
  virtual std::int64_t saved_bytes() const = 0;
  // Inputs, output, parameters (and with training the gradients) as a dump names them.
  virtual DumpFiles dump_files() const = 0;
  // A layer's forward and backward are its stages: the mechanism's own stages are not timed apart.
  virtual bool whole_layer() const = 0;
  Mechanism& mechanism() { return *mechanism_; }
  // The layer's mixture of experts (its routing counts after a forward); nullptr for a dense FFN or attention scope.
  virtual const MoeFfn* moe() const { return nullptr; }

 protected:
  std::unique_ptr<Mechanism> mechanism_;
};

// The point's workload, prepared: inputs drawn from the seed, mechanism created and prepared (and
// prepared for the backward when the pass trains). Untimed.
std::unique_ptr<Workload> make_workload(const Point& point);

// The timed body of the point's pass on `workload`: the forward; the backward (after one untimed
// forward here, which saves what it reads); or the train step, forward then backward, with the
// stages `forward` and `backward` unless the mechanism keeps its own (attention scope).
std::function<void()> pass_body(Pass pass, Workload& workload);

}  // namespace xfb
