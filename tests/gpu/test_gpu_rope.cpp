// rope_quantize on the GPU, against the CPU implementation (the public op called with CPU tensors
// and with CUDA tensors on the same random inputs) and against a float64 reference written here.
//
// Tolerances, per output element:
//   * nope values (a converted copy, fp8: x / scale): bit-exact with the CPU.
//   * rope values against the CPU: within 1 unit in the last place of the output dtype
//     (bf16 rtol 2^-7; fp16 rtol 2^-10, atol 2^-24; fp8 e4m3 rtol 2^-3, atol 2^-9). The kernel
//     computes x1*c - x2*s with explicitly rounded products and sums (no fma contraction), like
//     the CPU, so the expected count of differing rope values is 0; it is reported.
//   * every value against float64: half an ulp of the output dtype (bf16 rtol 2^-8; fp16 rtol
//     2^-11, atol 2^-25; fp8 rtol 2^-4, atol 2^-10, after saturation to ±448) plus the fp32
//     rounding of the rotation, 2^-22 (|x1 c| + |x2 s|) / scale.
// Every element of every output buffer is checked, padding included: outputs are NaN-poisoned and
// what the op must not write must stay NaN. Covered: NeoX and interleaved, bf16/fp16/fp32 inputs,
// bf16/fp16/fp8 query and key outputs (also different ones), no k, heads 1/12/16/24/96/128,
// T = 0, 1 and odd, int32/int64 positions, fused-buffer (strided, 16-byte aligned) and misaligned
// layouts, a launch large enough for the grid-stride loop, out-of-range positions (their rows
// start finite on the device and must come out NaN), a non-blocking stream and capture into a
// CUDA graph.
#include <algorithm>
#include <numeric>

#include "gpu_util.hpp"
#include "mla/ops.hpp"

namespace {

using mla::DType;
using mla::RopeStyle;
using mla::TensorView;
using mla::test::Launch;
using mla::test::launch_op;
using mla::test::DeviceTensor;
using mla::test::HostTensor;
using mla::test::PlacedTensor;
using mla::test::bitwise_equal;

constexpr int kNope = mla::kKvLoraRank;  // 512
constexpr int kRope = mla::kRopeDim;     // 64
constexpr int kEntry = mla::kLatentDim;  // 576
constexpr int kHalf = kRope / 2;

float log_uniform(std::mt19937_64& rng, double lo, double hi, double scale) {
  std::uniform_real_distribution<double> exponent(lo, hi);
  const double magnitude = std::exp2(exponent(rng)) * scale;
  return float((rng() & 1) ? -magnitude : magnitude);
}

struct Tolerance {
  double atol, rtol;
};
// One ulp (GPU against CPU) and half an ulp (against float64) of each output dtype.
Tolerance one_ulp(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {0, 0x1p-7};
    case DType::kFP16: return {0x1p-24, 0x1p-10};
    default: return {0x1p-9, 0x1p-3};
  }
}
Tolerance half_ulp(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {1e-38, 0x1p-8};
    case DType::kFP16: return {0x1p-25, 0x1p-11};
    default: return {0x1p-10, 0x1p-4};
  }
}

enum class Layout {
  kContiguous,  // every tensor separate and contiguous
  kFused,       // q_nope | q_pe slices of one [T, H, 576] buffer, k of one [T, 576] buffer;
                // q_out with a padded token stride; all rows 16-byte aligned
  kMisaligned,  // odd row paddings everywhere: rows not 16-byte aligned (element-wise path)
};

struct RopeCase {
  DType input_dtype;
  DType q_out_dtype;
  DType k_out_dtype;  // kFP32 = no k
  RopeStyle style;
  int num_heads;
  int num_tokens;
  DType pos_dtype;
  Layout layout;
  int bad_positions;  // tokens with a position outside [0, max_position) (device only)
  uint64_t seed;
};

std::string describe(const RopeCase& c) {
  std::ostringstream os;
  os << "input " << mla::dtype_name(c.input_dtype) << ", q_out " << mla::dtype_name(c.q_out_dtype)
     << ", k_out " << (c.k_out_dtype == DType::kFP32 ? "none" : mla::dtype_name(c.k_out_dtype))
     << (c.style == RopeStyle::kNeox ? ", neox" : ", interleaved") << ", H " << c.num_heads
     << ", T " << c.num_tokens << ", positions " << mla::dtype_name(c.pos_dtype) << ", layout "
     << int(c.layout) << ", bad_positions " << c.bad_positions;
  return os.str();
}

// [T, H, W] (or [T, W] when heads == 0) placed with row paddings: token stride and head stride
// get `pad` extra elements; `offset` elements in.
std::unique_ptr<PlacedTensor> place(DType dtype, int64_t T, int64_t H, int64_t W, int64_t head_pad,
                              int64_t token_pad, int64_t offset, int64_t buffer_row = 0) {
  if (H == 0) {
    const int64_t row = buffer_row ? buffer_row : W + token_pad;
    return std::make_unique<PlacedTensor>(dtype, std::max<int64_t>(1, T * row + offset),
                                    std::vector<int64_t>{T, W}, std::vector<int64_t>{row, 1}, offset);
  }
  const int64_t head_stride = buffer_row ? buffer_row : W + head_pad;
  const int64_t token_stride = H * head_stride + token_pad;
  return std::make_unique<PlacedTensor>(dtype, std::max<int64_t>(1, T * token_stride + offset),
                                  std::vector<int64_t>{T, H, W},
                                  std::vector<int64_t>{token_stride, head_stride, 1}, offset);
}

void run_rope_case(const RopeCase& c, Launch launch = Launch::kDefaultStream) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed);
  const int64_t T = c.num_tokens, H = c.num_heads;
  const bool with_k = c.k_out_dtype != DType::kFP32;
  const float q_scale = c.q_out_dtype == DType::kFP8E4M3 ? 0.0625f : 1.0f;
  const float k_scale = c.k_out_dtype == DType::kFP8E4M3 ? 3.0f : 1.0f;

  // Placement of every tensor.
  std::unique_ptr<PlacedTensor> q_nope, q_pe, k_nope, k_pe, q_out, k_nope_out, k_pe_out;
  const DType in = c.input_dtype;
  switch (c.layout) {
    case Layout::kContiguous:
      q_nope = place(in, T, H, kNope, 0, 0, 0);
      q_pe = place(in, T, H, kRope, 0, 0, 0);
      k_nope = place(in, T, 0, kNope, 0, 0, 0);
      k_pe = place(in, T, 0, kRope, 0, 0, 0);
      q_out = place(c.q_out_dtype, T, H, kEntry, 0, 0, 0);
      k_nope_out = place(c.k_out_dtype, T, 0, kNope, 0, 0, 0);
      k_pe_out = place(c.k_out_dtype, T, 0, kRope, 0, 0, 0);
      break;
    case Layout::kFused:
      // q_nope and q_pe are two placements over the same-shaped [T, H, 576] buffers: the test
      // fills them separately, so sharing storage is not needed to exercise the strides.
      q_nope = place(in, T, H, kNope, 0, 0, 0, kEntry);
      q_pe = place(in, T, H, kRope, 0, 0, kNope, kEntry);
      k_nope = place(in, T, 0, kNope, 0, 0, 0, kEntry);
      k_pe = place(in, T, 0, kRope, 0, 0, kNope, kEntry);
      q_out = place(c.q_out_dtype, T, H, kEntry, 0, 64, 0);
      k_nope_out = place(c.k_out_dtype, T, 0, kNope, 0, 0, 0);
      k_pe_out = place(c.k_out_dtype, T, 0, kRope, 0, 16, 16);
      break;
    case Layout::kMisaligned:
      q_nope = place(in, T, H, kNope, 3, 1, 1);
      q_pe = place(in, T, H, kRope, 1, 5, 3);
      k_nope = place(in, T, 0, kNope, 0, 7, 1);
      k_pe = place(in, T, 0, kRope, 0, 3, 0);
      q_out = place(c.q_out_dtype, T, H, kEntry, 1, 3, 1);
      k_nope_out = place(c.k_out_dtype, T, 0, kNope, 0, 1, 0);
      k_pe_out = place(c.k_out_dtype, T, 0, kRope, 0, 5, 3);
      break;
  }

  // Inputs: magnitudes 2^U(-18, 6); for fp8 outputs, in units of the scale, from below the
  // smallest subnormal to past 448.
  const bool q_fp8 = c.q_out_dtype == DType::kFP8E4M3;
  const bool k_fp8 = c.k_out_dtype == DType::kFP8E4M3;
  auto fill = [&](PlacedTensor& p, bool fp8, float scale) {
    const bool heads = p.shape.size() == 3;
    for (int64_t t = 0; t < p.shape[0]; ++t)
      for (int64_t h = 0; h < (heads ? p.shape[1] : 1); ++h)
        for (int64_t d = 0; d < p.shape.back(); ++d)
          p.cpu.set(heads ? p.at(t, h, d) : p.at(t, d),
                    fp8 ? log_uniform(rng, -12, 9.2, scale) : log_uniform(rng, -18, 6, 1.0));
  };
  fill(*q_nope, q_fp8, q_scale);
  fill(*q_pe, q_fp8, q_scale);
  fill(*k_nope, k_fp8, k_scale);
  fill(*k_pe, k_fp8, k_scale);
  for (PlacedTensor* p : {q_nope.get(), q_pe.get(), k_nope.get(), k_pe.get(), q_out.get(),
                    k_nope_out.get(), k_pe_out.get()})
    p->finish_init();

  // cos/sin cache: a real rotary table (base 10000), rows padded in the misaligned layout.
  const int64_t max_position = 1531;
  const int64_t cs_row = c.layout == Layout::kMisaligned ? kRope + 4 : kRope;
  HostTensor cos_sin(DType::kFP32, {max_position, cs_row});
  for (int64_t pos = 0; pos < max_position; ++pos)
    for (int i = 0; i < kHalf; ++i) {
      const double angle = double(pos) * std::pow(10000.0, -2.0 * i / kRope);
      cos_sin.set(pos * cs_row + i, float(std::cos(angle)));
      cos_sin.set(pos * cs_row + kHalf + i, float(std::sin(angle)));
    }
  DeviceTensor d_cos_sin(cos_sin);

  std::vector<int64_t> positions(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    positions[size_t(t)] = t == 0 ? max_position - 1 : t == 1 ? 0 : int64_t(rng() % max_position);
  std::vector<int64_t> d_positions = positions;
  std::vector<bool> bad_token(size_t(T), false);
  const int64_t bad_values[] = {max_position, -1, c.pos_dtype == DType::kInt32 ? INT32_MAX : INT64_MAX,
                                c.pos_dtype == DType::kInt32 ? INT32_MIN : INT64_MIN};
  for (int i = 0; i < c.bad_positions && i < T; ++i) {
    const size_t t = size_t((int64_t(i) * 7 + 2) % T);
    d_positions[t] = bad_values[size_t(i) % 4];
    bad_token[t] = true;
  }
  // The rows of a bad position start finite on the device (what an earlier step left there): the
  // op must overwrite them with NaN, not leave them.
  for (PlacedTensor* p : {q_out.get(), k_nope_out.get(), k_pe_out.get()}) {
    if (p != q_out.get() && !with_k) continue;  // no k outputs: their buffers must stay poison
    const bool heads = p->shape.size() == 3;
    for (int64_t t = 0; t < T; ++t) {
      if (!bad_token[size_t(t)]) continue;
      for (int64_t h = 0; h < (heads ? p->shape[1] : 1); ++h)
        for (int64_t d = 0; d < p->shape.back(); ++d) p->gpu.set(heads ? p->at(t, h, d) : p->at(t, d), 1.0f);
    }
    p->device->upload();
  }
  HostTensor pos_cpu = mla::test::index_tensor(c.pos_dtype, positions);
  HostTensor pos_gpu = mla::test::index_tensor(c.pos_dtype, d_positions);
  DeviceTensor d_pos(pos_gpu);

  mla::RopeQuantizeArgs args;
  args.q_nope = q_nope->cpu_view();
  args.q_pe = q_pe->cpu_view();
  if (with_k) {
    args.k_nope = k_nope->cpu_view();
    args.k_pe = k_pe->cpu_view();
    args.k_nope_out = k_nope_out->cpu_view();
    args.k_pe_out = k_pe_out->cpu_view();
  }
  args.cos_sin_cache = mla::test::strided_host_view(cos_sin, {max_position, kRope}, {cs_row, 1});
  args.positions = pos_cpu.view();
  args.style = c.style;
  args.q_out = q_out->cpu_view();
  args.q_scale = q_scale;
  args.k_scale = k_scale;
  ASSERT_NO_THROW(mla::rope_quantize(args));

  mla::RopeQuantizeArgs d_args = args;
  d_args.q_nope = q_nope->gpu_view();
  d_args.q_pe = q_pe->gpu_view();
  if (with_k) {
    d_args.k_nope = k_nope->gpu_view();
    d_args.k_pe = k_pe->gpu_view();
    d_args.k_nope_out = k_nope_out->gpu_view();
    d_args.k_pe_out = k_pe_out->gpu_view();
  }
  d_args.cos_sin_cache = d_cos_sin.view({max_position, kRope}, {cs_row, 1});
  d_args.positions = d_pos.view();
  d_args.q_out = q_out->gpu_view();
  ASSERT_NO_FATAL_FAILURE(launch_op(launch, [&](mla::Stream s) { mla::rope_quantize(d_args, s); }));
  for (PlacedTensor* p : {q_out.get(), k_nope_out.get(), k_pe_out.get()}) p->device->download();

  // Checks one output: every element of its buffer. `rope_begin`: first rope column (512 for
  // q_out, 0 for k_pe_out, none for k_nope_out). `input_at(t, h, d)`: the input value of column d
  // (for rope columns, of the rotation's pair too).
  int64_t rope_values = 0, rope_inexact = 0;
  auto check_output = [&](const char* name, PlacedTensor& out, int64_t rope_begin, float scale,
                          const PlacedTensor& nope_in, const PlacedTensor& pe_in, bool present) {
    SCOPED_TRACE(name);
    const DType dtype = out.cpu.dtype;
    const bool fp8 = dtype == DType::kFP8E4M3;
    const bool heads = out.shape.size() == 3;
    const int64_t H_out = heads ? out.shape[1] : 1;
    const int64_t width = out.shape.back();
    // 0: not part of the view (padding), 1: nope value, 2: rope value; -1: a bad position's.
    std::vector<int8_t> role(size_t(out.cpu.numel()), 0);
    if (present)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H_out; ++h)
          for (int64_t d = 0; d < width; ++d) {
            const int64_t i = heads ? out.at(t, h, d) : out.at(t, d);
            role[size_t(i)] = bad_token[size_t(t)] ? -1 : (rope_begin >= 0 && d >= rope_begin) ? 2 : 1;
          }
    // GPU against CPU, whole buffer.
    const Tolerance ulp = one_ulp(dtype);
    int64_t bad = 0;
    std::ostringstream first;
    for (int64_t i = 0; i < out.cpu.numel(); ++i) {
      const size_t elem = mla::dtype_size(dtype);
      const bool same_bits = std::memcmp(&out.gpu.bytes[size_t(i) * elem], &out.cpu.bytes[size_t(i) * elem], elem) == 0;
      bool ok;
      switch (role[size_t(i)]) {
        case 2: {
          ++rope_values;
          if (!same_bits) ++rope_inexact;
          const double g = out.gpu.get(i), r = out.cpu.get(i);
          ok = same_bits || std::fabs(g - r) <= ulp.atol + ulp.rtol * std::fabs(r);
          break;
        }
        case -1: ok = std::isnan(out.gpu.get(i)); break;  // a bad position's: NaN written
        default: ok = same_bits; break;                  // nope values and padding: exact
      }
      if (!ok && bad++ < 8)
        first << "\n  [" << i << "] role " << int(role[size_t(i)]) << " gpu " << out.gpu.get(i)
              << " cpu " << out.cpu.get(i);
    }
    EXPECT_EQ(bad, 0) << "GPU differs from CPU:" << first.str();

    // GPU against float64, every written element.
    bad = 0;
    std::ostringstream first64;
    const Tolerance half = half_ulp(dtype);
    if (present)
      for (int64_t t = 0; t < T; ++t) {
        if (bad_token[size_t(t)]) continue;
        const int64_t pos = positions[size_t(t)];
        for (int64_t h = 0; h < H_out; ++h)
          for (int64_t d = 0; d < width; ++d) {
            double ref, rounding;
            const bool is_rope = rope_begin >= 0 && d >= rope_begin;
            if (!is_rope) {
              const int64_t di = d;
              ref = heads ? nope_in.cpu.get(nope_in.at(t, h, di)) : nope_in.cpu.get(nope_in.at(t, di));
              rounding = 0x1p-24 * std::fabs(ref);
            } else {
              const int64_t e = d - rope_begin;
              int64_t e1, e2, angle;
              if (c.style == RopeStyle::kNeox) {
                angle = e % kHalf;
                e1 = angle;
                e2 = angle + kHalf;
              } else {
                angle = e / 2;
                e1 = 2 * angle;
                e2 = 2 * angle + 1;
              }
              auto x = [&](int64_t col) {
                return double(heads ? pe_in.cpu.get(pe_in.at(t, h, col)) : pe_in.cpu.get(pe_in.at(t, col)));
              };
              const double co = cos_sin.get(pos * cs_row + angle), si = cos_sin.get(pos * cs_row + kHalf + angle);
              const double x1 = x(e1), x2 = x(e2);
              ref = e == e1 ? x1 * co - x2 * si : x2 * co + x1 * si;
              rounding = 0x1p-22 * (std::fabs(x1 * co) + std::fabs(x2 * si));
            }
            if (fp8) {
              ref = std::clamp(ref / scale, -448.0, 448.0);
              rounding /= scale;
            }
            const int64_t i = heads ? out.at(t, h, d) : out.at(t, d);
            const double g = out.gpu.get(i);
            if (!(std::fabs(g - ref) <= half.atol + half.rtol * std::fabs(ref) + (1 + half.rtol) * rounding) && bad++ < 8)
              first64 << "\n  t " << t << " h " << h << " d " << d << ": gpu " << g << " float64 " << ref;
          }
      }
    EXPECT_EQ(bad, 0) << "GPU differs from float64:" << first64.str();
  };
  check_output("q_out", *q_out, kNope, q_scale, *q_nope, *q_pe, true);
  if (with_k) {
    check_output("k_nope_out", *k_nope_out, -1, k_scale, *k_nope, *k_pe, true);
    check_output("k_pe_out", *k_pe_out, 0, k_scale, *k_nope, *k_pe, true);
  }
  if (rope_inexact != 0)
    std::cout << "[ info ] " << rope_inexact << " of " << rope_values
              << " rope values are not bit-identical to the CPU (allowed: 1 ulp) (" << describe(c) << ")\n";
}

// Head counts 1..128 (tensor-parallel shards and odd ones) with T = 0, 1 and odd.
struct Shape {
  int heads, tokens;
};
constexpr Shape kShapes[] = {{1, 0},   {12, 1},  {16, 13}, {24, 0},  {96, 1},  {128, 13},
                             {1, 13},  {12, 0},  {16, 1},  {24, 13}, {96, 0},  {128, 1},
                             {1, 1},   {12, 13}, {16, 0},  {24, 1},  {96, 13}, {128, 0}};

TEST(GpuRopeQuantize, EveryDtypeStyleHeadCountAndLayout) {
  MLA_REQUIRE_GPU();
  struct Outputs {
    DType q, k;
  };
  const Outputs outputs[] = {{DType::kBF16, DType::kBF16},
                             {DType::kFP16, DType::kFP16},
                             {DType::kFP8E4M3, DType::kFP8E4M3},
                             {DType::kFP8E4M3, DType::kBF16},
                             {DType::kBF16, DType::kFP32}};  // no k
  int variant = 0;
  for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kInterleaved})
    for (DType in : {DType::kBF16, DType::kFP16, DType::kFP32})
      for (const Outputs& o : outputs)
        for (int k = 0; k < 3; ++k) {
          const Shape s = kShapes[size_t(variant) % std::size(kShapes)];
          const Layout layout = Layout(variant % 3);
          const DType pos = variant % 2 ? DType::kInt32 : DType::kInt64;
          run_rope_case({in, o.q, o.k, style, s.heads, s.tokens, pos, layout, 0, uint64_t(1000 + variant)});
          ++variant;
          if (HasFailure()) return;
        }
}

TEST(GpuRopeQuantize, LargeLaunchUsesTheGridStrideLoop) {
  MLA_REQUIRE_GPU();
  // 601 tokens * 16 heads * 72 chunks: more threads than one grid wave (16 blocks of 256 per SM).
  run_rope_case({DType::kBF16, DType::kBF16, DType::kBF16, RopeStyle::kNeox, 16, 601,
                 DType::kInt64, Layout::kFused, 0, 7});
  run_rope_case({DType::kFP32, DType::kFP8E4M3, DType::kFP8E4M3, RopeStyle::kInterleaved, 32, 601,
                 DType::kInt32, Layout::kContiguous, 0, 8});
}

TEST(GpuRopeQuantize, OutOfRangePositionsGiveNaNRowsOnTheDevice) {
  MLA_REQUIRE_GPU();
  for (DType pos : {DType::kInt32, DType::kInt64}) {
    run_rope_case({DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, RopeStyle::kNeox, 16, 13, pos,
                   Layout::kFused, 4, 20});
    run_rope_case({DType::kFP16, DType::kFP16, DType::kBF16, RopeStyle::kInterleaved, 3, 1, pos,
                   Layout::kMisaligned, 1, 21});
  }
}

// RopeQuantizeArgs::check_metadata: a position out of range is reported as the CPU path reports
// it (naming positions[t]) and nothing is written; good positions then give the CPU path's bits;
// and the check, which waits for a host copy, is refused inside a CUDA graph capture.
TEST(GpuRopeQuantize, CheckMetadataReportsPositionsOutOfRange) {
  MLA_REQUIRE_GPU();
  const int64_t T = 5, H = 4, max_position = 32;
  std::mt19937_64 rng(41);
  auto random = [&](DType dt, std::vector<int64_t> shape) {
    HostTensor h(dt, std::move(shape));
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (int64_t i = 0; i < h.numel(); ++i) h.set(i, u(rng));
    return h;
  };
  HostTensor q_nope = random(DType::kBF16, {T, H, mla::kKvLoraRank}), q_pe = random(DType::kBF16, {T, H, mla::kRopeDim});
  HostTensor cos_sin = random(DType::kFP32, {max_position, mla::kRopeDim});
  DeviceTensor d_q_nope(q_nope), d_q_pe(q_pe), d_cos_sin(cos_sin);
  for (DType pos_dtype : {DType::kInt32, DType::kInt64}) {
    SCOPED_TRACE(pos_dtype == DType::kInt32 ? "int32 positions" : "int64 positions");
    HostTensor q_out(DType::kBF16, {T, H, mla::kLatentDim});
    q_out.fill_nan();
    const HostTensor poisoned = q_out;
    DeviceTensor d_q_out(q_out);
    std::vector<int64_t> positions = {0, 31, 7, -1, 12};
    HostTensor bad = mla::test::index_tensor(pos_dtype, positions);
    DeviceTensor d_bad(bad);
    mla::RopeQuantizeArgs a;
    a.q_nope = d_q_nope.view();
    a.q_pe = d_q_pe.view();
    a.cos_sin_cache = d_cos_sin.view();
    a.positions = d_bad.view();
    a.q_out = d_q_out.view();
    a.check_metadata = true;
    EXPECT_TRUE(mla::test::throws_error([&] { mla::rope_quantize(a); },
                                        {"rope_quantize: positions[3] = -1", "out of range [0, 32)"}));
    d_q_out.download();
    EXPECT_TRUE(bitwise_equal(q_out, poisoned)) << "q_out was written";

    positions[3] = 30;
    HostTensor good = mla::test::index_tensor(pos_dtype, positions);
    DeviceTensor d_good(good);
    a.positions = d_good.view();
    EXPECT_NO_THROW(mla::rope_quantize(a));
    MLA_TEST_CUDA(cudaDeviceSynchronize());
    d_q_out.download();
    HostTensor expected = poisoned;
    mla::RopeQuantizeArgs c = a;
    c.q_nope = q_nope.view();
    c.q_pe = q_pe.view();
    c.cos_sin_cache = cos_sin.view();
    c.positions = good.view();
    c.q_out = expected.view();
    mla::rope_quantize(c);
    EXPECT_TRUE(bitwise_equal(q_out, expected));

    EXPECT_TRUE(mla::test::check_metadata_refused_during_capture([&](mla::Stream s) { mla::rope_quantize(a, s); }));
  }
}

TEST(GpuRopeQuantize, NonBlockingStreamAndCudaGraph) {
  MLA_REQUIRE_GPU();
  run_rope_case({DType::kBF16, DType::kBF16, DType::kBF16, RopeStyle::kNeox, 128, 5,
                 DType::kInt64, Layout::kFused, 0, 30}, Launch::kNonBlockingStream);
  run_rope_case({DType::kFP32, DType::kFP8E4M3, DType::kFP16, RopeStyle::kInterleaved, 16, 7,
                 DType::kInt32, Layout::kMisaligned, 1, 31}, Launch::kNonBlockingStream);
  run_rope_case({DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, RopeStyle::kNeox, 16, 9,
                 DType::kInt32, Layout::kContiguous, 0, 32}, Launch::kCudaGraph);
  run_rope_case({DType::kFP16, DType::kBF16, DType::kFP32, RopeStyle::kInterleaved, 24, 3,
                 DType::kInt64, Layout::kFused, 2, 33}, Launch::kCudaGraph);
}

}  // namespace
