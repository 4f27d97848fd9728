"""User-facing errors.

A `StofError` carries a one-line message meant for the user of the CLI or the Python API; the CLI prints it
as ``stof: error: <message>`` and exits with status 2. Anything else escaping is a bug. It is a ``ValueError``
(the input's value is what is wrong), so API callers that handle bad arguments that way catch it too.
"""

__all__ = ["StofError", "MaskSpecError"]


class StofError(ValueError):
    """An error caused by the user's input (bad file, bad spec, sizes that do not fit)."""


class MaskSpecError(StofError):
    """A mask spec that cannot be parsed or built."""
