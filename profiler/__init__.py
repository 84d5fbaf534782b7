"""Measures: the model trace under fake tensors and (later) hardware micro-benchmarks."""
