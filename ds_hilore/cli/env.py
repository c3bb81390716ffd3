"""``hilore env``: what ds_hilore runs on here -- versions, the accelerator, the CPU, whether the
codec compiles, the switches of the unchanged-script path -- for a bug report or a first check."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform

__all__ = ["HELP", "add_arguments", "run"]

HELP = "print versions, the accelerator and whether the codec compiles here"
DESCRIPTION = ("Print the versions of ds_hilore and of what it runs with, the accelerator "
               "DeepSpeed and torch see, the CPU's vector capability, whether codec_backend "
               "'compile' works on each device here (or why not), and the variables of the "
               "path without a script change (DS_HILORE, DS_HILORE_CONFIG). Paste it into a bug "
               "report.")
PACKAGES = ("ds_hilore", "torch", "deepspeed", "transformers", "peft", "accelerate", "trl",
            "openrlhf", "mpi4py")


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-compile-check", action="store_true",
                        help="skip the codec compilation check (a few seconds)")
    parser.add_argument("--build-codecs", metavar="DTYPES", nargs="?", const="fp32,bf16",
                        default=None, type=_dtypes,
                        help="first build the codecs' CPU kernels ahead for these activation "
                             "dtypes (comma-separated of fp32, bf16, fp16; default fp32,bf16), "
                             "once per machine: runs then load them instead of compiling at "
                             "their start (about 7 s a kernel; under DS_HILORE_CACHE_DIR, "
                             "default ~/.cache/ds_hilore)")


def run(args: argparse.Namespace) -> int:
    if args.build_codecs is not None:
        _build_codecs(args.build_codecs)
    rows = [("python", platform.python_version()), ("platform", platform.platform())]
    rows += [(name, _version(name)) for name in PACKAGES]
    rows += _accelerator()
    rows += _codec(not args.no_compile_check)
    rows.append(("codec kernels built ahead", _built()))
    rows += [(name, os.environ.get(name, "(unset)")) for name in
             ("DS_ACCELERATOR", "DS_HILORE", "DS_HILORE_CONFIG", "TORCH_EXTENSIONS_DIR")]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


def _dtypes(names: str) -> list[str]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in DTYPES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{names!r}: unknown dtype(s) {unknown}; give a "
                                         f"comma-separated list of {', '.join(DTYPES)}")
    return chosen


def _build_codecs(names: list[str]) -> None:
    """NOTE [ Codec kernels built ahead ] in runtime/codec_ahead.py"""
    import torch

    from ds_hilore.runtime.codecs import CODECS, build_ahead

    build_ahead(list(CODECS), [getattr(torch, DTYPES[n]) for n in names],
                say=lambda line: print(line, flush=True))


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _accelerator() -> list[tuple[str, str]]:
    import torch

    rows = [("torch threads", str(torch.get_num_threads())),
            ("cpu capability", torch.backends.cpu.get_cpu_capability()),
            ("cpu cores", str(os.cpu_count()))]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        rows.append(("cuda", f"{torch.version.cuda}: {torch.cuda.device_count()} device(s): {names}"))
    else:
        rows.append(("cuda", "not available" + (f" (torch built for CUDA {torch.version.cuda})"
                                                 if torch.version.cuda else "")))
    try:
        from deepspeed.accelerator import get_accelerator

        rows.append(("deepspeed accelerator", get_accelerator().device_name()))
    except Exception as error:  # noqa: BLE001 -- report what DeepSpeed says, whatever it is
        rows.append(("deepspeed accelerator", f"(unavailable: {str(error).splitlines()[0]})"))
    return rows


def _built() -> str:
    from ds_hilore.runtime.codec_ahead import cache_folder

    folder = cache_folder()
    found = ([p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]  # not
             if folder.is_dir() else [])  # a build under way
    return (f"{len(found)} in {folder}" if found else
            f"none ({folder}; `hilore env --build-codecs` builds them)")


def _codec(check: bool) -> list[tuple[str, str]]:
    """Whether codec_backend 'compile' works per device type here: the probe the runtime uses
    (a compiler for inductor), then, with ``check``, one real compilation of the int8 codec."""
    import torch

    from ds_hilore.runtime.codecs import CODECS, compile_failures, compile_unavailable, get_codec

    rows = []
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        reason = compile_unavailable(device)
        if reason is None and check:
            get_codec("int8", backend="compile").warmup((torch.float32,), device)
            reason = next(iter(compile_failures().values()), None)
        if reason is None and check and any(k.ahead for k in CODECS["int8"].kernels()):
            verdict = "loads its kernels built ahead"  # nothing compiled: they were found
        else:
            verdict = "compiles" if reason is None and check else \
                "compiler found (not tried: --no-compile-check)" if reason is None else \
                f"eager only: {reason}"
        rows.append((f"codec on {device}", verdict))
    return rows
