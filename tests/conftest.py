import os

import pytest
import torch

# CPU-only CI: generated kernels run in the Triton interpreter.  Under pytest-xdist
# (the README runs two workers) each worker keeps its own kernel cache -- a test that
# expects its first build to be a miss is never answered by the other worker's entry --
# and one torch thread, so two workers do not fight over the two cores.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
os.environ.setdefault("NEPTUNE_EQ_CACHE", os.path.join(os.path.dirname(__file__), ".cache",
                                                       *([_worker] if _worker else [])))
if _worker:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
