import os
import random

import pytest
import torch

import torchfuse  # noqa: F401

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_report_header(config):
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CUDA tests skip)"
    return f"torch {torch.__version__}, torchfuse {torchfuse.__version__}, GPU: {gpu}"


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A different seed per test and per run (printed on failure), so tests see fresh data; set
    TORCHFUSE_TEST_SEED to replay one."""
    seed = int(os.environ.get("TORCHFUSE_TEST_SEED", torch.seed() % (2**31)))
    torch.manual_seed(seed)
    random.seed(seed)  # tests draw keys and lengths with Python's random too: the replay must cover them
    request.node.user_properties.append(("seed", seed))
    yield seed


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        for k, v in item.user_properties:
            if k == "seed":
                print(f"\n[torchfuse] replay with TORCHFUSE_TEST_SEED={v}")
