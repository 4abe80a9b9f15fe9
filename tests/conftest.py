"""Shared fixtures: repository paths and the exercise generator (tools/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def make_exercises():
    """tools/make_exercises.py imported as a module."""
    spec = importlib.util.spec_from_file_location("make_exercises", REPO / "tools" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def demo_solutions() -> Path:
    """Folder holding the tiny demo solution notebook (99_demo.ipynb) the grading tests use."""
    return DATA / "solutions"
