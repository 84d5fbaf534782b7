"""A plan carries its failure and checkpoint assumptions (issue 30): whoever sizes a stage again (the
verification trials' candidate plans, the trainer's one-stage plans) sizes it under the plan's own
`--mtbf-hours`, never the planner's defaults (a 500-hour plan had been re-staged at 2000)."""

from __future__ import annotations

from pathlib import Path

from specs.plan_file import PlanAssumptions, load_plan
from planner.granularity import restage
from planner.plan import PlanOptions, make_plan
from presets import load_hardware, load_model, load_task
from trainer.verify import candidate_plan


def test_a_candidate_plan_is_restaged_under_the_plans_own_assumptions(tmp_path: Path) -> None:
    # a failure every 36 s: checkpoints every few steps, where the default 2000 hours never checkpoints mid-stage
    opts = PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), task=load_task("demo"),
                       mtbf_hours=0.01, checkpoint_write_gbs=1.0, restart_s=1.0)
    plan = make_plan(opts)
    assert plan.assumptions == PlanAssumptions(mtbf_hours=0.01, checkpoint_write_gbs=1.0, restart_s=1.0)
    plan.write(tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml").assumptions == plan.assumptions
    other = plan.alternatives[0]
    restaged = candidate_plan(plan, other)
    defaults = plan.model_copy(update={"assumptions": PlanAssumptions()})
    spec, stage = plan.task.stages[0], restaged.stages[0]
    nodes = max(1, -(-other.layout.devices // plan.gpus_per_node))
    assert stage == restage(plan, plan.task, spec, other.layout, other.estimate, nodes)
    at_defaults = restage(defaults, plan.task, spec, other.layout, other.estimate, nodes)
    assert stage.checkpoint_every_steps < at_defaults.checkpoint_every_steps
