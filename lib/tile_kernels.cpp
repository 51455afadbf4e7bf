#include "lib/tile_kernels.hpp"

#include <cstring>

namespace xfb::tiles {
namespace {

using v8 = float __attribute__((vector_size(32), aligned(4), may_alias));

inline v8 load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

template <int R>
void scores_block(const float* q, std::int64_t ldq, const float* panel, std::int64_t d, float alpha, float* s,
                  std::int64_t lds) {
  v8 lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = v8{};
  for (std::int64_t c = 0; c < d; ++c) {
    const v8 b0 = load(panel + c * kPanel), b1 = load(panel + c * kPanel + 8);
    for (int i = 0; i < R; ++i) {
      const v8 a = splat(q[i * ldq + c]);
      lo[i] += a * b0;
      hi[i] += a * b1;
    }
  }
  const v8 scale = splat(alpha);
  for (int i = 0; i < R; ++i) {
    store(s + i * lds, lo[i] * scale);
    store(s + i * lds + 8, hi[i] * scale);
  }
}

template <int R>
void pv_block(const float* p, std::int64_t ldp, std::int64_t cols, const float* v, std::int64_t ldv, float* out,
              std::int64_t ldo) {
  v8 lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = v8{};
  for (std::int64_t j = 0; j < cols; ++j) {
    const v8 b0 = load(v + j * ldv), b1 = load(v + j * ldv + 8);
    for (int i = 0; i < R; ++i) {
      const v8 a = splat(p[i * ldp + j]);
      lo[i] += a * b0;
      hi[i] += a * b1;
    }
  }
  for (int i = 0; i < R; ++i) {
    store(out + i * ldo, load(out + i * ldo) + lo[i]);
    store(out + i * ldo + 8, load(out + i * ldo + 8) + hi[i]);
  }
}

// Calls block<R>(row offset) over `rows` in blocks of kRows, then the remainder.
template <template <int> class Block, typename... Args>
void over_rows(std::int64_t rows, Args... args) {
  std::int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) Block<kRows>::run(r, args...);
  switch (rows - r) {
    case 1: Block<1>::run(r, args...); break;
    case 2: Block<2>::run(r, args...); break;
    case 3: Block<3>::run(r, args...); break;
    case 4: Block<4>::run(r, args...); break;
    case 5: Block<5>::run(r, args...); break;
    default: break;
  }
}

template <int R>
struct ScoresRows {
  static void run(std::int64_t r, const float* q, std::int64_t ldq, const float* packed, std::int64_t panels,
                  std::int64_t d, float alpha, float* s, std::int64_t lds) {
    for (std::int64_t p = 0; p < panels; ++p)
      scores_block<R>(q + r * ldq, ldq, packed + p * d * kPanel, d, alpha, s + r * lds + p * kPanel, lds);
  }
};

template <int R>
struct PvRows {
  static void run(std::int64_t r, const float* p, std::int64_t ldp, std::int64_t cols, const float* v,
                  std::int64_t ldv, std::int64_t d, float* out, std::int64_t ldo) {
    for (std::int64_t c0 = 0; c0 < d; c0 += kPanel)
      pv_block<R>(p + r * ldp, ldp, cols, v + c0, ldv, out + r * ldo + c0, ldo);
  }
};

}  // namespace

void pack_key_panels(const float* keys, std::int64_t ldk, std::int64_t cols, std::int64_t d, float* packed) {
  const std::int64_t panels = panels_for(cols);
  std::memset(packed, 0, static_cast<std::size_t>(panels * d * kPanel) * sizeof(float));
  for (std::int64_t j = 0; j < cols; ++j) {
    float* column = packed + (j / kPanel) * d * kPanel + j % kPanel;
    const float* key = keys + j * ldk;
    for (std::int64_t c = 0; c < d; ++c) column[c * kPanel] = key[c];
  }
}

void scores(const float* q, std::int64_t ldq, std::int64_t rows, const float* packed, std::int64_t panels,
            std::int64_t d, float alpha, float* s, std::int64_t lds) {
  over_rows<ScoresRows>(rows, q, ldq, packed, panels, d, alpha, s, lds);
}

void accumulate_pv(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v,
                   std::int64_t ldv, std::int64_t d, float* out, std::int64_t ldo) {
  over_rows<PvRows>(rows, p, ldp, cols, v, ldv, d, out, ldo);
}

}  // namespace xfb::tiles
