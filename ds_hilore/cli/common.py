"""What the ``hilore`` subcommands share: the exit status of a bad flag or configuration, the one
way ``--model`` is read, and building or loading the model it names.

NOTE [ One meaning of --model ]
Every subcommand that builds a model takes it from ``--model``, read the same way: a preset name
(``hilore bench``'s published shapes with random weights: ``tiny``, ``paper-cpu``,
``qwen2.5-1.5b`` ...), else a local checkpoint directory (one with a config.json, loaded with
``from_pretrained``, never downloaded), else a transformers model type (``qwen2``, ``llama``,
``phi3`` ...: a small random model of that architecture; ``hilore units --list-models`` prints
them) -- except ``hilore bench``, whose timings need a shape that was chosen: presets and
checkpoint directories only. A name that is none of these is an error listing what is
accepted.
"""

from __future__ import annotations

import dataclasses
import os
import sys

__all__ = ["EXIT_CONFIG_ERROR", "BadFlag", "ModelSource", "check_checkpoint", "load_checkpoint",
           "one_line_error", "model_source", "say"]

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


# the weights a checkpoint directory holds: one file, or the index of its shards
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model.bin.index.json")


def check_checkpoint(path: str) -> None:
    """``OSError`` where ``load_checkpoint(path)`` would fail for the directory itself (its
    config does not load, is not a causal LM's, or no weights are there), found without
    loading the weights: the bench checks before it starts its ranks."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise OSError(f"its config.json does not load ({str(error).splitlines()[0].rstrip('.')})"
                      ". Pass a directory written by save_pretrained.") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise OSError(f"it holds a {config.model_type!r} model, not a causal LM. Pass a causal "
                      "LM's checkpoint directory.")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _WEIGHTS):
        raise OSError(f"no weights there ({' or '.join(_WEIGHTS[::2])}). Pass a directory "
                      "written by save_pretrained (config.json + weights).")


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
