"""Launcher files for a plan: a DeepSpeed config and an accelerate config where those tools run the
chosen layout as the trainer does, the torchrun command and a Slurm batch script. The bucket sizes
are the ones the cost model assumed (`planner.zero_buffers.zero_settings`).

deepspeed.json and accelerate.yaml are for the user's own training script (an HF Trainer, an
accelerate loop), which computes transformers' loss over the whole logits rather than the trainer's
chunked loss: the peak memory their comments carry is priced with `loss=hf` (`user_script_memory`)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from specs.capabilities import engine_for
from specs.engine_traits import traits
from specs.plan_file import Plan
from specs.run_dir import PLAN_FILE
from specs.core import GiB, Layout, MemoryEstimate, ModelSpec, safe_name
from planner.cost_model import engine_of, estimate_from_trace
from planner.zero_buffers import zero_settings
from planner.memory import logits_fp32_bytes
from profiler.model_trace import trace_model

MASTER_PORT = 29511  # not DeepSpeed's and accelerate's default 29500, which collide on shared hosts
MAX_RESTARTS = 3  # torchrun's worker restarts before the job fails; each resumes from the last checkpoint
RUN_DIR = "run"  # beside plan.yaml, unless $RUN_DIR says otherwise


def deepspeed_config(plan: Plan, layout: Layout) -> dict:
    return model_deepspeed_config(plan.model, plan.hardware.device_type, layout)


def model_deepspeed_config(model: ModelSpec, device_type: str, layout: Layout) -> dict:
    """The DeepSpeed config of `layout` for `model` on `device_type`, without a plan around it: the
    trainer's timed steps (calibration, verification, the benches) configure DeepSpeed as
    `advisor train` does."""
    trace = trace_model(model, layout.seq, layout.dtype, layout.method, layout.lora_rank, device_type=device_type)
    settings = zero_settings(trace, layout, device_type)  # the cost model prices DeepSpeed's buffers from these
    bucket = settings.bucket_elems
    zero: dict = {"stage": settings.stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                  "contiguous_gradients": settings.contiguous_gradients, "overlap_comm": settings.overlap_comm}
    if settings.stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=0)
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if settings.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    # DeepSpeed checks train_batch_size == micro * accumulation * its world size, which is its
    # data-parallel size: the plan's whole world for the layouts DeepSpeed runs (tp = pp = 1)
    return {
        "train_batch_size": layout.mbs * layout.gas * layout.dp,
        "train_micro_batch_size_per_gpu": layout.mbs,
        "gradient_accumulation_steps": layout.gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": layout.dtype == "bf16"},
        "fp16": {"enabled": layout.dtype == "fp16"},
        "zero_optimization": zero,
        "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def accelerate_config(plan: Plan, layout: Layout) -> dict | None:
    """accelerate's config for the engine that runs `layout` (specs.capabilities.engine_for), or
    None where accelerate would run something else: its tensor and pipeline parallelism is not the
    DTensor plan and torch.distributed.pipelining schedule the trainer runs and the cost model prices,
    so a file for those layouts would launch an unpriced layout."""
    engine = traits(engine_for(layout, plan.engine))
    if engine.accelerate_type is None or layout.tp > 1:
        return None
    cpu = plan.hardware.device_type == "cpu"
    several = "MULTI_CPU" if cpu else "MULTI_GPU"
    kind = engine.accelerate_type or (several if layout.devices > 1 else "NO")
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "num_machines": plan.nodes,
        "num_processes": layout.devices,
        "machine_rank": 0,
        "main_process_port": MASTER_PORT,
        "mixed_precision": "no" if layout.dtype == "fp32" else layout.dtype,
        "use_cpu": cpu,
    }
    if engine.deepspeed:
        config["deepspeed_config"] = {"deepspeed_config_file": "deepspeed.json"}
    if engine.shards_replicas:  # as trainer/engines/sharded.py runs it: ZeRO-3 reshards after forward, 1/2 keep.
        # accelerate checkpoints every layer or none: a plan that recomputes some layers gets every one
        # (never more memory than planned; the step is slower than priced)
        config["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": layout.zero == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": False, "fsdp_activation_checkpointing": layout.recompute != "none",
            "fsdp_cpu_ram_efficient_loading": True}
    return config


def user_script_memory(plan: Plan, layout: Layout) -> tuple[MemoryEstimate, float]:
    """The per-device memory of `layout` as a user's own script runs it with the exported files:
    transformers' `ForCausalLMLoss` over the whole logits (`loss=hf`), everything else priced as the
    plan prices it (the plan's engine, rows as the planner prices them); and the bytes of one fp32
    logits buffer on a device, which a script that holds the model's whole output through backward
    keeps as well (measured: exactly one more buffer; HF Trainer keeps only the loss)."""
    hf = layout.model_copy(update={"loss": "hf"})
    trace = trace_model(plan.model, hf.seq, hf.dtype, hf.method, hf.lora_rank,  # type: ignore[arg-type]
                        device_type=plan.hardware.device_type, packed=True)
    memory = estimate_from_trace(trace, hf, plan.hardware, plan.engine).memory
    return memory, logits_fp32_bytes(trace, hf, engine_of(hf, plan.engine))


def memory_comment(plan: Plan, layout: Layout) -> list[str]:
    """What deepspeed.json and accelerate.yaml say about memory: the peak of the user's own script
    (`user_script_memory`), beside the plan's (the trainer's chunked loss)."""
    memory, logits = user_script_memory(plan, layout)
    verdict = "fits" if memory.fits else "does NOT fit: lower mbs, or train with advisor train"
    return [
        f"Peak memory per device with your own HF Trainer or accelerate script: {memory.peak / GiB:.2f} GiB of "
        f"{memory.capacity / GiB:.2f} GiB ({verdict}).",
        "Priced with loss=hf: transformers' loss over the whole logits, which such a script computes "
        f"(the plan's figure, with advisor train's loss: {plan.chosen.estimate.memory.peak / GiB:.2f} GiB).",
        "That is for a script that keeps only the output's .loss (as HF Trainer does); one that holds the whole "
        f"output through backward keeps the logits too: up to {logits / GiB:.2f} GiB more.",
    ]


class Expanded(str):
    """A word of ours that the shell expands (`${VAR:-default}`, `$@`): written in double quotes,
    so that it stays one word whatever the variable holds."""


def train_command(plan: Plan, plan_path: str = PLAN_FILE, slurm: bool = False) -> list[str]:
    """`advisor train` on one node, the launcher the CLI runs: it starts the ranks of each segment of
    stages that share a layout (torchrun for several), one after the other, so the whole plan runs.
    `--resume` continues the run in RUN_DIR when one is there (a rerun, a Slurm requeue) and starts it
    otherwise. Under Slurm, `advisor train` reads the nodes and this node's rank from Slurm's
    environment; elsewhere NODE_RANK says which node this is. The script's own arguments follow."""
    words = ["advisor", "train", plan_path, "--out", Expanded(f"${{RUN_DIR:-{RUN_DIR}}}"), "--resume"]
    if not slurm:
        words += [f"--nnodes={plan.nodes}", Expanded("--node-rank=${NODE_RANK:-0}")]
    return [*words, Expanded("--master-addr=${MASTER_ADDR:-127.0.0.1}"),
            Expanded(f"--master-port=${{MASTER_PORT:-{MASTER_PORT}}}"), Expanded("$@")]


def _with_restarts(command: str) -> str:
    """The command, started again up to MAX_RESTARTS times after a failure; each start resumes from
    the last checkpoint. The last exit status is the script's."""
    return f"""for attempt in $(seq 0 "${{MAX_RESTARTS:-{MAX_RESTARTS}}}"); do
  status=0
  {command} || status=$?
  if [ "$status" -eq 0 ]; then exit 0; fi
  echo "advisor train exited $status (attempt $attempt)" >&2
done
exit "$status"
"""


def shell_command(words: list[str]) -> str:
    """One shell line with every word quoted, so a path or name holding spaces, `;`, `$()` or quotes
    stays one argument; our `Expanded` words go in double quotes (their other characters are ours)."""
    return " ".join(f'"{w}"' if isinstance(w, Expanded) else shlex.quote(w) for w in words)


def job_name(model_name: str) -> str:
    """`#SBATCH` lines are not shell, so quoting cannot protect them (a newline in a folder name
    would start a command): the model's name goes in cleaned."""
    return f"advisor-{safe_name(model_name, 60)}"


def _environment_notes() -> str:
    return f"""# MASTER_ADDR  host name or address of node 0, reachable from every node (default 127.0.0.1: one
#              node); MASTER_PORT: a free TCP port there (default {MASTER_PORT}).
# RUN_DIR      the run directory: metrics, events, checkpoints (default: {RUN_DIR}/ beside plan.yaml; on
#              several nodes, a folder every node shares). A run already there is continued.
# MAX_RESTARTS how often the run is started again after a failure (default {MAX_RESTARTS}); each start
#              resumes from the last checkpoint.
# Arguments after the script's name go to `advisor train` (e.g. --weights DIR)."""


def torchrun_script(plan: Plan) -> str:
    return f"""#!/bin/bash
# Written by `advisor plan --export`: {plan.chosen.layout.short()}
# Run it on each of the {plan.nodes} node(s), e.g. MASTER_ADDR=node0 NODE_RANK=0 ./torchrun.sh on node0.
# It runs `advisor train`, which starts the ranks of every segment of stages (torchrun for several).
# NODE_RANK    this node's number, 0 to {plan.nodes - 1} (default 0); node 0 is at MASTER_ADDR.
{_environment_notes()}
set -euo pipefail
cd "$(dirname "${{BASH_SOURCE[0]}}")"
{_with_restarts(shell_command(train_command(plan)))}"""


def slurm_script(plan: Plan, plan_path: str = PLAN_FILE) -> str:
    layout = plan.chosen.layout
    hours = sum(s.hours for s in plan.stages) or 24.0
    minutes = max(10, int(hours * 60 * 1.2))  # 20% slack over the planned wall-clock time
    command = "srun " + shell_command(train_command(plan, plan_path, slurm=True))
    return f"""#!/bin/bash
#SBATCH --job-name={job_name(plan.model.name)}
#SBATCH --nodes={plan.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={min(layout.devices, plan.gpus_per_node)}
#SBATCH --time={minutes // 60:02d}:{minutes % 60:02d}:00
#SBATCH --output=advisor-%j.log
#SBATCH --open-mode=append
#SBATCH --requeue
# Written by `advisor plan --export`: {layout.short()}
# Submit from this folder: sbatch slurm.sbatch. A requeued job (a node failure, `scontrol requeue`)
# continues the run from its last checkpoint (advisor train also reads SLURM_RESTART_COUNT), and
# appends to its log. MASTER_ADDR is the job's first node. Each node runs `advisor train`, which reads
# the nodes and its rank from Slurm's environment and starts the ranks of every segment of stages.
{_environment_notes()}
set -euo pipefail
cd "${{SLURM_SUBMIT_DIR:-$(dirname "$0")}}"
if [ ! -f {shlex.quote(plan_path)} ]; then
  echo "slurm.sbatch: submit it from the folder that holds {plan_path}" >&2; exit 2
fi
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=1
{_with_restarts(command)}"""


@dataclass
class Exported:
    written: list[Path]
    skipped: dict[str, str]  # file name: why it was not written


def launcher_files(plan: Plan) -> tuple[dict[str, str | None], dict[str, str]]:
    """The launcher files' texts (None: plan.yaml, written by the plan itself), and the files left
    out with the reason."""
    layout = plan.chosen.layout
    engine = engine_for(layout, plan.engine)
    texts: dict[str, str | None] = {PLAN_FILE: None}
    skipped = {}
    accelerate = accelerate_config(plan, layout)
    deepspeed = traits(engine).deepspeed
    comment = memory_comment(plan, layout) if deepspeed or accelerate is not None else []
    if deepspeed:
        # JSON has no comments: DeepSpeed, accelerate and HF Trainer ignore a top-level key they do not know
        config = {"comment": [f"Written by `advisor plan --export`: {layout.short()}", *comment],
                  **deepspeed_config(plan, layout)}
        texts["deepspeed.json"] = json.dumps(config, indent=2) + "\n"
    else:
        skipped["deepspeed.json"] = f"the {engine} engine runs this layout, not DeepSpeed"
    if accelerate is not None:
        header = [f"Written by `advisor plan --export`: {layout.short()}", *comment]
        texts["accelerate.yaml"] = "".join(f"# {line}\n" for line in header) + yaml.safe_dump(
            accelerate, sort_keys=False)
    else:
        skipped["accelerate.yaml"] = (f"accelerate does not run tp={layout.tp}, pp={layout.pp} as the {engine} "
                                      "engine does; launch with torchrun.sh or slurm.sbatch")
    texts["torchrun.sh"] = torchrun_script(plan)
    texts["slurm.sbatch"] = slurm_script(plan)
    return texts, skipped


def export(plan: Plan, directory: Path) -> Exported:
    """Write the plan and its launcher files into `directory`; say which were left out and why."""
    directory.mkdir(parents=True, exist_ok=True)
    texts, skipped = launcher_files(plan)
    paths = []
    for name, text in texts.items():
        path = directory / name
        if text is None:
            plan.write(path)
        else:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
        paths.append(path)
    for name in skipped:  # a file of an earlier export would launch another engine than this plan's
        (directory / name).unlink(missing_ok=True)
    return Exported(paths, skipped)
