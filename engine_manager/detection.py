"""What answers at a URL, in plain words (:class:`Detection`), and the words for a request that never got an answer
(:func:`transport_problem`): shared by saved connections (``engine_manager.connections.detect``) and the InferenceKey
endpoint probe (``engine_manager.inferencekey.endpoint``), below both."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .engines.base import mask_in
from .engines.registry import TraitTable

DETECT_TIMEOUT_S = 5.0              # each read (httpx's timeout)
DETECT_DEADLINE_S = 10.0            # the whole detection, every request together
KIND_LABELS = TraitTable("kind_label")


@dataclass
class Detection:
    """What answers at a URL, in plain words. ``ok``: an LLM server answered and accepted the key."""

    base_url: str
    ok: bool = False
    kind: str | None = None            # engine adapter name (engine_manager.engines), when recognised
    problem: str | None = None         # refused | tls | timeout | slow | dns | auth | not_llm | http | a tunnel cause
    message: str = ""                  # in plain words; what to do names the `dsv41` commands
    gui_message: str = ""              # the same in the window's words, where they differ (empty: ``message``)
    found: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)      # the first MODELS_KEPT ids of the server's list
    models_total: int = 0                                # how many the list held
    simulated: bool = False

    @property
    def label(self) -> str:
        return KIND_LABELS.get(self.kind or "", "unknown")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        return d

    def words(self, gui: bool = False) -> str:
        """The message for the CLI (``gui`` False) or the window."""
        return (self.gui_message or self.message) if gui else self.message

    def summary(self, gui: bool = False) -> str:
        lines = [self.words(gui)]
        if self.found:
            lines.append("found: " + "; ".join(self.found))
        if self.missing:
            lines.append("missing: " + "; ".join(self.missing))
        return "\n".join(lines)

    def masked(self, secrets: list[str]) -> "Detection":
        """The same detection with each of ``secrets`` masked in every text a server could have put it in (a
        server that echoes the key in an error must not get it printed or saved)."""
        if not any(secrets):
            return self
        self.message = mask_in(self.message, secrets)
        self.gui_message = mask_in(self.gui_message, secrets)
        self.found = [mask_in(x, secrets) for x in self.found]
        self.missing = [mask_in(x, secrets) for x in self.missing]
        self.models = [mask_in(x, secrets) for x in self.models]
        return self


def transport_problem(exc: BaseException, url: str, timeout_s: float = DETECT_TIMEOUT_S,
                       deadline_s: float = DETECT_DEADLINE_S) -> tuple[str, str]:
    import ssl

    import httpx

    from .engines._http import AnswerTooSlow

    text = str(exc)
    if isinstance(exc, AnswerTooSlow):
        return "slow", (f"{url} is too slow: its answers did not arrive within {deadline_s:g} s (the server sends "
                        "slowly or stalls). It may be overloaded, or not an engine; check the address and port.")
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(x, ssl.SSLError) for x in chain) or "SSL" in text or "certificate" in text.lower():
        if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text.lower():
            return "tls", (f"TLS failed at {url}: the server there speaks plain HTTP. Use http:// instead of "
                           "https:// in the connection.")
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower():
            return "tls", (f"TLS failed at {url}: the server's certificate is not trusted ({text}). Give the "
                           "server a certificate your system trusts, or reach it over SSH (`--ssh HOST`) with "
                           "http:// on its loopback.")
        return "tls", f"TLS failed at {url} ({text}). Check that the server really serves https on that port."
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", (f"{url} did not answer within {timeout_s:g} s: a firewall may drop the "
                           "connection, or the server is overloaded. Check the address and port.")
    low = text.lower()
    if "name or service not known" in low or "nodename nor servname" in low or "no address associated" in low \
            or "temporary failure in name resolution" in low:
        return "dns", f"The host name in {url} could not be resolved: check its spelling."
    if isinstance(exc, httpx.ConnectError) or "connection refused" in low:
        return "refused", (f"Nothing listens at {url} (connection refused): wrong port, or the engine is not "
                           "running. Check the port the engine was started with.")
    if isinstance(exc, httpx.RemoteProtocolError):
        return "not_llm", (f"The program at {url} does not speak HTTP ({text[:200]}): wrong port? If it speaks "
                           "https, use https:// in the connection.")
    return "http", f"Could not talk to {url}: {text[:200]}."
