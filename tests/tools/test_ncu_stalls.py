#!/usr/bin/env python3
"""scripts/ncu_stalls.py on a small source page of two kernels: the stall totals by reason, the
top instructions in order of samples, what each waits on (a try-wait's barrier by offset or by
its --label name, a register-addressed barrier, wgmma completion, a named barrier), and the
errors for a file that is not a source page and for a bad --label.

    python3 tests/tools/test_ncu_stalls.py SCRIPTS/ncu_stalls.py
"""

import csv
import os
import subprocess
import sys
import tempfile

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_barrier", "stall_wait", "stall_long_sb (Not Issued)"]


def row(addr, source, samples, executed, long_sb, barrier, wait):
    return [addr, source, str(samples), "0", str(executed), str(long_sb), str(barrier), str(wait), "999"]


def run(script, args, expect_rc=0):
    r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if r.returncode != expect_rc:
        sys.exit(f"FAIL: ncu_stalls.py {args} exited {r.returncode}, expected {expect_rc}\n{r.stdout}\n{r.stderr}")
    return r


def expect(cond, what, out):
    if not cond:
        sys.exit(f"FAIL: {what}\n--- output ---\n{out}")


def main(script):
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "page.csv")
        with open(page, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["Kernel Name", "first_kernel"])
            w.writerow(HEADER)
            w.writerow(row("0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR32+0x36808], R8", 1, 10, 1, 0, 0))
            w.writerow(row("0x20", "UMOV UR21, 0x40000040", 2, 10, 0, 0, 2))
            w.writerow(row("0x30", "@!P1  BRA 0x7f00", 300, 10, 300, 0, 0))
            w.writerow(row("0x40", "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R12+URZ], R3", 0, 10, 0, 0, 0))
            w.writerow(row("0x50", "@!P2  BRA 0x7f40", 200, 10, 200, 0, 0))
            w.writerow(row("0x60", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 100, 10, 0, 100, 0))
            w.writerow(row("0x70", "BAR.SYNC.DEFER_BLOCKING 0x2, 0x80", 50, 10, 0, 50, 0))
            w.writerow(row("0x80", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR30+0x36818], R8", 0, 10, 0, 0, 0))
            w.writerow(row("0x90", "@!P0  BRA 0x7f80", 40, 10, 40, 0, 0))
            w.writerow(["Kernel Name", "second_kernel"])
            w.writerow(HEADER)
            w.writerow(row("0x10", "FFMA R1, R2, R3, R4", 7, 10, 0, 0, 7))
        out = run(script, ["--top", "4", "--label", "0x36808=full0R", page]).stdout
        expect("== first_kernel" in out and "== second_kernel" in out, "both kernels reported", out)
        expect("warp stall samples 693;" in out, "first kernel's total (300+200+100+50+40+1+2)", out)
        expect("stall_long_sb                 541" in out, "long_sb total", out)
        lines = [l for l in out.splitlines() if l.startswith("  ") and ("BRA" in l or "DEPBAR" in l or "BAR.SYNC" in l)]
        expect(lines and lines[0].split()[0] == "300" and lines[0].endswith("full0R"), "the labelled barrier first", out)
        expect(any(l.split()[0] == "200" and l.endswith("mbarrier (register address)") for l in lines),
               "the register-addressed barrier", out)
        expect(any("DEPBAR" in l and l.endswith("wgmma completion") for l in lines), "wgmma completion", out)
        expect(any("BAR.SYNC" in l and l.endswith("named barrier 0x2") for l in lines), "the named barrier", out)
        expect("mbarrier +0x36818" not in out, "--top 4 leaves the fifth instruction out", out)
        out = run(script, ["--top", "9", page]).stdout
        expect("mbarrier +0x36818" in out and "mbarrier +0x36808" in out, "unlabelled offsets", out)
        expect("warp stall samples 7;" in out, "second kernel's total", out)

        other = os.path.join(tmp, "other.csv")
        with open(other, "w") as f:
            f.write("a,b\n1,2\n")
        err = run(script, [other], expect_rc=1).stderr
        expect("no 'Kernel Name' block" in err, "a file that is not a source page", err)
        err = run(script, ["--label", "full0R", page], expect_rc=2).stderr
        expect("--label expects OFFSET=NAME" in err, "a bad --label", err)
    print("ncu_stalls.py: ok")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
