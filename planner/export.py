"""Launcher files for a plan: a DeepSpeed config, an accelerate config, the torchrun command and a
Slurm batch script. The bucket sizes are the ones the cost model assumed (`zero_bucket_elems`)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from advisor.plan_file import Plan
from advisor.specs import Layout, ModelSpec, safe_name
from planner.cost_model import zero_bucket_elems
from profiler.model_trace import trace_model

MASTER_PORT = 29511  # not DeepSpeed's and accelerate's default 29500, which collide on shared hosts


def deepspeed_config(plan: Plan, layout: Layout) -> dict:
    return model_deepspeed_config(plan.model, plan.hardware.device_type, layout)


def model_deepspeed_config(model: ModelSpec, device_type: str, layout: Layout) -> dict:
    """The DeepSpeed config of `layout` for `model` on `device_type`, without a plan around it: the
    trainer's timed steps (calibration, verification, the benches) configure DeepSpeed as
    `advisor train` does."""
    trace = trace_model(model, layout.seq, layout.dtype, layout.method, layout.lora_rank, device_type=device_type)
    bucket = zero_bucket_elems(trace, layout)
    zero: dict = {"stage": layout.zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                  "contiguous_gradients": True, "overlap_comm": device_type == "cuda"}
    if layout.zero == 3:
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=0)
    if layout.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": layout.global_batch,
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


def accelerate_config(plan: Plan, layout: Layout) -> dict:
    cpu = plan.hardware.device_type == "cpu"
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED" if layout.zero else ("MULTI_GPU" if layout.devices > 1 else "NO"),
        "num_machines": plan.nodes,
        "num_processes": layout.devices,
        "machine_rank": 0,
        "main_process_port": MASTER_PORT,
        "mixed_precision": "no" if layout.dtype == "fp32" else layout.dtype,
        "use_cpu": cpu,
    }
    if layout.zero:
        config["deepspeed_config"] = {"deepspeed_config_file": "deepspeed.json"}
    return config


def torchrun_command(plan: Plan, plan_path: str = "plan.yaml") -> list[str]:
    per_node = min(plan.chosen.layout.devices, plan.gpus_per_node)
    return ["torchrun", f"--nnodes={plan.nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=${{MASTER_ADDR:-127.0.0.1}}:{MASTER_PORT}", "-m", "advisor.cli", "train",
            plan_path, "--launched"]


def shell_command(words: list[str]) -> str:
    """One shell line with every word quoted, so a path or name holding spaces, `;`, `$()` or quotes
    stays one argument; only the rendezvous endpoint is left open for `${MASTER_ADDR}` to expand
    (its other characters are ours)."""
    return " ".join(w if w.startswith("--rdzv-endpoint=${MASTER_ADDR") else shlex.quote(w) for w in words)


def job_name(model_name: str) -> str:
    """`#SBATCH` lines are not shell, so quoting cannot protect them (a newline in a folder name
    would start a command): the model's name goes in cleaned."""
    return f"advisor-{safe_name(model_name, 60)}"


def slurm_script(plan: Plan, plan_path: str = "plan.yaml") -> str:
    layout = plan.chosen.layout
    hours = sum(s.hours for s in plan.stages) or 24.0
    minutes = max(10, int(hours * 60 * 1.2))  # 20% slack over the planned wall-clock time
    command = shell_command(torchrun_command(plan, plan_path))
    return f"""#!/bin/bash
#SBATCH --job-name={job_name(plan.model.name)}
#SBATCH --nodes={plan.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={min(layout.devices, plan.gpus_per_node)}
#SBATCH --time={minutes // 60:02d}:{minutes % 60:02d}:00
#SBATCH --output=advisor-%j.log
# Written by `advisor plan --export`: {layout.short()}
set -euo pipefail
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=1
srun {command}
"""


def export(plan: Plan, directory: Path) -> list[Path]:
    """Write the four launcher files into `directory` (and the plan beside them)."""
    directory.mkdir(parents=True, exist_ok=True)
    layout = plan.chosen.layout
    written = {
        "plan.yaml": None,
        "deepspeed.json": json.dumps(deepspeed_config(plan, layout), indent=2) + "\n",
        "accelerate.yaml": yaml.safe_dump(accelerate_config(plan, layout), sort_keys=False),
        "torchrun.sh": "#!/bin/bash\nset -euo pipefail\n" + shell_command(torchrun_command(plan)) + "\n",
        "slurm.sbatch": slurm_script(plan),
    }
    paths = []
    for name, text in written.items():
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
    return paths
