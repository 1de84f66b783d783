"""The first-run wizard's model step, under a real X server: it says the scripted engine needs none of the
264.5 GB it offers to download, so a machine that fails every check is not sent to fetch it."""
from __future__ import annotations

import pytest

from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui


def test_model_step_says_the_scripted_engine_needs_none_of_the_download(qtbot):
    from app.context import AppContext
    from app.first_run import ModelPage

    page = ModelPage(AppContext(load_settings()))
    qtbot.addWidget(page)
    page.show()
    # the subtitle (short: a wizard cuts a long one) and the words under it
    from PySide6.QtWidgets import QLabel
    said = page.subTitle() + " " + page.findChild(QLabel, "firstRunModelIntro").text()
    assert "264.5 GB" in said
    assert "scripted engine" in said and "needs none of it" in said and "Next" in said
