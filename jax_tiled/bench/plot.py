"""The PNG charts (--plot): TFLOP/s per shape, one bar per kernel and peer; with
--ladder, TFLOP/s per rung of the ladder (write_ladder_plot)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from jax_tiled.bench.harness import PEERS, peer_precision
from jax_tiled.bench.report import device_label

if TYPE_CHECKING:
    from jax_tiled.bench.ladder import LadderRow
    from jax_tiled.bench.products import Row


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear exit when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "python -m jax_tiled.bench: --plot needs matplotlib (pip install matplotlib)"
        ) from None
    return plt


def write_plot(path: str, info: dict, rows: list[Row]) -> None:
    """TFLOP/s per shape, one bar per kernel and peer; one panel per dtype/precision."""
    plt = pyplot()
    rows = [row for row in rows if row.tflops is not None]
    panels = _plot_panels(rows)
    if not panels:
        print("bench: nothing to plot (every row failed)", file=sys.stderr)
        return
    fig, axes = plt.subplots(
        len(panels),
        1,
        squeeze=False,
        layout="constrained",
        figsize=(max(8, 0.9 * _max_shapes(panels) + 3), 3.8 * len(panels)),
    )
    for ax, ((dtype, precision), prows) in zip(axes[:, 0], panels.items()):
        _plot_panel(ax, prows, precision, f"{dtype}, precision {precision}")
    peers = " and ".join(p for p in PEERS if any(r.kernel == p for r in rows)) or PEERS[0]
    fig.suptitle(f"jax_tiled vs {peers}\n{device_label(info)} - {info['date'][:16]}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_panels(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    """(dtype label, precision) -> its kernel rows and the peer rows they compare with."""
    panels: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if not row.is_peer:
            panels.setdefault((row.dtype_label, row.precision), []).append(row)
    for (label, precision), prows in panels.items():
        prows += [
            r
            for r in rows
            if r.is_peer and r.dtype_label == label and r.precision == peer_precision(precision)
        ]
    return panels


def _max_shapes(panels) -> int:
    return max(len({r.shape for r in rows}) for rows in panels.values())


def _plot_panel(ax, rows: list[Row], precision: str, title: str) -> None:
    shapes = list(dict.fromkeys(r.shape for r in rows))
    names = list(dict.fromkeys(r.kernel for r in rows))
    # the peers first, in PEERS' order, auto last
    names.sort(key=lambda k: (PEERS.index(k) if k in PEERS else len(PEERS), k == "auto"))
    labels = {k: k for k in names}
    for r in rows:  # peers for 'high' run at 'highest': say so in the legend
        if r.is_peer and r.precision != precision:
            labels[r.kernel] = f"{r.kernel} ({r.precision})"
    width = 0.8 / len(names)
    value = {(r.shape, r.kernel): r.tflops for r in rows}
    for i, name in enumerate(names):
        xs = [s + (i - (len(names) - 1) / 2) * width for s in range(len(shapes))]
        ys = [value.get((shape, name), 0.0) for shape in shapes]
        ax.bar(xs, ys, width, label=labels[name])
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncols=min(len(names), 4))


def write_ladder_plot(path: str, info: dict, rows: list[LadderRow]) -> None:
    """TFLOP/s per rung on a log axis, one panel per dtype: a bar per timed rung in
    ladder order, labelled with its TFLOP/s, each step's speedup over the bar
    before written between them, and jnp.matmul at each precision as a dashed
    line. Rungs that were skipped or failed have no bar."""
    plt = pyplot()
    sections = {}
    for row in rows:
        if row.tflops and row.error is None:
            sections.setdefault(row.dtype, []).append(row)
    if not sections:
        print("bench: nothing to plot (no rung was timed)", file=sys.stderr)
        return
    most = max(sum(not r.is_peer for r in section) for section in sections.values())
    fig, axes = plt.subplots(
        len(sections),
        1,
        squeeze=False,
        layout="constrained",
        figsize=(max(8, 1.1 * most + 2), 4.5 * len(sections)),
    )
    for ax, (dtype, section) in zip(axes[:, 0], sections.items()):
        _plot_ladder_panel(ax, dtype, section)
    shape = rows[0].shape
    fig.suptitle(
        f"The kernel ladder, {shape}: jax_tiled's rungs and jnp.matmul\n"
        f"{device_label(info)} - {info['date'][:16]}"
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_ladder_panel(ax, dtype: str, rows: list[LadderRow]) -> None:
    rungs = [r for r in rows if not r.is_peer]
    precisions = list(dict.fromkeys(r.precision for r in rungs))
    colors = {p: f"C{i}" for i, p in enumerate(precisions)}
    xs = range(len(rungs))
    ax.bar(xs, [r.tflops for r in rungs], color=[colors[r.precision] for r in rungs])
    for x, r in zip(xs, rungs):
        ax.annotate(f"{r.tflops:.3g}", (x, r.tflops), ha="center", va="bottom", fontsize="small")
        if r.step:  # the step from the bar before, between the two bars
            ax.annotate(
                f"×{r.step:.3g}",
                (x - 0.5, (r.tflops * (r.tflops / r.step)) ** 0.5),
                ha="center",
                va="center",
                fontsize="small",
                color="0.3",
            )
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[p], label=f"rungs at precision {p}") for p in precisions]
    for i, peer in enumerate(r for r in rows if r.is_peer):
        handles.append(
            ax.axhline(
                peer.tflops,
                linestyle="--",
                color=f"C{len(precisions) + i}",
                label=f"{peer.kernel} ({peer.precision}): {peer.tflops:.3g}",
            )
        )
    labels = [f"{r.rung} {r.kernel}" for r in rungs]
    ax.set_xticks(list(xs), labels, rotation=30, ha="right")
    ax.set_yscale("log")
    top = max(r.tflops for r in rows)
    ax.set_ylim(top=top * 2)  # room for the labels above the tallest bar
    ax.set_ylabel("TFLOP/s (log)")
    ax.set_title(f"{dtype}: each bar a rung, ×N the step from the rung before")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(handles=handles, fontsize="small", loc="best")
