"""What the engine panel shows of the watchdog's verdict, and when it restarts a stalled engine by itself.

:class:`StallEpisode` is fed each :class:`~engine_manager.watchdog.Liveness` of the watched engine (the one watchdog
``app.notify.Notifier`` feeds from the Monitor's samples) and answers a :class:`LivenessLine`: "Engine stalled: …"
(amber) or "Engine unavailable: …" (red) in the watchdog's own words and figures, whether to offer Restart (only
for the panel's own engine), and whether to restart it now — once per episode, only for a stall, only when the
"Restart after a crash" setting (``auto_restart``) is on. An episode ends when the engine is serving or idle
again (progress); "not answering" and "down" leave it open (the Monitor and the crash banner say those).
Qt-free; ``app/engine_panel.py`` draws the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .watchdog import IDLE, OK, STALLED, UNAVAILABLE

TITLES = {STALLED: "Engine stalled", UNAVAILABLE: "Engine unavailable"}


@dataclass(frozen=True)
class LivenessLine:
    text: str
    severe: bool            # unavailable: red; stalled: amber
    offer_restart: bool     # a Restart button (the panel's own engine, not being restarted already)
    restart_now: bool       # restart it now: auto_restart is on and this stall was not restarted yet


class StallEpisode:
    def __init__(self) -> None:
        self.restarted = False          # this episode's one automatic restart was made

    def end(self) -> None:
        self.restarted = False

    def judge(self, live: Any, *, own: bool, auto_restart: bool) -> LivenessLine | None:
        """The line for ``live`` (a Liveness; None: nothing to say). ``own``: the watched engine is the panel's
        own and the panel may restart it; ``auto_restart``: the setting."""
        state = getattr(live, "state", None)
        if state in (OK, IDLE):
            self.end()                  # progress again (or nothing in flight): the episode is over
            return None
        if state not in TITLES:
            return None
        detail = str(getattr(live, "detail", "") or state)
        now = own and auto_restart and state == STALLED and not self.restarted
        text = f"{TITLES[state]}: {detail}"
        if now:
            self.restarted = True
            text += (". “Restart after a crash” is on: the panel restarts it now (once for this stall).")
        elif own and auto_restart and state == STALLED:
            text += ". It was restarted once for this stall already: restart it again, or stop it and read the log."
        return LivenessLine(text, severe=state == UNAVAILABLE, offer_restart=own and not now, restart_now=now)


__all__ = ["LivenessLine", "StallEpisode", "TITLES"]
