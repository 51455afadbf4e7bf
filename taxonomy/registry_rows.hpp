#pragma once
// The registry's rows: every model of the survey's Table 1 (v1, then the models its 2022 revision adds), LRA's local
// attention and the two exact baselines, in the order `list` shows them. A row is the model's config type — the key to
// its implementation, implementation<Config>() (lib/core/config_table.hpp), or void for a card
// without one — and its card: name, display name, classes, complexity as the survey prints it,
// the per-token decoding cost ("" = does not decode: Table 1's Decode column), paper, arXiv id,
// year and survey row (0 or omitted: not in Table 1). taxonomy/cards.cpp reads the cards alone
// (it links no mechanism); taxonomy/registry.cpp joins them with the implementations.
// To add a mechanism: its file pair, its header included here and one row (docs/contributing.md).
#include "taxonomy/baselines/exact_tiled.hpp"
#include "taxonomy/baselines/vanilla.hpp"
#include "taxonomy/cards.hpp"
#include "taxonomy/downsampling/tokenlearner.hpp"
#include "taxonomy/fixed_patterns/axial.hpp"
#include "taxonomy/fixed_patterns/bigbird.hpp"
#include "taxonomy/fixed_patterns/etc.hpp"
#include "taxonomy/fixed_patterns/funnel.hpp"
#include "taxonomy/fixed_patterns/image_transformer.hpp"
#include "taxonomy/fixed_patterns/local.hpp"
#include "taxonomy/fixed_patterns/longformer.hpp"
#include "taxonomy/fixed_patterns/memory_compressed.hpp"
#include "taxonomy/fixed_patterns/poolingformer.hpp"
#include "taxonomy/fixed_patterns/sparse_transformer.hpp"
#include "taxonomy/kernels/linear_transformer.hpp"
#include "taxonomy/kernels/performer.hpp"
#include "taxonomy/kernels/rfa.hpp"
#include "taxonomy/learnable_patterns/cluster_former.hpp"
#include "taxonomy/learnable_patterns/reformer.hpp"
#include "taxonomy/learnable_patterns/routing.hpp"
#include "taxonomy/learnable_patterns/sinkhorn.hpp"
#include "taxonomy/low_rank/linformer.hpp"
#include "taxonomy/low_rank/long_short.hpp"
#include "taxonomy/low_rank/synthesizer.hpp"
#include "taxonomy/memory/luna.hpp"
#include "taxonomy/memory/nystromformer.hpp"
#include "taxonomy/memory/perceiver.hpp"
#include "taxonomy/memory/set_transformer.hpp"
#include "taxonomy/recurrence/compressive.hpp"
#include "taxonomy/recurrence/transformer_xl.hpp"
#include "taxonomy/sparse_models/adaptive_sparse.hpp"

namespace xfb {

// A row's config type as a value.
template <class Config>
struct Model {};
template <class Config>
inline constexpr Model<Config> model{};

// Calls row(model<Config>, card) for every row, in registry order; row takes (Model<Config>,
// const ModelCard&).
template <class Row>
void for_each_row(Row&& row) {
  using C = ModelClass;
  row(model<VanillaConfig>, {.name = "vanilla",
                             .display_name = "Transformer (materialised softmax attention)",
                             .classes = {C::Exact},
                             .complexity = "O(N²)",
                             .decode_cost = "O(N)",
                             .paper = "Vaswani et al. 2017",
                             .arxiv = "1706.03762",
                             .year = 2017});
  row(model<ExactTiledConfig>, {.name = "exact-tiled",
                                .display_name = "Exact tiled attention (online softmax)",
                                .classes = {C::Exact},
                                .complexity = "O(N²)",
                                .decode_cost = "O(N)",
                                .paper = "Dao et al. 2022",
                                .arxiv = "2205.14135",
                                .year = 2022});
  row(model<MemoryCompressedConfig>, {.name = "memory-compressed",
                                      .display_name = "Memory Compressed Transformer",
                                      .classes = {C::FixedPatterns, C::Memory},
                                      .complexity = "O(N_c²)",
                                      .decode_cost = "O(N_c)",
                                      .paper = "Liu et al. 2018",
                                      .arxiv = "1801.10198",
                                      .year = 2018,
                                      .survey_row = 1});
  row(model<ImageTransformerConfig>, {.name = "image-transformer",
                                      .display_name = "Image Transformer",
                                      .classes = {C::FixedPatterns},
                                      .complexity = "O(N·m)",
                                      .decode_cost = "O(l_q+l_m)",
                                      .paper = "Parmar et al. 2018",
                                      .arxiv = "1802.05751",
                                      .year = 2018,
                                      .survey_row = 2});
  row(model<SetTransformerConfig>, {.name = "set-transformer",
                                    .display_name = "Set Transformer",
                                    .classes = {C::Memory},
                                    .complexity = "O(kN)",
                                    .decode_cost = "",
                                    .paper = "Lee et al. 2019",
                                    .arxiv = "1810.00825",
                                    .year = 2019,
                                    .survey_row = 3});
  row(model<TransformerXlConfig>, {.name = "transformer-xl",
                                   .display_name = "Transformer-XL",
                                   .classes = {C::Recurrence},
                                   .complexity = "O(N²)",
                                   .decode_cost = "O(L+M)",
                                   .paper = "Dai et al. 2019",
                                   .arxiv = "1901.02860",
                                   .year = 2019,
                                   .survey_row = 4});
  row(model<SparseTransformerConfig>, {.name = "sparse-transformer",
                                       .display_name = "Sparse Transformer",
                                       .classes = {C::FixedPatterns},
                                       .complexity = "O(N√N)",
                                       .decode_cost = "O(√N)",
                                       .paper = "Child et al. 2019",
                                       .arxiv = "1904.10509",
                                       .year = 2019,
                                       .survey_row = 5});
  row(model<ReformerConfig>, {.name = "reformer",
                              .display_name = "Reformer",
                              .classes = {C::LearnablePatterns},
                              .complexity = "O(N log N)",
                              .decode_cost = "O(n_r·m)",
                              .paper = "Kitaev et al. 2020",
                              .arxiv = "2001.04451",
                              .year = 2020,
                              .survey_row = 6});
  row(model<RoutingConfig>, {.name = "routing",
                             .display_name = "Routing Transformer",
                             .classes = {C::LearnablePatterns},
                             .complexity = "O(N log N)",
                             .revised_complexity = "O(N√N)",
                             .decode_cost = "O(N/k)",
                             .paper = "Roy et al. 2020",
                             .arxiv = "2003.05997",
                             .year = 2020,
                             .survey_row = 7});
  row(model<AxialConfig>, {.name = "axial",
                           .display_name = "Axial Transformer",
                           .classes = {C::FixedPatterns},
                           .complexity = "O(N√N)",
                           .decode_cost = "O(√N)",
                           .paper = "Ho et al. 2019",
                           .arxiv = "1912.12180",
                           .year = 2019,
                           .survey_row = 8});
  row(model<CompressiveConfig>, {.name = "compressive",
                                 .display_name = "Compressive Transformer",
                                 .classes = {C::Recurrence},
                                 .complexity = "O(N²)",
                                 .decode_cost = "O(L+M+M_c)",
                                 .paper = "Rae et al. 2020",
                                 .arxiv = "1911.05507",
                                 .year = 2020,
                                 .survey_row = 9});
  row(model<SinkhornConfig>, {.name = "sinkhorn",
                              .display_name = "Sinkhorn Transformer",
                              .classes = {C::LearnablePatterns},
                              .complexity = "O(B²)",
                              .decode_cost = "O(b+N/b)",
                              .paper = "Tay et al. 2020b",
                              .arxiv = "2002.11296",
                              .year = 2020,
                              .survey_row = 10});
  row(model<LongformerConfig>, {.name = "longformer",
                                .display_name = "Longformer",
                                .classes = {C::FixedPatterns, C::Memory},
                                .complexity = "O(n(k+m))",
                                .decode_cost = "O(w+g)",
                                .paper = "Beltagy et al. 2020",
                                .arxiv = "2004.05150",
                                .year = 2020,
                                .survey_row = 11});
  row(model<EtcConfig>, {.name = "etc",
                         .display_name = "ETC",
                         .classes = {C::FixedPatterns, C::Memory},
                         .complexity = "O(N_g² + N·N_g)",
                         .decode_cost = "",
                         .paper = "Ainslie et al. 2020",
                         .arxiv = "2004.08483",
                         .year = 2020,
                         .survey_row = 12});
  row(model<SynthesizerConfig>, {.name = "synthesizer",
                                 .display_name = "Synthesizer",
                                 .classes = {C::LowRank, C::LearnablePatterns},
                                 .complexity = "O(N²)",
                                 .decode_cost = "O(N)",
                                 .paper = "Tay et al. 2020a",
                                 .arxiv = "2005.00743",
                                 .year = 2020,
                                 .survey_row = 13});
  row(model<PerformerConfig>, {.name = "performer",
                               .display_name = "Performer",
                               .classes = {C::Kernels},
                               .complexity = "O(N)",
                               .decode_cost = "O(1)",
                               .paper = "Choromanski et al. 2020",
                               .arxiv = "2009.14794",
                               .year = 2020,
                               .survey_row = 14});
  row(model<LinformerConfig>, {.name = "linformer",
                               .display_name = "Linformer",
                               .classes = {C::LowRank},
                               .complexity = "O(N)",
                               .decode_cost = "",
                               .paper = "Wang et al. 2020",
                               .arxiv = "2006.04768",
                               .year = 2020,
                               .survey_row = 15});
  row(model<LinearTransformerConfig>, {.name = "linear-transformer",
                                       .display_name = "Linear Transformer",
                                       .classes = {C::Kernels},
                                       .complexity = "O(N)",
                                       .decode_cost = "O(1)",
                                       .paper = "Katharopoulos et al. 2020",
                                       .arxiv = "2006.16236",
                                       .year = 2020,
                                       .survey_row = 16});
  row(model<BigBirdConfig>, {.name = "bigbird",
                             .display_name = "Big Bird",
                             .classes = {C::FixedPatterns, C::Memory},
                             .complexity = "O(N)",
                             .decode_cost = "",
                             .paper = "Zaheer et al. 2020",
                             .arxiv = "2007.14062",
                             .year = 2020,
                             .survey_row = 17});
  row(model<LocalConfig>, {.name = "local",
                           .display_name = "Local Attention (LRA)",
                           .classes = {C::FixedPatterns},
                           .complexity = "O(N·b)",
                           .decode_cost = "O(b)",
                           .paper = "Tay et al. 2021 (LRA)",
                           .arxiv = "2011.04006",
                           .year = 2021});
  row(model<FunnelConfig>, {.name = "funnel",
                            .display_name = "Funnel Transformer",
                            .classes = {C::FixedPatterns, C::Downsampling},
                            .complexity = "O(N²)",
                            .decode_cost = "",
                            .decode_note = "the survey marks it as decoding; its paper gives no causal form of "
                                           "pooled-query attention",
                            .paper = "Dai et al. 2020",
                            .arxiv = "2006.03236",
                            .year = 2020,
                            .revision = true});
  row(model<NystromformerConfig>, {.name = "nystromformer",
                                   .display_name = "Nyströmformer",
                                   .classes = {C::Memory, C::Downsampling},
                                   .complexity = "O(kN)",
                                   .decode_cost = "",
                                   .paper = "Xiong et al. 2021",
                                   .arxiv = "2102.03902",
                                   .year = 2021,
                                   .revision = true});
  row(model<PerceiverConfig>, {.name = "perceiver",
                               .display_name = "Perceiver (causal: Perceiver AR)",
                               .classes = {C::Memory, C::Downsampling},
                               .complexity = "O(kN)",
                               .decode_cost = "O(N)",
                               .paper = "Jaegle et al. 2021",
                               .arxiv = "2103.03206",
                               .year = 2021,
                               .revision = true});
  row(model<LunaConfig>, {.name = "luna",
                          .display_name = "Luna",
                          .classes = {C::Memory},
                          .complexity = "O(kN)",
                          .decode_cost = "O(l)",
                          .paper = "Ma et al. 2021",
                          .arxiv = "2106.01540",
                          .year = 2021,
                          .revision = true});
  row(model<TokenLearnerConfig>, {.name = "tokenlearner",
                                  .display_name = "TokenLearner",
                                  .classes = {C::Downsampling},
                                  .complexity = "O(k²)",
                                  .decode_cost = "",
                                  .paper = "Ryoo et al. 2021",
                                  .arxiv = "2106.11297",
                                  .year = 2021,
                                  .revision = true});
  row(model<RfaConfig>, {.name = "rfa",
                         .display_name = "Random Feature Attention",
                         .classes = {C::Kernels},
                         .complexity = "O(N)",
                         .decode_cost = "O(1)",
                         .paper = "Peng et al. 2021",
                         .arxiv = "2103.02143",
                         .year = 2021,
                         .revision = true});
  row(model<LongShortConfig>, {.name = "long-short",
                               .display_name = "Long-Short Transformer",
                               .classes = {C::FixedPatterns, C::LowRank},
                               .complexity = "O(kN)",
                               .decode_cost = "O(rN/l + w)",
                               .paper = "Zhu et al. 2021",
                               .arxiv = "2107.02192",
                               .year = 2021,
                               .revision = true});
  row(model<PoolingformerConfig>, {.name = "poolingformer",
                                   .display_name = "Poolingformer",
                                   .classes = {C::FixedPatterns, C::Memory},
                                   .complexity = "O(N)",
                                   .decode_cost = "",
                                   .paper = "Zhang et al. 2021",
                                   .arxiv = "2105.04371",
                                   .year = 2021,
                                   .revision = true});
  row(model<ClusterFormerConfig>, {.name = "cluster-former",
                                   .display_name = "Cluster-Former",
                                   .classes = {C::LearnablePatterns},
                                   .complexity = "O(N log N)",
                                   .decode_cost = "",
                                   .paper = "Wang et al. 2021",
                                   .arxiv = "2009.06097",
                                   .year = 2021,
                                   .revision = true});
  row(model<AdaptiveSparseConfig>, {.name = "adaptive-sparse",
                                    .display_name = "Adaptively Sparse Transformer",
                                    .classes = {C::Sparse},
                                    .complexity = "O(N²)",
                                    .decode_cost = "O(N)",
                                    .paper = "Correia et al. 2019",
                                    .arxiv = "1909.00015",
                                    .year = 2019,
                                    .revision = true});
  // The sparse class's mixtures of experts replace the layer's FFN, not attention: each card is the encoder
  // layer with vanilla attention (its config type) and its FFN (`.ffn`, taxonomy/layer/moe_ffn.hpp); layer
  // scope only. Any attention model takes the same FFN with --ffn switch|gshard.
  row(model<VanillaConfig>, {.name = "switch",
                             .display_name = "Switch Transformer (top-1 mixture of experts)",
                             .classes = {C::Sparse},
                             .complexity = "O(N²)",
                             .decode_cost = "O(N)",
                             .paper = "Fedus et al. 2021",
                             .arxiv = "2101.03961",
                             .year = 2021,
                             .revision = true,
                             .ffn = "switch"});
  row(model<VanillaConfig>, {.name = "gshard",
                             .display_name = "GShard (top-2 mixture of experts)",
                             .classes = {C::Sparse},
                             .complexity = "O(N²)",
                             .decode_cost = "O(N)",
                             .paper = "Lepikhin et al. 2020",
                             .arxiv = "2006.16668",
                             .year = 2020,
                             .revision = true,
                             .ffn = "gshard"});
}

}  // namespace xfb
