// The bf16 tile kernels (lib/core/tile_kernels_bf16.hpp) on every path the host runs — vdpbf16ps
// where it has AVX512_BF16, convert-and-FMA at 512 and 256 bits — against double-precision loops
// over the same bf16 values, at the register blocks' edges; the pair layouts and the rounding.
//
// The bound. Products of two bf16 values are exact in fp32 (8 + 8 significant bits), so the only
// error is the fp32 summation of the n products of an entry: |got − want| ≤ (n + 2)·2⁻²⁴·Σ|terms|
// (the standard γ_n bound with the final scaling), whatever order each path sums in.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lib/core/bf16.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/tile_kernels_bf16.hpp"

using namespace xfb;

namespace {

// A path of the bf16 kernels: an ISA and, on AVX-512, the pair product.
struct Bf16Path {
  KernelIsa isa;
  bool dot;
};

std::vector<Bf16Path> host_paths() {
  std::vector<Bf16Path> paths;
  for (KernelIsa isa : supported_kernel_isas()) {
    paths.push_back({isa, false});
    if (isa == KernelIsa::Avx512 && cpu_has_bf16_dot()) paths.push_back({isa, true});
  }
  return paths;
}

// Runs f on every path with the path forced, restoring the host's choice after.
template <class F>
void on_every_path(F f) {
  const KernelIsa isa = kernel_isa();
  const bool dot = bf16_dot_product();
  for (const Bf16Path& path : host_paths()) {
    force_kernel_isa(path.isa);
    force_bf16_dot(path.dot);
    REQUIRE(bf16_dot_product() == path.dot);
    f(bf16_kernels_name());
  }
  force_kernel_isa(isa);
  force_bf16_dot(dot);
}

// rows × cols bf16 values of seeded normal draws, row stride ld (entries past cols are NaN bits,
// which no kernel may read).
std::vector<bf16> bf16_matrix(std::int64_t rows, std::int64_t cols, std::int64_t ld, const std::string& stream) {
  Tensor draws(Shape{rows, cols});
  CounterRng(17, stream).fill_normal(draws);
  std::vector<bf16> m(static_cast<std::size_t>(rows * ld), static_cast<bf16>(0x7fc1));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      m[static_cast<std::size_t>(r * ld + c)] = to_bf16(draws.data()[r * cols + c]);
  return m;
}

double value(const std::vector<bf16>& m, std::int64_t i) { return to_float(m[static_cast<std::size_t>(i)]); }

// Checks got (fp32) against want with the summation bound for n terms of magnitude sum `size`.
bool within(double got, double want, std::int64_t n, double size) {
  return std::fabs(got - want) <= (static_cast<double>(n) + 2) * std::ldexp(1.0, -24) * size + 1e-30;
}

}  // namespace

TEST_SUITE("tile_kernels_bf16") {
  TEST_CASE("pair layouts: key pair panels and row pairs hold the documented words, zeros where rows run out") {
    for (std::int64_t d : {16, 64})
      for (std::int64_t cols : {1, 15, 16, 17, 33}) {
        const std::int64_t ld = d + 6, panels = tiles::panels_for(cols);
        const auto k = bf16_matrix(cols, d, ld, "pairs/k");
        std::vector<bf16> packed(static_cast<std::size_t>(panels * d * tiles::kPanel), static_cast<bf16>(0x7fc1));
        tiles::pack_key_pair_panels(k.data(), ld, cols, d, packed.data());
        std::int64_t wrong = 0;
        for (std::int64_t p = 0; p < panels; ++p)
          for (std::int64_t c2 = 0; c2 < d / 2; ++c2)
            for (std::int64_t t = 0; t < tiles::kPanel; ++t)
              for (std::int64_t e = 0; e < 2; ++e) {
                const std::int64_t key = p * tiles::kPanel + t;
                const bf16 want = key < cols ? k[static_cast<std::size_t>(key * ld + 2 * c2 + e)] : bf16{};
                wrong +=
                    packed[static_cast<std::size_t>(p * d * tiles::kPanel + (c2 * tiles::kPanel + t) * 2 + e)] == want
                        ? 0
                        : 1;
              }
        CHECK_MESSAGE(wrong == 0, "key pair panels d=" << d << " cols=" << cols);

        std::vector<bf16> pairs(static_cast<std::size_t>((cols + 1) / 2 * 2 * d), static_cast<bf16>(0x7fc1));
        tiles::pack_row_pairs(k.data(), ld, cols, d, pairs.data());
        wrong = 0;
        for (std::int64_t r = 0; r < (cols + 1) / 2 * 2; ++r)
          for (std::int64_t f = 0; f < d; ++f) {
            const bf16 want = r < cols ? k[static_cast<std::size_t>(r * ld + f)] : bf16{};
            wrong += pairs[static_cast<std::size_t>(((r / 2) * d + f) * 2 + r % 2)] == want ? 0 : 1;
          }
        CHECK_MESSAGE(wrong == 0, "row pairs d=" << d << " rows=" << cols);
      }
    const std::vector<float> row0{1.0f, -2.5f, 1.00390625f, 3e38f}, row1{0.5f, 7.0f, -1.01171875f, -1e-3f};
    std::vector<bf16> pair(8);
    tiles::round_row_pair(row0.data(), row1.data(), 4, pair.data());
    for (std::size_t j = 0; j < 4; ++j) {
      CHECK(pair[2 * j] == to_bf16(row0[j]));
      CHECK(pair[2 * j + 1] == to_bf16(row1[j]));
    }
    tiles::round_row_pair(row0.data(), nullptr, 4, pair.data());
    for (std::size_t j = 0; j < 4; ++j) CHECK(pair[2 * j + 1] == bf16{});
    std::vector<bf16> plain(4);
    tiles::round_row(row1.data(), 4, plain.data());
    for (std::size_t j = 0; j < 4; ++j) CHECK(plain[j] == to_bf16(row1[j]));
  }

  TEST_CASE("bf16 scores on every path equal double-precision sums over the bf16 values") {
    // AVX-512 blocks are 12 rows × 2 panels (4 for remainders of ≤ 4 rows), AVX2 6 rows × 1 panel:
    // rows and panels one below, at and above both.
    on_every_path([](const std::string& path) {
      for (std::int64_t d : {16, 32, 64})
        for (std::int64_t rows : {1, 4, 5, 6, 7, 11, 12, 13, 25})
          for (std::int64_t cols : {1, 16, 17, 31, 32, 33, 64, 65, 100}) {
            const std::int64_t ldq = d + 4, panels = tiles::panels_for(cols), lds = panels * tiles::kPanel + 16;
            const auto q = bf16_matrix(rows, d, ldq, "scores/q"), k = bf16_matrix(cols, d, d, "scores/k");
            std::vector<bf16> packed(static_cast<std::size_t>(panels * d * tiles::kPanel));
            tiles::pack_key_pair_panels(k.data(), d, cols, d, packed.data());
            std::vector<float> s(static_cast<std::size_t>(rows * lds), std::numeric_limits<float>::quiet_NaN());
            const float alpha = 0.125f;
            tiles::scores_bf16(q.data(), ldq, rows, packed.data(), panels, d, alpha, s.data(), lds);
            std::int64_t wrong = 0;
            for (std::int64_t r = 0; r < rows; ++r)
              for (std::int64_t j = 0; j < panels * tiles::kPanel; ++j) {
                double want = 0, size = 0;
                for (std::int64_t c = 0; j < cols && c < d; ++c) {
                  const double term = value(q, r * ldq + c) * value(k, j * d + c);
                  want += term;
                  size += std::fabs(term);
                }
                wrong += within(s[static_cast<std::size_t>(r * lds + j)], alpha * want, d, alpha * size) ? 0 : 1;
              }
            CHECK_MESSAGE(wrong == 0, path << " d=" << d << " rows=" << rows << " cols=" << cols);
          }
    });
  }

  TEST_CASE("bf16 P·V and Pᵀ·X on every path equal double-precision sums, odd inner sizes padded by 0") {
    on_every_path([](const std::string& path) {
      for (std::int64_t d : {16, 48, 64})
        for (std::int64_t rows : {1, 2, 5, 6, 7, 12, 13, 26})
          for (std::int64_t cols : {1, 2, 15, 16, 17, 50}) {
            // P·V: P [rows, cols] plain rows (stride even ≥ cols + 1, a 0 after an odd row end).
            const std::int64_t ldp = (cols + 1) / 2 * 2 + 2, ldo = d + 16;
            auto p = bf16_matrix(rows, cols, ldp, "pv/p");
            if (cols % 2 == 1)
              for (std::int64_t r = 0; r < rows; ++r) p[static_cast<std::size_t>(r * ldp + cols)] = bf16{};
            const auto v = bf16_matrix(cols, d, d, "pv/v");
            std::vector<bf16> v_pairs(static_cast<std::size_t>((cols + 1) / 2 * 2 * d));
            tiles::pack_row_pairs(v.data(), d, cols, d, v_pairs.data());
            std::vector<float> out(static_cast<std::size_t>(rows * ldo), 0.25f);
            tiles::accumulate_pv_bf16(p.data(), ldp, rows, cols, v_pairs.data(), d, out.data(), ldo, 0.5f);
            std::int64_t wrong = 0;
            for (std::int64_t r = 0; r < rows; ++r)
              for (std::int64_t f = 0; f < d; ++f) {
                double want = 0, size = 0;
                for (std::int64_t j = 0; j < cols; ++j) {
                  const double term = value(p, r * ldp + j) * value(v, j * d + f);
                  want += term;
                  size += std::fabs(term);
                }
                wrong +=
                    within(out[static_cast<std::size_t>(r * ldo + f)], 0.25 + 0.5 * want, cols, 0.25 + size) ? 0 : 1;
              }
            CHECK_MESSAGE(wrong == 0, path << " P·V d=" << d << " rows=" << rows << " cols=" << cols);

            // Pᵀ·X: P [rows, cols] in row pairs (ld ldp), X [rows, d] in row pairs; O [cols, d].
            const auto pt = bf16_matrix(rows, cols, cols, "pt/p"), x = bf16_matrix(rows, d, d, "pt/x");
            std::vector<bf16> p_pairs(static_cast<std::size_t>((rows + 1) / 2 * 2 * ldp)),
                x_pairs(static_cast<std::size_t>((rows + 1) / 2 * 2 * d));
            tiles::pack_row_pairs(pt.data(), cols, rows, cols, p_pairs.data());  // ld = cols here
            tiles::pack_row_pairs(x.data(), d, rows, d, x_pairs.data());
            std::vector<float> grad(static_cast<std::size_t>(cols * ldo), 0.0f);
            tiles::accumulate_transposed_bf16(p_pairs.data(), cols, rows, cols, x_pairs.data(), d, 2.0f, grad.data(),
                                              ldo);
            wrong = 0;
            for (std::int64_t c = 0; c < cols; ++c)
              for (std::int64_t f = 0; f < d; ++f) {
                double want = 0, size = 0;
                for (std::int64_t r = 0; r < rows; ++r) {
                  const double term = value(pt, r * cols + c) * value(x, r * d + f);
                  want += term;
                  size += std::fabs(term);
                }
                wrong += within(grad[static_cast<std::size_t>(c * ldo + f)], 2 * want, rows, 2 * size) ? 0 : 1;
              }
            CHECK_MESSAGE(wrong == 0, path << " Pᵀ·X d=" << d << " rows=" << rows << " cols=" << cols);
          }
    });
  }

  TEST_CASE("XFBENCH_BF16_DOT's choice is reported by name and forcing vdpbf16ps off takes the convert path") {
    const bool dot = bf16_dot_product();
    force_bf16_dot(false);
    CHECK(bf16_kernels_name() == (kernel_isa() == KernelIsa::Avx512 ? "avx512-convert" : "avx2-convert"));
    if (cpu_has_bf16_dot() && kernel_isa() == KernelIsa::Avx512) {
      force_bf16_dot(true);
      CHECK(bf16_kernels_name() == "vdpbf16ps");
    } else if (cpu_has_bf16_dot()) {  // 256-bit kernels: forcing the dot product on does not take it
      force_bf16_dot(true);
      CHECK(!bf16_dot_product());
    } else {
      CHECK_THROWS(force_bf16_dot(true));
    }
    force_bf16_dot(dot);
  }
}
