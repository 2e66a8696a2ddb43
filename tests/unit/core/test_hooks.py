"""torch's registration hooks (``metamode._core.hooks``): installed once, exactly ours,
and what they do with what a module registers inside a context.

``load_state_dict(assign=True)`` inside an ``empty_weights`` block registers the loaded
parameters there, so they would go back on meta: the hook warns, naming the parameter.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import metamode
from metamode._core import hooks as _hooks
from metamode._core.modes import LoadedIntoEmptyWeightsWarning

# -- installation -----------------------------------------------------------------------------


def test_hook_detection_ignores_foreign_hooks():
    def foreign(*args):
        return None

    assert _hooks._already_installed({}) is False
    assert _hooks._already_installed({1: foreign}) is False
    assert _hooks._already_installed({1: foreign, 2: _hooks._on_buffer_registered}) is True


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_install_adds_exactly_the_missing_hook(kind):
    hooks = getattr(torch_module, f"_global_{kind}_registration_hooks")
    expected = {
        "parameter": _hooks._on_parameter_registered,
        "buffer": _hooks._on_buffer_registered,
    }
    saved = dict(hooks)
    try:
        ours = [k for k, hook in hooks.items() if getattr(hook, "__metamode_hook__", False)]
        for key in ours:
            del hooks[key]
        assert _hooks.installed() is False, f"the {kind} hook is missing"
        _hooks._install()
        assert _hooks.installed() is True
        added = [hook for hook in hooks.values() if getattr(hook, "__metamode_hook__", False)]
        assert added == [expected[kind]]
        assert len(hooks) == len(saved) - len(ours) + 1
    finally:
        hooks.clear()
        hooks.update(saved)


# -- what the hooks do with a registration ------------------------------------------------------


def test_none_buffer_is_registered_untouched_with_include_buffers():
    module = nn.Module()
    with metamode.empty_weights(include_buffers=True):
        module.register_buffer("absent", None)
        module.register_buffer("present", torch.ones(2, device="cpu"))
    assert module.absent is None and module.present.is_meta


@pytest.mark.per_interpreter
def test_assign_inside_the_block_warns_naming_the_parameter_and_the_fix():
    state = nn.Linear(2, 2).state_dict()
    with metamode.empty_weights():
        model = nn.Sequential(nn.Linear(2, 2))
        with pytest.warns(LoadedIntoEmptyWeightsWarning) as caught:
            model.load_state_dict({f"0.{k}": v for k, v in state.items()}, assign=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "Linear.weight" in messages[0] and "Linear.bias" in messages[1]
    assert "after the block" in messages[0]
    assert caught[0].filename == __file__  # points at the load_state_dict call
    model.load_state_dict({f"0.{k}": v for k, v in state.items()}, assign=True)
    assert torch.equal(model[0].weight, state["weight"])


def _through(depth, call, *args):
    """``call(*args)``, ``depth`` frames further down the stack."""
    return call(*args) if depth == 0 else _through(depth - 1, call, *args)


class _WrappedLinear(nn.Linear):
    """Overrides that put frames between torch's ``_load_from_state_dict`` and the
    registration hook, and between ``load_state_dict`` and ``_load_from_state_dict``."""

    def __setattr__(self, name, value):
        _through(12, super().__setattr__, name, value)

    def _load_from_state_dict(self, *args):
        _through(12, super()._load_from_state_dict, *args)


@pytest.mark.per_interpreter
def test_assign_inside_the_block_warns_through_overriding_subclasses():
    state = nn.Linear(2, 2).state_dict()
    with metamode.empty_weights():
        model = _WrappedLinear(2, 2)
        with pytest.warns(LoadedIntoEmptyWeightsWarning) as caught:
            call_line = sys._getframe().f_lineno + 1
            model.load_state_dict(state, assign=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "Linear.weight" in messages[0] and "Linear.bias" in messages[1]
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, call_line)] * 2
    model.load_state_dict(state, assign=True)
    assert torch.equal(model.weight, state["weight"])


@pytest.mark.per_interpreter
def test_assign_by_a_direct_load_from_state_dict_call_warns_at_that_call():
    state = nn.Linear(2, 2).state_dict()
    with metamode.empty_weights():
        model = nn.Linear(2, 2)
        with pytest.warns(LoadedIntoEmptyWeightsWarning) as caught:
            call_line = sys._getframe().f_lineno + 1
            model._load_from_state_dict(
                state, "", {"assign_to_params_buffers": True}, True, [], [], []
            )
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, call_line)] * 2


def test_no_warning_for_ordinary_reassignment_or_assign_outside():
    state = nn.Linear(2, 2).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with metamode.empty_weights():
            model = nn.Linear(2, 2)
            model.weight = nn.Parameter(torch.ones(2, 2))  # construction code does this
            model.load_state_dict({k: v.to("meta") for k, v in state.items()}, assign=True)
        model.load_state_dict(state, assign=True)
    assert torch.equal(model.weight, state["weight"])
