"""materialize and running statistics updated in the build (a warm-up or shape-probing
forward through a normalisation layer in training mode).

torch's batch-norm kernels update ``running_mean`` / ``running_var`` in place without moving
their version counters, and most of their schemas do not mark them written either:
``metamode._core.facts.UNSTATED_WRITES`` writes those calls out (the argument that must be
true, the arguments updated), and an aten op's schema that does mark an argument written
(``_native_batch_norm_legit``) is read as such. Either way the update is recorded as a write,
so replay reproduces eager's statistics bit for bit. ``instance_norm`` updates its statistics
with ``copy_``, which moves their version counters: no row is needed for it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metamode._core.facts import UNSTATED_WRITES, fact_of
from tests.unit.contexts.materialize_checks import MODES, assert_eager_equal

_STATS = ("running_mean", "running_var")


class Stats(nn.Module):
    """Running statistics as buffers, updated in the constructor by ``update(self, x)`` on a
    random batch (meta with ``include_buffers=True``, real otherwise)."""

    def __init__(self, update, channels: int = 4) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.randn(channels))
        self.register_buffer("running_var", torch.rand(channels) + 0.5)
        update(self, torch.randn(8, channels) * 3 + 1)


# each updates the running statistics as eager does (training, or always)
UPDATES = {
    "F.batch_norm(training=True)": lambda s, x: F.batch_norm(
        x, s.running_mean, s.running_var, training=True, momentum=0.3
    ),
    "F.batch_norm positional training": lambda s, x: F.batch_norm(
        x, s.running_mean, s.running_var, None, None, True, 0.2
    ),
    "torch.batch_norm": lambda s, x: torch.batch_norm(
        x, None, None, s.running_mean, s.running_var, True, 0.1, 1e-5, False
    ),
    "torch.native_batch_norm": lambda s, x: torch.native_batch_norm(
        x, None, None, s.running_mean, s.running_var, True, 0.1, 1e-5
    ),
    "torch._native_batch_norm_legit (stated in its schema)": (
        lambda s, x: torch._native_batch_norm_legit(
            x, None, None, s.running_mean, s.running_var, True, 0.1, 1e-5
        )
    ),
    "torch._batch_norm_impl_index": lambda s, x: torch._batch_norm_impl_index(
        x, None, None, s.running_mean, s.running_var, True, 0.1, 1e-5, False
    ),
    "torch.ops.aten.batch_norm.default": lambda s, x: torch.ops.aten.batch_norm.default(
        x, None, None, s.running_mean, s.running_var, True, 0.1, 1e-5, False
    ),
    "torch.ops.aten.native_batch_norm": lambda s, x: torch.ops.aten.native_batch_norm(
        x, None, None, s.running_mean, s.running_var, True, 0.1, 1e-5
    ),
    "F.instance_norm(use_input_stats=True)": lambda s, x: F.instance_norm(
        x.view(2, 4, 4), s.running_mean, s.running_var, use_input_stats=True, momentum=0.4
    ),
    "F.batch_norm twice": lambda s, x: [
        F.batch_norm(x, s.running_mean, s.running_var, training=True) for _ in range(2)
    ],
    "F.batch_norm in eval mode (no update)": lambda s, x: F.batch_norm(
        x, s.running_mean, s.running_var, training=False
    ),
}


@pytest.mark.parametrize("include_buffers", MODES)
@pytest.mark.parametrize("update", sorted(UPDATES))
def test_running_statistics_updated_in_the_build_are_eagers(update, include_buffers):
    assert_eager_equal(
        lambda: nn.Sequential(nn.Linear(2, 2), Stats(UPDATES[update])), include_buffers
    )


def test_running_statistics_updated_on_real_tensors_in_the_build_are_eagers():
    """``batch_norm_update_stats`` has no meta kernel: on real buffers (params-only)."""

    def update(s: Stats, x: torch.Tensor) -> None:
        torch.batch_norm_update_stats(x, s.running_mean, s.running_var, 0.25)

    assert_eager_equal(lambda: nn.Sequential(nn.Linear(2, 2), Stats(update)))


class Probed(nn.Module):
    """BatchNorm layers warmed up, or probed for a size, by forwards in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.features(torch.randn(2, 3, 5, 5))
        n = self.features(torch.zeros(2, 3, 5, 5)).flatten(1).shape[1]
        self.head = nn.Sequential(nn.Linear(n, 4), nn.BatchNorm1d(4, momentum=0.5))
        with torch.no_grad():
            self.head(torch.randn(6, n))
        self.norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        self.norm(torch.randn(2, 4, 5))
        self.frozen = nn.BatchNorm1d(4).eval()
        self.frozen(torch.randn(3, 4))


def test_batchnorm_layers_run_forward_in_the_build_are_eagers():
    model = assert_eager_equal(Probed, include_buffers=True)
    assert int(model.features[1].num_batches_tracked) == 2


# -- the table, against torch -------------------------------------------------------------------


def _schemas(name: str) -> list:
    return torch._C._jit_get_schemas_for_operator(f"aten::{name}")


@pytest.mark.parametrize("name", sorted(UNSTATED_WRITES))
def test_each_unstated_row_is_an_op_whose_schema_does_not_mark_the_statistics_written(name):
    flag, written = UNSTATED_WRITES[name]
    schemas = [s for s in _schemas(name) if not any(a.kwarg_only for a in s.arguments)]
    assert schemas, f"aten::{name} is gone"
    for schema in schemas:
        arguments = {a.name: a for a in schema.arguments}
        assert set(written) <= arguments.keys()
        assert flag is None or flag in arguments
        for each in written:
            alias = arguments[each].alias_info
            assert alias is None or not alias.is_write, f"aten::{name} now states {each}"
    assert fact_of(getattr(torch, name)).unversioned is not None


_CUDA_ONLY = {
    "cudnn_batch_norm",
    "miopen_batch_norm",
    "batch_norm_gather_stats",
    "batch_norm_gather_stats_with_counts",
}


def _update(name: str):
    x = torch.randn(8, 4)
    return {
        "batch_norm": lambda m, v: torch.batch_norm(x, None, None, m, v, True, 0.1, 1e-5, False),
        "native_batch_norm": lambda m, v: torch.native_batch_norm(
            x, None, None, m, v, True, 0.1, 1e-5
        ),
        "_batch_norm_impl_index": lambda m, v: torch._batch_norm_impl_index(
            x, None, None, m, v, True, 0.1, 1e-5, False
        ),
        "batch_norm_update_stats": lambda m, v: torch.batch_norm_update_stats(x, m, v, 0.1),
    }[name]


@pytest.mark.parametrize("name", sorted(set(UNSTATED_WRITES) - _CUDA_ONLY))
def test_each_unstated_row_updates_the_statistics_without_moving_their_versions(name):
    mean, var = torch.zeros(4), torch.ones(4)
    _update(name)(mean, var)
    assert not torch.equal(mean, torch.zeros(4)) and not torch.equal(var, torch.ones(4))
    assert (mean._version, var._version) == (0, 0)


def test_the_python_batch_norm_uses_the_row_of_its_name():
    fact = fact_of(F.batch_norm).unversioned
    assert fact is not None
    assert fact.written == ((1, "running_mean"), (2, "running_var"))
    assert fact.flag == (5, "training", False)


def test_a_schema_that_marks_the_statistics_written_is_read_as_such():
    (schema,) = [s for s in _schemas("_native_batch_norm_legit") if s.overload_name == ""]
    stated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    assert stated == list(_STATS)
    fact = fact_of(torch._native_batch_norm_legit).unversioned
    assert fact is not None and [n for _, n in fact.written] == stated
    # ... and its kernel moves no version counter either
    mean, var = torch.zeros(4), torch.ones(4)
    torch._native_batch_norm_legit(torch.randn(8, 4), None, None, mean, var, True, 0.1, 1e-5)
    assert (mean._version, var._version) == (0, 0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_instance_norm_moves_the_versions_of_the_statistics_it_updates(device):
    mean, var = torch.zeros(4, device=device), torch.ones(4, device=device)
    F.instance_norm(torch.ones(2, 4, 3, device=device), mean, var, use_input_stats=True)
    assert mean._version > 0 and var._version > 0
    assert fact_of(F.instance_norm).unversioned is None
    assert fact_of(torch.instance_norm).unversioned is None
