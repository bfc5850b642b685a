import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # GPU tests skip cleanly on machines without CUDA (CI, developer laptops).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or os.sep + "gpu" + os.sep in str(item.fspath):
            item.add_marker(skip)
