"""Fixtures: each HF config saved once per session to a temp dir."""

from __future__ import annotations

import pytest

from .hf_models import HF_CONFIGS, save_hf


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    """(name, HF model, directory holding its save_pretrained output)."""
    directory = tmp_path_factory.mktemp(request.param)
    model = save_hf(request.param, directory)
    return request.param, model, directory
