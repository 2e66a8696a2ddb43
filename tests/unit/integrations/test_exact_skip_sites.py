"""How the exact-skip rule finds a call site: the source position of the caller's current
instruction and the ``ast`` of the caller's source, on every supported interpreter.

Each form below writes ``<expr>.NAME(...)`` some way; under the same seed, the tensors and
the random numbers drawn after must equal diffusers' stock ``no_init_weights``. Code with no
source to read runs its calls (stock skips them): never a skip that stock would not make.
"""

from __future__ import annotations

import gc
import json
import linecache
import subprocess
import sys
import weakref

import pytest
import torch

from metamode.integrations import _exact_skip
from metamode.integrations._exact_skip import SkipLibraryInit

diffusers = pytest.importorskip("diffusers")
from diffusers.models import modeling_utils  # noqa: E402

pytestmark = pytest.mark.per_interpreter

init = torch.nn.init
_bound_normal = torch.nn.init.normal_  # bound before any context: stock runs it


def _identity(f):
    return f


def _returning(_value):
    return _identity


def multi_line_calls(ts):
    init.normal_(
        ts[0],
        mean=1.0,
        std=2.0,
    )
    torch.nn.init.kaiming_uniform_(ts[1],
                                   a=5**0.5)  # fmt: skip
    init.constant_(
        ts[2],
        3.0,
    )


def attribute_on_a_later_line(ts):
    (torch.nn.init
        .uniform_(ts[0], -2.0, 2.0))  # fmt: skip
    torch.nn \
        .init \
        .normal_(ts[1])  # fmt: skip
    (torch.nn.init
        .constant_(ts[2], val=3.0))  # fmt: skip


def keyword_and_star_calls(ts):
    init.normal_(tensor=ts[0], mean=0.0, std=1.0)
    init.constant_(val=2.0, tensor=ts[1])
    init.uniform_(**{"tensor": ts[2], "b": 4.0})
    init.kaiming_uniform_(*ts[3:], mode="fan_out")


def inside_comprehensions(ts):
    [init.normal_(t) for t in ts[:2]]
    {i: init.uniform_(t, b=2.0) for i, t in enumerate(ts[2:3])}
    list(init.constant_(t, 5.0) for t in ts[3:])


def inside_lambdas_and_generators(ts):
    (lambda t: init.normal_(t, std=3.0))(ts[0])
    sorted(ts[1:3], key=lambda t: init.uniform_(t) is None)

    def generate():
        yield init.constant_(ts[3], 4.0)

    list(generate())


def inside_decorated_functions(ts):
    @torch.no_grad()
    def reset(t):
        init.normal_(t)

    @_identity
    @_identity
    def reset_uniform(t):
        init.uniform_(t, a=-3.0)

    reset(ts[0])
    reset_uniform(ts[1])


def inside_decorator_expressions(ts):
    @_returning(init.normal_(ts[0]))
    def f():
        pass

    @_returning(
        init.constant_(ts[1], 6.0),
    )
    class C:
        init.uniform_(ts[2])


def several_calls_on_one_line(ts):
    init.normal_(ts[0]); init.uniform_(ts[1]); (init.constant_(ts[2], 1.5), init.normal_(ts[3]))  # fmt: skip  # noqa: E501, E702


def calls_stock_runs(ts):
    _bound_normal(ts[0])  # a name bound before the context
    ts[1].data.normal_()  # tensor methods
    ts[2].data.uniform_(-1.0, 1.0)
    init.ones_(ts[3])  # not in diffusers' TORCH_INIT_FUNCTIONS


SKIPPED_BY_STOCK = [
    multi_line_calls,
    attribute_on_a_later_line,
    keyword_and_star_calls,
    inside_comprehensions,
    inside_lambdas_and_generators,
    inside_decorated_functions,
    inside_decorator_expressions,
    several_calls_on_one_line,
]


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def _run(form, context):
    torch.manual_seed(7)
    ts = [torch.nn.Parameter(torch.full((4, 4), -5.0)) for _ in range(4)]
    with context:
        form(ts)
    return [t.detach().clone() for t in ts], torch.randn(3)


def _skip_library_init():
    return SkipLibraryInit(frozenset(modeling_utils.TORCH_INIT_FUNCTIONS))


def _assert_same(run, other):
    (tensors, after), (other_tensors, other_after) = run, other
    assert all(torch.equal(a, b) for a, b in zip(tensors, other_tensors, strict=True))
    assert torch.equal(after, other_after), "a different amount of random numbers was drawn"


@pytest.mark.parametrize("form", SKIPPED_BY_STOCK, ids=lambda form: form.__name__)
def test_every_way_of_writing_the_call_is_skipped_as_stock_skips_it(form):
    stock = _run(form, modeling_utils.no_init_weights())
    eager = _run(form, _NoContext())
    assert all(torch.equal(t, torch.full((4, 4), -5.0)) for t in stock[0]), "stock skips all"
    assert not torch.equal(stock[1], eager[1])
    _assert_same(_run(form, _skip_library_init()), stock)


def test_calls_stock_runs_run():
    stock = _run(calls_stock_runs, modeling_utils.no_init_weights())
    _assert_same(stock, _run(calls_stock_runs, _NoContext()))
    _assert_same(_run(calls_stock_runs, _skip_library_init()), stock)


def _compiled(source: str, filename: str):
    namespace = {"init": torch.nn.init, "normal_bound": torch.nn.init.normal_}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["reset"]


_RESET = "def reset(ts):\n    init.normal_(ts[0])\n"


def test_code_without_source_runs_its_calls():
    reset = _compiled(_RESET, "<metamode-test-no-source>")
    assert linecache.getlines("<metamode-test-no-source>") == []
    _assert_same(_run(reset, _skip_library_init()), _run(reset, _NoContext()))


def test_source_that_linecache_holds_is_read(monkeypatch):
    """As IPython registers its cells: compiled from a string, the lines in linecache."""
    filename = "<metamode-test-cell>"
    monkeypatch.setitem(
        linecache.cache, filename, (len(_RESET), None, _RESET.splitlines(True), filename)
    )
    reset = _compiled(_RESET, filename)
    stock = _run(reset, modeling_utils.no_init_weights())
    _assert_same(_run(reset, _skip_library_init()), stock)
    assert torch.equal(stock[0][0], torch.full((4, 4), -5.0))


def test_equal_code_under_two_file_names_is_read_from_each_file(monkeypatch):
    with_source = "<metamode-test-with-source>"
    monkeypatch.setitem(
        linecache.cache, with_source, (len(_RESET), None, _RESET.splitlines(True), with_source)
    )
    read, unread = _compiled(_RESET, with_source), _compiled(_RESET, "<metamode-test-without>")
    assert read.__code__ == unread.__code__  # equal keys of the call-site cache
    for reset in (read, unread, read):
        context = modeling_utils.no_init_weights() if reset is read else _NoContext()
        _assert_same(_run(reset, _skip_library_init()), _run(reset, context))


def test_source_that_no_longer_matches_the_code_runs_the_call(monkeypatch):
    """The call's span holds ``init.normal_(...)`` in the source linecache gives, but the
    code calls a name bound before the context (stock runs it)."""
    filename = "<metamode-test-stale>"
    compiled = "def reset(ts):\n    normal_bound(ts[0])\n"
    stale = "def reset(ts):\n    init.normal_(ts[0])\n"
    assert len(compiled) == len(stale)
    monkeypatch.setitem(
        linecache.cache, filename, (len(stale), None, stale.splitlines(True), filename)
    )
    reset = _compiled(compiled, filename)
    stock = _run(reset, modeling_utils.no_init_weights())
    _assert_same(stock, _run(reset, _NoContext()))
    _assert_same(_run(reset, _skip_library_init()), stock)


_SCRIPT = """
import json
import torch
from metamode.integrations._exact_skip import SkipLibraryInit

torch.manual_seed(7)
t = torch.nn.Parameter(torch.full((4, 4), -5.0))
with SkipLibraryInit(frozenset({"normal_"})):
    torch.nn.init.normal_(t)
print(json.dumps({"skipped": torch.equal(t.detach(), torch.full((4, 4), -5.0))}))
"""


@pytest.mark.parametrize(("options", "skipped"), [((), True), (("-X", "no_debug_ranges"), False)])
def test_positions_without_columns_run_the_call(tmp_path, options, skipped):
    script = tmp_path / "reset.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, *options, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout) == {"skipped": skipped}


def test_the_call_site_cache_holds_code_weakly(monkeypatch):
    filename = "<metamode-test-weak>"
    source = "def reset(ts):\n    init.normal_(ts[0], std=0.5)\n"  # compiled here only
    monkeypatch.setitem(
        linecache.cache, filename, (len(source), None, source.splitlines(True), filename)
    )
    reset = _compiled(source, filename)
    assert reset.__code__ not in _exact_skip._CALLEE_NAMES
    _run(reset, _skip_library_init())
    sites = _exact_skip._CALLEE_NAMES[reset.__code__]
    assert {site[0] for site in sites} == {filename}
    assert set(sites.values()) == {"normal_"}
    code = weakref.ref(reset.__code__)
    del reset, sites
    gc.collect()
    assert code() is None
