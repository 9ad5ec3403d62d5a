"""Errors a user can act on: each message names the problem and the fix."""


class NanoserveError(ValueError):
    """Base class for refusals caused by the caller's input or set-up."""


class CheckpointError(NanoserveError):
    """A model path, file or config the loader cannot use."""


class RequestError(NanoserveError):
    """A request the engine refuses before it allocates anything."""


class ConfigError(NanoserveError):
    """An engine flag or combination of flags that cannot work."""


class RequestFault(NanoserveError):
    """A request's own input failed while it ran (its grammar, past what compiling could check): that request
    alone ended, and the step's other requests went on."""


class GateError(NanoserveError):
    """A precondition of the decode fast path does not hold (a stale plan, a moved buffer, a shape too many)."""


ECHO_CHARS = 200  # the most of a caller's input an error message repeats back


def shown(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as repr() writes it, cut to `limit` characters: enough to find the mistake, never the whole
    (possibly megabytes of) input echoed into an error body and the log."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"
