"""Launch settings of the matmul kernels at decode rows, overridden for a block of code.

Why: a kernel's tiles, stages and K splits were chosen by timing it alone, call after call, where the
run-to-run spread on an H200 (1.24x bf16 in one run, 1.58x in the next, same settings) is as large as the
differences between settings. A decode step of a 7B model (~2.5 ms, 128 such calls) averages that away:
``scripts/sweep_decode.py`` times whole decode loops, one per setting, and this is how it changes a
kernel's settings without touching the dispatch::

    with pallas_kernels.settings.override("int4_words", bn=256, stages=4):
        tokens = generate(...)      # every int4 word-kernel launch of <= 16 rows uses them

Each field replaces the kernel's own choice where given (None: keep it); an argument passed to the kernel
explicitly still wins. Rows beyond :data:`DECODE_ROWS` (prefill) keep their defaults. A setting the kernel
cannot take (a K block that is not a whole number of scale groups, ...) fails the kernel's own checks.
Like the other switches (:mod:`pallas_kernels.config`) the override is read when a function is traced and
is part of ``llmeq_jax.generate.kernel_state``, so a decode loop traced under one setting is not reused
under another.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from pallas_kernels.blocks import Blocks

# The kernels that take settings, by the name used here (their modules).
KERNELS = ("int4_words", "int8_f16", "weight_only", "w8a8", "float_matmul", "append_decode_attention")
# Rows a launch may have for its settings to apply: a decode step's batch (the kernels' 16-row tiles).
DECODE_ROWS = 16
EPILOGUES = ("rows", "mma")
CONVERTS = ("kernel", "xla")
NORMS = ("fold", "apart")
REDUCES = ("kernel", "xla")
ROPES = ("kernel", "xla")
CODES = ("kernel", "xla")
# The settings that are words, not counts: the kernels that take each and the words it takes.
WORDS = {"epilogue": (("int4_words",), EPILOGUES), "convert": (("int8_f16",), CONVERTS),
         "norm": (("int4_words", "float_matmul", "int8_f16", "w8a8"), NORMS),
         "reduce": (("int4_words", "float_matmul", "int8_f16", "weight_only", "w8a8", "append_decode_attention"),
                    REDUCES),
         "rope": (("append_decode_attention",), ROPES), "codes": (("w8a8",), CODES)}


# Kernels that take only some fields (the others would be read by no one).
ONLY = {"append_decode_attention": ("reduce", "rope")}


@dataclasses.dataclass(frozen=True)
class Settings:
    """One kernel's launch settings; None keeps the kernel's own choice.

    ``bn`` / ``bk``: the column tile and the K step; ``warps`` / ``stages``: Triton's warps and pipeline
    stages; ``programs``: the programs a split K loop aims for (``common.splits_for``'s target, 2 per
    SM of an H100 by default); ``k_splits``: the splits themselves (wins over ``programs``);
    ``epilogue``: the int4 word kernel's scale epilogue (``int4_words.EPILOGUES``); ``convert``: where the int8
    float16-operand kernel makes its float16 x from bfloat16 x, "kernel" (each K step's tile) or "xla" (before
    the launch: XLA fuses it into the op that makes x, but a decode step's norm then stays XLA's two kernels);
    ``norm``: whether a decode step's RMSNorm before the word, float or int8 float16-operand kernel's product is
    folded into it where it may be (``pallas_kernels.norm_fold``; "fold", the default there; W8A8: into the kernel
    that makes its activation codes) or left to a launch of its own ("apart"); ``codes``: who quantizes a W8A8
    decode step's activations per token: ``pallas_kernels.token_codes`` ("kernel", the default where it may run) or
    XLA's fusions ("xla"); ``reduce``: who adds a split product's partial sums (the float cache's attention
    kernel: merges its splits) where a scan carries the counters (``pallas_kernels.split_fixup``): the kernel's last
    program of each tile ("kernel", the default there) or XLA after it ("xla"); ``rope``: who rotates a decode
    step's query and key by RoPE where the float cache's attention kernel takes the step: the kernel ("kernel", the
    default: the q/k/v product's output reaches it as it is) or XLA's fusion before it ("xla").
    ``append_decode_attention`` takes ``reduce`` and ``rope`` alone, for a launch of its batch's rows."""

    bn: int | None = None
    bk: int | None = None
    warps: int | None = None
    stages: int | None = None
    programs: int | None = None
    k_splits: int | None = None
    epilogue: str | None = None
    convert: str | None = None
    norm: str | None = None
    reduce: str | None = None
    rope: str | None = None
    codes: str | None = None

    def blocks(self, default: Blocks) -> Blocks:
        """``default`` with the fields this setting gives."""
        given = {"bn": self.bn, "bk": self.bk, "num_warps": self.warps, "num_stages": self.stages}
        return dataclasses.replace(default, **{k: v for k, v in given.items() if v is not None})


NONE = Settings()
_OVERRIDES = contextvars.ContextVar("pallas_kernels_settings", default=())


def _checked(kernel: str, fields: dict) -> Settings:
    if kernel not in KERNELS:
        raise ValueError(f"settings: unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")
    names = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"settings: unknown field(s) {', '.join(unknown)} for {kernel}; "
                         f"known: {', '.join(sorted(names))}")
    only = ONLY.get(kernel)
    if only is not None and set(fields) - set(only):
        raise ValueError(f"settings: {kernel} takes {', '.join(only)} only, got {', '.join(sorted(fields))}")
    for name, value in fields.items():
        if name in WORDS:
            owners, words = WORDS[name]
            if kernel not in owners or value not in words:
                raise ValueError(f"settings: {name} belongs to {', '.join(owners)}, one of {words}; "
                                 f"got {value!r} for {kernel}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"settings: {kernel}.{name} must be a positive integer, got {value!r}")
    return Settings(**fields)


@contextlib.contextmanager
def override(kernel: str, **fields):
    """Inside this block, ``kernel``'s launches of at most :data:`DECODE_ROWS` rows take ``fields``
    (:class:`Settings`) in place of their own choices. Nested blocks add to (and for one kernel
    replace) the outer ones."""
    setting = _checked(kernel, fields)
    held = dict(_OVERRIDES.get())
    held[kernel] = setting
    token = _OVERRIDES.set(tuple(sorted(held.items())))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def of(kernel: str, m: int) -> Settings:
    """The settings of ``kernel`` for a launch of ``m`` rows: the override's, else :data:`NONE`."""
    if m > DECODE_ROWS:
        return NONE
    return dict(_OVERRIDES.get()).get(kernel, NONE)


def current() -> tuple:
    """Every override in force, hashable (a static argument of the jitted decode steps)."""
    return _OVERRIDES.get()


def parse(text: str) -> tuple[str, dict]:
    """``"int4_words:bn=256,stages=4"`` -> ``("int4_words", {"bn": 256, "stages": 4})`` (a sweep's command line);
    ``"int4_words"`` alone is the kernel's defaults."""
    kernel, _, rest = text.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"settings: {item!r} in {text!r} is not name=value")
        fields[name.strip()] = value.strip() if name.strip() in WORDS else _int(value, text)
    _checked(kernel.strip(), fields)
    return kernel.strip(), fields


def is_prefetch(text: str) -> bool:
    """Whether a setting's text is the read-ahead's (``"prefetch:mb=16,stream=side"``,
    :mod:`pallas_kernels.prefetch`) rather than a kernel's launch setting."""
    return text.partition(":")[0].strip() == "prefetch"


def check(text: str) -> None:
    """Raise ValueError unless ``text`` is a kernel's setting (:func:`parse`) or the read-ahead's."""
    with scope(text):
        pass


@contextlib.contextmanager
def scope(text: str):
    """The setting ``text`` in force for the block: a kernel's launch setting (``"int4_words:bn=256"``) or the
    decode products' read-ahead (``"prefetch:mb=16,stream=side"``)."""
    if is_prefetch(text):
        from pallas_kernels import prefetch

        with prefetch.ahead(**prefetch.parse(text)):
            yield
    else:
        kernel, fields = parse(text)
        with override(kernel, **fields):
            yield


def _int(value: str, text: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"settings: {value!r} in {text!r} is not an integer") from None


__all__ = ["CODES", "CONVERTS", "DECODE_ROWS", "KERNELS", "NONE", "NORMS", "Settings", "check", "current",
           "is_prefetch", "of", "override", "parse", "scope"]
