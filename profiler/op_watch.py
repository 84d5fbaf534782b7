"""A dispatch mode that watches the ops a model runs: each op runs as it would, then `see` is shown it.

The trace's logs (profiler/model_trace.py: what selective recomputation keeps, autocast's weight
copies, the kernels the host launches) only look at the ops; this base runs them. torch is imported
when the base is first asked for, so that importing the profiler stays light.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def op_watch() -> type:
    """The base class: a subclass defines `see(func, args, kwargs, out)`, called after every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpWatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.see(func, args, kwargs, out)
            return out

        def see(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
            raise NotImplementedError

    return OpWatch
