"""`stub_check.check_stub_imports`: the model's load-time check that transformers imports in the
stub's Python, with the root cause in its message (the end-to-end side of the numpy check is
test_stub_check_e2e.py)."""

from __future__ import annotations

import sys
import types

import pytest

from mla_backend.serving.stub_check import (
    NUMPY_REQUIREMENT,
    StubEnvironmentError,
    check_stub_imports,
)


class _LazyTransformers(types.ModuleType):
    """A transformers whose lazy attributes fail as 5.17's did under numpy 1 beside a SciPy for
    numpy 2: ModuleNotFoundError raised from the AttributeError of `np.long`."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            try:
                raise AttributeError("module 'numpy' has no attribute 'long'")
            except AttributeError as e:
                raise ModuleNotFoundError("Could not import module 'GenerationMixin'.") from e
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"Could not import module '{name}'.") from e


def test_passes_where_transformers_imports() -> None:
    check_stub_imports()


def test_names_the_root_cause_and_the_fix(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", _LazyTransformers("transformers"))
    with pytest.raises(StubEnvironmentError) as info:
        check_stub_imports()
    text = str(info.value)
    assert "transformers cannot be imported in the stub's Python" in text
    assert "Could not import module 'AutoTokenizer'" in text
    assert "root cause: AttributeError: module 'numpy' has no attribute 'long'" in text
    assert NUMPY_REQUIREMENT in text and "Serving on a GPU" in text


def test_a_missing_transformers_is_refused_too(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(StubEnvironmentError, match="root cause: ModuleNotFoundError"):
        check_stub_imports()


class _CyclicTransformers(types.ModuleType):
    """Its attributes fail with an exception chain that loops back on itself."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        first, second = ImportError("first"), ImportError("second")
        first.__cause__, second.__cause__ = second, first
        raise first


def test_a_cyclic_exception_chain_ends(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", _CyclicTransformers("transformers"))
    with pytest.raises(StubEnvironmentError, match="root cause: ImportError: second"):
        check_stub_imports()
