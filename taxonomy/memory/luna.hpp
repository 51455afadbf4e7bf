#pragma once
// `luna`: Luna, Linear Unified Nested Attention (Ma et al. 2021, arXiv 2106.01540; official code
// XuezheMax/fairseq-apollo, fairseq/modules/luna_attention.py and luna_sentence_encoder.py), in head
// space.
//
// Luna carries a projected sequence P from layer to layer next to the tokens. In attention scope the
// mechanism receives the per-head Q, K, V ([B, H, N, D]) and P is a learned parameter per head,
// P_h [l, D] (the head's slice of the model's P·W_pq: the paper's P W_pq, like Q = X W_q, is a
// projection outside the mechanism). With c = 1/√D, per (batch, head):
//   pack    Y_P = softmax_N(c·P_h·Kᵀ)·V                     [l, D]  (softmax over the N tokens)
//   unpack  O   = softmax_l(c·Q·Y_Pᵀ)·Y_P                   [N, D]  (softmax over the l rows)
// Roles (the choice where head space is ambiguous): the pack's keys are K and its values V (the
// code's untied pk_proj, pv_proj of X are the given K, V); the unpack's keys and values are both
// Y_P itself (the code's default tie_kv shares one projection c_proj of Y_P for keys and values;
// it is the identity here, so the mechanism is a function of q, k, v and P alone and no D×D
// projection is invented). The layer's P′ = LN(P + Y_P) and the FFN are outside the mechanism; Y_P
// is not an output (O has N rows).
// Non-causal rows of P: the encoder's default dynamic projection uses the first min(l, N) rows of
// P; so does this model (resolve sets projected_length = min(l, N)), and P is drawn by coordinates
// so those rows are the same for every N.
//
// Causal form (the code's LunarCausalAttention; no softmax over N). For token t (1-based):
//   a_t = elu(c·P_h·k_t) + 1                                [l]     pack weights, positive
//   s_t = (c/t)·(Σ_{s≤t} k_s a_sᵀ)ᵀ q_t                      [l]
//   π_t = softmax_l(s_t)
//   o_t = (1/t)·(Σ_{s≤t} a_s v_sᵀ)ᵀ π_t                      [D]
// as the code's efficient_causal_attention (the 1/t of its cumulative mean, the c of its scaled
// q) with its tied unpack key/value c_proj(X) taken as K (key role) and V (value role), and its pack
// key pc_proj(X) as K. The causal form uses all l rows of P at every N (cutting P to min(l, N)
// would make the model, and so earlier outputs, depend on the sequence length). It runs per head
// in chunks of `chunk` tokens: the chunk's pack weights by one product c·K_c·Pᵀ, then the prefix
// sums A = Σ k aᵀ (kept as Aᵀ [l, D]) and B = Σ a vᵀ [l, D] advance token by token; no N×N nor
// N×l×D tensor. Decoding keeps, per (batch, head), Aᵀ and B (dumped as key_sums and value_sums,
// [B, H, l, D] each) and the shared step count t (the sequences are in lock-step); each step is
// O(l·D).
//
// Parameters: projected_sequence [H, l, D] (l = projected_length as resolved), entry (h, j, f) =
// D^(−½)·normal_at(h, j, f) of stream "luna/projected_sequence" (P₀ ~ N(0, d^(−½)) as the code's
// projected_embeddings, with head space's D for the model's d). Its gradient is
// dprojected_sequence.
//
// Backward. Non-causal: the forward saves the pack probabilities [B·H, N, l] and the unpack
// probabilities [B·H, N, l]; Y_P is kept from the forward. Then per query block dSu = dO·Y_Pᵀ,
// dY_P = Suᵀ·dO + c·dUᵀ·Q, dQ = c·dU·Y_P (dU the softmax backward of dSu); then dSp = dY_P·Vᵀ,
// dV = Spᵀ·dY_P, dW = softmax backward of dSp, dP_h += c·dW·K, dK = c·dWᵀ·P_h. Causal: the forward
// saves a and π ([B·H, N, l] each); the backward walks forward again rebuilding A and B (dπ_t =
// B_t·dO_t/t, ds_t = softmax backward, dq_t = (c/t)·A_t·ds_t), then backwards with the suffix
// sums G_B = Σ_{u≥t} π_u dO_uᵀ/u and G_A = Σ_{u≥t} (c/u) q_u ds_uᵀ: dv_t = G_Bᵀ a_t, dk_t = G_A a_t,
// da_t = G_B v_t + G_Aᵀ k_t, dz_t = da_t ⊙ elu′; then dK += c·dZ·P_h and dP_h += c·dZᵀ·K.
//
// FLOPs (exact) per (batch, head), L = the rows of P used:
//   non-causal forward  8·N·L·D + 10·N·L            (four products, two softmaxes)
//   non-causal backward 16·N·L·D + 8·N·L
//   causal forward      N·(10·l·D + 7·l + D)        (pack product 2lD, elu l, sums and reads 8lD,
//                                                     1/t scalings l + D, softmax 5l)
//   causal backward     N·(24·l·D + 8·l + D)
//   decode step         10·l·D + 8·l + D
// Work is one task per (batch, head) (parallelism min(B·H, threads)); the non-causal pack scores
// are kept transposed, [N, L] (the product K·P_hᵀ, a softmax down each column).
// Workspace: P; non-causal Y_P [B·H, L, D] and per thread one [N, L] pack score matrix, a
// [chunk, L] unpack block and two L-vectors; causal per thread a [chunk, l] weight block, Aᵀ, B and two l-vectors.
// Backward adds dP, the saved probabilities (or a and π) and per thread dY_P [L, D] (causal: the
// ds/dz rows [N, l]); decoding adds Aᵀ and B per (batch, head).
// bf16 (--dtype bf16; storage only, any D): q, k, v, out, the gradients and the decode state Aᵀ, B
// bf16; each (batch, head) widens its rows into the thread's fp32 rows (4·N·D floats; 7·N·D in
// training with its fp32 dQ, dK, dV), runs the fp32 computation above and rounds the output once.
// The prefill rounds the sums once; a step widens its head's Aᵀ and B, updates and answers in fp32
// and stores them rounded — one rounding per state element per token, so after the prefill and s
// steps an entry is within (s + 1)·u of its magnitude sum (Σ a·|k|, Σ a·|v|), as linear attention's
// state (tests/models/memory/test_luna_bf16.cpp). FLOPs as fp32; speed about fp32's.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct LunaConfig {
  std::int64_t projected_length = 16;  // l, rows of the projected sequence P per head (the paper's LRA l ∈ {16, 128,
                                       // 256}: 16); non-causal uses min(l, N) of them
  std::int64_t chunk = 256;            // tokens per block: causal pack-weight products, non-causal query blocks
};

template <>
Implementation implementation<LunaConfig>();

}  // namespace xfb
