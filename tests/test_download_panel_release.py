"""The Downloads tab's ways to the real engine, under a real X server: "Use an engine release I already have…"
(driven through the method the folder chooser calls, not the native dialog) and "Download from URL" against a real
loopback HTTP server serving a tar of the stand-in Strata release, with the sha256 pinned, confirmed, or wrong."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from engine_manager import download as dl
from engine_manager.download import release_source as rs
from engine_manager.testing.hub import LocalHub

from strata_support import make_strata_release

pytestmark = pytest.mark.gui

ASSET = "strata-v0.1.0-linux-x86_64-cuda13-sm120.tar.gz"


@pytest.fixture
def panel(qtbot, app_ctx):
    from app.download_panel import DownloadPanel
    w = DownloadPanel(app_ctx)
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    qtbot.waitUntil(lambda: w.engine_label.text() != "", timeout=10000)
    yield w
    w.shutdown()
    qtbot.waitUntil(lambda: w.worker is None, timeout=15000)


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    d = tmp_path_factory.mktemp("gui-release")
    rel = make_strata_release(d / "rel")
    out = d / ASSET
    with tarfile.open(out, "w:gz", dereference=True) as tar:
        tar.add(rel, arcname="strata-v0.1.0")
    return out


@pytest.fixture
def served(archive):
    with LocalHub() as h:
        path = f"/deepseek-one-gpu/releases/download/v0.1.0/{ASSET}"
        f = h.add_raw(path, archive)
        yield h.raw_url(path), f.sha256


def _check(panel, qtbot, folder: Path):
    with qtbot.waitSignal(panel.releaseChecked, timeout=60000) as sig:
        panel.use_release_folder(folder)
    qtbot.waitUntil(lambda: panel.worker is None, timeout=10000)
    return sig.args[1]


def test_a_good_release_folder_becomes_engine_dir(panel, qtbot, tmp_path):
    rel = make_strata_release(tmp_path / "my-strata")
    checks = _check(panel, qtbot, rel)
    assert all(c.status != "fail" for c in checks)
    assert panel.ctx.settings.engine_dir == rel
    assert "passed the release checks" in panel.checks_label.text()
    qtbot.waitUntil(lambda: "Engine release in use" in panel.engine_label.text(), timeout=10000)
    assert "version 0.1.42, CUDA 13.0, sm_120" in panel.engine_label.text()


def test_a_failing_folder_shows_each_failure_with_its_fix_and_changes_nothing(panel, qtbot, tmp_path):
    rel = make_strata_release(tmp_path / "no-wheels")
    shutil.rmtree(next((rel / ".venv" / "lib").glob("python3*/site-packages")) / "nvidia")
    checks = _check(panel, qtbot, rel)
    assert [c.id for c in checks if c.status == "fail"] == ["cuda_libs"]
    text = panel.checks_label.text()
    assert "1 of" in text and "CUDA libraries for the engine" in text
    assert "What to do:" in text and "nvidia-cublas==13.0.2.14" in text
    assert panel.ctx.settings.engine_dir is None
    assert "setting was not changed" in panel.engine_label.text()
    assert panel.recheck_btn.isVisible()
    # fixed by hand, then "Check again": now it is used
    site = next((rel / ".venv" / "lib").glob("python3*/site-packages"))
    (site / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "lib" / "libcublas.so.13").write_bytes(b"")
    with qtbot.waitSignal(panel.releaseChecked, timeout=60000):
        panel.recheck_btn.click()
    assert panel.ctx.settings.engine_dir == rel


def test_url_without_sha256_waits_for_the_users_confirmation(panel, qtbot, served):
    url, sha = served
    panel.url_edit.setText(url)
    panel.url_btn.click()
    qtbot.waitUntil(lambda: panel.confirm_box.isVisible(), timeout=60000)
    # the box shows as the download's result arrives; its worker ends a moment later, and the button is enabled
    # only then (a loaded CI run typed the right sha256 in between and found the button still off)
    qtbot.waitUntil(lambda: panel.worker is None, timeout=60000)
    assert sha in panel.digest_label.text()
    s = panel.ctx.settings
    assert not [p for p in (s.cache_path / "engine").iterdir() if not p.name.startswith(".")]   # nothing unpacked
    panel.confirm_edit.setText("ab" * 32)
    assert not panel.confirm_btn.isEnabled() and "not the same" in panel.match_label.text()
    assert panel.confirm_release("ab" * 32) is False
    assert panel.ctx.settings.engine_dir is None
    panel.confirm_edit.setText(f"sha256:{sha}")
    assert panel.confirm_btn.isEnabled()
    with qtbot.waitSignal(panel.releaseChecked, timeout=60000) as sig:
        panel.confirm_btn.click()
    folder, checks = sig.args
    assert all(c.status != "fail" for c in checks)
    assert panel.ctx.settings.engine_dir == folder
    assert json.loads((folder / dl.RELEASE_MARKER).read_text())["verified"] == rs.VERIFIED_CONFIRMED
    qtbot.waitUntil(lambda: "confirmed by you" in panel.engine_label.text(), timeout=10000)


def test_url_with_a_wrong_sha256_is_refused(panel, qtbot, served):
    url, sha = served
    wrong = ("0" if sha[0] != "0" else "1") + sha[1:]
    panel.start_release_url(url, wrong)
    qtbot.waitUntil(lambda: panel.error.isVisible(), timeout=60000)
    assert "Refused" in panel.error.message.text() and "deleted" in panel.error.message.text()
    assert panel.ctx.settings.engine_dir is None and not panel.confirm_box.isVisible()


def test_url_with_the_right_sha256_is_used_without_asking(panel, qtbot, served):
    url, sha = served
    with qtbot.waitSignal(panel.releaseChecked, timeout=60000) as sig:
        panel.start_release_url(url, sha)
    folder, _checks = sig.args
    assert panel.ctx.settings.engine_dir == folder
    assert json.loads((folder / dl.RELEASE_MARKER).read_text())["verified"] == rs.VERIFIED_PINNED


def test_the_wizard_model_step_reports_the_release_check(panel, qtbot, app_ctx, tmp_path):
    from app.first_run import ModelPage
    page = ModelPage(app_ctx, panel)
    qtbot.addWidget(page)
    rel = make_strata_release(tmp_path / "no-venv", venv=False)
    _check(panel, qtbot, rel)
    assert "✗" in page.release_state.text() and "The release's Python (.venv)" in page.release_state.text()
    assert "setup" in page.release_state.text()
