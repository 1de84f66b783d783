"""Run the panel (``python -m app``) with parts of its per-tick work switched off, to weigh each part's CPU:
``benchmarks/panel_cpu.py --off PART[,PART]`` starts this instead of ``-m app``. Not for users: a part switched
off leaves the window wrong on purpose (no plots, no cards).

Parts: ``plots`` (the Monitor's redraw: data and paint), ``plot-paint`` (the plots' data still set, their widget
never repainted), ``cards`` (the Monitor's cards and guides card not updated), ``log`` (the Log page gets no
lines), ``statusbar`` (the live status bar not refreshed).
"""

from __future__ import annotations

import os
import sys

PARTS = ("plots", "plot-paint", "cards", "log", "statusbar")


def main() -> int:
    off = {p for p in os.environ.get("DSV41_BENCH_OFF", "").split(",") if p}
    unknown = off - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown part(s): {', '.join(sorted(unknown))}; known: {', '.join(PARTS)}")
    from app import log_view, monitor_view, statusbar

    def nothing(self, *_a, **_k) -> None:
        return None

    if "plots" in off:
        monitor_view.MonitorView.redraw = nothing
    if "cards" in off:
        monitor_view.MonitorView.update_cards = nothing
    if "log" in off:
        log_view.LogView.append_lines = nothing
    if "statusbar" in off:
        statusbar.LiveStatusBar.refresh = nothing
    if "plot-paint" in off:
        build = monitor_view.MonitorView.build_plots

        def build_unpainted(self) -> None:
            build(self)
            self.glw.setUpdatesEnabled(False)
        monitor_view.MonitorView.build_plots = build_unpainted
    from app.main import main as panel_main
    return panel_main([])


if __name__ == "__main__":
    sys.exit(main())
