#!/usr/bin/env python3
"""Renders the main panels of the kvcached Grafana dashboard from a Prometheus into a PNG.

    scripts/plot_dashboard.py http://127.0.0.1:9090 [--out docs/img/dashboard.png] [--since 900]

The queries are the dashboard's own (deploy/grafana/kvcached.json, found by panel title), with
every template variable set to "all" and $__rate_interval to --rate-interval, so the picture shows
what an operator sees in Grafana: hit rate by tier, saved prefill tokens per second, RPC p99
latency and write-through lag. tests/prometheus.rs runs it at its end when
KVCACHED_PLOT_DASHBOARD=1, against the Prometheus that scraped a real kvcached and kvrouter.

Needs matplotlib (scripts/lib.sh: `venv venv-plot matplotlib==3.9.4` makes
~/.cache/kvcached/venv-plot). Exits 1, naming the panel, when a main panel has no data.
"""

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (panel title, which targets (refIds), y unit, stacked)
PANELS = [
    ("Hit rate by tier", None, "percent", True),
    ("Saved prefill tokens / s", None, "tokens/s", True),
    ("RPC latency", ["A"], "ms", False),
    ("Write-through lag", None, "s", False),
]
TIER_COLOURS = {"g2": "#3274d9", "g3": "#56a64b", "g4": "#e0b400", "miss": "#c4162a"}


def substitute(expr: str, rate_interval: str) -> str:
    expr = re.sub(r"\$\{?__\w+\}?", rate_interval, expr)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list:
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    try:
        with urllib.request.urlopen(f"{prom.rstrip('/')}/api/v1/query_range?{q}", timeout=30) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"plot_dashboard: Prometheus refused {expr!r}: {e.read().decode(errors='replace')}")
    if body.get("status") != "success":
        sys.exit(f"plot_dashboard: {expr!r}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt or "")
    return text.strip() or ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prometheus", help="base URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--dashboard", default=str(REPO / "deploy/grafana/kvcached.json"))
    ap.add_argument("--out", default=str(REPO / "docs/img/dashboard.png"))
    ap.add_argument("--since", type=float, default=900, help="seconds of history to draw (default 900)")
    ap.add_argument("--end", type=float, default=None, help="unix time of the right edge (default now)")
    ap.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for (default 1m)")
    ap.add_argument("--title", default="kvcached: KV cache tiers (Grafana dashboard deploy/grafana/kvcached.json)")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from datetime import datetime, timezone

    dash = json.loads(Path(args.dashboard).read_text())
    by_title = {p["title"]: p for p in dash["panels"] if p.get("type") != "row"}
    end = args.end or time.time()
    start = end - args.since
    step = max(1.0, args.since / 300)

    fig, axes = plt.subplots(2, 2, figsize=(13, 7.5), dpi=110)
    fig.suptitle(args.title, fontsize=12, x=0.01, ha="left")
    missing = []
    for ax, (title, refs, unit, stacked) in zip(axes.flat, PANELS):
        panel = by_title.get(title)
        if panel is None:
            sys.exit(f"plot_dashboard: no panel {title!r} in {args.dashboard}")
        lines = []  # (label, times, values)
        for t in panel["targets"]:
            if refs and t["refId"] not in refs:
                continue
            for s in query_range(args.prometheus, substitute(t["expr"], args.rate_interval), start, end, step):
                pts = [(float(ts), float(v)) for ts, v in s["values"]]
                pts = [(ts, v) for ts, v in pts if math.isfinite(v)]
                if pts:
                    lines.append((legend(t.get("legendFormat", ""), s["metric"]), pts))
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(True, alpha=0.3)
        if not lines:
            missing.append(title)
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
            continue
        scale = 100.0 if unit == "percent" else 1000.0 if unit == "ms" else 1.0
        lines.sort(key=lambda x: (x[0] == "miss", x[0]))
        if stacked:
            grid = sorted({ts for _, pts in lines for ts, _ in pts})
            ys = [[dict(pts).get(ts, 0.0) * scale for ts in grid] for _, pts in lines]
            xs = [datetime.fromtimestamp(ts, timezone.utc) for ts in grid]
            colours = [TIER_COLOURS.get(lbl) for lbl, _ in lines]
            ax.stackplot(xs, ys, labels=[lbl for lbl, _ in lines], alpha=0.75,
                         colors=colours if all(colours) else None)
        else:
            for lbl, pts in lines:
                ax.plot([datetime.fromtimestamp(ts, timezone.utc) for ts, _ in pts], [v * scale for _, v in pts],
                        label=lbl, linewidth=1.4)
        ax.set_ylabel({"percent": "% of lookups", "ms": "ms"}.get(unit, unit), fontsize=9)
        if unit == "percent":
            ax.set_ylim(0, 100)
        else:
            ax.set_ylim(bottom=0)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7, loc="upper left", ncol=2 if len(lines) > 4 else 1, framealpha=0.7)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"plot_dashboard: wrote {out} ({start:.0f}..{end:.0f}, step {step:g} s)")
    if missing:
        print(f"plot_dashboard: no data for: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
