"""The engine's keeper (``engine_manager/keeper.py``): the key reaches it through a pipe, never its environment;
log files are never written through a symbolic link; a log the engine writes itself (Strata's config ``log``,
where ``serve/server.py`` ``StrataEngine.__init__`` sends the native engine's stderr, opened for appending) is
followed into the panel's log, masked, prefixed, this run's lines only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from supervisor_helpers import hw, tiny_engine

from engine_manager import supervisor as sv
from engine_manager.engine_state import READY
from engine_manager.launch import KEEPER
from engine_manager.settings import load_settings

SECRET = "dsv41-" + "k3yk3y" * 5


def keeper(tmp_path: Path, *opts: str, cmd: list[str], stdin: bytes | None = b"", env=None):
    return subprocess.run([sys.executable, "-I", "-S", str(KEEPER), "--log", str(tmp_path / "e.log"),
                           "--exit-file", str(tmp_path / "exit.json"), *opts, "--", *cmd],
                          input=stdin, capture_output=True, timeout=60, env=env)


def test_keeper_masks_secrets_read_from_its_stdin(tmp_path):
    cp = keeper(tmp_path, "--mask-stdin", cmd=["sh", "-c", f"echo key={SECRET}; env"],
                stdin=f"{SECRET}\n".encode())
    assert cp.returncode == 0, cp.stderr
    text = (tmp_path / "e.log").read_text()
    assert SECRET not in text and "key=dsv4…(masked)" in text


def test_the_key_is_not_in_the_keepers_environment(tmp_path, monkeypatch, free_port):
    """/proc/<keeper>/environ is readable for the keeper's whole life: the supervisor must not put the key there
    (it used to pass it as DSV41_KEEPER_MASK). An engine that takes its key from the environment (Strata's
    ``serve/server.py`` ``main()``: ``--api-key`` defaults to ``$STRATA_API_KEY``) gets it in its own environment
    only, through the keeper's pipe."""
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    settings = load_settings().settings                    # a generated key, kept in the 0600 settings file
    key = settings.api_key
    assert key and key not in "".join(os.environ.values())
    base = tiny_engine()

    class EnvKeyEngine(type(base)):
        def build_launch(self, settings, plan, workdir):
            spec = super().build_launch(settings, plan, workdir)
            spec.env["STRATA_API_KEY"] = settings.api_key
            return spec

    sup = sv.Supervisor(settings, hardware=hw(), grace_s=5.0, poll_s=0.05)
    try:
        for _ in sup.run(EnvKeyEngine(), watch=False):
            pass
        st = sup.status(check_health=False)
        assert st.state == READY and st.keeper_pid and st.pid
        environ = Path(f"/proc/{st.keeper_pid}/environ").read_bytes()
        assert key.encode() not in environ and b"DSV41_KEEPER_MASK" not in environ
        assert b"STRATA_API_KEY" not in environ
        cmdline = Path(f"/proc/{st.keeper_pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline and b"--mask-stdin" in cmdline
        engine_env = Path(f"/proc/{st.pid}/environ").read_bytes().split(b"\0")
        assert f"STRATA_API_KEY={key}".encode() in engine_env
    finally:
        for _ in sup.stop(force=True):
            pass


def test_the_keeper_refuses_a_symlinked_log(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    (tmp_path / "e.log").symlink_to(victim)
    cp = keeper(tmp_path, cmd=["sh", "-c", "echo engine output"])
    assert cp.returncode == 2
    assert b"symbolic link" in cp.stderr and b"Traceback" not in cp.stderr
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644


def test_the_keeper_follows_the_engines_own_log_from_this_run_only(tmp_path):
    own = tmp_path / "engine-own.log"
    own.write_text("line of an earlier run\n")
    script = (f"echo server says hi; echo 'unknown argument: --bogus key={SECRET}' >> {own}; "
              f"printf 'no newline at the end' >> {own}; exit 2")
    cp = keeper(tmp_path, "--mask-stdin", "--follow", str(own), cmd=["sh", "-c", script],
                stdin=f"{SECRET}\n".encode())
    assert cp.returncode == 2, cp.stderr
    lines = (tmp_path / "e.log").read_text().splitlines()
    assert "server says hi" in lines
    assert "[engine] unknown argument: --bogus key=dsv4…(masked)" in lines
    assert "[engine] no newline at the end" in lines
    assert not any("earlier run" in ln for ln in lines)
    # the engine's words are in before the keeper's exit line (crash classification reads them)
    assert lines.index("[engine] no newline at the end") < next(i for i, ln in enumerate(lines) if "ended:" in ln)
    assert stat.S_IMODE(own.stat().st_mode) == 0o600 or own.stat().st_uid == os.getuid()


def test_the_keeper_refuses_to_follow_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    own = tmp_path / "engine-own.log"
    own.symlink_to(victim)
    cp = keeper(tmp_path, "--follow", str(own), cmd=["sh", "-c", "true"])
    assert cp.returncode == 2 and b"symbolic link" in cp.stderr
    assert victim.read_text() == "precious\n"         # not truncated through the link
