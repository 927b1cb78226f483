#!/usr/bin/env python3
"""Where a kernel's warps wait, from ncu's source page (warp stall sampling by instruction).

Reads what `ncu --import REPORT --page source --csv --print-source sass` prints for a report
taken with `--section SourceCounters` (scripts/device_run.sh does both with NCU_SOURCE=1) and
prints, for each kernel in it, its stall samples by reason and its top instructions by samples,
each with its main reason and what it waits on:

  - a branch right after an mbarrier try-wait (`SYNCS.PHASECHK.TRANS64.TRYWAIT`, the retry test of
    mbar_wait): the barrier, as its shared-memory offset (`mbarrier +0x36800`), or the name that
    --label gives that offset. For the Hopper decode kernel the offsets follow SmemLayout in
    src/cuda/decode/decode_hopper.cu from its aligned base (full barriers, then empty ones, then
    the exchanges; a register address with no offset is the producer's empty barrier);
  - `WARPGROUP.DEPBAR`: wgmma completion;
  - `BAR.SYNC`: a named barrier.

    scripts/ncu_stalls.py [--top N] [--label 0x36800=full0L ...] SOURCE.csv [...]
"""

import argparse
import csv
import re
import sys
from collections import Counter

TRYWAIT = re.compile(r"TRYWAIT\s+P\d+,\s*\[([^\]]*)\]")
OFFSET = re.compile(r"\+0x([0-9a-fA-F]+)$")
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text):
    try:
        return float(text)
    except ValueError:
        return 0.0


def kernels(rows):
    """(name, header, instruction rows) for each "Kernel Name" block of the source page."""
    blocks = []
    i = 0
    while i < len(rows):
        row = rows[i]
        if row and row[0] == "Kernel Name":
            name = row[1] if len(row) > 1 else "?"
            header = rows[i + 1] if i + 1 < len(rows) else []
            body = []
            i += 2
            while i < len(rows) and not (rows[i] and rows[i][0] == "Kernel Name"):
                if len(rows[i]) == len(header):
                    body.append(rows[i])
                i += 1
            blocks.append((name, header, body))
        else:
            i += 1
    return blocks


def waits_on(body, i, source, labels):
    text = body[i][source]
    if "WARPGROUP.DEPBAR" in text:
        return "wgmma completion"
    m = re.search(r"BAR\.SYNC\S*\s+(0x[0-9a-fA-F]+|\d+)", text)
    if m:
        return "named barrier " + m.group(1)
    if "BRA" not in text:
        return ""
    for j in range(i - 1, max(-1, i - 13), -1):
        m = TRYWAIT.search(body[j][source])
        if m:
            off = OFFSET.search(m.group(1).replace(" ", ""))
            if off is None:
                return "mbarrier (register address)"
            key = int(off.group(1), 16)
            return labels.get(key, f"mbarrier +0x{key:x}")
    return ""


def report(name, header, body, top, labels, out):
    col = {h: k for k, h in enumerate(header)}
    for needed in ("Source", SAMPLES):
        if needed not in col:
            out.write(f"== {name}: no '{needed}' column (was the report taken with --section SourceCounters?)\n\n")
            return
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    totals = Counter()
    for row in body:
        for r in reasons:
            totals[r] += number(row[col[r]])
    total = sum(totals.values())
    out.write(f"== {name}\nwarp stall samples {total:.0f}; by reason:\n")
    for r, v in totals.most_common(8):
        out.write(f"  {r:24s} {v:8.0f} {100.0 * v / max(total, 1.0):5.1f}%\n")
    out.write("top instructions (samples, warp-level executions, main reason, what it waits on):\n")
    order = sorted(range(len(body)), key=lambda k: -number(body[k][col[SAMPLES]]))[:top]
    for k in order:
        row = body[k]
        main = max(reasons, key=lambda r: number(row[col[r]])) if reasons else ""
        executed = row[col[EXECUTED]] if EXECUTED in col else "-"
        out.write(f"  {number(row[col[SAMPLES]]):7.0f} {executed:>9s}  {row[col['Source']].strip()[:48]:48s} "
                  f"{main[len('stall_'):]:14s} {waits_on(body, k, col['Source'], labels)}\n")
    out.write("\n")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="ncu source-page CSV files")
    ap.add_argument("--top", type=int, default=16, help="instructions listed a kernel")
    ap.add_argument("--label", action="append", default=[],
                    help="OFFSET=NAME: call the mbarrier at that shared-memory offset NAME")
    args = ap.parse_args(argv)
    labels = {}
    for item in args.label:
        off, sep, label = item.partition("=")
        try:
            labels[int(off, 0)] = label
        except ValueError:
            ap.error(f"--label expects OFFSET=NAME with a number for OFFSET, got '{item}'")
        if not sep or not label:
            ap.error(f"--label expects OFFSET=NAME, got '{item}'")
    found = 0
    for path in args.files:
        with open(path, newline="") as f:
            blocks = kernels(list(csv.reader(f)))
        if not blocks:
            print(f"{path}: no 'Kernel Name' block (not ncu's --page source --csv output?)", file=sys.stderr)
        for name, header, body in blocks:
            report(name, header, body, args.top, labels, sys.stdout)
            found += 1
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
