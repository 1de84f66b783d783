"""The Benchmark tab: run ``engine_manager.bench`` on a worker and show its progress, the table beside
the guides' figures, per-user bars and per-stream token timelines (the long-prompt pause), history and compare;
the Quality page (:mod:`app.bench_quality`) runs and shows ``dsv41 bench --preset quality``.

Everything measured or decided lives in :mod:`engine_manager.bench`; this module renders its events and result.
"""

from __future__ import annotations

from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine_manager import bench
from engine_manager.bench import results
from engine_manager.cancel import CancelToken
from engine_manager.engines import find_engine
from engine_manager.errors import UserError

from . import workers
from .bench_quality import QualitySection
from .panel_base import Panel

COLUMNS = ("users", "total tok/s", "spread", "slowest tok/s", "per stream", "first token s", "engine's total",
           "guides' total", "guides' slowest", "ratio", "verdict")
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _read_history() -> tuple[list[dict[str, Any]], list[str]]:
    """The saved runs and a line per file that could not be read (on a worker thread)."""
    skipped: list[str] = []
    return results.history(skipped=skipped), skipped


def _n(x: Any, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


class BenchView(Panel, QWidget):
    """The tab. ``run_bench()`` starts a run with the options shown; ``cancel()`` stops it (the engine is put back
    as it was). ``finished`` carries the result document."""

    finished = Signal(object)

    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.tasks = workers.TaskOwner(self)
        self._token: CancelToken | None = None      # the running benchmark's: cancelling it stops the bench
        self.result: dict[str, Any] | None = None
        self.last_progress: Any = None
        self.saved_path: str | None = None
        self.history_notes: list[str] = []        # the bench folder's files that could not be read, in words
        self.spec_overrides: dict[str, Any] = {}      # BenchSpec fields set over the options shown (tests, scripts)
        self.formats_seen: list[str] = []             # the progress bar's texts, in order

        # -- controls ----------------------------------------------------------------------------------------
        self.engine_label = QLabel()
        self.engine_label.setWordWrap(True)
        self.quick = QCheckBox("Quick (64 tokens per stream)")
        self.quick.setChecked(True)
        self.long_prompt = QCheckBox("Long-prompt experiment (~64K tokens)")
        self.long_prompt.setChecked(True)
        self.preset_boxes: dict[str, QCheckBox] = {}
        presets_row = QHBoxLayout()
        presets_row.addWidget(QLabel("A/B:"))
        for name in ("numerics", "numa", "hotset", "placement"):
            box = QCheckBox(bench.PRESET_WORDS[name].split(":")[0])
            box.setToolTip(bench.PRESET_WORDS[name])
            self.preset_boxes[name] = box
            presets_row.addWidget(box)
        presets_row.addStretch(1)
        self.run_button = QPushButton("Run benchmark")
        self.run_button.clicked.connect(self.run_bench)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.progress.setFormat("idle")
        self.phase_label = QLabel("The benchmark restarts the engine for each configuration and puts it back as "
                                  "it was.")
        self.phase_label.setWordWrap(True)
        top = QHBoxLayout()
        top.addWidget(self.engine_label, 1)
        top.addWidget(self.run_button)
        top.addWidget(self.cancel_button)
        options_row = QHBoxLayout()       # a row of its own: the tab stays as narrow as the other tabs
        options_row.addWidget(self.quick)
        options_row.addWidget(self.long_prompt)
        options_row.addStretch(1)

        # -- results -------------------------------------------------------------------------------------------
        self.verdict = QLabel("No benchmark run yet.")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.details = QLabel("")
        self.details.setWordWrap(True)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        # the Monitor's look: white background, dark axes, short titles that fit half the tab
        self.bars = pg.PlotWidget(background="w", title="Decode tok/s per stream")
        self.bars.setLabel("left", "tok/s")
        self.bars.setLabel("bottom", "stream, grouped by users (last repeat)")
        self.bars.showGrid(y=True, alpha=0.3)
        self.timeline = pg.PlotWidget(background="w", title="Tokens over time (long prompt)")
        self.timeline.setLabel("left", "tokens (stream n drawn 3·n higher)")
        self.timeline.setLabel("bottom", "s since the phase began")
        self.timeline.showGrid(x=True, y=True, alpha=0.3)
        from .plot_export import add_export     # right click: Save plot as PNG/SVG…, Copy figures
        for plot in (self.bars, self.timeline):
            item = plot.getPlotItem()
            add_export(item, item.titleLabel.text, self)
            item.titleLabel.setText(item.titleLabel.text, color="#222", size="10pt")
            for name in ("left", "bottom"):
                item.getAxis(name).setPen(pg.mkPen("#444"))
                item.getAxis(name).setTextPen(pg.mkPen("#333"))
        self.timeline.addLegend(offset=(10, 10))
        plots = QSplitter(Qt.Orientation.Horizontal)
        plots.addWidget(self.bars)
        plots.addWidget(self.timeline)

        # -- history and compare ---------------------------------------------------------------------------
        self.history_a = QComboBox()
        self.history_b = QComboBox()
        for combo in (self.history_a, self.history_b):     # a long run name must not widen the whole window
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(16)
        self.compare_button = QPushButton("Compare")
        self.compare_button.clicked.connect(self.compare)
        self.show_button = QPushButton("Show A")
        self.show_button.clicked.connect(self.show_saved)
        # the two runs named above a table: figure | A | B | unit | B/A (plain text did not line up)
        self.compare_text = QLabel("Pick two saved runs and press Compare.")
        self.compare_text.setWordWrap(True)
        self.compare_table = QTableWidget(0, 5)
        self.compare_table.setObjectName("benchCompare")
        self.compare_table.setHorizontalHeaderLabels(["figure", "A", "B", "unit", "B / A"])
        self.compare_table.verticalHeader().setVisible(False)
        self.compare_table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.compare_table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        hist = QWidget()
        hl = QVBoxLayout(hist)
        row = QHBoxLayout()
        row.addWidget(QLabel("A:"))
        row.addWidget(self.history_a, 1)
        row.addWidget(QLabel("B:"))
        row.addWidget(self.history_b, 1)
        row.addWidget(self.show_button)
        row.addWidget(self.compare_button)
        hl.addLayout(row)
        hl.addWidget(self.compare_text)
        hl.addWidget(self.compare_table, 1)

        result_page = QWidget()
        rl = QVBoxLayout(result_page)
        rl.addWidget(self.verdict)
        self.table.setMaximumHeight(150)
        rl.addWidget(self.table)
        rl.addWidget(self.details)
        rl.addWidget(plots, 3)
        self.pages = QTabWidget()
        self.pages.addTab(result_page, "Result")
        self.pages.addTab(hist, "History and compare")
        self.quality = QualitySection(self)      # dsv41 bench --preset quality, on this tab's tasks
        self.pages.addTab(self.quality, "Quality")

        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addLayout(options_row)
        lay.addLayout(presets_row)
        lay.addWidget(self.progress)
        lay.addWidget(self.phase_label)
        lay.addWidget(self.pages, 1)

        ctx.settingsChanged.connect(lambda _l: self._show_engine())
        self._show_engine()
        self.refresh_history()
        self.quality.load_last()

    # -- state ---------------------------------------------------------------------------------------------
    def engine_name(self) -> str:
        return self.ctx.engine_name()

    def _show_engine(self) -> None:
        name = self.engine_name()
        eng = find_engine(name)
        sim = " — SIMULATED: its figures check the panel's wiring, not this host" if eng.simulated else ""
        self.engine_label.setText(f"Engine: <b>{name}</b>{sim}")
        for preset, box in self.preset_boxes.items():
            box.setEnabled(preset in eng.bench_presets)
        if not any(b.isChecked() for b in self.preset_boxes.values()):
            for preset in eng.default_bench_presets:
                self.preset_boxes[preset].setChecked(True)

    def spec(self) -> bench.BenchSpec:
        name = self.engine_name()
        presets = [p for p, b in self.preset_boxes.items() if b.isChecked() and b.isEnabled()]
        kw: dict[str, Any] = {}
        if not self.long_prompt.isChecked():
            kw["long_prompt_tokens"] = 0
        kw.update(self.spec_overrides)
        return bench.BenchSpec.make(name, quick=self.quick.isChecked(), presets=presets, **kw)

    def running(self) -> bool:
        return self.tasks.running("bench")

    # -- run -----------------------------------------------------------------------------------------------
    def run_bench(self) -> None:
        if self.running():
            return
        if self.quality.running():
            self.phase_label.setText("The quality check is running: wait for it to end or cancel it first.")
            return
        self._token = CancelToken()                 # the task's, and what the bench watches
        self.result = None
        self.run_button.setEnabled(False)
        self.quality.run_button.setEnabled(False)      # one run at a time takes the engine over
        self.cancel_button.setEnabled(True)
        self.progress.setValue(0)
        self.progress.setFormat("starting…")
        self.table.setRowCount(0)
        self.bars.clear()
        self.timeline.clear()
        self.verdict.setText("Running…")
        session = getattr(self.ctx, "session", None)
        feed = getattr(session, "feed", None)
        self.ctx.lock_engine("The benchmark is running: it starts and stops the engine itself and puts it back "
                             "as it was when it ends. Cancel it in the Benchmark tab to get Start/Stop back now.")
        self.tasks.start("bench", bench.run_and_save, self.ctx.settings, self.spec(), hardware=self.ctx.hardware,
                         stop=self._token, token=self._token, on_engine_event=feed, on_event=self._on_event,
                         on_done=self._on_done, on_error=self._on_error, on_finished=self._on_finished)

    def cancel(self) -> None:
        if self._token is not None:
            self._token.cancel("cancelled")
            self.progress.setFormat("cancelling: cutting the streams, putting the engine back…")
            self.cancel_button.setEnabled(False)

    def _on_event(self, ev: Any) -> None:
        match ev:
            case bench.BenchProgress():
                self.last_progress = ev
                self.progress.setValue(int(ev.fraction * 1000))
                eta = f" — about {ev.eta_s:.0f} s left" if ev.eta_s is not None else ""
                self.progress.setFormat(f"{results.phase_words(ev.phase)}: %p%{eta}")
                self.formats_seen.append(self.progress.format())
                self.phase_label.setText(f"{ev.config + ': ' if ev.config else ''}{ev.message}")
            case bench.BenchNote(text=text):
                self.ctx.statusMessage.emit(text, 5000)
            case bench.BenchPhase(phase="long_prompt", figures=figures):
                self.plot_timeline(figures)

    def _on_done(self, result: dict[str, Any] | None) -> None:
        if not result:
            return
        saved = result.get("saved") or {}
        self.saved_path = saved.get("json")
        if saved.get("error"):
            self.ctx.statusMessage.emit(f"The result could not be saved ({saved['error']}); it is shown here.", 8000)
        self.show_result(result)
        self.refresh_history()
        self.finished.emit(result)

    def _on_error(self, exc: BaseException) -> None:
        self.verdict.setText(f"The benchmark failed: {exc}")

    def _on_finished(self) -> None:
        self.ctx.lock_engine(None)
        self.run_button.setEnabled(True)
        self.quality.run_button.setEnabled(not self.quality.running())
        self.cancel_button.setEnabled(False)
        if self.result is not None:
            self.progress.setValue(1000)
            self.progress.setFormat("cancelled" if self.result.get("cancelled") else "done")
            self.phase_label.setText("Cancelled; the engine is as it was before." if self.result.get("cancelled")
                                     else "Done; the engine is as it was before the benchmark.")

    # -- rendering -----------------------------------------------------------------------------------------
    def show_result(self, r: dict[str, Any]) -> None:
        self.result = r
        text = r.get("verdict") or ""
        if text.startswith("SIMULATED"):
            text = "<b>SIMULATED</b>" + text[len("SIMULATED"):]
        self.verdict.setText(text)
        rows = r.get("table") or []
        self.table.setRowCount(len(rows))
        for i, x in enumerate(rows):
            cells = (str(x["users"]), _n(x["total_tok_s"]), _n(x["total_spread"], "{:.1%}"),
                     _n(x["slowest_tok_s"]), _n(x["per_stream_tok_s"]), _n(x["ttft_s"], "{:.2f}"),
                     _n(x["engine_total_tok_s"]), _n(x["guide_total_tok_s"], "{:.2f}"),
                     _n(x["guide_slowest_tok_s"], "{:.2f}"), _n(x["ratio_total"], "{:.2f}"),
                     x["verdict"] + (" (simulated)" if x.get("simulated") else ""))
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEditable)
                self.table.setItem(i, j, item)
        parts = bench.findings(r)
        if self.saved_path:
            parts.append(f"Saved: {self.saved_path} (+ .csv).")
        self.details.setText("\n".join(parts))
        self.plot_bars(r)
        base = (r.get("configs") or [{}])[0].get("phases") or {}
        if base.get("long_prompt"):
            self.plot_timeline(base["long_prompt"])

    def plot_bars(self, r: dict[str, Any]) -> None:
        self.bars.clear()
        phases = (r.get("configs") or [{}])[0].get("phases") or {}
        x0 = 0.0
        ticks: list[tuple[float, str]] = []
        for k, ph in phases.items():
            if not k.startswith("users_") or not ph.get("repeats"):
                continue
            rates = [v or 0.0 for v in ph["repeats"][-1]["per_stream_tok_s"]]
            xs = [x0 + i for i in range(len(rates))]
            color = PALETTE[len(ticks) % len(PALETTE)]
            self.bars.addItem(pg.BarGraphItem(x=xs, height=rates, width=0.8, brush=color))
            n_users = k.split("_")[1]
            ticks.append((x0 + (len(rates) - 1) / 2, f"{n_users} user{'' if n_users == '1' else 's'}"))
            x0 += len(rates) + 1.5
        self.bars.getAxis("bottom").setTicks([ticks])

    def plot_timeline(self, lp: dict[str, Any]) -> None:
        self.timeline.clear()
        for i, ts in enumerate(lp.get("timeline") or []):
            if not ts:
                continue
            self.timeline.plot(ts, [k + 1 + 3 * i for k in range(len(ts))],
                               pen=pg.mkPen(PALETTE[i % len(PALETTE)], width=2), name=f"stream {i + 1}")
        sent, first = lp.get("sent_at_s"), lp.get("first_token_s")
        if sent is not None and first is not None:
            region = pg.LinearRegionItem((sent, first), movable=False, brush=pg.mkBrush(255, 0, 0, 40))
            self.timeline.addItem(region)
            pause = lp.get("pause_s")
            label = pg.TextItem(f"long prompt sent → its first token: {first - sent:.2f} s"
                                + (f"; longest pause {pause:.2f} s" if pause is not None else ""), color="#e33")
            label.setPos(sent, 0)
            self.timeline.addItem(label)

    # -- history -------------------------------------------------------------------------------------------
    def refresh_history(self) -> None:
        """Read the saved runs on a worker, then fill the two lists."""
        self.tasks.start("history", _read_history, on_done=self._fill_history)

    def _fill_history(self, found: tuple[list[dict[str, Any]], list[str]]) -> None:
        rows, skipped = found
        self.history_notes = skipped
        if skipped:       # a bad file in the bench folder is named, and the good ones are still listed
            self.ctx.statusMessage.emit(skipped[0] + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1
                                                      else ""), 10000)
        for box in (self.history_a, self.history_b):
            current = box.currentData()
            box.clear()
            for x in rows:
                tot = " ".join(f"{u}u {v:.0f}" for u, v in (x.get("totals") or {}).items() if v is not None)
                box.addItem(f"{x['id']} · {x.get('engine')}{' (sim)' if x.get('simulated') else ''} · {tot}",
                            x["path"])
            if current is not None:
                i = box.findData(current)
                if i >= 0:
                    box.setCurrentIndex(i)
        if self.history_b.count() > 1 and self.history_b.currentIndex() == self.history_a.currentIndex():
            self.history_b.setCurrentIndex(1)

    def show_saved(self) -> None:
        path = self.history_a.currentData()
        if path:
            try:
                r = results.load(path)
            except UserError as exc:      # changed or damaged since it was listed
                self.verdict.setText(str(exc))
                return
            self.show_result(r)
            self.pages.setCurrentIndex(0)

    def compare(self) -> None:
        a, b = self.history_a.currentData(), self.history_b.currentData()
        if not a or not b:
            self.compare_text.setText("Run the benchmark twice to compare two runs.")
            return
        try:
            c = results.compare(results.load(a), results.load(b))
        except UserError as exc:          # changed or damaged since it was listed
            self.compare_text.setText(str(exc))
            return
        self.compare_text.setText("\n".join(results.render_compare(c).splitlines()[:2]))   # A = …, B = …
        self.compare_table.setRowCount(len(c["rows"]))
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for i, row in enumerate(c["rows"]):
            cells = (row["figure"], _n(row["a"], "{:.3f}"), _n(row["b"], "{:.3f}"), row["unit"],
                     _n(row["ratio"], "{:.2f}"))
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if j in (1, 2, 4):
                    item.setTextAlignment(right)
                self.compare_table.setItem(i, j, item)
        self.compare_table.resizeColumnsToContents()

    def shutdown(self, wait_ms: int = 3000) -> None:
        """The window is closing: the benchmark is cancelled (its token: the streams are cut, the
        engine is put back) and waited for up to ``wait_ms``."""
        self.tasks.shutdown(wait_ms)
