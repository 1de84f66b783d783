"""The benchmark's result document, its table beside the guides' figures, saving (JSON + CSV), history, compare.

Schema ``dsv41-bench``, ``schema_version`` 1 (fields may be added within a version; none is removed or changes meaning
without a new version): ``id``, ``started_at``, ``finished_at``, ``duration_s``, ``cancelled``, ``error``;
``simulated`` (the scripted engine ran: every figure checks the wiring, not the host); ``engine`` (argv, key masked),
``model_comparable``, ``engine_version`` / ``engine_build`` / ``engine_args`` (``runner.engine_facts``; None:
unknown); ``spec``, ``token_ratio``, ``settings`` (no secrets), ``hardware``, ``plan``; ``configs`` (per configuration
its settings, engine, ``phases`` — ``warmup``, ``users_N`` with median / spread of total, slowest and per-stream
tok/s, TTFT, the engine's own total, client CPU, each repeat, the last repeat's token timeline, ``long_prompt`` — and
``monitor``: hit rate, PCIe RX, swaps per phase); ``table`` (per user count: measured total / slowest / per stream,
the guides' figures, ratios, verdict); ``long_prompt`` (longest gap between tokens, prefill tok/s); ``ab`` (each other
configuration's ratio to the baseline, and the guides'); ``client`` (the client's CPU against wall time); ``verdict``
(in plain words). Files: ``<data dir>/bench/<id>.json`` and ``<id>.csv`` (one row per configuration × phase × repeat ×
stream), written atomically, owner-only."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..atomic import atomic_write_text, read_bytes_nofollow
from ..errors import UserError
from ..metrics.guides import AS_PUBLISHED, GUIDE_HOST, GUIDE_MODEL, GUIDE_TABLE, is_guide_model
from .config import BenchConfig, guide_effect
from .stats import finite_json, measured

SCHEMA = "dsv41-bench"
SCHEMA_VERSION = 1
SECRET_SETTINGS = ("api_key", "hf_token")
_ID_RE = re.compile(r"^bench_\d{8}T\d{6}Z(_\d+)?$")


def bench_dir() -> Path:
    return paths.data_dir() / "bench"


def _med(d: Any) -> float | None:
    return d.get("median") if isinstance(d, dict) else None


def _settings_dict(settings: Any) -> dict[str, Any]:
    try:
        d = settings.model_dump(mode="json")
    except Exception:  # noqa: BLE001
        return {}
    return {k: v for k, v in d.items() if k not in SECRET_SETTINGS}


def _plan_summary(plan: Any) -> dict[str, Any] | None:
    if not isinstance(plan, dict):
        return None
    keep = ("schema", "hot_experts", "cold_experts", "predicted_hit_rate", "refused", "llamacpp_cpu_layers",
            "llamacpp_predicted_hit_rate", "vram", "ram", "settings")
    out = {k: plan.get(k) for k in keep if k in plan}
    model = plan.get("model") or {}
    out["model"] = {k: model.get(k) for k in ("name", "file", "n_layers", "n_experts", "n_experts_used",
                                               "expert_bytes") if k in model}
    return out


def verdict_words(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    if ratio >= AS_PUBLISHED:
        return "as published" if ratio <= 1.1 else "faster than published"
    return "below the guides"


def assemble(doc: dict[str, Any], settings: Any, hardware: Any) -> dict[str, Any]:
    """The full result document from the runner's raw one."""
    started = doc.get("started_at") or time.time()
    out: dict[str, Any] = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                           "id": time.strftime("bench_%Y%m%dT%H%M%SZ", time.gmtime(started))}
    out.update(doc)
    configs = doc.get("configs") or []
    base = configs[0] if configs else {}
    eng = dict(base.get("engine") or {})
    simulated = bool(eng.get("simulated"))
    out["engine"] = eng
    for key in ("engine_version", "engine_build", "engine_args"):
        out[key] = eng.get(key)
    out["simulated"] = simulated
    comparable = is_guide_model(eng.get("model"))
    out["model_comparable"] = comparable
    out["settings"] = _settings_dict(settings)
    try:
        out["hardware"] = hardware.to_dict() if hardware is not None else None
    except Exception:  # noqa: BLE001
        out["hardware"] = None
    try:
        from ..engine_state import read_plan_file
        plan = read_plan_file(eng.get("plan_path")) if eng.get("plan_path") else None
    except Exception:  # noqa: BLE001
        plan = None
    out["plan"] = _plan_summary(plan)
    phases = base.get("phases") or {}
    # the table beside the guides'
    table = []
    for key, ph in phases.items():
        if not key.startswith("users_"):
            continue
        u = int(key.split("_")[1])
        g = GUIDE_TABLE.get(u) if comparable is not False else None
        tot, slow = _med(ph.get("total_tok_s")), _med(ph.get("slowest_tok_s"))
        r_tot = tot / g[0] if g and tot else None
        r_slow = slow / g[1] if g and slow else None
        table.append({
            "users": u, "total_tok_s": tot, "total_spread": (ph.get("total_tok_s") or {}).get("spread"),
            "slowest_tok_s": slow, "per_stream_tok_s": _med(ph.get("per_stream_tok_s")),
            "ttft_s": _med(ph.get("ttft_s")), "engine_total_tok_s": _med(ph.get("engine_total_tok_s")),
            "guide_total_tok_s": g[0] if g else None, "guide_slowest_tok_s": g[1] if g else None,
            "ratio_total": r_tot, "ratio_slowest": r_slow,
            "verdict": verdict_words(r_tot) if comparable is not False else "n/a",
            "prompt_ok": ph.get("prompt_ok"), "simulated": simulated,
        })
    out["table"] = table
    lp = phases.get("long_prompt")
    out["long_prompt"] = None if not lp else {
        "users_decoding": lp.get("users_decoding"), "prompt_tokens": lp.get("prompt_tokens"),
        "prompt_ok": (lp.get("prompt_check") or {}).get("ok"), "pause_s": lp.get("pause_s"),
        "max_gap_s": lp.get("max_gap_s"), "prefill_tok_s_client": lp.get("prefill_tok_s_client"),
        "prefill_tok_s_engine": lp.get("prefill_tok_s_engine"),
        "guide_pause_s": 4.048 if comparable is not False else None, "simulated": simulated}
    # A/B
    from .stats import ratio
    ab = []
    for c in configs[1:]:
        cfg = BenchConfig.from_dict(c.get("config") or {})
        for key, ph in (c.get("phases") or {}).items():
            if not key.startswith("users_") or key not in phases:
                continue
            r = ratio(ph.get("total_tok_s") or {}, phases[key].get("total_tok_s") or {})
            ge = guide_effect(cfg) if key == "users_1" and comparable is not False else None
            ab.append({"config": cfg.name, "label": cfg.label or cfg.name, "users": int(key.split("_")[1]),
                       "total_tok_s": _med(ph.get("total_tok_s")),
                       "baseline_tok_s": _med(phases[key].get("total_tok_s")), **r, "guide_ratio": ge,
                       "simulated": simulated})
    out["ab"] = ab
    # the client's own cost
    shares = {k: _med(ph.get("client_cpu_share")) for k, ph in phases.items() if k.startswith("users_")}
    per_stream = {k: _med(ph.get("client_cpu_per_stream_s")) for k, ph in phases.items() if k.startswith("users_")}
    out["client"] = {"cpu_share_of_wall": shares, "cpu_per_stream_s": per_stream,
                     "limit": 0.05,
                     "ok": all(v is None or v < 0.05 for v in shares.values())}
    out["verdict"] = headline(out)
    return out


def headline(r: dict[str, Any]) -> str:
    """The result in plain words."""
    if r.get("error"):
        return f"The benchmark stopped: {r['error']}"
    if r.get("cancelled"):
        return "Cancelled; the figures measured so far are kept."
    rows = [x for x in r.get("table") or [] if x.get("total_tok_s") is not None]
    if not rows:
        return "No figures were measured."
    model = (r.get("engine") or {}).get("model")
    sim = "SIMULATED — the scripted engine models the guides' table, so this checks the panel's wiring, not this " \
          "host. " if r.get("simulated") else ""
    if r.get("model_comparable") is False:
        parts = ", ".join(f"{x['users']} user{'s' if x['users'] > 1 else ''} {x['total_tok_s']:.1f} tok/s"
                          for x in rows)
        return (f"{sim}Measured {parts}. Comparison n/a: the guides' figures are for {GUIDE_MODEL} on {GUIDE_HOST}; "
                f"this engine runs {model}.")
    ratios = [x["ratio_total"] for x in rows if x.get("ratio_total") is not None]
    if not ratios:
        return f"{sim}Measured; the guides have no figures for these user counts."
    worst = min(rows, key=lambda x: x.get("ratio_total") or 9)
    lo, hi = min(ratios), max(ratios)
    if lo >= AS_PUBLISHED:
        words = f"Performs as published: {lo * 100:.0f}–{hi * 100:.0f}% of the guides' totals at 1/4/8 users."
    else:
        words = (f"Below the guides: {worst['users']} user{'s' if worst['users'] > 1 else ''} at "
                 f"{worst['ratio_total'] * 100:.0f}% of their total ({worst['total_tok_s']:.1f} vs "
                 f"{worst['guide_total_tok_s']:.2f} tok/s). Check the NUMA binding and the hot set (Settings, "
                 "Placement), then run the benchmark again.")
    lp = r.get("long_prompt") or {}
    if lp.get("pause_s") is not None:
        words += f" A {lp.get('prompt_tokens') or 0:,}-token prompt paused the decoding users {lp['pause_s']:.2f} s " \
                 "at most (guides: 4.05 s)."
    return sim + words


# ------------------------------------------------------------------------------------------------ files
def _unique_id(folder: Path, rid: str) -> str:
    out, n = rid, 1
    while (folder / f"{out}.json").exists():
        n += 1
        out = f"{rid}_{n}"
    return out


def to_csv(r: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["config", "phase", "repeat", "stream", "users", "total_tok_s", "stream_tok_s", "ttft_s",
                "engine_tok_s", "prompt_tokens", "tokens", "client_cpu_share", "max_gap_s", "simulated"])
    sim = int(bool(r.get("simulated")))
    for c in r.get("configs") or []:
        name = (c.get("config") or {}).get("name")
        for key, ph in (c.get("phases") or {}).items():
            if key.startswith("users_"):
                for rep in ph.get("repeats") or []:
                    for i, rate in enumerate(rep.get("per_stream_tok_s") or []):
                        w.writerow([name, key, rep.get("repeat"), i, rep.get("users"), _f(rep.get("total_tok_s")),
                                    _f(rate), _f((rep.get("ttft_s") or [None] * (i + 1))[i]),
                                    _f((rep.get("engine_tok_s") or [None] * (i + 1))[i]),
                                    (rep.get("prompt_tokens") or [None] * (i + 1))[i],
                                    (rep.get("tokens") or [None] * (i + 1))[i], _f(rep.get("client_cpu_share")),
                                    "", sim])
            elif key == "long_prompt":
                for i, gap in enumerate(ph.get("max_gap_s") or []):
                    w.writerow([name, key, 0, i, ph.get("users_decoding"), "", "", "", "", ph.get("prompt_tokens"),
                                "", "", _f(gap), sim])
    return buf.getvalue()


def _f(x: Any) -> str:
    v = measured(x, lo=None)
    return "" if v is None else f"{v:.4f}"


def save(r: dict[str, Any], folder: Path | None = None) -> tuple[Path, Path]:
    """Write ``<id>.json`` and ``<id>.csv`` under ``folder`` (default :func:`bench_dir`); returns the paths."""
    folder = Path(folder) if folder is not None else bench_dir()
    r["id"] = _unique_id(folder, r.get("id") or time.strftime("bench_%Y%m%dT%H%M%SZ", time.gmtime()))
    jp, cp = folder / f"{r['id']}.json", folder / f"{r['id']}.csv"
    # strict JSON: a figure that is not finite is written as missing (null), never as Infinity / NaN
    text = json.dumps(finite_json(r), indent=2, sort_keys=True, default=str, allow_nan=False) + "\n"
    atomic_write_text(jp, text)
    atomic_write_text(cp, to_csv(r))
    return jp, cp


def load(ref: str | Path, folder: Path | None = None) -> dict[str, Any]:
    """A saved run by id (``bench_…``) or path; :class:`UserError` in plain words when it cannot be read."""
    folder = Path(folder) if folder is not None else bench_dir()
    p = Path(ref)
    if not p.suffix and _ID_RE.match(str(ref)):
        p = folder / f"{ref}.json"
    try:
        raw = read_bytes_nofollow(p, RESULT_MAX_BYTES + 1)
        if len(raw) > RESULT_MAX_BYTES:
            raise ValueError(f"it is larger than {RESULT_MAX_BYTES // 2**20} MB")
        d = finite_json(json.loads(raw.decode("utf-8")))       # Infinity / NaN of older files: missing
    except FileNotFoundError:
        raise UserError(f"No saved benchmark {ref!r}. `dsv41 bench --history` lists the saved ones.") from None
    except RecursionError:
        raise UserError(f"The benchmark file {p} cannot be read (it is nested too deeply); it is not a result of "
                        "this panel.") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"The benchmark file {p} cannot be read ({str(exc)[:200]}); run the benchmark "
                        "again.") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise UserError(f"{p} is not a benchmark result of this panel (no schema {SCHEMA}).")
    version = d.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise UserError(f"{p} was written by a newer panel (schema version {version}); update the panel to read "
                        "it.")
    return check_result(d, str(p))


def engine_words(r: dict) -> str:
    """Which engine a saved run measured, in words (its label, else its kind): the run records no "name"."""
    eng = r.get("engine") or {}
    return str(eng.get("label") or eng.get("engine") or eng.get("name") or "engine not recorded")


def phase_words(key: str) -> str:
    """A phase's id in words: ``users_4`` → "4 users", ``long_prompt`` → "long prompt"."""
    if key.startswith("users_"):
        n = key.split("_", 1)[1]
        return f"{n} user{'' if n == '1' else 's'}"
    return {"warmup": "warm-up", "long_warmup": "long-prompt warm-up"}.get(key, key.replace("_", " "))


RESULT_MAX_BYTES = 64 * 2**20


def _result_model() -> Any:
    """The shape of a result document as far as the panel reads it (``render``, ``findings``, ``compare``,
    ``history``, the Benchmark tab) — pydantic models built on first use. Fields the readers do not use pass as they
    are (new fields may be added within a version); a field that is read must have its type."""
    global _RESULT_MODEL
    if _RESULT_MODEL is not None:
        return _RESULT_MODEL
    from typing import Annotated

    from pydantic import BaseModel, ConfigDict, Field

    Num = Annotated[float, Field(allow_inf_nan=False)] | None
    Users = Annotated[int, Field(strict=True, ge=1, le=1024)]
    Text = Annotated[str, Field(max_length=100_000)]
    Short = Annotated[str, Field(max_length=1000)]
    NumList = Annotated[list[Num], Field(max_length=100_000)]

    class _M(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Row(_M):
        users: Users
        total_tok_s: Num = None
        total_spread: Num = None
        slowest_tok_s: Num = None
        per_stream_tok_s: Num = None
        ttft_s: Num = None
        engine_total_tok_s: Num = None
        guide_total_tok_s: Num = None
        guide_slowest_tok_s: Num = None
        ratio_total: Num = None
        ratio_slowest: Num = None
        verdict: Short = "n/a"
        prompt_ok: bool | None = None
        simulated: bool | None = None

    class LongPrompt(_M):
        users_decoding: Annotated[int, Field(strict=True, ge=0, le=1024)] | None = None
        prompt_tokens: Annotated[int, Field(strict=True, ge=0)] | None = None
        prompt_ok: bool | None = None
        pause_s: Num = None
        max_gap_s: NumList | None = None
        prefill_tok_s_client: Num = None
        prefill_tok_s_engine: Num = None
        guide_pause_s: Num = None
        simulated: bool | None = None

    class AB(_M):
        config: Short
        label: Short = ""
        users: Users
        total_tok_s: Num = None
        baseline_tok_s: Num = None
        ratio: Num = None
        low: Num = None
        high: Num = None
        guide_ratio: Num = None
        simulated: bool | None = None

    class Client(_M):
        cpu_share_of_wall: Annotated[dict[Short, Num], Field(max_length=1024)] = {}
        cpu_per_stream_s: Annotated[dict[Short, Num], Field(max_length=1024)] = {}
        limit: Num = None
        ok: bool | None = None

    class Engine(_M):
        name: Short | None = None
        engine: Short | None = None
        label: Short | None = None
        model: Short | None = None

    class Repeat(_M):
        per_stream_tok_s: NumList = []

    class Phase(_M):
        repeats: Annotated[list[Repeat], Field(max_length=10_000)] = []
        timeline: Annotated[list[NumList], Field(max_length=1024)] = []
        sent_at_s: Num = None
        first_token_s: Num = None
        pause_s: Num = None

    class MonitorPhase(_M):
        hit_rate: Num = None

    class Config(_M):
        config: dict[Short, Any] = {}
        phases: Annotated[dict[Short, Phase], Field(max_length=1024)] = {}
        monitor: Annotated[dict[Short, MonitorPhase], Field(max_length=1024)] = {}

    class Spec(_M):
        quick: bool | None = None

    class Result(_M):
        id: Annotated[str, Field(max_length=200)] | None = None
        started_at: Num = None
        verdict: Text | None = None
        error: Text | None = None
        simulated: bool | None = None
        cancelled: bool | None = None
        engine: Engine | None = None
        spec: Spec | None = None
        table: Annotated[list[Row], Field(max_length=1024)] = []
        long_prompt: LongPrompt | None = None
        ab: Annotated[list[AB], Field(max_length=10_000)] = []
        client: Client | None = None
        configs: Annotated[list[Config], Field(max_length=1024)] = []

    _RESULT_MODEL = Result
    return Result


_RESULT_MODEL: Any = None


def check_result(d: dict[str, Any], where: str = "the result") -> dict[str, Any]:
    """``d`` with every field the panel reads of the type it reads (missing ones as None / empty), else
    :class:`UserError` in words naming the field: a hand-edited or damaged file is refused, never half-read."""
    from pydantic import ValidationError

    try:
        m = _result_model().model_validate(d)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc") or ()) or "the document"
        msg = str(err.get("msg") or "is not valid")
        raise UserError(f"{where} is not a benchmark result this panel can read: {loc}: {msg[:1].lower()}{msg[1:]}"
                        + (f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else "")
                        + ". Run the benchmark again, or move the file out of the bench folder.") from None
    except RecursionError:
        raise UserError(f"{where} is nested too deeply to be a benchmark result.") from None
    return m.model_dump(exclude_unset=False)


def history(folder: Path | None = None, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Saved runs, newest first: id, when, engine, simulated, quick, headline, 1/4/8 totals. A file that is not a
    result this panel can read is left out; ``skipped`` (when given) gets one line per such file saying why."""
    folder = Path(folder) if folder is not None else bench_dir()
    out = []
    for p in sorted(folder.glob("bench_*.json"), reverse=True):
        try:
            d = load(p)
        except UserError as exc:
            if skipped is not None:
                skipped.append(f"Skipped {p.name}: {exc}")
            continue
        out.append({"id": d.get("id"), "path": str(p), "started_at": d.get("started_at"),
                    "engine": engine_words(d), "model": (d.get("engine") or {}).get("model"),
                    "simulated": d.get("simulated"), "quick": (d.get("spec") or {}).get("quick"),
                    "cancelled": d.get("cancelled"), "verdict": d.get("verdict"),
                    "totals": {x["users"]: x["total_tok_s"] for x in d.get("table") or []}})
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two runs side by side: per figure, A, B and B/A."""
    rows = []

    def add(name: str, x: float | None, y: float | None, unit: str) -> None:
        rows.append({"figure": name, "unit": unit, "a": x, "b": y, "ratio": (y / x) if x and y is not None else None})

    ta = {x["users"]: x for x in a.get("table") or []}
    tb = {x["users"]: x for x in b.get("table") or []}
    for u in sorted(set(ta) | set(tb)):
        for key, label, unit in (("total_tok_s", "total", "tok/s"), ("slowest_tok_s", "slowest", "tok/s"),
                                 ("ttft_s", "first token", "s")):
            add(f"{u} user{'s' if u > 1 else ''}: {label}", (ta.get(u) or {}).get(key), (tb.get(u) or {}).get(key),
                unit)
    la, lb = a.get("long_prompt") or {}, b.get("long_prompt") or {}
    add("long prompt: pause", la.get("pause_s"), lb.get("pause_s"), "s")
    add("long prompt: prefill", la.get("prefill_tok_s_client"), lb.get("prefill_tok_s_client"), "tok/s")
    abb = {(x["config"], x["users"]): x for x in b.get("ab") or []}
    for x in a.get("ab") or []:
        y = abb.get((x["config"], x["users"]))
        add(f"{x['label']} vs baseline", x.get("ratio"), (y or {}).get("ratio"), "×")
    return {"a": {"id": a.get("id"), "engine": engine_words(a), "simulated": a.get("simulated")},
            "b": {"id": b.get("id"), "engine": engine_words(b), "simulated": b.get("simulated")},
            "rows": rows}


# ------------------------------------------------------------------------------------------------ text
def _n(x, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def findings(r: dict) -> list[str]:
    """The result's findings beside the table, one sentence each — the long prompt, each A/B ratio, the bench's
    own CPU, the Monitor's hit rate per phase: the same words in `dsv41 bench` and the Benchmark tab."""
    out: list[str] = []
    lp = r.get("long_prompt")
    if lp:
        guide = " (guides: 4.05 s)" if lp.get("guide_pause_s") else ""
        out.append(f"Long prompt: {_n(lp.get('prompt_tokens'), '{:,}')} tokens arriving while "
                   f"{lp.get('users_decoding')} users decode paused them {_n(lp.get('pause_s'), '{:.2f}')} s at "
                   f"most{guide}; prefill {_n(lp.get('prefill_tok_s_client'), '{:,.0f}')} tok/s "
                   f"(engine: {_n(lp.get('prefill_tok_s_engine'), '{:,.0f}')}).")
    for a in r.get("ab") or []:
        g = f" (guides: {a['guide_ratio']:.2f})" if a.get("guide_ratio") else ""
        out.append(f"A/B {a['label']}, {a['users']} user{'s' if a['users'] > 1 else ''}: "
                   f"{_n(a.get('ratio'), '{:.3f}')}× the baseline [{_n(a.get('low'), '{:.3f}')}–"
                   f"{_n(a.get('high'), '{:.3f}')}]{g}.")
    out.extend(prompt_findings(r))
    c = r.get("client") or {}
    shares = ", ".join(f"{k.split('_')[1]} users {v:.1%}" for k, v in (c.get("cpu_share_of_wall") or {}).items()
                       if v is not None)
    if shares:
        out.append(f"The bench's own CPU against wall time: {shares} "
                   f"({'under' if c.get('ok') else 'OVER'} the 5% limit).")
    mon = ((r.get("configs") or [{}])[0].get("monitor") or {})
    hr = ", ".join(f"{phase_words(k)} {v['hit_rate'] * 100:.0f}%" for k, v in mon.items()
                   if k.startswith("users_") and v.get("hit_rate") is not None)
    if hr:
        out.append(f"Hit rate (Monitor's collectors): {hr}.")
    return out


def prompt_findings(r: dict) -> list[str]:
    """What the report must say about prompt lengths it could not confirm: each prompt is sized from the engine's
    own token counts, and checked against them; where the engine gave no counts (or counted far off), the figures
    stand on prompts of unconfirmed length."""
    out: list[str] = []
    ratio = r.get("token_ratio") if isinstance(r.get("token_ratio"), dict) else {}
    wanted = (r.get("spec") or {}).get("prompt_tokens")
    size = f"{wanted:,}-token " if isinstance(wanted, int) and not isinstance(wanted, bool) else ""
    if ratio and ratio.get("measured") is False:
        out.append("Prompt lengths unconfirmed: the engine reported no prompt token counts in the warm-up, so the "
                   f"{size}prompts were sized at one token per word (a guess).")
    rows = r.get("table") or []
    unsaid = [x["users"] for x in rows if x.get("prompt_ok") is None]
    off = [x["users"] for x in rows if x.get("prompt_ok") is False]
    if unsaid:
        out.append(f"Prompt lengths unconfirmed at {_users_words(unsaid)}: the engine did not report how many tokens "
                   f"it read, so the {size}prompts may be longer or shorter there.")
    if off:
        out.append(f"Prompt lengths off at {_users_words(off)}: the engine counted more than 10% more or fewer "
                   f"tokens than the {size}prompts were meant to have; compare those rows with care.")
    lp = r.get("long_prompt") or {}
    if lp and lp.get("prompt_ok") is None:
        out.append("The long prompt's length is unconfirmed: the engine did not report how many tokens it read.")
    elif lp and lp.get("prompt_ok") is False:
        out.append(f"The long prompt's length is off: the engine read {_n(lp.get('prompt_tokens'), '{:,}')} tokens, "
                   "more than 10% away from the length asked for.")
    return out


def _users_words(users: list[Any]) -> str:
    xs = [str(u) for u in users]
    many = len(xs) > 1 or xs != ["1"]
    return (", ".join(xs[:-1]) + " and " + xs[-1] if len(xs) > 1 else xs[0]) + (" users" if many else " user")


def render(r: dict) -> str:
    sim = " (SIMULATED)" if r.get("simulated") else ""
    eng = r.get("engine") or {}
    lines = [f"Benchmark {r.get('id')} — {eng.get('label') or eng.get('engine')}{sim}; model {eng.get('model') or '?'}",
             "", f"{'users':>5} {'total tok/s':>12} {'spread':>7} {'slowest':>8} {'TTFT s':>7} {'engine':>8} "
                 f"{'guides':>8} {'ratio':>6}  verdict"]
    for x in r.get("table") or []:
        lines.append(f"{x['users']:>5} {_n(x['total_tok_s']):>12} {_n(x['total_spread'], '{:.1%}'):>7} "
                     f"{_n(x['slowest_tok_s']):>8} {_n(x['ttft_s'], '{:.2f}'):>7} {_n(x['engine_total_tok_s']):>8} "
                     f"{_n(x['guide_total_tok_s'], '{:.2f}'):>8} {_n(x['ratio_total'], '{:.2f}'):>6}  {x['verdict']}")
    found = findings(r)
    if found:
        lines.append("")
        lines.extend(found)
    lines.append("\n" + (r.get("verdict") or ""))
    return "\n".join(lines)


def render_compare(c: dict) -> str:
    a, b = c["a"], c["b"]
    lines = [f"A = {a['id']} ({a['engine']}{', simulated' if a['simulated'] else ''})",
             f"B = {b['id']} ({b['engine']}{', simulated' if b['simulated'] else ''})", ""]
    for row in c["rows"]:
        lines.append(f"{row['figure']:<45} {_n(row['a'], '{:.3f}'):>10} {_n(row['b'], '{:.3f}'):>10} {row['unit']:<6}"
                     f" B/A {_n(row['ratio'], '{:.2f}')}")
    return "\n".join(lines)
