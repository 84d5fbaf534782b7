"""One build of a compiled torch extension at a time, and none left waiting on a killed one.

torch's JIT builds (`torch.utils.cpp_extension.load`, `load_inline`, and DeepSpeed's op builder on
top of them) guard a build folder with a `FileBaton`: an empty `lock` file created exclusively and
removed when the build ends. A build killed midway (Ctrl-C, kill -9, an OOM kill) leaves that file,
and every later load of the extension, even one already built, then sleeps on it forever, silently.
A kernel lock is released when its holder dies, so we hold one (`flock`) around every build and load
of ours: whoever holds it while a `lock` file is there knows that file's builder is gone, and
removes it (an empty file: nothing of the build is lost; its half-written objects are rebuilt).
torch offers no public way to clear or time out its baton, hence this wrapper.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


def build_directory(name: str) -> Path:
    """The folder torch builds extension `name` in (TORCH_EXTENSIONS_DIR, else its default root)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / name
    try:  # the default root's per-accelerator subfolder: only torch knows it
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, False))
    except (ImportError, AttributeError, TypeError):
        from torch.utils.cpp_extension import get_default_build_root

        return Path(get_default_build_root()) / name


@contextlib.contextmanager
def exclusive_build(name: str) -> Iterator[Path]:
    """Hold this machine's (or shared cache's) build of extension `name`, its dead builder's baton
    cleared; yields the build folder."""
    folder = build_directory(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{name}.advisor-lock", "a+") as held:  # closing it releases the lock
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live build of ours; released if its holder dies
        (folder / "lock").unlink(missing_ok=True)  # every builder of ours holds the flock: a baton's is dead
        yield folder
