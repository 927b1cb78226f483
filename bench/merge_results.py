#!/usr/bin/env python3
"""Merges the JSON files of several mla-bench runs on one card into one results file.

    python3 bench/merge_results.py decode_1.json decode_2.json prefill.json --out bench/results/h200.json

A long sweep runs in parts (`mla-bench --sweep decode --part K/N`), and the prefill sweep runs on
its own; each run measures its own ceilings and computes its rows' fractions against them. The
merged file keeps that: `runs` lists every run (sweep, part, ceilings), each row gets `run` (its
index in `runs`), and the top-level `ceilings` are those of the first run. The runs must share the
card and the commit; rows are kept in the order given. A part given twice is an error; parts of
a sweep that are not given are listed in `parts_missing` (and said on stderr), so that a merged
file of a partial sweep says so itself.
"""

import argparse
import json
import sys


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="mla-bench --json files")
    parser.add_argument("--out", required=True, help="merged JSON file to write")
    parser.add_argument("--note", default=None, help="free text stored as `note`")
    args = parser.parse_args(argv)

    runs, rows, first = [], [], None
    for path in args.inputs:
        with open(path) as f:
            data = json.load(f)
        if first is None:
            first = data
        # One card, one build, one way of timing (the L2 flush of CUDA runs: write, read or none).
        for key in ("card", "commit", "device", "flush"):
            if data.get(key) != first.get(key):
                sys.exit(f"merge_results: {path}: {key} {data.get(key)!r} differs from "
                         f"{first.get(key)!r} of {args.inputs[0]}")
        run = {"file": path.split("/")[-1], "sweep": data.get("sweep"), "part": data.get("part"),
               "warmup": data.get("warmup"), "iters": data.get("iters"),
               "ceilings": data.get("ceilings"), "rows": len(data.get("rows", []))}
        for row in data.get("rows", []):
            rows.append(dict(row, run=len(runs)))
        runs.append(run)

    # Parts of each sweep: none twice, the missing ones named.
    seen, count = {}, {}  # (sweep, part) -> file; sweep -> parts in all
    for r in runs:
        if not r["part"]:
            continue
        k, n = (int(x) for x in r["part"].split("/"))
        if (r["sweep"], k) in seen:
            sys.exit(f"merge_results: part {r['part']} of sweep {r['sweep']} is given twice "
                     f"({seen[(r['sweep'], k)]} and {r['file']})")
        seen[(r["sweep"], k)] = r["file"]
        count[r["sweep"]] = n
    parts_missing = {}
    for sweep, n in count.items():
        missing = sorted(set(range(1, n + 1)) - {k for (s, k) in seen if s == sweep})
        if missing:
            parts_missing[sweep] = missing
    for sweep, parts in parts_missing.items():
        print(f"merge_results: sweep {sweep} lacks parts {parts}", file=sys.stderr)

    merged = {
        "card": first["card"], "driver": first.get("driver"), "commit": first["commit"],
        "device": first.get("device"),
        "sweeps": sorted({r["sweep"] for r in runs if r["sweep"]}),
        "warmup": first.get("warmup"), "iters": first.get("iters"),
        "ceilings": first.get("ceilings"),
        "runs": runs,
    }
    if first.get("flush"):
        merged["flush"] = first["flush"]
    if parts_missing:
        merged["parts_missing"] = parts_missing
    if args.note:
        merged["note"] = args.note
    merged["rows"] = rows
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    print(f"merge_results: {len(rows)} rows from {len(runs)} runs -> {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
