#pragma once
// Segment-level recurrence with Transformer-XL relative-position scores: the engine behind
// `transformer-xl` (Dai et al. 2019) and `compressive` (Rae et al. 2020).
//
// Per (batch, head) the sequence [N, D] is processed in segments of L tokens (the last may be
// shorter). Keys and values of previous positions are cached in a FIFO memory of M slots and,
// for the Compressive Transformer, a compressed memory of n_cm slots. Both caches are right-
// aligned in one window buffer per (batch, head) and tensor (K and V):
//   window rows [0, n_cm) compressed memory | [n_cm, W) memory | [W, W + L) segment,  W = n_cm + M;
// the valid slots are the last cm_len of the first part and the last mem_len of the second.
// Segment s (tokens s0 … s0 + Ls − 1): its K/V rows are copied into the segment part, its queries
// attend to the valid window rows, then the memory is updated (FIFO):
//   new memory = the last min(M, mem_len + Ls) rows of [memory ; segment];
//   the e = mem_len + Ls − new mem_len rows that fall out are evicted, oldest first. With
//   compression (rate c) the evicted rows become ⌈e/c⌉ compressed slots: consecutive groups of c
//   rows, oldest first, the last group holding e mod c rows when c does not divide e; f_c is max
//   pool or mean pool over each group's rows, or a 1-D convolution with kernel = stride = c,
//   out = Σ_t x_t·C_t with C [c·D, D] per head and tensor (a short group uses its first taps only,
//   i.e. zero padding at the end). Compressed slots are appended to the compressed memory, which
//   keeps its newest n_cm slots. Without compression evicted rows are dropped (Transformer-XL).
//
// Scores (query at window row W + i, i the row in the segment; key at window row j):
//   A_ij = [(q_i + u)·k_j + (q_i + v)·r_{δ}] / √D,   δ = W + i − j,   r_δ = W_R,h·R_δ,
// the paper's q_iᵀk_j + q_iᵀW_R R_{i−j} + uᵀk_j + vᵀW_R R_{i−j} grouped for two products. R_δ is
// the sinusoid of width d_r = H·D (the model width in attention scope): R_δ[2k] = sin(δ·ω_k),
// R_δ[2k+1] = cos(δ·ω_k), ω_k = 10000^(−2k/d_r); W_R,h [d_r, D], u_h, v_h [D] come from the seed.
// For memory and segment slots δ is the true token distance. Compressed slots sit, in the
// concatenated index, directly before the oldest memory slot (the newest compressed slot at
// distance i + M + 1, the next at i + M + 2 …), as when Transformer-XL's relative encoding is
// applied to the concatenation [compressed memory ; memory ; segment]; with c = 1 this is the
// true distance again (compressive with c = 1 and pooling equals Transformer-XL with M + n_cm).
// The table r_δ is precomputed in prepare (input-independent), rows in order of decreasing δ.
//
// Masks: causal (decoding): query i sees every valid memory slot and segment rows j ≤ i. Not
// causal: query i sees every valid memory slot and the whole current segment (bidirectional
// within the segment, memory as past context); positions of later segments are never seen.
//
// Work per (batch, head, query tile of `rows` rows, `cols` visible window rows): two score
// products 2·rows·cols·D and 2·rows·(cols + rows − 1)·D (causal: 2·rows·cols·D; the relative
// term needs cols + rows − 1 distances), one value product 2·rows·D·cols, 2·rows·D (q + u, q + v),
// per visible entry 1 (add the relative term) + 4 (max, subtract + exp, sum), and rows·D for the
// softmax's 1/sum applied to the output rows. Per segment and (batch, head),
// for K and V each: compression FLOPs (compress_flops). Total O(N·(n_cm + M + L)·D): linear in N.
// Workspace: windows 2·B·H·(W + L)·D, relative tables, per-thread tiles — independent of N.
//
// bf16 (--dtype bf16; storage only): q, k, v, out, the gradients and the windows — memory,
// compressed memory and the decode state — are bf16; the compressed slots are computed in fp32 and
// rounded once as they enter the compressed memory; every product and the softmax run in fp32 on
// rows widened per query tile (the tile's visible window rows, its query rows; the output rounded
// once), the backward on each segment's rows widened per (batch, head) (dQ, dK, dV accumulated in
// fp32, rounded once per segment) and its replay windows in fp32 holding the same bf16 values. The
// relative tables, u, v, W_R, the conv weights, the saved log-sum-exp and the parameter gradients
// stay fp32. Hence a bf16 point's error is the fp32 form's on its bf16 inputs plus the output's
// (and the gradients') rounding and, with mean or conv compression, the slots'. FLOPs as fp32; per
// thread 2·(W + L)·D + 2·block·D floats more in the forward, 6·L·D more in the backward.
//
// Backward (prepare_backward): the forward saves each query row's log-sum-exp L; the backward replays
// the segments of every (batch, head) on per-thread windows (the caches rebuilt, compression
// included; one task per head index, which sums the batch's parameter gradients), recomputes each
// tile's scores and, with P = exp(A − L), dS = P ⊙ (dO·Vᵀ − δ): dQ = (dS·K + dS_rel·R)/√D (dS_rel:
// dS in the relative product's layout), du = Σ_rows dS·K/√D, dv = Σ_rows dS_rel·R/√D, d(relative
// keys) = dS_relᵀ·(q + v)/√D and dW_R,h = sinusoidᵀ·d(relative keys). dK, dV reach only the current
// segment's rows: the memory and compressed memory are constants (stop-gradient, as both papers
// train), so the main loss gives the compression weights no gradient. With aux_loss (Conv), each
// segment that evicts e rows adds the Compressive Transformer's attention-reconstruction loss
// ‖attn(Q_s, K_e, V_e) − attn(Q_s, f_c(K_e), f_c(V_e))‖² (content attention of the segment's
// queries over the evicted rows and over their compression) whose gradient reaches the conv
// weights alone (stop-gradient into Q, K, V, as the paper).
// Backward FLOPs per tile: 2·2·rows·cols·D (scores, dP) + 2·2·seg_cols·rows·D (dK, dV, seg_cols: the
// segment's columns) + 2·rows·D·cols + 3·2·rows·relative·D (relative product, dQ's part, d relative
// keys) + 7·rows·D + 5 per visible entry; per segment 2·compress_flops (the replay); per head index
// 2·d_r·D·n_rel (dW_R); reconstruction per evicting segment of Ls queries, e rows, g = ⌈e/c⌉ slots:
// 4·compress_flops (compress K and V, the weights' gradient) + 2·2·Ls·e·D + 5·Ls·e + 5·2·Ls·g·D +
// 9·Ls·g + 2·Ls·D.
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

enum class Compression { None, MaxPool, MeanPool, Conv };

struct SegmentAttentionConfig {
  std::string model;                // registry name; prefixes the seed streams
  std::int64_t segment_len = 512;   // L, tokens per segment
  std::int64_t memory_len = 512;    // M, memory slots (cached previous positions)
  std::int64_t compressed_len = 0;  // n_cm, compressed-memory slots (0 with Compression::None)
  std::int64_t rate = 1;            // c, evicted slots per compressed slot
  Compression compression = Compression::None;
  std::int64_t block_q = 64;  // query rows per task, tokens
  bool aux_loss = false;      // Conv only: the attention-reconstruction loss in the backward
};

// Compresses `count` consecutive rows [count, d] into ⌈count/rate⌉ rows of `out` as described
// above; conv_weights [rate·d, d] (Conv only). Products go through ops::gemm (counted there);
// returns the other FLOPs executed: max pool (group rows − 1)·d, mean pool (group rows)·d per slot.
std::int64_t compress_rows(Compression f, const float* rows, std::int64_t count, std::int64_t d, std::int64_t rate,
                           const float* conv_weights, float* out);
// All FLOPs of compress_rows: conv 2·count·d², max (count − slots)·d, mean count·d.
std::int64_t compress_flops(Compression f, std::int64_t count, std::int64_t d, std::int64_t rate);

// Valid slots of the two caches of every (batch, head) between segments.
struct SegmentCache {
  std::int64_t memory = 0, compressed = 0;
};

class SegmentAttention final : public Mechanism {
 public:
  SegmentAttention(const Problem& problem, const SegmentAttentionConfig& config, std::uint64_t seed);

  void prepare(const Tensor& q, const Tensor& k, const Tensor& v) override;
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  // pos_bias_u, pos_bias_v [H, D]; w_r [H, d_r, D]; sinusoid [n_rel, d_r] and relative_keys
  // [H, n_rel, D] (row t: δ = δ_max − t); conv_weights [2, H, c·D, D] (K, V) with Conv.
  std::vector<NamedTensor> parameters() const override;

  void prepare_backward() override;
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
  std::vector<NamedTensor> saved() const override { return {{"lse", &lse_}}; }
  // dpos_bias_u, dpos_bias_v [H, D], dw_r [H, d_r, D].
  std::vector<NamedTensor> parameter_gradients() const override;
  std::string gradient_note() const override;

  // Decode (causal): segments of L_dec = min(L, N + T) tokens, as the causal forward over N + T
  // tokens cuts them. The state per (batch, head) is a key and a value window [W + L_dec, D] laid
  // out as above; after the prefill (the forward, then a replay of the context's memory updates
  // segment by segment, compression included) it holds the memory as of the open segment's start
  // and that segment's rows so far. A step first closes a full segment (the FIFO update and its
  // compression, timed as the stage `memory_update` of that step), then appends its row and
  // attends to the valid window rows up to it with the relative scores: 3·2·cols·D (content,
  // relative and value products) + 3·D + 5·cols FLOPs, cols ≤ n_cm + M + L — constant in N.
  void prepare_decode(std::int64_t tokens) override;
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> decode_state() const override { return {{"windows", &decode_windows_}}; }

  // State after the last forward, for tests: valid slots, oldest first, rows of D elements (T: the
  // problem's element type).
  std::int64_t memory_length() const { return cache_.memory; }
  std::int64_t compressed_length() const { return cache_.compressed; }
  template <class T = float>
  const T* memory_rows(bool values, std::int64_t b, std::int64_t h) const {
    return window<T>(values, b * p_.heads + h) + (context_ - cache_.memory) * p_.head_dim;
  }
  template <class T = float>
  const T* compressed_rows(bool values, std::int64_t b, std::int64_t h) const {
    return window<T>(values, b * p_.heads + h) + (c_.compressed_len - cache_.compressed) * p_.head_dim;
  }

 private:
  // One query tile of a segment: rows r0 … r0 + rows − 1; window rows [lo, lo + cols) are its
  // columns; its relative product has `relative` columns from table row first_table_row.
  struct TileGeometry {
    std::int64_t r0, rows, lo, cols, relative, first_table_row;
  };
  TileGeometry tile_geometry(std::int64_t r0, std::int64_t segment_rows, const SegmentCache& cache) const;
  std::int64_t valid_columns(const TileGeometry& t, std::int64_t r) const;  // columns row r sees
  float* saved_lse(std::int64_t bh, std::int64_t token) {
    return lse_.empty() ? nullptr : lse_.data() + bh * p_.seq_len + token;
  }
  // T: the element type of q, k, v, out and the windows (float, or bf16 in the bf16 form).
  template <class T>
  std::int64_t run_heads(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  template <class T>
  std::int64_t run_lockstep(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  // win: the key and value windows [W + L, D] of one (batch, head); k, v fp32 or bf16.
  template <class T>
  void copy_segment(const Tensor& k, const Tensor& v, T* const* win, std::int64_t bh, std::int64_t s0,
                    std::int64_t rows) const;
  void tile_scores(const float* q, const float* keys, std::int64_t head, const TileGeometry& t, int thread);
  template <class T>
  std::int64_t attend_tile(const T* q, T* out, float* lse, const T* const* win, std::int64_t head, std::int64_t r0,
                           std::int64_t segment_rows, const SegmentCache& cache, int thread);
  std::int64_t attend_tile_rows(const float* q, float* out, float* lse, const float* const* win, std::int64_t head,
                                const TileGeometry& t, int thread);
  template <class T>
  std::int64_t update_memory(T* const* win, std::int64_t head, std::int64_t segment_rows, const SegmentCache& cache,
                             int thread);
  template <class T>
  void push_compressed(T* window, const float* slots, std::int64_t count, std::int64_t valid) const;
  struct Grads {  // the backward's tensors
    const Tensor &q, &k, &v, &out, &dout;
    Tensor &dq, &dk, &dv;
  };
  // One segment's rows of one (batch, head) as fp32, from its first token: the tensors' own rows
  // (fp32) or the thread's widened copies and fp32 gradient accumulators (bf16); lse the saved rows.
  struct SegmentRows {
    const float *q, *out, *dout, *lse;
    float *dq, *dk, *dv;
  };
  SegmentRows segment_view(const Grads& g, std::int64_t bh, std::int64_t s0, std::int64_t rows, int thread);
  void store_segment_gradients(const SegmentRows& s, const Grads& g, std::int64_t bh, std::int64_t s0,
                               std::int64_t rows) const;
  std::int64_t backward_head(const Grads& g, std::int64_t head, int thread);
  std::int64_t tile_backward(const SegmentRows& s, const float* const* win, std::int64_t head, const TileGeometry& t,
                             int thread);
  std::int64_t reconstruction_backward(const SegmentRows& s, const float* const* win, std::int64_t head,
                                       std::int64_t segment_rows, const SegmentCache& cache, int thread);
  template <class T>
  T* window(bool values, std::int64_t bh) {
    return elements<T>(windows_) + ((values ? p_.batch * p_.heads : 0) + bh) * rows_ * p_.head_dim;
  }
  template <class T>
  const T* window(bool values, std::int64_t bh) const {
    return elements<T>(windows_) + ((values ? p_.batch * p_.heads : 0) + bh) * rows_ * p_.head_dim;
  }
  // The bf16 form's per-thread fp32 rows: a tile's widened K and V windows [2, W + L, D], then its
  // query and output rows [2, block, D]; the update's evicted rows reuse the K part.
  float* tile_window(int thread) { return widened_.data() + thread * widened_.dim(1); }
  // The relative table for distances up to rows − 1 (sinusoid_, relative_keys_, delta_max_).
  void build_relative_table(std::int64_t rows);
  // After a prefill: the decode windows replayed from the context's keys and values.
  template <class T>
  void load_decode_context(const Tensor& k, const Tensor& v);
  template <class T>
  void decode_rows(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  template <class T>
  T* decode_window(bool values, std::int64_t bh) {
    return elements<T>(decode_windows_) +
           ((values ? p_.batch * p_.heads : 0) + bh) * decode_windows_.dim(2) * p_.head_dim;
  }

  Problem p_;
  SegmentAttentionConfig c_;
  std::uint64_t seed_;
  std::int64_t segment_ = 0, context_ = 0, rows_ = 0, delta_max_ = 0;  // L clamped to N, W, W + L, top δ
  SegmentCache cache_;                                                 // after the last forward
  Tensor bias_u_, bias_v_, w_r_, sinusoid_, relative_keys_, conv_weights_;
  Tensor windows_, biased_queries_, scores_, relative_scores_, compressed_slots_;
  Tensor widened_;  // bf16 form: per thread fp32 rows (tile_window)
  // Backward only: each query row's log-sum-exp [B·H, N] (saved by the forward), per thread replay
  // windows [2, W + L, D], the parameter gradients (d relative keys [H, n_rel, D] on the way to dW_R),
  // per thread dS tiles in the content and relative layouts and the two parts of dQ.
  Tensor lse_, replay_windows_, bias_u_grads_, bias_v_grads_, relative_key_grads_, w_r_grads_;
  Tensor score_grads_, relative_grads_, query_grads_;
  Tensor widened_segments_;  // bf16 form: per thread q, out, dout, dq, dk, dv of a segment [6, L, D]
  // Conv: the weights' gradient [2, H, c·D, D] (only the reconstruction loss reaches it); with
  // aux_loss, per thread the compressed K, V of the evicted rows and their gradients [4, ⌈L/c⌉, D],
  // score tiles [L, L] (evicted) and [2, L, ⌈L/c⌉] (compressed, and dP/dS), both outputs [2, L, D].
  Tensor conv_grads_, reconstruction_slots_, reconstruction_scores_, reconstruction_outputs_;
  // Decoding only: L_dec, the open segment's rows so far, the caches' valid slots; windows
  // [2, B·H, W + L_dec, D]; per (batch, head) the content and relative score rows and q + u, q + v.
  std::int64_t decode_segment_ = 0, decode_filled_ = 0;
  SegmentCache decode_cache_;
  Tensor decode_windows_, decode_scores_, decode_queries_;
};

std::int64_t segment_attention_flops(const Problem& p, const SegmentAttentionConfig& c);
std::int64_t segment_attention_workspace(const Problem& p, const SegmentAttentionConfig& c);
std::int64_t segment_attention_backward_flops(const Problem& p, const SegmentAttentionConfig& c);
std::int64_t segment_attention_backward_workspace(const Problem& p, const SegmentAttentionConfig& c);
// The bytes prepare_decode(tokens) adds: the windows, score rows and biased queries, and the growth
// of the relative table and the compression buffer when L_dec exceeds the context's L.
std::int64_t segment_attention_decode_workspace(const Problem& p, const SegmentAttentionConfig& c, std::int64_t tokens);

// A model on this engine declares `SegmentAttentionConfig segment_config(const Config&)`; its
// functions (lib/core/config_table.hpp) are the engine's on segment_config(config).
template <class Config>
concept SegmentModel = requires(const Config& c) {
  { segment_config(c) } -> std::same_as<SegmentAttentionConfig>;
};

template <SegmentModel Config>
std::unique_ptr<Mechanism> create(const Problem& p, const Config& c, std::uint64_t seed) {
  return std::make_unique<SegmentAttention>(p, segment_config(c), seed);
}
template <SegmentModel Config>
std::int64_t flops(const Problem& p, const Config& c) {
  return segment_attention_flops(p, segment_config(c));
}
template <SegmentModel Config>
std::int64_t workspace(const Problem& p, const Config& c) {
  return segment_attention_workspace(p, segment_config(c));
}
template <SegmentModel Config>
std::int64_t backward_flops(const Problem& p, const Config& c) {
  return segment_attention_backward_flops(p, segment_config(c));
}
template <SegmentModel Config>
std::int64_t backward_workspace(const Problem& p, const Config& c) {
  return segment_attention_backward_workspace(p, segment_config(c));
}
template <SegmentModel Config>
std::int64_t decode_workspace(const Problem& p, const Config& c, std::int64_t tokens) {
  return segment_attention_decode_workspace(p, segment_config(c), tokens);
}

}  // namespace xfb
