"""The process-wide settings torch consults for a CPU result.

torch keeps these once per process (the intra-op thread count under OpenMP per thread, new
threads starting from the last count set anywhere), so replay cannot put them back around
a call without changing other threads' results: each recorded call that computes
from tensor values keeps the values it ran under, and is refused when the process runs
under other values at materialize time. (Calls that only create or overwrite a tensor,
random draws included, do not depend on them.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ProcessSettings", "now"]


class ProcessSettings(NamedTuple):
    """The values of the settings; each changes some CPU kernels' bits."""

    # torch.set_float32_matmul_precision: "high"/"medium" let CPU matmuls use bfloat16
    float32_matmul_precision: str
    # torch.set_num_threads: reductions split their work by thread
    intra_op_threads: int
    # torch.backends.mkldnn.enabled: another convolution and matmul implementation
    mkldnn: bool

    def differences(self, other: ProcessSettings) -> list[str]:
        """What ``other`` sets otherwise, as ``name ours -> theirs``."""
        return [
            f"{name} {ours!r} -> {theirs!r}"
            for name, ours, theirs in zip(self._fields, self, other, strict=True)
            if ours != theirs
        ]


def now() -> ProcessSettings:
    """The process's settings now."""
    return ProcessSettings(
        torch.get_float32_matmul_precision(),
        torch.get_num_threads(),
        bool(torch.backends.mkldnn.enabled),
    )
