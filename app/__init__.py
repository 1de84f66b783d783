"""dsv41 panel GUI: a PySide6 + pyqtgraph shell over engine_manager. It renders state and forwards intents;
every decision lives in engine_manager."""
