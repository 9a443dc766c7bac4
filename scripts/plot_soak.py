#!/usr/bin/env python3
"""Draws what `kvbench soak` sampled (scripts/soak runs both) as one PNG of six panels over the
run's time: RSS of kvcached and kvrouter, open descriptors, threads and mappings, shared memory,
latency p50/p99 per operation per interval, and the tiers' fill with the request rate. The dashed
lines are the least-squares fits over the second half of the run that the soak's bounds judge.

    ~/.cache/kvcached/venv-plot/bin/python scripts/plot_soak.py SAMPLES.csv SOAK.json OUT.png

Needs matplotlib (scripts/lib.sh: `venv venv-plot matplotlib==3.9.4`).
"""

import csv
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def fit(ts, ys):
    """Least-squares line through the points of the second half: (xs, ys) to draw."""
    half = ts[-1] / 2
    pts = [(t, y) for t, y in zip(ts, ys) if t >= half]
    if len(pts) < 2:
        return [], []
    n = len(pts)
    mx = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((t - mx) ** 2 for t, _ in pts)
    b = sum((t - mx) * (y - my) for t, y in pts) / sxx if sxx else 0.0
    xs = [pts[0][0], pts[-1][0]]
    return [x / 60 for x in xs], [my + b * (x - mx) for x in xs]


def series(ax, rows, ts, name, label, color, fitted=True):
    ys = [float(r[name]) for r in rows]
    ax.plot([t / 60 for t in ts], ys, color=color, linewidth=1.3, label=label)
    if fitted:
        fx, fy = fit(ts, ys)
        if fx:
            ax.plot(fx, fy, color=color, linestyle="--", linewidth=1.6)


def ceiling(rows, name, headroom):
    """The top of an axis that shows `name` with this much room above its largest value."""
    return max(float(r[name]) for r in rows) * headroom


def right_axis(ax, rows, ts, name, label, color, ylabel, headroom, fitted=True):
    """`name` on a second axis, at the panel's right; returns that axis."""
    ax2 = ax.twinx()
    series(ax2, rows, ts, name, label, color, fitted=fitted)
    ax2.set_ylabel(ylabel)
    ax2.set_ylim(0, ceiling(rows, name, headroom))
    return ax2


def legend_of_both(ax, ax2, title):
    """One legend for a panel's two axes, and the panel's title."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower right")
    ax.set_title(title)


def main():
    samples, report, dst = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(samples) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit("no samples")
    try:
        with open(report) as f:
            rep = json.load(f)
    except (OSError, ValueError):
        rep = {}
    ts = [float(r["t_s"]) for r in rows]
    fig, axs = plt.subplots(2, 3, figsize=(15, 8), dpi=110)

    ax = axs[0][0]
    series(ax, rows, ts, "daemon_rss_mib", "kvcached RSS", "tab:blue")
    series(ax, rows, ts, "daemon_anon_mib", "kvcached anonymous (heap)", "tab:cyan")
    series(ax, rows, ts, "daemon_shmem_mib", "kvcached shared (G2 pool, engines' KV)", "tab:purple")
    series(ax, rows, ts, "router_rss_mib", "kvrouter RSS", "tab:orange")
    ax.set_ylabel("MiB")
    ax.set_title("Resident memory")
    ax.set_ylim(bottom=0)

    ax = axs[0][1]
    for r in rows:
        r["daemon_fds_other"] = float(r["daemon_fds"]) - float(r["daemon_index_fds"])
    series(ax, rows, ts, "daemon_fds", "kvcached, all", "tab:cyan", fitted=False)
    series(ax, rows, ts, "daemon_fds_other", "kvcached, without G3 index (RocksDB) files", "tab:blue")
    series(ax, rows, ts, "daemon_index_fds", "kvcached, G3 index (RocksDB) files", "tab:green", fitted=False)
    series(ax, rows, ts, "router_fds", "kvrouter", "tab:orange")
    series(ax, rows, ts, "connections", "kvcached connections", "tab:gray", fitted=False)
    ax.set_ylabel("open file descriptors")
    ax.set_title("Descriptors")
    ax.set_ylim(bottom=0)

    ax = axs[0][2]
    series(ax, rows, ts, "daemon_threads", "kvcached threads", "tab:blue")
    series(ax, rows, ts, "router_threads", "kvrouter threads", "tab:orange")
    ax.set_ylabel("threads")
    ax.set_ylim(0, ceiling(rows, "daemon_threads", 1.8))
    ax2 = right_axis(ax, rows, ts, "daemon_maps", "kvcached mappings (right)", "tab:green", "memory mappings", 1.15)
    legend_of_both(ax, ax2, "Threads and mappings")

    ax = axs[1][0]
    series(ax, rows, ts, "shm_dir_mib", "the run's /dev/shm directory (G2 pool, engines' KV files)", "tab:purple")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, ceiling(rows, "shm_dir_mib", 1.5))
    ax2 = right_axis(
        ax, rows, ts, "dev_shm_used_mib", "/dev/shm used, whole machine (right)", "tab:gray",
        "MiB (other processes too)", 1.25, fitted=False,
    )
    legend_of_both(ax, ax2, "Shared memory")

    ax = axs[1][1]
    for op, color in [("lookup", "tab:blue"), ("load", "tab:green"), ("save", "tab:red"), ("route", "tab:gray")]:
        xs = [t / 60 for t, r in zip(ts, rows) if int(r[f"{op}_n"]) > 0]
        p50 = [float(r[f"{op}_p50_us"]) / 1000 for r in rows if int(r[f"{op}_n"]) > 0]
        p99 = [float(r[f"{op}_p99_us"]) / 1000 for r in rows if int(r[f"{op}_n"]) > 0]
        ax.plot(xs, p50, color=color, linewidth=1.3, label=f"{op} p50")
        ax.plot(xs, p99, color=color, linewidth=0.9, linestyle=":", label=f"{op} p99")
    ax.set_yscale("log")
    ax.set_ylabel("ms (per interval)")
    ax.set_title("Latency per interval")
    ax.legend(fontsize=7, ncol=2)

    ax = axs[1][2]
    series(ax, rows, ts, "g2_blocks", "G2 blocks", "tab:blue", fitted=False)
    series(ax, rows, ts, "g3_blocks", "G3 blocks", "tab:green", fitted=False)
    ax.plot([t / 60 for t in ts], [float(r["router_blocks"]) for r in rows], color="tab:orange", linestyle=":",
            linewidth=1.6, label="router's index (blocks)")
    ax.set_ylabel("blocks")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    reqs = [int(r["requests"]) for r in rows]
    rate = [(reqs[i] - (reqs[i - 1] if i else 0)) / (ts[i] - (ts[i - 1] if i else 0)) for i in range(len(rows))]
    ax2.plot([t / 60 for t in ts], rate, color="black", linewidth=0.8, label="requests / s (right)")
    ax2.set_ylabel("requests / s")
    ax2.set_ylim(bottom=0)
    legend_of_both(ax, ax2, "Tiers and load")

    for i, ax in enumerate(axs.flat):
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
        if i not in (2, 3, 5) and ax.get_legend() is None:
            ax.legend(fontsize=8)
    verdict = "passed" if rep.get("failures") == [] else ("FAILED" if rep else "")
    fig.suptitle(
        f"kvbench soak: kvcached + kvrouter, {rep.get('engines', '?')} engines, G2 {rep.get('g2_mib', '?')} MiB"
        f" + G3 {rep.get('g3_mib', '?')} MiB, {ts[-1] / 60:.1f} min ({verdict}); dashed: fit over the second half"
    )
    fig.tight_layout()
    fig.savefig(dst)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
