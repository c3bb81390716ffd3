"""One rank of ``hilore bench``: ``python -m ds_hilore.bench.rank RUN_FOLDER``, started by the
bench (``ds_hilore.bench.launch``) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
and DS_ACCELERATOR set. It reads the configuration from the run folder, joins the process group
(gloo on a CPU, NCCL on GPUs, one GPU per rank), builds the seeded model (the same on every
rank), and runs the paired mode (``rounds.paired``) or the whole run (``wholerun.whole_run``);
rank 0 writes every rank's samples to the run folder (NOTE [ The run folder ] in link.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import torch

from ds_hilore.bench.link import CONFIG, Link
from ds_hilore.bench.models import build_model
from ds_hilore.bench.options import Config

__all__ = ["main"]


def _join(config: Config) -> None:
    """This process in the bench's process group, on its device; fails loudly where the
    device is not what the bench was told."""
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("hilore bench rank: the bench asked for CUDA and this process sees "
                               "no CUDA device (CUDA_VISIBLE_DEVICES, driver?)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != config.device:
        raise RuntimeError(f"hilore bench rank: DeepSpeed's accelerator is {accelerator!r}, the "
                           f"bench runs on {config.device!r}; set DS_ACCELERATOR={config.device}")
    deepspeed.init_distributed(dist_backend="nccl" if config.device == "cuda" else "gloo",
                               auto_mpi_discovery=False, verbose=False)


def main(argv: list[str] | None = None) -> int:
    """The rank's whole life; returns its exit status."""
    run_dir = Path((argv if argv is not None else sys.argv[1:])[0])
    config = Config.from_dict(json.loads((run_dir / CONFIG).read_text(encoding="utf-8")))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE [ The run folder ]: the bench stops us
    # DeepSpeed's own calls of deprecated torch.distributed names: nothing a user can act on
    warnings.filterwarnings("ignore", message="`torch.distributed", category=FutureWarning)
    _join(config)
    import torch.distributed as dist

    from ds_hilore.bench.rounds import paired
    from ds_hilore.bench.wholerun import whole_run

    link = Link(run_dir, config.device)
    link.say(f"building {config.model} ({config.dtype}, {config.device}, "
             + ("full fine-tuning" if config.lora_r is None else f"LoRA r={config.lora_r}") + ")")
    base = build_model(config.model, config.dtype, config.device, config.seed, config.layers,
                       config.lora_r)
    (whole_run if config.run_steps else paired)(config, base, link)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
