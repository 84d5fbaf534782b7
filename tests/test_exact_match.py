"""Exact match by greedy decoding, against models whose answers are known by construction: a model
that continues every letter with the next one (and 'z' with end-of-text) answers "Q: u" with "vwxyz";
the scores are 100% for those references and 0% for others. Batched, left-padded decoding equals
HF's `generate` run on each prompt alone; whole-model engines on two ranks (ZeRO-3, FSDP2 with TP)
decode what one process does, and replicas that each score a share of the prompts and of the eval
sequences add up to the unsplit score and loss; and a training run reports the scores per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.corpus import BYTE_EOS
from trainer.exact_match import answer_batches, exact_match, greedy_answers

VOCAB = 272  # bytes, end-of-text (256) and spare ids: the trainer's byte tokenizer fits
CPU = torch.device("cpu")


def _next_token(t: int) -> int:
    """What the constructed model predicts after token t: the next letter, end-of-text after 'z'."""
    return BYTE_EOS if t == ord("z") else (t + 1) % VOCAB


def _alphabet_model():
    """Decoder layers that add nothing (zero output projections), one-hot embeddings, and an LM
    head that maps token t to `_next_token(t)`: greedy decoding continues the alphabet to 'z'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=VOCAB, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB) * 10)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(VOCAB, VOCAB)
        for t in range(VOCAB):
            head[_next_token(t), t] = 1.0
        model.lm_head.weight.copy_(head)
    return model.eval()


def _ids(text: str) -> list[int]:
    return list(text.encode())


PROMPTS = ["Q: u", "continue from w", "x", "the letters after m", "Q: q"]


def _truth(prompt: str) -> str:
    """The alphabet after the prompt's last letter: what the constructed model answers."""
    return "".join(chr(c) for c in range(ord(prompt[-1]) + 1, ord("z") + 1))


def test_exact_match_is_100_percent_for_answers_right_by_construction_and_0_otherwise() -> None:
    model = _alphabet_model()
    right = [(_ids(p), _ids(_truth(p))) for p in PROMPTS]
    assert exact_match(model, right, BYTE_EOS, micro_batch=2, device=CPU) == 1.0
    # the reference answer closed by end-of-text scores the same
    assert exact_match(model, [(p, a + [BYTE_EOS]) for p, a in right], BYTE_EOS, 3, CPU) == 1.0
    too_long = [(p, a + _ids("!")) for p, a in right]  # the model stops before it: no match
    too_short = [(p, a[:-1]) for p, a in right]  # the model goes on past it: no match
    other = [(p, _ids("abc")) for p, _ in right]
    for wrong in (too_long, too_short, other):
        assert exact_match(model, wrong, BYTE_EOS, 2, CPU) == 0.0
    assert exact_match(model, right[:2] + other[2:], BYTE_EOS, 4, CPU) == pytest.approx(2 / 5)


def test_answer_batches_are_the_longest_runs_that_fit_the_tokens_and_score_as_micro_batches_do() -> None:
    """Every batch is the longest run from its start whose rows, padded to its longest prompt and
    given its longest answer + 1 new tokens, fit the budget (never fewer than mbs but at the end),
    checked against every other cut by brute force; the constructed model scores the same in them."""
    generator = torch.Generator().manual_seed(3)
    pairs = [([1] * int(torch.randint(1, 12, (1,), generator=generator)),
              [2] * int(torch.randint(1, 6, (1,), generator=generator))) for _ in range(40)]

    def cost(rows):
        return len(rows) * (max(len(p) for p, _ in rows) + max(len(a) for _, a in rows) + 1)

    for mbs, tokens in ((1, 0), (2, 0), (1, 40), (2, 64), (3, 100), (1, 10_000)):
        batches = answer_batches(pairs, mbs, tokens)
        assert [i for b in batches for i in range(len(pairs))[b]] == list(range(len(pairs)))  # in order, once
        for batch in batches:
            rows = pairs[batch]
            assert len(rows) >= mbs or batch.stop == len(pairs)
            assert len(rows) <= mbs or cost(rows) <= tokens
            if batch.stop < len(pairs):  # one more row would break the budget (or the minimum was all it took)
                assert cost(pairs[batch.start:batch.stop + 1]) > tokens
    assert answer_batches(pairs, 2, 0) == [slice(i, min(i + 2, 40)) for i in range(0, 40, 2)]
    assert answer_batches(pairs, 1, 10_000) == [slice(0, 40)]
    model = _alphabet_model()
    right = [(_ids(p), _ids(_truth(p))) for p in PROMPTS]
    other = [(p, _ids("abc")) for p, _ in right]
    for tokens in (0, 30, 1000):
        assert exact_match(model, right[:3] + other[3:], BYTE_EOS, 1, CPU, tokens) == pytest.approx(3 / 5)


def test_batched_left_padded_decoding_equals_generate_on_each_prompt_alone() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=40)).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 40, (n,), generator=generator).tolist() for n in (2, 9, 5, 1, 7)]
    batched = greedy_answers(model, prompts, max_new_tokens=6, eos=0, device=CPU)
    alone = []
    for prompt in prompts:  # the truth: HF generate on the prompt alone, no padding
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=6, eos_token_id=0,
                             pad_token_id=0)[0, len(prompt):].tolist()
        alone.append(out[:out.index(0)] if 0 in out else out)
    assert batched == alone
    assert len({tuple(a) for a in alone}) > 1  # the prompts do lead to different answers


def _alphabet_weights(root: Path) -> Path:
    folder = root / "alphabet"
    _alphabet_model().save_pretrained(folder)
    return folder


def _letters_task(root: Path) -> Path:
    """Two stages: language (text rows only: nothing to score) and letters, budgeted in epochs, whose
    held-out rows hold prompts and answers, 3 of 4 right by construction."""
    data = root / "data"
    data.mkdir(parents=True)
    rows = [{"text": "abcdefghijklmnopqrstuvwxyz " * 2} for _ in range(40)]
    (data / "lang.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    letters = [{"prompt": f"Q: {c}", "completion": _truth(c)} for c in "abcdefghijklmnopqrstuvwxy"]
    (data / "letters.jsonl").write_text("".join(json.dumps({**r, "text": r["prompt"] + r["completion"]}) + "\n"
                                                for r in letters))
    held_out = [{"prompt": f"Q: {c}", "completion": _truth(c)} for c in "uvw"] + [{"prompt": "Q: k", "completion": "no"}]
    (data / "letters_eval.jsonl").write_text("".join(json.dumps({**r, "text": r["prompt"] + r["completion"]}) + "\n"
                                                     for r in held_out))
    (data / "lang_eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (root / "task.yaml").write_text("""
name: letters
seq_len: 32
global_batch: 4
stages:
  - {name: language, sources: [{path: data/lang.jsonl}], steps: 2, lr: 1.0e-7, warmup_steps: 0,
     eval_sources: [{path: data/lang_eval.jsonl}]}
  - {name: letters, sources: [{path: data/letters.jsonl, format: text}], epochs: 2, lr: 1.0e-7, warmup_steps: 0,
     eval_sources: [{path: data/letters_eval.jsonl, format: prompt_completion}]}
""")
    return root / "task.yaml"


def test_a_run_reports_exact_match_per_skill_and_epochs_per_source(tmp_path) -> None:
    from specs.core import ModelSpec
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware, load_task
    from trainer.corpus import ByteTokenizer, load_source
    from trainer.loop import TrainOptions, train

    weights = _alphabet_weights(tmp_path)
    task = load_task(str(_letters_task(tmp_path)))
    config = json.loads((weights / "config.json").read_text())
    plan = make_plan(PlanOptions(model=ModelSpec(name="alphabet", hf_config=config), hardware=load_hardware("cpu"),
                                 gpus_per_node=1, task=task, min_compute_fraction=0.0, method="full",
                                 fix={"dtype": "fp32", "mbs": 2, "gas": 2, "tp": 1, "pp": 1}))
    assert plan.stages[1].flags[0].startswith("sized at run time")  # no counts handed to the planner
    summary = train(plan, tmp_path / "run", resume=False,
                    options=TrainOptions(show_progress=False, weights=str(weights), exact_match_prompts=64))
    first, second = summary["stages"]
    assert first["exact_match"] == {"language": None}  # text rows: no answers, n/a
    assert second["exact_match"] == {"language": None, "letters": 0.75}
    # epochs: 2 passes over the letters' packed rows, in whole steps of 4 sequences
    rows = len(load_source(task.stages[1].sources[0], task, ByteTokenizer(), 32, None))
    steps = -(-2 * rows // 4)
    assert second["steps"] == steps
    assert second["epochs"] == {"letters:data/letters.jsonl": pytest.approx(steps * 4 / rows)}
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["exact_match"] for e in evals] == [first["exact_match"], second["exact_match"]]
    # the run report shows them: a percentage per skill, n/a where there are no answers
    from reports.run_report import run_report

    analysis, document = run_report(tmp_path / "run")
    assert analysis.exact_match == {"language": {"language": None},
                                    "letters": {"language": None, "letters": 0.75}}
    markdown = document.to_markdown()
    assert "| after letters | n/a | 75.0% |" in markdown
    assert analysis.epochs["letters"] == second["epochs"]


# -- every rank decodes together: ZeRO-3 and FSDP2 with tensor parallelism ------------------------


def _random_weights(root: Path) -> Path:
    """A random model of the same shape: its answers depend on attention over the whole prompt."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    folder = root / "random"
    LlamaForCausalLM(_alphabet_model().config).save_pretrained(folder)
    return folder


def _eval_sequences():
    return torch.randint(0, VOCAB, (5, 12), generator=torch.Generator().manual_seed(4)).numpy()


def _rank_decode(rank: int, world: int, port: int, folders: list[str], layout: dict, choice: str, out: str) -> None:
    from specs.core import Layout, ModelSpec
    from profiler.ranks import finish_rank, init_rank
    from trainer.engines import make_engine
    from trainer.model import build_model

    from trainer.eval_shards import EvalShard
    from trainer.evaluator import evaluate_sources
    from trainer.stream import Source

    init_rank(rank, world, port, distributed=True, threads=1)
    plan_layout = Layout(**layout)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "steps_per_print": 1_000_000}
    prompts = [_ids(p) for p in PROMPTS]
    results = []
    for weights in folders:
        config = json.loads(Path(weights, "config.json").read_text())
        engine = make_engine(build_model(ModelSpec(name="alphabet", hf_config=config), plan_layout, 0, weights),
                             plan_layout, ds_config, clip=1.0, engine=choice)
        module = getattr(engine.model, "module", engine.model)
        answers = greedy_answers(module, prompts, 30, BYTE_EOS, CPU)
        score = exact_match(module, [(p, _ids(_truth(t))) for p, t in zip(prompts, PROMPTS)], BYTE_EOS, 2, CPU)
        # each replica scores its share (3 of 5 and 2: the shorter one pads its calls and forwards)
        shard = EvalShard(engine.data_rank, plan_layout.dp)
        mixed = [(p, _ids(_truth(t) if k % 2 else "abc")) for k, (p, t) in enumerate(zip(prompts, PROMPTS))]
        sources = [Source("letters", _eval_sequences(), 1.0)]
        results.append({"answers": answers, "score": score,
                        "split_score": exact_match(module, mixed, BYTE_EOS, 1, CPU, 0, shard),
                        "split_losses": evaluate_sources(module, sources, 5, 1, CPU, shard)})
        del engine, module
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finish_rank(True)


@pytest.mark.slow
@pytest.mark.parametrize("choice, layout", [
    ("deepspeed", {"dp": 2, "zero": 3, "gas": 1, "mbs": 1, "dtype": "fp32"}),
    ("fsdp2", {"dp": 1, "tp": 2, "sp": True, "zero": 0, "gas": 1, "mbs": 1, "dtype": "fp32"}),
])
def test_whole_model_engines_on_two_ranks_decode_what_one_process_does(tmp_path, choice, layout) -> None:
    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
    from transformers import LlamaForCausalLM

    from profiler.ranks import free_port, launch
    from trainer.evaluator import evaluate_sources
    from trainer.stream import Source

    alphabet, random = _alphabet_weights(tmp_path), _random_weights(tmp_path)
    prompts = [_ids(p) for p in PROMPTS]
    random_model = LlamaForCausalLM.from_pretrained(random).eval()
    one_process = greedy_answers(random_model, prompts, 30, BYTE_EOS, CPU)
    unsplit_losses = evaluate_sources(random_model, [Source("letters", _eval_sequences(), 1.0)], 5, 1, CPU)
    launch(_rank_decode, 2, (2, free_port(), [str(alphabet), str(random)], layout, choice, str(tmp_path)))
    for rank in range(2):
        by_construction, randomly = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert by_construction["answers"] == [_ids(_truth(p)) for p in PROMPTS]
        assert by_construction["score"] == 1.0
        assert randomly["answers"] == one_process and randomly["score"] == 0.0
        assert by_construction["split_score"] == pytest.approx(2 / 5)  # the right answers at odd places
        assert randomly["split_losses"] == pytest.approx(unsplit_losses, rel=1e-6)


def test_a_pipeline_engine_is_not_scored_and_the_report_says_so(tmp_path) -> None:
    """The pipeline's model is its chunks run in turn (no `generate`): exact match is not scored there."""
    from presets import load_task
    from reports.run_report import _exact_match_section, RunAnalysis
    from reports.document import Document
    from trainer.corpus import ByteTokenizer
    from trainer.engines.pipeline import PipelineForward
    from trainer.exact_match import NOT_SCORED_PIPELINE, stage_exact_match

    task = load_task(str(_letters_task(tmp_path)))
    pipeline_model = PipelineForward([], engine=None)  # type: ignore[arg-type]
    assert stage_exact_match(pipeline_model, task, 1, ByteTokenizer(), 2, 64, CPU) is None
    # a whole model is scored: the letters skill, and language has no answers
    assert stage_exact_match(_alphabet_model(), task, 1, ByteTokenizer(), 2, 64, CPU) == {"language": None,
                                                                                         "letters": 0.75}
    analysis = RunAnalysis(data=None, comparisons=[], stages=[], spikes=[], rollbacks=[], checkpoint_events=[],  # type: ignore[arg-type]
                           evals={}, finished=True, steps=0, exact_match_note=NOT_SCORED_PIPELINE)
    document = Document("run")
    _exact_match_section(document, analysis)
    assert f"Exact match {NOT_SCORED_PIPELINE}." in document.to_markdown()


# -- decoding in batches of half a micro-batch's tokens peaks below the training step ------------

MHA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
       "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 2048,
       "max_position_embeddings": 512, "tie_word_embeddings": False}


def _decode_against_step(rank: int, out: str) -> None:
    """One process: a training step under full recomputation (its least memory), then the stage-end
    scoring's decoding at that layout; the allocator's peak over each, weights and Adam's states alive
    in both."""
    from profiler.tensor_memory import load_counter
    from specs.core import Layout, ModelSpec
    from test_recompute import second_step_peak
    from trainer.engines.plain import PlainEngine
    from trainer.model import build_model

    torch.set_num_threads(1)
    hook = load_counter()
    hook.install()
    layout = Layout(dtype="fp32", seq=256, mbs=2, gas=1, recompute="full")
    engine = PlainEngine(build_model(ModelSpec(name="mha", hf_config=MHA), layout, seed=0), layout, clip=1.0)
    batch = torch.randint(0, MHA["vocab_size"], (layout.mbs, layout.seq), generator=torch.Generator().manual_seed(0))
    step = second_step_peak(engine, batch, hook)
    generator = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(3, 2000, (24,), generator=generator).tolist(),
              torch.randint(3, 2000, (8,), generator=generator).tolist()) for _ in range(64)]
    tokens = layout.mbs * layout.seq // 2
    hook.reset_peak()
    exact_match(engine.model, pairs, 2, layout.mbs, CPU, tokens)
    decode = hook.peak_bytes()
    rows = answer_batches(pairs, layout.mbs, tokens)[0].stop  # prompts in the first decoding batch
    Path(out).write_text(json.dumps({"step": step, "decode": decode, "rows": rows}))


@pytest.mark.slow
def test_decoding_in_batches_of_half_a_micro_batch_peaks_below_the_training_step(tmp_path) -> None:
    """The memory argument of trainer/exact_match.py, measured where it is tightest: full attention
    heads (the KV cache keeps two vectors per layer and token), 8 layers, full recomputation. The
    decoding batches hold 7 prompts of 24 + 9 tokens (mbs 2 x 256 / 2 = 256 tokens), not mbs 2."""
    from profiler.ranks import launch

    out = tmp_path / "peaks.json"
    launch(_decode_against_step, 1, (str(out),))
    peaks = json.loads(out.read_text())
    assert peaks["rows"] == 7
    assert peaks["decode"] < peaks["step"], peaks
