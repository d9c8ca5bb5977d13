"""User-facing errors of the engine.

Every error a user can cause (a missing or corrupt file, an unsupported architecture, a prompt over the
context, a budget below the minimum) is a `SlipstreamError` whose message is one line that names the
file, field or value and says why. The CLI prints that line and exits non-zero, without a traceback.
"""

from __future__ import annotations


class SlipstreamError(Exception):
    """Base class: the message is one line a user can act on."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class ModelLoadError(SlipstreamError):
    """A model file or folder could not be read: missing, truncated, corrupt or inconsistent."""


class UnsupportedModelError(SlipstreamError):
    """The model's architecture or a weight type is not supported."""


class ContextLengthError(SlipstreamError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


class BudgetError(SlipstreamError):
    """A VRAM budget is malformed or below the smallest plan the model can run in."""


class OutOfBudgetError(SlipstreamError):
    """An allocation on the accelerator would exceed the budget (the simulated device's out-of-memory)."""


class BadInputError(SlipstreamError):
    """A request's arguments are invalid (a broken image, an unknown plan kind, ...)."""
