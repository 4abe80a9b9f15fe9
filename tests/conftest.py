"""Shared fixtures: repository paths and the exercise generator (tools/ is not a package)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


def pytest_configure(config):
    """The suite CI runs is the CPU suite, and on a GPU machine it stays one: many of its rank
    functions build CPU tensors and expect gloo's forked single-threaded ranks, where `launch`
    would pick NCCL and a forkserver for a 1-rank run (seen on an H100). So GPUs are hidden from
    it (before torch asks), unless the run selects the GPU checks (`make gpu-check`, `pytest -m
    gpu`) or the caller set CUDA_VISIBLE_DEVICES itself."""
    if re.search(r"(?<!not )\bgpu\b", config.option.markexpr or "") is None:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


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
