"""`advisor plan --fix "tp=8,zero=1"`: layout keys a cluster's policy holds fixed, and why a fix
cannot run.

The search keeps only layouts with the fixed values (`SearchSpace.fixed`); the keys it does not
enumerate (the method, the dtype, the sequence length) become the request's own. A fix that no
runnable layout satisfies is refused before any ILP runs, with the line of the rule that binds:
the device arithmetic, the model's structure, or the capability declaration
(`specs.capabilities.runnable_problem`, the trainer's own judge).
"""

from __future__ import annotations

from typing import Any

from specs.capabilities import config_shape, runnable_problem
from specs.errors import UsageError
from specs.layout_rules import (ModelShape, layout_problem, pipeline_problem, tensor_parallel_problem,
                                tp_crosses_nodes)
from specs.core import Layout, ModelSpec, parse_layout_string

# What the search enumerates (SearchSpace.fixed filters them) ...
SHAPE_KEYS = ("dp", "tp", "pp", "vpp", "sp", "zero", "offload", "mbs", "gas")
# ... and what the request itself carries.
REQUEST_KEYS = ("method", "dtype", "seq")
# Chosen per pipeline stage by the ILP, so not fixable as one value.
SOLVER_KEYS = ("recompute", "recompute_layers", "stage_layers", "lora_rank")
# Not planned: the planner prices the loss `advisor train` runs; a user's own script's is priced by
# `advisor estimate --layout ...,loss=hf` and carried by the exported launcher files' comments.
UNPLANNED_KEYS = ("loss",)


def parse_fix(text: str) -> dict[str, Any]:
    """`--fix`'s keys and values, refusing the ones the solver chooses per stage and the loss."""
    fixed = parse_layout_string(text)
    chosen = [key for key in fixed if key in SOLVER_KEYS]
    if chosen:
        raise UsageError(f"--fix {', '.join(chosen)}: chosen per pipeline stage by the solver; fix "
                         f"{', '.join(SHAPE_KEYS + REQUEST_KEYS)}")
    if any(key in fixed for key in UNPLANNED_KEYS):
        raise UsageError("--fix loss: plans train with advisor train's loss; price your own script's loss with "
                         "`advisor estimate --layout ...,loss=hf` (the exported deepspeed.json and accelerate.yaml "
                         "carry that figure)")
    if not fixed:
        raise UsageError("--fix: give layout keys, e.g. --fix \"tp=8,zero=1\"")
    return fixed


def describe(fixed: dict[str, Any]) -> str:
    return ",".join(f"{key}={int(value) if isinstance(value, bool) else value}" for key, value in fixed.items())


def _probe(given: dict[str, Any], fixed: dict[str, Any], devices: int, shape: ModelShape, method: str, dtype: str,
           seq: int) -> Layout:
    """The fixed values with the most runnable choices for the rest (no ZeRO, offload, sp or
    interleaving unless fixed or implied), so that what the declaration refuses is the fix."""
    fields: dict[str, Any] = {"method": method, "dtype": dtype, "seq": seq, **fixed}
    if fields.get("sp") and "tp" not in fields:  # sequence parallelism needs a tensor-parallel group
        fields["tp"] = next((tp for tp in range(2, min(devices, shape.num_heads) + 1) if devices % tp == 0
                             and tensor_parallel_problem(tp, shape) is None), 2)
    vpp = fields.get("vpp", 1)
    if vpp > 1 and "pp" not in fields:  # interleaving needs a pipeline that cuts the layers evenly
        fields["pp"] = next((pp for pp in range(2, min(devices, shape.num_layers) + 1) if devices % pp == 0
                             and pipeline_problem(pp, vpp, pp, None, shape.num_layers) is None), 2)
    if vpp > 1 and "gas" not in fields:  # interleaved 1F1B runs gas in multiples of pp
        fields["gas"] = fields["pp"]
    if fields.get("offload", "none") != "none" and "zero" not in fields:
        fields["zero"] = 3 if fields["offload"] == "optimizer+params" else 2
    fields.setdefault("dp", max(1, devices // (fields.get("tp", 1) * fields.get("pp", 1))))
    try:
        return Layout.model_validate(fields)
    except ValueError as exc:  # pydantic's ValidationError: a bad value, or fixed keys that contradict one another
        raise UsageError(f"--fix {describe(given)}: {_first_error(exc)}") from None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    first = errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def _arithmetic_problem(fixed: dict[str, Any], devices: int, global_batch: int) -> str | None:
    """Degrees that cannot multiply to the devices, or a batch they cannot split."""
    degrees = {key: fixed[key] for key in ("dp", "tp", "pp") if key in fixed}
    product = 1
    for value in degrees.values():
        product *= value
    if devices % product or (len(degrees) == 3 and product != devices):
        named = "*".join(degrees)
        values = "*".join(str(v) for v in degrees.values())
        stated = f"{named}={values}" if len(degrees) == 1 else f"{named} = {values} = {product}"
        return (f"dp*tp*pp must equal the {devices} devices; {stated} "
                + ("does not divide them" if devices % product else "does not equal them"))
    # dp when the fix decides it: given, or what the fixed tp and pp (or the devices they fill) leave
    dp = fixed.get("dp") or (devices // product if {"tp", "pp"} <= set(fixed) or devices == product else None)
    if dp and global_batch % dp:
        return f"dp={dp} does not divide the global batch of {global_batch} sequences"
    if dp == 1 and fixed.get("zero") and fixed.get("offload", "none") == "none":
        return (f"zero={fixed['zero']} with dp=1 shards nothing: ZeRO splits states across data-parallel "
                "replicas (alone it serves only ZeRO-Offload)")
    per_replica = f"the {global_batch // dp} sequences per replica" if dp else f"the global batch of {global_batch}"
    for key in ("mbs", "gas"):
        if key in fixed and (global_batch // (dp or 1)) % fixed[key]:
            return f"{key}={fixed[key]} does not divide {per_replica}"
    return None


def fix_problem(fixed: dict[str, Any], model: ModelSpec, devices: int, devices_per_node: int, global_batch: int,
                method: str, dtype: str, seq: int, device_type: str, engine: str, runnable_only: bool,
                allow_cross_node_tp: bool) -> str | None:
    """Why no layout with `fixed` can run (None: the fix itself is runnable; the search then says
    whether one fits memory)."""
    shape_fixed = {key: value for key, value in fixed.items() if key in SHAPE_KEYS}
    shape = config_shape(model.hf_config)
    structural = (tensor_parallel_problem(fixed.get("tp", 1), shape)
                  or pipeline_problem(fixed.get("pp", 1), 1, 1, None, shape.num_layers))
    problem = structural or _arithmetic_problem(shape_fixed, devices, global_batch)
    if problem:
        return problem
    if "tp" in fixed and tp_crosses_nodes(fixed["tp"], devices_per_node) and not allow_cross_node_tp:
        return f"tp={fixed['tp']} would span nodes of {devices_per_node} devices (add --allow-cross-node-tp)"
    probe = _probe(fixed, shape_fixed, devices, shape, method, dtype, seq)

    def problem_of(layout: Layout) -> str | None:
        return runnable_problem(layout, shape, device_type, engine) if runnable_only else layout_problem(layout, shape)

    problem = problem_of(probe)
    if problem and "zero" not in fixed and probe.dp > 1:  # some engines shard replicas only under ZeRO
        if any(problem_of(probe.model_copy(update={"zero": zero})) is None for zero in (1, 2, 3)):
            return None
    return problem


def check_fix(fixed: dict[str, Any], **request: Any) -> None:
    """`fix_problem` as the CLI's refusal: one line, exit 2."""
    problem = fix_problem(fixed, **request)
    if problem:
        raise UsageError(f"--fix {describe(fixed)}: {problem}")
