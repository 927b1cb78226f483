// Uses the installed library through find_package(mla): merges two tiny attention states, then
// runs the README's decode example (constant inputs, so the answer is known in closed form).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace {

bool merge_example() {
  float out_a[2] = {1.0f, 2.0f}, out_b[2] = {3.0f, 4.0f}, out[2], lse[1];
  float lse_a[1] = {0.0f}, lse_b[1] = {0.0f};
  mla::MergeStatesArgs args;
  args.out_a = mla::TensorView::contiguous(out_a, mla::DType::kFP32, {1, 1, 2});
  args.lse_a = mla::TensorView::contiguous(lse_a, mla::DType::kFP32, {1, 1});
  args.out_b = mla::TensorView::contiguous(out_b, mla::DType::kFP32, {1, 1, 2});
  args.lse_b = mla::TensorView::contiguous(lse_b, mla::DType::kFP32, {1, 1});
  args.out = mla::TensorView::contiguous(out, mla::DType::kFP32, {1, 1, 2});
  args.lse_out = mla::TensorView::contiguous(lse, mla::DType::kFP32, {1, 1});
  mla::merge_states(args);
  const bool ok = out[0] == 2.0f && out[1] == 3.0f && std::fabs(lse[0] - std::log(2.0f)) < 1e-6f;
  std::printf("mla consumer: merge_states %s\n", ok ? "ok" : "WRONG");
  return ok;
}

// The README example: every query value is a, every cache value c, so every score is the same:
// out = c (as bf16) and lse = ln(kv_len) + softmax_scale * 576 * a * c.
bool decode_example() {
  using namespace mla;
  const int B = 2, H = 16, S = 64, P = 8, max_blocks = 2;
  const float a = 0.01f, c = 0.02f;
  std::vector<uint16_t> q(B * H * kLatentDim, float_to_bf16(a));
  std::vector<uint16_t> cache(P * S * kLatentDim, float_to_bf16(c));
  std::vector<int32_t> block_table = {5, 2, 7, -1};
  std::vector<int32_t> kv_lens = {100, 30};
  std::vector<uint16_t> out(B * H * kKvLoraRank);
  std::vector<float> lse(B * H);

  MlaDecodeArgs args;
  args.q = TensorView::contiguous(q.data(), DType::kBF16, {B, H, kLatentDim});
  args.kv_cache = TensorView::contiguous(cache.data(), DType::kBF16, {P, S, kLatentDim});
  args.block_table = TensorView::contiguous(block_table.data(), DType::kInt32, {B, max_blocks});
  args.kv_lens = TensorView::contiguous(kv_lens.data(), DType::kInt32, {B});
  args.q_len = 1;
  args.softmax_scale = 1.0f / std::sqrt(192.0f);
  args.out = TensorView::contiguous(out.data(), DType::kBF16, {B, H, kKvLoraRank});
  args.lse = TensorView::contiguous(lse.data(), DType::kFP32, {B, H});
  mla_decode(args);

  const double qa = bf16_to_float(float_to_bf16(a)), kc = bf16_to_float(float_to_bf16(c));
  bool ok = true;
  for (int b = 0; b < B; ++b) {
    const double expected_lse = std::log(double(kv_lens[size_t(b)])) +
                                double(args.softmax_scale) * kLatentDim * qa * kc;
    for (int h = 0; h < H; ++h) {
      ok = ok && std::fabs(lse[size_t(b * H + h)] - expected_lse) < 1e-4;
      for (int d = 0; d < kKvLoraRank; ++d)
        ok = ok && std::fabs(bf16_to_float(out[size_t((b * H + h) * kKvLoraRank + d)]) - kc) < 1e-4;
    }
  }
  // Bad input throws mla::Error naming the argument.
  bool threw = false;
  args.kv_lens = TensorView::contiguous(kv_lens.data(), DType::kInt32, {1});
  try {
    mla_decode(args);
  } catch (const Error& e) {
    threw = e.message().find("kv_lens") != std::string::npos;
  }
  std::printf("mla consumer: mla_decode %s, bad input %s\n", ok ? "ok" : "WRONG",
              threw ? "rejected" : "NOT REJECTED");
  return ok && threw;
}

}  // namespace

int main() {
  try {
    const bool merge_ok = merge_example();
    const bool decode_ok = decode_example();
    return merge_ok && decode_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("mla consumer: unexpected error: %s\n", e.what());
    return 1;
  }
}
