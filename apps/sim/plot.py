"""Goodput against chip count, one line per system and M, with the paper's entries as markers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.apps.sim.goodput import PAPER_GOODPUT, Row


def _label(system: str, learners: int | None) -> str:
    names = {"dp": "data-parallel", "elastic_dp": "elastic data-parallel"}
    return names.get(system) or f"Decoupled DiLoCo, M = {learners}"


def _chips_label(chips: int) -> str:
    return f"{chips / 1e6:g}M" if chips >= 1_000_000 else f"{chips / 1e3:g}K"


def plot_goodput(rows: list[Row], path: str | Path) -> Path:
    """Write the PNG and return its path; matplotlib loads only here (keeps the CLI fast)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    lines: dict[tuple[str, int | None], list[Row]] = {}
    for row in rows:
        lines.setdefault((row.system, row.learners), []).append(row)
    colors: dict[tuple[str, int | None], Any] = {}  # matplotlib colour specs
    for key, group in lines.items():
        group.sort(key=lambda r: r.chips)
        (line,) = ax.plot([r.chips for r in group], [100 * r.goodput for r in group],
                          marker="o", ms=3, label=_label(*key))
        colors[key] = line.get_color()
    for (system, chips, learners), value in PAPER_GOODPUT.items():
        if (system, learners) in colors:
            ax.plot(chips, 100 * value, marker="*", ms=12, ls="none",
                    color=colors[(system, learners)], markeredgecolor="black")
    ax.plot([], [], marker="*", ms=12, ls="none", color="white", markeredgecolor="black",
            label="paper (arXiv 2604.21428)")
    ax.set_xscale("log")
    ticks = sorted({r.chips for r in rows})
    ax.set_xticks(ticks, [_chips_label(c) for c in ticks])
    ax.minorticks_off()
    ax.set_xlabel("chips (per-chip MTBI 1 year)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Simulated goodput: lines = this simulator, stars = the paper")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
