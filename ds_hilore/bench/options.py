"""The flags of ``hilore bench`` and the configuration they make (``Config``), checked: every
bad value is one line (``BenchError``) naming the flag and what is allowed.

Two modes: paired rounds (the default: every method warmed up, then timed one optimizer step
each per round, ``--rounds``), and the whole run (``--run-steps N``: fresh engines run N steps
each from the start, HiLoRe's warm-up included, at sequence lengths drawn from ``--lengths``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ds_hilore.bench.data import LAYOUTS
from ds_hilore.bench.methods import METHODS
from ds_hilore.bench.models import PRESETS, SHAPES, is_model
from ds_hilore.bench.targets import default_tolerance

__all__ = ["DEFAULT_BUDGETS", "DEFAULT_METHODS", "DEFAULT_ROUNDS", "BenchError", "Config",
           "add_arguments", "add_run_arguments", "check_args", "parse_budgets", "parse_methods",
           "parse_rounds"]

DEFAULT_METHODS = ("nogc", "gc", "static", "hr", "hilore")  # the decisive comparisons
DEFAULT_BUDGETS = "1.10"
DEFAULT_ROUNDS = 7  # the fewest a 95 % interval needs is 6 (paired.MIN_ROUNDS)
# --elide-zero-rows: the ds_config's key (NOTE [ Stand-ins on accelerators ])
ELIDE_ZERO_ROWS = {"auto": "auto", "true": True, "whole": "whole", "false": False}
DEFAULT_SHAPE = dict(seq_len=256, micro_batch=8, group_size=8, grad_accum=2, zero_adv_share=0.5,
                     clip_share=0.1)
ZERO_STAGES = (0, 1, 2, 3)


class BenchError(Exception):
    """A flag value the bench cannot run with; one line naming the flag and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a bench run is told (JSON-able: the ranks read it from a file)."""

    model: str
    device: str  # "cpu" | "cuda"
    ranks: int
    zero_stage: int
    methods: tuple[str, ...]
    budgets: tuple[float, ...]
    seq_len: int
    micro_batch: int
    group_size: int
    grad_accum: int
    zero_adv_share: float
    clip_share: float
    layout: str = "shuffled"
    predict: bool = False
    drop_zero_advantage: bool = False
    rounds: int | str = DEFAULT_ROUNDS  # a count, or "auto"
    max_minutes: float | None = None
    run_steps: int | None = None  # the whole-run mode
    lengths: tuple[int, ...] = ()
    dtype: str = "fp32"
    layers: int | None = None
    lora_r: int | None = 16  # None: full fine-tuning
    codec_backend: str = "compile"
    grad_error_tolerance: float | None = None
    elide_zero_rows: Any = "auto"
    threads: int | None = None
    seed: int = 0
    batches: int = 2  # distinct steps of data the paired rounds cycle through

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        fields = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in fields}
        for key in ("methods", "budgets", "lengths"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


def parse_budgets(text: str) -> tuple[float, ...]:
    """``--budgets``: multiples of GC's peak, each >= 1.0."""
    try:
        budgets = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--budgets {text}: not a comma-separated list of numbers; allowed: "
                         "multiples of GC's peak >= 1.0, e.g. --budgets 1.05,1.10,1.20") from None
    if not budgets or any(not (b >= 1.0 and math.isfinite(b)) for b in budgets):
        raise BenchError(f"--budgets {text}: budgets are multiples of GC's peak and must be >= 1.0 "
                         "(e.g. --budgets 1.05,1.10,1.20)")
    return tuple(budgets)


def parse_methods(text: str | None) -> tuple[str, ...]:
    """``--methods``: registry names; gc and nogc are always added (the budget's unit and the
    speed limit)."""
    names = list(DEFAULT_METHODS) if not text else [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise BenchError(f"--methods: unknown method {','.join(unknown) or '(none)'}; allowed: "
                         f"{', '.join(METHODS)}")
    for required in ("gc", "nogc"):
        if required not in names:
            names.insert(0, required)
    return tuple(dict.fromkeys(names))


def parse_rounds(text: str | None) -> int | str:
    """``--rounds``: a count >= 1, or "auto" (until the decisive comparisons are decided)."""
    if text is None:
        return DEFAULT_ROUNDS
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        rounds = int(text)
    except ValueError:
        rounds = 0
    if rounds < 1:
        raise BenchError(f"--rounds {text}: allowed: a number of paired rounds >= 1, or auto "
                         "(add rounds until hilore vs gc / static / the best in-budget rival, and any "
                         "rival level with that one, is decided, within --max-minutes)")
    return rounds


def _parse_lengths(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 8:
        raise BenchError(f"--lengths {text}: allowed: comma-separated sequence lengths >= 8, "
                         "e.g. --lengths 128,256,512")
    return lengths


def _shape(args) -> dict[str, Any]:
    """Each data flag: given, else the preset's (``models.SHAPES``), else the default."""
    preset = SHAPES.get(args.model, {})
    return {k: (getattr(args, k) if getattr(args, k, None) is not None else preset.get(k, v))
            for k, v in DEFAULT_SHAPE.items()}


def _check_shape(shape: dict[str, Any], layout: str, ranks: int) -> None:
    for flag, low in (("seq_len", 8), ("micro_batch", 1), ("group_size", 1), ("grad_accum", 1)):
        if shape[flag] < low:
            raise BenchError(f"--{flag.replace('_', '-')} {shape[flag]}: must be >= {low}")
    b, g = shape["micro_batch"], shape["group_size"]
    n = b * shape["grad_accum"] * ranks
    if layout == "grouped" and b % g:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        raise BenchError(f"--group-size {g} does not divide --micro-batch {b} (--layout grouped: "
                         f"a group never spans two microbatches); allowed: --group-size one of "
                         f"{','.join(map(str, divisors))}, or --layout shuffled")
    if n % g:
        raise BenchError(f"--group-size {g} does not divide the {n} sequences of a step "
                         f"(--micro-batch x --grad-accum x --ranks); allowed: a divisor of {n}")
    for flag in ("zero_adv_share", "clip_share"):
        if not 0.0 <= shape[flag] <= 1.0:
            raise BenchError(f"--{flag.replace('_', '-')} {shape[flag]}: allowed: a share "
                             "between 0 and 1")


def _check_filtered(shape: dict[str, Any], ranks: int) -> None:
    """--drop-zero-advantage: every microbatch of every rank keeps a completion."""
    n = shape["micro_batch"] * shape["grad_accum"] * ranks
    groups = n // shape["group_size"]
    kept = (groups - round(shape["zero_adv_share"] * groups)) * shape["group_size"]
    if kept < shape["grad_accum"] * ranks:
        raise BenchError(f"--drop-zero-advantage with --zero-adv-share {shape['zero_adv_share']}: "
                         f"{kept} completions of a step are left for {shape['grad_accum'] * ranks} "
                         "microbatches (--grad-accum x --ranks); allowed: a lower --zero-adv-share "
                         "or a larger --micro-batch")


def _device_and_ranks(args) -> tuple[str, int]:
    import torch

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        raise BenchError("--device cuda: torch sees no CUDA device here; allowed: cpu, or auto")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu"
    ranks = args.ranks if args.ranks is not None else (
        torch.cuda.device_count() if device == "cuda" else 2)
    if ranks < 1:
        raise BenchError(f"--ranks {ranks}: allowed: a number of ranks >= 1")
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise BenchError(f"--ranks {ranks}: one rank per GPU, and {torch.cuda.device_count()} "
                         f"are visible; allowed: --ranks 1 to {torch.cuda.device_count()}")
    return device, ranks


def _check_mode(args) -> None:
    if args.run_steps is None:
        if args.lengths:
            raise BenchError("--lengths is for the whole-run mode; allowed: with --run-steps N")
        return
    if args.run_steps < 1:
        raise BenchError(f"--run-steps {args.run_steps}: allowed: a number of optimizer steps >= 1")
    if args.rounds is not None:
        raise BenchError("--rounds with --run-steps: one mode at a time; allowed: --rounds "
                         "(paired rounds after the warm-up) or --run-steps (the whole run)")


def _check_numbers(args) -> None:
    if args.layers is not None and args.layers < 1:
        raise BenchError(f"--layers {args.layers}: must be >= 1")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise BenchError(f"--max-minutes {args.max_minutes}: allowed: minutes > 0")
    if args.lora_r < 1 and not args.full:
        raise BenchError(f"--lora-r {args.lora_r}: allowed: a rank >= 1 (or --full)")
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads {args.threads}: allowed: >= 1")
    tolerance = args.grad_error_tolerance
    if tolerance is not None and not 0.0 <= tolerance < 1.0:
        raise BenchError(f"--grad-error-tolerance {tolerance:g}: allowed: 0 <= X < 1 (the "
                         "relative error packing may add to a step's gradient)")


def check_args(args) -> Config:
    """The bench's ``Config`` from parsed arguments; ``BenchError`` on a bad value."""
    if args.model is None:
        raise BenchError("--model is required (a preset or a local checkpoint directory), or "
                         "--report IN.json to print a saved report")
    if not is_model(args.model):
        raise BenchError(f"--model {args.model}: unknown preset and not a checkpoint directory "
                         f"(no config.json there); allowed: {', '.join(PRESETS)} or a local "
                         "checkpoint directory")
    if args.model not in PRESETS:  # found here, not in a rank after the codecs were built
        from ds_hilore.cli.common import check_checkpoint

        try:
            check_checkpoint(args.model)
        except OSError as error:
            raise BenchError(f"--model {args.model}: {error}") from None
    _check_mode(args)
    _check_numbers(args)
    device, ranks = _device_and_ranks(args)
    shape = _shape(args)
    _check_shape(shape, args.layout, ranks)
    if args.drop_zero_advantage:
        _check_filtered(shape, ranks)
    threads = args.threads or (max(1, (os.cpu_count() or 1) // ranks) if device == "cpu" else None)
    return Config(
        model=args.model, device=device, ranks=ranks, zero_stage=args.zero_stage,
        methods=parse_methods(args.methods), budgets=parse_budgets(args.budgets), **shape,
        layout=args.layout, predict=args.predict, drop_zero_advantage=args.drop_zero_advantage,
        rounds=parse_rounds(args.rounds), max_minutes=args.max_minutes, run_steps=args.run_steps,
        lengths=_parse_lengths(args.lengths) or (shape["seq_len"],), dtype=args.dtype,
        layers=args.layers, lora_r=None if args.full else args.lora_r,
        codec_backend=args.codec_backend,
        grad_error_tolerance=(default_tolerance() if args.grad_error_tolerance is None
                              else args.grad_error_tolerance),
        elide_zero_rows=ELIDE_ZERO_ROWS[args.elide_zero_rows], threads=threads, seed=args.seed)


def add_run_arguments(parser, json_help: str = "write the report as JSON") -> None:
    """The flags ``hilore bench`` and ``hilore profile`` share, spelled and defaulted once."""
    parser.add_argument("--json", metavar="PATH", default=None, help=json_help)
    parser.add_argument("--threads", metavar="T", type=int, default=None,
                        help="torch CPU threads (per rank in hilore bench; default: the cores "
                             "shared out among the ranks on a CPU, torch's own on a GPU)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def add_arguments(parser) -> None:
    """Every flag of ``hilore bench``, one name each."""
    _model_arguments(parser)
    _data_arguments(parser)
    _method_arguments(parser)
    _mode_arguments(parser)
    add_run_arguments(parser)
    parser.add_argument("--plot", metavar="OUT.png", default=None,
                        help="write the plot: peak memory against speed, and each run's paired "
                             "speed against GC")
    parser.add_argument("--report", metavar="IN.json", nargs="+", default=None,
                        help="print the table and targets of a saved report (with --plot: redraw "
                             "it) instead of running; several reports (runs of one command): "
                             "their paired verdicts side by side")


def _model_arguments(parser) -> None:
    parser.add_argument("--model", metavar="PRESET_OR_DIR", default=None,
                        help=f"a preset name ({', '.join(PRESETS)}: published shapes, random "
                             "weights) or a local checkpoint directory (one with config.json; "
                             "never downloads)")
    parser.add_argument("--layers", metavar="L", type=int, default=None,
                        help="cut the model to L decoder layers")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--lora-r", metavar="R", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="weights' dtype (default fp32)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the ranks run (default auto: cuda if available)")
    parser.add_argument("--ranks", metavar="N", type=int, default=None,
                        help="ranks the bench launches (gloo on a CPU, NCCL on GPUs; default 2 "
                             "on a CPU, one per visible GPU)")
    parser.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=2,
                        help="DeepSpeed ZeRO stage of every engine (default 2)")
    parser.add_argument("--codec-backend", choices=("compile", "eager"), default="compile",
                        help="HiLoRe's codec kernels (default compile)")


def _data_arguments(parser) -> None:
    d = DEFAULT_SHAPE
    parser.add_argument("--seq-len", metavar="N", type=int, default=None,
                        help=f"tokens per sequence: prompt N/4, then a response (default {d['seq_len']})")
    parser.add_argument("--micro-batch", metavar="B", type=int, default=None,
                        help=f"sequences per microbatch (default {d['micro_batch']})")
    parser.add_argument("--group-size", metavar="G", type=int, default=None,
                        help=f"GRPO completions per prompt (default {d['group_size']})")
    parser.add_argument("--grad-accum", metavar="K", type=int, default=None,
                        help=f"microbatches per rank and optimizer step (default {d['grad_accum']})")
    parser.add_argument("--zero-adv-share", metavar="X", type=float, default=None,
                        help=f"share of groups without reward spread, A = 0 (default {d['zero_adv_share']})")
    parser.add_argument("--clip-share", metavar="X", type=float, default=None,
                        help=f"share of response tokens off-policy beyond the clip range "
                             f"(default {d['clip_share']})")
    parser.add_argument("--layout", choices=LAYOUTS, default="shuffled",
                        help="shuffled (default): a step's completions in random order, as TRL "
                             "shuffles its generation batch; grouped: a group never spans two "
                             "microbatches (G divides B)")
    parser.add_argument("--drop-zero-advantage", action="store_true",
                        help="the filtered variant: A = 0 completions dropped before the update")
    parser.add_argument("--predict", action="store_true",
                        help="hand HiLoRe each microbatch's predicted exposure (|A_i| x response "
                             "tokens) before its forward, as the TRL integration does; without "
                             "it the update is a plain DeepSpeed actor update")


def _method_arguments(parser) -> None:
    parser.add_argument("--methods", metavar="M,M,...", default=None,
                        help=f"comma-separated, of {', '.join(METHODS)} (default "
                             f"{','.join(DEFAULT_METHODS)}; nogc and gc always run)")
    parser.add_argument("--budgets", metavar="X,X,...", default=DEFAULT_BUDGETS,
                        help="memory budgets, multiples of GC's peak >= 1.0, one run of each "
                             f"budgeted method per budget (default {DEFAULT_BUDGETS})")
    parser.add_argument("--grad-error-tolerance", metavar="X", type=float, default=None,
                        help="the HiLoRe allocators' error budget (the ds_config's "
                             "grad_error_tolerance, 0 <= X < 1; default: its default, "
                             f"{default_tolerance()})")
    parser.add_argument("--elide-zero-rows", choices=list(ELIDE_ZERO_ROWS), default="auto",
                        help="every HiLoRe run's \"elide_zero_rows\": true (every sequence with "
                             "zero loss coefficients), whole (only microbatches of such "
                             "sequences), false, auto (the default: true on a CPU, whole on "
                             "accelerators)")


def _mode_arguments(parser) -> None:
    parser.add_argument("--rounds", metavar="N|auto", default=None,
                        help="paired rounds after the warm-up (every method one step per round, "
                             "the order rotating), or auto: until hilore vs gc / static / the "
                             "best in-budget rival is decided or --max-minutes is reached "
                             f"(default {DEFAULT_ROUNDS})")
    parser.add_argument("--max-minutes", metavar="M", type=float, default=None,
                        help="no round starts that would end past M minutes from the start "
                             "(default: none; with --rounds auto: 30)")
    parser.add_argument("--run-steps", metavar="N", type=int, default=None,
                        help="the whole-run mode: fresh engines run N optimizer steps each, "
                             "HiLoRe's warm-up included, interleaved step by step")
    parser.add_argument("--lengths", metavar="T,T,...", default=None,
                        help="with --run-steps: the sequence lengths steps are drawn from "
                             "(seeded), e.g. 128,256,512 (default: --seq-len)")
