#!/usr/bin/env python3
"""Same-call A/B of mla-bench builds on decode cases.

Runs every build on every case, interleaved, for several rounds (so that a drift of the card's
clocks during the call hits every build alike), and prints for each case and kernel the best
median of each build and its ratio to the first build. Absolute times move between cards and
calls; only a comparison made in one call says what a change did (docs/perf-notes.md). Where the
rows carry the plan's time (scheduled kernels on a GPU), a `plan_decode` line compares it too.

  scripts/ab_decode.py --out DIR --build base=old/mla-bench --build new=build/tools/mla-bench \\
      --case "--heads 128 --batch 128 --kv-len 4096" --case "--heads 16 --batch 1 --kv-len 4096"

A build may carry environment assignments for its runs: "tag=path:NAME=VALUE,NAME=VALUE".
Exit status: 0 when every run finished and every row verified, 1 otherwise.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time


def parse_build(spec):
    tag, sep, rest = spec.partition("=")
    if not sep or not tag or not rest:
        raise argparse.ArgumentTypeError(f"--build expects tag=path[:NAME=VALUE,...], got {spec!r}")
    path, _, env = rest.partition(":")
    extra = {}
    for item in filter(None, env.split(",")):
        name, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"environment assignment {item!r} in {spec!r} has no '='")
        extra[name] = value
    return tag, path, extra


def record(best, case, kernel, tag, time_us, verified):
    """Keeps the best time of (case, kernel, tag) and whether all of its runs verified."""
    t, v = best.setdefault((case, kernel), {}).get(tag, (float("inf"), True))
    best[(case, kernel)][tag] = (min(t, time_us), v and verified)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the JSON and stderr of every run")
    ap.add_argument("--build", action="append", type=parse_build, required=True,
                    help="tag=path[:NAME=VALUE,...]; the first one is the base")
    ap.add_argument("--case", action="append", required=True, help="mla-bench case options, quoted")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a run may take")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no new run starts (the best of the runs done is "
                         "reported; a round cut short leaves some builds with a run fewer)")
    a = ap.parse_args()
    tags = [tag for tag, _, _ in a.build]
    if len(set(tags)) != len(tags):
        ap.error("--build tags must differ")
    os.makedirs(a.out, exist_ok=True)

    best = {}  # (case index, kernel) -> {tag: (time_us, verified)}
    failed = {}  # (case index, tag) -> runs that exited non-zero (crash, timeout, unverified row)
    done = {}  # (case index, tag) -> runs started (fewer than --rounds after the deadline)
    ok = True
    started = time.monotonic()
    runs = [(rnd, ci, case, build) for rnd in range(1, a.rounds + 1)
            for ci, case in enumerate(a.case) for build in a.build]
    for i, (rnd, ci, case, (tag, path, extra)) in enumerate(runs):
        if a.deadline is not None and time.monotonic() - started > a.deadline:
            print(f"deadline: {i} of {len(runs)} runs done", file=sys.stderr)
            break
        stem = os.path.join(a.out, f"case{ci}.{tag}.{rnd}")
        done[(ci, tag)] = done.get((ci, tag), 0) + 1
        cmd = [path, "--device", a.device, "--op", "decode", "--warmup", str(a.warmup),
               "--iters", str(a.iters), *shlex.split(case), "--json", stem + ".json"]
        env = dict(os.environ, **extra)
        if os.path.exists(stem + ".json"):
            os.remove(stem + ".json")  # never read a previous run's results
        try:
            with open(stem + ".err", "w") as err:
                rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as e:
            rc = e.strerror
        if rc != 0:
            # mla-bench exits 1 when a row fails verification but still writes its JSON:
            # those rows are read (and shown NOT VERIFIED); the run is counted as failed.
            print(f"run failed ({rc}): {' '.join(cmd)}", file=sys.stderr)
            ok = False
            failed[(ci, tag)] = failed.get((ci, tag), 0) + 1
        if not os.path.exists(stem + ".json"):
            continue
        with open(stem + ".json") as f:
            rows = json.load(f)["rows"]
        if not rows:
            # A kernel that stopped applying (e.g. `--rows hopper` on a build whose Hopper kernel
            # no longer runs the case) leaves no row: a failed run, not a missing column.
            print(f"run has no rows: {' '.join(cmd)}", file=sys.stderr)
            ok = False
            failed[(ci, tag)] = failed.get((ci, tag), 0) + 1
        for r in rows:
            if r.get("time_us") is None:
                ok = False
                continue
            verified = bool(r.get("verified"))
            ok = ok and verified
            record(best, ci, r["kernel"], tag, r["time_us"], verified)
            if r.get("plan_us") is not None:  # the plan's time, carried by every row
                # The deterministic rows carry their own schedule's plan.
                plan = ("plan_decode (deterministic)" if "deterministic-split" in r["kernel"]
                        else "plan_decode")
                record(best, ci, plan, tag, r["plan_us"], verified)
            if r.get("graph_us") is not None:  # the same call replayed from a CUDA graph
                record(best, ci, r["kernel"] + " (graph)", tag, r["graph_us"], verified)

    base = tags[0]
    for (ci, tag), n in sorted(failed.items()):
        print(f"{a.case[ci]:45s} {'FAILED RUNS':24s} | {tag} {n} of {done[(ci, tag)]}")
    for (ci, kernel), by_tag in sorted(best.items()):
        line = f"{a.case[ci]:45s} {kernel:24s}"
        ref = by_tag.get(base, (None, True))[0]
        for tag in tags:
            if tag not in by_tag:
                line += f" | {tag} -"
                continue
            t, verified = by_tag[tag]
            ratio = f" ({t / ref:.3f})" if ref and tag != base else ""
            line += f" | {tag} {t:9.1f}{ratio}{'' if verified else ' NOT VERIFIED'}"
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
