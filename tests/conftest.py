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
    from qattn.interface import launch_plan

    saved = launch_plan.set_enabled(request.node.get_closest_marker("launch_plans") is not None)
    for p in launch_plan.PLANNERS:
        p.clear()
    yield
    launch_plan.set_enabled(saved)
    for p in launch_plan.PLANNERS:
        p.clear()
