// Timelines of one kernel run, for docs/perf-notes.md: a build with -DMLA_PLAN_TRACE=1 (the plan)
// or -DMLA_DECODE_TRACE=1 (the Hopper decode kernel and the combine) stamps %globaltimer at fixed
// points. The plan prints its stamps when it ends; the decode kernel stores six CTAs' stamps in a
// buffer (DecodeParams::trace) that the combine's first CTA prints, with its own, when it ends (a
// kernel that prints completes tens of microseconds later, which would delay the combine's
// wait). Off by default: nothing but the clock below is compiled into a normal build.
#pragma once

namespace mla::cuda {

// The GPU's global nanosecond clock (the same on every SM).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace mla::cuda

#if (defined(MLA_PLAN_TRACE) && MLA_PLAN_TRACE) || (defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE)
#include <cstdio>  // the traces' printf

namespace mla::cuda {

// The decode trace buffer: kDecodeTraceCtas records of kDecodeTraceWords words (a record's word 0
// is its CTA's entry time, 0 when the record is empty; the last three are the CTA, its first item
// and its item count).
constexpr int kDecodeTraceCtas = 6;
constexpr int kDecodeTraceWords = 32;
constexpr int kDecodeTraceStamps = 25;  // the Hopper kernel's TracePoints
// After the records: every CTA's entry, first S, row sums (of its last item), end, SM (%smid),
// and the links of its start: item range read, first item, first group issued, first tile issued;
// kDecodeTraceCtaWords words a CTA (up to kDecodeTraceGridCtas CTAs), which the combine prints one
// line a CTA.
constexpr int kDecodeTraceGrid = kDecodeTraceCtas * kDecodeTraceWords;
constexpr int kDecodeTraceGridCtas = 1024;
constexpr int kDecodeTraceCtaWords = 9;
constexpr int kDecodeTraceBufferWords = kDecodeTraceGrid + kDecodeTraceCtaWords * kDecodeTraceGridCtas;

}  // namespace mla::cuda
#endif
