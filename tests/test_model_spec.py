"""The model seam (protocols/model_spec.py): the registry's lookups, and the runtime, planner and
recipes reaching a model family only through it."""

import re
from pathlib import Path

import pytest

from models import SUPPORTED_MODELS
from protocols.model_spec import (all_flavors, get_flavor, get_model_spec, known_segments,
                                  model_specs, spec_of, spec_of_model_type)
from tests.conftest import REPO


def test_every_flavor_finds_its_own_spec_again():
    """Flavor names are unique across specs, and a flavor's args lead back to its spec."""
    names = [name for spec in model_specs() for name in spec.flavors]
    assert len(names) == len(set(names)) == len(all_flavors())
    for spec in model_specs():
        assert spec is get_model_spec(spec.name) and spec.name in SUPPORTED_MODELS
        assert set(spec.segments) <= set(known_segments())
        for name, args in spec.flavors.items():
            assert spec_of(args) is spec and get_flavor(name) is args, name


def test_lookups_name_the_choices():
    with pytest.raises(ValueError, match=f"unknown model 'gpt2'; choose one of "
                                         f"{', '.join(SUPPORTED_MODELS)}$"):
        get_model_spec("gpt2")
    with pytest.raises(ValueError, match=re.escape(f"unknown model flavor 'qwen9-1B'; choose one "
                                                   f"of {sorted(all_flavors())}")):
        get_flavor("qwen9-1B")
    types = sorted(t for spec in model_specs() for t in spec.hf.model_types)
    with pytest.raises(ValueError, match=re.escape(f"x.json: unsupported model_type 'mistral' "
                                                   f"(expected one of {types})")):
        spec_of_model_type("mistral", origin="x.json")


def test_only_models_imports_a_family_package():
    """slidedp/, recipes/ and protocols/ import no models/<family>/ module: the spec is the seam."""
    family = re.compile(rf"^\s*(from|import) models\.({'|'.join(SUPPORTED_MODELS)})\b", re.M)
    for folder in ("slidedp", "recipes", "protocols"):
        for path in Path(REPO, folder).rglob("*.py"):
            assert not family.search(path.read_text()), path
