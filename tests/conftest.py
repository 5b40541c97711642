import os

import pytest
import torch

# CPU-only CI: generated kernels run in the Triton interpreter.
os.environ.setdefault("NEPTUNE_EQ_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
