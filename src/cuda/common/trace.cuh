// Timelines of one kernel run, for docs/perf-notes.md: a build with -DMLA_PLAN_TRACE=1 (the plan)
// or -DMLA_DECODE_TRACE=1 (the Hopper decode kernel and the combine) stamps %globaltimer at fixed
// points and prints the stamps when the kernel ends. Off by default: nothing here is compiled
// into a normal build.
#pragma once

#if (defined(MLA_PLAN_TRACE) && MLA_PLAN_TRACE) || (defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE)
#include <cstdio>  // the traces' printf

namespace mla::cuda {

// The GPU's global nanosecond clock (the same on every SM).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace mla::cuda
#endif
