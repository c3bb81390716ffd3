"""Codec kernels compiled ahead of time, once per machine, and loaded at each run's start.

Used by ``Codec.warmup`` (codecs.py), which loads what this module built and compiles the rest
at run time as before, and by ``hilore env --build-codecs``, the bench and the demo, which
build ahead.

NOTE [ Codec kernels built ahead ]
``codec_backend: "compile"`` compiles each codec kernel at the run's first forward: on a 2-core
CPU about 4 s with inductor's on-disk cache warm (importing inductor, tracing with dynamo,
loading the cached code), 15 s cold, every run, a stall of the first step that GC never has.
So on a CPU the kernels are also built ahead, as DeepSpeed builds its C++ ops: exported with
dynamic sizes (``torch.export``) and compiled by AOTInductor into a package per kernel and
activation dtype, under ``DS_HILORE_CACHE_DIR`` (default ``~/.cache/ds_hilore``), in a folder
named by what the code depends on -- torch's version, the machine and its CPU capability, and a
hash of the kernels' source, of this module and of the CPU's model and instruction-set flags
(inductor compiles for the CPU it runs on: a folder shared between machines must not hand one a
package built for another). Each package is kept unpacked, a folder the loader reads in place
(``_path``). A run whose packages are there loads them in milliseconds and compiles nothing,
for its activations' dtype and for every other dtype its saved tensors have when they are met
(a bf16 model's norms save fp32); a run without them compiles as before and says once how to
build them (``hilore env --build-codecs``; the bench and ``make demo`` build them before their
ranks start). A package that does not load, or fails when run, is said and its kernel compiled
at run time; where inductor finds no compiler nothing is built (said), and a build that fails is
said and skipped. Each package reads the thread count at its call, as torch's own kernels do
(``cpp.dynamic_threads``), not the building process's.

The packages run the same functions as the run-time compiled kernels, with the same inductor
setting (``emulate_precision_casts``), and the payloads and scales are bitwise the eager ones
(tested); only the error sums may differ in their last bits, as the run-time compiled ones do.
The example inputs are (4096, 1024), the hint the run-time compiled encoders are given (NOTE
[ Size hints of unbacked sizes ] in codecs.py): inductor fuses a row's loops by it. Every size
of at least 2 is dynamic; inputs with a size of 1 run eager, as with the run-time compiler.
Accelerators keep compiling at run time (Triton): nothing is built ahead for them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Callable

import torch

__all__ = ["build", "build_all", "cache_folder", "load", "load_into", "load_key", "signature"]

logger = logging.getLogger(__name__)

_ROWS, _FEATURES = 4096, 1024  # the example inputs' sizes (NOTE [ Codec kernels built ahead ])
# as the run-time compiled kernels (codecs.py), and the thread count read at each call, not the
# building process's baked in (a rank may run with fewer threads than the process that built)
_INDUCTOR = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}


def _encoder(dtype: torch.dtype, payload: torch.dtype, rows: int, features: int) -> tuple:
    x = torch.linspace(-3.0, 3.0, rows * features).reshape(rows, features).to(dtype)
    return (x,), ({0: "rows", 1: "features"},)


def _rescaler(dtype: torch.dtype, payload: torch.dtype, rows: int, features: int) -> tuple:
    return ((torch.ones(rows, features, dtype=dtype), torch.ones(rows, 1)),
            ({0: "rows", 1: "features"}, {0: "rows"}))


def _decoder(dtype: torch.dtype, payload: torch.dtype, rows: int, features: int) -> tuple:
    q = torch.zeros(rows, features).to(payload)
    out = torch.empty(rows, features, dtype=dtype)
    return ((q, torch.ones(rows, 1), out),
            ({0: "rows", 1: "features"}, {0: "rows"}, {0: "rows", 1: "features"}))


# kernel name -> (its example arguments and their dynamic sizes, the payload dtype, whether it
# returns its results rather than writing an argument): the kernels a CPU runs (codecs.py: the
# encoders, int8's rescale, fp8's decoder). The ragged ones take a block size and are compiled
# at run time.
_SIGNATURES: dict[str, tuple[Callable, torch.dtype, bool]] = {
    "_int8_encode": (_encoder, torch.int8, True),
    "_int8_encode_fast": (_encoder, torch.int8, True),
    "_int8_rescale": (_rescaler, torch.int8, False),
    "_fp8_encode": (_encoder, torch.float8_e4m3fn, True),
    "_fp8_decode_into": (_decoder, torch.float8_e4m3fn, False),
}


def signature(name: str) -> bool:
    """Whether the kernel ``name`` can be built ahead."""
    return name in _SIGNATURES


def _key(name: str, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes of the kernel's arguments for activations of ``dtype``."""
    make, payload, _ = _SIGNATURES[name]
    return tuple(a.dtype for a in make(dtype, payload, 2, 2)[0])


@functools.lru_cache(maxsize=None)
def cache_folder() -> Path:
    """Where this code's packages live on this machine (NOTE [ Codec kernels built ahead ])."""
    digest = hashlib.sha256()
    for path in (Path(__file__).with_name("codecs.py"), Path(__file__)):  # the kernels, this
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_model().encode())
    capability = torch.backends.cpu.get_cpu_capability()
    tag = f"torch-{torch.__version__}-{platform.machine()}-{capability}-{digest.hexdigest()[:16]}"
    root = os.environ.get("DS_HILORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "ds_hilore")
    return Path(root) / "codec_kernels" / tag.replace("+", "_")


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags where the system lists them: inductor
    compiles for the machine it runs on (``-march=native``), so a package built on one CPU may
    not run on another of the same vector capability (a home folder shared between machines)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line.strip() for line in text.splitlines()
                              if line.split(":")[0].strip() in wanted}))


def _path(name: str, dtype: torch.dtype) -> Path:
    """The kernel's package, unpacked: a folder the loader reads in place. A ``.pt2`` file is
    unpacked again at every load into a temporary folder of its own (~1.6 MB), removed only
    when the loader is destroyed: a rank ended by a signal or ``os._exit`` left them behind."""
    return cache_folder() / f"{name}-{str(dtype).removeprefix('torch.')}"


class _Module(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def build(name: str, fn: Callable, dtype: torch.dtype) -> Path:
    """Export and compile the kernel ``fn`` (named ``name``) for activations of ``dtype`` into
    its package, unless it is there; returns its path. Built and unpacked aside and moved into
    place, so that ranks building at once never load half a package."""
    path = _path(name, dtype)
    if _loader(path) is not None:
        return path
    make, payload, _ = _SIGNATURES[name]
    args, dims = make(dtype, payload, _ROWS, _FEATURES)
    sizes = {}
    dynamic = tuple({d: sizes.setdefault(label, torch.export.Dim(label, min=2))
                     for d, label in spec.items()} for spec in dims)
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = tempfile.mkdtemp(prefix=".building-", dir=path.parent)  # not a package until moved
    archive, unpacked = os.path.join(aside, path.name + ".pt2"), os.path.join(aside, path.name)
    try:
        with warnings.catch_warnings():  # torch's own deprecation notices, not the user's
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(_Module(fn), args, dynamic_shapes=(dynamic,),
                                          strict=False)
            torch._inductor.aoti_compile_and_package(program, package_path=archive,
                                                     inductor_configs=_INDUCTOR)
        with zipfile.ZipFile(archive) as package:
            package.extractall(unpacked)
        for folder, _, files in os.walk(unpacked):  # readable by every user of a shared cache
            os.chmod(folder, 0o755)
            for file in files:
                os.chmod(os.path.join(folder, file), 0o755 if file.endswith(".so") else 0o644)
        if _loader(path) is None:  # none there, or one that does not load: replaced
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(unpacked, path)
        except OSError:  # another rank's landed first: used where it loads
            if _loader(path) is None:
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    return path


def load(name: str, dtype: torch.dtype) -> Callable | None:
    """The built kernel ``name`` for ``dtype``: called with the list of its tensor arguments, it
    returns the kernel's results (a mutated argument written back in place); None when it was
    not built here (or does not load: said once)."""
    if not signature(name):
        return None
    path = _path(name, dtype)
    if not os.path.isdir(path):  # False where the folder cannot be read, too: run-time compiled
        return None
    run = _loader(path)
    if run is None:
        logger.warning("ds_hilore: the codec kernel %s built ahead at %s does not load; it is "
                       "compiled at run time instead (`hilore env --build-codecs` builds it "
                       "again).", name, path)
        return None
    if _SIGNATURES[name][2]:
        return lambda args: tuple(run(args))
    return lambda args: run(args) and None


def _loader(path: Path) -> Callable | None:
    if not os.path.isdir(path):  # a file would be unpacked into a temporary folder (``_path``)
        return None
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1).run
    except Exception:  # noqa: BLE001 -- any loader failure: not a usable package
        return None


def load_key(kernel, key: tuple[torch.dtype, ...], dtypes) -> None:
    """Load into ``kernel`` what was built ahead for the activation dtype among ``dtypes`` whose
    arguments have the dtypes ``key``: a dtype the run's warm-up did not load (nothing said
    where none was built: the warm-up said how to build them)."""
    for dtype in dtypes:
        if _key(kernel.name, dtype) == key:
            run = load(kernel.name, dtype)
            if run is not None:
                kernel.ahead[key] = run
            return


_hinted = False


def load_into(kernels, dtypes) -> None:
    """Load into each of ``kernels`` (codecs.py's ``_Kernel``) what was built ahead for
    ``dtypes``; where something buildable was not built, say once how to build it."""
    global _hinted
    missing = []
    for kernel in kernels:
        for dtype in dtypes:
            if not signature(kernel.name) or _key(kernel.name, dtype) in kernel.ahead:
                continue
            run = load(kernel.name, dtype)
            if run is None:
                missing.append(f"{kernel.name} ({str(dtype).removeprefix('torch.')})")
            else:
                kernel.ahead[_key(kernel.name, dtype)] = run
    if missing and not _hinted:
        _hinted = True
        logger.info("ds_hilore: codec kernels %s are compiled at this run's start (a few "
                    "seconds): none was built ahead in %s. `hilore env --build-codecs` builds "
                    "them once for this machine; later runs load them in milliseconds.",
                    ", ".join(missing), cache_folder())


def build_all(kernels, dtypes, say=print, unavailable: str | None = None) -> list[Path]:
    """Build each of ``kernels`` (codecs.py's ``_Kernel``) that a CPU runs, for activation
    ``dtypes`` (what is there and loads is kept); ``say`` gets a line per kernel built, or why
    nothing could be (``unavailable``: why inductor cannot compile here; a build that failed:
    the runs then compile at their start, or run eager, as without this). Returns the packages
    there. ``codecs.build_ahead`` calls it by codec name."""
    import time

    if unavailable is not None:
        say(f"codec kernels not built ahead: {unavailable}")
        return []
    paths = []
    for kernel in kernels:
        if not signature(kernel.name):
            continue
        for dtype in dtypes:
            begin, there = time.perf_counter(), os.path.isdir(_path(kernel.name, dtype))
            label = f"{kernel.name} for {str(dtype).removeprefix('torch.')}"
            try:
                paths.append(build(kernel.name, kernel.fn, dtype))
            except Exception as exc:  # noqa: BLE001 -- any build failure: compiled at run time
                say(f"codec kernel {label} not built ahead ({type(exc).__name__}: "
                    f"{(str(exc).splitlines() or ['?'])[0]}); runs compile it at their start")
                continue
            if not there:
                say(f"built codec kernel {label} in {time.perf_counter() - begin:.1f} s: "
                    f"{paths[-1]}")
    return paths
