#!/usr/bin/env python3
"""The loops of a CUDA object's kernels in SASS, and the instruction mix of each.

Disassembles an object or cubin with cuobjdump (from the pinned PyPI package in
scripts/requirements-sass.txt; no GPU needed) and prints, for every kernel whose mangled name
contains --kernel, each loop (a backward branch) of at least --min instructions: its address
range, its length and its most frequent opcodes. The Hopper decode kernel's pair loops (WG1's
and WG2's) are its two loops of ~1,200 instructions; their mix says what a pair issues besides
the wgmma (docs/decode-kernel.md).

  python -m venv /tmp/sass && /tmp/sass/bin/pip install -r scripts/requirements-sass.txt
  scripts/sass_loops.py --cuobjdump /tmp/sass/lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump \\
      build/CMakeFiles/mla.dir/src/cuda/decode/decode_hopper.cu.o --kernel bfloat16Lb0ELb0E
"""
import argparse
import collections
import glob
import re
import subprocess
import sys

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"^\s+Function : (\S+)")
TARGET = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+.*?(0x[0-9a-f]+)\s*$")


def kernels(sass_text):
    """{mangled name: [(address, instruction text)]} in the order cuobjdump prints them."""
    out, current = {}, None
    for line in sass_text.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text):
    """The opcode without its predicate and modifiers: '@!P0 FMUL.FTZ R1, ...' -> 'FMUL'."""
    if text.startswith("@"):
        text = text.split(None, 1)[1]
    return text.split()[0].split(".")[0]


def loops(instructions, min_len):
    """(first, last, length) of every backward branch's range of at least min_len instructions.
    The retry paths of mbarrier waits, laid out after the kernel's last EXIT and branching back
    into it, are not loops and are left out."""
    exits = [a for a, t in instructions if opcode(t) == "EXIT"]
    tail = exits[-1] if exits else instructions[-1][0]
    found = []
    for address, text in instructions:
        m = TARGET.search(text)
        if m and int(m.group(1), 16) <= address and address < tail:
            first = int(m.group(1), 16)
            length = sum(1 for a, _ in instructions if first <= a <= address)
            if length >= min_len:
                found.append((first, address, length))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("object", help="a .o, .cubin or executable with sm_90a code")
    ap.add_argument("--kernel", default="", help="part of the mangled names to show (default: all)")
    ap.add_argument("--min", type=int, default=200, help="shortest loop shown, in instructions")
    ap.add_argument("--top", type=int, default=14, help="opcodes listed per loop")
    ap.add_argument("--cuobjdump", default="cuobjdump", help="the cuobjdump to run (a glob is expanded)")
    args = ap.parse_args()
    tool = sorted(glob.glob(args.cuobjdump)) or [args.cuobjdump]
    try:
        sass = subprocess.run([tool[-1], "-sass", args.object], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"sass_loops: cuobjdump failed on {args.object}: {e}")
    shown = 0
    for name, instructions in kernels(sass).items():
        if args.kernel not in name:
            continue
        shown += 1
        print(f"{name}: {len(instructions)} instructions")
        for first, last, length in loops(instructions, args.min):
            mix = collections.Counter(opcode(t) for a, t in instructions if first <= a <= last)
            top = ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top))
            print(f"  loop {first:#07x}-{last:#07x}: {length} instructions; {top}")
    if not shown:
        sys.exit(f"sass_loops: no kernel of {args.object} matches {args.kernel!r}")


if __name__ == "__main__":
    main()
