import os
import signal
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# The test helpers (run_harness, ledger_driver, hf_fixture, fake_vllm) live in tests/ and
# are imported by name from the test packages below it, which mirror src/rollkeep/.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# CI runs derandomized so a red build is reproducible; locally examples vary per run.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def no_hang():
    """A test that blocks dies of SIGALRM instead of hanging the suite."""
    old = signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
