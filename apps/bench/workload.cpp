#include "apps/bench/workload.hpp"

#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "taxonomy/layer/encoder_layer.hpp"

namespace xfb {
namespace {

bool trains(Pass pass) { return pass == Pass::Backward || pass == Pass::Train; }

// The mechanism's parameters, and with training their gradients, appended to a dump's files.
void add_mechanism_files(DumpFiles& files, const Mechanism& mechanism, bool training) {
  for (const auto& named : mechanism.parameters()) files.emplace_back(named.name, named.tensor);
  if (training)
    for (const auto& named : mechanism.parameter_gradients()) files.emplace_back(named.name, named.tensor);
}

Tensor seeded(Tensor tensor, std::uint64_t seed, const char* stream) {
  CounterRng(seed, stream).fill_normal(tensor);
  return tensor;
}

class AttentionWorkload final : public Workload {
 public:
  explicit AttentionWorkload(const Point& point) : training_(trains(point.config.pass)) {
    const PointConfig& c = point.config;
    const Problem& p = c.problem;
    auto bhnd = [&] { return Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, p.dtype); };
    auto outputs = [&] { return Tensor::bhnd(p.batch, p.heads, point_output_rows(point), p.head_dim, p.dtype); };
    q_ = seeded(bhnd(), c.seed, "input/q");
    k_ = seeded(bhnd(), c.seed, "input/k");
    v_ = seeded(bhnd(), c.seed, "input/v");
    out_ = outputs();
    if (training_) {
      dout_ = seeded(outputs(), c.seed, "input/dout");
      dq_ = bhnd();
      dk_ = bhnd();
      dv_ = bhnd();
    }
    mechanism_ = point.model->impl.create(p, point.requested, c.seed);
    mechanism_->prepare(q_, k_, v_);
    if (training_) mechanism_->prepare_backward();
  }
  void forward() override { mechanism_->forward(q_, k_, v_, out_); }
  void backward() override { mechanism_->backward(q_, k_, v_, out_, dout_, dq_, dk_, dv_); }
  std::int64_t saved_bytes() const override { return training_ ? mechanism_->saved_bytes() : 0; }
  bool whole_layer() const override { return false; }
  DumpFiles dump_files() const override {
    DumpFiles files = {{"q", &q_}, {"k", &k_}, {"v", &v_}, {"out", &out_}};
    if (training_) files.insert(files.end(), {{"dout", &dout_}, {"dq", &dq_}, {"dk", &dk_}, {"dv", &dv_}});
    add_mechanism_files(files, *mechanism_, training_);
    return files;
  }

 private:
  bool training_;
  Tensor q_, k_, v_, out_, dout_, dq_, dk_, dv_;
};

class LayerWorkload final : public Workload {
 public:
  explicit LayerWorkload(const Point& point) : training_(trains(point.config.pass)) {
    const PointConfig& c = point.config;
    const Problem& p = c.problem;
    const std::int64_t rows = point_output_rows(point);
    const Shape shape{p.batch, p.seq_len, p.heads * p.head_dim}, out_shape{p.batch, rows, p.heads * p.head_dim};
    x_ = seeded(Tensor(shape, p.dtype), c.seed, "input/x");
    out_ = Tensor(out_shape, p.dtype);
    if (training_) {
      dout_ = seeded(Tensor(out_shape, p.dtype), c.seed, "input/dout");
      dx_ = Tensor(shape, p.dtype);
    }
    mechanism_ = point.model->impl.create(p, point.requested, c.seed);
    layer_ =
        std::make_unique<EncoderLayer>(p, c.effective_d_ff(), rows, !point.model->impl.downsamples(), c.seed, c.ffn);
    if (training_) layer_->prepare_training();  // the layer's own buffers, before the mechanism's setup
    layer_->prepare(*mechanism_, x_);
    if (training_) layer_->prepare_backward(*mechanism_);
  }
  void forward() override { layer_->forward(*mechanism_, x_, out_); }
  void backward() override { layer_->backward(*mechanism_, x_, dout_, dx_); }
  std::int64_t saved_bytes() const override {
    return training_ ? mechanism_->saved_bytes() + total_bytes(layer_->saved()) : 0;
  }
  bool whole_layer() const override { return true; }
  const MoeFfn* moe() const override { return layer_->moe(); }
  DumpFiles dump_files() const override {
    DumpFiles files = {{"x", &x_},
                       {"q", &layer_->q()},
                       {"k", &layer_->k()},
                       {"v", &layer_->v()},
                       {"attention_out", &layer_->attention_output()},
                       {"out", &out_}};
    for (const auto& named : layer_->parameters()) files.emplace_back(named.name, named.tensor);
    if (training_) {
      files.insert(files.end(), {{"dout", &dout_}, {"dx", &dx_}});
      for (const auto& named : layer_->attention_gradients()) files.emplace_back(named.name, named.tensor);
      for (const auto& named : layer_->parameter_gradients()) files.emplace_back(named.name, named.tensor);
    }
    add_mechanism_files(files, *mechanism_, training_);
    return files;
  }

 private:
  bool training_;
  Tensor x_, out_, dout_, dx_;
  std::unique_ptr<EncoderLayer> layer_;
};

// One half of a train step, charged to the stage `name` unless the mechanism kept its own laps.
void timed_half(Workload& w, void (Workload::*half)(), const char* name) {
  const std::size_t before = stage_clock::stages();
  stage_clock::mute(w.whole_layer());
  (w.*half)();
  stage_clock::mute(false);
  if (stage_clock::stages() == before)
    stage_clock::lap(name);
  else
    stage_clock::restart();
}

}  // namespace

std::unique_ptr<Workload> make_workload(const Point& point) {
  if (point.config.scope == Scope::Layer) return std::make_unique<LayerWorkload>(point);
  return std::make_unique<AttentionWorkload>(point);
}

std::function<void()> pass_body(Pass pass, Workload& w) {
  switch (pass) {
    case Pass::Backward:
      w.forward();  // untimed: saves what the timed backward reads (the backward leaves it unchanged)
      return [&w] { w.backward(); };
    case Pass::Train:
      // Attention scope: a mechanism that splits its forward or backward into stages of its own
      // (route, attend) keeps them; layer scope: `forward` and `backward` are the whole layer's.
      return [&w] {
        timed_half(w, &Workload::forward, "forward");
        timed_half(w, &Workload::backward, "backward");
      };
    case Pass::Forward:
    case Pass::Decode:
      break;
  }
  return [&w] { w.forward(); };
}

}  // namespace xfb
