"""Plan quality on a grid nobody tuned (issue 14): the planner's untested first choice, made from a
fresh `advisor profile --quick`, against every layout of the grid measured through the trainer.

The grid: DDP (dp=2) and TP (tp=2) x micro-batch 1/2/4/8 x recompute none/full, 2 ranks of one
core, global batch 16 sequences of 512 tokens, a 512-wide Llama-family config that is no preset
(`GRID_MODEL`). Each layout runs through `advisor train`'s own engines and step code
(trainer/timed_steps.py: forked gloo ranks, random tokens, median after 2 warm-up steps). The
planner plans the same model, batch and devices on the fresh profile, restricted to what the grid
spans (tp 1 or 2, no pipeline, no ZeRO sharding, no offload, micro-batch <= 8); its first choice is
measured too when the grid does not hold it (a partial recomputation count).

    python -m bench.plan_quality_grid [--steps 4] [--profile profile.json] [--predict-only] [--no-write]

Measurements are kept in bench/plan_quality_grid.json; `--predict-only` re-profiles and re-plans
against them, measuring only a first choice that is not among them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402

from specs.core import Layout, ModelSpec, parse_layout_string  # noqa: E402

GOAL = 0.95
SEQ = 512
GLOBAL_BATCH = 16
MICRO_BATCHES = (1, 2, 4, 8)
GRID_MODEL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192,
              "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
              "intermediate_size": 1408, "max_position_embeddings": 1024, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-5}
SAVED = Path(__file__).with_name("plan_quality_grid.json")


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def model() -> ModelSpec:
    return ModelSpec(name="grid-512", hf_config=GRID_MODEL)


def grid() -> list[Layout]:
    out = []
    for dp, tp in ((2, 1), (1, 2)):
        for mbs in MICRO_BATCHES:
            for recompute in ("none", "full"):
                out.append(Layout(dp=dp, tp=tp, mbs=mbs, gas=GLOBAL_BATCH // (dp * mbs), seq=SEQ, dtype="fp32",
                                  recompute=recompute))
    return out


def quick_profile(work: Path) -> Path:
    """`advisor profile --quick` on the grid's model, in a fresh process and a fresh cache."""
    config, out = work / "grid-512.json", work / "profile.json"
    config.write_text(json.dumps(GRID_MODEL))
    env = {**__import__("os").environ, "ADVISOR_CACHE": str(work / "cache")}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "advisor.cli", "profile", "--quick", "--model", str(config),
                    "--out", str(out)], check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    print(f"profile: {time.perf_counter() - started:.0f} s", flush=True)
    return out


def planners_choice(profile: Path) -> Layout:
    """`advisor plan`'s first choice for the grid's model, batch and 2 devices, within the grid's span."""
    from planner.plan import PlanOptions, make_plan
    from planner.search import SearchSpace
    from presets import load_hardware

    space = SearchSpace(zero_stages=(0,), offloads=("none",), max_micro_batch=max(MICRO_BATCHES), max_vpp=1,
                        sequence_parallel=(False,), tp_degrees=(1, 2), pp_degrees=(1,))
    hardware = load_hardware(str(profile))
    plan = make_plan(PlanOptions(model=model(), hardware=hardware, gpus_per_node=2, seq=SEQ,
                                 global_batch=GLOBAL_BATCH, dtype="fp32", space=space))
    return plan.chosen.layout


def predicted_step_s(layout: Layout, profile: Path) -> float:
    from planner.cost_model import estimate
    from presets import load_hardware

    hardware = load_hardware(str(profile)).model_copy(update={"devices_per_node": 2})
    return estimate(model(), hardware, layout).time.step_s


def measure(layouts: list[Layout], steps: int, kept: dict[str, dict]) -> None:
    from trainer.timed_steps import prepare_forks, time_layout

    prepare_forks(layouts)
    for layout in layouts:
        if layout.short() in kept:
            continue
        step_s = time_layout(model(), layout, steps=steps, threads=1, warmup=2).step_s
        kept[layout.short()] = {"step_s": step_s, "load": load_average()}
        SAVED.write_text(json.dumps(kept, indent=1) + "\n")
        print(f"  {layout.short()}: {step_s:.3f} s (load {kept[layout.short()]['load']})", flush=True)


def describe(layout: Layout) -> str:
    kind = "DDP" if layout.tp == 1 else "TP"
    recompute = layout.recompute if not layout.recompute_layers else f"{layout.recompute} {layout.recompute_layers}"
    return f"{kind}, mbs {layout.mbs}, gas {layout.gas}, recompute {recompute}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per layout (2 warm up)")
    parser.add_argument("--profile", type=Path, help="an existing profile.json (default: a fresh quick profile)")
    parser.add_argument("--predict-only", action="store_true", help="reuse the saved measurements (measure only "
                        "a planner's choice that is not among them)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plan_quality_grid_"))
    kept: dict[str, dict] = json.loads(SAVED.read_text()) if (args.predict_only and SAVED.is_file()) else {}
    loads = [load_average()]
    profile = args.profile or quick_profile(work)
    choice = planners_choice(profile)
    print(f"planner's first choice: {choice.short()}", flush=True)
    layouts = grid()
    if choice.short() not in {g.short() for g in layouts}:
        layouts.append(choice)
    measure(layouts, args.steps, kept)
    loads.append(load_average())
    tokens = GLOBAL_BATCH * SEQ
    measured = {k: v for k, v in kept.items() if k in {g.short() for g in layouts}}
    best = min(measured, key=lambda k: measured[k]["step_s"])
    best_tps = tokens / measured[best]["step_s"]
    rows = ["| # | layout (2 ranks, seq 512, global batch 16) | measured step | tokens/s | of best | predicted step "
            "| predicted / measured | load |", "|---|---|---|---|---|---|---|---|"]
    for i, layout in enumerate(sorted(layouts, key=lambda g: measured[g.short()]["step_s"]), 1):
        m = measured[layout.short()]
        predicted = predicted_step_s(layout, profile)
        mark = " **planner's choice**" if layout.short() == choice.short() else ""
        rows.append(f"| {i} | {describe(layout)}{mark} | {m['step_s']:.2f} s | {tokens / m['step_s']:,.0f} | "
                    f"{100 * tokens / m['step_s'] / best_tps:.0f}% | {predicted:.2f} s | "
                    f"{predicted / m['step_s']:.2f} | {m['load']} |")
    ratio = tokens / measured[choice.short()]["step_s"] / best_tps
    saved_profile = json.loads(Path(profile).read_text()) if Path(profile).is_file() else {}
    factors = (saved_profile.get("calibration") or {}).get("factors", {})
    body = "\n".join(rows) + (
        f"\n\nThe planner's untested first choice, `{choice.short()}`, reaches **{100 * ratio:.0f}%** of the best "
        f"measured layout ({describe(Layout(**parse_layout_string(best)))}, {best_tps:,.0f} tokens/s); goal >= "
        f"{100 * GOAL:.0f}%. Model: a Llama-family config that is no preset (hidden 512, 2 layers, 8/4 heads, "
        f"intermediate 1408, vocab 8192, untied), fp32. Profile: a fresh `advisor profile --quick --model` of it "
        f"(fitted factors: {', '.join(f'{k} {v:.3g}' for k, v in sorted(factors.items()))}). 1-minute load "
        f"average at the start and the end: {', '.join(loads)} on 2 shared cores: step times under load are "
        "provisional; rerun on a quiet machine.")
    print(body)
    if not args.no_write:
        write_section("plan_quality_grid", "Plan quality on a grid nobody tuned (512-wide Llama, 2 ranks, "
                      "this CPU)", "python -m bench.plan_quality_grid", body)


if __name__ == "__main__":
    main()
