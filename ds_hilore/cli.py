"""The ``hilore`` command: demonstrations, recovery units of a model and what they cost, ds_config checks.

    hilore demo [--quick] [--model PATH]      HiLoRe vs no checkpointing vs HF checkpointing
    hilore grpo-demo                          how concentrated the GRPO coefficients ω are
    hilore units --arch qwen2                 recovery units attach() finds in a tiny model
    hilore units --model PATH                 ... or in a local checkpoint (never downloads)
    hilore units --list-archs                 the architectures --arch accepts
    hilore profile --model qwen2 --seq-len 512 --micro-batch 8 [--json PATH]
                                              measured cost, utility and susceptibility per unit
    hilore bench --model tiny [--ranks 2 --json OUT.json --plot OUT.png]
    hilore bench --model tiny --run-steps 20 --lengths 128,256,512
    hilore bench --report OUT.json [--plot OUT.png] | --report A.json B.json ...
                                              activation methods through DeepSpeed engines on
                                              several ranks: speed, memory, gradient error
    hilore config --check ds_config.json      validate the "hilore" block; exit 2 on error
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

__all__ = ["main"]

EXIT_CONFIG_ERROR = 2
PROBE_TOKENS = 32  # sequence length of the forward that measures each unit's bytes per token


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hilore`` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser (the bench's: one line)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (commands.choices.get(args.command) or parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    from ds_hilore.bench.demo import add_arguments as add_demo_arguments

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
                           "name, kind, the bytes it holds per token under H (measured by one "
                           f"forward of {PROBE_TOKENS} tokens) and the layer's children it runs.")
    source = units.add_mutually_exclusive_group(required=True)
    source.add_argument("--arch", metavar="NAME",
                        help="tiny model of this transformers model_type (see --list-archs)")
    source.add_argument("--model", metavar="PATH", help="local checkpoint directory (from_pretrained)")
    source.add_argument("--list-archs", action="store_true",
                        help="print the model_types --arch accepts (every causal LM of transformers)")
    units.add_argument("--config", metavar="DS_CONFIG", default=None,
                       help="ds_config whose \"hilore\" block selects layers or names the units' "
                            "children (layer_pattern, attn_children, mlp_children); default: built-in")
    units.set_defaults(run=_run_units)

    profile = sub.add_parser(
        "profile", help="measure what each recovery unit costs and what HiLoRe plans for a shape",
        description="Build a small random model of a preset (a transformers model_type) or load a "
        "local checkpoint (never downloading), attach HiLoRe, run synthetic GRPO microbatches of "
        "one shape -- the profiled ones all-R, then the calibrated ones -- and print per unit: "
        "bytes kept by H, L and a fast-forward, recompute / pack / unpack time, the utility of H "
        "and L against R, the codec's relative error, the calibrated susceptibility s of its "
        "group and the planned action; then the plan's mix, kept bytes and estimated error.")
    from ds_hilore import cli_profile

    cli_profile.add_arguments(profile)
    profile.set_defaults(run=cli_profile.run)

    bench = sub.add_parser(
        "bench", help="time activation methods through DeepSpeed engines on several ranks",
        description="Launch --ranks processes (gloo on a CPU, NCCL on GPUs) and run the GRPO "
        "actor update (forward, loss, engine.backward, engine.step) of each activation method "
        "(no checkpointing, HF GC, HiLoRe and its variants at each memory budget, ...) through "
        "its own DeepSpeed engine (ZeRO --zero-stage) on copies of one model, on GRPO-shaped "
        "steps. Paired mode (default): warm-up, peak memory, the step's gradient error against "
        "no checkpointing, then paired rounds (every method one step per round, the order "
        "rotating; a step's time the slowest rank's) and, per pair, the median paired ratio "
        "with its 95 % interval. Whole-run mode (--run-steps): fresh engines, HiLoRe's warm-up "
        "included, and what the warm-up cost against GC. Prints a table; --json and --plot "
        "write the report and the plot.")
    from ds_hilore.bench.options import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(run=_run_bench)
    bench.error = _one_line_error  # a bad flag: one line, as the bench's own checks say it

    config = sub.add_parser("config", help="validate the \"hilore\" block of a ds_config",
                            description="Print the resolved \"hilore\" block (defaults filled in) "
                            f"of a ds_config file, or the error; exit {EXIT_CONFIG_ERROR} on error.")
    config.add_argument("--check", metavar="PATH", required=True, help="ds_config JSON file")
    config.set_defaults(run=_run_config_check)
    return parser


def _one_line_error(message: str) -> None:
    """argparse's error (an unknown flag, a value outside its choices) as one line naming the
    flag and what is allowed; exits with the status of a bad configuration."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG_ERROR)


# ---------------------------------------------------------------------------------- commands
def _run_demo(args: argparse.Namespace) -> int:
    from ds_hilore.bench import demo

    preset, model, data = demo.setup(args)
    return demo.report(demo.run(model, data, preset))


def _run_grpo_demo(args: argparse.Namespace) -> int:
    from ds_hilore.bench.grpo_demo import demo

    demo(args.prompts, args.group, args.length, args.seed)
    return 0


def _run_units(args: argparse.Namespace) -> int:
    from ds_hilore import HiLoReConfig, HiLoReConfigError, HiLoReError, attach
    from ds_hilore.bench import zoo

    if args.list_archs:
        print("\n".join(zoo.causal_lm_types()))
        return 0
    if args.arch is not None and args.arch not in zoo.causal_lm_types():
        print(f"error: unknown architecture {args.arch!r}; `hilore units --list-archs` prints the "
              "names --arch accepts (transformers model_types of causal LMs).", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        config = HiLoReConfig.from_ds_config(args.config) if args.config else HiLoReConfig()
        # H everywhere for the measuring forward, whatever force_plan the file sets
        config = HiLoReConfig(**{**config.to_dict(), "enabled": True, "force_plan": "H"})
        model = tiny_model(args.arch) if args.arch else _load(args.model)
        runtime = attach(model, config)
    except zoo.ZooSkip as skip:
        print(f"error: no small {args.arch} model can be built: {skip.reason}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (HiLoReConfigError, HiLoReError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        per_token = _bytes_per_token(model, runtime)
    except HiLoReError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        runtime.detach()
    print(_units_table(model, runtime.units, per_token))
    return 0


def _bytes_per_token(model, runtime) -> list[float | None]:
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


def _units_table(model, units, per_token: list[float | None]) -> str:
    layers = len({u.layer_index for u in units})
    lines = [f"{type(model).__name__}: {len(units)} recovery units in {layers} decoder layers"]
    width = max((len(u.name) for u in units), default=4)
    lines.append(f"{'name':<{width}}  {'kind':<5}  {'B/token':>8}  children")
    for unit, nbytes in zip(units, per_token):
        held = "-" if nbytes is None else f"{nbytes:.0f}"
        lines.append(f"{unit.name:<{width}}  {unit.kind:<5}  {held:>8}  {', '.join(unit.children)}")
    return "\n".join(lines)


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


# ---------------------------------------------------------------------------------- bench
def _run_bench(args: argparse.Namespace) -> int:
    from ds_hilore.bench import bench, report

    try:
        if args.report:
            return report.show(args.report, args.plot)
        return bench.main(args)
    except (bench.BenchError, report.BenchReportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except bench.RankFailure as error:
        print(f"hilore bench: error: {error}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------- models
def tiny_model(arch: str, layers: int = 2, seed: int = 0):
    """A tiny causal LM of ``arch`` (a transformers model_type) with random weights, training mode."""
    from ds_hilore.bench import zoo

    return zoo.tiny_causal_lm(arch, layers=layers, seed=seed)


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
