"""Data as LLaMA-Factory and Axolotl users have it: JSON arrays, tool calls, files named for
another kind. Each file here is written in a tool's shipped shape; its rows are read, rendered and
labelled, and the labels compared with ones rebuilt from the rendered conversation text of
`tokenizer.apply_chat_template` (the answers located in the text, not by the renderer's prefix
method)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specs.errors import UsageError
from specs.task import DataSource, TaskSpec
from trainer.batch import IGNORE
from trainer.corpus import load_rows, tokenizer_for
from trainer.data import json_array
from trainer.data.formats import render_example, source_format
from trainer.data.sources import expand_source_path, file_type_of, read_rows

# A ChatML template that shows tools and tool calls (written for these tests)
TEMPLATE = (  # no whitespace control: the template string has no newlines of its own to strip
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?<\|im_end\|>\n)", re.S)  # a turn's role, and its text after the header

ALPACA = [  # alpaca_en_demo.json's shape
    {"instruction": "Name a primary colour.", "input": "", "output": "Red."},
    {"instruction": "Reverse the word.", "input": "stressed", "output": "desserts"},
    {"instruction": "And now?", "input": "", "output": "Blue.", "system": "Be brief.",
     "history": [["Name a colour.", "Green."]]},
]
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
GLAIVE = [  # glaive_toolcall_en_demo.json's shape: tools as a JSON string, function_call/observation turns
    {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": json.dumps({"temp": 21})},
        {"from": "gpt", "value": "It is 21 degrees in Paris."}],
     "tools": json.dumps([WEATHER_TOOL])},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}], "tools": "[]",
     "system": "You help."},
]
# GLAIVE's rows as the OpenAI-style messages and tools a template takes, written out by hand
GLAIVE_TOOLS = [{"type": "function", "function": WEATHER_TOOL}]
GLAIVE_MESSAGES = [
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": '{"temp": 21}'},
     {"role": "assistant", "content": "It is 21 degrees in Paris."}],
    [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}],
]
OPENAI = [  # OpenAI fine-tuning rows: tool_calls with string arguments, tool messages, content parts
    {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You help "}, {"type": "text", "text": "briefly."}]},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
        {"role": "assistant", "content": [{"type": "text", "text": "Minus three."}]}],
     "tools": [{"type": "function", "function": WEATHER_TOOL}]},
]


def _tokenizer(folder: Path):
    """One token per byte, plus ChatML's markers as special tokens (259 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chatml")
    _tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _truth(hf, messages: list[dict], tools: list[dict] | None = None, roles: tuple[str, ...] = ("assistant",),
           last_only: bool = False) -> tuple[list[int], list[int]]:
    """Ids of the rendered conversation and labels that train exactly each assistant block's (or
    each block of `roles`; only the last with `last_only`) text after its header, through its
    <|im_end|> and newline, located in the rendered string."""
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [match.span(2) for match in TURN.finditer(text) if match.group(1) in roles]
    spans = spans[-1:] if last_only else spans
    labels = [token if any(a <= start and end <= b for a, b in spans) else IGNORE
              for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    return encoded["input_ids"], labels


def _source(tmp_path: Path, name: str, tokenizer_dir: Path, **fields) -> tuple[TaskSpec, DataSource]:
    task = TaskSpec.model_validate({"name": "t", "base_dir": str(tmp_path), "data": {"tokenizer": str(tokenizer_dir)},
                                    "stages": [{"name": "s", "tokens": 10, "sources": [{"path": name, **fields}]}]})
    return task, task.stages[0].sources[0]


def _rendered(tmp_path: Path, source: DataSource, tokenizer) -> tuple[str, list[tuple[list[int], list[int]]]]:
    """The detected format and each row rendered, read as the trainer reads the source."""
    format = source_format(source, tmp_path)
    file_type = file_type_of(tmp_path, source)
    rows = [row for path in expand_source_path(tmp_path, source.path, file_type) for row in read_rows(path, file_type)]
    return format, [render_example(row, format, tokenizer, source.field_names()) for row in rows]


def _check_packed(tmp_path, task, source, tokenizer, expected: list[tuple[list[int], list[int]]]) -> None:
    """The packed rows train exactly the answers' tokens (labels shifted: a row's first never counts)."""
    packed = load_rows(source, task, tokenizer, 512, None)
    trained = sorted(int(t) for t in packed.labels[:, 1:][packed.labels[:, 1:] != IGNORE])
    assert trained == sorted(t for _, labels in expected for t in labels if t != IGNORE)


def test_an_alpaca_json_array_file_trains_its_outputs(tmp_path, tokenizer_dir, hf) -> None:
    (tmp_path / "alpaca_en_demo.json").write_text(json.dumps(ALPACA, indent=2))
    task, source = _source(tmp_path, "alpaca_en_demo.json", tokenizer_dir)
    tokenizer = tokenizer_for(task, "tiny", 512)
    format, documents = _rendered(tmp_path, source, tokenizer)
    assert format == "alpaca" and file_type_of(tmp_path, source) == "json"
    expected = [_truth(hf, [{"role": "user", "content": "Name a primary colour."},
                            {"role": "assistant", "content": "Red."}]),
                _truth(hf, [{"role": "user", "content": "Reverse the word.\n\nstressed"},
                            {"role": "assistant", "content": "desserts"}]),
                _truth(hf, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                            {"role": "assistant", "content": "Green."}, {"role": "user", "content": "And now?"},
                            {"role": "assistant", "content": "Blue."}])]
    assert documents == expected
    assert hf.decode([t for t in expected[2][1] if t != IGNORE]) == "Green.<|im_end|>\nBlue.<|im_end|>\n"
    _check_packed(tmp_path, task, source, tokenizer, expected)


def test_a_sharegpt_array_with_tool_calls_and_a_tools_column_trains_the_calls_and_answers(
        tmp_path, tokenizer_dir, hf) -> None:
    (tmp_path / "glaive_toolcall_en_demo.json").write_text(json.dumps(GLAIVE, indent=2))
    task, source = _source(tmp_path, "glaive_toolcall_en_demo.json", tokenizer_dir)
    tokenizer = tokenizer_for(task, "tiny", 512)
    format, documents = _rendered(tmp_path, source, tokenizer)
    expected = [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS), _truth(hf, GLAIVE_MESSAGES[1])]
    assert format == "sharegpt" and documents == expected
    trained = hf.decode([t for t in expected[0][1] if t != IGNORE])
    assert trained == ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
                       "It is 21 degrees in Paris.<|im_end|>\n")
    assert '"description": "Weather of a city"' in hf.decode(expected[0][0])  # the tools are shown, not trained
    _check_packed(tmp_path, task, source, tokenizer, expected)


def test_openai_messages_with_tool_calls_and_text_parts_train_the_calls_and_answers(
        tmp_path, tokenizer_dir, hf) -> None:
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(row) + "\n" for row in OPENAI))
    task, source = _source(tmp_path, "tools.jsonl", tokenizer_dir)
    tokenizer = tokenizer_for(task, "tiny", 512)
    format, documents = _rendered(tmp_path, source, tokenizer)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    expected = [_truth(hf, [{"role": "system", "content": "You help briefly."},
                            {"role": "user", "content": "Weather in Oslo?"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "-3"},
                            {"role": "assistant", "content": "Minus three."}], OPENAI[0]["tools"])]
    assert format == "chat" and documents == expected
    assert hf.decode([t for t in expected[0][1] if t != IGNORE]) == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n'
        "Minus three.<|im_end|>\n")


@pytest.mark.parametrize("row,column", [
    ({"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A cat."}],
      "images": ["cat.png"]}, "field 'images' holds media"),
    ({"conversations": [{"from": "human", "value": "<video>Say?"}, {"from": "gpt", "value": "Hi"}],
      "videos": ["a.mp4"]}, "field 'videos' holds media"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                {"type": "image_url", "image_url": {"url": "x.png"}}]},
                   {"role": "assistant", "content": "A cat."}]}, "'content' has a image_url part"),
])
def test_rows_with_images_audio_or_video_are_refused_in_one_line_naming_the_column(
        tmp_path, tokenizer_dir, row, column) -> None:
    (tmp_path / "mm.json").write_text(json.dumps([row]))
    task, source = _source(tmp_path, "mm.json", tokenizer_dir)
    with pytest.raises(UsageError) as error:
        load_rows(source, task, tokenizer_for(task, "tiny", 512), 64, None)
    assert f"{tmp_path / 'mm.json'}, row 1: " in str(error.value) and column in str(error.value)
    assert "text-only" in str(error.value) and "\n" not in str(error.value)


def test_a_template_that_ignores_tools_is_refused(tmp_path) -> None:
    plain = _tokenizer(tmp_path / "tok")
    plain.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    plain.save_pretrained(tmp_path / "plain")
    (tmp_path / "glaive.json").write_text(json.dumps(GLAIVE))
    task, source = _source(tmp_path, "glaive.json", tmp_path / "plain")
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'glaive.json'}, row 1: the tokenizer's chat template "
                                                   "ignores `tools`")):
        load_rows(source, task, tokenizer_for(task, "tiny", 512), 512, None)


# -- files told by their content -----------------------------------------------------------------


def _write_every_kind(folder: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as a JSON array, JSON lines, parquet, CSV and arrow under misleading or no
    extensions, and a `save_to_disk` folder."""
    import datasets

    kinds = {"json": folder / "array.jsonl", "jsonl": folder / "lines.json", "parquet": folder / "table.json",
             "csv": folder / "table.csv", "hf_disk": folder / "saved"}
    kinds["json"].write_text("\n" + json.dumps(rows, indent=1))
    kinds["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), kinds["parquet"])
    datasets.Dataset.from_list(rows).to_csv(kinds["csv"], index=False)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(kinds["hf_disk"]))
    (arrow,) = (kinds["hf_disk"] / "train").glob("*.arrow")  # an Arrow IPC stream
    kinds["arrow"] = folder / "table.bin"
    kinds["arrow"].write_bytes(arrow.read_bytes())
    return kinds


def test_files_are_read_by_their_content_not_their_name(tmp_path) -> None:
    rows = [{"instruction": f"say {i}", "input": "", "output": f"{i}"} for i in range(5)]
    for kind, path in _write_every_kind(tmp_path, rows).items():
        source = DataSource(path=str(path))
        assert file_type_of(tmp_path, source) == kind
        assert list(read_rows(path, file_type_of(tmp_path, source))) == rows, kind
    prose = tmp_path / "notes.md"
    prose.write_text("Plain words.\n\nA second paragraph.\n")
    assert list(read_rows(prose, file_type_of(tmp_path, DataSource(path=str(prose))))) == [
        {"text": "Plain words."}, {"text": "A second paragraph.\n"}]
    broken = tmp_path / "broken.jsonl"  # named JSON lines, first line damaged: an error, not text to train on
    broken.write_text('"text": "a"}\n')
    with pytest.raises(UsageError, match=rf"{re.escape(str(broken))}, line 1: not valid JSON"):
        list(read_rows(broken, file_type_of(tmp_path, DataSource(path=str(broken)))))


def test_a_json_array_streams_across_chunks_and_names_the_line_of_a_bad_row(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(json_array, "CHUNK_CHARS", 7)  # every row spans several reads
    rows = [{"text": "é" * i, "n": [i, {"deep": "]["}]} for i in range(30)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2))
    assert list(json_array.read_json_array(path)) == rows
    lines = json.dumps(rows[:3], indent=2).splitlines()
    path.write_text("\n".join(lines[:-2] + ['  },', '  {"text": oops}', ']']))  # a fourth row, not JSON
    with pytest.raises(UsageError, match=rf"{re.escape(str(path))}, line {len(lines)}: not valid JSON"):
        list(json_array.read_json_array(path))
    path.write_text('[{"text": "a"}, {"text": "b"')
    with pytest.raises(UsageError, match="not valid JSON in the array"):
        list(json_array.read_json_array(path))
    path.write_text('[{"text": "a"},\n')
    with pytest.raises(UsageError, match="the JSON array is not closed"):
        list(json_array.read_json_array(path))
    path.write_text('[{"text": "a"}, 3]')
    with pytest.raises(UsageError, match="row 2: expected a JSON object, got int"):
        list(json_array.read_json_array(path))


# -- through the CLI -------------------------------------------------------------------------------


@pytest.mark.slow
def test_advisor_train_data_json_trains_a_tool_call_array_on_its_answers(tmp_path, hf) -> None:
    """`advisor train --data glaive.json` of a tiny model for 2 steps, from a --weights folder whose
    tokenizer has the tool-calling template; the packed rows it trained on hold exactly the answers'
    tokens (function calls included) that the rebuilt labels hold."""
    import os
    import subprocess
    import sys

    import numpy as np
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM
    from typer.testing import CliRunner

    from advisor.cli import app
    from presets import load_model

    weights = tmp_path / "weights"
    config = dict(load_model("demo-tiny").hf_config)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(weights)
    _tokenizer(weights)
    data = tmp_path / "glaive_toolcall_en_demo.json"
    data.write_text(json.dumps(GLAIVE * 8, indent=2))
    plan = tmp_path / "plan.yaml"
    made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                    "--seq-len", "512", "--global-batch", "2", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(run), "--data",
                           str(data), "--weights", str(weights), "--steps", "2"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)
    assert yaml.safe_load((run / "plan.yaml").read_text())["task"]["stages"][0]["sources"][0]["format"] == "sharegpt"
    (cached,) = (run / "data_cache").glob("*.npz")
    with np.load(cached) as packed:
        labels = packed["labels"]
    trained = sorted(int(t) for t in labels[:, 1:][labels[:, 1:] != IGNORE])
    truth = [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS), _truth(hf, GLAIVE_MESSAGES[1])] * 8
    assert trained == sorted(t for _, row_labels in truth for t in row_labels if t != IGNORE)


# -- LLaMA-Factory's registry ----------------------------------------------------------------------


REGISTRY = {
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "glaive_toolcall_en_demo": {"file_name": "glaive_toolcall_en_demo.json", "formatting": "sharegpt",
                                "columns": {"messages": "conversations", "tools": "tools"}},
    "qa_custom": {"file_name": "qa", "columns": {"prompt": "question", "response": "answer", "history": "earlier",
                                                 "system": "persona"}},
    "openai_like": {"file_name": "openai_like.jsonl", "formatting": "sharegpt",
                    "columns": {"messages": "messages"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant", "system_tag": "system"}},
    "mllm_demo": {"file_name": "mllm_demo.json", "formatting": "sharegpt",
                  "columns": {"messages": "messages", "images": "images"}},
    "from_hub": {"hf_hub_url": "someone/somedata"},
    "pairs": {"file_name": "alpaca_en_demo.json", "ranking": True,
              "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}},
}


def test_a_llama_factory_registry_reads_its_datasets_as_it_ships(tmp_path, tokenizer_dir, hf) -> None:
    from trainer.data.registry import registry_sources

    data = tmp_path / "data"
    (data / "qa").mkdir(parents=True)
    (data / "dataset_info.json").write_text(json.dumps(REGISTRY, indent=2))
    (data / "alpaca_en_demo.json").write_text(json.dumps(ALPACA[:2]))
    (data / "glaive_toolcall_en_demo.json").write_text(json.dumps(GLAIVE[:1]))
    (data / "qa" / "part-0.json").write_text(json.dumps(
        {"question": "And blue?", "answer": "Sky.", "earlier": [["Red?", "Fire."]], "persona": "Poet."}) + "\n")
    (data / "openai_like.jsonl").write_text(json.dumps({"messages": [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}]}) + "\n")
    names = ["alpaca_en_demo", "glaive_toolcall_en_demo", "qa_custom", "openai_like"]
    sources = registry_sources(data, names)
    assert [s.format for s in sources] == ["alpaca", "sharegpt", "alpaca", "sharegpt"]
    task = TaskSpec.model_validate({"name": "t", "base_dir": str(tmp_path), "data": {"tokenizer": str(tokenizer_dir)},
                                    "stages": [{"name": "s", "tokens": 10,
                                                "sources": [s.model_dump() for s in sources]}]})
    tokenizer = tokenizer_for(task, "tiny", 512)
    expected = {
        "alpaca_en_demo": [_truth(hf, [{"role": "user", "content": "Name a primary colour."},
                                       {"role": "assistant", "content": "Red."}]),
                           _truth(hf, [{"role": "user", "content": "Reverse the word.\n\nstressed"},
                                       {"role": "assistant", "content": "desserts"}])],
        "glaive_toolcall_en_demo": [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS)],
        "qa_custom": [_truth(hf, [{"role": "system", "content": "Poet."}, {"role": "user", "content": "Red?"},
                                  {"role": "assistant", "content": "Fire."}, {"role": "user", "content": "And blue?"},
                                  {"role": "assistant", "content": "Sky."}])],
        "openai_like": [_truth(hf, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello."}])],
    }
    for name, source in zip(names, task.stages[0].sources):
        _, documents = _rendered(tmp_path, source, tokenizer)
        assert documents == expected[name], name


@pytest.mark.parametrize("name,message", [
    ("mllm_demo", "dataset 'mllm_demo' has an images column ('images'): training here is text-only"),
    ("from_hub", "dataset 'from_hub' is fetched by LLaMA-Factory (hf_hub_url); nothing is downloaded here"),
    ("pairs", "dataset 'pairs' is preference data"),
    ("missing", "dataset 'missing' is not in"),
])
def test_registry_entries_this_trainer_cannot_honour_are_refused_in_one_line(tmp_path, name, message) -> None:
    from trainer.data.registry import registry_sources

    (tmp_path / "dataset_info.json").write_text(json.dumps(REGISTRY))
    (tmp_path / "mllm_demo.json").write_text("[]")
    with pytest.raises(UsageError, match=re.escape(message)):
        registry_sources(tmp_path / "dataset_info.json", [name])


def test_data_prepare_reads_text_rows_of_every_kind_in_batches(tmp_path) -> None:
    """`advisor data prepare` reads sources in batches (`read_batches`): the same rows whatever the kind."""
    from trainer.data.sources import read_batches

    texts = [f"document number {i}" for i in range(7)]
    for kind, path in _write_every_kind(tmp_path, [{"text": t} for t in texts]).items():
        batches = list(read_batches(path, file_type_of(tmp_path, DataSource(path=str(path))), "text", batch_size=3))
        assert [t for b in batches for t in b.texts] == texts, kind
        assert [b.first_row for b in batches] == [sum(len(x) for x in batches[:i]) for i in range(len(batches))]


def test_a_file_that_is_one_json_object_over_several_lines_is_explained(tmp_path) -> None:
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 1, "data": ALPACA}, indent=2))
    with pytest.raises(UsageError, match="one JSON object spread over several lines, not JSON lines; its rows seem "
                                         "to be the list under 'data'"):
        list(read_rows(wrapped, file_type_of(tmp_path, DataSource(path=str(wrapped)))))
    pretty = tmp_path / "pretty.jsonl"
    pretty.write_text(json.dumps(ALPACA[0], indent=2))
    with pytest.raises(UsageError, match="write one object per line"):
        list(read_rows(pretty, file_type_of(tmp_path, DataSource(path=str(pretty)))))


def test_axolotl_conversations_with_role_and_content_keys_read_as_sharegpt(hf) -> None:
    row = {"conversations": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello!"}]}
    assert render_example(row, "sharegpt", hf) == _truth(hf, GLAIVE_MESSAGES[1])


def test_a_row_the_chat_template_raises_on_is_refused_naming_the_row(tmp_path, tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    strict = AutoTokenizer.from_pretrained(tokenizer_dir)
    strict.chat_template = ("{% for m in messages %}{% if m.tool_calls and m.tool_calls | length > 1 %}"
                            "{{ raise_exception('one tool call per turn') }}{% endif %}{{ m.content }}{% endfor %}")
    strict.save_pretrained(tmp_path / "strict")
    two_calls = {"messages": [{"role": "user", "content": "Both?"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": "{}"}},
        {"type": "function", "function": {"name": "b", "arguments": "{}"}}]}]}
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": GLAIVE_MESSAGES[1]}) + "\n" +
                                         json.dumps(two_calls) + "\n")
    task, source = _source(tmp_path, "rows.jsonl", tmp_path / "strict")
    with pytest.raises(UsageError) as error:
        load_rows(source, task, tokenizer_for(task, "tiny", 512), 512, None)
    assert str(error.value).startswith(f"{tmp_path / 'rows.jsonl'}, line 2 (row 2): the chat template of ")
    assert "refuses this row: one tool call per turn (chat format)" in str(error.value)


def _registry_and_plan(tmp_path: Path) -> tuple[Path, Path]:
    """A LLaMA-Factory data folder (the registry, an alpaca and a tool-call dataset) and a demo-tiny plan
    made without a task, as `advisor train --data data/dataset_info.json --dataset ...` gets them."""
    from typer.testing import CliRunner

    from advisor.cli import app

    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(REGISTRY))
    (data / "alpaca_en_demo.json").write_text(json.dumps(ALPACA[:2] * 30))
    (data / "glaive_toolcall_en_demo.json").write_text(json.dumps(GLAIVE * 5))
    plan = tmp_path / "plan.yaml"
    made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                    "--seq-len", "512", "--global-batch", "2", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    return data, plan


def test_a_one_stage_plan_reads_registry_datasets_concatenated(tmp_path, tokenizer_dir) -> None:
    """What `advisor train --data data/dataset_info.json --dataset a,b` calls: one stage over both
    datasets, each weighed by its share of the sequences they pack into (LLaMA-Factory concatenates)."""
    from specs.plan_file import load_plan
    from trainer.one_stage import one_stage_plan

    data, plan = _registry_and_plan(tmp_path)
    one_stage, _ = one_stage_plan(load_plan(plan), str(data), tmp_path / "run", None, None, weights=str(tokenizer_dir),
                                  datasets=["alpaca_en_demo", "glaive_toolcall_en_demo"])
    sources = one_stage.task.stages[0].sources
    assert [(Path(s.path).name, s.format) for s in sources] == [("alpaca_en_demo.json", "alpaca"),
                                                                  ("glaive_toolcall_en_demo.json", "sharegpt")]
    task = one_stage.task.model_copy(update={"data": one_stage.task.data.model_copy(
        update={"tokenizer": str(tokenizer_dir)})})
    tokenizer = tokenizer_for(task, "tiny", 512)
    counts = [len(load_rows(s, task, tokenizer, 512, None)) for s in sources]
    assert [s.weight for s in sources] == pytest.approx([n / sum(counts) for n in counts]) and counts[0] != counts[1]
    assert one_stage.stages[0].steps == -(-sum(counts) * 512 // (512 * 2))  # one pass, in whole steps


def test_advisor_train_hands_dataset_names_to_the_one_stage_plan(tmp_path, monkeypatch) -> None:
    """`advisor train --data DIR/dataset_info.json --dataset a,b` plans one stage over those registry
    datasets (the function the test above reads them through); an empty --dataset is one line, exit 2."""
    from typer.testing import CliRunner

    import trainer.one_stage
    from advisor.cli import app
    from specs.errors import UsageError

    seen = []

    def one_stage_plan(plan, data, run_dir, steps, tokens, epochs=None, weights=None, datasets=None, **settings):
        seen.append((Path(data).name, datasets))
        raise UsageError("stopped here by the test")

    monkeypatch.setattr(trainer.one_stage, "one_stage_plan", one_stage_plan)
    plan = tmp_path / "plan.yaml"
    made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                    "--global-batch", "2", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    registry = tmp_path / "data" / "dataset_info.json"
    registry.parent.mkdir()
    registry.write_text(json.dumps(REGISTRY))
    done = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--data", str(registry),
                                    "--dataset", "alpaca_en_demo, qa_custom", "--steps", "1"])
    assert done.exit_code == 2 and "stopped here by the test" in done.output
    assert seen == [("dataset_info.json", ["alpaca_en_demo", "qa_custom"])]
    empty = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / "run2"), "--data", str(registry),
                                     "--dataset", " , ", "--steps", "1"])
    assert empty.exit_code == 2 and "--dataset" in empty.output


# -- which tokens train: train_on_prompt, mask_history, roles_to_train ---------------------------------


MULTI_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "Green."}, {"role": "user", "content": "And now?"},
              {"role": "assistant", "content": "Blue."}]


@pytest.mark.parametrize("switches,truth", [
    ({}, {}),
    ({"mask_history": True}, {"last_only": True}),
    ({"roles_to_train": ["user", "assistant"]}, {"roles": ("user", "assistant")}),
    ({"roles_to_train": ["user", "assistant"], "mask_history": True}, {"roles": ("user", "assistant"),
                                                                      "last_only": True}),
])
def test_a_sources_loss_switches_train_the_turns_they_name(tmp_path, tokenizer_dir, hf, switches, truth) -> None:
    """A multi-turn alpaca row (history) and a tool-call row, read as the trainer reads a source with
    LLaMA-Factory's mask_history or Axolotl's roles_to_train: the labels are the blocks the regex
    finds in apply_chat_template's text (the last one only for mask_history)."""
    (tmp_path / "alpaca.json").write_text(json.dumps(ALPACA[2:]))
    (tmp_path / "glaive.json").write_text(json.dumps(GLAIVE[:1]))
    for name, expected in [("alpaca.json", [_truth(hf, MULTI_TURN, **truth)]),
                           ("glaive.json", [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS, **truth)])]:
        task, source = _source(tmp_path, name, tokenizer_dir, **switches)
        tokenizer = tokenizer_for(task, "tiny", 512)
        packed = load_rows(source, task, tokenizer, 512, None)
        (ids, labels), = expected
        assert packed.ids[0, :len(ids)].tolist() == ids
        assert packed.labels[0, :len(ids)].tolist() == [IGNORE] + labels[1:], (name, switches)
    if truth.get("last_only") and "roles" not in truth:
        assert hf.decode([t for t in expected[0][1] if t != IGNORE]) == "It is 21 degrees in Paris.<|im_end|>\n"


def test_train_on_prompt_trains_every_token_of_chat_and_plain_rows(tmp_path, tokenizer_dir, hf) -> None:
    from trainer.data.formats import LossRule

    every = LossRule(train_on_prompt=True)
    ids, _ = _truth(hf, MULTI_TURN)
    assert render_example(ALPACA[2], "alpaca", hf, rule=every) == (ids, ids)
    plain = tmp_path / "plain"  # no chat template: alpaca rows are plain prompt + output
    _tokenizer(plain)
    (plain / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((plain / "tokenizer_config.json").read_text()).items() if k != "chat_template"}))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(plain)
    assert not bare.chat_template
    text = "Reverse the word.\n\nstressed\n\ndesserts"
    expected = bare(text, add_special_tokens=False)["input_ids"] + [bare.eos_token_id]
    assert render_example(ALPACA[1], "alpaca", bare, rule=every) == (expected, expected)
    prompt = len(bare("Reverse the word.\n\nstressed\n\n", add_special_tokens=False)["input_ids"])
    assert render_example(ALPACA[1], "alpaca", bare)[1] == [IGNORE] * prompt + expected[prompt:]


def test_train_on_prompt_and_mask_history_exclude_each_other(tmp_path) -> None:
    with pytest.raises(ValueError, match="mask_history .* and train_on_prompt .* exclude each other"):
        DataSource(path="x.json", train_on_prompt=True, mask_history=True)


# -- Axolotl's datasets: block ------------------------------------------------------------------------


AXOLOTL_CONFIG = """\
base_model: ./weights
train_on_inputs: false
datasets:
  - path: alpaca_en_demo.json
    type: alpaca
  - path: chats.jsonl
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: from
      content: value
    roles_to_train: [assistant]
  - path: notes.jsonl
    ds_type: json
    type: completion
    field: body
"""
NOTES = [{"body": f"Note {i}: the river runs past the old mill and into the lake. " * 3} for i in range(6)]


def _axolotl_files(folder: Path, copies: int = 1) -> Path:
    (folder / "alpaca_en_demo.json").write_text(json.dumps(ALPACA * copies, indent=2))
    (folder / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GLAIVE * copies))
    (folder / "notes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in NOTES * copies))
    config = folder / "axolotl.yml"
    config.write_text(AXOLOTL_CONFIG)
    return config


def _alpaca_truth(hf) -> list[tuple[list[int], list[int]]]:
    return [_truth(hf, [{"role": "user", "content": "Name a primary colour."},
                        {"role": "assistant", "content": "Red."}]),
            _truth(hf, [{"role": "user", "content": "Reverse the word.\n\nstressed"},
                        {"role": "assistant", "content": "desserts"}]),
            _truth(hf, MULTI_TURN)]


def test_an_axolotl_datasets_block_reads_each_type_as_axolotl_means_it(tmp_path, tokenizer_dir, hf) -> None:
    from trainer.data.axolotl import axolotl_sources

    sources = axolotl_sources(_axolotl_files(tmp_path))
    assert [(Path(s.path).name, s.format) for s in sources] == [
        ("alpaca_en_demo.json", "alpaca"), ("chats.jsonl", "sharegpt"), ("notes.jsonl", "text")]
    task = TaskSpec.model_validate({"name": "t", "base_dir": str(tmp_path), "data": {"tokenizer": str(tokenizer_dir)},
                                    "stages": [{"name": "s", "tokens": 10,
                                                "sources": [s.model_dump() for s in sources]}]})
    tokenizer = tokenizer_for(task, "tiny", 512)
    alpaca, chats, notes = task.stages[0].sources
    assert _rendered(tmp_path, alpaca, tokenizer)[1] == _alpaca_truth(hf)
    assert _rendered(tmp_path, chats, tokenizer)[1] == [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS),
                                                        _truth(hf, GLAIVE_MESSAGES[1])]
    ids = [hf(row["body"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id] for row in NOTES]
    assert _rendered(tmp_path, notes, tokenizer)[1] == [(i, i) for i in ids]  # completion: every token


def test_axolotl_roles_to_train_and_train_on_inputs(tmp_path, tokenizer_dir, hf) -> None:
    from trainer.data.axolotl import axolotl_sources
    from trainer.data.formats import LossRule

    config = _axolotl_files(tmp_path)
    config.write_text(AXOLOTL_CONFIG.replace("[assistant]", "[user, assistant]"))
    chats = axolotl_sources(config)[1]
    row = GLAIVE[0]
    assert render_example(row, "sharegpt", hf, chats.field_names(), LossRule.of(chats)) == _truth(
        hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS, roles=("user", "assistant"))
    config.write_text(AXOLOTL_CONFIG.replace("train_on_inputs: false", "train_on_inputs: true"))
    alpaca = axolotl_sources(config)[0]
    ids, _ = _truth(hf, MULTI_TURN)
    assert render_example(ALPACA[2], "alpaca", hf, alpaca.field_names(), LossRule.of(alpaca)) == (ids, ids)


@pytest.mark.parametrize("edit,message", [
    (("type: alpaca", "type: sharegpt"), "type 'sharegpt' is not supported here (supported: alpaca, chat_template, "
                                         "completion)"),
    (("type: alpaca", "type: {field_instruction: q}"), "is not supported here (supported: alpaca, chat_template"),
    (("path: alpaca_en_demo.json", "path: tatsu-lab/alpaca"), "tatsu-lab/alpaca not found (nothing is downloaded"),
    (("ds_type: json", "shards: 4"), "'shards' is not read here"),
    (("[assistant]", "[gpt]"), "roles_to_train should list some of system, user, assistant, tool"),
    (("      content: value", "      content: value\n      weight: w"), "maps weight; only role and content"),
    (("train_on_inputs: false", "train_on_inputs: false\nnothing: 1\n"), None),  # other top-level keys: not data
])
def test_axolotl_entries_this_trainer_cannot_honour_exit_2_in_one_line(tmp_path, edit, message) -> None:
    """Through `advisor train`: an unsupported type, a hub dataset, a key not honoured is one line,
    exit 2, before any training. Other top-level keys are not data: that config is read, and its
    rows stop at the shipped demo-tiny tokenizer, which has no chat template for alpaca's history."""
    from typer.testing import CliRunner

    from advisor.cli import app

    config = _axolotl_files(tmp_path)
    config.write_text(AXOLOTL_CONFIG.replace(*edit))
    plan = tmp_path / "plan.yaml"
    made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                    "--global-batch", "2", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    done = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--data", str(config),
                                    "--steps", "1"])
    assert done.exit_code == 2, done.output
    if message is None:
        assert "alpaca_en_demo.json, row 3: field 'history' (earlier turns) needs a tokenizer with a chat " \
            "template" in " ".join(done.output.split())
    else:
        assert message in " ".join(done.output.split()) and "Traceback" not in done.output


# -- mixing several datasets ----------------------------------------------------------------------------


def test_mixture_weights_and_one_pass_follow_concat_and_interleave() -> None:
    from trainer.data.mixing import mixture

    assert mixture("concat", None, [30, 10]) == ([30.0, 10.0], 40)
    assert mixture("interleave", [0.7, 0.3], [30, 10]) == ([0.7, 0.3], 34)  # 10 / 0.3 = 33.3 draws: the second runs out
    assert mixture("interleave_under", None, [30, 10]) == ([0.5, 0.5], 20)
    assert mixture("interleave_over", [0.7, 0.3], [30, 10]) == ([0.7, 0.3], 43)  # 30 / 0.7 = 42.9
    with pytest.raises(UsageError, match="gives 3 probabilities for 2 datasets"):
        mixture("interleave", [0.2, 0.3, 0.5], [30, 10])


@pytest.mark.parametrize("flags,message", [
    (["--mix", "zip"], "--mix zip: choose concat, interleave, interleave_under, interleave_over"),
    (["--mix-probs", "0.5,0.5"], "--mix-probs goes with --mix interleave"),
    (["--mix", "interleave", "--mix-probs", "0.7,0.2"], "--mix-probs sum to 0.9, not 1"),
    (["--mix", "interleave", "--mix-probs", "0.7,x"], "give numbers separated by commas"),
    (["--mix", "interleave", "--epochs", "2"], "--epochs counts passes over concatenated datasets"),
    (["--train-on-prompt", "--mask-history"], "exclude each other"),
])
def test_bad_mixing_and_loss_flags_exit_2_in_one_line(tmp_path, flags, message) -> None:
    from typer.testing import CliRunner

    from advisor.cli import app

    plan = tmp_path / "plan.yaml"
    made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                    "--global-batch", "2", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    done = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--data", "x.json", *flags])
    assert done.exit_code == 2 and message in " ".join(done.output.split()), done.output
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_interleaved_registry_datasets_are_drawn_by_their_probabilities(tmp_path, tokenizer_dir) -> None:
    """`--mix interleave --mix-probs 0.25,0.75`: the stage draws its sequences from the datasets by
    those probabilities, and one pass ends when the first runs out (min n_i / p_i sequences)."""
    from specs.plan_file import load_plan
    from trainer.data.mixing import Reading
    from trainer.one_stage import one_stage_plan
    from trainer.stream import EpochOrder

    data, plan = _registry_and_plan(tmp_path)
    reading = Reading(mix="interleave", mix_probs=(0.25, 0.75))
    one_stage, _ = one_stage_plan(load_plan(plan), str(data), tmp_path / "run", None, None, weights=str(tokenizer_dir),
                                  datasets=["alpaca_en_demo", "glaive_toolcall_en_demo"], reading=reading)
    sources = one_stage.task.stages[0].sources
    assert [s.weight for s in sources] == [0.25, 0.75]
    task = one_stage.task.model_copy(update={"data": one_stage.task.data.model_copy(
        update={"tokenizer": str(tokenizer_dir)})})
    counts = [len(load_rows(s, task, tokenizer_for(task, "tiny", 512), 512, None)) for s in sources]
    first_out = min(counts[0] / 0.25, counts[1] / 0.75)
    assert one_stage.stages[0].steps == -(-int(-(-first_out // 1)) * 512 // (512 * 2))
    order = EpochOrder(counts, [s.weight for s in sources], [0.0, 0.0], seed=0, stage_index=0)
    which, _ = order.rows(0, 20000)
    assert abs((which == 1).mean() - 0.75) < 0.02


# -- each tool's shapes through `advisor train` ----------------------------------------------------------


def _trained_tokens(run: Path) -> list[int]:
    """The tokens the run's packed rows train (every source's cached rows), sorted."""
    import numpy as np

    trained = []
    for cached in sorted((run / "data_cache").glob("*.npz")):
        with np.load(cached) as packed:
            labels = packed["labels"]
        trained += [int(t) for t in labels[labels != IGNORE]]
    return sorted(trained)


def _example_tokens(expected: list[tuple[list[int], list[int]]]) -> list[int]:
    """What packing trains of supervised examples: their labels, less each example's first token."""
    return [t for _, labels in expected for t in labels[1:] if t != IGNORE]


def _stream_tokens(documents: list[list[int]], seq: int) -> list[int]:
    """What packing trains of text documents: the full rows of their concatenation, less each document's first token."""
    starts, stream = set(), []
    for ids in documents:
        starts.add(len(stream))
        stream += ids
    usable = len(stream) // seq * seq
    return [t for i, t in enumerate(stream[:usable]) if i not in starts]


def _train(tmp_path: Path, name: str, data: Path, *flags: str) -> Path:
    import os
    import subprocess
    import sys

    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM
    from typer.testing import CliRunner

    from advisor.cli import app
    from presets import load_model

    weights = tmp_path / "weights"
    if not weights.exists():
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**load_model("demo-tiny").hf_config)).save_pretrained(
            weights)
        _tokenizer(weights)
    plan = tmp_path / "plan.yaml"
    if not plan.exists():
        made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                        "--seq-len", "512", "--global-batch", "2", "--top", "1", "--out", str(plan)])
        assert made.exit_code == 0, made.output
    run = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(run), "--data",
                           str(data), "--weights", str(weights), "--steps", "2", *flags],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr + done.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)
    return run


@pytest.mark.slow
def test_advisor_train_trains_a_registry_and_an_axolotl_config_on_their_answers(tmp_path, hf) -> None:
    """`advisor train --data dataset_info.json --dataset ...` (alpaca, a tool-call sharegpt entry with
    `columns`, an OpenAI-like entry with `tags`; interleaved) and `advisor train --data axolotl.yml`
    (alpaca, chat_template with mapped message keys, completion): the packed rows each run trained on
    hold exactly the tokens of the labels rebuilt from apply_chat_template's text (and, for the
    completion, every token of the text)."""
    import yaml

    data = tmp_path / "lf"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps(REGISTRY, indent=2))
    (data / "alpaca_en_demo.json").write_text(json.dumps(ALPACA, indent=2))
    (data / "glaive_toolcall_en_demo.json").write_text(json.dumps(GLAIVE[:1], indent=2))
    openai_like = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello."}]
    (data / "openai_like.jsonl").write_text(json.dumps({"messages": openai_like}) + "\n")
    run = _train(tmp_path, "lf-run", data / "dataset_info.json", "--dataset",
                 "alpaca_en_demo,glaive_toolcall_en_demo,openai_like", "--mix", "interleave", "--mix-probs",
                 "0.5,0.25,0.25")
    sources = yaml.safe_load((run / "plan.yaml").read_text())["task"]["stages"][0]["sources"]
    assert [(s["format"], s["weight"]) for s in sources] == [("alpaca", 0.5), ("sharegpt", 0.25), ("sharegpt", 0.25)]
    expected = _alpaca_truth(hf) + [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS), _truth(hf, openai_like)]
    assert _trained_tokens(run) == sorted(_example_tokens(expected))

    axolotl = tmp_path / "axolotl"
    axolotl.mkdir()
    run = _train(tmp_path, "axolotl-run", _axolotl_files(axolotl))
    sources = yaml.safe_load((run / "plan.yaml").read_text())["task"]["stages"][0]["sources"]
    assert [s["format"] for s in sources] == ["alpaca", "sharegpt", "text"]
    notes = [hf(row["body"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id] for row in NOTES]
    expected = _alpaca_truth(hf) + [_truth(hf, GLAIVE_MESSAGES[0], GLAIVE_TOOLS), _truth(hf, GLAIVE_MESSAGES[1])]
    assert _trained_tokens(run) == sorted(_example_tokens(expected) + _stream_tokens(notes, 512))
