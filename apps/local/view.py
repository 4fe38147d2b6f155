"""Progress of a local run: a rich live table, or a plain line every few seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco.apps.local.tracker import RunTracker
from diloco.spec import DecoupledDiLoCoJob


def _row(tracker: RunTracker, elapsed: float) -> dict[str, str]:
    ev = tracker.latest_eval()
    return {
        "elapsed": f"{elapsed:.0f}s",
        "outer version": str(tracker.outer_versions),
        "merges": str(tracker.outer_steps),
        "tokens trained": f"{tracker.tokens_trained:,}",
        "tokens merged": f"{tracker.tokens_merged:,}",
        "tokens/s": f"{tracker.tokens_trained / elapsed:,.0f}" if elapsed > 0 else "-",
        "eval loss": f"{ev:.3f}" if ev is not None else "-",
        "learners up": f"{tracker.up_count}/{len(tracker.slots)}",
        "kills": str(len(tracker.kills)),
        "last chaos": tracker.last_chaos or "-",
    }


class View:
    def __init__(self, live: bool, job: DecoupledDiLoCoJob):
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=4) if live and self.console.is_terminal else None
        self.job = job
        self.last_line = 0.0

    def __enter__(self) -> View:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.__exit__(None, None, None)

    def update(self, tracker: RunTracker, elapsed: float, limit: float | None) -> None:
        row = _row(tracker, elapsed)
        if self.live:
            table = Table(title=f"diloco run {self.job.metadata.name}" + (f" ({limit:.0f}s)" if limit else ""))
            for key in row:
                table.add_column(key, justify="right")
            table.add_row(*row.values())
            self.live.update(table)
        elif time.monotonic() - self.last_line >= 5.0:
            self.last_line = time.monotonic()
            self.console.print("  ".join(f"{k}={v}" for k, v in row.items()), highlight=False)

    def final(self, summary: dict[str, Any], out: Path) -> None:
        shown = {k: v for k, v in summary.items() if k != "sample"}
        self.console.print(json.dumps(shown, indent=2), highlight=False)
        if "sample" in summary:  # what the model learned, as text rather than an escaped JSON string
            self.console.print("sample of the final model (greedy):", highlight=False)
            self.console.print(summary["sample"], highlight=False, markup=False)
        self.console.print(f"wrote {out}/summary.json, events.jsonl, eval_loss.png, timeline.png")


def make_view(live: bool, job: DecoupledDiLoCoJob) -> View:
    return View(live, job)
