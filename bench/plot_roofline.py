#!/usr/bin/env python3
"""Roofline plots of mla-bench results, as hand-written SVG (no dependencies).

    python3 bench/plot_roofline.py                      # every bench/results/*.json
    python3 bench/plot_roofline.py a.json b.json --out-dir /tmp/plots

For each JSON file written by `mla-bench --json`, writes <name>.roofline.svg beside it (or in
--out-dir): achieved TFLOP/s against arithmetic intensity (FLOP per byte moved, as mla-bench
counts them), both on log scales, under the roofs measured in the same run: the cuBLAS bf16 GEMM
ceiling (flat) and the device-copy bandwidth (slanted). Colour = kernel, marker = op (circle:
decode, square: prefill), hollow markers = fp8 inputs, and each point carries a tooltip with its
case. Rows that failed or did not verify are left out and counted in the subtitle.
"""

import argparse
import glob
import html
import json
import math
import os
import sys

WIDTH, HEIGHT = 900, 600
LEFT, RIGHT, TOP, BOTTOM = 80, 220, 60, 60  # plot margins; the legend sits on the right
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def decades(lo, hi):
    """Powers of ten covering [lo, hi]."""
    return list(range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1))


def fmt_tick(exp):
    value = 10.0 ** exp
    return f"{value:g}" if -3 <= exp <= 4 else f"1e{exp}"


class LogAxes:
    def __init__(self, x_range, y_range):
        self.x0, self.x1 = [math.log10(v) for v in x_range]
        self.y0, self.y1 = [math.log10(v) for v in y_range]

    def px(self, x):
        return LEFT + (math.log10(x) - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def py(self, y):
        return HEIGHT - BOTTOM - (math.log10(y) - self.y0) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)


def point_label(row):
    if row["op"] == "decode":
        case = (f"decode b={row['batch']} h={row['heads']} kv={row['kv_len']} q={row['q_len']} "
                f"page={row['page_size']} {row['kv_dtype']}")
    else:
        case = f"prefill tokens={row.get('tokens')} b={row['batch']} h={row['heads']} {row['kv_dtype']}"
    extra = f", {row['speedup_vs_naive']:.2f}x naive" if row.get("speedup_vs_naive") else ""
    return (f"{row['kernel']}: {case}: {row['time_us']:.1f} us, {row['tflops']:.3g} TFLOP/s, "
            f"{row['gbps']:.4g} GB/s{extra}")


def plot(report, title):
    rows = [r for r in report.get("rows", [])
            if r.get("verified") and not r.get("error") and r.get("tflops") and r.get("gbps")]
    skipped = len(report.get("rows", [])) - len(rows)
    ceilings = report.get("ceilings") or {}
    gemm, copy = ceilings.get("gemm_tflops"), ceilings.get("copy_gbps")

    # Arithmetic intensity in FLOP/byte; TFLOP/s = GB/s * intensity / 1000.
    points = [(r["tflops"] * 1e3 / r["gbps"], r["tflops"], r) for r in rows]
    xs = [p[0] for p in points] or [1.0]
    ys = [p[1] for p in points] or [1.0]
    x_lo, x_hi = min(xs) / 2, max(xs) * 2
    y_lo, y_hi = min(ys) / 2, max(ys) * 2
    if gemm and copy:
        ridge = gemm * 1e3 / copy  # intensity where the two roofs meet
        x_lo, x_hi = min(x_lo, ridge / 10), max(x_hi, ridge * 4)
        y_hi = max(y_hi, gemm * 1.5)
        y_lo = min(y_lo, copy * x_lo / 1e3)
    x_lo, x_hi = 10.0 ** math.floor(math.log10(x_lo)), 10.0 ** math.ceil(math.log10(x_hi))
    y_lo, y_hi = 10.0 ** math.floor(math.log10(y_lo)), 10.0 ** math.ceil(math.log10(y_hi))
    ax = LogAxes((x_lo, x_hi), (y_lo, y_hi))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    esc = html.escape
    out.append(f'<text x="{LEFT}" y="24" font-size="16" font-weight="bold">{esc(title)}</text>')
    subtitle = f"{report.get('card', '?')}; {report.get('driver') or 'no driver'}; commit {report.get('commit', '?')}"
    if skipped:
        subtitle += f"; {skipped} failed row(s) not shown"
    out.append(f'<text x="{LEFT}" y="42" fill="#555">{esc(subtitle)}</text>')

    # Grid and ticks.
    plot_left, plot_right = LEFT, WIDTH - RIGHT
    plot_top, plot_bottom = TOP, HEIGHT - BOTTOM
    for e in decades(x_lo, x_hi):
        x = ax.px(10.0 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{plot_top}" x2="{x:.1f}" y2="{plot_bottom}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{plot_bottom + 16}" text-anchor="middle">{fmt_tick(e)}</text>')
    for e in decades(y_lo, y_hi):
        y = ax.py(10.0 ** e)
        out.append(f'<line x1="{plot_left}" y1="{y:.1f}" x2="{plot_right}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{plot_left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_tick(e)}</text>')
    out.append(f'<rect x="{plot_left}" y="{plot_top}" width="{plot_right - plot_left}" '
               f'height="{plot_bottom - plot_top}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{(plot_left + plot_right) / 2}" y="{HEIGHT - 18}" text-anchor="middle">'
               f'arithmetic intensity (FLOP / byte)</text>')
    out.append(f'<text transform="translate(22 {(plot_top + plot_bottom) / 2}) rotate(-90)" '
               f'text-anchor="middle">achieved TFLOP/s</text>')

    # Roofs, clipped to the plot area.
    out.append(f'<clipPath id="plot"><rect x="{plot_left}" y="{plot_top}" '
               f'width="{plot_right - plot_left}" height="{plot_bottom - plot_top}"/></clipPath>')
    if gemm and copy:
        ridge = gemm * 1e3 / copy
        roof = [(x_lo, copy * x_lo / 1e3), (ridge, gemm), (x_hi, gemm)]
        path = " ".join(f"{ax.px(x):.1f},{ax.py(y):.1f}" for x, y in roof)
        out.append(f'<polyline points="{path}" fill="none" stroke="#000" stroke-width="2" clip-path="url(#plot)"/>')
        out.append(f'<text x="{ax.px(ridge) + 8:.1f}" y="{ax.py(gemm) - 6:.1f}">'
                   f'cuBLAS bf16 GEMM {gemm:.0f} TFLOP/s</text>')
        # The bandwidth label runs along the slanted roof, just above it.
        label_x = max(x_lo * 1.5, ridge / 20)
        lx, ly = ax.px(label_x), ax.py(copy * label_x / 1e3)
        angle = math.degrees(math.atan2(ax.py(gemm) - ax.py(copy * x_lo / 1e3), ax.px(ridge) - ax.px(x_lo)))
        out.append(f'<text transform="translate({lx:.1f} {ly - 6:.1f}) rotate({angle:.1f})">'
                   f'device copy {copy:.0f} GB/s</text>')

    # Points.
    kernels = sorted({p[2]["kernel"] for p in points})
    colour = {k: COLOURS[i % len(COLOURS)] for i, k in enumerate(kernels)}
    for x, y, r in points:
        cx, cy = ax.px(x), ax.py(y)
        c = colour[r["kernel"]]
        fill = "none" if r["kv_dtype"].startswith("fp8") else c
        tip = f"<title>{esc(point_label(r))}</title>"
        if r["op"] == "decode":
            out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{fill}" stroke="{c}" '
                       f'stroke-width="1.5" fill-opacity="0.8">{tip}</circle>')
        else:
            out.append(f'<rect x="{cx - 5:.1f}" y="{cy - 5:.1f}" width="10" height="10" fill="{fill}" '
                       f'stroke="{c}" stroke-width="1.5" fill-opacity="0.8">{tip}</rect>')

    # Legend.
    lx, ly = WIDTH - RIGHT + 20, TOP + 10
    for i, k in enumerate(kernels):
        y = ly + 20 * i
        out.append(f'<circle cx="{lx}" cy="{y}" r="5" fill="{colour[k]}"/>')
        out.append(f'<text x="{lx + 12}" y="{y + 4}">{esc(k)}</text>')
    y = ly + 20 * len(kernels) + 10
    out.append(f'<circle cx="{lx}" cy="{y}" r="5" fill="#777"/><text x="{lx + 12}" y="{y + 4}">decode</text>')
    out.append(f'<rect x="{lx - 5}" y="{y + 15}" width="10" height="10" fill="#777"/>'
               f'<text x="{lx + 12}" y="{y + 24}">prefill</text>')
    out.append(f'<circle cx="{lx}" cy="{y + 40}" r="5" fill="none" stroke="#777" stroke-width="1.5"/>'
               f'<text x="{lx + 12}" y="{y + 44}">fp8 inputs (hollow)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n", len(points)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="mla-bench JSON files (default: bench/results/*.json)")
    parser.add_argument("--out-dir", help="where to write the SVGs (default: beside each JSON file)")
    args = parser.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                        "results", "*.json")))
    if not files:
        print("plot_roofline: no JSON files given and none in bench/results/", file=sys.stderr)
        return 1
    for path in files:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        base = os.path.splitext(os.path.basename(path))[0]
        sweep = report.get("sweep") or "+".join(report.get("sweeps", [])) or "?"
        if report.get("runs"):  # a merged file: its first run's roofs (each row's fractions are its own run's)
            sweep += f", {len(report['runs'])} runs, roofs of the first"
        title = f"mla-bench roofline: {base} ({report.get('device', '?')}, sweep {sweep})"
        svg, count = plot(report, title)
        out_dir = args.out_dir or os.path.dirname(os.path.abspath(path))
        os.makedirs(out_dir, exist_ok=True)
        out_path = os.path.join(out_dir, base + ".roofline.svg")
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(svg)
        print(f"{out_path}: {count} point(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
