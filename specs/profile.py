"""`profile.json`: what `advisor profile` measured, on what, and when (a versioned schema).

The `hardware` section is an ordinary `HardwareSpec` built from the measurements, so every
command that takes `--hardware` reads a profile like a preset (presets.load_hardware). The rest
is the evidence: the host it was measured on, the inventory, each micro-benchmark's median with
its repeat count, and the calibration steps with the factors fitted to them.

This module is the file format only: `profiler/` measures what goes in, `planner/calibration.py`
and `planner/feedback.py` fit the factors. The host identity (name and CPU model) lives here because
reading a profile warns when it describes another machine.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specs.errors import UsageError
from specs.core import READ_CONFIG, SPEC_CONFIG, FiniteDict, HardwareSpec, Layout, _format_validation_error

PROFILE_VERSION = 1


class HostFingerprint(BaseModel):
    """Enough to tell whether a profile describes the machine it is used on."""

    model_config = READ_CONFIG

    hostname: str
    cpu_model: str
    torch_version: str
    device_names: list[str] = Field(default_factory=list)
    cuda_version: str | None = None


class Inventory(BaseModel):
    """The devices and links as seen by the profiler."""

    model_config = READ_CONFIG

    device_type: Literal["cuda", "cpu"]
    backend: Literal["nccl", "gloo"]
    device_name: str
    devices_per_node: int = Field(ge=1)
    nodes: int = Field(1, ge=1)
    device_memory_gib: float = Field(gt=0, description="per device (CPU: the node's RAM over its devices)")
    device_reserved_gib: float = Field(ge=0, description="taken before tensors: CUDA context and NCCL, or on "
                                                   "CPU the framework's import footprint per rank")
    cpu_cores: int = Field(ge=1)
    threads_per_device: int = Field(ge=1, description="CPU threads each rank runs (torch.set_num_threads)")
    host_memory_gib: float = Field(gt=0)
    host_memory_available_gib: float = Field(ge=0)
    intra_node_link: str = Field(description="NVLink, PCIe, or shared memory (CPU)")
    inter_node_link: str = Field(description="InfiniBand/RoCE, TCP, or none (one node)")
    notes: list[str] = Field(default_factory=list)


class Measurement(BaseModel):
    """One micro-benchmark figure: the median of `repeats` samples."""

    # benchmark-specific details (shape, sizes, per-shape rows); a failed benchmark's figure may be NaN
    model_config = ConfigDict(extra="allow")

    name: str = Field(description="e.g. gemm/fp32, memory_bandwidth, all_reduce/2/intra/33554432")
    value: float
    unit: str
    median_s: float | None = None
    repeats: int = 0
    stable: bool = True
    suspect: str | None = Field(None, description="why no healthy device gives this figure (measured twice); "
                                "the hardware does not price it as measured (profiler.run_profile.hardware_from)")


class CalibrationStep(BaseModel):
    """One calibration layout: its real median step time and the cost model's, before and after."""

    model_config = READ_CONFIG

    layout: str
    measured_s: float = Field(gt=0)
    steps: int = Field(ge=1)
    predicted_before_s: float = Field(ge=0)
    predicted_after_s: float = Field(ge=0)
    used_for: Literal["fit", "check"] = "fit"


class Calibration(BaseModel):
    model_config = READ_CONFIG

    model: str
    layers: int = Field(ge=1, description="decoder layers of the model that actually ran (full width)")
    threads: int = Field(ge=0)
    factors: dict[str, float] = Field(description="fitted Efficiency fields")
    steps: list[CalibrationStep]
    method: str = "least squares on measured step times, see planner/calibration.py"


class Observation(BaseModel):
    """One measured layout of a real model on this machine (a verification trial or a finished
    run): what `planner/feedback.py` refits the efficiency factors on."""

    model_config = READ_CONFIG

    source: Literal["calibration", "verify", "run"]
    model: str
    hf_config: FiniteDict = Field(description="the model that ran (the fit re-traces it)")
    layout: Layout
    step_s: float = Field(gt=0, description="measured median optimizer step")
    predicted_step_s: float = Field(ge=0, description="the cost model's step when it was measured")
    peak_bytes: int | None = Field(None, description="measured peak per device, if measured")
    predicted_peak_bytes: int | None = None
    peak_source: str | None = None
    threads: int = Field(0, ge=0, description="CPU threads per rank (0: not a CPU run)")
    steps: int = Field(0, ge=0)
    run_dir: str | None = None
    at: dt.datetime


class FeedbackRound(BaseModel):
    """One refit: how many observations it used and the step-time error before and after it.
    (An error over no observations is NaN: this record may hold it.)"""

    at: dt.datetime
    run_dir: str | None = None
    added: int
    used: int
    factors_before: dict[str, float]
    factors_after: dict[str, float]
    error_before: float = Field(description="RMS relative step-time error over the used observations")
    error_after: float
    new_error_before: float | None = Field(None, description="the same over this round's new observations")


class Feedback(BaseModel):
    """Measurements fed back into the profile: a bounded history of observations and refits."""

    model_config = READ_CONFIG

    observations: list[Observation] = Field(default_factory=list)
    rounds: list[FeedbackRound] = Field(default_factory=list)
    method: str = "refit of the calibration's least squares over every kept observation, see planner/feedback.py"


class NodeInventory(BaseModel):
    """One node of a cluster profile, as its own first rank saw it."""

    model_config = READ_CONFIG

    node: int = Field(ge=0)
    hostname: str
    cpu_model: str
    device_name: str
    devices: int = Field(ge=1)
    cpu_cores: int = Field(ge=1)
    host_memory_gib: float = Field(gt=0)
    device_memory_gib: float = Field(gt=0)


class DeviceRate(BaseModel):
    """What one device measured while every device ran the same benchmark at once."""

    model_config = READ_CONFIG

    name: str = Field(description="n<node>d<local rank>, e.g. n1d0: what `advisor plan --exclude` takes")
    node: int = Field(ge=0)
    rank: int = Field(ge=0)
    gemm_tflops: dict[str, float] = Field(description="step-weighted GEMM rate per dtype")
    memory_gbs: float = Field(gt=0)


class LinkRate(BaseModel):
    """Send/recv between the first ranks of two nodes (every pair measured, disjoint pairs at once),
    fitted to latency + bytes / bandwidth."""

    model_config = READ_CONFIG

    name: str = Field(description="n<a>-n<b>")
    nodes: tuple[int, int]
    bandwidth_gbs: float = Field(gt=0)
    latency_us: float = Field(ge=0)


class Straggler(BaseModel):
    """A device or link slower than the median of its kind by more than the threshold."""

    model_config = READ_CONFIG

    name: str
    kind: Literal["device", "link"]
    figure: str = Field(description="gemm/<dtype>, memory_bandwidth or send_recv")
    value: float
    median: float
    slower_by: float = Field(description="1 - value / median")


class ClusterProfile(BaseModel):
    """The cluster as a whole: per-node inventories, per-device and per-link rates, the bisection,
    and the stragglers among them. `hardware` prices the slowest device and link listed here;
    `advisor plan --exclude` reprices without the ones it names."""

    model_config = READ_CONFIG

    nodes: list[NodeInventory]
    uniform: bool = Field(description="every node has the same CPU, devices, cores and memory")
    devices: list[DeviceRate]
    links: list[LinkRate] = Field(default_factory=list)
    bisection_gbs: float | None = Field(
        None, description="all-to-all of every rank: bytes crossing the cut between the two halves of the "
        "nodes (both ways) per second")
    straggler_threshold: float = Field(ge=0)
    stragglers: list[Straggler] = Field(default_factory=list)


class HardwareProfile(BaseModel):
    model_config = SPEC_CONFIG

    version: int = PROFILE_VERSION
    created: dt.datetime
    quick: bool = False
    duration_s: float = 0.0
    fingerprint: HostFingerprint
    inventory: Inventory
    measurements: list[Measurement] = Field(default_factory=list)
    calibration: Calibration | None = None
    feedback: Feedback | None = None
    cluster: ClusterProfile | None = None
    hardware: HardwareSpec

    def measurement(self, name: str) -> Measurement:
        for m in self.measurements:
            if m.name == name:
                return m
        raise KeyError(name)

    def write(self, path: Path) -> None:
        """Atomically: a reader never sees half a profile. Its hardware then comes from `path`."""
        path = Path(path)
        self.hardware.source = str(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        tmp.replace(path)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def looks_like_profile(data: Any) -> bool:
    return isinstance(data, dict) and "version" in data and "hardware" in data


def load_profile(path: Path) -> HardwareProfile:
    """Read and validate a profile; corrupt, truncated or foreign files raise one clear line."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"profile {path} is corrupt or truncated (not valid JSON: {exc}); "
                         "rerun `advisor profile`") from None
    return profile_from_data(data, path)


def profile_from_data(data: Any, path: Path) -> HardwareProfile:
    if not looks_like_profile(data):
        raise UsageError(f"{path} is not an advisor profile (no 'version' and 'hardware' keys)")
    version = data.get("version")
    if version != PROFILE_VERSION:
        raise UsageError(f"profile {path} has version {version!r}; this advisor reads version "
                         f"{PROFILE_VERSION}: rerun `advisor profile`")
    try:
        profile = HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise UsageError(_format_validation_error(exc, f"profile {path}") + " (corrupt or edited? "
                         "rerun `advisor profile`)") from None
    except UnicodeEncodeError:  # pydantic-core cannot take a lone surrogate
        raise UsageError(f"profile {path} holds text that is not valid Unicode (corrupt or edited? "
                         "rerun `advisor profile`)") from None
    profile.hardware.source = str(path)
    hardware = profile.hardware
    if hardware.device_type == "cpu" and hardware.threads_per_device is None:
        # written before the hardware carried its device's threads: the inventory has them
        hardware.threads_per_device = profile.inventory.threads_per_device
        hardware.cpu_cores = profile.inventory.cpu_cores
    return profile


def fingerprint_mismatch(profile: HardwareProfile, here: HostFingerprint | None = None) -> str | None:
    """A one-line warning when the profile was measured on another machine, else None."""
    theirs = profile.fingerprint
    if here is None:
        here = HostFingerprint(hostname=socket.gethostname(), cpu_model=cpu_model_name(),
                               torch_version=theirs.torch_version)
    differences = []
    if theirs.hostname != here.hostname:
        differences.append(f"host '{theirs.hostname}' (this is '{here.hostname}')")
    if theirs.cpu_model != here.cpu_model:
        differences.append(f"CPU '{theirs.cpu_model}' (this is '{here.cpu_model}')")
    if not differences:
        return None
    return ("profile measured on another machine: " + ", ".join(differences)
            + "; its figures may not describe this one (rerun `advisor profile` here)")
