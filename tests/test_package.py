"""The installed package: its version is written once, its metadata agrees, and
it ships its license and its type-annotation marker."""

from __future__ import annotations

import importlib.metadata

import jax_tiled


def test_version_is_single_sourced():
    """pyproject.toml reads the version from jax_tiled/__init__.py."""
    assert importlib.metadata.version("jax_tiled") == jax_tiled.__version__


def test_license_is_shipped():
    files = importlib.metadata.files("jax_tiled") or []
    assert any(f.name == "LICENSE" for f in files), files


def test_type_annotations_are_shipped():
    """py.typed marks the package as typed (PEP 561) for type checkers."""
    files = importlib.metadata.files("jax_tiled") or []
    assert any(f.name == "py.typed" for f in files), files
