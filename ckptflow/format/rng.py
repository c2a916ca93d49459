"""The RNG states of a rank record (``training.state.capture_rng`` writes them), decoded
here for restore and checked here when the record is parsed: a state restore could not
apply is damage that verify reports and restore falls back past before it writes any
tensor, not an error raised after the tensors were read into place."""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping
from typing import Any

import numpy as np


def python_state(rng: Mapping) -> tuple:
    version, internal, gauss = rng["python"]
    return (version, tuple(internal), gauss)


def numpy_state(rng: Mapping) -> tuple:
    name, keys, pos, has_gauss, cached = rng["numpy"]
    return (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)


def generator_bytes(text: Any) -> bytearray:
    """A torch generator's state, stored as base64 text."""
    if not isinstance(text, str):
        raise TypeError(f"a generator state that is a {type(text).__name__}, not base64 text")
    return bytearray(base64.b64decode(text, validate=True))


def cuda_states(rng: Mapping) -> list[bytearray]:
    states = rng.get("cuda", [])
    if not isinstance(states, list):
        raise TypeError(f"CUDA generator states that are a {type(states).__name__}, not a list")
    return [generator_bytes(s) for s in states]


def problem(rng: Any) -> str | None:
    """Why ``rng`` holds states restore cannot apply, or None. Python's and NumPy's are
    tried on generators of their own; torch's must be base64 text here (its content only
    torch can judge, which verify does not import: restore asks it, ``state.check_rng``)."""
    if rng is None:
        return None
    if not isinstance(rng, dict):
        return "is not an object"
    try:
        random.Random().setstate(python_state(rng))
        np.random.RandomState().set_state(numpy_state(rng))
        generator_bytes(rng["torch"])
        cuda_states(rng)
    except (ValueError, TypeError, LookupError, ArithmeticError) as e:
        return f"does not decode ({type(e).__name__}: {e})"
    return None
