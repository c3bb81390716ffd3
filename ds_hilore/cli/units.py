"""``hilore units``: the recovery units HiLoRe finds in a model, and what each keeps under H."""

from __future__ import annotations

import argparse
import sys

from ds_hilore.cli.common import EXIT_CONFIG_ERROR, BadFlag, load_checkpoint, model_source

__all__ = ["HELP", "add_arguments", "run"]

PROBE_TOKENS = 32  # sequence length of the forward that measures each unit's bytes per token
HELP = "list the recovery units HiLoRe finds in a model"
DESCRIPTION = (f"Build the model --model names (a preset or a transformers model type, small and "
               "with random weights, cut to --layers decoder layers; or a local checkpoint, never "
               "downloaded), attach HiLoRe and print each recovery unit: its name, its kind, the "
               f"bytes it keeps per token under H (measured by one forward of {PROBE_TOKENS} tokens) and "
               "the layer's children it runs.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="NAME_OR_DIR",
                        help="a preset (as hilore bench takes), a local checkpoint directory, or "
                             "a transformers model type such as qwen2 (see --list-models)")
    source.add_argument("--list-models", action="store_true",
                        help="print the transformers model types --model accepts (every causal LM)")
    parser.add_argument("--layers", metavar="L", type=int, default=2,
                        help="decoder layers of a preset or model type (default 2; a checkpoint "
                             "keeps its own)")
    parser.add_argument("--config", metavar="DS_CONFIG", default=None,
                        help="ds_config whose \"hilore\" block selects layers or names the units' "
                             "children (layer_pattern, attn_children, mlp_children); default: built-in")


def run(args: argparse.Namespace) -> int:
    from ds_hilore import HiLoReConfig, HiLoReConfigError, HiLoReError, attach
    from ds_hilore.bench import zoo

    if args.list_models:
        print("\n".join(zoo.causal_lm_types()))
        return 0
    try:
        if args.layers < 1:
            raise BadFlag(f"--layers {args.layers}: must be >= 1; pass e.g. --layers 2.")
        source = model_source(args.model)
        config = HiLoReConfig.from_ds_config(args.config) if args.config else HiLoReConfig()
        # H everywhere for the measuring forward, whatever force_plan the file sets
        config = HiLoReConfig(**{**config.to_dict(), "enabled": True, "force_plan": "H"})
        model = _build(source, args.layers)
        runtime = attach(model, config)
    except zoo.ZooSkip as skip:
        print(f"error: no small {args.model} model can be built: {skip.reason}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (BadFlag, HiLoReConfigError, HiLoReError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        per_token = bytes_per_token(model, runtime)
    except HiLoReError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        runtime.detach()
    print(units_table(model, runtime.units, per_token))
    return 0


def _build(source, layers: int):
    from ds_hilore.bench import zoo
    from ds_hilore.bench.models import build_model

    if source.kind == "preset":
        return build_model(source.value, "fp32", "cpu", seed=0, layers=layers, lora_r=None)
    if source.kind == "dir":
        return load_checkpoint(source.value)
    return zoo.tiny_causal_lm(source.value, layers=layers, seed=0)


def bytes_per_token(model, runtime) -> list[float | None]:
    """Bytes each unit holds under H after one forward of (1, PROBE_TOKENS) tokens, per token.

    None for every unit while the runtime does not record held bytes per unit (``Unit.nbytes``
    missing, or 0 everywhere although H always holds something).
    """
    import torch

    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        out = model(input_ids=ids)  # HiLoRe captures only when a backward can follow
    del out  # frees the captured tensors; the units keep their counts
    held = [getattr(u, "nbytes", 0) for u in runtime.units]  # bytes
    if not any(held):
        return [None] * len(held)
    return [n / PROBE_TOKENS for n in held]


def units_table(model, units, per_token: list[float | None]) -> str:
    layers = len({u.layer_index for u in units})
    lines = [f"{type(model).__name__}: {len(units)} recovery units in {layers} decoder layers"]
    width = max((len(u.name) for u in units), default=4)
    lines.append(f"{'name':<{width}}  {'kind':<5}  {'B/token':>8}  children")
    for unit, nbytes in zip(units, per_token):
        held = "-" if nbytes is None else f"{nbytes:.0f}"
        lines.append(f"{unit.name:<{width}}  {unit.kind:<5}  {held:>8}  {', '.join(unit.children)}")
    return "\n".join(lines)
