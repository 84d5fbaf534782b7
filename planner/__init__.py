"""Decides: the cost model (memory and time of one layout), the ILP search over layouts, the plan
and its stage granularity, the one time-to-train, and the fit of the cost model's efficiency
factors to measured steps (calibration and feedback). Reads the profiler's measurements; never
measures or trains itself."""
