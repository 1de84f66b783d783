"""The base of every error whose message is meant for the user as it is: plain words saying what was wrong and
what to do. The CLI prints such an error without a traceback and exits 1; the GUI shows it in its panel."""


class UserError(Exception):
    """An expected failure with a plain-words message (``str(exc)``)."""


class EngineSetupError(UserError, RuntimeError):
    """The engine cannot be launched as configured (no binary, no model, no release...)."""


class PlacementRefused(EngineSetupError):
    """The plan the engine would start with was refused by the planner (the host cannot hold it)."""
