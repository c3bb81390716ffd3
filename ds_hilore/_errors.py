"""Error types and the internal-invariant helper."""


class HiLoReConfigError(ValueError):
    """A ``"hilore"`` config value is invalid; the message names the key, the value and the fix."""


class HiLoReError(RuntimeError):
    """HiLoRe cannot do what was asked with this model or setup; the message says what to change."""


class HiLoReNameError(HiLoReConfigError, HiLoReError):
    """A name in the ``"hilore"`` block (``force_plan`` glob, ``layer_pattern``,
    ``attn_children`` / ``mlp_children``) matches nothing in the model, or names children that
    do not form the two units the override asks for. Only the model can tell,
    so it is raised once the names can be checked (at attach for transformers models, else at the
    first training forward); it is both a ``HiLoReConfigError`` (the fix is in the block) and a
    ``HiLoReError`` (as it was raised before), so either ``except`` clause catches it."""


def bug(message: str) -> AssertionError:
    """An internal invariant broke: ``raise bug("...")``. Never used for user input."""
    return AssertionError(
        f"{message} -- this is a bug in ds_hilore; please report it with the model and config used."
    )
