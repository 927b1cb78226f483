#!/usr/bin/env python3
"""mla-bench --part K/N and bench/merge_results.py: the parts of a sweep together run every case
once, with the results of the whole run (same seeds), and merge into one file; bad --part and
--flush and --rows values, and runs of different cards or flushes, are rejected with a message. Also
--kv-min (requests of mixed lengths) and --q-dtype.

    python3 tests/tools/test_bench_parts.py MLA_BENCH MERGE_RESULTS_PY
"""

import json
import os
import subprocess
import sys
import tempfile


def run(cmd, expect_rc=0):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != expect_rc:
        sys.exit(f"FAIL: {cmd} exited {r.returncode}, expected {expect_rc}\n{r.stdout}\n{r.stderr}")
    return r


def main(bench, merge):
    common = ["--device", "cpu", "--sweep", "default", "--op", "decode", "--warmup", "0", "--iters", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        whole = os.path.join(tmp, "whole.json")
        run([bench, *common, "--json", whole])
        parts = []
        for k in (1, 2, 3):
            path = os.path.join(tmp, f"part{k}.json")
            run([bench, *common, "--part", f"{k}/3", "--json", path])
            parts.append(path)
        merged = os.path.join(tmp, "merged.json")
        run([sys.executable, merge, *parts, "--out", merged])

        w = json.load(open(whole))
        m = json.load(open(merged))
        key = lambda r: (r["kernel"], r["heads"], r["batch"], r["kv_len"], r["q_len"], r["page_size"], r["kv_dtype"])
        assert [key(r) for r in m["rows"]] == [key(r) for r in w["rows"]], "parts must cover the sweep once, in order"
        # Same seeds as the whole run: the same inputs, so the same outputs and errors.
        assert [r["max_rel_err"] for r in m["rows"]] == [r["max_rel_err"] for r in w["rows"]]
        assert [r["part"] for r in m["runs"]] == ["1/3", "2/3", "3/3"], m["runs"]
        assert sorted({r["run"] for r in m["rows"]}) == [0, 1, 2]
        assert all(json.load(open(p))["part"] == f"{k}/3" for k, p in enumerate(parts, 1))
        assert "part" not in w

        # Bad --part values: usage errors (exit 2) that say what was expected.
        for bad, message in (("4/3", "--part K expects an integer in [1, 3], got '4'"),
                             ("0/3", "--part K expects an integer in [1, 3], got '0'"),
                             ("3", "--part expects K/N, got '3'"),
                             ("1/0", "--part N expects an integer in [1, 1000000], got '0'"),
                             ("2/9", "--part 2/9 selects none of the 4 cases")):
            r = run([bench, *common, "--part", bad], expect_rc=2)
            assert message in r.stderr, f"--part {bad}: {r.stderr!r}"

        r = run([bench, *common, "--flush", "both"], expect_rc=2)
        assert "--flush expects write, read or none, got 'both'" in r.stderr, r.stderr
        for bad in ("hopper,fast", "", "hopper,", ",naive"):
            r = run([bench, *common, "--rows", bad], expect_rc=2)
            assert f"--rows expects a comma-separated list of portable, hopper, unsplit, deterministic and naive, got '{bad}'" in r.stderr, r.stderr
        run([bench, *common, "--rows", "hopper,unsplit,naive"])  # valid (the CPU runner has one row)
        for bad, message in (("100", "--split-keys expects a multiple of 64, got '100'"),
                             ("-64", "--split-keys expects an integer in [0, 2147483647], got '-64'")):
            r = run([bench, *common, "--split-keys", bad], expect_rc=2)
            assert message in r.stderr, f"--split-keys {bad}: {r.stderr!r}"
        r = run([bench, *common, "--split-keys", "1024"], expect_rc=2)
        assert "--split-keys times the deterministic rows: give --deterministic on" in r.stderr, r.stderr
        run([bench, *common, "--split-keys", "1024", "--deterministic", "on"])  # valid (rows: cuda only)

        # Mixed lengths (--kv-min): the case runs and verifies, its row names the range; a range
        # that ends below its start is a usage error.
        single = ["--device", "cpu", "--op", "decode", "--warmup", "0", "--iters", "1", "--batch", "5",
                  "--kv-len", "200"]
        mixed = os.path.join(tmp, "mixed.json")
        run([bench, *single, "--kv-min", "1", "--json", mixed])
        rows = json.load(open(mixed))["rows"]
        assert rows and all(r["kv_min"] == 1 and r["kv_len"] == 200 and r["verified"] for r in rows), rows
        assert all("kv_min" not in r for r in w["rows"]), "equal lengths: no kv_min"
        r = run([bench, *single, "--kv-min", "201"], expect_rc=2)
        assert "--kv-min 201 is past --kv-len 200" in r.stderr, r.stderr

        # --q-dtype: an fp8 cache with a 16-bit query verifies and is named in both outputs; a
        # dtype that is none is a usage error naming the option.
        typed = os.path.join(tmp, "typed.json")
        r = run([bench, *single, "--kv-dtype", "fp8", "--q-dtype", "bf16", "--json", typed])
        rows = json.load(open(typed))["rows"]
        assert rows and all(r["q_dtype"] == "bf16" and r["kv_dtype"] == "fp8e4m3" and r["verified"] for r in rows), rows
        assert "fp8e4m3/bf16" in r.stdout, r.stdout
        assert all("q_dtype" not in r for r in w["rows"]), "no --q-dtype: no q_dtype"
        r = run([bench, *single, "--q-dtype", "fp4"], expect_rc=2)
        assert "--q-dtype expects bf16, fp16 or fp8, got 'fp4'" in r.stderr, r.stderr

        # Runs of different cards, or timed after different L2 flushes, are not merged.
        for key, value, message in (("card", "another card", "card 'another card' differs"),
                                    ("flush", "read", "flush 'read' differs")):
            other = os.path.join(tmp, "other.json")
            data = json.load(open(parts[1]))
            data[key] = value
            json.dump(data, open(other, "w"))
            r = run([sys.executable, merge, parts[0], other, "--out", os.path.join(tmp, "x.json")], expect_rc=1)
            assert message in r.stderr, r.stderr
    print("bench parts: ok")


if __name__ == "__main__":
    main(*sys.argv[1:3])
