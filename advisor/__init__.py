"""advisor: the top layer, the `advisor` CLI verbs and the compositions (`advisor run`, `curriculum compare`).

Everything it composes sits below it, in order: `specs` (the shared models and file formats) ->
`presets` -> `profiler` -> `planner` -> `trainer` -> `reports`. No lower package imports this one
(tests/test_layers.py checks the order).
"""

__version__ = "0.1.0"
