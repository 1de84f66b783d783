"""An InferenceKey endpoint as a saved connection: the URL's shape, the key, detection, and the backend's JSON answer
unwrapped (no Qt, no SDK import: the chat and ``dsv41 connections`` use it without the ``inferencekey`` package).

What the platform documents (inferencekey/inferencekey-sdk): the data plane is
``{base}/endpoint/{project}/{workload}/v1/{path}`` (core/src/pipelines/data.rs@595efc4 ``build_endpoint_url``;
docs/src/content/docs/en/reference/wire-format.mdx, "Data plane"), with ``POST /chat/completions`` and ``POST
/embeddings`` only (no model list, health or metrics); its key is an ``ik_live_`` key, an ``ik_sdk_`` token there a
403 ``wrong_credential_type`` (wire-format.mdx "Wrong-token errors"; inferencekey/clients.py
``DataClient.endpoint``); the SDK's client sends ``model`` = the workload's slug ("default" without one) and reads
``choices[0].message.content`` (data.rs ``build_chat_body``, ``resolve_model``, ``parse_chat_result``). It does not
fix how a custom backend's ``Result(output=...)`` becomes that content (inferencekey/backend/base.py@d6a89a0 ``Job``,
``Result``): :func:`unwrap` takes it to be the backend's output as JSON (``{text, reasoning, finish_reason, usage,
timings}`` from :class:`engine_manager.inferencekey.backend.DeepSeekOneGpuBackend`), also inside ``{"output": ...}``
(``Result.to_wire``); anything else is shown as it came, said in plain words not to be the backend's result.
A custom backend answers a job whole (``process(job)`` returns once), so the endpoint is asked without streaming.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping
from ..tls import verify as tls_verify

if TYPE_CHECKING:
    from ..detection import Detection

KIND = "inferencekey"
KEY_PREFIX = "ik_live_"
CONTROL_PREFIX = "ik_sdk_"
#: the one line both front ends show for such an endpoint
NO_STREAMING = ("An InferenceKey endpoint answers whole, not streamed (its custom backend returns each answer at "
                "once): the answer appears when it is complete.")
CONTENT_CAP = 16 * 2**20            # characters of content parsed as JSON; more is never this backend's result
TEXT_FIGURE_MAX = 1e12

_SLUG = r"[A-Za-z0-9][A-Za-z0-9._~-]{0,127}"
_PATH_RE = re.compile(rf"^(?P<prefix>(?:/[^/]+)*?)/endpoint/(?P<project>{_SLUG})/(?P<workload>{_SLUG})(?:/v1)?/?$")


@dataclass(frozen=True)
class EndpointRef:
    """Where one workload's endpoint is: ``chat_base`` is the URL the chat appends ``/v1/chat/completions`` to."""

    project: str
    workload: str
    chat_base: str          # …/endpoint/<project>/<workload>
    v1: str                 # …/endpoint/<project>/<workload>/v1


def endpoint_ref(url: str | None) -> EndpointRef | None:
    """The endpoint a URL names when its path is ``/endpoint/<project>/<workload>`` (``/v1`` optional); else None."""
    if not isinstance(url, str) or len(url) > 4096:
        return None
    try:
        parts = urllib.parse.urlsplit(url.strip())
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        return None
    m = _PATH_RE.match(parts.path)
    if m is None:
        return None
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc,
                                    f"{m['prefix']}/endpoint/{m['project']}/{m['workload']}", "", ""))
    return EndpointRef(m["project"], m["workload"], base, base + "/v1")


def key_problem(api_key: str | None) -> str | None:
    """Why ``api_key`` cannot be an endpoint's key (plain words), or None when it looks like one."""
    if not api_key:
        return ("An InferenceKey endpoint needs its data-plane key (ik_live_…): give it with --api-key-file or "
                "--api-key-stdin (the InferenceKey dashboard shows it with the workload).")
    if api_key.startswith(CONTROL_PREFIX):
        return ("That is an InferenceKey control-plane token (ik_sdk_…), which the endpoint refuses (403 "
                "wrong_credential_type) and which must not travel with every chat: give the workload's data-plane "
                "key (ik_live_…) instead.")
    if not api_key.startswith(KEY_PREFIX):
        return ("That key does not look like an InferenceKey data-plane key: those start with ik_live_. Copy the "
                "workload's key from the InferenceKey dashboard and add the connection again.")
    return None


def detect_endpoint(url: str, api_key: str | None, *, timeout_s: float, deadline_s: float,
                    verify: Any = True) -> "Detection":
    """:func:`engine_manager.connections.detect` for a URL of an endpoint's shape: the key's prefix, then one
    ``GET …/v1/models`` with the key (size-capped, within ``deadline_s``) that says whether something answers there
    and whether it takes the key (401/403: refused). The data plane documents no such route, so any other answer
    (404 included) is an endpoint that answers; nothing is generated (no GPU time)."""
    import httpx

    from ..detection import Detection, transport_problem
    from ..engines._http import AnswerTooLarge, AnswerTooSlow, bearer_headers, error_message, get_capped
    from ..tunnel import transport_for

    ref = endpoint_ref(url)
    det = Detection(base_url=url.rstrip("/"))
    if ref is None:                    # pragma: no cover - the caller checked the shape
        det.problem, det.message = "not_llm", f"{url} is not an InferenceKey endpoint's address."
        return det
    det.kind = KIND
    det.found.append(f"the address of an InferenceKey endpoint (project {ref.project}, workload {ref.workload})")
    problem = key_problem(api_key)
    if problem is not None:
        det.problem, det.message = "auth", problem
        return det.masked([api_key] if api_key else [])
    secrets = [api_key] if api_key else []
    probe = ref.v1 + "/models"
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=bearer_headers(api_key), trust_env=False,
                          verify=tls_verify(verify), follow_redirects=False,
                          transport=transport_for(probe, verify=verify)) as client:
            r = get_capped(client, probe, deadline_s=deadline_s)
    except AnswerTooLarge:
        r = None
    except (httpx.HTTPError, OSError, AnswerTooSlow) as exc:
        det.problem, det.message = transport_problem(exc, ref.v1, timeout_s, deadline_s)
        return det.masked(secrets)
    if r is not None and r.status_code in (401, 403):
        said = error_message(r)[:300]
        det.problem = "auth"
        det.message = (f"The InferenceKey endpoint at {ref.v1} refused the key (HTTP {r.status_code}"
                       + (f": {said}" if said else "") + "). Give the workload's own ik_live_ key: add the "
                       "connection again with --replace.")
        return det.masked(secrets)
    code = "an answer too large to read" if r is None else f"HTTP {r.status_code}"
    det.found.append(f"GET /v1/models answered {code} with the key (the endpoint serves chat completions)")
    det.missing.append("load figures: an InferenceKey endpoint reports none (the worker's own panel shows its "
                       "engine)")
    det.missing.append("streaming: the custom backend answers whole")
    det.ok = True
    det.message = f"InferenceKey endpoint at {ref.v1} (workload {ref.workload})"
    return det.masked(secrets)


# -- the backend's answer ----------------------------------------------------------------------------------------
@dataclass
class Unwrapped:
    """The backend's result read from an endpoint's content. ``problem``: plain words when the content is not that
    result (``text`` is then the content as it came, nothing else is known)."""

    text: str
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    engine_timings: dict[str, float] = field(default_factory=dict)     # the engine's own (llama.cpp names)
    ttft_s: float | None = None
    tok_s: float | None = None
    engine_tok_s: float | None = None
    engine_prompt_tok_s: float | None = None
    total_s: float | None = None
    note: str | None = None
    problem: str | None = None


def _figure(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if not math.isfinite(v) or v < 0 or v > TEXT_FIGURE_MAX:
        return None
    return v


def _figures(d: Any, limit: int = 64) -> dict[str, Any]:
    if not isinstance(d, Mapping):
        return {}
    out: dict[str, Any] = {}
    for k, v in list(d.items())[:limit]:
        f = _figure(v)
        if isinstance(k, str) and len(k) <= 64 and f is not None:
            out[k] = f
    return out


def _shape(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", int: "a number", float: "a number",
            bool: "true or false", type(None): "null"}.get(type(v), "something else")


def unwrap(content: str) -> Unwrapped:
    """Read the backend's JSON result out of an endpoint's answer text (see the module docstring). Never raises:
    content that is not the result comes back as it came, with ``problem`` saying why in plain words."""
    if len(content) > CONTENT_CAP:
        return Unwrapped(content, problem=(
            f"The InferenceKey endpoint's answer is {len(content):,} characters, more than the backend's result "
            f"ever is ({CONTENT_CAP:,}), so it was not read as one; it is shown as it came."))
    try:
        data = json.loads(content)
    except RecursionError:
        data = None
        why = "JSON nested too deeply to read"
    except ValueError:
        data = None
        why = "plain text, not JSON"
    else:
        why = ""
    if isinstance(data, Mapping) and isinstance(data.get("output"), Mapping) and "text" not in data:
        data = data["output"]                                     # Result.to_wire: {"output": {...}}
    if not isinstance(data, Mapping) or not isinstance(data.get("text"), str):
        if not why:
            why = (f"JSON without the answer's text ({_shape(data)}" + (
                f" whose text is {_shape(data.get('text'))}" if isinstance(data, Mapping) and "text" in data
                else "") + ")")
        return Unwrapped(content, problem=(
            f"The InferenceKey endpoint answered with {why}, not with the DeepSeek backend's result "
            "({text, reasoning, usage, timings}): its answer is shown as it came, and its reasoning, token counts "
            "and timings are unknown. Is this endpoint's workload running the dsv41 backend?"))
    reasoning = data.get("reasoning")
    fr = data.get("finish_reason")
    note = data.get("note")
    raw_timings = data.get("timings")
    timings: Mapping[str, Any] = raw_timings if isinstance(raw_timings, Mapping) else {}
    usage = {k: int(v) for k, v in _figures(data.get("usage")).items()
             if k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return Unwrapped(
        text=data["text"],
        reasoning=reasoning if isinstance(reasoning, str) else "",
        finish_reason=fr[:64] if isinstance(fr, str) and fr else None,
        usage=usage,
        engine_timings=_figures(timings.get("engine")),
        ttft_s=_figure(timings.get("ttft_s")),
        tok_s=_figure(timings.get("tok_s")),
        engine_tok_s=_figure(timings.get("engine_tok_s")),
        engine_prompt_tok_s=_figure(timings.get("engine_prompt_tok_s")),
        total_s=_figure(timings.get("total_s")),
        note=note[:1000] if isinstance(note, str) and note else None,
    )


def rewrap(whole: Any) -> tuple[Any, Unwrapped | None]:
    """An endpoint's whole chat answer with its first choice's content unwrapped (:func:`unwrap`) into an answer of
    the usual shape — ``message.content`` the text, ``message.reasoning_content`` the reasoning, the result's
    finish reason, usage and engine timings — so the chat client reads it as any engine's. An answer whose first
    choice has no text content is handed back as it is (the client's own checks say what is wrong with it)."""
    if not isinstance(whole, Mapping):
        return whole, None
    choices = whole.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return whole, None
    msg = choices[0].get("message")
    content = msg.get("content") if isinstance(msg, Mapping) else None
    if not isinstance(content, str):
        return whole, None
    u = unwrap(content)
    if u.problem is not None:
        return {"choices": [{"message": {"content": content}, "finish_reason": choices[0].get("finish_reason")}],
                "usage": whole.get("usage")}, u
    message: dict[str, Any] = {"content": u.text}
    if u.reasoning:
        message["reasoning_content"] = u.reasoning
    out: dict[str, Any] = {"choices": [{"message": message, "finish_reason": u.finish_reason}]}
    out["usage"] = u.usage or whole.get("usage")
    if u.engine_timings:
        out["timings"] = u.engine_timings
    return out, u


def apply_figures(stats: Any, u: Unwrapped) -> None:
    """The figures measured on the worker (the result's ``timings``) in the answer's stats: first token, tok/s and
    the engine's rates as the backend measured them (one whole answer measures nothing here but its round trip)."""
    for name, v in (("ttft_s", u.ttft_s), ("tok_s", u.tok_s), ("engine_tok_s", u.engine_tok_s),
                    ("engine_prompt_tok_s", u.engine_prompt_tok_s)):
        if v is not None:
            setattr(stats, name, float(v))
    extra = {k: v for k, v in (("backend_total_s", u.total_s), ("backend_ttft_s", u.ttft_s),
                               ("backend_tok_s", u.tok_s)) if v is not None}
    if extra:
        stats.timings = {**(stats.timings or {}), **extra}
