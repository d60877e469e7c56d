"""kbit's data-only hand-off encoding: exact round trips of what ranks exchange, and refusal of everything else."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kbit_core import handoff

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4) | st.tuples(inner, inner)
    ),
    max_leaves=20,
)


@given(json_values)
def test_plain_values_round_trip_with_their_types(value) -> None:
    assert handoff.loads(handoff.dumps(value)) == value


def test_arrays_tensors_and_nonfinite_floats_round_trip_bit_for_bit() -> None:
    state = {
        "rng": torch.get_rng_state(),
        "keys": np.random.get_state()[1],
        "py": (3, tuple(range(5)), None),
        "loss": [math.inf, -math.inf, 0.5],
    }
    back = handoff.loads(handoff.dumps(state))
    assert torch.equal(back["rng"], state["rng"]) and back["rng"].dtype == torch.uint8
    assert back["keys"].dtype == np.uint32 and np.array_equal(back["keys"], state["keys"])
    assert back["py"] == state["py"] and isinstance(back["py"][1], tuple)
    assert back["loss"] == state["loss"]
    nan = handoff.loads(handoff.dumps({"v": float("nan")}))["v"]
    assert math.isnan(nan)


@pytest.mark.parametrize("value", [object(), {1: "int key"}, {"__kbit__": "spoof"}, np.array([object()]), {1, 2}])
def test_values_json_cannot_carry_are_refused_when_sent(value) -> None:
    with pytest.raises(TypeError):
        handoff.dumps(value)


def test_a_pickle_is_not_wire_data() -> None:
    with pytest.raises(ValueError):
        handoff.loads(pickle.dumps({"a": 1}))


@pytest.mark.parametrize(
    "doc",
    [{"__kbit__": "callable", "name": "os.system"}, {"__kbit__": "ndarray", "dtype": "|O", "shape": [1], "data": ""}],
)
def test_unknown_tags_and_object_arrays_are_refused_when_received(doc) -> None:
    with pytest.raises(ValueError):
        handoff.loads(json.dumps(doc))
