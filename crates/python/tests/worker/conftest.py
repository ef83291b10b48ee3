"""Worker tests: the scheduler harness (tests/vllm/sched_harness.py) and an offline fake
model before vLLM is imported."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm"))

import sched_harness  # noqa: E402

sched_harness.prepare_environment()
