#pragma once
// Gradient checks shared by the backward tests: run a registered mechanism's forward and backward,
// compare dQ, dK, dV with the analytic gradient of the double-precision masked reference, and check
// the directional derivative ⟨dO, J·δ⟩ (central differences of the reference) = ⟨Jᵀ·dO, δ⟩.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/tensor.hpp"
#include "tests/reference.hpp"

namespace xfb::test {

struct BackwardRun {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out, dq, dk, dv;  // [B, H, N, D]; NaN-filled before the calls: every element must be written
};

// create, prepare, prepare_backward, forward, backward with the given dO, on kTestThreads threads.
BackwardRun run_backward(const std::string& model, const Problem& p, const AttentionInputs& in, const Tensor& dout,
                         const std::vector<std::string>& params = {}, std::uint64_t seed = 42);

// N(0,1) in the shape of q, from stream `name`.
Tensor random_like(const Problem& p, std::uint64_t seed, const char* name);

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

}  // namespace xfb::test
