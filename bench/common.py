"""Shared set-up for benchmarks: a private stack under a temp root, torn down afterwards."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hostmove.stack import stack_down, stack_up
from hostmove.stackinfo import StackInfo
from kernel.credentials import ENV_CREDENTIALS


@contextlib.contextmanager
def private_stack() -> Iterator[StackInfo]:
    with tempfile.TemporaryDirectory(prefix="hostmove-bench-") as tmp:
        root = Path(tmp) / "stack"
        info = stack_up(root)
        os.environ[ENV_CREDENTIALS] = info.credentials  # the benchmark acts as the stack's operator (issue 14)
        try:
            yield info
        finally:
            os.environ.pop(ENV_CREDENTIALS, None)
            stack_down(root)


def result(name: str, ratio: float, target: float) -> str:
    return f"RESULT {name} ratio={ratio:.3f} target={target}"
