"""The GUI tests' shared fixtures and rules, loaded for every test by ``tests/conftest.py`` (``pytest_plugins``).

- Every test that uses ``qtbot`` or ``qapp`` (pytest-qt; pytest-xvfb gives the real X server) is marked ``gui``,
  whether or not its module says ``pytestmark = pytest.mark.gui``: ``-m "not gui"`` then really leaves every
  GUI test out, and ``-m gui`` runs them all.
- ``app_ctx``: the panel's :class:`app.context.AppContext` over the test's own settings (``conftest.isolated_dirs``
  gives every test its own config and data dirs).
- ``shown``: a widget added to ``qtbot``, sized and shown, and exposed before the test goes on.
- ``panel_engine_port``: the settings for the panel's own engine (the scripted engine on ``free_port``), and that
  engine stopped at the end whatever happens.

Nothing here imports Qt or ``app`` at import time: a test run without GUI tests never loads them.
"""

from __future__ import annotations

import pytest

GUI_FIXTURES = frozenset({"qtbot", "qapp"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if GUI_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("gui") is None:
            item.add_marker(pytest.mark.gui)


@pytest.fixture
def app_ctx(qapp):
    """``AppContext(load_settings())`` for one test."""
    from app.context import AppContext
    from engine_manager.settings import load_settings

    return AppContext(load_settings())


@pytest.fixture
def panel_engine_port(monkeypatch, free_port):
    """The panel's own engine: the scripted engine (``--load-time 0.3``) on ``free_port``, stopped at the end
    whatever happens (never leave an engine behind)."""
    from engine_manager import supervisor as sv
    from engine_manager.settings import load_settings

    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.3")
    monkeypatch.setenv("DSV41_SERVER_ENGINE", "sim")
    yield free_port
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


@pytest.fixture
def shown(qtbot):
    """``shown(widget, width=, height=)``: the widget, owned by ``qtbot`` (closed at the end), shown and exposed."""

    def show(widget, width: int | None = None, height: int | None = None):
        qtbot.addWidget(widget)
        if width and height:
            widget.resize(width, height)
        widget.show()
        qtbot.waitExposed(widget)
        return widget

    return show
