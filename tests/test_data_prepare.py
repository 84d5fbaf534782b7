"""`advisor data prepare` end to end: rows land in the right stage shards, the manifest's counts
equal a direct count, the token ids equal an independent tokenisation, and bad data stops cleanly.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from presets import load_task
from trainer.data import manifest_stage_tokens
from trainer.data.manifest import read_manifest
from trainer.data.prepare import prepare
from trainer.data.shards import load_shard
from trainer.data.tokenizer import load_demo_tokenizer

SEQ = 64
TOPICS = ("math", "code", "prose", "misc")
WINDOWS = {"y2022": ["2022-01-01", "2023-01-01"], "y2023": ["2023-01-01", "2024-01-01"]}
RULE = "def long_words(text):\n    return sum(len(w) >= 8 for w in text.split())\n"


def make_rows(n: int = 160, seed: int = 5) -> list[dict]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 11))) for _ in range(3000)]
    rows = []
    for i in range(n):
        length = int(min(140, rng.lognormvariate(3.0, 0.7)) + 3)  # long-tailed: some exceed seq_len tokens
        day = dt.date(2022, 1, 1) + dt.timedelta(days=rng.randint(0, 3 * 365 - 1))
        rows.append({"text": " ".join(rng.choice(vocab) for _ in range(length)), "level": rng.randint(1, 5),
                     "topic": TOPICS[i % 4], "ts": day.isoformat()})
    return rows


def write_task(folder: Path, stages: list[dict], **data) -> Path:
    task = {"name": "t", "model": "demo-tiny", "seq_len": SEQ, "data": {"buckets": {"micro_batch_tokens": 256}, **data},
            "stages": stages}
    path = folder / "task.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def shard_rows(out: Path, stage: dict, split: str = "train") -> list[tuple[dict, dict]]:
    """(shard entry, row) for every sample of a stage split, read straight from the Arrow files."""
    found = []
    for shard in stage[split]["shards"]:
        for row in load_shard(out / shard["path"]):
            found.append((shard, row))
    return found


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("prepare")
    rows = make_rows()
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "rules.py").write_text(RULE)
    stages = [
        {"name": "graded", "tokens": 1000, "split_by": "difficulty",
         "difficulty": {"by": "field", "field": "level", "edges": [2, 4]},
         "sources": [{"path": "corpus.jsonl"}]},
        {"name": "topics", "tokens": 1000, "split_by": "domain",
         "sources": [{"path": "corpus.jsonl", "domain_field": "topic", "domains": ["math", "code"]}]},
        {"name": "recent", "tokens": 1000, "split_by": "time", "time_windows": WINDOWS,
         "sources": [{"path": "corpus.jsonl", "time_field": "ts"}]},
        {"name": "wordy", "tokens": 1000, "replay": {"graded": 0.25},
         "difficulty": {"by": "rule", "rule": "rules.py:long_words", "edges": [6], "names": ["plain", "wordy"]},
         "sources": [{"path": "corpus.jsonl", "bands": ["wordy"]}]},
    ]
    task_path = write_task(tmp, stages, filters={"min_tokens": 1}, dedup={"near": False})
    out, manifest = prepare(load_task(str(task_path)), allow_code=True)
    return tmp, task_path, out, manifest, rows


def by_name(manifest: dict, name: str) -> dict:
    return next(s for s in manifest["stages"] if s["name"] == name)


def test_difficulty_bands_land_in_their_shards(prepared) -> None:
    _, _, out, manifest, rows = prepared
    stage = by_name(manifest, "graded")
    found = shard_rows(out, stage)
    for shard, row in found:
        level = rows[row["row"]]["level"]
        band = "easy" if level < 2 else "medium" if level < 4 else "hard"
        assert shard["group"] == band == row["band"] and row["difficulty"] == level
        assert f"/{band}/" in shard["path"]
    assert {r["row"] for _, r in found} == set(range(len(rows)))
    assert list(stage["train"]["groups"]) == ["easy", "medium", "hard"]  # curriculum order


def test_domain_selection_and_split_land_in_their_shards(prepared) -> None:
    _, _, out, manifest, rows = prepared
    stage = by_name(manifest, "topics")
    found = shard_rows(out, stage)
    for shard, row in found:
        assert shard["group"] == row["domain"] == rows[row["row"]]["topic"]
    wanted = {i for i, r in enumerate(rows) if r["topic"] in ("math", "code")}
    assert {r["row"] for _, r in found} == wanted
    assert stage["train"]["dropped"] == {"selection:domain": len(rows) - len(wanted)}


def test_time_windows_split_and_rows_outside_are_dropped(prepared) -> None:
    _, _, out, manifest, rows = prepared
    stage = by_name(manifest, "recent")
    found = shard_rows(out, stage)
    for shard, row in found:
        assert shard["group"] == "y" + rows[row["row"]]["ts"][:4]
    outside = sum(r["ts"] >= "2024" for r in rows)
    assert len({r["row"] for _, r in found}) == len(rows) - outside
    assert stage["train"]["dropped"] == {"selection:no_time_window": outside}


def test_a_user_rule_grades_and_bands_select(prepared) -> None:
    _, _, out, manifest, rows = prepared
    namespace: dict = {}
    exec(RULE, namespace)
    expected = {i for i, r in enumerate(rows) if namespace["long_words"](r["text"]) >= 6}
    stage = by_name(manifest, "wordy")
    assert {r["row"] for _, r in shard_rows(out, stage)} == expected
    assert stage["train"]["dropped"] == {"selection:band": len(rows) - len(expected)}


def test_manifest_counts_equal_a_direct_count_of_the_shards(prepared) -> None:
    _, _, out, manifest, _ = prepared
    for stage in manifest["stages"]:
        info = stage["train"]
        found = shard_rows(out, stage)
        lengths = [len(row["input_ids"]) for _, row in found]
        assert all(row["length"] == len(row["input_ids"]) for _, row in found)
        assert info["samples"] == len(found) and info["tokens"] == sum(lengths) == stage["tokens"]
        assert info["length_counts"] == sorted([list(kv) for kv in Counter(lengths).items()])
        assert info["documents"] == len({row["row"] for _, row in found})
        for shard in info["shards"]:
            ds = load_shard(out / shard["path"])
            assert shard["samples"] == len(ds) and shard["tokens"] == sum(ds["length"])
        lower = 0
        for bucket in info["buckets"]:
            inside = [n for n in lengths if lower < n <= bucket["edge"]]
            assert bucket["samples"] == len(inside) and bucket["tokens"] == sum(inside)
            assert sum(bucket["histogram"]["counts"]) == len(inside)
            lower = bucket["edge"]
        for shard, row in found:
            edges = [0, *info["bucket_edges"]]
            b = edges.index(shard["bucket"])
            assert edges[b - 1] < row["length"] <= shard["bucket"]


def test_token_ids_equal_an_independent_tokenisation_cut_at_seq_len(prepared) -> None:
    _, _, out, manifest, rows = prepared
    tok = load_demo_tokenizer()
    stage = by_name(manifest, "graded")
    pieces: dict[int, dict[int, list[int]]] = {}
    for _, row in shard_rows(out, stage):
        pieces.setdefault(row["row"], {})[row["chunk"]] = row["input_ids"]
    long_documents = 0
    for index, chunks in pieces.items():
        ids = tok(rows[index]["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        expected = [ids[i:i + SEQ] for i in range(0, len(ids), SEQ)]
        expected = [c for c in expected if len(c) >= 2 or len(expected) == 1]
        assert [chunks[k] for k in sorted(chunks)] == expected
        long_documents += len(expected) > 1
    assert long_documents >= 3  # the long tail really was cut into seq_len pieces


def test_planner_reads_stage_tokens_with_replay_and_ignores_a_stale_manifest(prepared) -> None:
    tmp, task_path, _, manifest, _ = prepared
    task = load_task(str(task_path))
    tokens = manifest_stage_tokens(task)
    assert tokens is not None
    for stage in manifest["stages"]:
        share = sum(stage["replay"].values())
        assert tokens[stage["name"]] == round(stage["train"]["tokens"] / (1 - share))
    assert tokens["wordy"] > by_name(manifest, "wordy")["train"]["tokens"]
    changed = task.model_copy(update={"seq_len": SEQ * 2})
    assert manifest_stage_tokens(changed) is None
    assert manifest_stage_tokens(task, out_dir=tmp / "nowhere") is None


def test_cli_stats_prints_the_manifest_as_a_table_and_as_json(prepared) -> None:
    _, _, out, manifest, _ = prepared
    result = CliRunner().invoke(app, ["data", "stats", str(out), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == manifest
    table = CliRunner().invoke(app, ["data", "stats", str(out)])
    assert table.exit_code == 0
    for stage in manifest["stages"]:
        assert stage["name"] in table.stdout
        assert f"{stage['train']['tokens']:,}" in table.stdout


# --- bad data: a clear message that names the file and the row, and no half-written output ------------


@pytest.fixture()
def workspace(tmp_path: Path):
    rows = make_rows(40, seed=9)
    (tmp_path / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stages = [{"name": "one", "tokens": 100, "sources": [{"path": "good.jsonl"}, {"path": "more.jsonl"}]}]
    task_path = write_task(tmp_path, stages)
    (tmp_path / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_rows(10, seed=10)))
    out, _ = prepare(load_task(str(task_path)))
    return tmp_path, task_path, out


def assert_untouched(tmp_path: Path, out: Path, before: bytes) -> None:
    assert (out / "manifest.json").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("content,message", [
    (b'{"text": "fine words here"}\n{"text": "caf\xe9 au lait"}\n', "more.jsonl, line 2: not valid UTF-8 (byte 0xe9"),
    (b'{"text": "fine words here"}\n\n{"body": "no text field"}\n', "more.jsonl, line 3 (row 2): no field 'text'"),
    (b'{"text": "fine words here"}\n{"text": "unclosed"\n', "more.jsonl, line 2: not valid JSON"),
    (b'{"text": "fine words here"}\n{"text": 42}\n', "more.jsonl, line 2 (row 2): field 'text' is int"),
])
def test_bad_rows_stop_with_file_and_row_and_leave_the_output_whole(workspace, content, message) -> None:
    tmp_path, task_path, out = workspace
    before = (out / "manifest.json").read_bytes()
    (tmp_path / "more.jsonl").write_bytes(content)
    with pytest.raises(UsageError) as err:
        prepare(load_task(str(task_path)))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert_untouched(tmp_path, out, before)


def test_missing_files_and_empty_stages_are_refused(workspace) -> None:
    tmp_path, task_path, out = workspace
    before = (out / "manifest.json").read_bytes()
    (tmp_path / "more.jsonl").unlink()
    with pytest.raises(UsageError, match="data source not found: .*more.jsonl"):
        prepare(load_task(str(task_path)))
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    strict = write_task(tmp_path, [{"name": "one", "tokens": 100, "sources": [{"path": "more.jsonl"}]}],
                        filters={"min_chars": 1000})
    with pytest.raises(UsageError, match=r"stage 'one' \(train\): no documents left after filtering; read 1 rows "
                                         r"from .*more.jsonl; dropped: quality:min_chars 1"):
        prepare(load_task(str(strict)))
    assert_untouched(tmp_path, out, before)


def test_cli_errors_are_one_line_with_exit_code_2(workspace) -> None:
    tmp_path, task_path, out = workspace
    (tmp_path / "more.jsonl").write_bytes(b'{"text": "ok ok"}\n{"text": "\xff"}\n')
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task_path)])
    assert result.exit_code == 2
    assert "line 2: not valid UTF-8" in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "precious.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task_path), "--out", str(tmp_path / "elsewhere")])
    assert result.exit_code == 2 and "not a prepared-data folder" in result.stderr
    assert (tmp_path / "elsewhere" / "precious.txt").read_text() == "keep me"


def test_difficulty_by_reference_model_loss_equals_a_direct_forward_pass(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "ref")
    rows = make_rows(24, seed=3)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stages = [{"name": "s", "tokens": 100, "sources": [{"path": "c.jsonl"}],
               "difficulty": {"by": "loss", "reference_model": "ref"}}]
    out, manifest = prepare(load_task(str(write_task(tmp_path, stages, filters={"min_tokens": 2}))))
    tok = load_demo_tokenizer()
    for _, row in shard_rows(out, manifest["stages"][0]):
        ids = (tok(rows[row["row"]]["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:SEQ]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        expected = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
        assert row["difficulty"] == pytest.approx(expected, rel=1e-4)
    assert read_manifest(out)["stages"][0]["train"]["documents"] == len(rows)


def test_parquet_arrow_text_and_json_sources_read_the_same_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_rows(30, seed=4)
    table = pa.table({"body": [r["text"] for r in rows], "level": [r["level"] for r in rows]})
    pq.write_table(table, tmp_path / "c.parquet")
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "c.txt").write_text("".join(r["text"] + "\n" for r in rows))
    (tmp_path / "c.json").write_text(json.dumps([{"body": r["text"]} for r in rows]))
    formats = {"parquet": "c.parquet", "arrow": "c.arrow", "text": "c.txt", "json": "c.json"}
    stages = [{"name": fmt, "tokens": 100, "sources": [{"path": path, "format": fmt, "text_field": "body"}]}
              for fmt, path in formats.items()]
    _, manifest = prepare(load_task(str(write_task(tmp_path, stages, dedup={"exact": False, "near": False}))))
    tok = load_demo_tokenizer()
    lengths = [len(tok(r["text"], add_special_tokens=False)["input_ids"]) + 1 for r in rows]
    # a piece of one token past the last full seq_len piece has nothing to predict and is dropped
    expected = sum(n - (n % SEQ if n > SEQ and n % SEQ < 2 else 0) for n in lengths)
    for stage in manifest["stages"]:
        assert stage["train"]["documents"] == len(rows) and stage["train"]["tokens"] == expected, stage["name"]


def test_plan_sizes_stages_from_the_manifest(tmp_path) -> None:
    """`advisor plan --task` reads the prepared data's token counts when a fresh manifest exists."""
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware, load_model, load_task
    from trainer.data.demo_corpus import generate_demo_corpus
    from trainer.data.manifest import manifest_stage_tokens
    from trainer.data.prepare import prepare

    task_path = generate_demo_corpus(tmp_path, scale=0.02)["task.yaml"]
    task = load_task(str(task_path))
    prepare(task)
    counts = manifest_stage_tokens(task)
    assert counts
    plan = make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), gpus_per_node=1,
                                 task=task, stage_tokens=counts, min_compute_fraction=0.0))
    for stage in plan.stages:
        if stage.name in counts:
            assert stage.tokens == counts[stage.name]
