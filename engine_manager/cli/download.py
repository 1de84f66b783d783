"""``dsv41 download [--model] [--engine] [--dir DIR] [--jobs N]``: fetch the seven model shards and the engine
release, resumable and verified, with a terminal progress bar (per file and in total, speed, ETA).

Ctrl+C stops cleanly: every partial file keeps its checkpoint, and running the command again resumes it.

A complete, verified model needs no network: the command says the seven shards are present and verified and exits
0 without asking the hub. ``--repin`` resolves the revision again when the commit the folder was pinned to is gone
from the hub (the error says so).

``dsv41 download engine --from DIR`` checks a release folder the user already has (the checks of ``dsv41
doctor``) and, when none fails, makes it the ``engine_dir`` setting. ``dsv41 download engine --url URL
[--sha256 HEX]`` downloads a release archive: with ``--sha256`` a mismatch refuses and deletes it; without, the
sha256 of what arrived is printed and must be confirmed against the release page (pasted at a terminal, or
``--yes-i-checked-the-sha256 HEX``) before anything is unpacked; the unpacked release is then checked the same
way."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .. import download as dl, fmt
from ..cancel import CancelToken
from ..fmt import MIB
from ..gguf_split import short_name

from ..exitcodes import ExitCode


def register(sub) -> None:
    p = sub.add_parser(
        "download", help="download the model's seven shards and the engine release (resumable, verified)",
        description="Download DeepSeek-V4.1-Flash's seven GGUF shards at the pinned revision and the prebuilt engine "
                    "release, verifying every byte (sha256) before use. Interrupted downloads resume. With neither "
                    "--model nor --engine: the model, then the engine if its manifest pins a release. The token is "
                    "read from HF_TOKEN or the hf_token setting and never printed.")
    p.add_argument("what", nargs="?", choices=("model", "engine"),
                   help="what to download: `model` (the same as --model) or `engine` (--engine)")
    p.add_argument("--model", action="store_true", help="download (or verify) the model shards")
    p.add_argument("--engine", action="store_true", help="download and unpack the engine release")
    p.add_argument("--dir", type=Path, metavar="DIR",
                   help="folder for the shards (default: DSV41_MODEL_DIR if set, else <cache_dir>/models/…)")
    p.add_argument("--jobs", type=int, default=dl.DEFAULT_JOBS, metavar="N",
                   help=f"files downloaded in parallel, one connection each (default {dl.DEFAULT_JOBS})")
    p.add_argument("--verify", action="store_true",
                   help="re-hash files already on disk even if they were verified before (asks the hub)")
    p.add_argument("--repin", action="store_true",
                   help="forget the commit this model folder was pinned to and pin what DSV41_MODEL_REVISION "
                        "(default 'main') is now; shards with an unchanged sha256 stay verified, partial files of "
                        "the old commit start over. Use it when the hub no longer has the pinned commit")
    p.add_argument("--engine-manifest", type=Path, metavar="FILE",
                   help="engine release manifest (JSON: version, url, size, sha256, executables) instead of "
                        "resources/manifests/engine.json")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from", dest="from_dir", type=Path, metavar="DIR",
                     help="engine: use a Strata release folder you already have; it is checked the way `dsv41 "
                          "doctor` checks one, and becomes the engine_dir setting when no check fails")
    src.add_argument("--url", metavar="URL",
                     help="engine: download the release archive at URL (a .tar.gz/.tar.xz/.zip asset of the release "
                          "page), unpack it safely and check it")
    p.add_argument("--sha256", metavar="HEX",
                   help="with --url: the sha256 the release page publishes; a download that differs is refused and "
                        "deleted")
    p.add_argument("--yes-i-checked-the-sha256", dest="confirm_sha256", metavar="HEX",
                   help="with --url and no --sha256: the sha256 printed for the download, which you compared with "
                        "the release page (the non-interactive confirmation; a download kept from an earlier run "
                        "is used without fetching it again)")
    p.add_argument("--json", action="store_true", help="print one JSON object per event instead of a progress bar")
    p.add_argument("--checkpoint-mib", type=float, default=dl.CHECKPOINT_BYTES / MIB, metavar="MIB",
                   help="save resumable state every MIB mebibytes: at most this much is fetched again after a "
                        "crash (default %(default)g)")
    p.add_argument("--stall-timeout", type=float, default=dl.STALL_TIMEOUT_S, metavar="S",
                   help="retry a connection that delivered nothing for S seconds (default %(default)g)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------------------

def _short(name: str) -> str:
    """``DeepSeek-V4.1-Flash-Q2_K-00003-of-00007.gguf`` → ``shard 3 of 7`` (any other name cut to 24 characters)."""
    return short_name(name)[:24]


def _bar(frac: float, width: int) -> str:
    frac = min(1.0, max(0.0, frac))
    full = int(frac * width)
    half = frac * width - full >= 0.5
    return "█" * full + ("▌" if half else "") + " " * (width - full - (1 if half else 0))


def _speed(bps: float | None) -> str:
    return f"{fmt.bytes_si(bps)}/s" if bps else "   --   "


class Renderer:
    """Prints events. On a terminal: a block of bars redrawn in place (one per file and a total); otherwise a
    line per event and a progress line every few seconds."""

    def __init__(self, out=None, json_mode: bool = False):
        self.out = out or sys.stdout
        self.json = json_mode
        self.tty = (not json_mode) and self.out.isatty() and os.environ.get("TERM") != "dumb"
        self.lines_drawn = 0
        self.last_draw = 0.0
        self.last_line = 0.0
        self.last_progress: dl.Progress | None = None

    def _print(self, text: str) -> None:
        if self.tty and self.lines_drawn:
            self.out.write(f"\x1b[{self.lines_drawn}F\x1b[J")
            self.lines_drawn = 0
        print(text, file=self.out, flush=True)
        if self.tty and self.last_progress is not None:
            self._draw(self.last_progress)

    def event(self, ev) -> None:
        if self.json:
            d: dict[str, Any] = {"event": type(ev).__name__}
            d.update({k: (str(v) if isinstance(v, Path) else v) for k, v in ev.__dict__.items() if k != "files"})
            if isinstance(ev, dl.Progress):
                d["files"] = [f.__dict__ for f in ev.files]
            elif isinstance(ev, (dl.Resolved, dl.Finished)):
                d["files"] = [(f.__dict__ if hasattr(f, "__dict__") and not isinstance(f, Path) else str(f))
                              for f in ev.files]
            print(json.dumps(d, default=str), file=self.out, flush=True)
            return
        if isinstance(ev, dl.Progress):
            self.progress(ev)
        elif isinstance(ev, dl.Resolved):
            how = "pinned earlier" if ev.pinned else f"resolved from '{ev.revision}' and pinned"
            self._print(f"{ev.repo} @ {ev.commit[:12]} ({how}): {len(ev.files)} files, "
                        f"{fmt.bytes_si(ev.total_bytes)} → {ev.target_dir}")
        elif isinstance(ev, dl.DiskChecked):
            self._print(f"disk: {fmt.bytes_si(ev.free_bytes)} free at {ev.path}, "
                        f"{fmt.bytes_si(ev.needed_bytes)} needed")
        elif isinstance(ev, dl.Checking):
            now = time.monotonic()
            if now - self.last_line >= (0.2 if self.tty else 5.0):
                self.last_line = now
                frac = ev.done_bytes / ev.total_bytes if ev.total_bytes else 1.0
                msg = f"checking files on disk: {frac * 100:5.1f}% of {fmt.bytes_si(ev.total_bytes)}"
                if self.tty:
                    self.out.write("\r\x1b[2K" + msg)
                    self.out.flush()
                else:
                    print(msg, file=self.out, flush=True)
        elif isinstance(ev, dl.FileVerified):
            if self.tty:
                self.out.write("\r\x1b[2K")
            self._print(f"✓ {ev.name} verified" + ("" if ev.downloaded else " (already on disk)"))
        elif isinstance(ev, dl.FileCorrupt):
            self._print(f"✗ {ev.name}: sha256 mismatch (expected {ev.expected[:12]}…, got {ev.actual[:12]}…): "
                        f"{ev.action}")
        elif isinstance(ev, dl.Retrying):
            self._print(f"↻ {ev.name}: {ev.reason}; retry {ev.attempt} in {ev.delay_s:.1f} s")
        elif isinstance(ev, dl.Notice):
            self._print(f"note: {ev.text}")
        elif isinstance(ev, dl.Paused):
            self._print("paused")
        elif isinstance(ev, dl.Resumed):
            self._print("resumed")

    def progress(self, p: dl.Progress, force: bool = False) -> None:
        self.last_progress = p
        now = time.monotonic()
        if self.tty:
            if force or now - self.last_draw >= 0.2:
                self.last_draw = now
                self._draw(p)
        elif force or now - self.last_line >= 5.0:
            self.last_line = now
            active = [f for f in p.files if f.state in ("downloading", "retrying", "verifying")]
            parts = ", ".join(f"{_short(f.name)} {f.done_bytes / f.size_bytes * 100:.0f}%" for f in active
                              if f.size_bytes)
            print(f"{p.fraction * 100:5.1f}%  {fmt.bytes_si(p.done_bytes)} of {fmt.bytes_si(p.total_bytes)}  "
                  f"{_speed(p.speed_bps)}  ETA {fmt.clock(p.eta_s)}" + (f"  [{parts}]" if parts else ""),
                  file=self.out, flush=True)

    def _draw(self, p: dl.Progress) -> None:
        cols = shutil.get_terminal_size((100, 20)).columns
        width = max(10, min(40, cols - 62))
        lines = []
        for f in p.files:
            frac = f.done_bytes / f.size_bytes if f.size_bytes else 1.0
            mark = "✓" if f.state in ("verified", "present") else " "
            lines.append(f"{mark} {_short(f.name):<15} {_bar(frac, width)} {frac * 100:5.1f}% "
                         f"{fmt.bytes_si(f.done_bytes):>9} {_speed(f.speed_bps):>11} "
                         f"{fmt.clock(f.eta_s) if f.state == 'downloading' else f.state:>8}")
        lines.append(f"  {'total':<15} {_bar(p.fraction, width)} {p.fraction * 100:5.1f}% "
                     f"{fmt.bytes_si(p.done_bytes):>9} {_speed(p.speed_bps):>11} ETA {fmt.clock(p.eta_s)}"
                     f"  of {fmt.bytes_si(p.total_bytes)}")
        lines = [ln[:cols - 1] for ln in lines]
        if self.lines_drawn:
            self.out.write(f"\x1b[{self.lines_drawn}F")
        self.out.write("".join("\x1b[2K" + ln + "\n" for ln in lines))
        self.out.flush()
        self.lines_drawn = len(lines)


# ---------------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------------

def _drive(gen, r: Renderer):
    """Run a download generator to its end, printing events; returns the last event."""
    last = None
    try:
        for ev in gen:
            r.event(ev)
            last = ev
    finally:
        gen.close()
    if r.last_progress is not None and not r.json:
        r.progress(r.last_progress, force=True)
    return last


def run(args, ctx) -> int:
    if args.what == "model":
        args.model = True
    elif args.what == "engine":
        args.engine = True
    if args.from_dir is not None or args.url:
        if args.model:
            print("dsv41 download: --from and --url are for the engine release (`dsv41 download engine --from DIR`"
                  " or `--url URL`)", file=sys.stderr)
            return ExitCode.USAGE
        return release_source(args, ctx)
    if args.sha256 or args.confirm_sha256:
        print("dsv41 download: --sha256 and --yes-i-checked-the-sha256 go with --url URL", file=sys.stderr)
        return ExitCode.USAGE
    settings = ctx.settings
    want_model = args.model or not args.engine
    want_engine = args.engine
    r = Renderer(json_mode=args.json)
    err = sys.stderr
    if args.jobs < 1 or args.jobs > 16:
        print("dsv41 download: --jobs must be 1 to 16", file=err)
        return ExitCode.USAGE
    common = dict(checkpoint_bytes=max(64 * 1024, int(args.checkpoint_mib * MIB)),
                  stall_timeout_s=max(0.5, args.stall_timeout))
    control = CancelToken()
    stage = "model"
    try:
        if want_model:
            last = _drive(dl.download_model(settings, target_dir=args.dir, jobs=args.jobs, control=control,
                                            verify="full" if args.verify else "quick", repin=args.repin,
                                            **common), r)
            if isinstance(last, dl.Finished):
                where = last.target_dir
                fetched = f"{fmt.bytes_si(last.fetched_bytes)} fetched" if last.fetched_bytes else "nothing fetched"
                print(f"model: all {len(last.files)} shards verified in {where} ({fetched}, "
                      f"{last.elapsed_s:.1f} s).", file=sys.stdout if not args.json else err, flush=True)
                if args.dir and settings.model_dir is None:
                    print(f"hint: the engine loads the model from {dl.model_dir(settings)}; set DSV41_MODEL_DIR={where}"
                          " (or `dsv41 settings set model_dir …`) to use this folder.", file=err)
        if not args.engine and not args.model:
            try:
                dl.read_engine_manifest(args.engine_manifest)
                want_engine = True
            except dl.ArchiveError as exc:
                print(f"note: engine release skipped: {exc.message}", file=err)
        if want_engine:
            stage = "engine"
            last = _drive(dl.download_engine(settings, manifest=args.engine_manifest, control=control, **common), r)
            if isinstance(last, dl.Finished):
                print(f"engine: release verified and unpacked in {last.target_dir}.",
                      file=sys.stdout if not args.json else err, flush=True)
    except KeyboardInterrupt:
        control.cancel()
        if r.tty:
            sys.stdout.write("\n")
        st = dl.local_status(settings, args.dir) if stage == "model" else None
        kept = f" ({fmt.bytes_si(st.partial_bytes)} of partial files kept in {st.folder})" if st else ""
        print(f"dsv41 download: interrupted; the download state is saved{kept}. Run `dsv41 download` again to "
              "resume where it stopped.", file=err, flush=True)
        return ExitCode.INTERRUPTED
    except dl.DownloadError as exc:
        if r.tty and r.lines_drawn:
            sys.stdout.write("\n")
        print(f"dsv41 download: {exc.message}", file=err)
        if exc.fix:
            print(f"  what to do: {exc.fix}", file=err)
        return ExitCode.FAIL
    return ExitCode.OK


# ---------------------------------------------------------------------------------------------------------------
# an engine release the user names: --from DIR, --url URL
# ---------------------------------------------------------------------------------------------------------------

def _say(args, text: str, **obj: Any) -> None:
    """A line for the user (stdout), or with --json one JSON object."""
    if args.json:
        print(json.dumps({"event": "message", "text": text, **obj}, default=str), flush=True)
    else:
        print(text, flush=True)


def _show_checks(args, folder: Path, checks: list) -> None:
    from ..download.release_source import describe_checks
    if args.json:
        print(json.dumps({"event": "release_checks", "folder": str(folder),
                          "checks": [c.to_dict() for c in checks]}), flush=True)
    else:
        print(f"release checks for {folder}:", flush=True)
        print(describe_checks(checks), flush=True)


def _adopt(args, ctx, folder: Path, checks: list) -> int:
    """Make ``folder`` the engine_dir setting when no check failed; otherwise say what to do and change nothing."""
    from ..release_check import usable
    from ..settings import save_settings

    _show_checks(args, folder, checks)
    if not usable(checks):
        print(f"dsv41 download: {folder} cannot be used as the engine release yet: "
              f"{sum(c.status == 'fail' for c in checks)} check(s) failed (each with what to do above). The "
              "engine_dir setting was not changed.", file=sys.stderr)
        print(f"  what to do: fix those, then run `dsv41 download engine --from {folder}` again.", file=sys.stderr)
        return ExitCode.FAIL
    save_settings(ctx.loaded, {"engine_dir": str(folder)})
    _say(args, f"engine: {folder} passed the release checks and is now the engine folder (engine_dir).",
         engine_dir=str(folder))
    env_dir = os.environ.get("DSV41_ENGINE_DIR")
    if env_dir and Path(env_dir).expanduser() != folder:
        print(f"note: DSV41_ENGINE_DIR={env_dir} is set in the environment and wins over the setting; unset it to "
              "use this release.", file=sys.stderr)
    return ExitCode.OK


def _confirm_at_terminal(digest: str, asset: str) -> str | None:
    """Ask the user to paste the release page's sha256 (at a terminal only); what they pasted, or None."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    print(f"Open the release page and find the sha256 of {asset}. Paste it here to confirm (Enter alone stops; the "
          "download is kept):", flush=True)
    try:
        return input("sha256 from the release page: ").strip() or None
    except EOFError:
        return None


def release_source(args, ctx) -> int:
    """``dsv41 download engine --from DIR | --url URL [--sha256 HEX | --yes-i-checked-the-sha256 HEX]``."""
    from ..download import release_source as rs
    from ..release_check import check_release, gpu_facts

    settings = ctx.settings
    if args.sha256 and args.confirm_sha256:
        print("dsv41 download: give --sha256 (known before the download) or --yes-i-checked-the-sha256 (confirmed "
              "after it), not both", file=sys.stderr)
        return ExitCode.USAGE
    for flag, value in (("--sha256", args.sha256), ("--yes-i-checked-the-sha256", args.confirm_sha256)):
        if value and rs.sha256_text(value) is None:
            print(f"dsv41 download: {flag} {value!r} is not a sha256 (64 hexadecimal digits)", file=sys.stderr)
            return ExitCode.USAGE
    cc, driver = gpu_facts(settings.gpu_index)
    if args.from_dir is not None:
        if args.sha256 or args.confirm_sha256:
            print("dsv41 download: --sha256 goes with --url, not --from", file=sys.stderr)
            return ExitCode.USAGE
        folder = args.from_dir.expanduser().absolute()
        return _adopt(args, ctx, folder, check_release(folder, compute_capability=cc, driver_cuda=driver))
    r = Renderer(json_mode=args.json)
    control = CancelToken()
    try:
        url = rs.check_url(args.url)
        pending = rs.pending_archive(settings, url)
        confirm = rs.sha256_text(args.confirm_sha256)
        if pending is not None and (args.sha256 or (confirm and confirm != pending.sha256)):
            pending = None                  # fetch again: the kept file is not the one being confirmed
        if pending is not None:
            archive, digest, pinned = pending.path, pending.sha256, False
            _say(args, f"engine: using {archive.name} downloaded earlier ({fmt.bytes_si(pending.size)}, "
                       f"sha256 {digest}).", sha256=digest)
        else:
            last = _drive(rs.fetch_release(settings, url, sha256=args.sha256, control=control,
                                           stall_timeout_s=max(0.5, args.stall_timeout)), r)
            if not isinstance(last, rs.ArchiveFetched):
                print("dsv41 download: the download stopped; nothing was unpacked.", file=sys.stderr)
                return ExitCode.FAIL
            archive, digest, pinned = last.path, last.sha256, last.pinned
            _say(args, f"engine: downloaded {archive.name} ({fmt.bytes_si(last.size)}), sha256 {digest}"
                       + (" — the same as --sha256." if pinned else "."), sha256=digest, pinned=pinned)
        if pinned:
            how = rs.VERIFIED_PINNED
        else:
            answer = confirm or rs.sha256_text(_confirm_at_terminal(digest, archive.name) or "")
            if answer is None:
                print(f"dsv41 download: not unpacked: no published sha256 was given, so the download must be "
                      f"confirmed before it is used. It is kept in {archive.parent}.", file=sys.stderr)
                print(f"  what to do: compare {digest} with the sha256 the release page shows for {archive.name}; "
                      f"if they are the same, run `dsv41 download engine --url {url} --yes-i-checked-the-sha256 "
                      f"{digest}` (it is not downloaded again).", file=sys.stderr)
                return ExitCode.FAIL
            if answer != digest:
                rs.discard_archive(archive)
                print(f"dsv41 download: refused: the download's sha256 is {digest}, the one you confirmed is "
                      f"{answer}. The download was deleted and nothing was unpacked.", file=sys.stderr)
                print("  what to do: check the URL and the release page; if the page's sha256 really differs, do not "
                      "use this file.", file=sys.stderr)
                return ExitCode.FAIL
            how = rs.VERIFIED_CONFIRMED
        _say(args, f"engine: unpacking {archive.name} (sha256 {'pinned' if pinned else 'confirmed by you'})…")
        installed = rs.install_release(settings, archive, sha256=digest, how=how, url=url, compute_capability=cc,
                                       driver_cuda=driver, control=control)
        _say(args, f"engine: unpacked into {installed.folder}.", folder=str(installed.folder))
        return _adopt(args, ctx, installed.folder, installed.checks)
    except KeyboardInterrupt:
        control.cancel()
        print("dsv41 download: interrupted; nothing was unpacked (a partial download is deleted).", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except dl.DownloadError as exc:
        if r.tty and r.lines_drawn:
            sys.stdout.write("\n")
        print(f"dsv41 download: {exc.message}", file=sys.stderr)
        if exc.fix:
            print(f"  what to do: {exc.fix}", file=sys.stderr)
        return ExitCode.FAIL
