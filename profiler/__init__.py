"""Measures, never decides: the model trace under fake tensors (FLOPs, bytes and parameters of one
layer), the hardware micro-benchmarks (GEMM per dtype, memory bandwidth, host<->device copies, CPU
Adam, collectives), the inventory of this machine, fork launching of ranks, and calibration steps
timed through a step runner the caller hands in. `run_profile` puts the figures in a profile
(the file format is specs/profile.py); fitting the cost model to them is the planner's."""
