"""What a run leaves to ship: RUN/model/ (and RUN/stages/<stage>/model/) loads with transformers or
peft and computes what the trainer computed; local weights go in on every engine; a run stopped on
2 ranks resumes on 1 from its resharded checkpoint.

The base model is a tiny Llama built from a config and saved with `save_pretrained`, with a
word-level tokenizer built here in the same folder (so the tokenizer comes from --weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specs.plan_file import load_plan
from test_trainer import CONFIG, WORDS, make_plan_file, read_jsonl
from trainer.loop import TrainOptions, train

STEPS = 3  # optimizer steps per curriculum stage (two stages)
FP32 = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "gas": 4, "zero": 0, "dtype": "fp32"}
EOS = "<|endoftext|>"


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the test data's words, digits, sums and signs (ids < 272, the
    model's vocabulary), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [EOS, "<unk>", *WORDS, *(str(n) for n in range(19)), "+", "=", ".", "+=", "="]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>").save_pretrained(str(folder))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """The tiny Llama's weights and tokenizer, as a user's local HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG)).save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


def _plan(root: Path, fields: dict) -> Path:
    layout = {**FP32, **fields}
    return make_plan_file(root, devices=layout["dp"] * layout["tp"] * layout["pp"], steps=STEPS,
                          layout_fields=layout)


def held_out(run: Path, stage: int = 1):
    """The stage's eval rows as the trainer reads them (ids, labels, positions: the first
    `eval_sequences`), and its final eval loss (summary.json)."""
    from trainer.corpus import FileTokenizer, load_rows

    plan = load_plan(run / "plan.yaml")
    summary = json.loads((run / "summary.json").read_text())
    spec = plan.task.stages[stage]
    tokenizer = FileTokenizer(run / "model")  # the artifact's, read the way training reads tokenizers
    rows = load_rows(spec.eval_sources[0], plan.task, tokenizer, plan.chosen.layout.seq, None)
    count = TrainOptions().eval_sequences
    rows.ids, rows.labels, rows.positions = rows.ids[:count], rows.labels[:count], rows.positions[:count]
    return rows, summary["stages"][stage]["eval"][spec.name]


def mean_loss(model: torch.nn.Module, rows) -> float:
    """The mean cross-entropy over the trained tokens (label != -100) of packed rows, each row with
    its own position ids, computed here from the logits (independently of the trainer's loss)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, positions in zip(rows.ids, rows.labels, rows.positions):
            logits = model(input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(positions)[None],
                           use_cache=False).logits[0, :-1].float()
            target = torch.from_numpy(labels)[1:]
            trained = target != -100
            total += float(torch.nn.functional.cross_entropy(logits[trained], target[trained], reduction="sum"))
            count += int(trained.sum())
    return total / count


def test_lora_run_leaves_an_adapter_that_peft_loads_with_the_trainers_eval_loss(tmp_path, base_dir) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = load_plan(_plan(tmp_path, {"method": "lora", "lora_rank": 4}))
    run = tmp_path / "run"
    train(plan, run, resume=False, options=TrainOptions(show_progress=False, weights=str(base_dir), merge=True))

    model_dir = run / "model"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= \
        {p.name for p in model_dir.iterdir()}
    for stage in plan.task.stages:  # every stage end left the same kind of artifact
        assert (run / "stages" / stage.name / "model" / "adapter_model.safetensors").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model_dir"] == "model"
    assert [s["model_dir"] for s in summary["stages"]] == [f"stages/{s.name}/model" for s in plan.task.stages]

    # the tokenizer training read is the --weights folder's, and it ships with the adapter
    text = "the cat sat 1+1=2"
    assert AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(base_dir)(text)["input_ids"]

    batch, trainer_eval = held_out(run)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), model_dir)
    assert mean_loss(adapted, batch) == pytest.approx(trainer_eval, abs=1e-4)
    base_loss = mean_loss(AutoModelForCausalLM.from_pretrained(base_dir), batch)
    assert abs(base_loss - trainer_eval) > 1e-2  # the adapter is what makes it equal

    merged = AutoModelForCausalLM.from_pretrained(model_dir / "merged")  # --merge
    assert mean_loss(merged, batch) == pytest.approx(trainer_eval, abs=1e-4)
    assert not any("lora" in name for name in merged.state_dict())


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def _chat_task(root: Path, rng) -> Path:
    """One chat stage: a user asks for a sum, the assistant answers it (digits are words of the
    tokenizer); held-out conversations of the same kind."""
    data = root / "data"
    data.mkdir(parents=True)

    def conversation() -> dict:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return {"messages": [{"role": "user", "content": f"{a} + {b} ="},
                             {"role": "assistant", "content": f"{a + b} ."}]}

    for name, count in (("chat.jsonl", 200), ("chat_eval.jsonl", 24)):
        (data / name).write_text("".join(json.dumps(conversation()) + "\n" for _ in range(count)))
    (root / "task.yaml").write_text(f"""
name: chat
seq_len: 32
global_batch: 4
stages:
  - {{name: sums, sources: [{{path: data/chat.jsonl, format: chat}}], steps: 8, lr: 1.0e-2, warmup_steps: 1,
      eval_sources: [{{path: data/chat_eval.jsonl, format: chat}}]}}
""")
    return root / "task.yaml"


def test_lora_on_chat_data_loads_back_with_peft_at_the_trainers_eval_loss(tmp_path) -> None:
    """Issue 17: LoRA on chat data (the tokenizer's chat template, loss on the assistant's tokens)
    leaves RUN/model/, which `PeftModel.from_pretrained(base, RUN/model)` loads; its loss on the
    held-out conversations equals the trainer's own final evaluation within 1e-4."""
    import random

    from peft import PeftModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from specs.core import ModelSpec
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware, load_task
    from trainer.corpus import FileTokenizer, load_rows

    base = tmp_path / "base"
    words = ["<pad>", EOS, "<|user|>", "<|assistant|>", "<|end|>", "+", "=", ".", *(str(n) for n in range(19))]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=EOS, pad_token="<pad>",
                                        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG)).save_pretrained(base)

    task = load_task(str(_chat_task(tmp_path, random.Random(5))))
    plan = make_plan(PlanOptions(model=ModelSpec(name="tiny", hf_config=CONFIG), hardware=load_hardware("cpu"),
                                 gpus_per_node=1, task=task, min_compute_fraction=0.0, method="lora",
                                 fix={"dtype": "fp32", "mbs": 2, "gas": 2, "tp": 1, "pp": 1}))
    run = tmp_path / "run"
    summary = train(plan, run, resume=False, options=TrainOptions(show_progress=False, weights=str(base)))
    assert (run / "model" / "adapter_config.json").is_file()

    rows = load_rows(task.stages[0].eval_sources[0], task, FileTokenizer(run / "model"), 32, None)
    rows.ids, rows.labels, rows.positions = (a[:TrainOptions().eval_sequences] for a in (rows.ids, rows.labels,
                                                                                          rows.positions))
    # the loss is on the assistant's answers only: "<sum> . <|end|>", 3 tokens per conversation
    conversations = int((rows.ids == words.index("<|user|>")).sum())
    assert conversations > 0 and int((rows.labels != -100).sum()) == 3 * conversations
    trainer_eval = summary["stages"][0]["eval"]["sums"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "model")
    assert mean_loss(adapted, rows) == pytest.approx(trainer_eval, abs=1e-4)
    assert abs(mean_loss(AutoModelForCausalLM.from_pretrained(base), rows) - trainer_eval) > 1e-2


def test_qlora_from_local_weights_learns_and_its_adapter_loads_on_a_16_bit_and_a_4_bit_base(tmp_path,
                                                                                            base_dir) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    plan = load_plan(_plan(tmp_path, {"method": "qlora", "lora_rank": 4, "dtype": "bf16"}))
    run = tmp_path / "run"
    train(plan, run, resume=False, options=TrainOptions(show_progress=False, weights=str(base_dir), merge=True))
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if m["stage"] == "language"]
    assert losses[-1] < losses[0]  # the adapters learn
    batch, trainer_eval = held_out(run)

    on_4bit = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16))
    for module in on_4bit.modules():  # bitsandbytes' CPU inference repack needs in_features >= its block
        if hasattr(module, "support_avx512bf16_for_cpu"):  # of 64 (trainer/adapters.py turns it off too)
            module.support_avx512bf16_for_cpu = False
    on_16bit = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    adapted = {name: mean_loss(PeftModel.from_pretrained(base, run / "model"), batch)
               for name, base in (("4-bit", on_4bit), ("16-bit", on_16bit))}
    before = mean_loss(AutoModelForCausalLM.from_pretrained(base_dir), batch)
    assert trainer_eval < before - 1e-2  # the held-out loss fell
    # bf16 compute: the same NF4 base as in training within bf16 rounding, the 16-bit base within
    # NF4's rounding of the weights; both far nearer the trained loss than the untrained one
    assert adapted["4-bit"] == pytest.approx(trainer_eval, abs=2e-3)
    assert adapted["16-bit"] == pytest.approx(trainer_eval, abs=(before - trainer_eval) / 2)
    merged = AutoModelForCausalLM.from_pretrained(run / "model" / "merged")  # dequantised base + adapters
    assert merged.dtype == torch.bfloat16
    assert mean_loss(merged, batch) == pytest.approx(trainer_eval, abs=2e-3)


def test_one_process_without_a_tokenizer_leaves_an_hf_folder_that_says_it_reads_bytes(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    plan = load_plan(_plan(tmp_path, {}))  # no --weights, no tokenizer: a seeded init on UTF-8 bytes
    run = tmp_path / "run"
    train(plan, run, resume=False, options=TrainOptions(show_progress=False))
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    engine_state = torch.load(last / "engine.pt", weights_only=True)["model"]
    loaded = AutoModelForCausalLM.from_pretrained(run / "model")
    assert (fixed_batch_logits(loaded) - logits_of(engine_state)).abs().max() < 1e-5
    assert "UTF-8 bytes" in (run / "model" / "README.md").read_text()
    assert not (run / "model" / "tokenizer.json").exists()


# -- full fine-tuning on 2 ranks: the artifact against the engine's own checkpoint ---------------------


def _rank_train(rank: int, world: int, port: int, plan_path: str, run_dir: str, weights: str) -> None:
    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=world > 1, threads=1)
    train(load_plan(plan_path), Path(run_dir), False, TrainOptions(show_progress=False, weights=weights or None))
    finish_rank(world > 1)


def _train_forked(plan: Path, run: Path, weights: Path) -> None:
    from profiler.ranks import free_port, launch

    world = load_plan(plan).chosen.layout.devices
    launch(_rank_train, world, (world, free_port(), str(plan), str(run), str(weights)))


def _with_engine(plan: Path, engine: str) -> Path:
    loaded = load_plan(plan)
    loaded.engine = engine
    loaded.write(plan)
    return plan


def logits_of(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tiny Llama with these weights, on a fixed batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(weights)
    return fixed_batch_logits(model)


def fixed_batch_logits(model: torch.nn.Module) -> torch.Tensor:
    batch = torch.randint(0, CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch).logits


def _check_full_artifact(run: Path, checkpoint_weights: dict[str, torch.Tensor], base_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = run / "model"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= \
        {p.name for p in model_dir.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert loaded.dtype == torch.float32  # the training dtype
    trained = logits_of(checkpoint_weights)
    assert (fixed_batch_logits(loaded) - trained).abs().max() < 1e-5
    start = fixed_batch_logits(AutoModelForCausalLM.from_pretrained(base_dir))
    assert (start - trained).abs().max() > 1e-3  # it trained, from the --weights


@pytest.mark.slow
def test_zero3_on_two_ranks_leaves_an_hf_folder_and_resumes_on_one_process_from_a_universal_checkpoint(
        tmp_path, base_dir) -> None:
    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    plan = _with_engine(_plan(tmp_path, {"dp": 2, "gas": 2, "zero": 3}), "deepspeed")
    run = tmp_path / "run"
    _train_forked(plan, run, base_dir)
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    # DeepSpeed's own consolidation of its ZeRO-3 partitions, independent of trainer/handoff.py
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(last), tag="engine")
    _check_full_artifact(run, consolidated, base_dir)

    # stopped after the first stage, resumed on one process: DeepSpeed's universal checkpoint
    stage_end = _stop_after_first_stage(run)
    saved = get_fp32_state_dict_from_zero_checkpoint(str(stage_end), tag="engine")
    _check_resumed_on_one_process(plan, run, base_dir, saved, tmp_path)


@pytest.mark.slow
def test_tp_on_two_ranks_leaves_an_hf_folder_and_resumes_on_one_process_from_its_resharded_checkpoint(
        tmp_path, base_dir) -> None:
    import torch.distributed.fsdp  # noqa: F401  (imported before forking)
    import torch.distributed.tensor.parallel  # noqa: F401

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plan = _with_engine(_plan(tmp_path, {"tp": 2}), "fsdp2")
    run = tmp_path / "run"
    _train_forked(plan, run, base_dir)
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    dcp_to_torch_save(last / "dcp", tmp_path / "last.pt")  # DCP's own consolidation, independent of handoff.py
    _check_full_artifact(run, torch.load(tmp_path / "last.pt", weights_only=True)["model"], base_dir)

    # stopped after the first stage, resumed on one process: the plain engine reads the DCP shards
    stage_end = _stop_after_first_stage(run)
    dcp_to_torch_save(stage_end / "dcp", tmp_path / "stage1.pt")
    saved = torch.load(tmp_path / "stage1.pt", weights_only=True)["model"]
    _check_resumed_on_one_process(plan, run, base_dir, saved, tmp_path)


def _stop_after_first_stage(run: Path) -> Path:
    """The run as if stopped after its first stage: the checkpoints after its end removed."""
    stage_end = run / "checkpoints" / f"step-{STEPS:08d}"
    for later in (run / "checkpoints").glob("step-*"):
        if later.name > stage_end.name:
            shutil.rmtree(later)
    return stage_end


def _check_resumed_on_one_process(plan: Path, run: Path, base_dir: Path, saved: dict[str, torch.Tensor],
                                  tmp_path: Path) -> None:
    """The plan re-made for 1 process (the same global batch), resumed: right after the restore its
    parameters are the 2-rank checkpoint's exactly and Adam has taken the first stage's steps; then
    it trains on to the end with the losses the 2 ranks had."""
    two_rank_losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    one = _replanned(plan, tmp_path / "one.yaml", FP32)
    resumed = _resumed_run(one, run, base_dir)
    params = dict(resumed.recovery.engine.module.named_parameters())
    assert params.keys() == saved.keys()
    assert all(torch.equal(params[k].detach(), saved[k].view(params[k].shape)) for k in params)
    moments = resumed.recovery.engine.optimizer.state_dict()["state"]
    assert len(moments) == len(params) and all(float(m["step"]) == STEPS for m in moments.values())
    resumed = None

    train(load_plan(one), run, resume=True, options=TrainOptions(show_progress=False, weights=str(base_dir)))
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 2 * STEPS + 1))  # it trained on to the end
    losses = [m["loss"] for m in metrics]
    assert losses[:STEPS] == two_rank_losses[:STEPS]
    assert losses[STEPS:] == pytest.approx(two_rank_losses[STEPS:], abs=1e-5)  # as if never stopped
    assert any(e["event"] == "resharded" and e["saved_layout"] != e["layout"] for e in read_jsonl(run / "events.jsonl"))
    assert json.loads((run / "summary.json").read_text())["finished"]
    assert load_plan(run / "plan.yaml").chosen.layout.devices == 1  # the run dir's plan is the one that ran


def _replanned(plan_path: Path, out: Path, layout_fields: dict) -> Path:
    """The plan re-made for another number of devices: the same task, global batch and engine
    choice (fsdp2; one process runs it plain), another layout."""
    plan = load_plan(plan_path)
    layout = plan.chosen.layout.model_copy(update=layout_fields)
    assert layout.global_batch == plan.chosen.layout.global_batch
    plan.chosen.layout = layout
    for stage in plan.stages:
        stage.layout = layout
    plan.write(out)
    return out


def _resumed_run(plan: Path, run: Path, base_dir: Path | None):
    """The loop's run object after it restored the newest checkpoint (nothing trained yet)."""
    from trainer.loop import Run

    weights = str(base_dir) if base_dir else None
    resumed = Run(load_plan(plan), run, TrainOptions(show_progress=False, weights=weights))
    resumed.restore_or_start(True)
    return resumed


def _rank_resume(rank: int, world: int, port: int, plan: str, run: str, out: str) -> None:
    """Resume `run` with `plan`: rank 0 saves the whole parameters right after the restore, then
    every rank trains on."""
    from torch.distributed.tensor import DTensor

    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=True, threads=1)
    resumed = _resumed_run(Path(plan), Path(run), None)
    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in resumed.recovery.engine.module.named_parameters()}
    if rank == 0:
        torch.save(whole, out)
    resumed = whole = None
    train(load_plan(plan), Path(run), True, TrainOptions(show_progress=False))
    finish_rank(True)


@pytest.mark.slow
def test_a_one_process_run_resumes_on_two_fsdp2_ranks_from_its_own_checkpoint(tmp_path) -> None:
    import torch.distributed.fsdp  # noqa: F401  (imported before forking)

    from profiler.ranks import free_port, launch

    plan = _with_engine(_plan(tmp_path, {}), "fsdp2")
    run = tmp_path / "run"
    train(load_plan(plan), run, resume=False, options=TrainOptions(show_progress=False))
    one_process_losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    saved = torch.load(_stop_after_first_stage(run) / "engine.pt", weights_only=True)["model"]

    two = _replanned(plan, tmp_path / "two.yaml", {"dp": 2, "gas": 2, "zero": 3})  # engine.pt into FSDP2 shards
    launch(_rank_resume, 2, (2, free_port(), str(two), str(run), str(tmp_path / "whole.pt")))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert whole.keys() == saved.keys() and all(torch.equal(whole[k], saved[k]) for k in whole)
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    assert losses == pytest.approx(one_process_losses, abs=1e-5)  # Adam's moments came along too
    assert len(losses) == 2 * STEPS
