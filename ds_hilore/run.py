"""Run a training script with HiLoRe in every training ``deepspeed.initialize``, unchanged.

    python -m ds_hilore.run train.py ARGS
    deepspeed --num_gpus N --module ds_hilore.run train.py ARGS
    accelerate launch -m ds_hilore.run train.py ARGS
    python -m ds_hilore.run -m package.module ARGS         # a module instead of a script

The script runs as ``__main__`` (as ``python train.py ARGS`` would run it) with
``deepspeed.initialize`` replaced as ``DS_HILORE=1`` replaces it (NOTE [ Autoload ] in
ds_hilore/integrations/autoload.py): engines with an optimizer get HiLoRe, with the ``"hilore"``
block of their ds_config, else the one in DS_HILORE_CONFIG, else the defaults; the others stay
plain. No variable is needed, so this form also works where the launcher does not carry
variables to other nodes; it sets ``DS_HILORE=1`` for the processes the script starts (Ray
workers of a local ``ray.init``). ``DS_HILORE=0`` keeps everything plain. Neither torch nor
DeepSpeed is imported before the script runs.

``deepspeed --module`` puts ``--local_rank=N`` before the script (``python -u -m ds_hilore.run
--local_rank=N train.py ARGS``); it is handed on right after the script name, where ``deepspeed
train.py ARGS`` would have put it.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import sys
from typing import Sequence

from ds_hilore.integrations import autoload

__all__ = ["Command", "main", "parse"]

USAGE = ("usage: python -m ds_hilore.run [--local_rank=N] (SCRIPT | -m MODULE) [ARGS ...]\n"
         "Runs SCRIPT (or MODULE) as __main__ with HiLoRe in every training deepspeed.initialize.")
_LOCAL_RANK = ("--local_rank", "--local-rank")  # the deepspeed launcher; torch.distributed.launch


@dataclasses.dataclass(frozen=True)
class Command:
    """What to run: ``target`` (a script path, or a module name when ``module``) with ``argv``
    as its ``sys.argv[1:]``."""

    target: str
    module: bool
    argv: list[str]


def parse(args: Sequence[str]) -> Command:
    """Splits ``ds_hilore.run``'s arguments; launcher options before the target move after it.

    Raises:
        SystemExit: no target, or an option this command does not know (with the usage).
    """
    args = list(args)
    launcher: list[str] = []
    while args and args[0].startswith("-"):
        head = args.pop(0)
        if head.split("=", 1)[0] in _LOCAL_RANK:
            launcher.append(head)
            if "=" not in head and args:
                launcher.append(args.pop(0))  # "--local_rank N"
        elif head == "-m" and args:
            return Command(target=args[0], module=True, argv=launcher + args[1:])
        elif head in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        else:
            raise SystemExit(f"ds_hilore.run: unknown option {head!r} before the script. Options of "
                             f"the script go after it.\n{USAGE}")
    if not args:
        raise SystemExit(f"ds_hilore.run: no script given.\n{USAGE}")
    return Command(target=args[0], module=False, argv=launcher + args[1:])


def main(args: Sequence[str] | None = None) -> None:
    command = parse(sys.argv[1:] if args is None else args)
    if autoload.install(explicit=True):
        # The processes the script starts (a local ray.init's workers, a launcher's ranks) start
        # with HiLoRe too: the .pth reads this variable there. DS_HILORE=0 keeps all of them plain.
        os.environ.setdefault(autoload.ENV_SWITCH, "1")
    if command.module:
        sys.argv = [command.target, *command.argv]  # run_module puts the module's path in [0]
        runpy.run_module(command.target, run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(command.target)
    if not os.path.isfile(script):
        raise SystemExit(f"ds_hilore.run: {command.target!r} is not a file. Fix: give the path of the "
                         f"training script, or -m MODULE for a module.\n{USAGE}")
    sys.argv = [command.target, *command.argv]
    sys.path[0] = os.path.dirname(script)  # as `python train.py` sets it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
