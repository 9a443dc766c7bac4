#!/usr/bin/env python3
"""Runs the router index bench (ours against dynamo-kv-router 1.6.1) at several index sizes and
draws the figures against size.

    cd router/bench-dynamo && cargo build --release
    python3 scripts/plot_index_scaling.py BENCH_BINARY docs/img/index-scaling.csv docs/img/index-scaling.png

BENCH_BINARY is the `index` binary that build makes (e.g. target/release/index of that
workspace). Writes the CSV (size,index,store,churn,p50_us,p99_us,bytes_per_block; the median of three runs
per size), then the PNG.
Needs matplotlib for the plot (`pip install matplotlib`); nothing else in the project does.
"""

import csv
import re
import subprocess
import sys

SIZES = [125_000, 250_000, 500_000, 1_000_000, 2_000_000, 4_000_000]
ROW = re.compile(r"^(kvrouter BlockIndex|dynamo-kv-router RadixTree)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(?:\s+[\d.]+)*$")


RUNS = 3


def measure(binary, out_csv):
    """Runs the bench RUNS times per size and keeps, per index and figure, the median."""
    rows = []
    for size in SIZES:
        runs = {"kvrouter": [], "dynamo": []}
        for _ in range(RUNS):
            text = subprocess.run([binary, "--bench", "--blocks", str(size)], check=True, capture_output=True,
                                  text=True).stdout
            for line in text.splitlines():
                m = ROW.match(line.strip())
                if m:
                    name = "kvrouter" if m.group(1).startswith("kvrouter") else "dynamo"
                    runs[name].append([float(m.group(i)) for i in range(2, 7)])
        for name, got in runs.items():
            medians = [sorted(col)[len(col) // 2] for col in zip(*got)]
            rows.append([size, name] + [f"{v:g}" for v in medians])
        print(size, "done", flush=True)
    with open(out_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["size", "index", "store", "churn", "p50_us", "p99_us", "bytes_per_block"])
        w.writerows(rows)


def plot(in_csv, out_png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {}
    with open(in_csv, newline="") as f:
        for r in csv.DictReader(f):
            data.setdefault(r["index"], []).append(r)
    panels = [("store", "build from empty (M blocks/s)", 1e-6), ("churn", "steady state: store + remove (M blocks/s)", 1e-6),
              ("p99_us", "lookup p99 (us), 256 workers", 1.0), ("bytes_per_block", "heap bytes per indexed block", 1.0)]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=110)
    for ax, (field, title, scale) in zip(axes.flat, panels):
        for name, style in [("kvrouter", dict(color="tab:blue", marker="o")), ("dynamo", dict(color="tab:red", marker="s"))]:
            rows = sorted(data.get(name, []), key=lambda r: int(r["size"]))
            ax.plot([int(r["size"]) for r in rows], [float(r[field]) * scale for r in rows],
                    label="kvrouter BlockIndex" if name == "kvrouter" else "dynamo-kv-router 1.6.1 RadixTree", **style)
        ax.set_xscale("log", base=2)
        sizes = sorted({int(r["size"]) for rows in data.values() for r in rows})
        ax.set_xticks(sizes, [f"{s / 1e6:g}M" for s in sizes])
        ax.minorticks_off()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("distinct blocks indexed")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Router index against Dynamo's, same events and queries, median of 3 runs per size (2-core VM)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out_png)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        measure(sys.argv[1], sys.argv[2])
        plot(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3:
        plot(sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage: plot_index_scaling.py [BENCH_BINARY] SCALING.csv OUT.png")
