"""Run a worker script on several CPU ranks and collect what each rank reports.

``run_distributed(script, args)`` starts ``script`` on N ranks with ``DS_ACCELERATOR=cpu``,
passes it ``--result_dir DIR --master_port P`` after ``args``, and returns the JSON each rank
wrote with :func:`write_result`, sorted by rank. A non-zero exit or a timeout fails with every
rank's output.

# NOTE [ Three ways to start ranks ]
# ``launcher="direct"`` (the default) starts the N rank processes itself, each with what
# DeepSpeed's launcher gives a local rank: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK,
# CROSS_SIZE, MASTER_ADDR / MASTER_PORT in its environment and ``--local_rank=R`` before its
# arguments (tests/test_launch.py compares the two). ``"deepspeed"`` goes through ``deepspeed
# --num_gpus N``, whose runner and launcher are two more Python processes that import
# DeepSpeed before any rank starts: a launch that does nothing took 14.6 s through them
# against 4.5 s started directly (2-core CPU), and the suite makes dozens of launches. The
# ranks run the same code either way; tests whose point is the user's command (the examples,
# TRL's variable, the mpirun comparison) name the runner. ``"mpirun"`` is ``mpirun -np N``
# (mpich), where DeepSpeed discovers the ranks through MPI.

Workers are run from the repository root with it on ``PYTHONPATH``, so they can
``from tests.launch import write_result`` (or :func:`run_cases`, which runs a worker's cases and
writes their result).

# NOTE [ Clean rank environment ]
# In-process single-rank tests set RANK/WORLD_SIZE/MASTER_* in os.environ. If those leaked
# into a launch, DeepSpeed would skip MPI discovery under mpirun and every rank would believe
# it is rank 0 of 1. The child environment is scrubbed of them; the launcher sets its own.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_BIN = Path(sys.executable).parent
LAUNCHERS = ("direct", "deepspeed", "mpirun")
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
             "OMPI_COMM_WORLD_SIZE")


def free_port() -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_result(result_dir: str | os.PathLike, rank: int, payload: dict) -> None:
    """Worker side, its last call: write this rank's result as ``rank{rank}.json`` (atomically),
    then end torch.distributed and the process (NOTE [ Ending the process group ])."""
    path = Path(result_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    os.replace(tmp, path)
    end_distributed()


def case_arguments(cases) -> "argparse.Namespace":
    """Worker side: a command line of ``--case`` (one of ``cases``, repeated) and what the launch
    passes (``--result_dir``, ``--master_port``; the deepspeed runner's ``--local_rank``)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", required=True, choices=list(cases))
    parser.add_argument("--result_dir", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def run_cases(worker: str, cases: list[str], run: Callable[[str], dict], result_dir: str) -> None:
    """Worker side, its main: ``run(case)`` for each case in turn, then :func:`write_result` of
    ``{"rank", "cases": case -> record, "seconds"}``. A case that raises is recorded as
    ``{"error": traceback}`` and the next case runs; ``worker`` names the log lines."""
    import torch.distributed as dist

    started, results = time.perf_counter(), {}
    for case in cases:
        print(f"[{worker}] case {case}", flush=True)  # locates a failure
        try:
            results[case] = run(case)
        except Exception:  # reported per case; a rank left waiting in a collective times out
            traceback.print_exc()
            results[case] = {"error": traceback.format_exc()}
    write_result(result_dir, dist.get_rank(), {
        "rank": dist.get_rank(), "cases": results, "seconds": time.perf_counter() - started})


# NOTE [ Ending the process group ]
# A process that exits with its gloo process group alive can abort in C++ while the interpreter
# shuts down ("terminate called without an active exception": gloo's worker threads can still
# hold work whose tensors the finalizing interpreter frees); a rank did so now and then, and its
# launch failed. Every rank therefore meets the others at a barrier and destroys its process groups
# before it exits. That made it rarer, not impossible (a clean-clone run aborted twice in a row,
# after the destroy): with its result written, a worker has nothing left for the interpreter's
# shutdown to do, so it flushes its output and leaves at once (os._exit), running no C++ static
# destructor and joining no thread.
def end_distributed() -> None:
    """Barrier, then ``destroy_process_group()``, when torch.distributed is up; then end the
    process with exit code 0 without the interpreter's shutdown. A worker's last call."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    mpi = sys.modules.get("mpi4py.MPI")  # mpirun: MPI_Finalize, which the skipped atexit would run
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # C and C++ output not yet written to a redirected log
    os._exit(0)


def _command(script: Path, args: list[str], nprocs: int, launcher: str, port: int,
             log_dir: Path) -> list[str]:
    if launcher == "direct":
        return [sys.executable, __file__, str(nprocs), str(port), str(log_dir), str(script), *args]
    if launcher == "deepspeed":
        return [str(_BIN / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(port),
                f"--enable_each_rank_log={log_dir}", str(script), *args]
    if launcher == "mpirun":
        # mpich's hydra: -l prefixes each output line with its rank.
        return [str(_BIN / "mpirun"), "-np", str(nprocs), "-l", sys.executable, str(script), *args]
    raise ValueError(f"launcher={launcher!r} is unknown; use one of {LAUNCHERS}")


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}  # NOTE [ Clean rank environment ]
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Appended, not prepended: the venv's pip `ninja` differs from the system one, and two
    # ninja versions alternating on DeepSpeed's JIT op cache rebuild it (~1 min) each time.
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), str(_BIN)])
    env.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on a 2-core machine: one thread each
    return env


def _all_output(launcher_output: str, log_dir: Path) -> str:
    parts = [f"==== launcher output ====\n{launcher_output}"]
    for log in sorted(log_dir.glob("*.log")):
        parts.append(f"==== {log.name} ====\n{log.read_text(errors='replace')}")
    return "\n".join(parts)


# A rank of a 2-rank CPU launch has been seen, rarely, to abort in C++ ("terminate called without
# an active exception"; NOTE [ Ending the process group ]). Such a launch is run once more, with a
# warning; a second abort fails the test. So is a launch whose store could not listen on its port:
# free_port() finds a port free, but another launch (the other test worker's) may take it before
# the store binds it; the second try gets a new port.
NATIVE_ABORT = "terminate called without an active exception"
PORT_TAKEN = ("Address already in use", "EADDRINUSE")  # the runner's words, the rank's store's
RETRIED = (NATIVE_ABORT, *PORT_TAKEN)


def run_distributed(script: str | os.PathLike, args: list[str] | tuple[str, ...] = (), nprocs: int = 2,
                    launcher: str = "direct", timeout: float = 300.0, retry: bool = True) -> list[dict]:
    """Run ``script`` on ``nprocs`` CPU ranks and return each rank's result dict, by rank.

    Args:
        script: worker script (absolute, or relative to the repository root).
        args: arguments for the script; ``--result_dir DIR --master_port P`` are appended.
        nprocs: number of ranks.
        launcher: ``"direct"`` (the rank processes started here), ``"deepspeed"`` (``deepspeed
            --num_gpus N``) or ``"mpirun"`` (``mpirun -np N``): NOTE [ Three ways to start ranks ].
        timeout: seconds before every process of the launch is killed and the test fails.
        retry: run the launch once more after a native abort or a port taken (``RETRIED``,
            see above).

    Returns:
        One dict per rank, sorted by rank, as written by :func:`write_result`.

    Raises:
        pytest.fail.Exception: non-zero exit, timeout, or a rank that wrote no result; the
            message holds the launcher's and every rank's output.
    """
    script = Path(script)
    if not script.is_absolute():
        script = REPO_ROOT / script
    work = Path(tempfile.mkdtemp(prefix="hilore_launch_"))
    result_dir, log_dir = work / "results", work / "logs"
    result_dir.mkdir()
    log_dir.mkdir()
    port = free_port()
    cmd = _command(script, [*map(str, args), "--result_dir", str(result_dir), "--master_port", str(port)],
                   nprocs, launcher, port, log_dir)
    # A new session, so that a timeout can end the launcher and every rank it started together.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{launcher} launch of {script.name} timed out after {timeout:.0f} s "
                    f"(a hang: ranks issuing different collectives?)\n{_all_output(output, log_dir)}")
    try:
        if proc.returncode != 0:
            everything = _all_output(output, log_dir)
            cause = next((c for c in RETRIED if c in everything), None) if retry else None
            if cause is not None:
                warnings.warn(f"{launcher} launch of {script.name}: {cause!r} in its output; "
                              f"launching once more")
                return run_distributed(script, args, nprocs, launcher, timeout, retry=False)
            pytest.fail(f"{launcher} launch of {script.name} exited with {proc.returncode}\n"
                        f"{' '.join(cmd)}\n{everything}")
        results = []
        for rank in range(nprocs):
            path = result_dir / f"rank{rank}.json"
            if not path.exists():
                pytest.fail(f"rank {rank} of {script.name} wrote no result\n{_all_output(output, log_dir)}")
            results.append(json.loads(path.read_text()))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)
        # DeepSpeed's CPU all-reduce leaves its shared-memory buffers in /dev/shm; a whole test
        # session of launches would otherwise hold gigabytes of the machine's memory
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            path.unlink(missing_ok=True)


def _start_ranks(nprocs: str, port: str, log_dir: str, script: str, *args: str) -> int:
    """The ``"direct"`` launcher, run as ``python tests/launch.py NPROCS PORT LOG_DIR SCRIPT
    ARGS...`` (NOTE [ Three ways to start ranks ]): starts the ranks, each writing its output to
    LOG_DIR/rankR.log, and waits for them; where one exits with an error the others are ended
    (a rank left waiting in a collective would wait for the launch's timeout). Returns the
    first error's exit code, 0 when every rank succeeded."""
    from ds_hilore.bench.launch import local_rank_environment  # the bench starts its ranks so

    procs = []
    for rank in range(int(nprocs)):
        env = local_rank_environment(rank, int(nprocs), int(port))
        with open(Path(log_dir) / f"rank{rank}.log", "w", encoding="utf-8") as log:
            procs.append(subprocess.Popen([sys.executable, "-u", script, f"--local_rank={rank}", *args],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by a signal: 128 + N
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(_start_ranks(*sys.argv[1:]))
