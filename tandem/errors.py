"""Errors raised at Tandem's boundaries."""


class InvalidRequestError(ValueError):
    """A request is malformed (empty or over-long prompt, bad sampling parameters, bad token ids).

    Services map it to HTTP 400 / gRPC INVALID_ARGUMENT; it never affects other requests.

    Args:
        message: what is wrong, for the caller.
        param: the request field at fault (OpenAI's error ``param``: "temperature", "max_tokens",
            "prompt", ...), or None when no single field is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_utf8(text: str, what: str = "prompt", param: str | None = "prompt") -> None:
    """Raise InvalidRequestError when ``text`` has no UTF-8 encoding (a lone surrogate: ``"\\ud800"``
    in JSON, or undecodable bytes on a command line): it could be neither tokenized nor matched
    against decoded text nor sent to another service."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        # a byte no UTF-8 decoder accepted reaches Python as U+DC80..U+DCFF (surrogateescape)
        found = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}")
        raise InvalidRequestError(f"{what} is not valid UTF-8 text ({found} at character {exc.start})",
                                  param=param) from None


class ConfigError(ValueError):
    """A bad engine setting (unknown device, CUDA asked for on a machine without it, ...)."""


def check_fields(cls, record: dict) -> None:
    """Raise ValueError ("missing a, b; unknown c") unless ``record``'s keys are fields of the
    dataclass ``cls`` and include every field without a default: the shape check of a JSON object
    read back into ``cls(**record)``."""
    import dataclasses

    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    missing = sorted(f.name for f in fields if f.name not in record and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    unknown = sorted(set(record) - names)
    if missing or unknown:
        raise ValueError("; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                   + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
