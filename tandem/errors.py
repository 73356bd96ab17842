"""Errors raised at Tandem's boundaries."""


class InvalidRequestError(ValueError):
    """A request is malformed (empty or over-long prompt, bad sampling parameters, bad token ids).

    Services map it to HTTP 400 / gRPC INVALID_ARGUMENT; it never affects other requests.
    """


class ConfigError(ValueError):
    """A bad engine setting (unknown device, CUDA asked for on a machine without it, ...)."""
