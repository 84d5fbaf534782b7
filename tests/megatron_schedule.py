"""An independent replay of Megatron-LM's 2021 pipeline programs (1F1B and interleaved 1F1B), for
checking the cost model's pipeline terms.

Each device runs its program as Megatron's `schedules.py` of the SC21 paper's commit writes it:
warm-up forwards (2 (p - rank - 1) + (v - 1) p chunks when interleaved), the steady state of one
forward chunk and one backward chunk followed by ONE combined exchange
(`send_forward_backward_recv_forward_backward`), then cool-down backwards. Every exchange blocks
until each peer has posted its side (NCCL send/recv, then `torch.cuda.synchronize`), and lasts one
message time per message it sends (or receives, whichever is more). The ring wraps: the last
device sends chunk c's output to the first device's chunk c + 1.

Nothing here prices anything: `replay` takes the per-micro-batch seconds of each stage (the cost
model's StageTime fields) and lays them out as Megatron's programs run; a test and
bench/megatron_table1.py hold the priced pipeline against it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

Op = tuple  # ("F", chunk) | ("B", chunk) | ("X", sends, recvs); sends/recvs: [(kind, peer)]


def _one_f_one_b(d: int, p: int, m: int) -> list[Op]:
    first, last, nxt, prv = d == 0, d == p - 1, d + 1, d - 1
    prog: list[Op] = []

    def call(sends, recvs):
        if sends or recvs:
            prog.append(("X", sends, recvs))

    recv_f, send_f = ([] if first else [("F", prv)]), ([] if last else [("F", nxt)])
    recv_b, send_b = ([] if last else [("B", nxt)]), ([] if first else [("B", prv)])
    warm = min(p - d - 1, m)
    for _ in range(warm):
        call([], recv_f), prog.append(("F", 0)), call(send_f, [])
    if m - warm:
        call([], recv_f)
    for i in range(m - warm):
        prog.append(("F", 0)), call(send_f, recv_b), prog.append(("B", 0))
        call(send_b, [] if i == m - warm - 1 else recv_f)
    for _ in range(warm):
        call([], recv_b), prog.append(("B", 0)), call(send_b, [])
    return prog


def _interleaved(d: int, p: int, v: int, m: int) -> list[Op]:
    first, last, nxt, prv = d == 0, d == p - 1, (d + 1) % p, (d - 1) % p
    prog: list[Op] = []

    def call(sends, recvs):
        if sends or recvs:
            prog.append(("X", sends, recvs))

    def fwd_chunk(k: int) -> int:
        return (k % (p * v)) // p

    def bwd_chunk(k: int) -> int:
        return v - 1 - fwd_chunk(k)

    total = m * v
    all_warm = m == p
    warm = total if all_warm else min(2 * (p - d - 1) + (v - 1) * p, total)
    call([], [] if first else [("F", prv)])
    for k in range(warm):
        prog.append(("F", fwd_chunk(k)))
        sends = [] if last and fwd_chunk(k) == v - 1 else [("F", nxt)]
        recv_prev = not (first and fwd_chunk(k + 1) == 0) and k != total - 1
        recvs = [("F", prv)] if recv_prev else []
        if k == warm - 1 and not all_warm and not last:
            recvs.append(("B", nxt))
        call(sends, recvs)
    for k in range(total - warm):
        fk = k + warm
        prog.append(("F", fwd_chunk(fk))), prog.append(("B", bwd_chunk(k)))
        sends = ([] if last and fwd_chunk(fk) == v - 1 else [("F", nxt)])
        sends += [] if first and bwd_chunk(k) == 0 else [("B", prv)]
        recv_prev = fwd_chunk(fk - (p - 1)) != v - 1 if first else True
        recv_next = bwd_chunk(k - (p - 1)) != 0 if last else True
        recv_prev = recv_prev and k != total - warm - 1
        call(sends, ([("F", prv)] if recv_prev else []) + ([("B", nxt)] if recv_next else []))
    if all_warm and not last:
        call([], [("B", nxt)])
    for k in range(total - warm, total):
        prog.append(("B", bwd_chunk(k)))
        recv_next = not (last and bwd_chunk(k + 1) == v - 1) and k != total - 1
        call([] if first and bwd_chunk(k) == 0 else [("B", prv)], [("B", nxt)] if recv_next else [])
    return prog


def programs(p: int, v: int, m: int) -> list[list[Op]]:
    """Each device's program for `m` micro-batches on `p` devices of `v` chunks each."""
    return [_interleaved(d, p, v, m) if v > 1 else _one_f_one_b(d, p, m) for d in range(p)]


def messages_sent(p: int, v: int, m: int) -> list[int]:
    """Activation and gradient messages each device sends in one step."""
    return [sum(len(op[1]) for op in prog if op[0] == "X") for prog in programs(p, v, m)]


def makespan(p: int, v: int, m: int, forward_s: float, backward_s: float, message_s: float,
             extra: Callable[[int, str, int], float] | None = None) -> float:
    """Seconds from the first forward to the last backward. `forward_s`/`backward_s`: one chunk of
    one micro-batch; `extra(device, "F"|"B", chunk)`: seconds added to that op (embedding, head)."""
    progs = programs(p, v, m)
    sends, recvs = defaultdict(list), defaultdict(list)
    for d, prog in enumerate(progs):
        for i, op in enumerate(prog):
            if op[0] == "X":
                for kind, peer in op[1]:
                    sends[(kind, d, peer)].append((d, i))
                for kind, peer in op[2]:
                    recvs[(kind, peer, d)].append((d, i))
    partners = defaultdict(list)
    for channel in set(sends) | set(recvs):
        assert len(sends[channel]) == len(recvs[channel]), f"unmatched messages on {channel}"
        for s, r in zip(sends[channel], recvs[channel]):  # NCCL orders a pair's messages
            partners[s].append(r), partners[r].append(s)
    posted: dict[tuple[int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    while any(pos[d] < len(progs[d]) for d in range(p)):
        moved = False
        for d in range(p):
            while pos[d] < len(progs[d]):
                op = progs[d][pos[d]]
                if op[0] == "X":
                    posted[(d, pos[d])] = clock[d]
                    peers = partners[(d, pos[d])]
                    if any(q not in posted for q in peers):
                        break  # blocked until every peer posts its side
                    clock[d] = max([clock[d]] + [posted[q] for q in peers]) + message_s * max(len(op[1]), len(op[2]))
                else:
                    clock[d] += (forward_s if op[0] == "F" else backward_s) + (extra(d, op[0], op[1]) if extra else 0.0)
                pos[d] += 1
                moved = True
        assert moved, "the programs deadlock"
    return max(clock)


def replay(pp: int, vpp: int, gas: int, times) -> float:
    """Makespan of one step's micro-batches for per-stage times `times` (objects with compute_mb,
    tp_comm_mb, backward_mb and pp_comm_mb, as planner.cost_model.StageTime): a middle stage's body
    split evenly over its chunks, the first and last stages' extra (embedding, head) on the model's
    first and last chunk, one message the priced pipeline traffic over its 2 vpp boundaries."""
    middle = times[1] if pp > 2 else times[-1]
    body = middle.compute_mb + middle.tp_comm_mb
    backward_share = middle.backward_mb / middle.compute_mb
    message = times[1].pp_comm_mb / (2 * vpp) if pp > 2 else times[0].pp_comm_mb / (2 * vpp - 1)
    ends = {0: times[0].compute_mb + times[0].tp_comm_mb - body,
            pp - 1: times[-1].compute_mb + times[-1].tp_comm_mb - body}

    def extra(device: int, kind: str, chunk: int) -> float:
        at_end = (device == 0 and chunk == 0) or (device == pp - 1 and chunk == vpp - 1)
        share = backward_share if kind == "B" else 1 - backward_share
        return ends.get(device, 0.0) * share if at_end else 0.0

    return makespan(pp, vpp, gas, body * (1 - backward_share) / vpp, body * backward_share / vpp, message, extra)
