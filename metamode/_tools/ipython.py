"""IPython extension: the ``%%empty_weights`` cell magic.

    %load_ext metamode

    %%empty_weights --include-buffers
    model = MyModel(config)

runs the cell inside :func:`metamode.empty_weights`, so everything it builds
has its weights on ``meta`` (or ``--device``). The context is entered and
exited around the cell's code in the kernel's thread, so nothing outlives
the cell, even when it raises.

The cell is executed the way ``%%time`` executes one -- transformed (line
magics and ``!`` work inside), compiled, run in the user namespace, the last
expression returned as the cell's value -- and not through a nested
``run_cell``: a nested ``run_cell`` swallows the exception, so a failing cell
would report success to nbclient / papermill. Top-level ``await`` is not
supported inside the magic. As in any cell, a trailing ``;`` suppresses the
output, and a traceback from the cell shows the cell's frames, not the
magic's.
"""

from __future__ import annotations

import ast
import io
import tokenize

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from metamode._contexts.empty_weights import empty_weights

__all__ = ["EmptyWeightsMagics", "load_ipython_extension"]


@magics_class
class EmptyWeightsMagics(Magics):
    """Holds the ``%%empty_weights`` cell magic."""

    @magic_arguments()
    @argument(
        "--include-buffers",
        action="store_true",
        help="also put buffers and factory calls without device= on the device",
    )
    @argument("--device", default="meta", help="where parameters go (default: meta)")
    @cell_magic
    def empty_weights(self, line: str, cell: str) -> object:
        """Run the cell under ``metamode.empty_weights()``: its models get no real weights.

        Everything the cell builds has its parameters (and with
        ``--include-buffers``, its buffers) on ``--device``, ``meta`` by
        default. Only the kernel's thread is affected, and only while the
        cell runs. The value of the cell's last expression is its output,
        unless the cell ends with ``;``.
        """
        __tracebackhide__ = True  # IPython hides this frame from the cell's tracebacks
        args = parse_argstring(self.empty_weights, line)
        try:
            context = empty_weights(include_buffers=args.include_buffers, device=args.device)
        except ValueError as error:
            raise UsageError(f"%%empty_weights: {error}") from None
        shell = self.shell
        source = shell.transform_cell(cell)
        tree = shell.transform_ast(shell.compile.ast_parse(source))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(source):
            last = ast.Expression(tree.body.pop().value)
        # Registered with IPython's line cache, so tracebacks show the cell's lines.
        filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
        body = shell.compile(tree, filename, "exec")
        value = None if last is None else shell.compile(last, filename, "eval")
        namespace = shell.user_ns
        with context:
            exec(body, namespace)
            return None if value is None else eval(value, namespace)


def _ends_with_semicolon(source: str) -> bool:
    """Whether the last token of ``source`` is ``;`` (IPython's rule for silencing output)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    ignored = {tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT}
    ignored |= {tokenize.INDENT, tokenize.DEDENT}
    for token in reversed(tokens):
        if token.type not in ignored:
            return token.type == tokenize.OP and token.string == ";"
    return False


def load_ipython_extension(ipython) -> None:
    """Register ``%%empty_weights`` (``%load_ext metamode`` calls this)."""
    ipython.register_magics(EmptyWeightsMagics)
