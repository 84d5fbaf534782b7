"""Reference data transcribed from three papers, for testing the training cost model.

Plain data only: constants, plus the per-layer activation formulas of Korthikanti et al. written
as lambdas (that is how the paper states them). No test logic lives here.

Sources and how each number was checked
---------------------------------------
* Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
  (arXiv:1910.02054, SC'20).  Table 1 cross-checked against two independent full-text
  transcriptions of the paper (one markdown table, one HTML table) and the section 5.1/5.2/5.3
  text ("31.4 GB", "16.6 GB", "1.9 GB" at Nd = 64 for 7.5B).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198, MLSys'23).  Section 4.1 text, Tables 2-5 and Appendix A read from a
  full-text transcription of the paper; Table 3/5 also match two independent summaries.
* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473, SC'21).  Table 1, section 5.1 text, equations (2)-(4) and the
  FLOP appendix read from two full-text transcriptions of the paper.  Micro-batch sizes,
  interleaving and recomputation flags come from the authors' reproduction script
  NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (commits cf547dea..., 79a3bb6b...), NOT from
  the paper text (the paper does not print them).

Nothing below rests on memory alone; where a value is derived rather than printed, the comment
says so.
"""

# =================================================================================================
# 1. ZeRO (Rajbhandari et al. 2020), Table 1
# =================================================================================================
#
# Caption (verbatim): "Per-device memory consumption of different optimizations in ZeRO-DP as a
# function of DP degree. Bold-faced text are the combinations for which the model can fit into a
# cluster of 32GB V100 GPUs."
#
# Model-state bytes per device, Psi = parameter count, K = optimizer multiplier (mixed-precision
# Adam: fp32 params + momentum + variance = 4+4+4 -> K = 12), Nd = DP degree (section 5):
#   baseline DP     : (2 + 2 + K) * Psi                      = 16 Psi
#   P_os            : 2 Psi + 2 Psi + K Psi / Nd             = 4 Psi + 12 Psi / Nd
#   P_os+g          : 2 Psi + (2 + K) Psi / Nd               = 2 Psi + 14 Psi / Nd
#   P_os+g+p        : (2 + 2 + K) Psi / Nd                   = 16 Psi / Nd
#
# Units: "GB" in this table is DECIMAL, 1 GB = 1e9 bytes.  Evidence: 16 * 7.5e9 B = 120e9 B is
# printed as 120; 16 * 128e9 = 2048e9 -> 2048; 16 * 1e12 = 16e12 -> 16000; and section 3.1 says a
# 1.5B model needs "at least 24 GB" (16 * 1.5e9 = 24e9).  Not GiB.
#
# The printed table has NO separate baseline column: its columns are DP | (P_os, P_os+g,
# P_os+g+p) for each of 7.5B / 128B / 1T.  The DP = 1 row (120 / 2048 / 16000) is the baseline.
# `baseline_gb` below is therefore DERIVED (= 16 Psi / 1e9, independent of Nd, which is what plain
# DP replicates); every other number is exactly as printed.
#
# Rounding as printed (checked against the formulas above; all printed values lie within
# max(0.5 % relative, 0.005 GB absolute) of the exact value):
#   * 7.5B columns are rounded to ~3 significant figures: 41.25 -> 41.3, 35.625 -> 35.6,
#     21.5625 -> 21.6, 31.406 -> 31.4, 16.641 -> 16.6, 1.875 -> 1.88, 30.352 -> 30.4,
#     15.410 -> 15.4, 0.46875 -> 0.47, 30.088 -> 30.1, 15.103 -> 15.1, 0.1172 -> 0.12 (+2.4 %,
#     the largest relative deviation; 0.0028 GB absolute).
#   * 128B and 1T columns are TRUNCATED to integers, not rounded: 513.5 -> 513, 257.75 -> 257,
#     4187.5 -> 4187, 2218.75 -> 2218, 4046.875 -> 4046, 2054.69 -> 2054, 4011.72 -> 4011,
#     2013.67 -> 2013 (max absolute error 0.875 GB); non-integers 62.5 and 15.6 (15.625) kept.
#   * Section 5 text says "1.9 GB" for 7.5B / P_os+g+p / Nd = 64 while Table 1 prints 1.88.
#   * (The brief that commissioned this file quoted os_g_gb = 41.25 for 7.5B at dp = 4; the paper
#     prints 41.3, which is what is stored here.)

# How each model's column was printed (see "Rounding as printed" above): "round" to the digits
# shown, or "truncate" integers (their non-integer cells, 62.5 and 15.6, are rounded).
ZERO_TABLE1_PRINTED = {7.5e9: "round", 128e9: "truncate", 1e12: "truncate"}

ZERO_K = 12  # optimizer-state multiplier for mixed-precision Adam (ZeRO section 3.1)
ZERO_BYTES_PER_GB = 1e9  # the paper's GB is decimal (see above)

ZERO_TABLE1 = [
    # --- 7.5B model (Psi = 7.5e9) ---------------------------------------------------------------
    {"params": 7.5e9, "dp": 1, "baseline_gb": 120, "os_gb": 120, "os_g_gb": 120, "os_g_p_gb": 120},
    {"params": 7.5e9, "dp": 4, "baseline_gb": 120, "os_gb": 52.5, "os_g_gb": 41.3, "os_g_p_gb": 30},
    {"params": 7.5e9, "dp": 16, "baseline_gb": 120, "os_gb": 35.6, "os_g_gb": 21.6, "os_g_p_gb": 7.5},
    {"params": 7.5e9, "dp": 64, "baseline_gb": 120, "os_gb": 31.4, "os_g_gb": 16.6, "os_g_p_gb": 1.88},
    {"params": 7.5e9, "dp": 256, "baseline_gb": 120, "os_gb": 30.4, "os_g_gb": 15.4, "os_g_p_gb": 0.47},
    {"params": 7.5e9, "dp": 1024, "baseline_gb": 120, "os_gb": 30.1, "os_g_gb": 15.1, "os_g_p_gb": 0.12},
    # --- 128B model (Psi = 128e9) ---------------------------------------------------------------
    {"params": 128e9, "dp": 1, "baseline_gb": 2048, "os_gb": 2048, "os_g_gb": 2048, "os_g_p_gb": 2048},
    {"params": 128e9, "dp": 4, "baseline_gb": 2048, "os_gb": 896, "os_g_gb": 704, "os_g_p_gb": 512},
    {"params": 128e9, "dp": 16, "baseline_gb": 2048, "os_gb": 608, "os_g_gb": 368, "os_g_p_gb": 128},
    {"params": 128e9, "dp": 64, "baseline_gb": 2048, "os_gb": 536, "os_g_gb": 284, "os_g_p_gb": 32},
    {"params": 128e9, "dp": 256, "baseline_gb": 2048, "os_gb": 518, "os_g_gb": 263, "os_g_p_gb": 8},
    {"params": 128e9, "dp": 1024, "baseline_gb": 2048, "os_gb": 513, "os_g_gb": 257, "os_g_p_gb": 2},
    # --- 1T model (Psi = 1e12) ------------------------------------------------------------------
    {"params": 1e12, "dp": 1, "baseline_gb": 16000, "os_gb": 16000, "os_g_gb": 16000, "os_g_p_gb": 16000},
    {"params": 1e12, "dp": 4, "baseline_gb": 16000, "os_gb": 7000, "os_g_gb": 5500, "os_g_p_gb": 4000},
    {"params": 1e12, "dp": 16, "baseline_gb": 16000, "os_gb": 4750, "os_g_gb": 2875, "os_g_p_gb": 1000},
    {"params": 1e12, "dp": 64, "baseline_gb": 16000, "os_gb": 4187, "os_g_gb": 2218, "os_g_p_gb": 250},
    {"params": 1e12, "dp": 256, "baseline_gb": 16000, "os_gb": 4046, "os_g_gb": 2054, "os_g_p_gb": 62.5},
    {"params": 1e12, "dp": 1024, "baseline_gb": 16000, "os_gb": 4011, "os_g_gb": 2013, "os_g_p_gb": 15.6},
]

# Bold cells of Table 1 ("the model can fit into a cluster of 32GB V100 GPUs"); these five are the
# only bold cells in the printed table.  (params, column key, dp).
ZERO_TABLE1_BOLD = [
    (7.5e9, "os_gb", 64),
    (7.5e9, "os_g_gb", 16),
    (7.5e9, "os_g_p_gb", 4),
    (128e9, "os_g_p_gb", 64),
    (1e12, "os_g_p_gb", 1024),
]

# =================================================================================================
# 2. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
# =================================================================================================
#
# Symbols (paper Table 1): a = attention heads, b = micro-batch size, h = hidden size,
# L = layers, p = pipeline-parallel size, s = sequence length, t = tensor-parallel size,
# v = vocabulary size.
# Assumptions (section 4): activations stored in 16-bit (2 bytes/element), dropout masks 1 byte
# per element; layer-norm mean/variance (2sb) ignored; MLP width 4h with GeLU; all sizes in BYTES.
#
# Table 2 ("Activations memory, in bytes, per transformer layer for different techniques"),
# paper row text -> formula:
#   "no parallelism"                                                     sbh(34 + 5as/h)
#   "tensor parallel (baseline)"                                         sbh(10 + 24/t + 5as/(ht))
#   "tensor + sequence parallel"                                         sbh(34/t + 5as/(ht))
#   "tensor parallel + selective activation recomputation"               sbh(10 + 24/t)
#   "tensor parallel + sequence parallel + selective activation
#    recomputation"                                                      sbh(34/t)
#   "full activation recomputation"                                      sbh(2)
# Full recompute keeps only each layer's 2sbh input; it is NOT divided by t in Table 2 (section 5
# notes 2sbhL/t would need an extra all-gather per layer, which they do not consider).
#
# Section 4.1 per-tensor breakdown of 34sbh + 5as^2b (confirmed against the paper text):
#   Attention block = 11sbh + 5as^2b
#     linear projection (output proj.) input ........ 2sbh
#     attention dropout mask ......................... sbh
#     Q, K, V matmuls: shared input .................. 2sbh
#     QK^T: stores Q and K ........................... 4sbh
#     softmax output ................................. 2as^2b
#     softmax dropout mask ........................... as^2b
#     attention over V: dropout output ............... 2as^2b
#     attention over V: V ............................ 2sbh
#   MLP = 19sbh
#     h->4h linear input 2sbh, 4h->h linear input 8sbh, GeLU input 8sbh, dropout mask sbh
#   Layer norms = 4sbh (each of the two stores its 2sbh input)
#   Total: 11 + 19 + 4 = 34 -> sbh(34 + 5as/h)                                  (Equation 1)
# Under t-way tensor parallelism, the block inputs (QKV input, h->4h input), the two layer-norm
# inputs and the two block-output dropout masks are replicated: 2+2+4+1+1 = 10sbh; everything else
# (24sbh and all 5as^2b) is split by t -> Equation 2.  Sequence parallelism splits the 10 too
# (Equation 4 = Equation 1 / t).
#
# Pipeline: the first stage holds L layers' worth (p microbatches x L/p layers):
#   total = sbhL/t * (34 + 5as/h)                                                (Equation 5)
#   interleaved schedule with m interleaving stages: multiply by (1 + (p-1)/(p*m)).
#   Extra (embeddings dropout, final LN, output layer, fp32 logits):
#   sbhL/t * (p/L + delta_{p=1} * 4/L * (1 + v/h))  -- "< 0.01 %" for the 22B model.
#   Selective recompute + TP + SP: total = 34 sbhL/t                              (Equation 6)
# 5as/h worked examples in the paper: GPT-3 (a=96, s=2048, h=12288) -> 80; MT-NLG (a=128,
# s=2048, h=20480) -> 64; selective recompute saves 70 % / 65 % of activation memory with
# 2.7 % / 1.6 % FLOPs overhead.

KORTHIKANTI_TABLE2 = {
    # "no parallelism"
    "no_parallelism": lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    # "tensor parallel (baseline)"
    "tensor_parallel": lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    # "tensor + sequence parallel"
    "tensor_sequence_parallel": lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
    # "tensor parallel + selective activation recomputation"
    "tensor_parallel_selective_recompute": lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    # "tensor parallel + sequence parallel + selective activation recomputation"
    "tensor_sequence_parallel_selective_recompute": lambda s, b, h, a, t: s * b * h * (34 / t),
    # "full activation recomputation"  (t unused)
    "full_recompute": lambda s, b, h, a, t: s * b * h * 2,
}

KORTHIKANTI_TABLE2_ROW_TEXT = {
    "no_parallelism": "no parallelism",
    "tensor_parallel": "tensor parallel (baseline)",
    "tensor_sequence_parallel": "tensor + sequence parallel",
    "tensor_parallel_selective_recompute": "tensor parallel + selective activation recomputation",
    "tensor_sequence_parallel_selective_recompute": (
        "tensor parallel + sequence parallel + selective activation recomputation"
    ),
    "full_recompute": "full activation recomputation",
}

# Section 4.1 breakdown as data.  Bytes of the tensor = sbh_coeff * s*b*h + as2b_coeff * a*s*s*b.
# `split_by_tp`: whether plain tensor parallelism (no sequence parallelism) divides it by t
# (section 4.2.1/4.2.2); the replicated ones sum to the "10" of Equation 2.
KORTHIKANTI_ACTIVATION_BREAKDOWN = [
    {"block": "attention", "tensor": "output linear projection input", "sbh_coeff": 2, "as2b_coeff": 0, "split_by_tp": True},
    {"block": "attention", "tensor": "attention dropout mask", "sbh_coeff": 1, "as2b_coeff": 0, "split_by_tp": False},
    {"block": "attention", "tensor": "QKV shared input", "sbh_coeff": 2, "as2b_coeff": 0, "split_by_tp": False},
    {"block": "attention", "tensor": "Q and K (for QK^T)", "sbh_coeff": 4, "as2b_coeff": 0, "split_by_tp": True},
    {"block": "attention", "tensor": "softmax output", "sbh_coeff": 0, "as2b_coeff": 2, "split_by_tp": True},
    {"block": "attention", "tensor": "softmax dropout mask", "sbh_coeff": 0, "as2b_coeff": 1, "split_by_tp": True},
    {"block": "attention", "tensor": "softmax dropout output (for attention over V)", "sbh_coeff": 0, "as2b_coeff": 2, "split_by_tp": True},
    {"block": "attention", "tensor": "V (for attention over V)", "sbh_coeff": 2, "as2b_coeff": 0, "split_by_tp": True},
    {"block": "mlp", "tensor": "h->4h linear input", "sbh_coeff": 2, "as2b_coeff": 0, "split_by_tp": False},
    {"block": "mlp", "tensor": "4h->h linear input", "sbh_coeff": 8, "as2b_coeff": 0, "split_by_tp": True},
    {"block": "mlp", "tensor": "GeLU input", "sbh_coeff": 8, "as2b_coeff": 0, "split_by_tp": True},
    {"block": "mlp", "tensor": "MLP dropout mask", "sbh_coeff": 1, "as2b_coeff": 0, "split_by_tp": False},
    {"block": "layernorm", "tensor": "layer norm 1 input", "sbh_coeff": 2, "as2b_coeff": 0, "split_by_tp": False},
    {"block": "layernorm", "tensor": "layer norm 2 input", "sbh_coeff": 2, "as2b_coeff": 0, "split_by_tp": False},
]
# Block subtotals stated in the paper (sbh coefficient, as^2b coefficient).
KORTHIKANTI_BLOCK_TOTALS = {"attention": (11, 5), "mlp": (19, 0), "layernorm": (4, 0)}

# Table 3: "Model configurations used during evaluation. Note that no data parallelism is used in
# our evaluations and as a result, the batch sizes as well as total number of GPUs are set to a
# value much lower than the ones in the end-to-end training."
# Section 6: t = 8 for all; "interleaving schedule with three interleaving stages (m = 3) for the
# 175B and 530B models" (interleave_stages = None -> non-interleaved); s = 2048, v = 51200;
# mixed precision, Selene, 8x A100 80GB per node.
KORTHIKANTI_SEQ_LEN = 2048
KORTHIKANTI_VOCAB = 51200
KORTHIKANTI_TABLE3 = [
    {"model": "22B", "heads": 64, "hidden": 6144, "layers": 48, "tp": 8, "pp": 1, "gpus": 8,
     "global_batch": 4, "micro_batch": 4, "interleave_stages": None},
    {"model": "175B (GPT-3)", "heads": 96, "hidden": 12288, "layers": 96, "tp": 8, "pp": 8, "gpus": 64,
     "global_batch": 64, "micro_batch": 1, "interleave_stages": 3},
    {"model": "530B (MT-NLG)", "heads": 128, "hidden": 20480, "layers": 105, "tp": 8, "pp": 35, "gpus": 280,
     "global_batch": 280, "micro_batch": 1, "interleave_stages": 3},
    {"model": "1T", "heads": 160, "hidden": 25600, "layers": 128, "tp": 8, "pp": 64, "gpus": 512,
     "global_batch": 512, "micro_batch": 1, "interleave_stages": None},
]

# Table 4: "Time to complete the forward and backward pass of a single transformer layer of the
# 22B model."  (Timings only -- the paper prints no per-model activation-memory numbers in a table;
# memory is only shown as percentages in Figure 7, not transcribed.)
KORTHIKANTI_TABLE4_22B_LAYER_MS = [
    {"experiment": "Baseline no recompute", "forward_ms": 7.7, "backward_ms": 11.9, "combined_ms": 19.6, "overhead_pct": None},
    {"experiment": "Sequence Parallelism", "forward_ms": 7.2, "backward_ms": 11.8, "combined_ms": 19.0, "overhead_pct": -3},
    {"experiment": "Baseline with recompute", "forward_ms": 7.7, "backward_ms": 19.5, "combined_ms": 27.2, "overhead_pct": 39},
    {"experiment": "Selective Recompute", "forward_ms": 7.7, "backward_ms": 13.2, "combined_ms": 20.9, "overhead_pct": 7},
    {"experiment": "Selective + Sequence", "forward_ms": 7.2, "backward_ms": 13.1, "combined_ms": 20.3, "overhead_pct": 4},
]

# Table 5: "End-to-end iteration time."  Full recompute = full recomputation without sequence
# parallelism; present work = sequence parallelism + selective recomputation.  Configs: Table 3.
# MFU/HFU use the A100 peak of 312 TFLOP/s (footnote 5) and Appendix A:
#   model FLOPs / iteration    = 72 B L s h^2 (1 + s/(6h) + v/(12hL))                (Equation 7)
#   hardware FLOPs / iteration = 72 B L s h^2 (1 + s/(3h) + v/(12hL))                (Equation 8)
#   (B = global batch here; hardware/model ~ 1 + s/(6h), Equation 9.)
# Checked: Equation 7 / (present_work_s * gpus * 312e12) reproduces mfu_pct within 0.15 points for
# all four rows (22B 41.65, 175B 51.39, 530B 56.05, 1T 56.27), Equation 8 reproduces hfu_pct
# within 0.11 points, and full/present - 1 reproduces throughput_increase_pct within 0.1.
KORTHIKANTI_TABLE5 = [
    {"model": "22B", "full_recompute_s": 1.42, "present_work_s": 1.10, "throughput_increase_pct": 29.0, "mfu_pct": 41.5, "hfu_pct": 43.7},
    {"model": "175B", "full_recompute_s": 18.13, "present_work_s": 13.75, "throughput_increase_pct": 31.8, "mfu_pct": 51.4, "hfu_pct": 52.8},
    {"model": "530B", "full_recompute_s": 49.05, "present_work_s": 37.83, "throughput_increase_pct": 29.7, "mfu_pct": 56.0, "hfu_pct": 57.0},
    {"model": "1T", "full_recompute_s": 94.42, "present_work_s": 71.49, "throughput_increase_pct": 32.1, "mfu_pct": 56.3, "hfu_pct": 57.0},
]
# Section 6.3: 530B with 8-way data parallelism (2240 GPUs, batch x8): 37.83 s -> 39.15 s per
# iteration, MFU 56.0 % -> 54.2 %.
KORTHIKANTI_530B_DP8 = {"gpus": 2240, "global_batch": 2240, "iteration_s": 39.15, "mfu_pct": 54.2}

# =================================================================================================
# 3. Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
#    Megatron-LM"), Table 1
# =================================================================================================
#
# Caption: "Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion
# parameters."  Section 5.1: "we use the interleaved pipeline schedule with the scatter/gather
# optimization enabled.  All models use a vocabulary size (denoted by V) of 51,200 (multiple of
# 1024) and a sequence length (s) of 2048."  Section 5: "The peak device throughput of an A100
# GPU with 16-bit precision is 312 teraFLOP/s."  Throughput is end-to-end (data loading,
# optimizer, communication, logging included).  Hardware: Selene, DGX A100 80GB nodes.
#
# Equations (section 5.1 and the FLOP appendix):
#   (2) P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))
#   (3) F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))      FLOPs per iteration (GEMMs only, a lower
#       bound); "equation (3) assumes activation recomputation and takes into account the
#       floating-point operations associated with the extra forward pass" -- i.e. 4x forward:
#       per layer 4 * (24 B s h^2 + 4 B s^2 h), plus 6 B s h V for the logit layer (no recompute
#       of the logits).  A FLOP is counted "regardless of precision"; matmul m x k x n = 2mkn.
#   (4) end-to-end training time ~= 8 T P / (n X)   (T tokens, n GPUs, X achieved FLOP/s per GPU)
#
# Printed columns: params_billion, heads, hidden, layers, tp, pp, gpus, batch_size (global, in
# sequences), tflops_per_gpu, pct_peak, aggregate_pflops.
#
# Extra columns NOT in the paper (None = unknown), taken from the authors' reproduction script
# NVIDIA/Megatron-LM examples/sc21/run_table_1.sh ("Table 1 showing weak-scaling throughput"):
#   dp                 DERIVED = gpus / (tp * pp).
#   micro_batch        MBS in the script.
#   model_chunks       interleaved model chunks per device v = (layers / pp) /
#                      --num-layers-per-virtual-pipeline-stage; 1 = no interleaving (script sets
#                      no virtual stages).  PP = 1 rows have no pipeline at all.
#                      NOTE: the 1T row has no virtual-pipeline flag in the script (so v = 1,
#                      non-interleaved), although section 5.1 says the interleaved schedule is
#                      used; the 39.1B row (pp = 2) is also non-interleaved in the script.
#   ddp                the script's DDP variable (--DDP-impl): "torch" (PyTorch DDP, whose bucketed
#                      all-reduce overlaps the last micro-batch's backward) for 1.7B-18.4B, "local"
#                      (Megatron's DDP: one all-reduce after the last backward) from 39.1B on.
#   activation_recompute  every row in the script passes "--activations-checkpoint-method uniform"
#                      (later renamed "--recompute-method uniform"), i.e. full recomputation with
#                      the default 1 layer per checkpoint; consistent with equation (3)'s 4x.
# Internal consistency (checked): aggregate_pflops agrees with tflops_per_gpu * gpus / 1000 within
# 0.4 % (the per-GPU column is rounded to an integer; e.g. 1T: 502.0 / 3072 = 163.4); pct_peak
# equals round(tflops_per_gpu / 312 * 100) for every row; params_billion equals equation (2)
# rounded to 0.1 (1.652 -> 1.7, 18.450 -> 18.4, 1008.04 -> 1008.0).
# Derived microbatches per pipeline m = batch_size / (dp * micro_batch):
#   1, 1, 1, 4, 12, 28, 48, 144, 280, 512 (each a multiple of pp where interleaved).

A100_PEAK_TFLOPS = 312.0  # dense 16-bit (fp16/bf16) tensor-core peak assumed by both NVIDIA papers
MEGATRON_SEQ_LEN = 2048
MEGATRON_VOCAB = 51200

MEGATRON_TABLE1 = [
    {"params_billion": 1.7, "heads": 24, "hidden": 2304, "layers": 24, "tp": 1, "pp": 1, "gpus": 32,
     "batch_size": 512, "tflops_per_gpu": 137, "pct_peak": 44, "aggregate_pflops": 4.4,
     "dp": 32, "micro_batch": 16, "model_chunks": 1, "activation_recompute": True, "ddp": "torch"},
    {"params_billion": 3.6, "heads": 32, "hidden": 3072, "layers": 30, "tp": 2, "pp": 1, "gpus": 64,
     "batch_size": 512, "tflops_per_gpu": 138, "pct_peak": 44, "aggregate_pflops": 8.8,
     "dp": 32, "micro_batch": 16, "model_chunks": 1, "activation_recompute": True, "ddp": "torch"},
    {"params_billion": 7.5, "heads": 32, "hidden": 4096, "layers": 36, "tp": 4, "pp": 1, "gpus": 128,
     "batch_size": 512, "tflops_per_gpu": 142, "pct_peak": 46, "aggregate_pflops": 18.2,
     "dp": 32, "micro_batch": 16, "model_chunks": 1, "activation_recompute": True, "ddp": "torch"},
    {"params_billion": 18.4, "heads": 48, "hidden": 6144, "layers": 40, "tp": 8, "pp": 1, "gpus": 256,
     "batch_size": 1024, "tflops_per_gpu": 135, "pct_peak": 43, "aggregate_pflops": 34.6,
     "dp": 32, "micro_batch": 8, "model_chunks": 1, "activation_recompute": True, "ddp": "torch"},
    {"params_billion": 39.1, "heads": 64, "hidden": 8192, "layers": 48, "tp": 8, "pp": 2, "gpus": 512,
     "batch_size": 1536, "tflops_per_gpu": 138, "pct_peak": 44, "aggregate_pflops": 70.8,
     "dp": 32, "micro_batch": 4, "model_chunks": 1, "activation_recompute": True, "ddp": "local"},
    {"params_billion": 76.1, "heads": 80, "hidden": 10240, "layers": 60, "tp": 8, "pp": 4, "gpus": 1024,
     "batch_size": 1792, "tflops_per_gpu": 140, "pct_peak": 45, "aggregate_pflops": 143.8,
     "dp": 32, "micro_batch": 2, "model_chunks": 3, "activation_recompute": True, "ddp": "local"},  # 15 layers/stage, 5/chunk
    {"params_billion": 145.6, "heads": 96, "hidden": 12288, "layers": 80, "tp": 8, "pp": 8, "gpus": 1536,
     "batch_size": 2304, "tflops_per_gpu": 148, "pct_peak": 47, "aggregate_pflops": 227.1,
     "dp": 24, "micro_batch": 2, "model_chunks": 2, "activation_recompute": True, "ddp": "local"},  # 10 layers/stage, 5/chunk
    {"params_billion": 310.1, "heads": 128, "hidden": 16384, "layers": 96, "tp": 8, "pp": 16, "gpus": 1920,
     "batch_size": 2160, "tflops_per_gpu": 155, "pct_peak": 50, "aggregate_pflops": 297.4,
     "dp": 15, "micro_batch": 1, "model_chunks": 2, "activation_recompute": True, "ddp": "local"},  # 6 layers/stage, 3/chunk
    {"params_billion": 529.6, "heads": 128, "hidden": 20480, "layers": 105, "tp": 8, "pp": 35, "gpus": 2520,
     "batch_size": 2520, "tflops_per_gpu": 163, "pct_peak": 52, "aggregate_pflops": 410.2,
     "dp": 9, "micro_batch": 1, "model_chunks": 3, "activation_recompute": True, "ddp": "local"},  # 3 layers/stage, 1/chunk
    {"params_billion": 1008.0, "heads": 160, "hidden": 25600, "layers": 128, "tp": 8, "pp": 64, "gpus": 3072,
     "batch_size": 3072, "tflops_per_gpu": 163, "pct_peak": 52, "aggregate_pflops": 502.0,
     "dp": 6, "micro_batch": 1, "model_chunks": 1, "activation_recompute": True, "ddp": "local"},  # script: no interleaving
]

# Section 5.1 worked training-time estimates with equation (4).
MEGATRON_TRAINING_TIME_EXAMPLES = [
    # GPT-3: "trained on T=300 billion tokens. On n=1024 A100 GPUs using batch size 1536, we
    # achieve X=140 teraFLOP/s per GPU. As a result, the time required ... is 34 days."
    {"params": 175e9, "tokens": 300e9, "gpus": 1024, "batch_size": 1536, "tflops_per_gpu": 140, "days": 34},
    # "For the 1 trillion parameter model, we assume that 450 billion tokens ... 3072 A100 GPUs
    # ... 163 teraFLOP/s, and end-to-end training time of 84 days."  Equation (4) gives 83.2 days
    # with P = 1e12 and 83.9 days with Table 1's P = 1008.0e9, so the paper evidently used 1008e9.
    {"params": 1e12, "tokens": 450e9, "gpus": 3072, "batch_size": None, "tflops_per_gpu": 163, "days": 84},
]
