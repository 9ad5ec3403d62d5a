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
