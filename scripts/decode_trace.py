#!/usr/bin/env python3
"""Timeline of one scheduled Hopper decode call from a trace build's output.

A build configured with -DCMAKE_CUDA_FLAGS=-DMLA_DECODE_TRACE=1 stamps %globaltimer in six CTAs
of every scheduled run of the Hopper decode kernel and in the combine's first CTA, which prints
them (DTRACE lines) and its own (a CTRACE line) when it ends; see src/cuda/common/trace.cuh. This
script reads mla-bench's output of such a build and prints, for each case, one scheduled call's
stamps (--index; a run whose grid is --grid CTAs, with its combine) in microseconds from the
first traced CTA's entry.

  mla-bench --device cuda --op decode --warmup 2 --iters 3 --heads 128 --batch 1 --kv-len 16384 \\
      | scripts/decode_trace.py --grid 132
"""
import argparse
import re
import sys

# p0 .. p11: the ends of WG1's first pairs of tiles (the narrow consumers of 16-row tiles: of its
# first tiles, one at a time; their stR stays empty, WG2 has no work there).
NAMES = ["wait", "work", "item", "g0", "g1", "issued", "Q", "S"] + [f"p{i}" for i in range(12)] + ["sums", "stL", "stR", "end"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", type=int, required=True, help="the scheduled decode grid (the plan's parts)")
    ap.add_argument("--index", type=int, default=-1,
                    help="which of a case's scheduled calls (0: the first; -1: the last). mla-bench runs "
                         "warmup + iters eager calls, then as many graph replays")
    ap.add_argument("file", nargs="?", default="-")
    a = ap.parse_args()
    lines = (sys.stdin if a.file == "-" else open(a.file)).read().splitlines()

    calls, group, reported = [], None, 0  # group: [decode lines, combine lines, grid]
    for line in lines:
        if line.startswith("DTRACE"):
            m = re.match(r"DTRACE grid (\d+) cta (\d+) items (\d+)/(\d+) t0 (\d+) \| (.*)", line)
            grid, cta, begin, count, t0 = map(int, m.groups()[:5])
            stamps = [int(v) for v in m.group(6).replace("|", " ").split()]
            if group is None or group[1] or group[2] != grid:
                group = [[], [], grid]
                calls.append(group)
            group[0].append((cta, begin, count, t0, stamps))
        elif line.startswith("ETRACE") and group is not None:
            # Every CTA: entry, first S, row sums, end (absolute ns, 0: not reached; newer builds),
            # its SM, then its start's links: work range read, first item, first group issued,
            # first tile issued (newer builds still; -1 / 0 where the line has none).
            while len(group) < 4:
                group.append([])
            v = [int(x) for x in line.split()[1:11]]
            v += [-1] if len(v) < 6 else []
            v += [0] * (10 - len(v))
            group[3].append(tuple(v))
        elif line.startswith("CTRACE") and group is not None:
            m = re.match(r"CTRACE grid (\d+) cta (\d+) rows (\d+) t0 (\d+) \| (-?\d+) (-?\d+)((?: -?\d+)*)", line)
            head = tuple(map(int, m.groups()[:6]))
            group[1].append(head + (tuple(int(x) for x in m.group(7).split()),))
        elif line.startswith("decode ") and calls:
            # A result row ends a case: report its scheduled call --index.
            done = [c for c in calls[reported:] if c[2] == a.grid]
            reported = len(calls)
            if done:
                print(f"# {' '.join(line.split()[2:8])}: call {a.index} of {len(done)}")
                report(done[a.index])
    return 0


def report(call):
    decode, combine = call[0], call[1]
    base = min(t0 for _, _, _, t0, _ in decode)
    print("  cta items  entry " + " ".join(f"{n:>6}" for n in NAMES))
    for cta, begin, count, t0, stamps in decode:
        rel = [f"{(t0 - base + s) / 1000:6.1f}" if s >= 0 else "     -" for s in stamps]
        print(f"  {cta:3d} {begin:3d}/{count:<2d} {(t0 - base) / 1000:5.1f} " + " ".join(rel))
    if len(call) > 3:
        # Every CTA with work: when its first S, row sums and end came; the latest five in full.
        us = lambda t: (t - base) / 1000 if t else float("nan")
        busy = sorted((r for r in call[3] if r[2]), key=lambda r: r[4])
        if busy:
            ends = [us(r[4]) for r in busy]
            firsts = sorted(us(r[2]) for r in busy)
            print(f"  {len(busy)} CTAs with work: first S {firsts[0]:.1f} / {firsts[len(firsts) // 2]:.1f} / "
                  f"{firsts[-1]:.1f}, end {ends[0]:.1f} / {ends[len(ends) // 2]:.1f} / {ends[-1]:.1f} us "
                  f"(min / median / max)")
            # The call ends with its slowest CTA: from the mean end to the last is what a schedule
            # that moved work from slow CTAs to fast ones at run time could save at most.
            mean_end = sum(ends) / len(ends)
            print(f"  end spread: mean {mean_end:.1f} us, last - mean {ends[-1] - mean_end:.1f} us")
            for c, t0, s, sums, end, sm, work, item, g0, issued in busy[-5:]:
                where = f" sm {sm:3d}" if sm >= 0 else ""
                start = (f" work {us(work):.1f} item {us(item):.1f} g0 {us(g0):.1f} issued {us(issued):.1f}"
                         if work else "")
                print(f"    late cta {c:3d}{where}: entry {us(t0):.1f}{start} S {us(s):.1f} "
                      f"sums {us(sums):.1f} end {us(end):.1f}")
            if busy[0][6]:
                # Which link of the start the CTAs that ended last (a tenth) lose their time in:
                # the median of each link's length over them and over all CTAs with work.
                def links(rows):
                    cols = list(zip(*[(r[6] - r[1], r[7] - r[6], r[8] - r[7], r[9] - r[8], r[2] - r[9],
                                       r[4] - r[2]) for r in rows if r[7] and r[8] and r[9]]))
                    return [sorted(c)[len(c) // 2] / 1000 for c in cols] if cols else []
                names = ["entry-work", "work-item", "item-g0", "g0-issued", "issued-S", "S-end"]
                for label, rows in (("all", busy), ("latest tenth", busy[-max(1, len(busy) // 10):])):
                    m = links(rows)
                    if m:
                        print(f"  links, median of {label}: " + " ".join(f"{n} {x:.1f}" for n, x in zip(names, m)))
            if busy[0][5] >= 0:
                # The SMs of the CTAs that ended last (a tenth of them): whether the same group is
                # late from call to call.
                late = sorted(r[5] for r in busy[-max(1, len(busy) // 10):])
                print(f"  SMs of the latest {len(late)} CTAs: {' '.join(str(x) for x in late)}")
    for grid, cta, rows, t0, waited, end, job in combine:
        # The first job's stamps (newer builds): LSE, first step added, all steps, warps met, stored;
        # newest builds also the return of two probe loads right after the wait (the plan's header,
        # then the row's first LSE; they delay the job's stamps by their round trips).
        steps = " ".join(f"{n} {(t0 - base + s) / 1000:.1f}" if s >= 0 else f"{n} -"
                         for n, s in zip(["lse", "step1", "steps", "met", "stored", "probe-header", "probe-lse"], job))
        print(f"  combine cta {cta}/{grid} rows {rows}: entry {(t0 - base) / 1000:.1f} "
              f"waited {(t0 - base + waited) / 1000:.1f} {steps + ' ' if steps else ''}"
              f"end {(t0 - base + end) / 1000:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
