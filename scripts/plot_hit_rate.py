#!/usr/bin/env python3
"""Draws the Mooncake-trace hit rate per routing policy against per-worker capacity.

Input: the CSV that `mooncake_sim --sweep` prints (capacity,policy,hit_rate).
Output: a PNG. Needs matplotlib (`pip install matplotlib`); nothing else in the project does.

    target/release/examples/mooncake_sim --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --sweep 250,500,1000,2000,4000,8000,16000 > docs/img/mooncake-hit-rate.csv
    python3 scripts/plot_hit_rate.py docs/img/mooncake-hit-rate.csv docs/img/mooncake-hit-rate.png
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "kv-aware": dict(color="tab:blue", marker="o", linewidth=2.2),
    "pooled LRU": dict(color="black", linestyle="--", linewidth=1.2),
    "infinite cache": dict(color="gray", linestyle=":", linewidth=1.2),
    "kv-aware pure prefix": dict(color="tab:purple", marker="^"),
    "round-robin": dict(color="tab:orange", marker="s"),
    "random": dict(color="tab:red", marker="x"),
}


def main(src: str, dst: str) -> None:
    series = defaultdict(list)
    with open(src, newline="") as f:
        for row in csv.DictReader(f):
            series[row["policy"]].append((int(row["capacity"]), float(row["hit_rate"])))
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for policy, style in STYLE.items():
        points = sorted(series.get(policy, []))
        if points:
            ax.plot([c for c, _ in points], [h for _, h in points], label=policy, **style)
    ax.set_xscale("log", base=2)
    caps = sorted({c for points in series.values() for c, _ in points})
    ax.set_xticks(caps, [f"{c:,}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("blocks per worker (8 workers, 512-token blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_title("Mooncake conversation trace (12,031 requests) through kvrouter")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_hit_rate.py SWEEP.csv OUT.png")
    main(sys.argv[1], sys.argv[2])
