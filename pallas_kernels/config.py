"""The one explicit switch of the kernel package: run kernels in Pallas interpret mode.

On a GPU the kernels compile through Triton. Everywhere else they can still run,
slowly, in Pallas interpret mode -- that is how CI checks their numerics on CPU.
Interpret mode is off unless a caller turns it on for a block of code::

    with pallas_kernels.config.interpret(True):
        y = ops.linear(x, qw)          # takes the Pallas path on CPU

On a GPU the kernels take over by themselves (``ops.linear`` with ``backend="auto"``,
one-token decode steps over a quantized KV cache). ``disabled()`` turns them all
off for a block, so everything runs through XLA (the CLI's ``--xla``)::

    with pallas_kernels.config.disabled():
        tokens = generate(...)

Context variables hold both flags, so they are scoped to the ``with`` block (and to
the current thread / task) and nothing global is patched. They are read when a
function is traced: a function jitted before the ``with`` keeps its compiled choice.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_INTERPRET = contextvars.ContextVar("pallas_kernels_interpret", default=False)
_DISABLED = contextvars.ContextVar("pallas_kernels_disabled", default=False)


@contextlib.contextmanager
def interpret(enabled: bool = True):
    """Run Pallas kernels in interpret mode inside this block (for tests on CPU)."""
    token = _INTERPRET.set(bool(enabled))
    try:
        yield
    finally:
        _INTERPRET.reset(token)


@contextlib.contextmanager
def disabled():
    """No Pallas kernel runs inside this block, not even on a GPU: XLA everywhere."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def is_disabled() -> bool:
    return _DISABLED.get()


def interpret_enabled() -> bool:
    return _INTERPRET.get()


def on_gpu() -> bool:
    """True when the default JAX backend is a CUDA GPU (where Triton kernels compile)."""
    return jax.default_backend() == "gpu"


def kernels_available() -> bool:
    """Kernels can run here: on a GPU, or anywhere in interpret mode (and they are not disabled)."""
    return not is_disabled() and (interpret_enabled() or on_gpu())


def resolve_interpret(interpret_arg: bool | None) -> bool:
    """An explicit ``interpret=`` argument wins; else the context flag; on a GPU it is off."""
    if interpret_arg is not None:
        return bool(interpret_arg)
    return interpret_enabled()
