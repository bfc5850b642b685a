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


@pytest.fixture(autouse=True)
def _launch_plans(request):
    """Launch plans (``qattn.interface.launch_plan``) replay a call signature's recorded launches: tests that
    monkeypatch the launch decisions between calls would replay another test's (or their own earlier) choices,
    so plans are off and empty in every test but those marked ``launch_plans`` (which check replay == the
    normal path)."""
    from qattn.interface import prefill

    on = request.node.get_closest_marker("launch_plans") is not None
    saved = prefill._PLANS_ON[0]
    prefill._PLANS_ON[0] = on
    prefill._DENSE_PLANS.clear()
    prefill._VARLEN_PLANS.clear()
    yield
    prefill._PLANS_ON[0] = saved
    prefill._DENSE_PLANS.clear()
    prefill._VARLEN_PLANS.clear()
