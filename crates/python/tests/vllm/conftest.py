"""vLLM scheduler tests: an offline fake model before vLLM is imported (sched_harness)."""

import sched_harness

sched_harness.prepare_environment()
