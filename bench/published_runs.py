"""Published, public GPU training measurements: the published-runs bench's reference rows.

Every row is a measurement somebody published for a named model, GPU, layout and engine, copied as
printed (no number here is derived unless its `notes` say so). Each row records where it was read
(`url`, `where`) and the FLOP convention behind its metric (`metric_note`). Fields a source does not
state are listed in the row's `unstated`, with the value chosen and why in `notes`; a consumer that
wants only fully stated layouts drops rows whose `unstated` is not empty.

Sources (all read from the addresses below; GitHub files at the commit given):

* narayanan2021 -- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC'21, arXiv:2104.04473, Table 1. Numbers as in the paper's table, also
  published as the Megatron-LM README image
  https://github.com/NVIDIA/Megatron-LM/blob/fd5cfec0ba60c5bc14a9667aa9cab10cf9682f40/images/cases_april2021.png
  (read; identical to the transcription in tests/paper_tables.py, MEGATRON_TABLE1). Micro-batch,
  interleaving, DDP and recompute flags from the authors' script
  https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/examples/academic_paper_scripts/sc21/run_table_1.sh
  and CONFIG.sh beside it (--fp16, seq 2048).
* korthikanti2022 -- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", MLSys'23, arXiv:2205.05198, Tables 3 and 5, section 6.3 and the abstract. Table 3/5 values
  as transcribed in tests/paper_tables.py (KORTHIKANTI_TABLE3/5, KORTHIKANTI_530B_DP8); the MFU/HFU
  pairs were re-read this session in the Megatron-LM README before commit f2e5db40 (README.md at
  fd5cfec0ba60c5bc14a9667aa9cab10cf9682f40, "measured using a data parallel size of one"), the
  54.2% / 42.1% at 2240 GPUs in the abstract (https://ar5iv.labs.arxiv.org/html/2205.05198).
* bloom2022 -- BigScience, BLOOM-176B training (tr11), github bigscience-workshop/bigscience at
  9e64edec2ad1fb9263bf39ba616a84ff64b4d947: train/tr11-176B-ml/README.md (model, layout),
  tr11-176B-ml.slurm (flags), chronicles.md (production throughput, 2022-03-18),
  chronicles-prequel.md (topology benchmarks, "Rebalancing layers", 02-28).
* llmfoundry -- MosaicML llm-foundry, "MPT Training Benchmarks",
  https://github.com/mosaicml/llm-foundry/blob/8c8dd48f72168c5d51e2f7b151595892a8fba43d/scripts/train/benchmarking/README.md
  (model shapes from scripts/train/yamls/pretrain/mpt-*.yaml; peak FLOP/s from Composer's
  GPU_AVAILABLE_FLOPS, which collect_results.py imports).
* torchtitan -- PyTorch torchtitan (Liang et al., "TorchTitan", arXiv:2410.06511):
  docs/performance.md at 3faaa1a0dee68ce028400e3dafd1735d152cb4f8 (64 A100 and 128 H100 runs, 2024),
  benchmarks/llama3_h100_202412_torchtitan.md and benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md
  at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a; configs (seq_len, AC mode) from
  train_configs/*.toml at 3faaa1a0, 9dec370a and 820504e2; model shapes from
  torchtitan/models/llama/__init__.py and model.py at 3faaa1a0.
* fmsfsdp -- IBM/PyTorch "Maximizing training throughput using PyTorch FSDP" (pytorch.org blog,
  2024-03-13), tables in
  https://github.com/foundation-model-stack/fms-fsdp/blob/5e522b4c4f8a5f080717e714fee7622414dd6b63/README.md
  (the eager, pre-torch.compile version); shapes from fms_fsdp/utils/config_utils.py, seq 4096 and
  batch size from fms_fsdp/config/training.py.
* megatroncore2024 -- the Megatron-LM README's weak-scaling table on H100s (Megatron-Core r0.8.0),
  https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4/images/model_table.png
  (read; the README text beside it states vocab, sequence and the overlap flags). FLOP convention from
  megatron/training/training.py at tag core_r0.8.0. Listed, not priced: see bench/published_bench.py
  UNPRICED_ENGINES.

    python -m bench.published_runs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPUS = ("a100-40g", "a100-80g", "h100-80g", "h200-141g")
# Cards a row names in its notes that its `gpu` preset only approximates
OFF_PRESET_CARDS = {"Grand Teton H100": "a 500 W H100 with 96 GB HBM2e (Grand Teton), not the 700 W H100 SXM of h100-80g"}
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp8")


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement. Metrics are as printed; None where the source printed none."""

    source: str
    cite: str
    where: str
    url: str
    # model shape
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq: int
    activation: str  # "gelu" (GPT-style 4h MLP) or "swiglu" (Llama-style)
    tied_embeddings: bool | None
    # hardware
    gpu: str
    gpus: int
    # layout
    tp: int
    pp: int
    dp: int
    vpp: int
    cp: int
    sp: bool
    zero: int  # 0-3; Megatron distributed optimizer = 1, FSDP FULL_SHARD = 3
    mbs: int
    gbs: int  # sequences per optimizer step
    recompute: str
    dtype: str
    engine: str
    # measured, as published
    metric_note: str
    tflops_per_gpu: float | None = None
    mfu: float | None = None  # fraction
    hfu: float | None = None  # fraction, where the source prints it beside the MFU
    tokens_per_s_per_gpu: float | None = None
    step_s: float | None = None  # seconds per optimizer step, where printed
    memory_gib: float | None = None  # per GPU, only where published
    notes: str = ""
    unstated: tuple[str, ...] = ()  # layout fields the source does not state (see notes)
    ddp: str | None = None  # Megatron-LM 2021's --DDP-impl: "torch" (PyTorch DDP) or "local" (Megatron's own)

    def __post_init__(self) -> None:
        problems = [msg for ok, msg in self._checks() if not ok]
        if problems:
            raise ValueError(f"{self.source} {self.name} {self.gpus} GPUs: " + "; ".join(problems))

    def _checks(self) -> list[tuple[bool, str]]:
        metrics = (self.tflops_per_gpu, self.mfu, self.tokens_per_s_per_gpu, self.step_s)
        return [
            (self.tp * self.pp * self.dp * self.cp == self.gpus, "tp*pp*dp*cp != gpus"),
            (self.gbs % (self.dp * self.mbs) == 0, "gbs not a multiple of dp*mbs"),
            (self.gpu in GPUS, f"unknown gpu {self.gpu}"),
            (self.recompute in RECOMPUTE, f"unknown recompute {self.recompute}"),
            (self.dtype in DTYPES, f"unknown dtype {self.dtype}"),
            (0 <= self.zero <= 3, "zero outside 0-3"),
            (self.heads % self.kv_heads == 0, "heads not a multiple of kv_heads"),
            (any(m is not None for m in metrics), "no metric"),
        ]

    @property
    def off_preset(self) -> str:
        """Why no preset is the card this row ran on ("" where `gpu` is it)."""
        return next((why for card, why in OFF_PRESET_CARDS.items() if card in self.notes), "")

    @property
    def gas(self) -> int:
        """Micro-batches per data-parallel rank per step."""
        return self.gbs // (self.dp * self.mbs)

    @property
    def layout(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"vpp{self.vpp}"] * (self.vpp > 1) + [f"cp{self.cp}"] * (self.cp > 1) + ["sp"] * self.sp
        return " ".join(parts + [f"z{self.zero}", f"mbs{self.mbs}", f"gbs{self.gbs}", self.recompute, self.dtype])


# ------------------------------------------------------------------------------------------------
# model shapes
# ------------------------------------------------------------------------------------------------

def _shape(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           activation: str, tied: bool | None) -> dict[str, Any]:
    return {"name": name, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "ffn_hidden": ffn, "vocab": vocab, "activation": activation, "tied_embeddings": tied}


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int) -> dict[str, Any]:
    """Megatron/BLOOM/MPT GPT block: MHA, 4h GeLU MLP, input embedding tied to the output layer."""
    return _shape(name, layers, hidden, heads, heads, 4 * hidden, vocab, "gelu", True)


# MPT (llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml): d_model, n_heads, n_layers.
MPT_SIZES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
             "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
             "70b": (8192, 64, 80)}
MPT_VOCAB = 50368


def _mpt(size: str) -> dict[str, Any]:
    hidden, heads, layers = MPT_SIZES[size]
    return _gpt(f"mpt-{size}", layers, hidden, heads, MPT_VOCAB)


# Llama shapes as torchtitan (3faaa1a0) and fms-fsdp build them: FFN = multiple_of-rounded
# int(ffn_dim_multiplier * int(8h/3)); Llama 3 vocab 128256 (tiktoken), Llama 2 32000; untied.
LLAMA = {
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256),
    "llama3.1-405b": (126, 16384, 128, 8, 53248, 128256),
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama2-34b": (48, 8192, 64, 8, 22016, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000),
}


def _llama(name: str) -> dict[str, Any]:
    layers, hidden, heads, kv, ffn, vocab = LLAMA[name]
    return _shape(name, layers, hidden, heads, kv, ffn, vocab, "swiglu", False)


# ------------------------------------------------------------------------------------------------
# 1. Narayanan et al. 2021, Table 1 (A100 80GB, Selene)
# ------------------------------------------------------------------------------------------------

NARAYANAN_CITE = ("D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, "
                  "D. Vainbrand, P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia. "
                  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM. "
                  "SC'21, arXiv:2104.04473")
NARAYANAN_URL = ("https://arxiv.org/abs/2104.04473 ; layout: https://github.com/NVIDIA/Megatron-LM/blob/"
                 "d98e8a64ddf34856e74b24714e3bedb2f5a39553/examples/academic_paper_scripts/sc21/run_table_1.sh")
NARAYANAN_METRIC = ("TFLOP/s per GPU by the paper's eq. (3), 96 B s l h^2 (1 + s/6h + V/16lh) per iteration: "
                    "GEMM FLOPs only, counting the recomputed forward (full recompute, i.e. HFU-like), "
                    "end-to-end (data loading, optimizer, logging included); peak 312 TFLOP/s")

# (params label, layers, hidden, heads, tp, pp, gpus, gbs, mbs, interleaved chunks, DDP, TFLOP/s)
NARAYANAN_TABLE1 = (
    ("1.7b", 24, 2304, 24, 1, 1, 32, 512, 16, 1, "torch", 137),
    ("3.6b", 30, 3072, 32, 2, 1, 64, 512, 16, 1, "torch", 138),
    ("7.5b", 36, 4096, 32, 4, 1, 128, 512, 16, 1, "torch", 142),
    ("18.4b", 40, 6144, 48, 8, 1, 256, 1024, 8, 1, "torch", 135),
    ("39.1b", 48, 8192, 64, 8, 2, 512, 1536, 4, 1, "local", 138),
    ("76.1b", 60, 10240, 80, 8, 4, 1024, 1792, 2, 3, "local", 140),
    ("145.6b", 80, 12288, 96, 8, 8, 1536, 2304, 2, 2, "local", 148),
    ("310.1b", 96, 16384, 128, 8, 16, 1920, 2160, 1, 2, "local", 155),
    ("529.6b", 105, 20480, 128, 8, 35, 2520, 2520, 1, 3, "local", 163),
    ("1008.0b", 128, 25600, 160, 8, 64, 3072, 3072, 1, 1, "local", 163),
)


def _narayanan(row: tuple) -> PublishedRun:
    label, layers, hidden, heads, tp, pp, gpus, gbs, mbs, chunks, ddp, tflops = row
    return PublishedRun(
        source="narayanan2021", cite=NARAYANAN_CITE, url=NARAYANAN_URL,
        where=f"Table 1, row {label} (layout: run_table_1.sh MODEL_SIZE case)",
        **_gpt(f"gpt-{label}", layers, hidden, heads, 51200), seq=2048, gpu="a100-80g", gpus=gpus,
        tp=tp, pp=pp, dp=gpus // (tp * pp), vpp=chunks, cp=1, sp=False, zero=0, mbs=mbs, gbs=gbs,
        recompute="full", dtype="fp16", engine="megatron-2021", metric_note=NARAYANAN_METRIC,
        tflops_per_gpu=float(tflops), ddp=ddp,
        notes=(f"DDP impl '{ddp}' (torch = PyTorch DDP overlapping its bucketed all-reduce; local = Megatron's "
               "own, one all-reduce after the last backward). Recompute: --activations-checkpoint-method "
               "uniform (every layer). Interleaving from --num-layers-per-virtual-pipeline-stage; the 1T row "
               "has none in the script although section 5.1 says interleaving is used. Vocab 51200, "
               "seq 2048, --fp16 (CONFIG.sh). Same rows as tests/paper_tables.py MEGATRON_TABLE1."),
    )


# ------------------------------------------------------------------------------------------------
# 2. Korthikanti et al. 2022, Tables 3 and 5 (A100 80GB, Selene; no data parallelism)
# ------------------------------------------------------------------------------------------------

KORTHIKANTI_CITE = ("V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro. "
                    "Reducing Activation Recomputation in Large Transformer Models. MLSys'23, arXiv:2205.05198")
KORTHIKANTI_URL = ("https://arxiv.org/abs/2205.05198 ; MFU/HFU also in https://github.com/NVIDIA/Megatron-LM/blob/"
                   "fd5cfec0ba60c5bc14a9667aa9cab10cf9682f40/README.md")
KORTHIKANTI_METRIC = ("MFU = eq. (7) 72 B L s h^2 (1 + s/6h + v/12hL) per iteration over (time x GPUs x 312 TFLOP/s), "
                      "recompute not counted; HFU = eq. (8) 72 B L s h^2 (1 + s/3h + v/12hL), counting the "
                      "selective recompute. step_s = Table 5 end-to-end iteration time")

# (name, layers, hidden, heads, pp, gpus, gbs=mbs*m, mbs, interleave, full-recompute s, present s, MFU, HFU)
KORTHIKANTI_TABLE5 = (
    ("gpt-22b", 48, 6144, 64, 1, 8, 4, 4, 1, 1.42, 1.10, 0.415, 0.437),
    ("gpt-175b", 96, 12288, 96, 8, 64, 64, 1, 3, 18.13, 13.75, 0.514, 0.528),
    ("gpt-530b", 105, 20480, 128, 35, 280, 280, 1, 3, 49.05, 37.83, 0.560, 0.570),
    ("gpt-1t", 128, 25600, 160, 64, 512, 512, 1, 1, 94.42, 71.49, 0.563, 0.570),
)
KORTHIKANTI_NOTES = ("tp 8 for all (section 6); interleaving with 3 stages for 175B and 530B only; vocab 51200, "
                     "seq 2048. dtype not stated beyond 'mixed precision' (bf16 assumed). Present work = "
                     "sequence parallelism + selective recompute; baseline = full recompute, no SP.")


def _korthikanti_pair(row: tuple) -> list[PublishedRun]:
    name, layers, hidden, heads, pp, gpus, gbs, mbs, vpp, full_s, present_s, mfu, hfu = row
    common = dict(source="korthikanti2022", cite=KORTHIKANTI_CITE, url=KORTHIKANTI_URL,
                  **_gpt(name, layers, hidden, heads, 51200), seq=2048, gpu="a100-80g", gpus=gpus, tp=8,
                  pp=pp, dp=1, vpp=vpp, cp=1, zero=0, mbs=mbs, gbs=gbs, dtype="bf16", engine="megatron-core",
                  metric_note=KORTHIKANTI_METRIC, unstated=("dtype",))
    label = name.removeprefix("gpt-").upper()
    return [
        PublishedRun(**common, where=f"Table 5 (config Table 3), {label}, 'Present Work'", sp=True,
                     recompute="selective", step_s=present_s, mfu=mfu, hfu=hfu, notes=KORTHIKANTI_NOTES),
        PublishedRun(**common, where=f"Table 5 (config Table 3), {label}, 'Full Recompute'", sp=False,
                     recompute="full", step_s=full_s, notes=KORTHIKANTI_NOTES + " Only the iteration time is "
                     "printed for the baseline."),
    ]


def _korthikanti_dp8() -> list[PublishedRun]:
    """Section 6.3 / abstract: the 530B model with 8-way data parallelism on 2240 GPUs."""
    common = dict(source="korthikanti2022", cite=KORTHIKANTI_CITE, url=KORTHIKANTI_URL,
                  **_gpt("gpt-530b", 105, 20480, 128, 51200), seq=2048, gpu="a100-80g", gpus=2240, tp=8,
                  pp=35, dp=8, vpp=3, cp=1, zero=0, mbs=1, gbs=2240, dtype="bf16", engine="megatron-core",
                  metric_note=KORTHIKANTI_METRIC, unstated=("dtype", "zero", "vpp"))
    notes = (KORTHIKANTI_NOTES + " Table 3's 530B layout with batch x8 (section 6.3); whether the distributed "
             "optimizer was on is not stated (zero 0 assumed), interleaving assumed as in Table 3.")
    return [
        PublishedRun(**common, where="Section 6.3 and abstract, 530B on 2240 GPUs, present work", sp=True,
                     recompute="selective", mfu=0.542, step_s=39.15, notes=notes),
        PublishedRun(**common, where="Abstract, 530B on 2240 GPUs, 'using recomputation'", sp=False,
                     recompute="full", mfu=0.421, notes=notes + " Abstract: 42.1% MFU with recomputation."),
    ]


# ------------------------------------------------------------------------------------------------
# 3. BLOOM-176B (BigScience tr11; 48 nodes of 8 A100 80GB, Jean Zay; Megatron-DeepSpeed)
# ------------------------------------------------------------------------------------------------

BLOOM_CITE = ("BigScience Workshop. BLOOM: A 176B-Parameter Open-Access Multilingual Language Model "
              "(Le Scao et al. 2022, arXiv:2211.05100); training logs and README of tr11-176B-ml")
BLOOM_BASE = ("https://github.com/bigscience-workshop/bigscience/blob/9e64edec2ad1fb9263bf39ba616a84ff64b4d947/"
              "train/tr11-176B-ml/")
BLOOM_METRIC = ("TFLOP/s per GPU as Megatron-DeepSpeed logs it after PR 251: Narayanan eq. (3) with the "
                "activation-checkpoint factor 4, i.e. counting the recomputed forward ('hardware TFLOPs', "
                "README 'Throughput'); step_s = 'elapsed time per iteration'")
BLOOM_NOTES = ("70 layers, hidden 14336, vocab padded to 250880 (--pad-vocab-size-to), seq 2048, ALiBi, "
               "embedding LayerNorm, GeLU, tied embeddings; bf16 with DeepSpeed's BF16_Optimizer (its own "
               "ZeRO-1, fp32 gradient accumulation; ZERO_STAGE=0 in the config); --checkpoint-activations; "
               "--pp-partition-method 'type:transformer|embedding' (embeddings take a pipeline slot).")


def _bloom(heads: int, **kw: Any) -> PublishedRun:
    return PublishedRun(source="bloom2022", cite=BLOOM_CITE, **_gpt("bloom-176b", 70, 14336, heads, 250880),
                        seq=2048, gpu="a100-80g", gpus=384, pp=12, vpp=1, cp=1, sp=False, zero=1, gbs=2048,
                        recompute="full", dtype="bf16", engine="megatron-deepspeed", metric_note=BLOOM_METRIC,
                        **kw)


def _bloom_rows() -> list[PublishedRun]:
    prequel = ("'Rebalancing layers', table 'NHIDDEN=14336; NLAYERS=70; Model size: 176B', 02-28, row ")
    memory = (" Mem: nvidia-smi reading of one node, printed 'GB' (allocator reserve and CUDA context "
              "included). Iteration-2 snapshot of a benchmark run, not the production run.")
    return [
        _bloom(112, where="chronicles.md 2022-03-18 (149-150 TFLOPs at GBS=2048) and its iteration 12695 log line",
               url=BLOOM_BASE + "chronicles.md", tp=4, dp=8, mbs=2, tflops_per_gpu=149.02, step_s=105.22,
               notes=BLOOM_NOTES + " Production run, 112 heads (README 'Architecture', 'Replica setup')."),
        _bloom(112, where=prequel + "DP 8 TP 4 PP 12 MBS 2 NHEADS 112", url=BLOOM_BASE + "chronicles-prequel.md",
               tp=4, dp=8, mbs=2, tflops_per_gpu=150.05, step_s=104.50, memory_gib=59.0,
               notes=BLOOM_NOTES + memory),
        _bloom(64, where=prequel + "DP 8 TP 4 PP 12 MBS 2 NHEADS 64", url=BLOOM_BASE + "chronicles-prequel.md",
               tp=4, dp=8, mbs=2, tflops_per_gpu=153.68, step_s=102.03, memory_gib=59.0,
               notes=BLOOM_NOTES + memory),
        _bloom(64, where=prequel + "DP 8 TP 4 PP 12 MBS 4 NHEADS 64", url=BLOOM_BASE + "chronicles-prequel.md",
               tp=4, dp=8, mbs=4, tflops_per_gpu=153.33, step_s=102.27, memory_gib=73.0,
               notes=BLOOM_NOTES + memory),
        _bloom(64, where=prequel + "DP 4 TP 8 PP 12 MBS 2 NHEADS 64", url=BLOOM_BASE + "chronicles-prequel.md",
               tp=8, dp=4, mbs=2, tflops_per_gpu=128.92, step_s=121.63, memory_gib=40.0,
               notes=BLOOM_NOTES + memory),
    ]


# ------------------------------------------------------------------------------------------------
# 4. MosaicML llm-foundry MPT benchmarks (PyTorch FSDP via Composer)
# ------------------------------------------------------------------------------------------------

MOSAIC_CITE = "MosaicML. llm-foundry, MPT Training Benchmarks (scripts/train/benchmarking/README.md), 2023-2024"
MOSAIC_URL = ("https://github.com/mosaicml/llm-foundry/blob/8c8dd48f72168c5d51e2f7b151595892a8fba43d/"
              "scripts/train/benchmarking/README.md")
MOSAIC_PEAK = {"a100-80g": 312.0, "a100-40g": 312.0, "h100-80g": 989.5}
MOSAIC_NOTES = ("MPT: biases on, LayerNorm with bias ('low_precision_layernorm'), learned positional "
                "embedding of max_seq_len x d_model, tied embeddings, vocab 50368; NumParams in the table "
                "matches this count exactly (70b: 64,862,437,376). Activation checkpointing True = every "
                "MPTBlock (full). Sharding FULL_SHARD = zero 3, SHARD_GRAD_OP = zero 2; FSDP1 under "
                "Composer. Precision {prec} with FSDP mixed precision '{mp}' (PURE: params, gradient reduce "
                "and buffers in bf16; DEFAULT: fp32 gradient reduce). Attention kernel not stated per row "
                "(submit_benchmarks.py defaulted to attn_impl 'triton' when the A100/H100 tables were "
                "committed, Oct 2023; the large-scale H100 rows, Jan 2024, installed flash-attn 2).")

# README sections: key -> (heading, GPU preset)
MOSAIC_SECTIONS = {
    "h100-large": ("H100 80GB BF16 (Large Scale, >= 128 GPUs)", "h100-80g"),
    "h100": ("H100 80GB BF16", "h100-80g"),
    "h100-fp8": ("H100 80GB FP8", "h100-80g"),
    "a100-80": ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "a100-80g"),
    "a100-40": ("A100 40GB with 1600 Gbps node-node interconnect (RoCE)", "a100-40g"),
}
# (section, size, seq, GPUs, MFU %, HFU %, mbs, grad accum, gbs, T/s/GPU, precision, sharding, act. ckpt);
# FSDP mixed precision is PURE for precision "bf16" and DEFAULT for "amp_*" in every row below.
MOSAIC_TABLE = (
    ("h100-large", "70b", 2048, 512, 41.25, 55.0, 8, 1, 4096, 1007, "amp_bf16", "FULL_SHARD", True),
    ("h100-large", "70b", 2048, 128, 43.36, 57.81, 8, 1, 1024, 1058, "amp_bf16", "FULL_SHARD", True),
    ("h100-large", "30b", 2048, 128, 41.85, 55.8, 8, 1, 1024, 2199, "amp_bf16", "FULL_SHARD", True),
    ("h100-large", "13b", 2048, 512, 41.12, 54.83, 16, 1, 8192, 4952, "amp_bf16", "FULL_SHARD", True),
    ("h100-large", "7b", 2048, 512, 42.2, 42.2, 6, 1, 3072, 9670, "amp_bf16", "FULL_SHARD", False),
    ("h100-large", "7b", 2048, 128, 45.71, 45.71, 6, 1, 768, 10475, "amp_bf16", "FULL_SHARD", False),
    ("h100-large", "3b", 2048, 128, 42.43, 42.43, 8, 1, 1024, 23422, "amp_bf16", "SHARD_GRAD_OP", False),
    ("h100-large", "1b", 2048, 512, 36.65, 36.65, 12, 1, 6144, 39837, "amp_bf16", "SHARD_GRAD_OP", False),
    ("h100", "30b", 2048, 8, 38.11, 50.82, 3, 21, 504, 2002, "amp_bf16", "FULL_SHARD", True),
    ("h100", "13b", 4096, 8, 41.6, 55.47, 10, 3, 240, 4717, "amp_bf16", "FULL_SHARD", True),
    ("h100", "7b", 8192, 8, 37.14, 49.52, 8, 2, 128, 6935, "amp_bf16", "FULL_SHARD", True),
    ("h100", "7b", 2048, 8, 46.44, 46.44, 6, 1, 48, 10643, "amp_bf16", "FULL_SHARD", False),
    ("h100-fp8", "3b", 2048, 8, 27.7, 27.7, 10, 6, 480, 30586, "amp_fp8", "FULL_SHARD", False),
    ("a100-80", "70b", 2048, 64, 53.33, 71.1, 8, 4, 2048, 410, "bf16", "FULL_SHARD", True),
    ("a100-80", "30b", 2048, 8, 55.3, 73.74, 3, 21, 504, 916, "amp_bf16", "FULL_SHARD", True),
    ("a100-80", "13b", 2048, 8, 59.57, 59.57, 2, 3, 48, 2262, "amp_bf16", "FULL_SHARD", False),
    ("a100-80", "7b", 2048, 8, 64.23, 64.23, 6, 2, 96, 4641, "amp_bf16", "FULL_SHARD", False),
    ("a100-80", "1b", 2048, 8, 59.86, 59.86, 14, 4, 448, 20513, "amp_bf16", "FULL_SHARD", False),
    ("a100-80", "125m", 2048, 8, 44.79, 44.79, 40, 2, 640, 142830, "amp_bf16", "FULL_SHARD", False),
    ("a100-40", "70b", 2048, 128, 48.91, 65.21, 4, 1, 512, 376, "bf16", "FULL_SHARD", True),
    ("a100-40", "30b", 2048, 128, 52.25, 69.66, 6, 1, 768, 865, "bf16", "FULL_SHARD", True),
    ("a100-40", "13b", 2048, 128, 51.93, 69.24, 16, 1, 2048, 1972, "bf16", "FULL_SHARD", True),
    ("a100-40", "7b", 2048, 64, 50.73, 67.64, 18, 1, 1152, 3665, "bf16", "FULL_SHARD", True),
    ("a100-40", "3b", 2048, 64, 55.94, 55.94, 6, 1, 384, 9736, "bf16", "FULL_SHARD", False),
    ("a100-40", "1b", 2048, 8, 56.23, 56.23, 8, 8, 512, 19271, "bf16", "FULL_SHARD", False),
)


def _mosaic_metric(gpu: str, precision: str) -> str:
    peak = MOSAIC_PEAK[gpu] * (2 if "fp8" in precision else 1)
    return ("MFU = (6 N + 12 n_layers d_model seq) x tokens/s / peak, N = all parameters (embeddings included), "
            f"recompute not counted; HFU = 4/3 of it when activation checkpointing is on; peak {peak:g} "
            "TFLOP/s (Composer GPU_AVAILABLE_FLOPS: A100 312, H100 SXM 1979/2 bf16, 3958/2 fp8). "
            "tokens_per_s_per_gpu = 'Throughput (T/s/GPU)'")


def _mosaic(row: tuple) -> PublishedRun:
    key, size, seq, gpus, mfu, hfu, mbs, gas, gbs, tps, prec, shard, ac = row
    section, gpu = MOSAIC_SECTIONS[key]
    mixed = "PURE" if prec == "bf16" else "DEFAULT"
    assert gbs == mbs * gas * gpus, row
    return PublishedRun(
        source="llmfoundry", cite=MOSAIC_CITE, url=MOSAIC_URL,
        where=f"section '{section}', row {size} / SeqLen {seq} / {gpus} GPUs",
        **_mpt(size), seq=seq, gpu=gpu, gpus=gpus, tp=1, pp=1, dp=gpus, vpp=1, cp=1, sp=False,
        zero=3 if shard == "FULL_SHARD" else 2, mbs=mbs, gbs=gbs, recompute="full" if ac else "none",
        dtype="fp8" if "fp8" in prec else "bf16", engine="pytorch-fsdp", metric_note=_mosaic_metric(gpu, prec),
        mfu=mfu / 100, hfu=hfu / 100, tokens_per_s_per_gpu=float(tps),
        notes=MOSAIC_NOTES.format(prec=prec, mp=mixed),
    )


# ------------------------------------------------------------------------------------------------
# 5. torchtitan (FSDP2, TP, PP, CP; PyTorch-native)
# ------------------------------------------------------------------------------------------------

TITAN_CITE = ("W. Liang, T. Liu, L. Wright, W. Constable, A. Gu, C.-C. Huang, I. Zhang, W. Feng, H. Huang, "
              "J. Wang, S. Purandare, G. Nadathur, S. Idreos. TorchTitan: One-stop PyTorch native solution for "
              "production ready LLM pre-training. arXiv:2410.06511 (ICLR 2025); github pytorch/torchtitan")
TITAN_GH = "https://github.com/pytorch/torchtitan/blob/"
TITAN_HEAD = TITAN_GH + "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/benchmarks/"
TITAN_2024 = TITAN_GH + "3faaa1a0dee68ce028400e3dafd1735d152cb4f8/docs/performance.md"
TITAN_H100_2412 = TITAN_HEAD + "llama3_h100_202412_torchtitan.md"
TITAN_ASYNC_TP = TITAN_HEAD + "asyncTP_llama3_h100_2025-06_torchtitan.md"
TITAN_METRIC = ("tokens/s per GPU = tokens of the local batch / (step time x tp x pp x cp) (train.py); "
                "MFU = (6 N_no_embedding + 12 L h q s) x tokens/s / peak (utils.get_num_flop_per_token: "
                "flash recompute not counted, no causal discount), peak 312 (A100) / 989 (H100 SXM) TFLOP/s. "
                "Memory = peak max_reserved GiB (caching allocator)")
TITAN_H100_NOTE = ("TP rows: torchtitan's TP plan shards the norms with SequenceParallel (parallelize_llama.py "
                   "at 3faaa1a0), hence sp. GPU: Grand Teton H100 with 96 GB HBM2e at 500 W (lower TDP than "
                   "SXM; 94/95 GB in the 2024 doc); mapped to h100-80g, the nearest preset (memory > 80 GiB "
                   "possible). ")


def _titan(name: str, seq: int, gpu: str, gpus: int, lbs: int, where: str, url: str, **kw: Any) -> PublishedRun:
    """One torchtitan row; gbs = local batch x DP degree (torchtitan's local batch is per DP rank)."""
    dp = kw.pop("dp", gpus)
    mbs = kw.pop("mbs", lbs)
    return PublishedRun(source="torchtitan", cite=TITAN_CITE, where=where, url=url, **_llama(name), seq=seq,
                        gpu=gpu, gpus=gpus, dp=dp, mbs=mbs, gbs=lbs * dp, vpp=kw.pop("vpp", 1),
                        cp=kw.pop("cp", 1), tp=kw.pop("tp", 1), pp=kw.pop("pp", 1), sp=kw.pop("sp", False),
                        zero=3, engine="torchtitan", metric_note=TITAN_METRIC, **kw)


def _titan_a100() -> list[PublishedRun]:
    base = ("FSDP2 1D on 64 A100 80GB, bf16, eager (compile = false in the config), SDPA flash attention. "
            "'selective op' = op-level SAC policy (selective_ac_option 'op').")
    rows = [("llama3-8b", 8192, 1, "Llama 3, 8B / selective op", "selective", 2973, 0.582),
            ("llama3-70b", 8192, 1, "Llama 3, 70B / full", "full", 331, 0.517),
            ("llama2-13b", 4096, 2, "Llama 2, 13B / no", "none", 2162, 0.611),
            ("llama2-13b", 4096, 2, "Llama 2, 13B / selective op", "selective", 1904, 0.538),
            ("llama2-70b", 4096, 1, "Llama 2, 70B / batch 1 / selective op", "selective", 355, 0.508),
            ("llama2-70b", 4096, 2, "Llama 2, 70B / batch 2 / full", "full", 353, 0.505)]
    return [_titan(name, seq, "a100-80g", 64, lbs, f"'{table} performance numbers' row", TITAN_2024,
                   recompute=ac, dtype="bf16", tokens_per_s_per_gpu=float(tps), mfu=mfu, notes=base)
            for name, seq, lbs, table, ac, tps, mfu in rows]


def _titan_h100() -> list[PublishedRun]:
    t24 = "Table {n}, row '{row}'"
    cfg = "seq 8192 (train_configs/llama3_*.toml at 9dec370a); "
    return [
        _titan("llama3.1-405b", 8192, "h100-80g", 128, 2,
               "'Llama 3.1 performance numbers', row 405B / Optimizations None", TITAN_2024,
               dp=16, tp=8, sp=True, recompute="full", dtype="bf16", tokens_per_s_per_gpu=109.0, mfu=0.290,
               notes=TITAN_H100_NOTE + "FSDP 16 x TP 8 (sequence-parallel norms), local batch 2, "
               "global 32, seq 8192. MFU footnote: SXM peak used, so MFU is understated. Whether "
               "torch.compile was on for this row is not stated (the 405B config then had compile = true)."),
        _titan("llama3-8b", 8192, "h100-80g", 8, 2, t24.format(n=1, row="FSDP"), TITAN_H100_2412,
               recompute="selective", dtype="bf16", tokens_per_s_per_gpu=5762.0, memory_gib=82.4,
               notes=TITAN_H100_NOTE + cfg + "selective AC = op-level SAC; eager."),
        _titan("llama3-8b", 8192, "h100-80g", 8, 2, t24.format(n=1, row="FSDP + torch.compile"), TITAN_H100_2412,
               recompute="selective", dtype="bf16", tokens_per_s_per_gpu=6667.0, memory_gib=77.0,
               notes=TITAN_H100_NOTE + cfg + "selective AC = op-level SAC; torch.compile."),
        _titan("llama3-8b", 8192, "h100-80g", 128, 2, t24.format(n=3, row="FSDP"), TITAN_H100_2412,
               recompute="selective", dtype="bf16", tokens_per_s_per_gpu=5605.0, memory_gib=67.0,
               notes=TITAN_H100_NOTE + cfg + "selective AC = op-level SAC; eager."),
        _titan("llama3-8b", 65536, "h100-80g", 8, 1, t24.format(n=2, row="FSDP 4, CP 2"), TITAN_H100_2412,
               dp=4, cp=2, recompute="full", dtype="fp8", tokens_per_s_per_gpu=2540.0, memory_gib=84.2,
               notes=TITAN_H100_NOTE + "FSDP + CP + torch.compile + Float8 (Linear layers only; attention bf16)."),
        _titan("llama3-70b", 8192, "h100-80g", 256, 16, t24.format(n=4, row="2D"), TITAN_H100_2412,
               dp=32, tp=8, sp=True, recompute="full", dtype="fp8", tokens_per_s_per_gpu=829.0, memory_gib=71.9,
               notes=TITAN_H100_NOTE + cfg + "FSDP 32 x TP 8 (sequence-parallel norms), torch.compile, Float8 "
               "Linear layers."),
        _titan("llama3.1-405b", 8192, "h100-80g", 512, 32, t24.format(n=5, row="1F1B"), TITAN_H100_2412,
               dp=8, tp=8, pp=8, mbs=4, sp=True, recompute="full", dtype="fp8", tokens_per_s_per_gpu=100.0,
               memory_gib=82.5, notes=TITAN_H100_NOTE + cfg + "FSDP 8 x TP 8 x PP 8, torch.compile, Float8, "
               "async TP. mbs 4 = local batch 32 over the default microbatch count (= pipeline stages, 8; "
               "config_manager.py at 9dec370a).", unstated=("mbs",)),
        _titan("llama3-70b", 8192, "h100-80g", 256, 16, "Llama3 70b table, row 'None (bfloat16)', Vanilla TP",
               TITAN_ASYNC_TP, dp=32, tp=8, sp=True, recompute="full", dtype="bf16", tokens_per_s_per_gpu=597.3,
               notes=TITAN_H100_NOTE + "June 2025; FSDP 32 x TP 8, torch.compile, full AC, local batch 16; seq "
               "8192 from llama3_70b.toml at 820504e2."),
        _titan("llama3-8b", 8192, "h100-80g", 64, 12, "Llama3 8b table, row 'None (bfloat16)', Vanilla TP",
               TITAN_ASYNC_TP, dp=8, tp=8, sp=True, recompute="selective", dtype="bf16",
               tokens_per_s_per_gpu=4378.0, notes=TITAN_H100_NOTE + "June 2025; FSDP 8 x TP 8, torch.compile, "
               "per-op SAC, local batch 12; seq 8192 from llama3_8b.toml at 820504e2."),
    ]


# ------------------------------------------------------------------------------------------------
# 6. IBM fms-fsdp (PyTorch FSDP1, Llama 2 shapes, seq 4096)
# ------------------------------------------------------------------------------------------------

FMS_CITE = ("Team PyTorch at IBM and Team PyTorch at Meta. Maximizing training throughput using PyTorch FSDP. "
            "pytorch.org blog, 2024-03-13; github foundation-model-stack/fms-fsdp README")
FMS_URL = ("https://github.com/foundation-model-stack/fms-fsdp/blob/5e522b4c4f8a5f080717e714fee7622414dd6b63/"
           "README.md")
FMS_METRIC = ("MFU by the nanoGPT/PaLM method (6 N + 12 L H Q T per token, recompute not counted); HFU by the "
              "PyTorch FLOP counter (recompute counted); peak = theoretical dense bf16 of A100 / H100. "
              "tokens_per_s_per_gpu = 'Training Throughput tokens/sec/GPU'")
FMS_NOTES = ("Eager (this README version predates the torch.compile numbers), SDPA flash attention v2, bf16 "
             "mixed precision, batch size 2 per GPU, seq 4096. A100 80G: 128 GPUs, 400 Gbps; H100: 96 GPUs, "
             "800 Gbps. ")


def _fms(name: str, gpu: str, gpus: int, tps: int, mfu: float, hfu: float, full_ac: bool) -> PublishedRun:
    hsdp = name == "llama2-7b"
    where = (f"'Training throughput benchmarks' tables, row {name.removeprefix('llama2-')} "
             f"({'A100 80G' if gpu == 'a100-80g' else 'H100'} columns)")
    notes = FMS_NOTES + ("HSDP: FULL_SHARD inside each 8-GPU node, replicated across nodes (recorded as zero 3)."
                         if hsdp else "FSDP FULL_SHARD over all GPUs.")
    return PublishedRun(source="fmsfsdp", cite=FMS_CITE, where=where, url=FMS_URL, **_llama(name), seq=4096,
                        gpu=gpu, gpus=gpus, tp=1, pp=1, dp=gpus, vpp=1, cp=1, sp=False, zero=3, mbs=2,
                        gbs=2 * gpus, recompute="full" if full_ac else "none", dtype="bf16", engine="pytorch-fsdp",
                        metric_note=FMS_METRIC, tokens_per_s_per_gpu=float(tps), mfu=mfu, hfu=hfu, notes=notes)


def _fms_rows() -> list[PublishedRun]:
    return [_fms("llama2-7b", "a100-80g", 128, 3700, 0.57, 0.57, False),
            _fms("llama2-7b", "h100-80g", 96, 7500, 0.37, 0.37, False),
            _fms("llama2-34b", "a100-80g", 128, 700, 0.47, 0.64, True),
            _fms("llama2-34b", "h100-80g", 96, 1550, 0.32, 0.44, True),
            _fms("llama2-70b", "a100-80g", 128, 370, 0.50, 0.67, True),
            _fms("llama2-70b", "h100-80g", 96, 800, 0.34, 0.45, True)]


# ------------------------------------------------------------------------------------------------
# 7. Megatron-Core r0.8.0 on H100 (Megatron-LM README's weak-scaling table, 2024)
# ------------------------------------------------------------------------------------------------

MCORE_CITE = ("NVIDIA Megatron-LM README, 'Training Speed and Scalability' (Megatron-Core r0.8.0, H100 GPUs), "
              "github NVIDIA/Megatron-LM at f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, images/model_table.png")
MCORE_URL = ("https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4/"
             "images/model_table.png")
MCORE_METRIC = ("per-GPU TFLOP/s by Megatron's num_floating_point_operations (megatron/training/training.py at "
                "core_r0.8.0): 12 B s L h^2 (2 + s/h + ffn/h + V/(2 L h)) per iteration for MHA and a GeLU MLP, "
                "no recomputation counted; MFU = it / 989 TFLOP/s (bf16 dense)")
MCORE_NOTES = ("vocab 131,072, seq 4096 (README). --overlap-grad-reduce --overlap-param-gather (so the "
               "distributed optimizer: zero 1) and --tp-comm-overlap (so sequence parallelism) as the README "
               "states; micro-batch, interleaving and recomputation not stated (1, none, none here). Every size "
               "is 12 L h^2 + 2 V h parameters: a 4h MLP, untied embeddings.")
# (label, heads, hidden, layers, tp, pp, dp, batch, per-GPU TFLOP/s, MFU %), as in the table
MCORE_TABLE = (
    ("1.7b", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41), ("7.1b", 32, 4096, 30, 2, 1, 48, 192, 465.9, 47),
    ("16b", 48, 6144, 32, 4, 1, 48, 192, 489.1, 49), ("32b", 56, 7168, 48, 8, 1, 48, 192, 459.6, 46),
    ("70b", 64, 8192, 84, 8, 2, 48, 384, 419.7, 42), ("119b", 80, 10240, 92, 8, 4, 48, 768, 420.5, 43),
    ("177b", 96, 12288, 96, 8, 6, 48, 1152, 432.8, 44), ("314b", 128, 16384, 96, 8, 8, 48, 1536, 474.4, 48),
    ("462b", 144, 18432, 112, 8, 16, 48, 3072, 459.9, 47),
)
MCORE_VOCAB, MCORE_SEQ = 131072, 4096


def _mcore(row: tuple) -> PublishedRun:
    label, heads, hidden, layers, tp, pp, dp, batch, tflops, mfu = row
    return PublishedRun(
        source="megatroncore2024", cite=MCORE_CITE, where=f"model table, row {label.upper()}", url=MCORE_URL,
        **_shape(f"gpt-{label}", layers, hidden, heads, heads, 4 * hidden, MCORE_VOCAB, "gelu", False),
        seq=MCORE_SEQ, gpu="h100-80g", gpus=tp * pp * dp, tp=tp, pp=pp, dp=dp, vpp=1, cp=1, sp=tp > 1, zero=1,
        mbs=1, gbs=batch, recompute="none", dtype="bf16", engine="megatron-core-te", metric_note=MCORE_METRIC,
        tflops_per_gpu=tflops, mfu=mfu / 100, notes=MCORE_NOTES, unstated=("mbs", "vpp", "recompute"))


# ------------------------------------------------------------------------------------------------

def _all_rows() -> tuple[PublishedRun, ...]:
    rows: list[PublishedRun] = [_narayanan(r) for r in NARAYANAN_TABLE1]
    rows += [run for r in KORTHIKANTI_TABLE5 for run in _korthikanti_pair(r)] + _korthikanti_dp8()
    rows += _bloom_rows()
    rows += [_mosaic(r) for r in MOSAIC_TABLE]
    rows += _titan_a100() + _titan_h100()
    rows += _fms_rows()
    rows += [_mcore(r) for r in MCORE_TABLE]
    return tuple(rows)


ROWS: tuple[PublishedRun, ...] = _all_rows()


def _metric(run: PublishedRun) -> str:
    parts = [f"{run.tflops_per_gpu:g} TFLOP/s" if run.tflops_per_gpu else "",
             f"MFU {100 * run.mfu:.1f}%" if run.mfu else "",
             f"{run.tokens_per_s_per_gpu:g} tok/s" if run.tokens_per_s_per_gpu else "",
             f"{run.step_s:g} s/step" if run.step_s else "",
             f"{run.memory_gib:g} GiB" if run.memory_gib else ""]
    return ", ".join(p for p in parts if p)


def main() -> None:
    print(f"{'source':<16} {'model':<14} {'gpu':<9} {'gpus':>5}  {'layout':<52} metric")
    for run in ROWS:
        print(f"{run.source:<16} {run.name:<14} {run.gpu:<9} {run.gpus:>5}  {run.layout:<52} {_metric(run)}")
    sources = sorted({r.source for r in ROWS})
    counts = ", ".join(f"{s} {sum(r.source == s for r in ROWS)}" for s in sources)
    print(f"\n{len(ROWS)} rows from {len(sources)} sources: {counts}")


if __name__ == "__main__":
    main()
