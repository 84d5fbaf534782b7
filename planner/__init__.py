"""Decides: the cost model (memory and time of one layout) and, later, the ILP that searches layouts."""
