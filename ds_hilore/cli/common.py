"""What the ``hilore`` subcommands share: the exit status of a bad flag or configuration, the one
way ``--model`` is read, and building or loading the model it names.

NOTE [ One meaning of --model ]
Every subcommand that builds a model takes it from ``--model``, read the same way: a preset name
(``hilore bench``'s published shapes with random weights: ``tiny``, ``paper-cpu``,
``qwen2.5-1.5b`` ...), else a local checkpoint directory (one with a config.json, loaded with
``from_pretrained``, never downloaded), else a transformers model type (``qwen2``, ``llama``,
``phi3`` ...: a small random model of that architecture; ``hilore units --list-models`` prints
them). A name that is none of these is an error listing what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import sys

__all__ = ["EXIT_CONFIG_ERROR", "BadFlag", "ModelSource", "load_checkpoint", "one_line_error",
           "model_source", "say"]

EXIT_CONFIG_ERROR = 2  # a flag or a configuration the command cannot run with


class BadFlag(Exception):
    """A flag value a command cannot run with; the message names the flag, the value and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What ``--model`` names (NOTE [ One meaning of --model ])."""

    kind: str  # "preset" | "dir" | "arch"
    value: str

    @property
    def description(self) -> str:
        return {"preset": "preset, random weights", "dir": "local checkpoint",
                "arch": "small random model of this architecture"}[self.kind]


def model_source(value: str, flag: str = "--model") -> ModelSource:
    """``value`` read as NOTE [ One meaning of --model ] says; ``BadFlag`` when it is none."""
    from ds_hilore.bench.models import PRESETS
    from ds_hilore.bench import zoo

    if value in PRESETS:
        return ModelSource("preset", value)
    if os.path.isdir(value):
        if not os.path.isfile(os.path.join(value, "config.json")):
            raise BadFlag(f"{flag} {value}: a directory without config.json; pass a checkpoint "
                          "directory written by save_pretrained (hilore never downloads).")
        return ModelSource("dir", value)
    if os.sep not in value and value in zoo.causal_lm_types():
        return ModelSource("arch", value)
    raise BadFlag(f"{flag} {value}: not a preset ({', '.join(PRESETS)}), not a local checkpoint "
                  "directory, not a transformers model type (`hilore units --list-models` prints "
                  "them); pass one of these.")


def load_checkpoint(path: str):
    """The causal LM saved in ``path`` (training mode), never downloading."""
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise OSError(f"{path!r} is not a local checkpoint directory (no config.json there); "
                      "hilore never downloads. Pass a directory written by save_pretrained.")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise OSError(f"cannot load a causal LM from {path!r} without downloading: "
                      f"{str(error).splitlines()[0].rstrip('.')}. Pass a local checkpoint "
                      "directory (config.json + weights).") from None
    return model.train()


def one_line_error(message: str) -> None:
    """argparse's error (an unknown flag, a value outside its choices) as one line naming the
    flag and what is allowed; exits with the status of a bad configuration."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG_ERROR)


def say(command: str, message: str) -> None:
    """A progress line of ``hilore COMMAND`` on stderr."""
    print(f"hilore {command}: {message}", file=sys.stderr, flush=True)
