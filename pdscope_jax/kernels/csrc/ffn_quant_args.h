// How the quantized FFI handlers read a matrix's buffers: the int4 group rule, the scales' type, one matrix's shapes
// checked and its group found, the call's format set. Part of cpu_ffn.cc (one translation unit); see its header
// comment for the contract.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

#include "ffn_types.h"

namespace pdscope_cpu_ffn {

namespace ffi = xla::ffi;

// Whether g rows may share an int4 scale row of a `rows`-row matrix: a power of two, a multiple of kBlock, dividing.
bool int4_group(int64_t g, int64_t rows) { return g > 0 && rows % g == 0 && g % kBlock == 0 && !(g & (g - 1)); }

// The scales' element type as Call::scale_bits: 32 (f32), 16 (bf16), or 0 for another.
int scale_bits_of(const ffi::AnyBuffer& scale) {
  return scale.element_type() == ffi::DataType::F32 ? 32 : scale.element_type() == ffi::DataType::BF16 ? 16 : 0;
}

// One quantized matrix of dense shape [k, n] after `lead` leading axes: its integers' dtype and shape match the format,
// its scales are [k / G, n] (int8: G = k; int4: `int4_group(G, k)`) of the call's type (c.scale_bits; the first
// matrix sets it). Returns G, or 0 when it does not.
int64_t quant_group(Call& c, const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale, int bits, size_t lead, int64_t k,
                    int64_t n) {
  auto qd = q.dimensions(), sd = scale.dimensions();
  const bool int4 = bits == 4;
  if (c.scale_bits == 0) c.scale_bits = scale_bits_of(scale);
  if (c.scale_bits == 0 || scale_bits_of(scale) != c.scale_bits ||
      q.element_type() != (int4 ? ffi::DataType::U8 : ffi::DataType::S8) || qd.size() != lead + 2 ||
      sd.size() != lead + 2 || qd[lead] != (int4 ? k / 2 : k) || qd[lead + 1] != n || sd[lead + 1] != n ||
      sd[lead] <= 0 || k % sd[lead] != 0)
    return 0;
  for (size_t a = 0; a < lead; ++a)
    if (qd[a] != sd[a]) return 0;
  const int64_t g = k / sd[lead];
  if (int4 ? !int4_group(g, k) : sd[lead] != 1) return 0;
  return g;
}

ffi::Error quant_format(Call& c, int32_t bits) {
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("pdscope_cpu_ffn_quant: bits must be 8 or 4");
  c.fmt = bits == 8 ? kInt8 : kInt4;
  c.scale_bits = 0;  // set by the first scales (quant_group)
  return ffi::Error::Success();
}

const char kQuantLayout[] =
    ": int8 q [D, 2F] and [F, D] with scales [1, 2F] and [1, D]; int4 q uint8 [D/2, 2F] and [F/2, D] with "
    "scales [D/G, 2F] and [F/G', D], G and G' powers of two and multiples of 32; every scale f32, or every one bf16";

}  // namespace pdscope_cpu_ffn
