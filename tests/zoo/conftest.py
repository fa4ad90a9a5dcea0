"""The zoo's meshes, over the suite's shared session (tests/conftest.py). Nothing may come from a
hub: every model is built from a config object, and the hub is switched off before any library
that could reach it is imported."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import pytest

import dtorch


@pytest.fixture(scope="session")
def zoo_meshes(session):
    """layout name -> mesh: dp2 shards the batch over 2 ranks, tp2 splits the layers a plan names."""
    return {"dp2": dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"]),
            "tp2": dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])}


@pytest.fixture
def sync_debug_error():
    """dtorch.set_sync_debug_mode("error") for one test, "default" again afterwards."""
    if not hasattr(dtorch, "set_sync_debug_mode"):
        pytest.skip("dtorch.set_sync_debug_mode is not there yet (issue 42, 'Devices follow DTensor's conventions')")
    dtorch.set_sync_debug_mode("error")
    try:
        yield
    finally:
        dtorch.set_sync_debug_mode("default")
