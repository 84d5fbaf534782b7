"""`advisor train`'s flags for what --data is and how its datasets are read: --data, --dataset,
--template, how several mix (--mix, --mix-probs) and which tokens train (--train-on-prompt,
--mask-history). Declared here, beside the check that turns them into a `Reading`
(trainer/data/mixing.py), to keep the train verb short."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import typer

from specs.errors import UsageError
from trainer.data.chat_templates import TEMPLATE_NAMES
from trainer.data.mixing import Reading, check_mix, parse_probabilities

# Each flag's default and help (the train verb's signature orders them in its --help).
_FLAGS: dict[str, tuple[Any, str]] = {
    "--data": (None, "with a task: an `advisor data prepare` folder of length-bucketed shards (default: the task's "
                     "data.out when it is fresh, else its raw files). Without a task: the data the run trains on as "
                     "one stage, a file, glob or folder of JSON lines or a JSON array (text, alpaca, sharegpt or "
                     "chat rows, tool calls included), parquet, CSV, arrow, text or a datasets save_to_disk folder, "
                     "told apart by content; an `advisor data prepare` folder (all its stages' train shards); "
                     "LLaMA-Factory's dataset_info.json with --dataset; or an Axolotl config (.yml) whose datasets: "
                     "list (alpaca, chat_template, completion) it trains"),
    "--dataset": (None, "with --data DIR/dataset_info.json (LLaMA-Factory's registry): the datasets to train on, "
                        "NAME[,NAME...], concatenated"),
    "--template": (None, "a built-in chat template for chat, sharegpt and conversational rows, in place of the "
                         "tokenizer's own (a base model's tokenizer often has none): "
                         f"{', '.join(TEMPLATE_NAMES)}"),
    "--mix": ("concat", "how several datasets of --data mix: concat (every row once per pass, as LLaMA-Factory and "
                        "Axolotl do), interleave (each sequence from dataset i with probability --mix-probs; one "
                        "pass ends when the first runs out; also interleave_under) or interleave_over (when the last "
                        "runs out)"),
    "--mix-probs": (None, "with --mix interleave: P,P,... one per dataset in order, summing to 1 (default: equal)"),
    "--train-on-prompt": (False, "a plan without a task: loss on every token, prompts included (LLaMA-Factory's "
                                 "train_on_prompt, Axolotl's train_on_inputs)"),
    "--mask-history": (False, "a plan without a task: train only the last answer of each multi-turn row "
                              "(LLaMA-Factory's mask_history)"),
}
# The train verb's parameters take these: `mix: str = data_reading.OPTIONS["--mix"]`.
OPTIONS = {flag: typer.Option(default, flag, help=text) for flag, (default, text) in _FLAGS.items()}


def reading(a: SimpleNamespace) -> Reading:
    """How --data's datasets are read (--mix, --mix-probs, --train-on-prompt, --mask-history), checked."""
    probs = parse_probabilities(a.mix_probs)
    check_mix(a.mix, probs, a.epochs)
    if a.train_on_prompt and a.mask_history:  # LLaMA-Factory refuses the pair too
        raise UsageError("--train-on-prompt (every token) and --mask-history (the last answer only) exclude each other")
    return Reading(a.mix, tuple(probs) if probs else None, a.train_on_prompt, a.mask_history)
