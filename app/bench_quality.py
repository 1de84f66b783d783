"""The Benchmark tab's Quality page: run :func:`engine_manager.bench.quality.run_quality` (``dsv41 bench --preset
quality``) on the tab's tasks and show its result: the scores beside the guides' and DeepSeek API's figures, the
determinism table, and the failed items, each one opened whole in a dialog.

Everything measured or decided lives in :mod:`engine_manager.bench.quality`; this module renders its events and its
result document (schema ``dsv41-quality``), and on start shows the newest one saved in the bench folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Generator

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine_manager.atomic import read_bytes_nofollow
from engine_manager.bench import BenchNote, BenchProgress, results
from engine_manager.bench import quality as Q
from engine_manager.bench.stats import finite_json
from engine_manager.cancel import CancelToken
from engine_manager.errors import UserError

BENCHES = (("humaneval", "HumanEval pass@1"), ("gsm8k", "GSM8K (exact match)"), ("ifeval", "IFEval"))
SCORE_COLUMNS = ("benchmark", "items", "score", "guides'", "DeepSeek API", "stock llama.cpp")
DET_COLUMNS = ("numerics", "prompts", "batch", "identical answers", "first divergence")
ITEM_COLUMNS = ("id", "status", "expected", "got / answer")
IFEVAL_CELL = "not run: no checker installed"
PHASES = {"prepare": "checking the data and the sandbox", "start": "starting the engine", "humaneval": "HumanEval",
          "gsm8k": "GSM8K", "determinism": "determinism", "restore": "putting the engine back", "done": "done"}


def run_and_save(settings: Any, spec: Q.QualitySpec, **kw: Any) -> Generator[Any, None, dict[str, Any]]:
    """:func:`engine_manager.bench.quality.run_quality`, then the result saved with :func:`.quality.save` on the same
    worker (as :func:`engine_manager.bench.runner.run_and_save` does for the speed benchmark); the result gains
    ``saved`` (the two paths, or ``error``: why they could not be written)."""
    doc = yield from Q.run_quality(settings, spec, **kw)
    try:
        jp, cp = Q.save(doc)
        doc["saved"] = {"json": str(jp), "csv": str(cp)}
    except OSError as exc:
        doc["saved"] = {"error": str(exc)}
    return doc


def read_last(folder: Path | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The newest quality result saved in the bench folder (``quality_*.json``, by name: the names are times), and
    a line for each newer file that could not be read (on a worker thread)."""
    folder = Path(folder) if folder is not None else results.bench_dir()
    skipped: list[str] = []
    for p in sorted(folder.glob("quality_*.json"), reverse=True):
        try:
            raw = read_bytes_nofollow(p, results.RESULT_MAX_BYTES + 1)
            if len(raw) > results.RESULT_MAX_BYTES:
                raise ValueError("too large")
            d = finite_json(json.loads(raw.decode("utf-8")))
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            skipped.append(f"Skipped {p.name}: it cannot be read ({str(exc)[:120]}).")
            continue
        if not isinstance(d, dict) or d.get("schema") != Q.SCHEMA:
            skipped.append(f"Skipped {p.name}: not a quality result of this panel (no schema {Q.SCHEMA}).")
            continue
        d.setdefault("saved", {"json": str(p)})
        return d, skipped
    return None, skipped


def _dicts(x: Any) -> list[dict[str, Any]]:
    return [v for v in x if isinstance(v, dict)] if isinstance(x, list) else []


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "—"


def _cell(text: Any, tip: str | None = None, right: bool = False) -> QTableWidgetItem:
    item = QTableWidgetItem("" if text is None else str(text))
    item.setFlags(item.flags() & ~Qt.ItemFlag.ItemIsEditable)
    if tip:
        item.setToolTip(tip)
    if right:
        item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    return item


def item_text(x: dict[str, Any]) -> str:
    """One item of the result in full: what was asked, what came back, what was expected, and why it failed."""
    parts = [f"{x.get('bench')} {x.get('id')} — {'passed' if x.get('passed') else 'failed'} ({x.get('status')})",
             f"Expected: {x.get('expected')}"]
    if x.get("bench") == "gsm8k":
        parts.append(f"Got: {x.get('got') if x.get('got') is not None else 'no number in the answer'}")
    if x.get("tokens") is not None:
        parts.append(f"Answer tokens: {x.get('tokens')}")
    if x.get("error"):
        parts.append(f"Error: {x.get('error')}")
    parts += ["", "── Prompt ──", str(x.get("prompt") or ""), "", "── Answer ──", str(x.get("answer") or "(none)")]
    if x.get("output"):
        parts += ["", "── The tests' output in the sandbox ──", str(x["output"])]
    return "\n".join(parts)



def _wrapped(text: str) -> QLabel:
    """A caption that wraps (an unwrapped one set the Benchmark tab's, and so the window's, minimum width)."""
    label = QLabel(text)
    label.setWordWrap(True)
    return label

class QualitySection(QWidget):
    """The page. ``run()`` starts a check with the options shown on ``view.tasks`` (key ``quality``); ``cancel()``
    cancels its token (the run stops and puts the engine back as it was). ``finished`` carries the result."""

    finished = Signal(object)

    def __init__(self, view: Any, parent: QWidget | None = None):
        # view: the app.bench_view.BenchView holding this page (its ctx, tasks, engine_name, running, run_button)
        super().__init__(parent)
        self.view = view
        self.ctx = view.ctx
        self.tasks = view.tasks
        self._token: CancelToken | None = None
        self.result: dict[str, Any] | None = None
        self.failed: list[dict[str, Any]] = []
        self.saved_path: str | None = None
        self.formats_seen: list[str] = []             # the progress bar's texts, in order
        self.spec_overrides: dict[str, Any] = {}      # QualitySpec fields set over the options shown (tests, scripts)
        self.item_dialog: QDialog | None = None

        # -- the options dsv41 bench --preset quality takes ---------------------------------------------------
        self.mode = QComboBox()
        self.mode.addItem("Quick: 3 items each, 256-token answers", True)
        self.mode.addItem("Full: 40 HumanEval tasks, 50 GSM8K items", False)
        self.subset = QSpinBox()
        self.subset.setRange(0, 1319)
        self.subset.setSpecialValueText("mode's")
        self.subset.setToolTip("Items per benchmark (--subset N); 'mode's' keeps the quick or full mode's count.")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.seed.setValue(Q.QualitySpec().seed)
        self.seed.setToolTip("The subsets' seed (--seed): the same seed and size ask the same items.")
        self.batch = QSpinBox()
        self.batch.setRange(1, 8)
        self.batch.setValue(Q.QualitySpec().determinism_users)
        self.batch.setToolTip("The determinism check's batch of concurrent requests (--batch N).")
        self.gsm8k = QLineEdit()
        self.gsm8k.setPlaceholderText("GSM8K test items as JSONL (--gsm8k FILE); empty: GSM8K is not run")
        self.gsm8k.setToolTip(Q.GSM8K_WHERE)
        self.browse = QPushButton("Browse…")
        self.browse.clicked.connect(self._browse)
        self.run_button = QPushButton("Run quality check")
        self.run_button.clicked.connect(self.run)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        # three rows, so the tab (and the window) still fits a 1280×800 screen beside the engine column and chat
        grid = QGridLayout()
        grid.addWidget(QLabel("Mode:"), 0, 0)
        grid.addWidget(self.mode, 0, 1, 1, 2)
        grid.addWidget(self.run_button, 0, 3)
        row = QHBoxLayout()
        for label, w in (("Items per benchmark:", self.subset), ("Seed:", self.seed), ("Batch:", self.batch)):
            row.addWidget(QLabel(label))
            row.addWidget(w)
        row.addStretch(1)
        grid.addLayout(row, 1, 0, 1, 4)
        grid.addWidget(QLabel("GSM8K file:"), 2, 0)
        file_row = QHBoxLayout()
        file_row.addWidget(self.gsm8k, 1)
        file_row.addWidget(self.browse)
        grid.addLayout(file_row, 2, 1, 1, 2)
        grid.addWidget(self.cancel_button, 2, 3)
        grid.setColumnStretch(2, 1)

        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.progress.setFormat("idle")
        self.phase_label = QLabel("HumanEval answers run in a sandbox; the engine is started for the check and put "
                                  "back as it was.")
        self.phase_label.setWordWrap(True)

        # -- the result ----------------------------------------------------------------------------------------
        self.verdict = QLabel("No quality check run yet.")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.scores = self._table(SCORE_COLUMNS, "qualityScores")
        self.scores.setRowCount(len(BENCHES))
        self.determinism = self._table(DET_COLUMNS, "qualityDeterminism")
        self.notes = QLabel("")
        self.notes.setWordWrap(True)
        self.notes.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.items = self._table(ITEM_COLUMNS, "qualityFailed")
        self.items.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.items.setSelectionMode(QTableWidget.SelectionMode.SingleSelection)
        self.items.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.items.setWordWrap(False)
        self.items.cellDoubleClicked.connect(lambda r, _c: self.open_item(r))
        self.items_label = _wrapped("Items that failed (double-click one to read it whole):")
        self.open_button = QPushButton("Open item…")
        self.open_button.setEnabled(False)
        self.open_button.clicked.connect(lambda: self.open_item(self.items.currentRow()))
        self.items.itemSelectionChanged.connect(
            lambda: self.open_button.setEnabled(self.items.currentRow() >= 0 and bool(self.failed)))

        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(_wrapped("Scores beside the guides' figures (their fixed-seed subsets) and DeepSeek's API:"))
        ll.addWidget(self.scores)
        ll.addWidget(_wrapped("Determinism: the same prompts alone, then in a batch, temperature 0:"))
        ll.addWidget(self.determinism)
        ll.addWidget(self.notes, 1, Qt.AlignmentFlag.AlignTop)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        head = QHBoxLayout()
        head.addWidget(self.items_label, 1)
        head.addWidget(self.open_button)
        rl.addLayout(head)
        rl.addWidget(self.items, 1)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)

        lay = QVBoxLayout(self)
        lay.addLayout(grid)
        lay.addWidget(self.progress)
        lay.addWidget(self.phase_label)
        lay.addWidget(self.verdict)
        lay.addWidget(split, 1)
        self._fill_scores({})

    def _table(self, columns: tuple[str, ...], name: str) -> QTableWidget:
        # a table scrolls rather than widening the window (the tab's width is the window's minimum at 1280×800)

        t = QTableWidget(0, len(columns))
        t.setObjectName(name)
        t.setHorizontalHeaderLabels(columns)
        t.verticalHeader().setVisible(False)
        t.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        t.setMinimumWidth(200)
        return t

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GSM8K test items (JSONL)", self.gsm8k.text(),
                                              "JSONL (*.jsonl *.json);;All files (*)")
        if path:
            self.gsm8k.setText(path)

    # -- run -----------------------------------------------------------------------------------------------
    def running(self) -> bool:
        return self.tasks.running("quality")

    def spec(self) -> Q.QualitySpec:
        """The options shown as :meth:`QualitySpec.make` takes them from ``dsv41 bench --preset quality``."""
        n = self.subset.value() or None
        kw: dict[str, Any] = {"seed": self.seed.value(), "humaneval_n": n, "gsm8k_n": n,
                              "gsm8k_file": self.gsm8k.text().strip() or None,
                              "determinism_users": self.batch.value()}
        kw.update(self.spec_overrides)
        return Q.QualitySpec.make(self.view.engine_name(), quick=bool(self.mode.currentData()), **kw)

    def run(self) -> None:
        if self.running():
            return
        if self.view.running():
            self.phase_label.setText("The speed benchmark is running: wait for it to end or cancel it first.")
            return
        try:
            spec = self.spec()
        except UserError as exc:
            self.verdict.setText(str(exc))
            return
        self._token = CancelToken()                 # the task's, and what the run watches
        self.result = None
        self.run_button.setEnabled(False)
        self.view.run_button.setEnabled(False)      # one run at a time takes the engine over
        self.cancel_button.setEnabled(True)
        self.progress.setValue(0)
        self.progress.setFormat("starting…")
        self.verdict.setText("Running…")
        session = getattr(self.ctx, "session", None)
        self.ctx.lock_engine("The quality check is running: it starts and stops the engine itself and puts it "
                             "back as it was when it ends. Cancel it in the Benchmark tab to get Start/Stop back "
                             "now.")
        self.tasks.start("quality", run_and_save, self.ctx.settings, spec, hardware=self.ctx.hardware,
                         stop=self._token, token=self._token, on_engine_event=getattr(session, "feed", None),
                         on_event=self._on_event, on_done=self._on_done, on_error=self._on_error,
                         on_finished=self._on_finished)

    def cancel(self) -> None:
        if self._token is not None and self.running():
            self._token.cancel("cancelled")
            self.progress.setFormat("cancelling: putting the engine back…")
            self.cancel_button.setEnabled(False)

    def _on_event(self, ev: Any) -> None:
        match ev:
            case BenchProgress():
                self.progress.setValue(int(ev.fraction * 1000))
                eta = f" — about {ev.eta_s:.0f} s left" if ev.eta_s is not None else ""
                self.progress.setFormat(f"{PHASES.get(ev.phase, ev.phase)}: %p%{eta}")
                self.formats_seen.append(self.progress.format())
                self.phase_label.setText(ev.message)
            case BenchNote(text=text):
                self.ctx.statusMessage.emit(text, 5000)

    def _on_done(self, doc: dict[str, Any] | None) -> None:
        if not doc:
            return
        saved = doc.get("saved") or {}
        if saved.get("error"):
            self.ctx.statusMessage.emit(f"The quality result could not be saved ({saved['error']}); it is shown "
                                        "here.", 8000)
        self.show_result(doc)
        self.finished.emit(doc)

    def _on_error(self, exc: BaseException) -> None:
        self.verdict.setText(f"The quality check failed: {exc}")

    def _on_finished(self) -> None:
        self.ctx.lock_engine(None)
        self.run_button.setEnabled(True)
        self.view.run_button.setEnabled(not self.view.running())
        self.cancel_button.setEnabled(False)
        if self.result is not None:
            cancelled = bool(self.result.get("cancelled"))
            self.progress.setValue(1000)
            self.progress.setFormat("cancelled" if cancelled else "stopped" if self.result.get("error") else "done")
            self.phase_label.setText("Cancelled; the engine is as it was before." if cancelled
                                     else "Done; the engine is as it was before the quality check.")

    # -- the last result -----------------------------------------------------------------------------------
    def load_last(self) -> None:
        """Show the newest saved result (read on a worker) unless a run has shown one meanwhile."""
        self.tasks.start("quality_last", read_last, on_done=self._show_last)

    def _show_last(self, found: tuple[dict[str, Any] | None, list[str]]) -> None:
        doc, skipped = found
        if skipped:
            self.ctx.statusMessage.emit(skipped[0], 10000)
        if doc is not None and self.result is None and not self.running():
            self.show_result(doc)

    # -- rendering -----------------------------------------------------------------------------------------
    def show_result(self, doc: dict[str, Any]) -> None:
        self.result = doc
        self.saved_path = (doc.get("saved") or {}).get("json")
        text = str(doc.get("verdict") or "")
        if text.startswith("SIMULATED"):
            text = "<b>SIMULATED</b>" + text[len("SIMULATED"):]
        eng = doc.get("engine") if isinstance(doc.get("engine"), dict) else {}
        spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
        head = (f"<b>{doc.get('id')}</b> — {eng.get('label') or eng.get('engine') or '?'}, "
                f"{'quick' if spec.get('quick') else 'full'}, seed {spec.get('seed')}")
        self.verdict.setText(f"{head}<br>{text}")
        self._fill_scores(doc)
        self._fill_determinism(doc)
        self.failed = [x for x in _dicts(doc.get("items")) if not x.get("passed")]
        self._fill_items()
        ifeval = doc.get("ifeval") if isinstance(doc.get("ifeval"), dict) else {}
        notes = [f"IFEval — {ifeval.get('why') or Q.IFEVAL_WHY}"]
        notes += [str(n) for n in doc.get("notes") or [] if isinstance(n, str)]
        if self.saved_path:
            notes.append(f"Saved: {self.saved_path} (+ .csv).")
        self.notes.setText("\n".join(notes))

    def _fill_scores(self, doc: dict[str, Any]) -> None:
        scores = doc.get("scores") if isinstance(doc.get("scores"), dict) else {}
        notes = [str(n) for n in doc.get("notes") or [] if isinstance(n, str)]
        ifeval_why = (doc.get("ifeval") or {}).get("why") if isinstance(doc.get("ifeval"), dict) else None
        for i, (b, name) in enumerate(BENCHES):
            sc = scores.get(b) if isinstance(scores.get(b), dict) else {}
            guide = sc.get("guide", Q.GUIDE_SCORES.get(b))
            api = sc.get("deepseek_api", Q.DEEPSEEK_API_SCORES.get(b))
            stock = sc.get("stock_llamacpp", Q.STOCK_LLAMACPP_SCORES.get(b))
            n = sc.get("items") or 0
            tip: str | None = None
            if b == "ifeval":
                score, tip = IFEVAL_CELL, str(ifeval_why or Q.IFEVAL_WHY)
            elif not doc:
                score = ""
            elif n:
                score = f"{_num(sc.get('score'))} ({sc.get('passed', 0)}/{n})"
            else:        # the run's note says why (no GSM8K file, no sandbox here)
                why = [t for t in notes if t.startswith(f"{name.split()[0]} was not measured")]
                tip = why[0] if why else None
                score = "not run" + ((": no file given" if b == "gsm8k" else ": no sandbox here") if why else "")
            cells = (name, str(n) if doc and b != "ifeval" else "—", score, _num(guide), _num(api), _num(stock))
            for j, text in enumerate(cells):
                self.scores.setItem(i, j, _cell(text, tip if j == 2 else None, right=j in (1, 3, 4, 5)))
        self.scores.resizeColumnsToContents()
        self._fit_height(self.scores)

    def _fill_determinism(self, doc: dict[str, Any]) -> None:
        rows = _dicts(doc.get("determinism"))
        self.determinism.setRowCount(len(rows))
        for i, r in enumerate(rows):
            prompts, same = r.get("prompts"), r.get("identical")
            fd = r.get("first_divergence_min")
            if fd is not None:
                where = f"token {fd}"
            elif same == prompts:
                where = "none"
            else:
                where = "— (a request failed)"
            label = str(r.get("label") or r.get("mode")) + (" (simulated)" if r.get("simulated") else "")
            cells = (label, prompts, r.get("users"), f"{same} of {prompts}", where)
            for j, text in enumerate(cells):
                self.determinism.setItem(i, j, _cell(text, right=j in (1, 2)))
        self.determinism.resizeColumnsToContents()
        self._fit_height(self.determinism)

    def _fill_items(self) -> None:
        self.items.setRowCount(len(self.failed))
        for i, x in enumerate(self.failed):
            if x.get("bench") == "gsm8k":
                got = x.get("got") if x.get("got") is not None else "(no number)"
            else:
                got = " ".join(str(x.get("answer") or "(no answer)").split())[:160]
            status = x.get("status")
            if x.get("bench") == "gsm8k" and status == "answered":
                status = "wrong number"
            cells = (x.get("id"), status, x.get("expected"), got)
            for j, text in enumerate(cells):
                self.items.setItem(i, j, _cell(text, "Double-click to read the item whole" if j == 0 else None))
        self.items_label.setText(f"Items that failed ({len(self.failed)}; double-click one to read it whole):"
                                 if self.failed else "No item failed." if self.result else
                                 "Items that failed (double-click one to read it whole):")
        self.open_button.setEnabled(False)

    @staticmethod
    def _fit_height(t: QTableWidget) -> None:
        h = t.horizontalHeader().height() + sum(t.rowHeight(r) for r in range(t.rowCount())) + 2 * t.frameWidth()
        t.setFixedHeight(max(h, t.horizontalHeader().height() + 24))

    def open_item(self, row: int) -> None:
        """The failed item in ``row`` whole (prompt, answer, expected, the sandbox's output) in a dialog."""
        if not 0 <= row < len(self.failed):
            return
        x = self.failed[row]
        if self.item_dialog is not None:
            self.item_dialog.close()
        dlg = QDialog(self)
        dlg.setWindowTitle(f"{x.get('bench')} {x.get('id')}")
        dlg.resize(820, 600)
        text = QPlainTextEdit(item_text(x))
        text.setObjectName("qualityItemText")
        text.setReadOnly(True)
        text.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(dlg.close)
        lay = QVBoxLayout(dlg)
        lay.addWidget(text, 1)
        lay.addWidget(buttons)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dlg.destroyed.connect(lambda *_: setattr(self, "item_dialog", None))
        self.item_dialog = dlg
        dlg.show()
