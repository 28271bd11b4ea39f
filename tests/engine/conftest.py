from __future__ import annotations

import pytest

from kvpage.model import load_model

from ..model.hf_models import save_hf
from .workload import ReferenceCache


@pytest.fixture(scope="session")
def hf_gqa_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf-gqa")
    save_hf("llama-gqa-8q-2kv", directory)
    return str(directory)


@pytest.fixture(scope="session")
def references():
    """model name -> ReferenceCache over a model loaded once."""
    caches: dict[str, ReferenceCache] = {}

    def get(model_name: str) -> ReferenceCache:
        if model_name not in caches:
            caches[model_name] = ReferenceCache(load_model(model_name)[0])
        return caches[model_name]

    return get
