"""torchrun's agent, bound to the launcher that started it: `python -m trainer.agent PARENT_PID ARGS...`
runs `torch.distributed.run` with ARGS after asking to die with PARENT_PID (trainer/run_lock.py), so
that killing the launcher (the CLI) stops the agent, which stops its workers."""

from __future__ import annotations

import runpy
import sys

from trainer.run_lock import die_with_parent


def main() -> None:
    die_with_parent(int(sys.argv[1]))
    sys.argv = ["torchrun", *sys.argv[2:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
