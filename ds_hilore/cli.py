"""The ``hilore`` command: demonstrations, recovery units of a model, ds_config checks.

    hilore demo [--quick] [--model PATH]      HiLoRe vs no checkpointing vs HF checkpointing
    hilore grpo-demo                          how concentrated the GRPO coefficients ω are
    hilore units --arch qwen2                 recovery units attach() finds in a tiny model
    hilore units --model PATH                 ... or in a local checkpoint (never downloads)
    hilore config --check ds_config.json      validate the "hilore" block; exit 2 on error
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Mapping, Sequence

__all__ = ["TINY_ARCHS", "main"]

EXIT_CONFIG_ERROR = 2

# arch -> (transformers config class, causal-LM class, extra config fields). Sizes are tiny:
# the command lists units, it never trains. Dropouts are on so that layer-level dropout
# children (Phi-3's resid_*_dropout, GPT-NeoX's post_*_dropout) show up in their units.
TINY_ARCHS: Mapping[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"num_key_value_heads": 2, "resid_pdrop": 0.1, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": 2}),  # Phi-3's defaults lie outside vocab 128
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 {"hidden_dropout": 0.1, "use_parallel_residual": True}),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hilore`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    from ds_hilore.demo import add_arguments as add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="hilore", description="HiLoRe for DeepSpeed: store (H), pack (L) or recompute (R) "
        "the activations of each recovery unit -- a replacement for gradient checkpointing.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the HiLoRe demo (what `make demo` runs)",
                          description="Time, peak memory, retained bytes and gradient error of "
                          "HiLoRe plans vs no checkpointing and HF gradient checkpointing on a "
                          "small model. Exit status 1 if an exact plan is not bitwise exact.")
    add_demo_arguments(demo)
    demo.set_defaults(run=_run_demo)

    grpo = sub.add_parser("grpo-demo", help="GRPO coefficient statistics of a synthetic batch",
                          description="For every GRPO loss type: share of tokens whose "
                          "coefficient ω = dL/dlogp is exactly 0, and the share of Σ|ω| on the top 10% of tokens.")
    grpo.add_argument("--prompts", type=int, default=16, help="prompts in the batch (default 16)")
    grpo.add_argument("--group", type=int, default=8, help="completions per prompt (default 8)")
    grpo.add_argument("--length", type=int, default=512, help="completion length (default 512)")
    grpo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    grpo.set_defaults(run=_run_grpo_demo)

    units = sub.add_parser("units", help="list the recovery units attach() finds in a model",
                           description="Build a tiny random model of an architecture (or load a "
                           "local checkpoint, never downloading) and print each recovery unit: "
                           "name, kind and the decoder-layer children it owns.")
    source = units.add_mutually_exclusive_group(required=True)
    source.add_argument("--arch", choices=list(TINY_ARCHS), help="tiny model of this architecture")
    source.add_argument("--model", metavar="PATH", help="local checkpoint directory (from_pretrained)")
    units.add_argument("--config", metavar="DS_CONFIG", default=None,
                       help="ds_config whose \"hilore\" block names layers and children "
                            "(layer_pattern, attn_children, mlp_children); default: built-in")
    units.set_defaults(run=_run_units)

    config = sub.add_parser("config", help="validate the \"hilore\" block of a ds_config",
                            description="Print the resolved \"hilore\" block (defaults filled in) "
                            f"of a ds_config file, or the error; exit {EXIT_CONFIG_ERROR} on error.")
    config.add_argument("--check", metavar="PATH", required=True, help="ds_config JSON file")
    config.set_defaults(run=_run_config_check)
    return parser


# ---------------------------------------------------------------------------------- commands
def _run_demo(args: argparse.Namespace) -> int:
    from ds_hilore import demo

    preset, model, data = demo.setup(args)
    return demo.report(demo.run(model, data, preset))


def _run_grpo_demo(args: argparse.Namespace) -> int:
    from ds_hilore.grpo_demo import demo

    demo(args.prompts, args.group, args.length, args.seed)
    return 0


def _run_units(args: argparse.Namespace) -> int:
    from ds_hilore import HiLoReConfig, HiLoReConfigError, HiLoReError, attach

    try:
        config = HiLoReConfig.from_ds_config(args.config) if args.config else HiLoReConfig()
        if not config.enabled:
            config = HiLoReConfig(**{**config.to_dict(), "enabled": True})
        model = tiny_model(args.arch) if args.arch else _load(args.model)
        runtime = attach(model, config)
    except (HiLoReConfigError, HiLoReError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"{type(model).__name__}: {len(runtime.units)} recovery units "
          f"in {len(runtime.units) // 2} decoder layers")
    width = max(len(u.name) for u in runtime.units)
    print(f"{'name':<{width}}  {'kind':<4}  children")
    for unit in runtime.units:
        print(f"{unit.name:<{width}}  {unit.kind:<4}  {', '.join(unit.children)}")
    runtime.detach()
    return 0


def _run_config_check(args: argparse.Namespace) -> int:
    from ds_hilore import HiLoReConfig, HiLoReConfigError

    try:
        config = HiLoReConfig.from_ds_config(args.check)
    except HiLoReConfigError as error:
        print(f"error in {args.check}:\n{error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not config.enabled:
        print(f"{args.check}: HiLoRe is off (no \"hilore\" block, or \"enabled\": false).")
    else:
        print(f"{args.check}: the \"hilore\" block is valid; resolved (defaults filled in):")
    print(json.dumps({"hilore": config.to_dict()}, indent=2))
    return 0


# ---------------------------------------------------------------------------------- models
def tiny_model(arch: str, layers: int = 2, seed: int = 0):
    """A tiny causal LM of ``arch`` (a key of ``TINY_ARCHS``) with random weights, training mode."""
    import torch
    import transformers

    config_name, model_name, extra = TINY_ARCHS[arch]
    config: Callable = getattr(transformers, config_name)
    cfg = config(vocab_size=128, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=False,
                 attention_dropout=0.1, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    return model.train()


def _load(path: str):
    import os

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


if __name__ == "__main__":
    sys.exit(main())
