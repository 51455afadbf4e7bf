#pragma once
// Gradient checks shared by the backward tests: run a registered mechanism's forward and backward,
// compare dQ, dK, dV with the analytic gradient of the double-precision masked reference, and check
// the directional derivative ⟨dO, J·δ⟩ (central differences of the reference) = ⟨Jᵀ·dO, δ⟩.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/tensor.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

struct BackwardRun {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out, dq, dk, dv;  // out [B, H, M, D], dq, dk, dv [B, H, N, D]; NaN-filled before the calls: every
                           // element must be written
};

// create, prepare, prepare_backward, forward, backward with the given dO, on kTestThreads threads.
BackwardRun run_backward(const std::string& model, const Problem& p, const AttentionInputs& in, const Tensor& dout,
                         const std::vector<std::string>& params = {}, std::uint64_t seed = 42);

// N(0,1) in the shape of q, from stream `name`.
Tensor random_like(const Problem& p, std::uint64_t seed, const char* name);
// N(0,1) in the shape of the model's output ([B, H, M, D]: dO), from stream `name`.
Tensor random_output(const std::string& model, const Problem& p, const std::vector<std::string>& params,
                     std::uint64_t seed, const char* name);

// Every element of dQ, dK, dV of every head within gradient_error_factor · (its terms). Returns the
// largest error / tolerance ratio; with `report`, CHECKs fail for elements above 1.
double check_gradients(const BackwardRun& run, const AttentionInputs& in, const Tensor& dout, const Problem& p,
                       const HeadMask& allowed, const std::string& label, bool report = true);

// ⟨dQ, δq⟩ + ⟨dK, δk⟩ + ⟨dV, δv⟩ against the central difference of ⟨dO, reference(x + hδ)⟩, per head,
// within the element tolerances weighted by |δ| (plus the difference's own error).
void check_directional_derivative(const BackwardRun& run, const AttentionInputs& in, const Tensor& dout,
                                  const Problem& p, const HeadMask& allowed, const std::string& label);

// Both checks on seeded inputs and dO; returns check_gradients' largest ratio.
double check_model_gradients(const std::string& model, const Problem& p, const HeadMask& allowed,
                             const std::vector<std::string>& params = {}, std::uint64_t seed = 7);

// Named double-precision inputs of a whole model: "q", "k", "v" ([B, H, N, D]) and parameters.
using NamedValues = std::map<std::string, std::vector<double>>;
// The inputs alone, widened.
inline NamedValues named_inputs(const AttentionInputs& in) {
  return {{"q", widened(in.q.data(), in.q.size())},
          {"k", widened(in.k.data(), in.k.size())},
          {"v", widened(in.v.data(), in.v.size())}};
}
// The inputs and the mechanism's parameters (by their names), widened.
inline NamedValues named_inputs(const AttentionInputs& in, const Mechanism& mechanism) {
  NamedValues named = named_inputs(in);
  for (const auto& parameter : mechanism.parameters())
    named[parameter.name] = widened(parameter.tensor->data(), parameter.tensor->size());
  return named;
}
// The model's output in double (the layout of dO), from the named inputs.
using ModelReference = std::function<std::vector<double>(const NamedValues& inputs)>;

// For models whose forward is more than masked attention (learned projections, compressions): the
// gradients of q, k, v and of every parameter with a gradient ("d<name>") against central
// differences of ⟨dO, reference⟩: with `every_element` (tiny problems) each element, else a seeded
// sample of 24 per tensor; and always the directional derivative along a seeded random direction.
// An element may be off by 64·eps·(log2 N + D)·max(largest |gradient| of its tensor, of any
// tensor), plus the difference quotient's own error.
void check_composite_gradients(const std::string& model, const Problem& p, const std::vector<std::string>& params,
                               const ModelReference& reference, bool every_element, std::uint64_t seed = 7);

// The core of the check above, for any model with named inputs: grads[name] is the gradient of
// ⟨dout, reference⟩ with respect to inputs[name]; an element may be off by
// 64·eps·size_factor·max(largest |gradient| of its tensor, of any tensor) plus the difference
// quotient's own error.
void check_against_differences(const std::string& label, const NamedValues& inputs,
                               const std::map<std::string, const Tensor*>& grads, const Tensor& dout,
                               const ModelReference& reference, double size_factor, bool every_element);

}  // namespace xfb::test
