// The narrow warpgroup MMA shapes of src/cuda/common/hopper.cuh (m64n16k16, keys or value dims as
// M), on the tile layouts the Hopper decode kernel keeps in shared memory, against a float64
// product on the host: S^T = K Q^T (A = a 64-key box, B = the query box, both K-major) and
// O^T = V^T P^T (A = the same box read MN-major as V^T, B = P, K-major), for bf16 and fp16, over
// one 64-wide box (four k16 steps). The fragment layout is checked element by element, so a
// wrong descriptor, major-ness or register order fails here before any kernel uses the shapes.
// Also the bounded mbarrier wait (mbar_wait_at_most): it gives up on a phase that does not
// complete, and returns at once on one that has.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "gpu_util.hpp"

#if defined(MLA_TEST_EXPECT_HOPPER)
#include "cuda/common/hopper.cuh"
#include "cuda/common/trace.cuh"
#endif

namespace mla::test {
namespace {

#if defined(MLA_TEST_EXPECT_HOPPER)

constexpr int kRows = 16;  // query rows (N)
constexpr int kBox = 64;   // keys (rows of a box) and values a row

// One warpgroup. k: [64 keys][64 dims], q: [16][64], p: [16][64 keys], row-major; st: S^T [64][16],
// ot: O^T [64 dims][16], fp32.
template <typename T>
__global__ void narrow_mma_kernel(const T* k, const T* q, const T* p, float* st, float* ot) {
#if defined(MLA_SM90A_DEVICE)
  using namespace mla::cuda::sm90;
  __shared__ __align__(1024) uint8_t smem[3 * kBox * 128];  // K box, Q box, P box (rows past 16: 0)
  uint8_t* sk = smem;
  uint8_t* sq = smem + kBox * 128;
  uint8_t* sp = smem + 2 * kBox * 128;
  const int t = int(threadIdx.x);
  const T zero = T(0.0f);
  for (int i = t; i < kBox * kBox; i += 128) {
    const int r = i / kBox, c = i % kBox;
    *reinterpret_cast<T*>(sk + swizzled_offset(r, c)) = k[i];
    *reinterpret_cast<T*>(sq + swizzled_offset(r, c)) = r < kRows ? q[r * kBox + c] : zero;
    *reinterpret_cast<T*>(sp + swizzled_offset(r, c)) = r < kRows ? p[r * kBox + c] : zero;
  }
  fence_proxy_async();
  __syncthreads();
  float s[8], o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = o[i] = 0.0f;
  const uint32_t ak = smem_u32(sk), aq = smem_u32(sq), ap = smem_u32(sp);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)  // S^T over the 64 dims: k16 slice kk of each row
    wgmma_64x16<T>(k_major_desc(ak + kk * 32), k_major_desc(aq + kk * 32), s, kk > 0);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)  // O^T over the 64 keys: rows [16 kk, 16 kk + 16) of the box
    wgmma_64x16_mn<T>(mn_major_desc(ak + kk * 16 * 128, kBox * 128), k_major_desc(ap + kk * 32), o, kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(s);
  fence_operands(o);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int j = i >> 2, h = (i >> 1) & 1, e = i & 1;
    const int m = 16 * (t / 32) + (t % 32) / 4 + 8 * h, n = 8 * j + 2 * (t % 4) + e;
    st[m * kRows + n] = s[i];
    ot[m * kRows + n] = o[i];
  }
#endif
}

// The kernel on random k, q and p of `dtype` (T), against a float64 product of the same values.
template <typename T>
void run_narrow_mma(DType dtype, float (*to_float)(T), T (*from_float)(float)) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  HostTensor k(dtype, {kBox, kBox}), q(dtype, {kRows, kBox}), p(dtype, {kRows, kBox});
  T* kv = static_cast<T*>(k.data());
  T* qv = static_cast<T*>(q.data());
  T* pv = static_cast<T*>(p.data());
  for (int64_t i = 0; i < k.numel(); ++i) kv[i] = from_float(u(rng));
  for (int64_t i = 0; i < q.numel(); ++i) qv[i] = from_float(u(rng));
  for (int64_t i = 0; i < p.numel(); ++i) pv[i] = from_float(0.5f * (u(rng) + 1.0f));  // weights in [0, 1]
  // NaN in the outputs: an element the kernel does not write fails the comparison.
  HostTensor st(DType::kFP32, {kBox, kRows}), ot(DType::kFP32, {kBox, kRows});
  std::memset(st.data(), 0xFF, st.bytes.size());
  std::memset(ot.data(), 0xFF, ot.bytes.size());
  DeviceTensor dk(k), dq(q), dp(p), dst(st), dot(ot);
  narrow_mma_kernel<T><<<1, 128>>>(static_cast<const T*>(dk.ptr), static_cast<const T*>(dq.ptr),
                                   static_cast<const T*>(dp.ptr), static_cast<float*>(dst.ptr),
                                   static_cast<float*>(dot.ptr));
  MLA_TEST_CUDA(cudaGetLastError());
  MLA_TEST_CUDA(cudaDeviceSynchronize());
  dst.download();
  dot.download();
  const float* s_got = static_cast<const float*>(st.data());
  const float* o_got = static_cast<const float*>(ot.data());

  int bad = 0;
  for (int m = 0; m < kBox; ++m) {
    for (int n = 0; n < kRows; ++n) {
      double s_ref = 0.0, o_ref = 0.0;
      for (int c = 0; c < kBox; ++c) {
        s_ref += double(to_float(kv[m * kBox + c])) * double(to_float(qv[n * kBox + c]));  // key m . query n
        o_ref += double(to_float(kv[c * kBox + m])) * double(to_float(pv[n * kBox + c]));  // V[c][dim m] P[n][c]
      }
      const float s_m = s_got[m * kRows + n], o_m = o_got[m * kRows + n];
      if (!(std::fabs(s_m - s_ref) <= 1e-3 + 1e-4 * std::fabs(s_ref)) && bad++ < 8)
        ADD_FAILURE() << "S^T[key " << m << "][row " << n << "] = " << s_m << ", expected " << s_ref;
      if (!(std::fabs(o_m - o_ref) <= 1e-3 + 1e-4 * std::fabs(o_ref)) && bad++ < 8)
        ADD_FAILURE() << "O^T[dim " << m << "][row " << n << "] = " << o_m << ", expected " << o_ref;
    }
  }
  EXPECT_EQ(bad, 0);
}

// Thread 0 waits at most 4 x 500 ns for a phase nobody has completed yet, records how long that
// took and whether the phase was complete when it returned, then waits (unbounded) for warp 1,
// which arrives 2 ms after the start, and waits at most ~0.5 s more on the completed phase. out:
// [0] the first wait's ns, [1] 1 if the phase was complete after it, [2] the last wait's ns.
__global__ void wait_at_most_kernel(unsigned long long* out) {
#if defined(MLA_SM90A_DEVICE)
  using namespace mla::cuda::sm90;
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    mbar_init(&bar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  const unsigned long long start = mla::cuda::globaltimer_ns();
  if (threadIdx.x == 0) {
    mbar_wait_at_most(&bar, 0, 500u, 4);
    const unsigned long long gave_up = mla::cuda::globaltimer_ns();
    uint32_t complete;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(complete)
        : "r"(smem_u32(&bar))
        : "memory");
    out[0] = gave_up - start;
    out[1] = complete;
    mbar_wait(&bar, 0);
    const unsigned long long t = mla::cuda::globaltimer_ns();
    mbar_wait_at_most(&bar, 0, 500u, 1 << 20);
    out[2] = mla::cuda::globaltimer_ns() - t;
  } else if (threadIdx.x == 32) {
    while (mla::cuda::globaltimer_ns() - start < 2000000ull) {
    }
    mbar_arrive(&bar);
  }
#endif
}

float bf16_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__nv_bfloat16 float_to_bf16(float x) { return __float2bfloat16(x); }
float half_to_float(__half x) { return __half2float(x); }
__half float_to_half(float x) { return __float2half(x); }

#endif  // MLA_TEST_EXPECT_HOPPER

TEST(GpuWgmma, NarrowShapesMatchTheHostProduct) {
  MLA_REQUIRE_HOPPER();
#if defined(MLA_TEST_EXPECT_HOPPER)
  {
    SCOPED_TRACE("bf16");
    run_narrow_mma<__nv_bfloat16>(DType::kBF16, bf16_to_float, float_to_bf16);
  }
  {
    SCOPED_TRACE("fp16");
    run_narrow_mma<__half>(DType::kFP16, half_to_float, float_to_half);
  }
#endif
}

TEST(GpuHopperBarriers, WaitAtMostGivesUpThenReturnsOnCompletion) {
  MLA_REQUIRE_HOPPER();
#if defined(MLA_TEST_EXPECT_HOPPER)
  unsigned long long* out = nullptr;
  MLA_TEST_CUDA(cudaMalloc(&out, 3 * sizeof(unsigned long long)));
  MLA_TEST_CUDA(cudaMemset(out, 0xff, 3 * sizeof(unsigned long long)));
  wait_at_most_kernel<<<1, 64>>>(out);
  MLA_TEST_CUDA(cudaGetLastError());
  MLA_TEST_CUDA(cudaDeviceSynchronize());
  unsigned long long host[3];
  MLA_TEST_CUDA(cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost));
  MLA_TEST_CUDA(cudaFree(out));
  // Gave up well before the arrival at 2 ms, on a phase still open; returned at once once it closed.
  EXPECT_LT(host[0], 1000000ull) << "ns in the bounded wait on an open phase";
  EXPECT_EQ(host[1], 0ull) << "the phase was complete when the bounded wait returned";
  EXPECT_LT(host[2], 100000ull) << "ns in the bounded wait on a completed phase";
#endif
}

}  // namespace
}  // namespace mla::test
