// CPU rope_quantize: rotary embedding of q_pe / k_pe, the 576-wide query q_nope | rope(q_pe), and
// the key outputs, each converted to its output dtype (fp8: divided by its scale, saturating).
#include "cpu/cpu_ops.hpp"
#include "cpu/load_index.hpp"
#include "cpu/parallel.hpp"
#include "mla/error.hpp"

namespace mla::cpu {
namespace {

constexpr int kHalfRope = kRopeDim / 2;  // 32 angles per position

// Converts `width` values starting at element src_offset of src into dst at dst_offset; an fp8
// destination stores value / scale.
void convert_row(const TensorView& src, int64_t src_offset, const TensorView& dst,
                 int64_t dst_offset, int64_t width, float scale) {
  const bool quantise = dst.dtype == DType::kFP8E4M3;
  for (int64_t d = 0; d < width; ++d) {
    float x = load_as_float(src.data, src.dtype, src_offset + d);
    if (quantise) x = x / scale;
    store_from_float(dst.data, dst.dtype, dst_offset + d, x);
  }
}

// Rotates the 64 rope values at src[src_offset..] by the angles of `cos_sin` (32 cos, 32 sin) and
// writes them, in the same layout, to dst[dst_offset..].
void rope_row(const TensorView& src, int64_t src_offset, const float* cos_sin, RopeStyle style,
              const TensorView& dst, int64_t dst_offset, float scale) {
  const bool quantise = dst.dtype == DType::kFP8E4M3;
  float rotated[kRopeDim];
  for (int i = 0; i < kHalfRope; ++i) {
    // NeoX pairs element i with i + 32; interleaved (GPT-J) pairs 2i with 2i + 1.
    const int i1 = style == RopeStyle::kNeox ? i : 2 * i;
    const int i2 = style == RopeStyle::kNeox ? i + kHalfRope : 2 * i + 1;
    const float x1 = load_as_float(src.data, src.dtype, src_offset + i1);
    const float x2 = load_as_float(src.data, src.dtype, src_offset + i2);
    const float c = cos_sin[i], s = cos_sin[kHalfRope + i];
    rotated[i1] = x1 * c - x2 * s;
    rotated[i2] = x2 * c + x1 * s;
  }
  for (int d = 0; d < kRopeDim; ++d)
    store_from_float(dst.data, dst.dtype, dst_offset + d, quantise ? rotated[d] / scale : rotated[d]);
}

}  // namespace

void check_rope_positions(const RopeQuantizeArgs& args) {
  const int64_t num_tokens = args.positions.shape[0];
  const int64_t max_position = args.cos_sin_cache.shape[0];
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t pos = load_index(args.positions, t);
    MLA_CHECK(pos >= 0 && pos < max_position, "rope_quantize: positions[", t, "] = ", pos,
              " is out of range [0, ", max_position, ") (cos_sin_cache has ", max_position,
              " rows)");
  }
}

void rope_quantize(const RopeQuantizeArgs& args) {
  const int64_t num_tokens = args.q_nope.shape[0];
  const int64_t num_heads = args.q_nope.shape[1];
  const bool with_k = !args.k_nope.empty();

  // Validate every position before writing anything.
  check_rope_positions(args);
  auto cos_sin_of = [&](int64_t t) {
    return static_cast<const float*>(args.cos_sin_cache.data) +
           load_index(args.positions, t) * args.cos_sin_cache.stride[0];
  };

  // Rows 0 .. T*H-1 are query heads, rows T*H .. T*H+T-1 (with k) are key tokens.
  const int64_t num_q_rows = num_tokens * num_heads;
  const int64_t num_rows = num_q_rows + (with_k ? num_tokens : 0);
  parallel_for(num_rows, [&](int64_t row) {
    if (row < num_q_rows) {
      const int64_t t = row / num_heads, h = row % num_heads;
      const int64_t out = t * args.q_out.stride[0] + h * args.q_out.stride[1];
      convert_row(args.q_nope, t * args.q_nope.stride[0] + h * args.q_nope.stride[1], args.q_out,
                  out, kKvLoraRank, args.q_scale);
      rope_row(args.q_pe, t * args.q_pe.stride[0] + h * args.q_pe.stride[1], cos_sin_of(t),
               args.style, args.q_out, out + kKvLoraRank, args.q_scale);
    } else {
      const int64_t t = row - num_q_rows;
      convert_row(args.k_nope, t * args.k_nope.stride[0], args.k_nope_out,
                  t * args.k_nope_out.stride[0], kKvLoraRank, args.k_scale);
      rope_row(args.k_pe, t * args.k_pe.stride[0], cos_sin_of(t), args.style, args.k_pe_out,
               t * args.k_pe_out.stride[0], args.k_scale);
    }
  }, /*min_per_thread=*/16);
}

}  // namespace mla::cpu
