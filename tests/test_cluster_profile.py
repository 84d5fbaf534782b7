"""`advisor profile --nnodes 2`: two launchers on localhost (one core and one gloo rank each) profile
together; the inter-node fit against the test's own all-reduce between two such processes; an
injected straggler named, priced by `advisor plan` and taken out by `--exclude`; bad input fails
with one line within the timeout."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.profile import load_profile
from planner.plan import PlanOptions, make_plan
from presets import load_model
from profiler.hardware_bench import SLOW_RANKS_ENV
from profiler.ranks import free_port
from profiler.stragglers import DEFAULT_THRESHOLD

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
SLOWDOWN = 4.0  # node 1's GEMM and memory samples last 4x longer (issue 31 restored it from 10x)
SMALL, LARGE = 4 << 10, 32 << 20  # the smallest and largest --quick collective sizes


def _node(rank: int, port: int, out: Path, core: int, env: dict[str, str]) -> subprocess.Popen:
    """One simulated node: `advisor profile` pinned to one core, as if it were its own machine."""
    command = [sys.executable, "-m", "advisor.cli", "profile", "--quick", "--nproc", "1", "--nnodes", "2",
               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--timeout-s", "60", "--out", str(out)]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def _direct_all_reduce(rank: int, port: int, out: str) -> None:
    """The test's own measurement: two gloo processes, one core and one thread each, like the nodes;
    median seconds of an all-reduce of a small and of a large buffer."""
    import torch
    import torch.distributed as dist

    from profiler.ranks import finish_rank, init_rank

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})
    init_rank(rank, 2, port, distributed=True, threads=1)
    medians = {}
    for nbytes, calls in ((SMALL, 10), (LARGE, 3)):  # back-to-back calls, as the profile times them: the
        # ranks leave a barrier milliseconds apart on a loaded host, and one call would count that skew
        buffer = torch.ones(nbytes // 4)
        for _ in range(2):
            dist.all_reduce(buffer)
        samples = []
        for _ in range(12):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(buffer)
            samples.append((time.perf_counter() - start) / calls)
        medians[nbytes] = statistics.median(samples)
        del buffer
    if rank == 0:
        Path(out).write_text(json.dumps(medians))
    finish_rank(distributed=True)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two simulated nodes need a core each")
def test_two_nodes_profile_the_links_and_name_the_injected_straggler(tmp_path: Path) -> None:
    from profiler.ranks import launch

    def direct_runs(count: int) -> list[dict[int, float]]:
        """Separate launches, half before and half after the profile: the machine's load drifts."""
        runs = []
        for _ in range(count):
            launch(_direct_all_reduce, 2, (free_port(), str(tmp_path / "direct.json")))
            runs.append({int(k): v for k, v in json.loads((tmp_path / "direct.json").read_text()).items()})
        return runs

    runs = direct_runs(2)
    out, port = tmp_path / "cluster.json", free_port()
    started = time.perf_counter()
    node1 = _node(1, port, tmp_path / "unused.json", core=1, env={SLOW_RANKS_ENV: f"1={SLOWDOWN}"})
    node0 = _node(0, port, out, core=0, env={})
    console0, _ = node0.communicate(timeout=180)
    console1, _ = node1.communicate(timeout=60)
    elapsed = time.perf_counter() - started
    assert node0.returncode == 0, console0
    assert node1.returncode == 0, console1
    assert "node 1 measured; node 0 writes the profile" in console1
    assert not (tmp_path / "unused.json").exists()
    # the --quick budget on 2 nodes (interpreters, imports and the meeting included)
    assert elapsed < 90, elapsed

    profile = load_profile(out)
    cluster = profile.cluster
    assert cluster is not None and profile.inventory.nodes == 2
    assert [n.node for n in cluster.nodes] == [0, 1] and cluster.uniform
    assert [d.name for d in cluster.devices] == ["n0d0", "n1d0"]
    assert [link.name for link in cluster.links] == ["n0-n1"] and cluster.links[0].bandwidth_gbs > 0
    assert cluster.bisection_gbs and cluster.bisection_gbs > 0
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        assert profile.measurement(f"{op}/2/inter/bandwidth").value > 0
    hardware = profile.hardware
    assert hardware.assumed == {}  # measured across nodes: nothing assumed

    # the straggler: named in the profile and on node 0's console, and the hardware prices it
    fast, slow = cluster.devices
    # below the product's own straggler rule (20% under the median), not a stricter 2x: CI once measured
    # 1.98x at 4x, its "fast" node slowed by a neighbour; the rule keeps a 3.2x margin for such noise
    assert slow.gemm_tflops["fp32"] < fast.gemm_tflops["fp32"] * (1 - DEFAULT_THRESHOLD)
    named = {(s.name, s.figure) for s in cluster.stragglers}
    assert ("n1d0", "gemm/fp32") in named and ("n1d0", "memory_bandwidth") in named
    assert not [s for s in cluster.stragglers if s.name == "n0d0"]
    assert "straggler: device n1d0" in console0
    assert hardware.peak_tflops["fp32"] == slow.gemm_tflops["fp32"]
    assert hardware.memory_bandwidth_gbs == slow.memory_gbs

    # the inter-node fit against the test's own all-reduce between two such processes
    runs += direct_runs(2)
    small, large = (statistics.median(r[size] for r in runs) for size in (SMALL, LARGE))
    # 2 ranks: the bus carries 2(n-1)/n = 1 x the buffer. Like the fit's, the direct bandwidth is the
    # slope of time over bytes (the small buffer's time is the latency term): on this loaded machine a
    # small all-reduce takes milliseconds of scheduling, which bytes / time at one size would count as
    # transfer time.
    direct_bus_gbs = (LARGE - SMALL) / (large - small) / 1e9
    fitted = profile.measurement("all_reduce/2/inter/bandwidth").value
    at_size = profile.measurement(f"all_reduce/2/inter/{LARGE}").value
    assert hardware.inter_node_bandwidth_gbs == fitted
    print(f"\nFIGURES elapsed {elapsed:.1f} s, fitted {fitted:.3f} GB/s, direct slope {direct_bus_gbs:.3f} GB/s, "
          f"at {LARGE} bytes: profile {at_size:.3f}, direct {LARGE / large / 1e9:.3f} GB/s; {runs}")
    # within half either way: on CI's shared machine the four direct runs' own slopes spread over
    # 1.19-1.50 GB/s while the profile, run between them, fitted 1.82. A unit slip (bits, elements,
    # the buffer counted per rank) would be off by 4x or more.
    assert fitted == pytest.approx(direct_bus_gbs, rel=0.5), (fitted, direct_bus_gbs)
    assert at_size == pytest.approx(LARGE / large / 1e9, rel=0.5), (at_size, LARGE / large / 1e9)

    # a plan from this profile prices the slow rank; --exclude n1d0 prices the fast one, and the
    # straggler's note announces the throughput that the excluded plan then has
    options = dict(model=load_model("demo-tiny"), hardware=hardware, nodes=2, gpus_per_node=1, seq=128,
                   global_batch=8, min_compute_fraction=0.0, top_k=1, dtype="fp32", cluster=cluster)
    slowed = make_plan(PlanOptions(**options))
    assert slowed.hardware.peak_tflops["fp32"] == slow.gemm_tflops["fp32"]
    assert any("slowest participating device: n1d0" in n for n in slowed.notes)
    gain = [n for n in slowed.notes if "--exclude n1d0 would give" in n]
    assert gain, slowed.notes
    result = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", str(out), "--nodes", "2",
                                 "--gpus-per-node", "1", "--seq-len", "128", "--global-batch", "8", "--top", "1",
                                 "--min-compute-fraction", "0", "--exclude", "n1d0", "--json"])
    assert result.exit_code == 0, result.output
    excluded = json.loads(result.stdout)
    assert any("(without n1d0): n0d0" in n for n in excluded["notes"])
    assert not [n for n in excluded["notes"] if "would give" in n]
    tokens_excluded = excluded["plans"][0]["estimate"]["throughput"]["tokens_per_s"]
    tokens_slowed = slowed.chosen.estimate.throughput.tokens_per_s
    assert tokens_excluded > tokens_slowed
    assert f"would give {tokens_excluded:,.0f} instead of {tokens_slowed:,.0f} tokens/s" in gain[0]
    fast_only = make_plan(PlanOptions(**options, exclude=["n1d0"]))
    assert fast_only.hardware.peak_tflops["fp32"] == pytest.approx(fast.gemm_tflops["fp32"], rel=1e-12)


@pytest.mark.parametrize("args,message", [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"], "--node-rank must be within 0-1"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "70000"],
     "--master-port must be within"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "PORT"],
     "cannot reach the profile's master at 127.0.0.1"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "PORT"],
     "node(s) 1 of 2 did not join"),
])
def test_bad_cluster_input_fails_with_one_line_within_the_timeout(args: list[str], message: str) -> None:
    args = [str(free_port()) if a == "PORT" else a for a in args]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "profile", "--quick", "--nproc", "1", "--timeout-s",
                           "3", "--out", os.devnull, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                          "COLUMNS": "300"}, capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - started < 3 + 20  # the timeout, plus the interpreter's start-up and imports
    assert done.returncode == 2, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines


def test_a_one_node_profile_in_a_two_node_plan_says_which_inter_node_figures_are_assumed(tmp_path: Path) -> None:
    from tests.test_profile import synthetic_profile

    profile = synthetic_profile()
    assumed = {"inter_node_bandwidth_gbs": "assumed from preset cpu, not measured",
               "inter_node_latency_us": "assumed from preset cpu, not measured"}
    profile.hardware = profile.hardware.model_copy(update={"assumed": assumed})
    profile.write(tmp_path / "one-node.json")
    result = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", str(tmp_path / "one-node.json"),
                                 "--nodes", "2", "--seq-len", "128", "--global-batch", "8", "--top", "1",
                                 "--min-compute-fraction", "0", "--json"])
    assert result.exit_code == 0, result.output
    said = [n for n in json.loads(result.stdout)["notes"] if "inter-node figures are assumed" in n]
    assert len(said) == 1
    assert "inter_node_bandwidth_gbs" in said[0] and "inter_node_latency_us" in said[0] and "preset cpu" in said[0]


def test_node_pairs_unequal_nodes_and_exclusion_pricing() -> None:
    """Without processes: the rounds cover every node pair once with disjoint pairs; unequal nodes are
    reported; --exclude reprices each figure at the slowest device and link kept."""
    from specs.core import HardwareSpec
    from planner.stragglers import priced_without
    from presets import load_hardware
    from profiler.cluster_bench import crossing_bytes, pair_rounds
    from profiler.cluster_profile import cluster_notes, cluster_of, priced_at_slowest

    for nodes in range(2, 8):
        rounds = pair_rounds(nodes)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]
        assert all(len({n for p in r for n in p}) == 2 * len(r) for r in rounds)  # disjoint within a round
    # 4 nodes of 2 ranks: ranks 0-3 on one side of the cut, 4-7 on the other; each sends 1/8 to every rank
    assert crossing_bytes(800, 8, 2) == 2 * 4 * 4 * 100

    def node(n: int, cores: int) -> dict:
        return dict(node=n, hostname=f"h{n}", cpu_model="X", device_name="X", devices=1, cpu_cores=cores,
                    host_memory_gib=64.0, device_memory_gib=32.0 - 16 * n)

    ranks = [{"rank": r, "node": r, "local_rank": 0, "gemm": {"fp32": g}, "memory_gbs": m, "inventory": node(r, c),
              "node_pairs": [{"nodes": [0, 1], "fit": {"bandwidth_gbs": 2.0, "latency_us": 5.0}}] if r == 0 else []}
             for r, g, m, c in ((0, 1.0, 40.0, 8), (1, 0.4, 10.0, 4))]
    cluster = cluster_of({"ranks": ranks, "bisection": {"bisection_gbs": 3.0}}, threshold=0.2)
    assert not cluster.uniform and "unequal nodes" in cluster_notes(cluster)[0]
    assert {(s.name, s.figure) for s in cluster.stragglers} == {("n1d0", "gemm/fp32"), ("n1d0", "memory_bandwidth")}
    straggler = next(s for s in cluster.stragglers if s.figure == "gemm/fp32")
    assert straggler.slower_by == pytest.approx(1 - 0.4 / 0.7)
    measured: HardwareSpec = load_hardware("cpu").model_copy(update={"peak_tflops": {"fp32": 1.0}})
    slowest = priced_at_slowest(measured, cluster)
    assert slowest.peak_tflops["fp32"] == 0.4 and slowest.memory_bandwidth_gbs == 10.0
    assert slowest.memory_gib == 16.0  # the smaller node's
    kept = priced_without(slowest, cluster, ["n1"])
    assert kept.peak_tflops["fp32"] == pytest.approx(1.0) and kept.memory_bandwidth_gbs == pytest.approx(40.0)
    # two healthy devices 10% apart (a quick profile's noise, within the threshold): the median prices
    noisy = cluster_of({"ranks": [{**ranks[0]}, {**ranks[1], "gemm": {"fp32": 0.9}, "memory_gbs": 36.0}],
                        "bisection": {"bisection_gbs": 3.0}}, threshold=0.2)
    assert not noisy.stragglers
    median = priced_at_slowest(measured, noisy)
    assert median.peak_tflops["fp32"] == pytest.approx(0.95) and median.memory_bandwidth_gbs == pytest.approx(38.0)
    with pytest.raises(UsageError, match="not in the profile"):
        priced_without(slowest, cluster, ["n7d0"])
    with pytest.raises(UsageError, match="leaves no measured device"):
        priced_without(slowest, cluster, ["n0", "n1"])
