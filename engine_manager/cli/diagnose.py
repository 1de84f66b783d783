"""``dsv41 diagnose --out FILE``: one zip for a bug report, with no secret in it.

The bundle holds ``doctor.json`` (``dsv41 doctor --json``), ``status.json`` (``dsv41 status --json`` without the
checks), ``plan.json`` (the plan the engine runs with, else the last plan), ``settings.json``
(``Settings.masked()``: keys and tokens masked), ``checks.json`` (planned vs measured, while an engine is ready),
``engine-log-tail.txt`` (the engine log's last lines, every known secret masked once more), ``nvidia-smi.txt`` and
``numactl-hardware.txt`` (where those programs exist; argv lists, a timeout each), ``metrics-last-hour.csv`` (the
newest recorded run's rows of the last hour, from ``<data dir>/runs/metrics/``) and ``README.txt`` (what each file
is, and what could not be read). Written atomically, mode 0600; a folder given is not made private.

Exit 0 written, 1 when the file cannot be written.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from ..exitcodes import ExitCode

LOG_LINES = 400
CMD_TIMEOUT_S = 10.0
CMD_OUTPUT_CAP = 256 * 1024
METRICS_CAP = 32 * 2**20
HOUR_S = 3600.0


def register(sub) -> None:
    p = sub.add_parser("diagnose", help="write a diagnostic bundle (zip) for a bug report, keys masked",
                       description="Collect doctor, status, the plan, settings (keys masked), the planned-vs-"
                                   "measured checks, the engine log's tail (masked), nvidia-smi and numactl "
                                   "--hardware output and the last hour of metrics into one zip (mode 0600). "
                                   "Exit 0 written, 1 not written.")
    p.add_argument("--out", required=True, metavar="FILE", help="the zip to write (replaced if it exists)")
    p.set_defaults(func=run)


def mask(text: str, secrets: list[str]) -> str:
    from ..engines.base import mask_in

    return mask_in(text, [s for s in secrets if s and len(s) >= 4])


def _command(argv: list[str]) -> str | None:
    """``argv``'s output (stdout + stderr, capped), or None when the program is not here."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        cp = subprocess.run([exe, *argv[1:]], capture_output=True, timeout=CMD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"$ {' '.join(argv)}\n(no answer within {CMD_TIMEOUT_S:.0f} s)\n"
    except OSError as exc:
        return f"$ {' '.join(argv)}\n(could not run: {exc.strerror or exc})\n"
    out = (cp.stdout + cp.stderr)[:CMD_OUTPUT_CAP].decode("utf-8", "replace")
    return f"$ {' '.join(argv)}\n(exit {cp.returncode})\n{out}"


def metrics_last_hour(now: float | None = None) -> tuple[str | None, str]:
    """The newest recorded run's CSV rows of the last hour (header kept), and where they came from."""
    from ..metrics.record import list_runs

    now = time.time() if now is None else now
    for run in list_runs():
        try:
            with open(run.csv_path, encoding="utf-8", newline="") as f:
                header = f.readline()
                rows = []
                size = len(header)
                for line in f:
                    try:
                        t = float(line.split(",", 1)[0])
                    except ValueError:
                        continue
                    if t >= now - HOUR_S and line.endswith("\n"):
                        rows.append(line)
                        size += len(line)
                        while size > METRICS_CAP and rows:      # keep the newest within the cap
                            size -= len(rows.pop(0))
        except OSError:
            continue
        if rows:
            return header + "".join(rows), f"{run.csv_path} ({len(rows)} rows of the last hour)"
        return None, f"the newest recording ({run.csv_path}) has no row from the last hour"
    return None, "no metrics recording (the panel records while its Monitor runs)"


def build_bundle(settings: Any) -> tuple[bytes, list[str]]:
    """The zip's bytes and the README's notes (what could not be collected)."""
    from .. import doctor, hardware
    from ..checks import checks_for_status
    from ..logtail import read_log_tail
    from ..plans import load_last_plan
    from ..session import EngineSession

    secrets = [settings.api_key, getattr(settings, "hf_token", "") or ""]
    files: dict[str, str] = {}
    notes: list[str] = []

    def put_json(name: str, obj: Any) -> None:
        files[name] = mask(json.dumps(obj, indent=2, default=str), secrets) + "\n"

    def attempt(what: str, fn) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a bundle collects what it can and says what it could not
            notes.append(f"{what}: could not be collected ({type(exc).__name__}: {mask(str(exc), secrets)[:300]})")
            return None

    report = attempt("doctor", lambda: hardware.probe(settings.cache_path))
    if report is not None:
        put_json("doctor.json", attempt("doctor", lambda: doctor.report_dict(report, settings)))
    session = EngineSession(settings)
    st = attempt("status", session.status)
    if st is not None:
        put_json("status.json", st.to_dict())
    plan = (st.plan() if st is not None and st.running else None) or attempt("plan", load_last_plan)
    if plan is not None:
        put_json("plan.json", plan)
    else:
        notes.append("plan: none (no engine runs with a plan and no plan was saved)")
    put_json("settings.json", settings.masked())
    checks = attempt("checks", lambda: checks_for_status(st, settings)) if st is not None else None
    if checks is not None:
        put_json("checks.json", checks.to_dict())
    else:
        notes.append("checks: none (no engine is ready)")
    log_path = Path(st.log_path) if st is not None and st.log_path else session.log_path
    lines = attempt("engine log", lambda: read_log_tail(log_path)) or []
    if lines:
        files["engine-log-tail.txt"] = mask("\n".join(lines[-LOG_LINES:]), secrets) + "\n"
    else:
        notes.append(f"engine log: nothing at {log_path}")
    for name, argv in (("nvidia-smi.txt", ["nvidia-smi"]), ("numactl-hardware.txt", ["numactl", "--hardware"])):
        out = attempt(argv[0], lambda argv=argv: _command(argv))
        if out is not None:
            files[name] = mask(out, secrets)
        else:
            notes.append(f"{argv[0]}: not installed here")
    csv, where = attempt("metrics", metrics_last_hour) or (None, "")
    if csv is not None:
        files["metrics-last-hour.csv"] = csv
    notes.append(f"metrics: {where}" if where else "metrics: none")
    readme = ("dsv41 diagnostic bundle, written " + time.strftime("%Y-%m-%d %H:%M:%S %z") + "\n\n"
              "doctor.json  status.json  plan.json  settings.json (secrets masked)  checks.json (planned vs "
              "measured)\nengine-log-tail.txt (masked)  nvidia-smi.txt  numactl-hardware.txt  metrics-last-hour.csv"
              "\n\n" + "\n".join(notes) + "\n")
    files["README.txt"] = readme
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return buf.getvalue(), notes


def write_bundle(settings: Any, out: Path) -> tuple[int, list[str]]:
    """Collect the bundle (:func:`build_bundle`) and write it to ``out`` atomically, mode 0600: its size in bytes
    and the README's notes. Raises OSError when it cannot be written. Help ▸ Save a diagnostic bundle… runs it."""
    from ..atomic import atomic_write_bytes

    data, notes = build_bundle(settings)
    atomic_write_bytes(Path(out), data)
    return len(data), notes


def run(args, ctx) -> int:
    out = Path(args.out).expanduser()
    if out.is_dir():
        print(f"dsv41 diagnose: {out} is a folder; give a file name (e.g. {out / 'dsv41-diagnose.zip'}).",
              file=sys.stderr)
        return ExitCode.USAGE
    if not out.parent.is_dir():
        print(f"dsv41 diagnose: the folder {out.parent} does not exist; create it or choose another --out.",
              file=sys.stderr)
        return ExitCode.FAIL
    try:
        size, notes = write_bundle(ctx.settings, out)
    except OSError as exc:
        print(f"dsv41 diagnose: cannot write {out} ({exc.strerror or exc}); choose another --out.", file=sys.stderr)
        return ExitCode.FAIL
    print(f"wrote {out} ({size / 1024:.0f} KiB, mode 0600; keys masked)")
    for n in notes:
        print(f"  {n}")
    return ExitCode.OK
