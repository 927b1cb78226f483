// The arithmetic of a deterministic split-KV plan (DecodeSchedule::split_keys > 0): plain
// integer functions, compiled for the plan kernel and for the host (the tests' model of the
// plan), so that both run the same code.
//
// Every unit (request, row tile; or the whole request when the plan runs row tiles in lanes) is
// cut at the multiples of split_keys of its request's keys, whatever else is in the batch: piece
// k holds keys [k S, min((k + 1) S, kv_len)), and a request of kv_len keys has
// pieces(kv_len, S) of them (one, possibly empty, when kv_len <= S). A piece's result, and the
// order in which the combine adds the pieces of a row, then depend on the request alone, so its
// output has the same bits in any batch. Each row tile of a request takes the same cuts (a row
// tile whose last query sees fewer keys finds its last pieces shorter or empty), so the pieces
// do not depend on whether the plan runs row tiles in lanes either.
//
// Which CTA runs a piece is free (it changes no bits): the pieces are laid end to end on a cost
// line in request order (each costs its key blocks plus kOverhead for its query load and its
// stores) and piece i, starting at position s_i, goes to part floor(s_i P / T) of the P parts
// (T the line's total): part p runs the pieces that start in [p T / P, (p + 1) T / P).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MLA_FIXED_SPLIT_HD __host__ __device__
#else
#define MLA_FIXED_SPLIT_HD
#endif

namespace mla::cuda::decode::fixed_split {

constexpr int kBlockKeys = 64;  // keys a cost block (the decode kernels' kBlockN)
constexpr int kOverhead = 1;    // cost blocks a piece adds (kOverheadBlocks)

// Key blocks of `keys` (>= 0) keys.
MLA_FIXED_SPLIT_HD inline int blocks(int keys) {
  return int((unsigned(keys) + kBlockKeys - 1) / kBlockKeys);
}

// Pieces of a request of kv_len keys (>= 0) cut every split_keys keys (a multiple of kBlockKeys):
// at least one.
MLA_FIXED_SPLIT_HD inline int pieces(int kv_len, int split_keys) {
  return kv_len <= split_keys ? 1 : int((unsigned(kv_len) - 1) / unsigned(split_keys)) + 1;
}

// Keys [begin, end) of piece k of a request of kv_len keys.
struct KeyRange {
  int begin, end;
};
MLA_FIXED_SPLIT_HD inline KeyRange piece_keys(int k, int kv_len, int split_keys) {
  const long long begin = (long long)k * split_keys;
  const long long end = begin + split_keys < kv_len ? begin + split_keys : kv_len;
  return {int(begin < kv_len ? begin : kv_len), int(end)};
}

// Line cost of a unit of a request of kv_len keys: its key blocks and one overhead a piece.
MLA_FIXED_SPLIT_HD inline long long unit_cost(int kv_len, int split_keys) {
  return (long long)blocks(kv_len) + (long long)pieces(kv_len, split_keys) * kOverhead;
}

// Line offset of piece k from its unit's start (every piece before it is a whole split_keys).
MLA_FIXED_SPLIT_HD inline long long piece_offset(int k, int split_keys) {
  return (long long)k * (split_keys / kBlockKeys + kOverhead);
}

// Line cost of piece k of a request of kv_len keys.
MLA_FIXED_SPLIT_HD inline long long piece_cost(int k, int kv_len, int split_keys) {
  const KeyRange r = piece_keys(k, kv_len, split_keys);
  return (long long)blocks(r.end - r.begin) + kOverhead;
}

// floor(position * parts / total) for 0 <= position <= total, total >= 1: the number of cuts
// p T / P (p >= 1) at or before `position`.
MLA_FIXED_SPLIT_HD inline int cuts_up_to(long long position, long long total, int parts) {
  return int((unsigned long long)position * (unsigned long long)parts / (unsigned long long)total);
}

// The part of a piece that starts at `start` on a line of `total` (>= 1): floor(start P / T).
MLA_FIXED_SPLIT_HD inline int part_of(long long start, long long total, int parts) {
  const int p = cuts_up_to(start, total, parts);
  return p < parts - 1 ? p : parts - 1;
}

// The parts whose first piece follows item i, a piece on [start, end) of the line: part p begins
// at item i + 1 for p in (cuts_up_to(start), cuts_up_to(end)]. These ranges of consecutive items
// tile (0, P], so every part_begin[p], p >= 1, is written by exactly one item; part_begin[0] = 0.
struct PartRange {
  int first, last;  // parts first..last (none when first > last)
};
MLA_FIXED_SPLIT_HD inline PartRange parts_after(long long start, long long end, long long total,
                                                int parts) {
  return {cuts_up_to(start, total, parts) + 1, cuts_up_to(end, total, parts)};
}

}  // namespace mla::cuda::decode::fixed_split
