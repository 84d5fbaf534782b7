"""Row formats (text, prompt_completion, chat, alpaca, sharegpt): detected from their fields, rendered
with the tokenizer's chat template, trained on the answers only; packed rows keep documents apart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.task import DataSource, TaskSpec
from trainer.batch import IGNORE
from trainer.corpus import load_rows, tokenizer_for
from trainer.data.formats import detect_format, prompt_and_answer, render_example

WORDS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "hi", "there", "how", "are", "you",
         "fine", "ok", "thanks", "add", "two", "and", "three", "five", "reverse", "abc", "cba", "be", "brief",
         "what", "is", "it", "yes", "no", "the", "sky", "blue", "red", "green"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
CONFIG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128}

ROWS = {
    "text": [{"text": "the sky is blue"}, {"text": "hi there how are you"}, {"text": "red green"}],
    "prompt_completion": [{"prompt": "add two and three", "completion": "five"},
                          {"prompt": "reverse abc", "completion": "cba"},
                          {"prompt": "what is the sky", "completion": "the sky is blue"}],
    "chat": [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                           {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you"},
                           {"role": "assistant", "content": "fine thanks"}]},
             {"messages": [{"role": "user", "content": "is the sky blue"}, {"role": "assistant", "content": "yes"}]}],
    "alpaca": [{"instruction": "reverse", "input": "abc", "output": "cba"},
               {"instruction": "add two and three", "input": "", "output": "five"},
               {"instruction": "what is the sky", "output": "blue", "system": "be brief"}],
    "sharegpt": [{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hi"},
                                    {"from": "human", "value": "is it red"}, {"from": "gpt", "value": "no it is blue"}]},
                 {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "ok"},
                                    {"from": "gpt", "value": "ok"}]}],
}


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<pad>",
                                        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    _tokenizer(folder)
    return folder


def _words(text: str) -> int:
    """Tokens of `text` under the test vocabulary: one per word (WordLevel on whitespace)."""
    return len(text.split())


def _answer_tokens(format: str, row: dict) -> int:
    """The trained tokens of a row, counted from the row and the template alone: every answer's
    words plus the token that closes it (<|end|> of the template's assistant turn, <eos> of plain text)."""
    if format == "text":
        return _words(row["text"]) + 1
    if format == "prompt_completion":
        return _words(row["completion"]) + 1
    if format == "alpaca":
        return _words(row["output"]) + 1
    turns = row.get("messages") or row["conversations"]
    return sum(_words(t.get("content", t.get("value"))) + 1 for t in turns
               if t.get("role", t.get("from")) in ("assistant", "gpt"))


def _task(tmp_path: Path, rows: list[dict], tokenizer_dir: Path, **source) -> TaskSpec:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TaskSpec.model_validate({"name": "t", "base_dir": str(tmp_path), "data": {"tokenizer": str(tokenizer_dir)},
                                    "stages": [{"name": "s", "tokens": 10,
                                                "sources": [{"path": "rows.jsonl", **source}]}]})


@pytest.mark.parametrize("format", list(ROWS))
def test_every_format_trains_exactly_its_answer_tokens(tmp_path, tokenizer_dir, format) -> None:
    rows = ROWS[format]
    task = _task(tmp_path, rows, tokenizer_dir)  # format detected from the fields
    tokenizer = tokenizer_for(task, "tiny", 64)
    for row in rows:
        ids, labels = render_example(row, format, tokenizer)
        assert len(ids) == len(labels)
        assert sum(label != IGNORE for label in labels) == _answer_tokens(format, row)
        assert all(label in (IGNORE, token) for token, label in zip(ids, labels))
    # packed rows of the source: the same answers trained (as the model reads labels: shifted, so
    # each row's first label never counts), nothing else. A text document's first token is not
    # trained: nothing of its own document comes before it. The text stream is one full row here.
    seq = sum(_answer_tokens("text", r) for r in rows) if format == "text" else 48
    packed = load_rows(task.stages[0].sources[0], task, tokenizer, seq, None)
    trained = int((packed.labels[:, 1:] != IGNORE).sum())
    if format == "text":
        assert len(packed) == 1 and trained == sum(_answer_tokens(format, r) - 1 for r in rows)
    else:
        assert trained == sum(_answer_tokens(format, r) for r in rows)
        assert len(packed) < len(rows)  # examples share rows


def test_chat_answers_are_the_templates_assistant_turns_and_the_prompt_ends_with_the_generation_prompt(
        tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    row = ROWS["chat"][0]
    ids, labels = render_example(row, "chat", hf)  # a transformers tokenizer works as it is
    trained = [token for token, label in zip(ids, labels) if label != IGNORE]
    assert hf.decode(trained) == "hi <|end|> fine thanks <|end|>"
    prompt, answer = prompt_and_answer(row, "chat", hf)
    assert prompt == hf.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_dict=False)
    assert hf.decode(answer) == "fine thanks <|end|>" and ids[:len(prompt) + len(answer)] == prompt + answer
    plain = prompt_and_answer(ROWS["prompt_completion"][0], "prompt_completion", hf)
    assert plain == (hf.encode("add two and three", add_special_tokens=False), [hf.convert_tokens_to_ids("five"),
                                                                             hf.eos_token_id])


@pytest.mark.parametrize("format", list(ROWS))
def test_each_format_is_detected_from_its_fields(format) -> None:
    assert detect_format(ROWS[format], "rows.jsonl") == format


def test_overridden_field_names_render(tokenizer_dir, tmp_path) -> None:
    rows = [{"question": "reverse abc", "answer": "cba"}]
    task = _task(tmp_path, rows, tokenizer_dir, format="prompt_completion",
                 fields={"prompt": "question", "completion": "answer"})
    packed = load_rows(task.stages[0].sources[0], task, tokenizer_for(task, "tiny", 64), 8, None)
    assert int((packed.labels != IGNORE).sum()) == 2


@pytest.mark.parametrize("rows,message", [
    ([{"text": "a", "prompt": "b", "completion": "c"}], "rows.jsonl, row 1: the fields fit several formats"),
    ([{"prompt": "b", "completion": "c"}, {"messages": []}], "rows.jsonl, row 2: chat (messages), but row 1 is "
                                                           "prompt_completion"),
    ([{"question": "b"}], "rows.jsonl, row 1: no format's fields"),
])
def test_ambiguous_mixed_or_unknown_rows_are_refused_naming_the_row(rows, message) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        detect_format(rows, "rows.jsonl")


def test_a_bad_row_names_the_file_the_row_and_the_missing_field(tmp_path, tokenizer_dir) -> None:
    rows = [ROWS["chat"][1], {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}]
    task = _task(tmp_path, rows, tokenizer_dir)
    with pytest.raises(UsageError) as error:
        load_rows(task.stages[0].sources[0], task, tokenizer_for(task, "tiny", 64), 16, None)
    assert str(error.value) == (f"{tmp_path / 'rows.jsonl'}, line 2 (row 2): 'messages' turn 2: no field 'content' "
                                "(or it is not a string) (chat format)")


def test_legacy_file_types_in_format_move_to_file_type() -> None:
    assert DataSource(path="a.parquet", format="parquet").file_type == "parquet"
    legacy = DataSource(path="a.jsonl", format="jsonl", text_field="body")
    assert (legacy.format, legacy.file_type, legacy.field_names()["text"]) == ("text", "jsonl", "body")
    assert DataSource(path="a.jsonl", format="chat").format == "chat"


def test_train_with_data_detects_the_format_and_refuses_mixed_rows_in_one_line(tmp_path) -> None:
    runner = CliRunner()
    plan = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--seq-len", "64", "--global-batch", "2", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"text": "c"}) + "\n")
    result = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--data", str(mixed)])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"{mixed}, row 2: text (text), but row 1 is prompt_completion" in result.stderr
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"what is {i}", "completion": "the sky is blue " * 3}) + "\n"
                            for i in range(40)))
    from specs.plan_file import load_plan
    from trainer.one_stage import one_stage_plan

    one_stage, _ = one_stage_plan(load_plan(plan), str(good), tmp_path / "run2", steps=1, tokens=None)
    assert one_stage.task.stages[0].sources[0].format == "prompt_completion"  # fixed in the run's plan


# -- packing keeps documents apart ----------------------------------------------------------------


def _model(attn: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), attn_implementation=attn)


def _examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    return [render_example(row, format, tokenizer) for format in ("chat", "alpaca", "sharegpt", "prompt_completion")
            for row in ROWS[format]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_see_only_themselves(tmp_path, tokenizer_dir, attn) -> None:
    """Each document's loss in a packed row equals its loss alone; without the position ids the
    packed documents would see their neighbours, and the losses differ."""
    import torch

    from trainer.batch import MicroBatch
    from trainer.engines.plain import PlainEngine
    from specs.core import Layout
    from trainer.stream import pack_examples

    examples = _examples(_tokenizer(tmp_path / "tok"))
    seq = 48
    packed = pack_examples(examples, seq)
    assert len(packed) < len(examples)
    engine = PlainEngine(_model(attn), Layout(seq=seq, dtype="fp32"), clip=0.0)
    starts = np.argwhere(packed.positions == 0)  # (row, column) of each segment, padding included
    alone, together, leaky = [], [], []
    with torch.no_grad():
        for (row, col), end in zip(starts, [*starts[1:, 1], None]):
            end = seq if end is None or end <= col else end
            ids, labels = packed.ids[row, col:end], packed.labels[row, col:end]
            if not (labels != IGNORE).any():
                continue  # padding
            single = MicroBatch.from_arrays(ids[None].copy(), labels[None].copy(), None)
            alone.append(float(engine.model(**single.model_inputs()).loss))
            only = np.full_like(packed.labels[row:row + 1], IGNORE)
            only[0, col:end] = labels
            batch = MicroBatch.from_arrays(packed.ids[row:row + 1].copy(), only, packed.positions[row:row + 1].copy())
            together.append(float(engine.model(**batch.model_inputs()).loss))
            batch.position_ids = None
            leaky.append(float(engine.model(**batch.model_inputs()).loss))
    assert len(alone) == len(examples)
    assert together == pytest.approx(alone, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(leaky, alone)) > 1e-3  # the check can fail


# -- and so do the sharded and pipeline engines (2 ranks) ----------------------------------------

SEQ = 48
LAYOUTS = {  # each step reads the same four packed rows: 2 per replica, or all 4 through one pipeline
    "fsdp2_zero3": {"dp": 2, "zero": 3, "mbs": 1, "gas": 2},
    "tensor_parallel": {"tp": 2, "mbs": 2, "gas": 2},
    "pipeline": {"pp": 2, "mbs": 1, "gas": 4},
}


def _packed_rows(folder: Path):
    from trainer.stream import pack_examples

    examples = _examples(_tokenizer(folder)) * 2
    packed = pack_examples(examples, SEQ)
    assert len(packed) >= 4 and (packed.positions[:4, 1:] == 0).any()  # rows hold several documents
    return packed


def _losses(layout, packed, rank_of_data) -> list[float]:
    """Two optimizer steps of `layout` on the four packed rows; each step's mean micro-batch loss."""
    from specs.core import ModelSpec
    from trainer.batch import MicroBatch
    from trainer.engines import make_engine
    from trainer.model import build_model

    model = build_model(ModelSpec(name="tiny", hf_config=CONFIG), layout, seed=0)
    engine = make_engine(model, layout, None, clip=0.0, engine="fsdp2" if layout.pp == 1 else "auto")
    data_rank = rank_of_data(engine)
    losses = []
    for _ in range(2):
        step = []
        for micro in range(layout.gas):
            first = (micro * layout.dp + data_rank) * layout.mbs
            rows = slice(first, first + layout.mbs)
            step.append(engine.micro_step(MicroBatch.from_arrays(packed.ids[rows].copy(), packed.labels[rows].copy(),
                                                                 packed.positions[rows].copy())))
        engine.optimizer_step(1e-2)
        losses.append(float(np.mean([x for x in step if x is not None])))
    return losses


def _rank_packed(rank: int, world: int, port: int, out_dir: str) -> None:
    from specs.core import Layout
    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=True, threads=1)
    packed = _packed_rows(Path(out_dir) / f"tok{rank}")
    results = {name: _losses(Layout(seq=SEQ, dtype="fp32", **fields), packed, lambda e: e.data_rank)
               for name, fields in LAYOUTS.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finish_rank(True)


@pytest.mark.slow
def test_sharded_and_pipeline_engines_keep_packed_documents_apart(tmp_path) -> None:
    """FSDP2, tensor parallel and the pipeline train packed rows as the plain engine does, which
    keeps their documents apart (test above)."""
    import torch.distributed.fsdp  # noqa: F401  (imported before forking)
    import torch.distributed.pipelining  # noqa: F401

    from specs.core import Layout
    from profiler.ranks import free_port, launch

    packed = _packed_rows(tmp_path / "tok")
    # one process, the same micro-batches (a micro-batch's loss is the mean over its trained tokens)
    reference = {mbs: _losses(Layout(seq=SEQ, dtype="fp32", mbs=mbs, gas=4 // mbs), packed, lambda e: 0)
                 for mbs in (1, 2)}
    launch(_rank_packed, 2, (2, free_port(), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, fields in LAYOUTS.items():
        measured = [sum(r[name][s] for r in ranks) / 2 for s in range(2)] if name.startswith("fsdp2") else ranks[1][name]
        assert measured == pytest.approx(reference[fields["mbs"]], abs=1e-5), name


def test_a_chat_task_trains_and_evaluates_on_its_answers(tmp_path, tokenizer_dir) -> None:
    from specs.plan_file import load_plan
    from specs.core import ModelSpec
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware
    from trainer.loop import train
    from trainer.options import TrainOptions

    rows = [row for _ in range(20) for row in ROWS["chat"]]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskSpec.model_validate({
        "name": "chat", "base_dir": str(tmp_path), "seq_len": 32, "global_batch": 2,
        "data": {"tokenizer": str(tokenizer_dir)},
        "stages": [{"name": "answers", "steps": 3, "warmup_steps": 0, "sources": [{"path": "chat.jsonl"}],
                    "eval_sources": [{"path": "chat.jsonl"}], "eval_tokens": 64}]})
    plan = make_plan(PlanOptions(model=ModelSpec(name="tiny", hf_config=CONFIG), hardware=load_hardware("cpu"),
                                 gpus_per_node=1, task=task, min_compute_fraction=0.0))
    plan.write(tmp_path / "plan.yaml")
    summary = train(load_plan(tmp_path / "plan.yaml"), tmp_path / "run", resume=False,
                    options=TrainOptions(show_progress=False, eval_sequences=4))
    assert summary["finished"] and summary["steps"] == 3 and summary["nan"] is False
    assert np.isfinite(summary["stages"][0]["eval"]["answers"])


def test_prepare_refuses_rows_that_are_not_text_in_one_line(tmp_path) -> None:
    from trainer.data.prepare import prepare

    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS["chat"]))
    task = TaskSpec.model_validate({"name": "t", "base_dir": str(tmp_path), "model": "demo-tiny",
                                    "stages": [{"name": "s", "tokens": 10, "sources": [{"path": "chat.jsonl"}]}]})
    with pytest.raises(UsageError, match="`advisor data prepare` shards text rows only, these are chat"):
        prepare(task, tmp_path / "out")


def test_a_stream_picks_the_same_row_of_ids_labels_and_positions() -> None:
    from trainer.stream import Packed, Source, StageStream

    ids = np.arange(40, dtype=np.int64).reshape(10, 4)
    sources = [Source.of("a", Packed(ids, ids + 1000, ids + 2000), 0.5),
               Source.of("b", Packed(ids + 100, ids + 1100, ids + 2100), 0.5)]
    rows = StageStream(sources, seed=0, stage_index=0).rows(0, 64)
    assert np.array_equal(rows.labels, rows.ids + 1000) and np.array_equal(rows.positions, rows.ids + 2000)
    assert len(np.unique(rows.ids[:, 0] // 100)) == 2  # both sources drawn


def test_an_example_longer_than_a_row_keeps_its_beginning_or_is_dropped_without_an_answer() -> None:
    from trainer.stream import pack_examples

    long_answer = (list(range(1, 14)), [IGNORE] * 3 + list(range(4, 14)))  # prompt 3, answer 10
    long_prompt = (list(range(1, 14)), [IGNORE] * 10 + list(range(11, 14)))  # prompt 10, answer 3
    packed = pack_examples([long_answer, long_prompt], seq=8)
    assert len(packed) == 1 and packed.ids[0].tolist() == list(range(1, 9))
    assert packed.labels[0].tolist() == [IGNORE] * 3 + list(range(4, 9))
