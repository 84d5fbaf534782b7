"""Shared test set-up: an isolated trace cache, and the paper tables importable by name."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True, scope="session")
def _isolated_trace_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["ADVISOR_CACHE"] = str(tmp_path_factory.mktemp("advisor-cache"))


def gpt_config(hidden: int, layers: int, heads: int, vocab: int = 51200, seq: int = 2048) -> dict:
    """A GPT-2 style config as in the Megatron-LM and Korthikanti et al. experiments (GeLU MLP of 4h)."""
    return {
        "model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads,
        "n_positions": seq, "vocab_size": vocab, "activation_function": "gelu",
    }


try:  # the fuzz tests' draws: the same in every CI run (a failure there is the code's, reproducible);
    # the campaign (bench/fuzz_campaign.py) draws anew each time: pytest --hypothesis-profile=campaign
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True)
    _hypothesis_settings.register_profile("campaign", derandomize=False)
    _hypothesis_settings.load_profile("ci")
except ImportError:  # the lowest-versions leg runs no fuzz test
    pass
