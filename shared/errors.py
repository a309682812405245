"""Exceptions a user can cause, each with a message naming the thing to fix.

The CLI prints `str(exc)` on one line and exits non-zero for any `EdgecoreError`;
the HTTP layer maps them to OpenAI-style error objects. `EngineDead` is the one
exception here a user does not cause: the engine (thread or process) failed.
"""


class EdgecoreError(Exception):
    """Base of every error caused by input (files, flags, requests), not by a bug."""


class ConfigError(EdgecoreError):
    """A configuration file or value is missing, malformed or unsupported."""


class ModelLoadError(EdgecoreError):
    """Model files are missing, corrupt, or do not match the configuration."""


class RequestError(EdgecoreError):
    """A request cannot be served as asked (too long, bad sampling parameters)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a one-line log of an exception whose message may run on."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class EngineDead(RuntimeError):
    """The engine failed or exited; requests in flight and new ones cannot be served."""


class AdapterError(RequestError):
    """An adapter that cannot be served: its files, config, shapes or rank (a 400 at load, one line at start)."""

    def __init__(self, message: str, param: str = "lora_path"):
        super().__init__(message, param, "invalid_lora_adapter")
