"""A chat template's sandbox with bounds: a GGUF's `tokenizer.chat_template` is the model file's
code, run on every chat request with the caller's messages as its data.

jinja2's immutable sandbox already keeps a template from Python's objects and from changing its
inputs, and bounds `range` (100,000 items). What it leaves open is size and time: a careless
template driven by a caller's messages, or a hostile one, can build a value of gigabytes in a few
operations (`'x' * 10**9`, a string doubled in a loop, `'%999999999d' % 1`, `s.ljust(10**9)`)
or loop for hours writing nothing. Here:

- every operator that makes a value from others (`*`, `**`, `+`, `%`, `~`) is checked before it
  runs against `max_chars` (and integers against `MAX_INT_BITS`);
- every call and every filter is checked before it runs (no integer argument past `max_chars`, no
  format width of seven digits) and after (no string or list past `max_chars`);
- `lipsum` (n paragraphs of text on request) is not offered;
- the output is counted as it is produced, and a render past `max_seconds` is stopped (a trace
  function on the rendering thread checks the clock at each line of the compiled template: a loop
  that writes nothing is stopped too).

Invariant: a render returns at most `max_chars` characters within about `max_seconds`, or raises
`TemplateRefused`; the bounds are per value, so memory stays within a small multiple of
`max_chars` except through a chain of calls on values each under it (documented in
docs/security.md: load GGUFs you trust)."""

from __future__ import annotations

import functools
import operator
import re
import sys
import time

from jinja2 import TemplateError
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: the longest text, list or rendering a template may make (characters or items)
MAX_CHARS = 4 * 2**20
#: the largest integer a template may make (bits): enough for any arithmetic a template does
MAX_INT_BITS = 4096
#: the longest a render may run
MAX_SECONDS = 5.0
#: a format width or precision of seven digits or more: `%9999999d`, `%.9999999f`, `{:>9999999}`
_WIDE_PERCENT = re.compile(r"%[-#0 +]*(\d{7,}|\d*\.\d{7,})")
_WIDE_BRACES = re.compile(r"\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


class TemplateRefused(Exception):
    """The template, run on these messages, went past a bound or raised."""


def _size(v) -> int:
    return len(v) if isinstance(v, (str, list, tuple, dict)) else 0


def _check_value(v, max_chars: int):
    if _size(v) > max_chars:
        raise SecurityError(f"a value of {_size(v)} items in a chat template (at most {max_chars})")
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > MAX_INT_BITS:
        raise SecurityError(f"an integer over {MAX_INT_BITS} bits in a chat template")
    return v


def _check_arguments(args, kwargs, max_chars: int) -> None:
    """No integer argument past the bound: `s.ljust(10**9)`, `s|center(10**9)`, `s|indent(10**9)`."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > max_chars:
            raise SecurityError(f"an argument of {a} in a chat template (at most {max_chars})")


def _check_format(fmt, braces: bool) -> None:
    if isinstance(fmt, str) and (_WIDE_BRACES.search(fmt) if braces else _WIDE_PERCENT.search(fmt.replace("%%", ""))):
        raise SecurityError("a format width of seven digits in a chat template")


def _bounded_join(max_chars: int, seq) -> str:
    parts = [str(x) for x in seq]
    if sum(map(len, parts)) > max_chars:
        raise SecurityError(f"a concatenation over {max_chars} characters in a chat template")
    return "".join(parts)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` (jinja2's concatenation, which the sandbox's operator hook does not see) to
    a join that checks its length first."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with every value-making operation bounded (see the module)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    _OPS = {"*": operator.mul, "**": operator.pow, "+": operator.add, "%": operator.mod}

    def __init__(self, *args, max_chars: int = MAX_CHARS, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_chars = max_chars
        self.globals.pop("lipsum", None)
        self.filters = {name: self._bounded(f) for name, f in self.filters.items()}

    def bounded_join(self, seq) -> str:
        return _bounded_join(self.max_chars, seq)

    def _bounded(self, fn):
        """A filter whose arguments and result are checked (the value filtered is the first argument
        after what jinja2 passes first to a pass_context/pass_environment filter)."""
        skip = 2 if getattr(fn, "jinja_pass_arg", None) is not None else 1
        printf = fn.__name__ == "do_format"  # `'%9999999d'|format(1)`

        @functools.wraps(fn)
        def bounded(*args, **kwargs):
            _check_arguments(args[skip:], kwargs, self.max_chars)
            if printf and len(args) >= skip:
                _check_format(args[skip - 1], braces=False)
            return _check_value(fn(*args, **kwargs), self.max_chars)

        return bounded

    def call_binop(self, context, op: str, left, right):
        limit = self.max_chars
        if op == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and max(1, abs(left).bit_length()) * right > MAX_INT_BITS:
                raise SecurityError(f"a power over {MAX_INT_BITS} bits in a chat template")
        elif op == "*":
            n = right if _size(left) else left if _size(right) else None
            if isinstance(n, int) and max(_size(left), _size(right)) * n > limit:
                raise SecurityError("a repeated value too long for a chat template")
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() + right.bit_length() > MAX_INT_BITS
            ):
                raise SecurityError(f"a product over {MAX_INT_BITS} bits in a chat template")
        elif op == "+" and _size(left) + _size(right) > limit:
            raise SecurityError("a concatenation too long for a chat template")
        elif op == "%":
            _check_format(left, braces=False)
        return _check_value(self._OPS[op](left, right), limit)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        _check_arguments(args, kwargs, __self.max_chars)
        if getattr(__obj, "__name__", None) in ("format", "format_map"):  # str.format's widths (the
            # sandbox hands out a wrapper of the bound method)
            _check_format(getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None), braces=True)
        return _check_value(super().call(__context, __obj, *args, **kwargs), __self.max_chars)


def render_bounded(template, max_chars: int = MAX_CHARS, max_seconds: float = MAX_SECONDS, **context) -> str:
    """`template` (made by a BoundedSandbox) rendered with `context`, within the bounds; TemplateRefused
    otherwise. Runs on the calling thread, which it traces while it renders."""
    deadline = time.monotonic() + max_seconds

    def trace(frame, event, arg):  # each call; each line of the compiled template's own frames
        if time.monotonic() > deadline:
            raise SecurityError(f"the chat template ran past {max_seconds:g} s")
        return trace if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        parts, n = [], 0
        for part in template.generate(**context):
            n += len(part)
            if n > max_chars:
                raise SecurityError(f"the rendered prompt is over {max_chars} characters")
            parts.append(part)
        return "".join(parts)
    except (
        TemplateError,
        OverflowError,
        RecursionError,
        MemoryError,
        TypeError,
        ValueError,
        AttributeError,
        KeyError,
        IndexError,
        ZeroDivisionError,
    ) as e:
        # jinja2 raises OverflowError for a range over its bound; Python's own errors are the
        # template failing on these messages: each is a refusal of the request, not the worker's fault
        raise TemplateRefused(f"{type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)
