"""Which engine events deserve a desktop notification, each said once: the engine crashed, stalled, or a
planned-vs-measured check failed.

:class:`NoticeFilter` is fed what the window hears — the engine's state events (``StateChanged``; the crash's cause
from ``Supervisor.last_failure``), the Monitor's samples (a :class:`~engine_manager.watchdog.Watchdog` judges
them), the checks' reports (:func:`engine_manager.checks.collect_checks`) — and answers a :class:`Notice` only
when something *begins*: entering ``crashed`` from a running state, the watchdog turning ``stalled``, a check that
was not failing before. The same episode is never said twice. Qt-free; the GUI sends the notices
(``app/notify.py``), only when the ``desktop_notifications`` setting is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .checks import failed
from .engine_state import CRASHED, RUNNING_STATES
from .watchdog import STALLED, Watchdog

STALL_CAUSE = "engine_stalled"          # engines.strata's crash cause: the engine's own watchdog stopped it


@dataclass(frozen=True)
class Notice:
    key: str            # "crashed" | "stalled" | "checks"
    title: str
    body: str


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class NoticeFilter:
    def __init__(self, watchdog: Watchdog | None = None):
        self.watchdog = watchdog if watchdog is not None else Watchdog()
        self._state: str | None = None
        self._stalled = False
        self._failing: set[str] = set()

    def state(self, state: str, message: str = "", cause: str | None = None) -> Notice | None:
        """One engine state event. A notice when the engine enters ``crashed`` from a running state (a crash the
        panel saw, not one it found at start-up); ``cause`` says whether it was a stall."""
        prev, self._state = self._state, state
        if state != CRASHED or prev not in RUNNING_STATES:
            return None
        if cause == STALL_CAUSE:
            return Notice("stalled", "dsv41: the engine stalled and stopped itself",
                          (message or "It made no progress during a request.") + " Start it again from the panel.")
        return Notice("crashed", "dsv41: the engine crashed",
                      (message or "The engine ended without being asked to.") + " The panel says why and what to do.")

    def sample(self, sample: Any) -> Notice | None:
        """One Monitor sample (``AppContext.sampleArrived``: the engine's Sample with the panel's figures under
        ``extra['panel']``). A notice when the watchdog turns ``stalled``; again only after it recovered."""
        extra = getattr(sample, "extra", None) or {}
        panel = extra.get("panel") or {}
        missing = extra.get("missing")
        live = self.watchdog.feed_sample(None if missing else sample, t=getattr(sample, "t", None),
                                         mono=_num(extra.get("mono")),
                                         cpu_pct=_num(panel.get("engine_cpu_pct")),
                                         gpu_util_pct=_num(panel.get("gpu_util_pct")),
                                         gpu_power_w=_num(panel.get("gpu_power_w")), missing=str(missing or ""))
        was, self._stalled = self._stalled, live.state == STALLED
        if self._stalled and not was:
            return Notice("stalled", "dsv41: the engine seems stalled", live.detail[:1].upper() + live.detail[1:])
        return None

    def checks(self, checks: Iterable[Any]) -> Notice | None:
        """One planned-vs-measured report's checks. A notice when a check fails that was not failing at the last
        report; checks that pass again are forgotten (a later failure is news again)."""
        bad = failed(checks)
        names = {c.name for c in bad}
        new = [c for c in bad if c.name not in self._failing]
        self._failing = names
        if not new:
            return None
        first = new[0]
        more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
        return Notice("checks", "dsv41: not as planned",
                      f"{first.title}{more}: planned {first.planned or '—'}, measured {first.measured or '—'}. "
                      f"{first.fix}".strip())

    def new_watched(self) -> None:
        """Another engine is watched (or none): its samples start a new watchdog history."""
        self.watchdog = Watchdog(self.watchdog.setting_s)
        self._stalled = False

    def new_own(self) -> None:
        """The panel's own engine changed (its checks are about it): a failing check is news again."""
        self._failing = set()


__all__ = ["Notice", "NoticeFilter", "STALL_CAUSE"]
