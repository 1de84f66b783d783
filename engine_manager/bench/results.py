"""The benchmark's result document, its table beside the guides' figures, saving (JSON + CSV), history, compare.

Schema (``schema`` = ``dsv41-bench``, ``schema_version`` = 1; new fields may be added within a version, none is
removed or changes meaning without a new version):

- ``id``, ``started_at``, ``finished_at``, ``duration_s`` (Unix seconds / seconds), ``cancelled``, ``error``;
- ``simulated``: the scripted engine ran (every figure is then SIMULATED: it checks the wiring, not the host);
- ``engine``: the baseline engine (name, label, model, argv with the key masked), ``model_comparable``: whether
  the model is the guides' (None: unknown);
- ``spec``: what was asked (users, tokens, repeats, prompt lengths, configurations); ``token_ratio``;
- ``settings``: the panel's settings (secrets left out); ``hardware``: the hardware report; ``plan``: a summary;
- ``configs``: per configuration its settings, engine, ``phases`` (``warmup``, ``users_N`` with median / spread
  of total, slowest, per-stream tok/s, TTFT, the engine's own total, client CPU, each repeat, the last repeat's
  token timeline; ``long_prompt``) and ``monitor`` (mean hit rate, PCIe RX MB/s, swaps/s per phase);
- ``table``: one row per user count: measured total / slowest / per stream, the guides' figures, ratios, verdict;
- ``long_prompt``: the pause (longest gap between tokens of a decoding stream), prefill tok/s (client, engine);
- ``ab``: per other configuration, its ratio to the baseline (median, low, high) and the guides' ratio if any;
- ``client``: the client's own CPU against wall time (the bench must not be what limits the figures);
- ``verdict``: the result in plain words.

Files: ``<data dir>/bench/<id>.json`` and ``<id>.csv`` (one row per configuration × phase × repeat × stream),
written atomically, owner-only.
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..atomic import atomic_write_json, atomic_write_text, read_bytes_nofollow
from ..errors import UserError
from ..metrics.guides import AS_PUBLISHED, GUIDE_HOST, GUIDE_MODEL, GUIDE_TABLE, is_guide_model

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
    out["simulated"] = simulated
    comparable = is_guide_model(eng.get("model"))
    out["model_comparable"] = comparable
    out["settings"] = _settings_dict(settings)
    try:
        out["hardware"] = hardware.to_dict() if hardware is not None else None
    except Exception:  # noqa: BLE001
        out["hardware"] = None
    try:
        from ..session import read_plan_file
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
    from .runner import BenchConfig, guide_effect
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
    return "" if x is None else f"{float(x):.4f}"


def save(r: dict[str, Any], folder: Path | None = None) -> tuple[Path, Path]:
    """Write ``<id>.json`` and ``<id>.csv`` under ``folder`` (default :func:`bench_dir`); returns the paths."""
    folder = Path(folder) if folder is not None else bench_dir()
    r["id"] = _unique_id(folder, r.get("id") or time.strftime("bench_%Y%m%dT%H%M%SZ", time.gmtime()))
    jp, cp = folder / f"{r['id']}.json", folder / f"{r['id']}.csv"
    atomic_write_json(jp, r)
    atomic_write_text(cp, to_csv(r))
    return jp, cp


def load(ref: str | Path, folder: Path | None = None) -> dict[str, Any]:
    """A saved run by id (``bench_…``) or path; :class:`UserError` in plain words when it cannot be read."""
    folder = Path(folder) if folder is not None else bench_dir()
    p = Path(ref)
    if not p.suffix and _ID_RE.match(str(ref)):
        p = folder / f"{ref}.json"
    try:
        d = json.loads(read_bytes_nofollow(p, 64 * 2**20).decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"No saved benchmark {ref!r}. `dsv41 bench --history` lists the saved ones.") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"The benchmark file {p} cannot be read ({exc}); run the benchmark again.") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise UserError(f"{p} is not a benchmark result of this panel (no schema {SCHEMA}).")
    if int(d.get("schema_version") or 0) > SCHEMA_VERSION:
        raise UserError(f"{p} was written by a newer panel (schema version {d.get('schema_version')}); update the "
                        "panel to read it.")
    return d


def history(folder: Path | None = None) -> list[dict[str, Any]]:
    """Saved runs, newest first: id, when, engine, simulated, quick, headline, 1/4/8 totals."""
    folder = Path(folder) if folder is not None else bench_dir()
    out = []
    for p in sorted(folder.glob("bench_*.json"), reverse=True):
        try:
            d = load(p)
        except UserError:
            continue
        out.append({"id": d.get("id"), "path": str(p), "started_at": d.get("started_at"),
                    "engine": (d.get("engine") or {}).get("name"), "model": (d.get("engine") or {}).get("model"),
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
    return {"a": {"id": a.get("id"), "engine": (a.get("engine") or {}).get("name"), "simulated": a.get("simulated")},
            "b": {"id": b.get("id"), "engine": (b.get("engine") or {}).get("name"), "simulated": b.get("simulated")},
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
    c = r.get("client") or {}
    shares = ", ".join(f"{k.split('_')[1]} users {v:.1%}" for k, v in (c.get("cpu_share_of_wall") or {}).items()
                       if v is not None)
    if shares:
        out.append(f"The bench's own CPU against wall time: {shares} "
                   f"({'under' if c.get('ok') else 'OVER'} the 5% limit).")
    mon = ((r.get("configs") or [{}])[0].get("monitor") or {})
    hr = ", ".join(f"{k} {v['hit_rate'] * 100:.0f}%" for k, v in mon.items()
                   if k.startswith("users_") and v.get("hit_rate") is not None)
    if hr:
        out.append(f"Hit rate (Monitor's collectors): {hr}.")
    return out


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
