"""How close two replicas of a stage on other kernels or backends must come (a spot check across
them, head/row_checks.py): each row the stage sent on (the tail: each logit row) is compared by its
relative error, ||a - b|| / ||a||, and a request's stage passes when its largest row error is within
the tolerance of its kind.

Replicas of one build, backend and kernels are held to equal bytes instead (head/proofs.py); other
kernels round differently in every dot product, so their rows differ a little, and the errors grow
with the layers a stage holds and the positions behind a row. The bounds come from pairs measured by
`benchmarks/cross_kernels_study.py` (docs/benchmarks.md, "Across kernels"; SmolLM2-135M Q4_1, zen4
against haswell kernels): honest replicas' largest error was 0.049 (centred logit rows; hidden rows
0.043; sessions of up to 454 positions), about half the bound; the cheats that change the computation (a
skipped layer, another quantization, a stale row) gave no row under 0.138, and no request's largest
under 0.27. Noise of 1e-3 is about 1e-4 of a row: across kernels it is not seen (a replica of the
same kernels sees it).
zen4 against sse42 kernels (no AVX) stayed under 0.047 too; a Sapphire Rapids' AMX kernels against
haswell under 0.047, and against ggml's Vulkan backend on lavapipe (Vulkan on the CPU) under 0.045.
Other pairs (a real GPU) and longer sessions are not measured here.
"""

from __future__ import annotations

import numpy as np

#: the largest relative error of a hidden row, and of a centred logit row, allowed a replica on
#: other kernels or another backend (see above)
HIDDEN_TOLERANCE = 0.10
LOGITS_TOLERANCE = 0.10


def row_errors(a: np.ndarray, b: np.ndarray, centered: bool = False) -> np.ndarray:
    """Each row's relative error of `b` against `a` (same shape; inf where shapes differ or a value
    is not finite). `centered`: each row less its mean first (logits: a row means the same
    distribution whatever constant is added to it, and other kernels shift it as a whole)."""
    a = np.asarray(a, dtype=np.float64).reshape(len(a), -1)
    b = np.asarray(b, dtype=np.float64).reshape(len(b), -1)
    if a.shape != b.shape:
        return np.full(max(len(a), 1), np.inf)
    if centered:
        a, b = a - a.mean(axis=1, keepdims=True), b - b.mean(axis=1, keepdims=True)
    diff = np.linalg.norm(a - b, axis=1)
    scale = np.maximum(np.linalg.norm(a, axis=1), 1e-30)
    errors = diff / scale
    errors[~np.isfinite(errors)] = np.inf
    return errors


class Closeness:
    """A stage's largest row error over a request's steps."""

    __slots__ = ("max_error", "rows", "total")

    def __init__(self):
        self.max_error, self.rows, self.total = 0.0, 0, 0.0

    def add(self, a: np.ndarray, b: np.ndarray, centered: bool = False) -> None:
        errors = row_errors(a, b, centered)
        self.max_error = max(self.max_error, float(errors.max(initial=0.0)))
        self.rows += len(errors)
        self.total += float(errors.sum())

    @property
    def mean_error(self) -> float:
        return self.total / self.rows if self.rows else 0.0

    def within(self, tolerance: float) -> bool:
        return self.max_error <= tolerance
