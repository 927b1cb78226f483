// Error reporting on the GPU path: CUDA errors surface as mla::Error carrying the CUDA error name
// and string, the failing call, and the file and line; tensors on a device that does not exist
// fail with the CUDA error (not a crash); mixed CPU/CUDA arguments are rejected naming the
// argument, for every op owned here (append_latent_kv, build_block_table, rope_quantize,
// merge_states). Only non-sticky CUDA errors are provoked, so later tests in the same process
// still run on a healthy context.
#include <string>

#include "cuda/cuda_check.hpp"
#include "gpu_util.hpp"
#include "mla/ops.hpp"

namespace {

using mla::Device;
using mla::DType;
using mla::TensorView;
using mla::test::DeviceTensor;
using mla::test::HostTensor;
using mla::test::throws_error;

TEST(GpuErrors, CudaCheckThrowsMlaErrorWithCudaStringFileAndLine) {
  MLA_REQUIRE_GPU();
  const int line = __LINE__ + 2;
  try {
    MLA_CUDA_CHECK(cudaSetDevice(-1));
    FAIL() << "MLA_CUDA_CHECK did not throw";
  } catch (const mla::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaSetDevice(-1)"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaErrorInvalidDevice"), std::string::npos) << what;
    EXPECT_NE(what.find(cudaGetErrorString(cudaErrorInvalidDevice)), std::string::npos) << what;
    EXPECT_NE(what.find("test_gpu_errors.cpp:" + std::to_string(line)), std::string::npos) << what;
    EXPECT_EQ(e.message().find("test_gpu_errors.cpp"), std::string::npos) << "message() has no location";
  }
  cudaGetLastError();  // clear the (non-sticky) error
}

TEST(GpuErrors, LaunchCheckReportsThePendingError) {
  MLA_REQUIRE_GPU();
  cudaGetLastError();
  // A failed runtime call leaves its error pending; the check after a launch must report it.
  EXPECT_NE(cudaSetDevice(-1), cudaSuccess);
  EXPECT_TRUE(throws_error([] { MLA_CUDA_CHECK_LAUNCH(); },
                           {"cudaGetLastError", "cudaErrorInvalidDevice", "test_gpu_errors.cpp:"}));
  // Reading the error clears it: the next check passes.
  EXPECT_NO_THROW(MLA_CUDA_CHECK_LAUNCH());
}

// Valid small inputs for the four ops, allocated on device 0; views can be moved to another
// device (or to the CPU) one argument at a time.
struct Fixture {
  HostTensor k_nope{DType::kBF16, {3, mla::kKvLoraRank}};
  HostTensor k_pe{DType::kBF16, {3, mla::kRopeDim}};
  HostTensor loc = mla::test::int32_tensor({0, -1, 5});
  HostTensor cache{DType::kBF16, {2, 4, mla::kLatentDim}};
  HostTensor req_to_token = mla::test::int32_tensor({0, 1, 2, 3, 4, 5, 6, 7}, {2, 4});
  HostTensor req_idx = mla::test::int32_tensor({1, 0});
  HostTensor seq_lens = mla::test::int32_tensor({3, 4});
  HostTensor table{DType::kInt32, {2, 2}};
  HostTensor q_nope{DType::kBF16, {3, 2, mla::kKvLoraRank}};
  HostTensor q_pe{DType::kBF16, {3, 2, mla::kRopeDim}};
  HostTensor cos_sin{DType::kFP32, {8, mla::kRopeDim}};
  HostTensor positions = mla::test::int32_tensor({0, 3, 7});
  HostTensor q_out{DType::kBF16, {3, 2, mla::kLatentDim}};
  HostTensor k_nope_out{DType::kBF16, {3, mla::kKvLoraRank}};
  HostTensor k_pe_out{DType::kBF16, {3, mla::kRopeDim}};
  HostTensor out_a{DType::kFP32, {3, 2, 128}}, out_b{DType::kFP32, {3, 2, 128}}, out{DType::kFP32, {3, 2, 128}};
  HostTensor lse_a{DType::kFP32, {3, 2}}, lse_b{DType::kFP32, {3, 2}}, lse_out{DType::kFP32, {3, 2}};

  std::vector<std::unique_ptr<DeviceTensor>> device;
  TensorView on_gpu(HostTensor& h) {
    device.push_back(std::make_unique<DeviceTensor>(h));
    return device.back()->view();
  }
  mla::AppendLatentKvArgs append;
  mla::BuildBlockTableArgs block_table;
  mla::RopeQuantizeArgs rope;
  mla::MergeStatesArgs merge;

  Fixture() {
    std::mt19937_64 rng(1);
    for (HostTensor* t : {&k_nope, &k_pe, &q_nope, &q_pe, &cos_sin, &out_a, &out_b, &lse_a, &lse_b})
      t->fill_uniform(rng, -1, 1);
    append.k_nope = on_gpu(k_nope);
    append.k_pe = on_gpu(k_pe);
    append.loc = on_gpu(loc);
    append.kv_cache = on_gpu(cache);
    block_table.req_to_token = on_gpu(req_to_token);
    block_table.req_pool_indices = on_gpu(req_idx);
    block_table.seq_lens = on_gpu(seq_lens);
    block_table.page_size = 2;
    block_table.block_table = on_gpu(table);
    rope.q_nope = on_gpu(q_nope);
    rope.q_pe = on_gpu(q_pe);
    rope.k_nope = append.k_nope;
    rope.k_pe = append.k_pe;
    rope.cos_sin_cache = on_gpu(cos_sin);
    rope.positions = on_gpu(positions);
    rope.q_out = on_gpu(q_out);
    rope.k_nope_out = on_gpu(k_nope_out);
    rope.k_pe_out = on_gpu(k_pe_out);
    merge.out_a = on_gpu(out_a);
    merge.lse_a = on_gpu(lse_a);
    merge.out_b = on_gpu(out_b);
    merge.lse_b = on_gpu(lse_b);
    merge.out = on_gpu(out);
    merge.lse_out = on_gpu(lse_out);
  }
};

TEST(GpuErrors, FixtureRunsOnTheGpu) {
  MLA_REQUIRE_GPU();
  Fixture f;
  EXPECT_NO_THROW(mla::append_latent_kv(f.append));
  EXPECT_NO_THROW(mla::build_block_table(f.block_table));
  EXPECT_NO_THROW(mla::rope_quantize(f.rope));
  EXPECT_NO_THROW(mla::merge_states(f.merge));
  MLA_TEST_CUDA(cudaDeviceSynchronize());
}

TEST(GpuErrors, TensorsOnAMissingDeviceRaiseTheCudaError) {
  MLA_REQUIRE_GPU();
  int count = 0;
  MLA_TEST_CUDA(cudaGetDeviceCount(&count));
  const Device missing = Device::cuda(count + 3);
  Fixture f;
  auto move_all = [&](std::initializer_list<TensorView*> views) {
    for (TensorView* v : views)
      if (!v->empty()) v->device = missing;
  };
  move_all({&f.append.k_nope, &f.append.k_pe, &f.append.loc, &f.append.kv_cache});
  move_all({&f.block_table.req_to_token, &f.block_table.req_pool_indices, &f.block_table.seq_lens,
            &f.block_table.block_table});
  move_all({&f.rope.q_nope, &f.rope.q_pe, &f.rope.k_nope, &f.rope.k_pe, &f.rope.cos_sin_cache,
            &f.rope.positions, &f.rope.q_out, &f.rope.k_nope_out, &f.rope.k_pe_out});
  move_all({&f.merge.out_a, &f.merge.lse_a, &f.merge.out_b, &f.merge.lse_b, &f.merge.out,
            &f.merge.lse_out});
  const std::initializer_list<const char*> fragments = {"cudaSetDevice", "cudaErrorInvalidDevice",
                                                        "src/cuda/"};
  EXPECT_TRUE(throws_error([&] { mla::append_latent_kv(f.append); }, fragments));
  EXPECT_TRUE(throws_error([&] { mla::build_block_table(f.block_table); }, fragments));
  EXPECT_TRUE(throws_error([&] { mla::rope_quantize(f.rope); }, fragments));
  EXPECT_TRUE(throws_error([&] { mla::merge_states(f.merge); }, fragments));
  cudaGetLastError();
  // The current device is unchanged and still works.
  int current = -1;
  MLA_TEST_CUDA(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);
  Fixture ok;
  EXPECT_NO_THROW(mla::merge_states(ok.merge));
  MLA_TEST_CUDA(cudaDeviceSynchronize());
}

// Each argument in turn moved to the CPU: rejected, naming the argument, before any launch.
template <typename Args, typename Run>
void expect_mixed_devices_rejected(const char* op, Args Fixture::*member,
                                   std::initializer_list<std::pair<const char*, TensorView Args::*>> fields,
                                   Run run) {
  for (const auto& [name, field] : fields) {
    Fixture f;
    Args& args = f.*member;
    (args.*field).device = Device::cpu();
    EXPECT_TRUE(throws_error([&] { run(args); }, {op, name, "cpu", "cuda:0", "one device"}))
        << op << ": " << name << " on the CPU";
  }
}

TEST(GpuErrors, MixedDevicesAreRejected) {
  MLA_REQUIRE_GPU();
  using A = mla::AppendLatentKvArgs;
  expect_mixed_devices_rejected<A>(
      "append_latent_kv", &Fixture::append,
      {{"k_nope", &A::k_nope}, {"k_pe", &A::k_pe}, {"loc", &A::loc}, {"kv_cache", &A::kv_cache}},
      [](const A& a) { mla::append_latent_kv(a); });
  using B = mla::BuildBlockTableArgs;
  expect_mixed_devices_rejected<B>(
      "build_block_table", &Fixture::block_table,
      {{"req_to_token", &B::req_to_token}, {"req_pool_indices", &B::req_pool_indices},
       {"seq_lens", &B::seq_lens}, {"block_table", &B::block_table}},
      [](const B& a) { mla::build_block_table(a); });
  using R = mla::RopeQuantizeArgs;
  expect_mixed_devices_rejected<R>(
      "rope_quantize", &Fixture::rope,
      {{"q_nope", &R::q_nope}, {"q_pe", &R::q_pe}, {"k_nope", &R::k_nope}, {"k_pe", &R::k_pe},
       {"cos_sin_cache", &R::cos_sin_cache}, {"positions", &R::positions}, {"q_out", &R::q_out},
       {"k_nope_out", &R::k_nope_out}, {"k_pe_out", &R::k_pe_out}},
      [](const R& a) { mla::rope_quantize(a); });
  using M = mla::MergeStatesArgs;
  expect_mixed_devices_rejected<M>(
      "merge_states", &Fixture::merge,
      {{"out_a", &M::out_a}, {"lse_a", &M::lse_a}, {"out_b", &M::out_b}, {"lse_b", &M::lse_b},
       {"out", &M::out}, {"lse_out", &M::lse_out}},
      [](const M& a) { mla::merge_states(a); });
  // Nothing was launched: no CUDA error pending.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
