"""Recognising the HF forwards that the patched forwards mirror, for transformers releases newer than
any tested.

A forward's *form* is its syntax tree without annotations, docstring, decorators or its name, with
the cache argument's name (``past_key_values`` through 5.23, ``cache`` from 5.24) replaced by a
placeholder, hashed. A layer whose forward still has a known form runs the same submodule calls with
the same arguments and the same adds as the forward ``_layers`` mirrors, so it can be patched; any
other edit (a new add, a moved norm, another call) changes the form.
"""
import ast
import hashlib
import inspect
import textwrap

# The forms of transformers 5.17 through 5.24 (every release in between has the same ones).
KNOWN = {
    "rms": "b4b2f2e4f5c858f0",        # LlamaDecoderLayer.forward (Mistral, Qwen2, Qwen3 are copies)
    "neox": "6732ca54d1495e8b",       # GPTNeoXLayer.forward
    "gpt2": "6ff63cfbb50f6bd5",       # GPT2Block.forward
    "rms_norm": "ca7f077cfce6d2a8",   # LlamaRMSNorm.forward (and its copies)
}

# Fields that vary between Python versions or do not change what the code does.
_SKIP = frozenset({"annotation", "returns", "type_comment", "type_params", "ctx", "kind"})
_CACHE_NAMES = ("cache", "past_key_values")


def cache_arg(fn):
    """The name of the cache argument of an HF layer forward, or None when it has none."""
    params = inspect.signature(fn).parameters
    return next((n for n in _CACHE_NAMES if n in params), None)


def _walk(node, cache, out):
    if isinstance(node, ast.AST):
        out.append(type(node).__name__ + "(")
        for field in node._fields:
            if field in _SKIP:
                continue
            value = getattr(node, field, None)
            if field in ("arg", "id") and value is not None and value == cache:
                value = "<cache>"
            out.append(field + "=")
            _walk(value, cache, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            _walk(item, cache, out)
            out.append(",")
        out.append("]")
    else:
        out.append(repr(node))


def form(fn):
    """The form of a function (see the module docstring); None when its source cannot be read."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, ast.FunctionDef):
        return None
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        tree.body = body[1:]
    tree.name, tree.decorator_list = "forward", []
    cache = next((a.arg for a in tree.args.args if a.arg in _CACHE_NAMES), None)
    out = []
    _walk(tree, cache, out)
    return hashlib.sha256("".join(out).encode()).hexdigest()[:16]


def is_known(fn, kind):
    return form(fn) == KNOWN[kind]
