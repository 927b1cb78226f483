// merge_states on the GPU, against the CPU implementation (the public op called with CPU tensors
// and with CUDA tensors on the same random inputs) and against a float64 reference written here.
//
// Tolerances, per element (the kernel forms the weights in double like the CPU and rounds each
// product and sum separately, so in practice the results are bit-identical; the count of
// differing values is reported):
//   * out against the CPU: 1 ulp of the out dtype (bf16 rtol 2^-7; fp16 rtol 2^-10, atol 2^-24;
//     fp32 rtol 2^-22) plus 2^-22 (|w_a a| + |w_b b|) for a weight differing in its last bit;
//     lse against the CPU: 2^-22 |lse| + 1e-6.
//   * out against float64: half an ulp of the out dtype (bf16 2^-8; fp16 2^-11, atol 2^-25;
//     fp32 2^-23) plus 2^-21 (|w_a a| + |w_b b|); lse: 2^-22 |lse| + 1e-6.
//   * -inf sides: exact. A row with one side at -inf equals the other side; both at -inf gives
//     out 0 and lse -inf. The values of a -inf side are NaN here and must never leak.
// Every element of every output buffer is checked, padding included (it must stay NaN).
// Covered: bf16/fp16/fp32 and mixed dtypes, Dv 512/128/64 and odd (7, 36: element-wise tails),
// heads 1/12/16/128, T = 0, 1 and odd, contiguous / strided aligned / misaligned rows, lse with
// any strides, lse_out absent, in-place (out aliasing out_a or out_b, lse_out aliasing lse_a or
// lse_b), a launch large enough for the grid-stride loop, a non-blocking stream, a CUDA graph.
#include <algorithm>
#include <cstring>
#include <limits>

#include "gpu_util.hpp"
#include "mla/ops.hpp"

namespace {

using mla::DType;
using mla::TensorView;
using mla::test::Launch;
using mla::test::launch_op;
using mla::test::DeviceTensor;
using mla::test::HostTensor;
using mla::test::PlacedTensor;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Tolerance {
  double atol, rtol;
};
Tolerance one_ulp(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {0, 0x1p-7};
    case DType::kFP16: return {0x1p-24, 0x1p-10};
    default: return {1e-38, 0x1p-22};
  }
}
Tolerance half_ulp(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {1e-38, 0x1p-8};
    case DType::kFP16: return {0x1p-25, 0x1p-11};
    default: return {1e-38, 0x1p-23};
  }
}

enum class Layout { kContiguous, kStridedAligned, kMisaligned };
enum class Alias { kNone, kOutIsA, kOutIsB };

struct MergeCase {
  DType a_dtype, b_dtype, out_dtype;
  int num_heads, num_tokens, head_dim;
  Layout layout;
  Alias alias;
  bool with_lse_out;
  uint64_t seed;
};

std::string describe(const MergeCase& c) {
  std::ostringstream os;
  os << "a " << mla::dtype_name(c.a_dtype) << ", b " << mla::dtype_name(c.b_dtype) << ", out "
     << mla::dtype_name(c.out_dtype) << ", H " << c.num_heads << ", T " << c.num_tokens << ", Dv "
     << c.head_dim << ", layout " << int(c.layout) << ", alias " << int(c.alias)
     << (c.with_lse_out ? ", lse_out" : ", no lse_out");
  return os.str();
}

// [T, H, Dv] (or [T, H] for an LSE when dv == 0) in a padded buffer, per layout.
std::unique_ptr<PlacedTensor> place(DType dtype, int64_t T, int64_t H, int64_t dv, Layout layout,
                                    int salt) {
  if (dv == 0) {  // LSE: any strides (no inner-contiguity requirement)
    const int64_t head_stride = layout == Layout::kContiguous ? 1 : 2 + salt % 2;
    const int64_t token_stride = H * head_stride + (layout == Layout::kContiguous ? 0 : 3);
    return std::make_unique<PlacedTensor>(dtype, std::max<int64_t>(1, T * token_stride + 1),
                                          std::vector<int64_t>{T, H},
                                          std::vector<int64_t>{token_stride, head_stride},
                                          layout == Layout::kContiguous ? 0 : 1);
  }
  int64_t head_pad = 0, token_pad = 0, offset = 0;
  if (layout == Layout::kStridedAligned) {
    head_pad = 8 * (1 + salt % 2);  // 16 or 32 bytes for bf16/fp16
    token_pad = 16;
    offset = 8;
  } else if (layout == Layout::kMisaligned) {
    head_pad = 1 + salt % 2;
    token_pad = 3;
    offset = 1;
  }
  const int64_t head_stride = dv + head_pad;
  const int64_t token_stride = H * head_stride + token_pad;
  return std::make_unique<PlacedTensor>(dtype, std::max<int64_t>(1, T * token_stride + offset),
                                        std::vector<int64_t>{T, H, dv},
                                        std::vector<int64_t>{token_stride, head_stride, 1}, offset);
}

void run_merge_case(const MergeCase& c, Launch launch = Launch::kDefaultStream) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed);
  const int64_t T = c.num_tokens, H = c.num_heads, D = c.head_dim;
  const bool alias = c.alias != Alias::kNone;
  // In-place: out takes the place (and dtype) of the side it overwrites.
  const DType out_dtype = c.alias == Alias::kOutIsA ? c.a_dtype : c.alias == Alias::kOutIsB ? c.b_dtype : c.out_dtype;

  auto out_a = place(c.a_dtype, T, H, D, c.layout, 0);
  auto out_b = place(c.b_dtype, T, H, D, c.layout, 1);
  auto lse_a = place(DType::kFP32, T, H, 0, c.layout, 0);
  auto lse_b = place(DType::kFP32, T, H, 0, c.layout, 1);
  auto out_sep = place(out_dtype, T, H, D, c.layout, 2);
  auto lse_sep = place(DType::kFP32, T, H, 0, c.layout, 2);

  // LSEs: random, with rows where a side (or both) is -inf, equal LSEs, and far-apart LSEs.
  std::uniform_real_distribution<double> lse_dist(-4.0, 12.0), value_dist(-2.0, 2.0);
  std::vector<double> la(size_t(T * H)), lb(size_t(T * H));
  for (int64_t r = 0; r < T * H; ++r) {
    double x = lse_dist(rng), y = lse_dist(rng);
    switch (r % 9) {
      case 0: x = kNegInf; break;
      case 1: y = kNegInf; break;
      case 2: x = y = kNegInf; break;
      case 3: y = x; break;
      case 4: y = x - 90.0; break;  // weight of b underflows to ~1e-39 (a float subnormal)
      default: break;
    }
    la[size_t(r)] = x;
    lb[size_t(r)] = y;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const size_t r = size_t(t * H + h);
      lse_a->cpu.set(lse_a->at(t, h), float(la[r]));
      lse_b->cpu.set(lse_b->at(t, h), float(lb[r]));
      for (int64_t d = 0; d < D; ++d) {
        // A side with lse -inf holds NaN: it must contribute nothing.
        out_a->cpu.set(out_a->at(t, h, d), la[r] == kNegInf ? NAN : float(value_dist(rng)));
        out_b->cpu.set(out_b->at(t, h, d), lb[r] == kNegInf ? NAN : float(value_dist(rng)));
      }
    }
  // Inputs as the op reads them (rounded to their dtype), for the float64 reference.
  const HostTensor a_in = out_a->cpu, b_in = out_b->cpu;
  for (PlacedTensor* p : {out_a.get(), out_b.get(), lse_a.get(), lse_b.get(), out_sep.get(), lse_sep.get()})
    p->finish_init();

  PlacedTensor& out = c.alias == Alias::kOutIsA ? *out_a : c.alias == Alias::kOutIsB ? *out_b : *out_sep;
  PlacedTensor& lse_out = c.alias == Alias::kOutIsA ? *lse_a : c.alias == Alias::kOutIsB ? *lse_b : *lse_sep;

  mla::MergeStatesArgs args;
  args.out_a = out_a->cpu_view();
  args.lse_a = lse_a->cpu_view();
  args.out_b = out_b->cpu_view();
  args.lse_b = lse_b->cpu_view();
  args.out = out.cpu_view();
  if (c.with_lse_out) args.lse_out = lse_out.cpu_view();
  ASSERT_NO_THROW(mla::merge_states(args));

  mla::MergeStatesArgs d_args;
  d_args.out_a = out_a->gpu_view();
  d_args.lse_a = lse_a->gpu_view();
  d_args.out_b = out_b->gpu_view();
  d_args.lse_b = lse_b->gpu_view();
  d_args.out = out.gpu_view();
  if (c.with_lse_out) d_args.lse_out = lse_out.gpu_view();
  ASSERT_NO_FATAL_FAILURE(launch_op(launch, [&](mla::Stream s) { mla::merge_states(d_args, s); }));
  for (PlacedTensor* p : {out_a.get(), out_b.get(), lse_a.get(), lse_b.get(), out_sep.get(), lse_sep.get()})
    p->device->download();

  // Every buffer, every element: GPU against CPU. Inputs not written must be unchanged (the
  // CPU leaves them as they were too); outputs within tolerance; padding stays NaN.
  struct Weights {
    double wa, wb, lse;
  };
  std::vector<Weights> w(size_t(T * H));
  for (size_t r = 0; r < w.size(); ++r) {
    const double m = std::max(la[r], lb[r]);
    if (m == kNegInf) {
      w[r] = {0, 0, kNegInf};
      continue;
    }
    const double ea = la[r] == kNegInf ? 0 : std::exp(double(float(la[r])) - double(float(m)));
    const double eb = lb[r] == kNegInf ? 0 : std::exp(double(float(lb[r])) - double(float(m)));
    w[r] = {ea / (ea + eb), eb / (ea + eb), double(float(m)) + std::log(ea + eb)};
  }
  int64_t values = 0, inexact = 0;
  auto check_buffer = [&](const char* name, PlacedTensor& p, bool is_out, bool is_lse) {
    SCOPED_TRACE(name);
    std::vector<int8_t> role(size_t(p.cpu.numel()), 0);  // 1 = written by the op
    std::vector<int64_t> row_of(size_t(p.cpu.numel()), -1);
    if (is_out || is_lse)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < (is_lse ? 1 : D); ++d) {
            const int64_t i = is_lse ? p.at(t, h) : p.at(t, h, d);
            role[size_t(i)] = 1;
            row_of[size_t(i)] = t * H + h;
          }
    const size_t elem = mla::dtype_size(p.cpu.dtype);
    const Tolerance ulp = one_ulp(p.cpu.dtype), half = half_ulp(p.cpu.dtype);
    int64_t bad = 0, bad64 = 0;
    std::ostringstream first, first64;
    for (int64_t i = 0; i < p.cpu.numel(); ++i) {
      const bool same_bits = std::memcmp(&p.gpu.bytes[size_t(i) * elem], &p.cpu.bytes[size_t(i) * elem], elem) == 0;
      if (role[size_t(i)] == 0) {
        if (!same_bits && bad++ < 8) first << "\n  [" << i << "] (not an output) changed";
        continue;
      }
      ++values;
      if (!same_bits) ++inexact;
      const double g = p.gpu.get(i), cpu = p.cpu.get(i);
      const size_t r = size_t(row_of[size_t(i)]);
      double ref, terms = 0;
      if (is_lse) {
        ref = w[r].lse;
      } else {
        // Recover (t, h, d) of this element from its row and the buffer offset.
        const int64_t t = int64_t(r) / H, h = int64_t(r) % H;
        const int64_t d = i - p.at(t, h, 0);
        const double xa = w[r].wa == 0 ? 0 : a_in.get(out_a->at(t, h, d));
        const double xb = w[r].wb == 0 ? 0 : b_in.get(out_b->at(t, h, d));
        ref = w[r].wa * xa + w[r].wb * xb;
        terms = std::fabs(w[r].wa * xa) + std::fabs(w[r].wb * xb);
      }
      bool ok_cpu, ok_64;
      if (std::isinf(ref) || std::isinf(cpu)) {
        ok_cpu = g == cpu;
        ok_64 = g == ref;
      } else if (is_lse) {
        ok_cpu = std::fabs(g - cpu) <= 1e-6 + 0x1p-22 * std::fabs(cpu);
        ok_64 = std::fabs(g - ref) <= 1e-6 + 0x1p-22 * std::fabs(ref);
      } else {
        ok_cpu = same_bits || std::fabs(g - cpu) <= ulp.atol + ulp.rtol * std::fabs(cpu) + 0x1p-22 * terms;
        ok_64 = std::fabs(g - ref) <= half.atol + half.rtol * std::fabs(ref) + 0x1p-21 * terms;
      }
      if (!ok_cpu && bad++ < 8) first << "\n  [" << i << "] gpu " << g << " cpu " << cpu;
      if (!ok_64 && bad64++ < 8) first64 << "\n  [" << i << "] gpu " << g << " float64 " << ref;
    }
    EXPECT_EQ(bad, 0) << "GPU differs from CPU:" << first.str();
    EXPECT_EQ(bad64, 0) << "GPU differs from float64:" << first64.str();
  };
  const bool out_a_is_out = c.alias == Alias::kOutIsA, out_b_is_out = c.alias == Alias::kOutIsB;
  check_buffer("out_a", *out_a, out_a_is_out, false);
  check_buffer("out_b", *out_b, out_b_is_out, false);
  check_buffer("lse_a", *lse_a, false, out_a_is_out && c.with_lse_out);
  check_buffer("lse_b", *lse_b, false, out_b_is_out && c.with_lse_out);
  check_buffer("out", *out_sep, !alias, false);
  check_buffer("lse_out", *lse_sep, false, !alias && c.with_lse_out);
  if (inexact != 0)
    std::cout << "[ info ] " << inexact << " of " << values
              << " merged values are not bit-identical to the CPU (" << describe(c) << ")\n";
}

struct Shape {
  int heads, tokens, head_dim;
};
constexpr Shape kShapes[] = {{1, 0, 512},  {16, 1, 128}, {128, 9, 512}, {12, 9, 7},
                             {1, 1, 36},   {16, 9, 64},  {128, 1, 128}, {12, 0, 512},
                             {1, 9, 512},  {16, 0, 7},   {128, 9, 36},  {12, 1, 128}};

TEST(GpuMergeStates, EveryDtypeShapeLayoutAndAliasing) {
  MLA_REQUIRE_GPU();
  struct Dtypes {
    DType a, b, out;
  };
  const Dtypes dtypes[] = {{DType::kBF16, DType::kBF16, DType::kBF16},
                           {DType::kFP16, DType::kFP16, DType::kFP16},
                           {DType::kFP32, DType::kFP32, DType::kFP32},
                           {DType::kFP32, DType::kFP32, DType::kBF16},
                           {DType::kBF16, DType::kFP32, DType::kFP16}};
  int variant = 0;
  for (const Dtypes& dt : dtypes)
    for (Layout layout : {Layout::kContiguous, Layout::kStridedAligned, Layout::kMisaligned})
      for (Alias alias : {Alias::kNone, Alias::kOutIsA, Alias::kOutIsB})
        for (int k = 0; k < 2; ++k) {
          const Shape s = kShapes[size_t(variant) % std::size(kShapes)];
          run_merge_case({dt.a, dt.b, dt.out, s.heads, s.tokens, s.head_dim, layout, alias,
                          variant % 4 != 3, uint64_t(500 + variant)});
          ++variant;
          if (HasFailure()) return;
        }
}

TEST(GpuMergeStates, LargeLaunchUsesTheGridStrideLoop) {
  MLA_REQUIRE_GPU();
  // 600 tokens * 128 heads = 76800 rows: more warps than one grid wave (16 blocks of 4 per SM).
  run_merge_case({DType::kBF16, DType::kBF16, DType::kBF16, 128, 600, 128, Layout::kContiguous,
                  Alias::kNone, true, 1});
  run_merge_case({DType::kFP32, DType::kFP32, DType::kFP32, 16, 4001, 36, Layout::kMisaligned,
                  Alias::kOutIsA, true, 2});
}

TEST(GpuMergeStates, NonBlockingStreamAndCudaGraph) {
  MLA_REQUIRE_GPU();
  run_merge_case({DType::kBF16, DType::kBF16, DType::kBF16, 16, 7, 512, Layout::kStridedAligned,
                  Alias::kNone, true, 10}, Launch::kNonBlockingStream);
  run_merge_case({DType::kFP16, DType::kFP32, DType::kFP32, 128, 3, 128, Layout::kContiguous,
                  Alias::kOutIsB, true, 11}, Launch::kCudaGraph);
  run_merge_case({DType::kFP32, DType::kBF16, DType::kBF16, 12, 5, 7, Layout::kMisaligned,
                  Alias::kNone, false, 12}, Launch::kCudaGraph);
}

// A side of weight 0 (lse -inf, or 200 below the other) leaves the other side bit for bit, -0
// included, on both the vectorised (Dv 512) and the element-wise (Dv 7) paths.
TEST(GpuMergeStates, AWeightlessSideLeavesEveryBitOfTheOther) {
  MLA_REQUIRE_GPU();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t dv : {512, 7}) {
    const int64_t rows = 6;  // row % 3: only a, only b, both with b far below
    HostTensor out_a(DType::kFP32, {rows, 1, dv}), out_b(DType::kFP32, {rows, 1, dv});
    HostTensor lse_a(DType::kFP32, {rows, 1}), lse_b(DType::kFP32, {rows, 1});
    HostTensor out(DType::kFP32, {rows, 1, dv}), lse_out(DType::kFP32, {rows, 1});
    out.fill_nan();
    lse_out.fill_nan();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < dv; ++c) {
        out_a.set(r * dv + c, c % 3 == 0 ? -0.0f : 0.25f * float(c + r));
        out_b.set(r * dv + c, c % 3 == 0 ? -0.0f : -0.5f * float(c + 1));
      }
      lse_a.set(r, r % 3 == 1 ? neg_inf : 1.5f + float(r));
      lse_b.set(r, r % 3 == 0 ? neg_inf : r % 3 == 1 ? 0.75f : 1.5f + float(r) - 200.0f);
    }
    DeviceTensor d_out_a(out_a), d_out_b(out_b), d_lse_a(lse_a), d_lse_b(lse_b), d_out(out),
        d_lse_out(lse_out);
    mla::MergeStatesArgs args;
    args.out_a = d_out_a.view();
    args.out_b = d_out_b.view();
    args.lse_a = d_lse_a.view();
    args.lse_b = d_lse_b.view();
    args.out = d_out.view();
    args.lse_out = d_lse_out.view();
    ASSERT_NO_THROW(mla::merge_states(args));
    MLA_TEST_CUDA(cudaDeviceSynchronize());
    d_out.download();
    d_lse_out.download();
    for (int64_t r = 0; r < rows; ++r) {
      const bool only_b = r % 3 == 1;
      const HostTensor& kept = only_b ? out_b : out_a;
      EXPECT_EQ(0, std::memcmp(out.bytes.data() + size_t(r * dv) * 4, kept.bytes.data() + size_t(r * dv) * 4,
                               size_t(dv) * 4))
          << "Dv " << dv << ", row " << r;
      EXPECT_EQ(lse_out.get(r), (only_b ? lse_b : lse_a).get(r)) << "Dv " << dv << ", row " << r;
    }
  }
}

}  // namespace
