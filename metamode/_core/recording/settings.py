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

from metamode._torch import (
    fp32_precision,
    mkldnn_deterministic,
    mkldnn_enabled,
    nnpack_enabled,
)

__all__ = ["ProcessSettings", "now"]


class ProcessSettings(NamedTuple):
    """The values of the settings; each changes some CPU kernels' bits."""

    # torch.set_float32_matmul_precision, or oneDNN's matmul fp32_precision (the newer
    # setting, which the older one writes): "high"/"medium" let CPU matmuls use bfloat16.
    # Named as the older setting names it; read from the newer, which both APIs set
    float32_matmul_precision: str
    # torch.backends.mkldnn.conv.fp32_precision (or .fp32_precision of oneDNN or of torch)
    float32_conv_precision: str
    # torch.backends.mkldnn.rnn.fp32_precision (likewise)
    float32_rnn_precision: str
    # torch.set_num_threads: reductions split their work by thread
    intra_op_threads: int
    # torch.backends.mkldnn.enabled: another convolution and matmul implementation
    mkldnn: bool
    # torch.backends.mkldnn.deterministic: oneDNN's deterministic kernels
    mkldnn_deterministic: bool
    # torch.backends.nnpack.flags: NNPACK's convolution for some batched shapes
    nnpack: bool

    def differences(self, other: ProcessSettings) -> list[str]:
        """What ``other`` sets otherwise, as ``name ours -> theirs``."""
        return [
            f"{name} {ours!r} -> {theirs!r}"
            for name, ours, theirs in zip(self._fields, self, other, strict=True)
            if ours != theirs
        ]


# oneDNN's fp32 precision of matmuls, as torch.set_float32_matmul_precision names it
_MATMUL_NAMES = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def now() -> ProcessSettings:
    """The process's settings now. The fp32 precision oneDNN computes an op at is the first
    one set of the op's own, oneDNN's and torch's (``"none"`` passes the question up), else
    full precision."""
    inherited = fp32_precision("mkldnn", "all")
    if inherited == "none":
        inherited = fp32_precision("generic", "all")
    if inherited == "none":
        inherited = "ieee"
    matmul = _onednn(inherited, "matmul")
    return ProcessSettings(
        _MATMUL_NAMES.get(matmul, matmul),
        _onednn(inherited, "conv"),
        _onednn(inherited, "rnn"),
        torch.get_num_threads(),
        mkldnn_enabled(),
        mkldnn_deterministic(),
        nnpack_enabled(),
    )


def _onednn(inherited: str, op: str) -> str:
    """oneDNN's fp32 precision of ``op``: its own, else ``inherited``."""
    own = fp32_precision("mkldnn", op)
    return inherited if own == "none" else own
