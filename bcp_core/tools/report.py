"""`bcp report`: a checkpoint's per-rank phase timings as a heat map, a timeline and a summary.

Reads the JSON lines of `bcp_core.metrics` (`bcp_metrics.jsonl` in a checkpoint, or any file a
sink wrote) and draws, like the paper's Figs. 12-13, a heat map of ranks x phases (busy seconds)
and the timeline of one rank (the slowest unless asked), into a PNG and a self-contained HTML
page. The text summary names the slowest rank and the phase that makes it slow, so a straggler
stands out without opening the picture. Drawing needs matplotlib (the `report` extra);
the summary does not.
"""

from __future__ import annotations

import base64
import html
import io
import os
import statistics
from dataclasses import dataclass

from ..errors import BCPError
from ..extras import require
from ..layout import resolve
from ..metadata import read_capped
from ..utils import human_bytes
from ..metrics import LOAD_PHASES, METRICS_FILE, SAVE_PHASES, load_jsonl

# Phases where a rank waits for the others rather than works: they do not make a rank slow.
WAITING = {"wait", "commit", "transfer"}


@dataclass
class Report:
    source: str
    op: str
    ranks: list[int]
    phases: list[str]
    busy: dict[tuple[int, str], float]      # (rank, phase) -> busy seconds
    nbytes: dict[tuple[int, str], int]
    records: list[dict]

    def rank_time(self, rank: int) -> float:
        """Seconds the rank spent working (phases that wait for other ranks left out)."""
        return sum(self.busy.get((rank, p), 0.0) for p in self.phases if p not in WAITING)


def read_records(path: str | os.PathLike) -> tuple[str, list[dict]]:
    """The records at `path`: a JSON-lines file, or a checkpoint (or root) holding bcp_metrics.jsonl."""
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path) as f:
            return path, load_jsonl(f.read(), path)
    st = resolve(path)
    if not st.exists(METRICS_FILE):
        raise BCPError(f"{st.root} has no {METRICS_FILE}: it was saved by a bcp without metrics, or the file "
                       "could not be written (see the save's log)")
    return st.join(METRICS_FILE), load_jsonl(read_capped(st, METRICS_FILE), st.join(METRICS_FILE))


def build(source: str, records: list[dict], op: str | None = None) -> Report:
    if not records:
        raise BCPError(f"{source}: no metrics records")
    ops = sorted({r["op"] for r in records})
    op = op or ("save" if "save" in ops else ops[0])
    records = [r for r in records if r["op"] == op]
    if not records:
        raise BCPError(f"{source}: no '{op}' records (found {', '.join(ops)})")
    known = SAVE_PHASES if op == "save" else LOAD_PHASES
    seen = {r["phase"] for r in records}
    phases = [p for p in known if p in seen] + sorted(seen - set(known))
    busy: dict[tuple[int, str], float] = {}
    nbytes: dict[tuple[int, str], int] = {}
    for r in records:  # several operations in one file (a sink): add them up per rank and phase
        k = (r["rank"], r["phase"])
        busy[k] = busy.get(k, 0.0) + r["busy"]
        nbytes[k] = nbytes.get(k, 0) + r["bytes"]
    return Report(source, op, sorted({r["rank"] for r in records}), phases, busy, nbytes, records)


def summary(rep: Report) -> str:
    lines = [f"bcp report: {rep.op} of {len(rep.ranks)} rank(s) from {rep.source}"]
    start = min(r["start"] for r in rep.records)
    end = max(r["end"] for r in rep.records)
    lines.append(f"  wall time {end - start:.3f} s (first phase start to last phase end)")
    lines.append(f"  {'phase':<10} {'median s':>9} {'max s':>9} {'slowest':>8} {'max/median':>10} {'bytes':>12}")
    worst_phase, worst_excess = None, -1.0
    for p in rep.phases:
        vals = [rep.busy.get((r, p), 0.0) for r in rep.ranks]
        med, mx = statistics.median(vals), max(vals)
        slow = rep.ranks[vals.index(mx)]
        ratio = f"{mx / med:.1f}x" if med > 0 else "-"
        total = sum(rep.nbytes.get((r, p), 0) for r in rep.ranks)
        lines.append(f"  {p:<10} {med:>9.4f} {mx:>9.4f} {slow:>8} {ratio:>10} {human_bytes(total):>12}")
        if p not in WAITING and mx - med > worst_excess:
            worst_phase, worst_excess = p, mx - med
    times = {r: rep.rank_time(r) for r in rep.ranks}
    slowest = max(times, key=times.get)
    med_time = statistics.median(times.values())
    # the phase where the slowest rank loses most against the median rank
    behind = {p: rep.busy.get((slowest, p), 0.0) - statistics.median(rep.busy.get((r, p), 0.0) for r in rep.ranks)
              for p in rep.phases if p not in WAITING}
    lag_phase = max(behind, key=behind.get) if behind else None
    lines.append(f"  slowest rank: {slowest} ({times[slowest]:.4f} s working vs median {med_time:.4f} s)"
                 + (f", mostly in '{lag_phase}' (+{behind[lag_phase]:.4f} s over the median rank)"
                    if lag_phase is not None else ""))
    if worst_phase is not None:
        lines.append(f"  most uneven phase: '{worst_phase}' (slowest rank {worst_excess:.4f} s above the median)")
    return "\n".join(lines)


def figure(rep: Report, rank: int | None = None):
    """A matplotlib figure: heat map of ranks x phases (left), timeline of `rank` (right)."""
    matplotlib = require("matplotlib", "report", "drawing the report (bcp report --text does without)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if rank is None:
        rank = max(rep.ranks, key=rep.rank_time)
    if rank not in rep.ranks:
        raise BCPError(f"rank {rank} has no records (ranks: {rep.ranks[0]}..{rep.ranks[-1]})")
    import numpy as np
    grid = np.array([[rep.busy.get((r, p), 0.0) for p in rep.phases] for r in rep.ranks])
    n = len(rep.ranks)
    fig, (ax_heat, ax_time) = plt.subplots(
        1, 2, figsize=(13, max(3.5, min(12, 1.6 + 0.35 * n))), gridspec_kw={"width_ratios": [1, 1.4]})
    # Waiting phases get their own grey scale: the ranks that wait longest are the fast ones, and
    # on the working scale they would drown the straggler.
    waiting = np.array([p in WAITING for p in rep.phases])
    work = np.ma.masked_array(grid, mask=np.broadcast_to(waiting, grid.shape))
    wait = np.ma.masked_array(grid, mask=np.broadcast_to(~waiting, grid.shape))
    im = ax_heat.imshow(work, aspect="auto", cmap="YlOrRd", interpolation="nearest")
    if waiting.any():
        ax_heat.imshow(wait, aspect="auto", cmap="Greys", interpolation="nearest", alpha=0.45)
    ax_heat.set_xticks(range(len(rep.phases)), rep.phases, rotation=35, ha="right")
    for label, w in zip(ax_heat.get_xticklabels(), waiting):
        if w:
            label.set_color("grey")
            label.set_fontstyle("italic")
    step = max(1, n // 32)
    ax_heat.set_yticks(range(0, n, step), [str(r) for r in rep.ranks[::step]])
    ax_heat.set_ylabel("rank")
    ax_heat.set_title(f"{rep.op}: busy seconds per rank and phase\n(grey: waiting for other ranks)", fontsize=10)
    if n <= 16 and len(rep.phases) <= 10:
        top = float(work.max()) if work.count() else 1.0
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                dark = not waiting[j] and v > 0.6 * top
                ax_heat.text(j, i, f"{v:.2f}" if v >= 0.01 else f"{v * 1e3:.1f}m", ha="center", va="center",
                             fontsize=7, color="white" if dark else "black")
    ax_heat.add_patch(plt.Rectangle((-0.5, rep.ranks.index(rank) - 0.5), len(rep.phases), 1, fill=False,
                                    edgecolor="tab:blue", linewidth=2))
    fig.colorbar(im, ax=ax_heat, label="seconds (working phases)")

    t0 = min(r["start"] for r in rep.records)
    mine = {p: [] for p in rep.phases}
    for r in rep.records:
        if r["rank"] == rank:
            mine[r["phase"]].extend(r.get("intervals") or [[r["start"], r["end"]]])
    colors = plt.get_cmap("tab10")
    for i, p in enumerate(rep.phases):
        bars = [(s - t0, max(e - s, 1e-6)) for s, e in mine[p]]
        ax_time.broken_barh(bars, (i - 0.35, 0.7), color=colors(i % 10))
        nb = rep.nbytes.get((rank, p), 0)
        if bars:
            ax_time.text(max(s + w for s, w in bars), i, f" {rep.busy.get((rank, p), 0.0) * 1e3:.1f} ms"
                         + (f", {human_bytes(nb)}" if nb else ""), va="center", fontsize=7)
    ax_time.set_yticks(range(len(rep.phases)), rep.phases)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("seconds since the first rank started")
    ax_time.set_title(f"timeline of rank {rank}")
    ax_time.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def write(rep: Report, out_prefix: str, rank: int | None = None) -> tuple[str, str]:
    """Write OUT.png and OUT.html (the PNG embedded, with the summary); returns their paths."""
    fig = figure(rep, rank)
    import matplotlib.pyplot as plt  # figure() required it
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    png = buf.getvalue()
    png_path, html_path = f"{out_prefix}.png", f"{out_prefix}.html"
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    with open(png_path, "wb") as f:
        f.write(png)
    rows = "".join(
        "<tr><td>{}</td>{}</tr>".format(r, "".join(f"<td>{rep.busy.get((r, p), 0.0):.4f}</td>"
                                                  for p in rep.phases))
        for r in rep.ranks)
    img = base64.b64encode(png).decode()
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>bcp report: {html.escape(rep.source)}</title>
<style>body{{font-family:sans-serif;margin:2em}} pre{{background:#f4f4f4;padding:1em}}
table{{border-collapse:collapse;font-size:12px}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}</style>
</head><body>
<h1>bcp {html.escape(rep.op)} report</h1>
<pre>{html.escape(summary(rep))}</pre>
<img alt="heat map of ranks by phases and timeline of one rank" src="data:image/png;base64,{img}">
<h2>Busy seconds per rank and phase</h2>
<table><tr><th>rank</th>{"".join(f"<th>{html.escape(p)}</th>" for p in rep.phases)}</tr>{rows}</table>
</body></html>
"""
    with open(html_path, "w") as f:
        f.write(page)
    return png_path, html_path
