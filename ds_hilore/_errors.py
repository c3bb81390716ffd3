"""Error types and the internal-invariant helper."""


class HiLoReConfigError(ValueError):
    """A ``"hilore"`` config value is invalid; the message names the key, the value and the fix."""


class HiLoReError(RuntimeError):
    """HiLoRe cannot do what was asked with this model or setup; the message says what to change."""


def bug(message: str) -> AssertionError:
    """An internal invariant broke: ``raise bug("...")``. Never used for user input."""
    return AssertionError(
        f"{message} -- this is a bug in ds_hilore; please report it with the model and config used."
    )
