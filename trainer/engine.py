"""Compatibility names for `trainer.loop` until its imports move to `trainer.engines` and
`trainer.model` (issue 12: the lead removes this module at merge)."""

from trainer.engines import device, make_engine, select_backend  # noqa: F401
from trainer.model import build_model  # noqa: F401
