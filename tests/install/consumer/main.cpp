// Uses the installed library through find_package(mla): merges two tiny attention states.
#include <cmath>
#include <cstdio>

#include "mla/ops.hpp"

int main() {
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
  bool ok = out[0] == 2.0f && out[1] == 3.0f && std::fabs(lse[0] - std::log(2.0f)) < 1e-6f;
  std::printf("mla consumer: merge_states %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
