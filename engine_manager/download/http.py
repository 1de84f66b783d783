"""HTTP: one ranged GET with ``http.client`` (the package docstring has the measurement), the hub's
endpoint and token, and the hub's errors in plain words."""

from __future__ import annotations

import http.client
import os
import re
import socket
import ssl
import urllib.request
from typing import Callable
from urllib.parse import urljoin, urlsplit

from ..settings import Settings
from .events import (
    HubError,
)


def hf_token(settings: Settings | None) -> str | None:
    """The token: ``HF_TOKEN`` from the environment, else the ``hf_token`` setting. Never printed."""
    return os.environ.get("HF_TOKEN") or (settings.hf_token if settings else "") or None


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` read now (huggingface_hub reads it once at import)."""
    from huggingface_hub import constants
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _scrub(text: str, token: str | None) -> str:
    if token and token in text:
        text = text.replace(token, "***")
    return text


def _ssl_context() -> ssl.SSLContext:
    try:
        import certifi
        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:  # pragma: no cover
        return ssl.create_default_context()


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection for ``url`` (through the environment's proxy if one applies) and the request target."""
    u = urlsplit(url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    target = u.path + (f"?{u.query}" if u.query else "")
    proxies = urllib.request.getproxies()
    proxy = proxies.get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        pu = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        phost = pu.hostname or ""
        if u.scheme == "https":
            tunnel = http.client.HTTPSConnection(phost, pu.port or 80, timeout=timeout, context=_ssl_context())
            tunnel.set_tunnel(host, port)
            return tunnel, target
        return http.client.HTTPConnection(phost, pu.port or 80, timeout=timeout), url
    if u.scheme == "https":
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=_ssl_context()), target
    return http.client.HTTPConnection(host, port, timeout=timeout), target


class _HTTPStatus(Exception):
    def __init__(self, status: int, url: str, reason: str = ""):
        self.status, self.url, self.reason = status, url, reason
        super().__init__(f"HTTP {status} {reason}".strip())


def _abort_connection(conn: http.client.HTTPConnection) -> None:
    """From another thread: make a blocked read on ``conn`` return now (shutdown, not close, is thread-safe)."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _ranged_get(url: str, headers: dict[str, str], offset: int, timeout: float,
                on_connection: Callable[[http.client.HTTPConnection], None] | None = None
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, int]:
    """GET ``url`` from byte ``offset``; follows redirects (dropping Authorization when the host changes).
    Returns the connection, the response (2xx) and the offset the body starts at. ``on_connection`` sees each
    connection once it is open (so a cancel can abort it)."""
    hdrs = dict(headers)
    hdrs["Accept-Encoding"] = "identity"
    if offset > 0:
        hdrs["Range"] = f"bytes={offset}-"
    for _ in range(10):
        conn, target = _connection(url, timeout)
        if on_connection is not None:
            conn.connect()
            on_connection(conn)
        conn.request("GET", target, headers=hdrs)
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
            new = urljoin(url, resp.getheader("Location"))
            resp.close()
            conn.close()
            if urlsplit(new).netloc != urlsplit(url).netloc:
                hdrs = {k: v for k, v in hdrs.items() if k.lower() != "authorization"}
            url = new
            continue
        if resp.status == 206:
            m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.getheader("Content-Range") or "")
            start = int(m.group(1)) if m else -1
            if start != offset:
                resp.close()
                conn.close()
                raise _HTTPStatus(206, url, f"the server answered a range from byte {start}, not {offset}")
            return conn, resp, offset
        if resp.status == 200:
            return conn, resp, 0
        reason = resp.reason
        resp.close()
        conn.close()
        raise _HTTPStatus(resp.status, url, reason)
    raise _HTTPStatus(310, url, "too many redirects")


def _hub_error(exc: BaseException, token: str | None) -> HubError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    text = _scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, token)
    if isinstance(exc, GatedRepoError):
        return HubError(f"The repository is gated: {text}",
                        "Accept its terms on the hub with your account, then set HF_TOKEN (or the hf_token "
                        "setting) to a token of that account.")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"The hub says the repository does not exist or needs a token ({text}).",
                        "Check DSV41_MODEL_REPO; if the repository is private or gated, set HF_TOKEN (or the "
                        "hf_token setting) to a token that can read it.")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"The revision does not exist on the hub ({text}).",
                        "Check DSV41_MODEL_REVISION (a branch, tag or 40-hex commit).")
    if isinstance(exc, HfHubHTTPError):
        code = exc.response.status_code if exc.response is not None else "?"
        if code in (401, 403):
            return HubError(f"The hub refused access (HTTP {code}).",
                            "Set HF_TOKEN (or the hf_token setting) to a token that can read the repository.")
        if code == 404:
            return HubError(f"The hub answered HTTP 404 (not found): {text}",
                            "Check DSV41_MODEL_REPO and DSV41_MODEL_REVISION; the file may have been removed at "
                            "that revision.")
        return HubError(f"The hub answered HTTP {code}: {text}", "Try again later; the download resumes.")
    return HubError(f"Could not reach the hub at {hub_endpoint()} ({type(exc).__name__}: {text}).",
                    "Check the network connection, the proxy settings and HF_ENDPOINT, then run the download again.")
