"""The one event base of the core.

Every long operation in ``engine_manager`` (the supervisor, downloads, provisioning, the benchmark) is a generator
yielding events derived from :class:`Event`: frozen dataclasses with a ``kind`` (their tag for JSON and the GUI),
the time they happened (``t``, keyword-only so subclasses keep their positional fields) and :meth:`to_dict`.
Front ends consume them with ``match`` (``case Ready(base_url=url): ...``). Imports nothing from the package.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = "event"
    t: float = field(default_factory=time.time, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind
        return d
