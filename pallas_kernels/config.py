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

``compiling_for(device)`` traces for another device than the default one -- a GPU of a
deviceless topology (``jax.experimental.topologies``), so that a CPU-only machine can
compile what a GPU would run (``scripts/gpu_aot.py``): every "which backend / which
device is this" decision of the package (kernels or not, native CPU kernels, the
dispatch table's device) asks :func:`target_device` / :func:`target_backend`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_INTERPRET = contextvars.ContextVar("pallas_kernels_interpret", default=False)
_DISABLED = contextvars.ContextVar("pallas_kernels_disabled", default=False)
_TARGET = contextvars.ContextVar("pallas_kernels_target", default=None)


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


@contextlib.contextmanager
def compiling_for(device):
    """Trace inside this block for ``device`` (a ``jax.Device``, e.g. ``topology.devices[0]`` of a deviceless
    GPU topology) instead of the default device: kernels, layouts and the dispatch table's entries are
    chosen as they would be there. Lower with shardings on ``device`` to compile for it."""
    if getattr(device, "platform", None) is None or getattr(device, "device_kind", None) is None:
        raise ValueError(f"compiling_for expects a jax Device (with platform and device_kind), got {device!r}")
    token = _TARGET.set(device)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_device():
    """The device traced for: the :func:`compiling_for` device, else the default one."""
    device = _TARGET.get()
    return device if device is not None else jax.devices()[0]


def compute_capability(device=None) -> tuple[int, int] | None:
    """(major, minor) of ``device``'s CUDA compute capability (default: the traced-for device), or None where it has
    none (a CPU, a device that does not say)."""
    device = device or target_device()
    try:
        major, minor = (int(v) for v in str(getattr(device, "compute_capability", "")).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def target_backend() -> str:
    """The backend traced for ("cpu", "gpu", ...): the :func:`compiling_for` device's, else the default."""
    device = _TARGET.get()
    return device.platform if device is not None else jax.default_backend()


def is_disabled() -> bool:
    return _DISABLED.get()


def interpret_enabled() -> bool:
    return _INTERPRET.get()


def on_gpu() -> bool:
    """True when tracing for a CUDA GPU (where Triton kernels compile): the default backend, or the
    :func:`compiling_for` device."""
    return target_backend() == "gpu"


def kernels_available() -> bool:
    """Kernels can run here: on a GPU, or anywhere in interpret mode (and they are not disabled)."""
    return not is_disabled() and (interpret_enabled() or on_gpu())


def resolve_interpret(interpret_arg: bool | None) -> bool:
    """An explicit ``interpret=`` argument wins; else the context flag; on a GPU it is off."""
    if interpret_arg is not None:
        return bool(interpret_arg)
    return interpret_enabled()
