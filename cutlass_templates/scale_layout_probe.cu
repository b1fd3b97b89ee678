// Host-side probe of the scale-factor layout that CUTLASS's SM100 block-scaled GEMMs read.
//
// Usage: scale_layout_probe M N K
// Prints, for the NVFP4 configuration (one E4M3 scale per 16 elements along K):
//   SFA <row> <k_block> <offset>    for every row of A [M, K] and every 16-element block along K
//   SFB <row> <k_block> <offset>    the same for B [N, K]
//   SIZE SFA <bytes> / SIZE SFB <bytes>   the extent of each layout, padding included
// Offsets come from Sm1xxBlockScaledConfig<16>::tile_atom_to_shape_SFA/SFB, the layouts the GEMM
// kernel is launched with, so fp4compile.formats.swizzled_offset can be checked against them on a
// machine without a Blackwell GPU. Host code only.

#include <cstdio>
#include <cstdlib>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"

namespace {

constexpr int kVecSize = 16;
using ScaleConfig = cutlass::detail::Sm1xxBlockScaledConfig<kVecSize>;

template <class Layout>
void print_layout(char const* operand, Layout const& layout, int rows, int k) {
  for (int r = 0; r < rows; ++r) {
    for (int kb = 0; kb < k / kVecSize; ++kb) {
      std::printf("%s %d %d %lld\n", operand, r, kb, static_cast<long long>(layout(r, kb * kVecSize, 0)));
    }
  }
  std::printf("SIZE %s %lld\n", operand, static_cast<long long>(cute::cosize(cute::filter_zeros(layout))));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s M N K\n", argv[0]);
    return 2;
  }
  int const m = std::atoi(argv[1]);
  int const n = std::atoi(argv[2]);
  int const k = std::atoi(argv[3]);
  if (m <= 0 || n <= 0 || k <= 0 || k % kVecSize != 0) {
    std::fprintf(stderr, "M, N, K must be positive and K a multiple of %d\n", kVecSize);
    return 2;
  }
  auto problem = cute::make_shape(m, n, k, 1);
  print_layout("SFA", ScaleConfig::tile_atom_to_shape_SFA(problem), m, k);
  print_layout("SFB", ScaleConfig::tile_atom_to_shape_SFB(problem), n, k);
  return 0;
}
