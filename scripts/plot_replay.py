#!/usr/bin/env python3
"""Draws what `kvbench replay --out DIR` measured, as PNGs.

Input: one or more replay.json files (the first is the main run; later ones, e.g. a G2+G3 run,
are drawn beside it in the hit-rate-over-time and latency plots). Output, in OUT_DIR:
  - replay-hit-rate-time.png: hit rate per tier per window of requests over trace time;
  - replay-hit-rate-capacity.png: hit rate against G2 capacity (from a `--sweep` run), replay
    beside the model (`kvrouter::sim`), the pooled LRU and the infinite cache;
  - replay-latency-cdf.png: CDFs of route / lookup / load / save latency.
Needs matplotlib (the project's plotting venv: ~/.cache/kvcached/venv-plot).

    ~/.cache/kvcached/venv-plot/bin/python scripts/plot_replay.py docs/img \\
        /tmp/replay-g2/replay.json /tmp/replay-g3/replay.json
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TIERS = [("g2", "tab:blue"), ("g3", "tab:green"), ("g4", "tab:purple"), ("peer", "tab:orange")]
OPS = [("route", "tab:gray"), ("lookup", "tab:blue"), ("load", "tab:green"), ("save", "tab:red")]
LINES = ["-", "--", ":", "-."]


def label(r: dict) -> str:
    c = r.get("config") or {}
    s = f"{c.get('nodes', '?')} nodes, G2 {c.get('g2_blocks', '?')}"
    if c.get("g3_blocks"):
        s += f" + G3 {c['g3_blocks']}"
    if c.get("g4"):
        s += " + G4"
    return s + " blocks/node"


def replays(runs: list[dict]):
    """(line style, run, its replay) of each run that has a replay; the style is the run's."""
    for i, r in enumerate(runs):
        if r.get("replay"):
            yield LINES[i % len(LINES)], r, r["replay"]


def save(fig, dst: str) -> None:
    fig.tight_layout()
    fig.savefig(dst)
    plt.close(fig)


def hit_rate_over_time(runs: list[dict], dst: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for ls, r, rep in replays(runs):
        xs = [w["trace_s"] / 60 for w in rep["series"]]
        ax.plot(xs, [w["hit_rate"]["total"] for w in rep["series"]], color="black", linestyle=ls,
                linewidth=1.8, label=f"total ({label(r)})")
        for tier, color in TIERS:
            ys = [w["hit_rate"][tier] for w in rep["series"]]
            if any(ys):
                ax.plot(xs, ys, color=color, linestyle=ls, linewidth=1.2, label=f"{tier} ({label(r)})")
    model = runs[0].get("model")
    if model:
        ax.axhline(model["kv_aware_hit_rate"], color="gray", linestyle="--", linewidth=1,
                   label=f"model, whole trace ({model['kv_aware_hit_rate']:.3f})")
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("hit rate (blocks loaded / blocks requested)")
    ax.set_title("Mooncake trace through real daemons: hit rate per tier, per window of requests")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    save(fig, dst)


def hit_rate_vs_capacity(runs: list[dict], dst: str) -> bool:
    run = next((r for r in runs if r.get("sweep")), None)
    if not run:
        return False
    sweep = list(run["sweep"])
    # The run's own capacity is a point too.
    rep, model = run.get("replay"), run.get("model")
    if rep and model and not any(p["g2_blocks"] == run["config"]["g2_blocks"] for p in sweep):
        sweep.append({
            "g2_blocks": run["config"]["g2_blocks"],
            "replay_hit_rate": rep["hit_rate"],
            "model_hit_rate": model["kv_aware_hit_rate"],
            "pooled_hit_rate": model["pooled_hit_rate"],
            "infinite_hit_rate": model["infinite_hit_rate"],
        })
    pts = sorted(sweep, key=lambda p: p["g2_blocks"])
    xs = [p["g2_blocks"] for p in pts]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    ax.plot(xs, [p["replay_hit_rate"]["total"] for p in pts], color="tab:blue", marker="o", linewidth=2.2,
            label="replay (daemons + router)")
    ax.plot(xs, [p["model_hit_rate"] for p in pts], color="tab:orange", marker="s", label="model (kvrouter::sim)")
    ax.plot(xs, [p["pooled_hit_rate"] for p in pts], color="black", linestyle="--", linewidth=1.2, label="pooled LRU")
    ax.plot(xs, [p["infinite_hit_rate"] for p in pts], color="gray", linestyle=":", linewidth=1.2,
            label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("G2 capacity per node (blocks of 512 tokens)")
    ax.set_ylabel("hit rate")
    ax.set_title("Hit rate against capacity: replay beside the model")
    ax.set_ylim(0, max(p["infinite_hit_rate"] for p in pts) * 1.15)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, dst)
    return True


def latency_cdf(runs: list[dict], dst: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for ls, r, rep in replays(runs):
        for op, color in OPS:
            d = rep["latency"][op]
            if d["cdf"]:
                ax.plot([us / 1e3 for _, us in d["cdf"]], [q for q, _ in d["cdf"]], color=color,
                        linestyle=ls, label=f"{op} ({label(r)})")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Replay latency CDFs (per request, through the real socket and router)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    save(fig, dst)


def main(out: str, srcs: list[str]) -> None:
    runs = [json.load(open(s)) for s in srcs]
    os.makedirs(out, exist_ok=True)
    hit_rate_over_time(runs, os.path.join(out, "replay-hit-rate-time.png"))
    latency_cdf(runs, os.path.join(out, "replay-latency-cdf.png"))
    if hit_rate_vs_capacity(runs, os.path.join(out, "replay-hit-rate-capacity.png")):
        print("wrote replay-hit-rate-capacity.png")
    print(f"wrote replay-hit-rate-time.png, replay-latency-cdf.png to {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
