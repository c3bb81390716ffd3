"""The bench's ranks: started, listened to, ended (``run_ranks``).

The bench starts ``config.ranks`` processes of ``python -m ds_hilore.bench.rank RUN_FOLDER`` on
this machine, each with its rank in the environment as ``deepspeed`` or ``torchrun`` would set
it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT on a free local port), DeepSpeed's
accelerator (``DS_ACCELERATOR``: cpu or cuda) and, on a CPU, ``--threads`` OpenMP threads each.
Rank 0's stderr is the bench's (its progress lines); everything else a rank prints goes to
``rankN.log`` in the run folder, whose last lines are shown should the rank fail. While they
run, the bench reads what rank 0 writes (NOTE [ The run folder ] in link.py) and hands it to a
listener, which says whether a waiting round runs. A rank that fails ends the others.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import ds_hilore
from ds_hilore.bench.link import CONFIG, SAMPLES, answer, read_samples, request_stop, write_json

__all__ = ["Listener", "RankFailure", "local_rank_environment", "run_ranks"]

POLL_S = 0.05
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "CROSS_RANK", "CROSS_SIZE")


class RankFailure(Exception):
    """A rank exited with an error; the message ends with its last output lines."""


class Listener(Protocol):
    def seen(self, samples: dict[str, Any]) -> None:
        """Rank 0 wrote new samples."""

    def word(self, samples: dict[str, Any], round_index: int) -> bool:
        """Whether round ``round_index`` runs (rank 0 waits for the answer)."""

    def interrupted(self) -> None:
        """The bench was interrupted: the ranks are asked to stop."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_rank_environment(rank: int, ranks: int, port: int,
                           base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment DeepSpeed's launcher gives local rank ``rank`` of ``ranks`` on one node
    (its rendezvous on 127.0.0.1:``port``): ``base`` (the process's own by default) with any
    rank variables it had replaced."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _RANK_ENV}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_SIZE=str(ranks),
               CROSS_RANK="0", CROSS_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _environment(config, rank: int, port: int) -> dict[str, str]:
    env = local_rank_environment(rank, config.ranks, port)
    package_root = str(Path(ds_hilore.__file__).resolve().parents[1])
    env.update(DS_ACCELERATOR=config.device,
               PYTHONPATH=os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p))
    if config.device == "cpu" and config.threads:
        env["OMP_NUM_THREADS"] = str(config.threads)
    return env


def _start(config, run_dir: Path, port: int) -> list[subprocess.Popen]:
    procs = []
    for rank in range(config.ranks):
        log = open(run_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ds_hilore.bench.rank", str(run_dir)],
            env=_environment(config, rank, port), stdout=log,
            stderr=None if rank == 0 else subprocess.STDOUT))
        log.close()  # the child holds its own descriptor
    return procs


def _failure(procs: list[subprocess.Popen], run_dir: Path) -> RankFailure | None:
    """A rank that exited with an error, its others ended; None while none did."""
    failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
    if failed is None:
        return None
    _end(procs)
    tail = (run_dir / f"rank{failed}.log").read_text(errors="replace").splitlines()[-25:]
    where = ("its error is above (rank 0 writes to stderr); its last lines on stdout"
             if failed == 0 else "its last output")  # rank 0's stderr is the terminal's
    return RankFailure(f"rank {failed} of {len(procs)} exited with status "
                       f"{procs[failed].returncode}; {where}:\n" + "\n".join(tail))


def _end(procs: list[subprocess.Popen]) -> None:
    """Every rank still running killed (ours, by process id) and reaped."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def _listen(procs, run_dir: Path, listener: Listener) -> dict[str, Any] | None:
    """Until every rank ended: new samples to ``listener``, its word on each waiting round; an
    interrupt asks the ranks to stop (a second one ends them). The last samples."""
    stamp, samples, answered, interrupts = None, None, set(), 0
    while True:
        try:
            failure = _failure(procs, run_dir)
            if failure is not None:
                raise failure
            path = run_dir / SAMPLES
            now = (path.stat().st_ino, path.stat().st_mtime_ns) if path.exists() else None
            if now != stamp and (fresh := read_samples(run_dir)) is not None:
                stamp, samples = now, fresh
                listener.seen(samples)
                waiting = samples.get("waiting")
                if waiting is not None and waiting not in answered:
                    answered.add(waiting)
                    answer(run_dir, waiting, listener.word(samples, waiting))
            if all(p.poll() == 0 for p in procs):
                return read_samples(run_dir) or samples
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupts += 1
            request_stop(run_dir)
            listener.interrupted()
            if interrupts > 1:
                _end(procs)
                raise


def run_ranks(config, listener: Listener) -> dict[str, Any] | None:
    """Start the ranks of ``config`` (the bench's ``Config``), listen until they end; what
    rank 0 last wrote (None if nothing). Raises ``RankFailure`` when a rank fails."""
    run_dir = Path(tempfile.mkdtemp(prefix="hilore_bench_"))
    write_json(run_dir / CONFIG, config.to_dict())
    procs: list[subprocess.Popen] = []
    port = _free_port()
    try:
        procs = _start(config, run_dir, port)
        return _listen(procs, run_dir, listener)
    finally:
        _end(procs)
        shutil.rmtree(run_dir, ignore_errors=True)
        # DeepSpeed's CPU all-reduce leaves its shared-memory buffers (tens of MB per rank,
        # named after the port) in /dev/shm, which is the machine's memory
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            path.unlink(missing_ok=True)
