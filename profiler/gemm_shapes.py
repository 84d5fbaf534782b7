"""The GEMM shapes a model's training step runs, as plain data (no torch: the planner prices them and
`advisor report capacity --jobs N` plans in worker processes without loading torch); the profiler times
them (profiler/hardware_bench.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmShape:
    """(m x k) @ (k x n), run `count` times per training step of the model."""

    m: int
    k: int
    n: int
    count: float = 1
    name: str = ""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def linear_gemms(tokens: int, fan_in: int, fan_out: int) -> list[GemmShape]:
    """Forward (T x in) @ (in x out), input gradient (T x out) @ (out x in) and weight gradient
    (out x T) @ (T x in) of one linear layer over `tokens` tokens, named fwd, dgrad and wgrad."""
    return [GemmShape(tokens, fan_in, fan_out, name="fwd"), GemmShape(tokens, fan_out, fan_in, name="dgrad"),
            GemmShape(fan_out, tokens, fan_in, name="wgrad")]


def model_gemm_shapes(dims: dict[str, int], tokens: int, head: bool = True) -> list[GemmShape]:
    """The linear layers of a decoder layer and (with `head`) the LM head for `tokens` tokens of one
    micro-batch: forward (T x in) @ (in x out), input gradient (T x out) @ (out x in) and weight
    gradient (out x T) @ (T x in); counts per step (layers for the decoder, 1 for the head).
    `dims` is profiler.model_trace.architecture_dims of the model."""
    h, inter, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_layers"]
    kv = dims["num_kv_heads"] * dims["head_dim"]
    q = dims["num_heads"] * dims["head_dim"]
    linears = [("q/o", h, q, 2), ("k/v", h, kv, 2), ("gate/up", h, inter, 2), ("down", inter, h, 1)]
    shapes: dict[tuple[int, int, int], GemmShape] = {}

    def add(m: int, k: int, n: int, count: int, name: str) -> None:
        key = (m, k, n)
        old = shapes.get(key)
        shapes[key] = GemmShape(m, k, n, count + (old.count if old else 0), old.name if old else name)

    heads = [("head", h, dims["vocab_size"], 1)] if head else []
    for name, fan_in, fan_out, count in [*((n, i, o, per_layer * layers) for n, i, o, per_layer in linears),
                                         *heads]:
        for gemm in linear_gemms(tokens, fan_in, fan_out):
            add(gemm.m, gemm.k, gemm.n, count, f"{name} {gemm.name}")
    return list(shapes.values())


def square_gemm_shapes(device_type: str) -> list[GemmShape]:
    sizes = (512, 1024) if device_type == "cpu" else (4096, 8192)
    return [GemmShape(s, s, s, 1, f"{s}^3") for s in sizes]
