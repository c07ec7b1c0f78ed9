"""ONNX export: the decoder (llama family and GPT-2) as one onnxruntime graph, weights kept quantized.

One graph serves prefill and decode (the optimum / onnxruntime-genai layout):

  inputs   ``input_ids`` int64 [batch, sequence]
           ``past_key_values.{i}.key`` / ``.value`` float32 [batch, kv_heads, past_sequence, head_dim]
           (``past_sequence`` = 0 on the first step)
  outputs  ``logits`` float32 [batch, sequence, vocab]
           ``present.{i}.key`` / ``.value`` [batch, kv_heads, past_sequence + sequence, head_dim]

Positions are ``past_sequence + 0 .. sequence-1`` for every row: no padding mask
(rows of a batch have equal lengths). Opset 21 plus the ``com.microsoft`` domain.

Weights, each chosen where the runtime op computes our grid value for value:

* float kernels -> ``MatMul`` on a float32 initializer.
* int5..int8 weight-only -> int8 initializer (the ``(in, out)`` kernel) ->
  ``DequantizeLinear`` -> ``MatMul``: per-channel along axis 1; groups along
  the input via opset 21's blocked ``block_size`` (a shorter last group is the
  spec's own rule); asymmetric grids keep their int8 zero points.
* int2..int4 with groups of a power of two >= 16 -> ``com.microsoft``
  ``MatMulNBits`` (bits=4): nibbles ``u = q + 8`` packed low-first in
  ``(out, blocks, group/2)`` bytes, float32 scales per block, and for
  asymmetric grids packed nibble zero points ``zp + 8`` (without zero points
  the op's default 8 gives back ``x = q * s``). int2/int3 codes sit in 4-bit
  slots, as in our own checkpoint. ``accuracy_level=0``: float32 compute.
* W8A8 (int8 activations: dynamic per token, dynamic per tensor or a static
  scale) -> our own activation quantizer written out in ops (``absmax / 127``,
  ``Round`` half to even, ``Clip`` to +-127) -> ``MatMulInteger`` int8 x int8
  -> int32 (asymmetric weights: per-column ``b_zero_point``) -> times the
  weight scale, times the activation scale. ``DynamicQuantizeLinear`` is not
  used: it quantizes to an asymmetric uint8 grid, not ours.
* the token table: float -> ``Gather``; int8 per row -> ``Gather`` of the int8
  rows and of their scales, then ``Cast`` and ``Mul`` (only the rows read are
  dequantized). A tied LM head reads the same int8 bytes through
  ``DequantizeLinear`` (axis 0) and ``Gemm`` with ``transB``.

Not expressible (one ExportError naming the layer, nothing written): int2..int4
per-channel or in groups that are not a power of two >= 16 (MatMulNBits' block
rule), W8A8 with grouped weight scales (MatMulInteger has no per-group
rescaling), sub-byte or grouped token tables, a quantized KV cache (past and
present are float32 tensors). Sliding-window layers (Mistral, Qwen2's
per-layer windows) mask keys older than the window; the present caches keep
every slot, as our own cache does.

Why the graph is built node by node with ``onnx.helper`` rather than traced
from JAX (jax2onnx) or written in onnxscript: the point of the file is the
quantized operators -- MatMulNBits' packed nibbles, blocked DequantizeLinear,
MatMulInteger -- and a tracer sees only the dequantized float math of our
jitted forward (it would write float weights or need a custom rule per op);
onnxscript would add a dependency for what ``onnx.helper`` already gives us.
Each piece of the decoder is a small function from input names to output names.

onnxruntime note: at its default optimisation level onnxruntime rewrites
``DequantizeLinear -> MatMul`` into MatMulNBits with int8-quantized activations
(session config ``session.qdq_matmulnbits_accuracy_level``, default 4), which
moved SmolLM2's rtn-w8 logits by 2.2e-2 of their scale. Setting that level to 0
keeps our grid but runs onnxruntime 1.32's 8-bit MatMulNBits about 10x slower
(measured 4.4 s vs 0.38 s per SmolLM2 decode step). :func:`session_options`
instead sets ``session.disable_quant_qdq``: the int8 initializers are
dequantized once at load (exactly our values; float32 in memory, int8 in the
file) and MatMulNBits (int4) is untouched. The tests and the benchmark use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from llmeq_jax.core.qarray import QArray
from llmeq_jax.core.rope import rope_inv_freq
from llmeq_jax.export.common import ExportError, KernelGrid, atomic_output, kernel_grid
from llmeq_jax.models.config import ModelConfig

OPSET = 21  # blocked DequantizeLinear (block_size) arrived in opset 21
MS_DOMAIN = "com.microsoft"
# Masked attention scores: the value our model uses (kv.attention.MASKED), so fully masked rows agree too.
MASKED = -1e30
# protobuf cannot serialise a message of 2 GiB or more (external data is not written here).
MAX_PROTO_BYTES = 2**31 - 2**20


# --------------------------------------------------------------------------- graph builder


@dataclasses.dataclass
class Graph:
    """Nodes and initializers under construction; every name it hands out is unique."""

    nodes: list = dataclasses.field(default_factory=list)
    initializers: list = dataclasses.field(default_factory=list)
    used: Counter = dataclasses.field(default_factory=Counter)
    consts: dict = dataclasses.field(default_factory=dict)

    def name(self, hint: str) -> str:
        self.used[hint] += 1
        return hint if self.used[hint] == 1 else f"{hint}_{self.used[hint] - 1}"

    def init(self, hint: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value, dtype=np.float32) -> str:
        """A small shared constant (scalar or 1-D), one initializer per distinct value."""
        a = np.asarray(value, dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self.consts:
            self.consts[key] = self.init(f"const_{a.dtype.name}", a)
        return self.consts[key]

    def op(self, op_type: str, inputs: list[str], hint: str, *, outputs: int = 1, domain: str = "", **attrs):
        from onnx import helper

        outs = [self.name(f"{hint}/{op_type}" + (f"_{i}" if outputs > 1 else "")) for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(f"{hint}/{op_type}_node"),
                                           domain=domain or None, **attrs))
        return outs[0] if outputs == 1 else outs

    def nbytes(self) -> int:
        return sum(len(t.raw_data) for t in self.initializers)


# --------------------------------------------------------------------------- weights


def weight_encoding(grid: KernelGrid) -> str:
    """``w8a8`` | ``nbits`` | ``int8`` for one quantized kernel, or an ExportError saying why none holds it."""
    where = f"{grid.path} ({grid.describe()})"
    grouped = grid.group < grid.in_features
    if grid.act_spec is not None:
        if grouped:
            raise ExportError(f"{where}: W8A8 with grouped weight scales has no ONNX form (MatMulInteger gives one "
                              "int32 sum per output, with no per-group rescaling); use per-channel weights")
        return "w8a8"
    if grid.bits > 4:
        return "int8"
    if grid.group < 16 or grid.group & (grid.group - 1):
        # One scale per row is one block of the whole row: fine when that length is itself a power of two.
        what = f"group size {grid.group}" if grouped else f"one block of the whole input dim {grid.in_features}"
        raise ExportError(f"{where}: int{grid.bits} weights go to MatMulNBits, whose block size must be a power "
                          f"of two >= 16; got {what} (use groups of 16, 32, 64 or 128)")
    return "nbits"


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """Values 0..15 along the last axis (even length) -> bytes, element 2j low nibble, 2j+1 high (low-first)."""
    u = u.astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << np.uint8(4))


def nbits_tensors(grid: KernelGrid) -> dict[str, np.ndarray]:
    """MatMulNBits' B (out, blocks, group/2) uint8, scales (out*blocks,) and, if asymmetric, packed zero points."""
    out, k = grid.q.shape
    blocks = -(-k // grid.group)
    u = np.zeros((out, blocks * grid.group), np.uint8)  # the padded tail of a short last block is never read
    u[:, :k] = (grid.q.astype(np.int16) + 8).astype(np.uint8)
    tensors = {"B": pack_nibbles(u).reshape(out, blocks, grid.group // 2),
               "scales": grid.scale.astype(np.float32).reshape(-1)}
    if grid.zero_point is not None:
        zp = grid.zero_point.astype(np.int16) + 8
        zp = np.pad(zp, ((0, 0), (0, blocks % 2)))  # each row's zero points start on a byte
        tensors["zero_points"] = pack_nibbles(zp).reshape(-1)
    return tensors


def nbits_matmul(g: Graph, x: str, grid: KernelGrid, hint: str) -> str:
    t = nbits_tensors(grid)
    inputs = [x, g.init(f"{hint}/B", t["B"]), g.init(f"{hint}/scales", t["scales"])]
    if "zero_points" in t:
        inputs.append(g.init(f"{hint}/zero_points", t["zero_points"]))
    return g.op("MatMulNBits", inputs, hint, domain=MS_DOMAIN, K=grid.in_features, N=grid.out_features, bits=4,
                block_size=grid.group, accuracy_level=0)


def dequantize_kernel(g: Graph, grid: KernelGrid, hint: str) -> str:
    """The float (in, out) kernel from an int8 initializer: per-channel (axis 1) or blocked along the input (axis 0)."""
    q = g.init(f"{hint}/qweight", grid.q.T)
    if grid.group >= grid.in_features:
        scale, zp, attrs = grid.scale[:, 0], None if grid.zero_point is None else grid.zero_point[:, 0], {"axis": 1}
    else:
        scale, zp = grid.scale.T, None if grid.zero_point is None else grid.zero_point.T
        attrs = {"axis": 0, "block_size": grid.group}
    inputs = [q, g.init(f"{hint}/scale", scale.astype(np.float32))]
    if zp is not None:
        inputs.append(g.init(f"{hint}/zero_point", zp.astype(np.int8)))
    return g.op("DequantizeLinear", inputs, hint, **attrs)


def activation_scale(g: Graph, x: str, grid: KernelGrid, hint: str) -> str:
    """Our int8 activation scale: static, or absmax / 127 per token (keepdims) or per tensor."""
    if grid.act_scale is not None:
        return g.const(grid.act_scale.reshape(()))
    per_token = grid.act_spec.granularity == "token"
    axes = [g.const([-1], np.int64)] if per_token else []
    amax = g.op("ReduceMax", [g.op("Abs", [x], hint)] + axes, hint, keepdims=1 if per_token else 0)
    amax = g.op("Max", [amax, g.const(np.finfo(np.float32).tiny)], hint)
    return g.op("Div", [amax, g.const(127.0)], hint)


def w8a8_matmul(g: Graph, x: str, grid: KernelGrid, hint: str) -> str:
    sx = activation_scale(g, x, grid, hint)
    xq = g.op("Round", [g.op("Div", [x, sx], hint)], hint)
    xq = g.op("Cast", [g.op("Clip", [xq, g.const(-127.0), g.const(127.0)], hint)], hint, to=3)  # 3: INT8
    inputs = [xq, g.init(f"{hint}/qweight", grid.q.T)]
    if grid.zero_point is not None:
        inputs += ["", g.init(f"{hint}/zero_point", grid.zero_point[:, 0].astype(np.int8))]
    acc = g.op("Cast", [g.op("MatMulInteger", inputs, hint)], hint, to=1)  # 1: FLOAT
    y = g.op("Mul", [acc, g.init(f"{hint}/scale", grid.scale[:, 0].astype(np.float32))], hint)
    return g.op("Mul", [y, sx], hint)


def linear(g: Graph, x: str, kernel: Any, bias: Any, hint: str) -> str:
    """``x @ kernel (+ bias)`` for a float ``(in, out)`` kernel or a QArray, in the op that holds its grid."""
    if isinstance(kernel, QArray):
        grid = kernel_grid(f"{hint}/kernel", kernel)
        kind = weight_encoding(grid)
        if kind == "nbits":
            y = nbits_matmul(g, x, grid, hint)
        elif kind == "w8a8":
            y = w8a8_matmul(g, x, grid, hint)
        else:
            y = g.op("MatMul", [x, dequantize_kernel(g, grid, hint)], hint)
    else:
        y = g.op("MatMul", [x, g.init(f"{hint}/kernel", np.asarray(kernel, np.float32))], hint)
    if bias is not None:
        y = g.op("Add", [y, g.init(f"{hint}/bias", np.asarray(bias, np.float32))], hint)
    return y


# --------------------------------------------------------------------------- token table


def check_table(table: QArray, name: str = "embed") -> None:
    """A token (or position) table we can gather from int8 bytes: int5..int8, one scale per row (or per tensor)."""
    where = f"{name}/embedding (int{table.bits} {table.granularity})"
    if table.bits <= 4:
        raise ExportError(f"{where}: ONNX Gather reads whole bytes; a sub-byte token table has no gatherable "
                          "layout (quantize the table int8 per row)")
    if table.tile[1] != table.shape[1] or table.tile[0] not in (1, table.shape[0]):
        raise ExportError(f"{where}: ONNX export takes a token table with one scale per row (or per tensor); "
                          "groups along hidden are not written")


@dataclasses.dataclass(frozen=True)
class TableInit:
    """The token table's initializers: a float table, or int8 rows with a scale per row (or one) and zero points."""

    table: str
    scale: str | None = None
    zero_point: str | None = None
    per_row: bool = True


def table_init(g: Graph, table: Any, name: str = "embed") -> TableInit:
    """Add a table (``name``: "embed" for tokens, "pos_embed" for GPT-2's positions) once; the lookup and a tied
    head both read these bytes."""
    if not isinstance(table, QArray):
        return TableInit(g.init(f"{name}/table", np.asarray(table, np.float32)))
    check_table(table, name)
    per_row = table.tile[0] == 1
    shape = (-1,) if per_row else ()  # DequantizeLinear takes a 1-D per-axis scale or a scalar

    def vec(a, dtype):
        return np.asarray(a, dtype).reshape(shape)

    return TableInit(g.init(f"{name}/qtable", np.asarray(table.values(), np.int8)),
                     g.init(f"{name}/scale", vec(table.scale, np.float32)),
                     None if table.zero_point is None else g.init(f"{name}/zero_point", vec(table.zero_point, np.int8)),
                     per_row)


def embedding(g: Graph, ids: str, t: TableInit) -> str:
    """[B, T] ids -> [B, T, hidden]; an int8 table dequantizes only the rows it gathers."""
    rows = g.op("Gather", [t.table, ids], "embed", axis=0)
    if t.scale is None:
        return rows
    rows = g.op("Cast", [rows], "embed", to=1)

    def picked(a: str) -> str:  # (vocab,) -> [B, T, 1] by id; a per-tensor scalar broadcasts as it is
        if not t.per_row:
            return a
        return g.op("Unsqueeze", [g.op("Gather", [a, ids], "embed", axis=0), g.const([-1], np.int64)], "embed")

    if t.zero_point is not None:
        rows = g.op("Sub", [rows, g.op("Cast", [picked(t.zero_point)], "embed", to=1)], "embed")
    return g.op("Mul", [rows, picked(t.scale)], "embed")


def tied_head(g: Graph, h: str, t: TableInit, hidden: int) -> str:
    """[B, T, hidden] -> logits [B, T, vocab] against the (vocab, hidden) table: Gemm with transB on 2-D rows."""
    w = t.table
    if t.scale is not None:
        inputs = [t.table, t.scale] + ([t.zero_point] if t.zero_point else [])
        w = g.op("DequantizeLinear", inputs, "head", **({"axis": 0} if t.per_row else {}))
    rows = g.op("Reshape", [h, g.const([-1, hidden], np.int64)], "head")
    logits = g.op("Gemm", [rows, w], "head", transB=1)
    lead = g.op("Shape", [h], "head", start=0, end=-1)
    shape = g.op("Concat", [lead, g.const([-1], np.int64)], "head", axis=0)
    return g.op("Reshape", [logits, shape], "head")


# --------------------------------------------------------------------------- decoder pieces


def rms_norm(g: Graph, x: str, scale: Any, eps: float, hint: str) -> str:
    """x * 1/sqrt(mean(x^2) + eps) * scale over the last axis (onnxruntime fuses this pattern)."""
    ms = g.op("ReduceMean", [g.op("Mul", [x, x], hint), g.const([-1], np.int64)], hint, keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(eps)], hint)], hint)], hint)
    return g.op("Mul", [g.op("Mul", [x, inv], hint), g.init(f"{hint}/scale", np.asarray(scale, np.float32))], hint)


def layer_norm(g: Graph, x: str, p: dict, eps: float, hint: str) -> str:
    """GPT-2's LayerNorm over the last axis (scale and bias), float32 as our model computes it."""
    return g.op("LayerNormalization", [x, g.init(f"{hint}/scale", np.asarray(p["scale"], np.float32)),
                                       g.init(f"{hint}/bias", np.asarray(p["bias"], np.float32))], hint,
                axis=-1, epsilon=float(eps))


def rope(g: Graph, x: str, cos: str, sin: str, hint: str) -> str:
    """Rotate-half RoPE on the last axis of ``x`` (as HF Llama and our model), cos/sin [T, D] broadcast."""
    x1, x2 = g.op("Split", [x], hint, outputs=2, axis=-1, num_outputs=2)
    rotated = g.op("Concat", [g.op("Neg", [x2], hint), x1], hint, axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], hint), g.op("Mul", [rotated, sin], hint)], hint)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What every layer shares: the new positions, their RoPE tables (None for GPT-2's learned positions) and the
    causal mask over the cache."""

    positions: str  # int64 [T]: past .. past + T - 1
    cos: str | None
    sin: str | None
    allowed: str  # bool [T, S]: query t may see key slot s
    allowed_sliding: str | None = None  # the same within the last ``sliding_window`` slots (sliding layers)

    def mask(self, config: ModelConfig, layer: int) -> str:
        """The mask layer ``layer`` attends with."""
        return self.allowed_sliding if config.is_sliding(layer) else self.allowed


def step_inputs(g: Graph, config: ModelConfig, ids: str, past_key: str) -> StepInputs:
    """Positions past .. past+T-1 from the shapes of ``ids`` and the first past key; RoPE angles; causal mask."""
    past = g.op("Squeeze", [g.op("Shape", [past_key], "pos", start=2, end=3)], "pos")
    seq = g.op("Squeeze", [g.op("Shape", [ids], "pos", start=1, end=2)], "pos")
    total = g.op("Add", [past, seq], "pos")
    one = g.const(1, np.int64)
    positions = g.op("Range", [past, total, one], "pos")  # [T]
    keys = g.op("Range", [g.const(0, np.int64), total, one], "pos")  # [S]
    key_row = g.op("Unsqueeze", [keys, g.const([0], np.int64)], "mask")  # [1, S]
    query_col = g.op("Unsqueeze", [positions, g.const([1], np.int64)], "mask")  # [T, 1]
    allowed = g.op("LessOrEqual", [key_row, query_col], "mask")
    sliding = None
    if config.sliding_window is not None:  # as our model and HF: the last `window` slots, the query's own included
        start = g.op("Sub", [query_col, g.const(config.sliding_window, np.int64)], "mask")
        sliding = g.op("And", [allowed, g.op("Greater", [key_row, start], "mask")], "mask")
    if config.family == "gpt2":
        return StepInputs(positions=positions, cos=None, sin=None, allowed=allowed, allowed_sliding=sliding)
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    posf = g.op("Unsqueeze", [g.op("Cast", [positions], "rope", to=1), g.const([1], np.int64)], "rope")
    angles = g.op("Mul", [posf, g.init("rope/inv_freq", inv_freq[None, :].astype(np.float32))], "rope")
    angles = g.op("Concat", [angles, angles], "rope", axis=-1)  # [T, D]
    return StepInputs(positions=positions, cos=g.op("Cos", [angles], "rope"), sin=g.op("Sin", [angles], "rope"),
                      allowed=allowed, allowed_sliding=sliding)


def heads(g: Graph, x: str, n: int, d: int, hint: str) -> str:
    """[B, T, n * d] -> [B, n, T, d]."""
    return g.op("Transpose", [g.op("Reshape", [x, g.const([0, 0, n, d], np.int64)], hint)], hint, perm=[0, 2, 1, 3])


def llama_qkv(g: Graph, config: ModelConfig, p: dict, x: str, step: StepInputs, hint: str) -> tuple[str, str, str]:
    """Llama-family q [B, KV, G, T, D] (each KV head's query group), k, v [B, KV, T, D]: biases where the
    checkpoint has them (Qwen2), q/k RMSNorms (Qwen3), RoPE."""
    c = config
    groups = c.num_heads // c.num_kv_heads

    def proj(name):
        return linear(g, x, p[name]["kernel"], p[name].get("bias"), f"{hint}/{name}")

    q = g.op("Reshape", [proj("q_proj"), g.const([0, 0, c.num_kv_heads, groups, c.head_dim], np.int64)], hint)
    q = g.op("Transpose", [q], hint, perm=[0, 2, 3, 1, 4])
    k = heads(g, proj("k_proj"), c.num_kv_heads, c.head_dim, hint)
    v = heads(g, proj("v_proj"), c.num_kv_heads, c.head_dim, hint)
    if c.qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
        q = rms_norm(g, q, p["q_norm"]["scale"], c.norm_eps, f"{hint}/q_norm")
        k = rms_norm(g, k, p["k_norm"]["scale"], c.norm_eps, f"{hint}/k_norm")
    return rope(g, q, step.cos, step.sin, f"{hint}/rope_q"), rope(g, k, step.cos, step.sin, f"{hint}/rope_k"), v


def gpt2_qkv(g: Graph, config: ModelConfig, p: dict, x: str, hint: str) -> tuple[str, str, str]:
    """GPT-2's fused projection (q | k | v along the output, as HF's c_attn) split into q [B, H, 1, T, D], k, v
    [B, H, T, D]: every head its own KV head, no rotation (positions were added at the embedding)."""
    c = config
    qkv = linear(g, x, p["qkv_proj"]["kernel"], p["qkv_proj"].get("bias"), f"{hint}/qkv_proj")
    q, k, v = (heads(g, t, c.num_heads, c.head_dim, hint)
               for t in g.op("Split", [qkv], hint, outputs=3, axis=-1, num_outputs=3))
    return g.op("Unsqueeze", [q, g.const([2], np.int64)], hint), k, v


def attention(g: Graph, config: ModelConfig, p: dict, x: str, step: StepInputs, past: tuple[str, str],
              hint: str, layer: int = 0) -> tuple[str, str, str]:
    """Attention of layer ``layer`` over past + new keys: (output [B, T, hidden], present key, present value)."""
    c = config
    # q as [B, KV, G, T, D]: each KV head's query group shares its keys through MatMul broadcasting.
    q, k, v = gpt2_qkv(g, c, p, x, hint) if c.family == "gpt2" else llama_qkv(g, c, p, x, step, hint)
    present_k = g.op("Concat", [past[0], k], hint, axis=2)  # [B, KV, S, D]
    present_v = g.op("Concat", [past[1], v], hint, axis=2)
    axis2 = g.const([2], np.int64)
    kt = g.op("Unsqueeze", [g.op("Transpose", [present_k], hint, perm=[0, 1, 3, 2]), axis2], hint)  # [B, KV, 1, D, S]
    scores = g.op("Div", [g.op("MatMul", [q, kt], hint), g.const(math.sqrt(c.head_dim))], hint)  # [B, KV, G, T, S]
    scores = g.op("Where", [step.mask(c, layer), scores, g.const(MASKED)], hint)
    probs = g.op("Softmax", [scores], hint, axis=-1)
    out = g.op("MatMul", [probs, g.op("Unsqueeze", [present_v, axis2], hint)], hint)  # [B, KV, G, T, D]
    out = g.op("Reshape", [g.op("Transpose", [out], hint, perm=[0, 3, 1, 2, 4]), g.const([0, 0, -1], np.int64)], hint)
    o = p["o_proj"]
    return linear(g, out, o["kernel"], o.get("bias"), f"{hint}/o_proj"), present_k, present_v


def swiglu(g: Graph, p: dict, x: str, hint: str) -> str:
    gate = linear(g, x, p["gate_proj"]["kernel"], None, f"{hint}/gate_proj")
    up = linear(g, x, p["up_proj"]["kernel"], None, f"{hint}/up_proj")
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], hint)], hint), up], hint)  # silu(gate) * up
    return linear(g, act, p["down_proj"]["kernel"], None, f"{hint}/down_proj")


def gelu_mlp(g: Graph, config: ModelConfig, p: dict, x: str, hint: str) -> str:
    """GPT-2's MLP: fc_in, GELU (tanh-approximated where the config says so, as our model), fc_out."""
    h = linear(g, x, p["fc_in"]["kernel"], p["fc_in"].get("bias"), f"{hint}/fc_in")
    h = g.op("Gelu", [h], hint, approximate="tanh" if config.act == "gelu_tanh" else "none")
    return linear(g, h, p["fc_out"]["kernel"], p["fc_out"].get("bias"), f"{hint}/fc_out")


# --------------------------------------------------------------------------- whole model


def check_config(config: ModelConfig, kv: dict | None = None) -> None:
    """An ExportError for what this graph does not compute: a quantized cache."""
    if kv:
        raise ExportError(f"layers_*/attn (KV cache): the recipe quantizes the KV cache ({kv}); the ONNX graph's "
                          "past/present tensors are float32 and no standard op reads our quantized cache layout")


def io_names(config: ModelConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(past, present) name pairs per layer, in the optimum / onnxruntime-genai convention."""
    past = [(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(config.num_layers)]
    present = [(f"present.{i}.key", f"present.{i}.value") for i in range(config.num_layers)]
    return past, present


def build_model(config: ModelConfig, params: Any, *, kv: dict | None = None, metadata: dict | None = None):
    """The ``onnx.ModelProto`` of the decoder; every ExportError is raised here, before anything is written."""
    try:
        import onnx
        from onnx import TensorProto, helper
    except ImportError:
        raise ExportError("ONNX export needs the onnx package: pip install 'llmeq_jax[export]'") from None

    check_config(config, kv)
    g = Graph()
    c = config
    past, present = io_names(c)
    gpt2 = c.family == "gpt2"
    table = params["embed"]["embedding"]
    tab = table_init(g, table)
    h = embedding(g, "input_ids", tab)
    step = step_inputs(g, c, "input_ids", past[0][0])
    if gpt2:  # learned positions, added once: rows past .. past + T - 1 of their table, broadcast over the batch
        h = g.op("Add", [h, embedding(g, step.positions, table_init(g, params["pos_embed"]["embedding"],
                                                                     "pos_embed"))], "embed")

    def norm(x, p, hint):
        return layer_norm(g, x, p, c.norm_eps, hint) if gpt2 else rms_norm(g, x, p["scale"], c.norm_eps, hint)

    for i in range(c.num_layers):
        p = params[f"layers_{i}"]
        hint = f"layers_{i}"
        first, second = ("ln_1", "ln_2") if gpt2 else ("input_norm", "post_attn_norm")
        a, pk, pv = attention(g, c, p["attn"], norm(h, p[first], f"{hint}/{first}"), step, past[i], f"{hint}/attn",
                              layer=i)
        h = g.op("Add", [h, a], hint)
        x = norm(h, p[second], f"{hint}/{second}")
        m = gelu_mlp(g, c, p["mlp"], x, f"{hint}/mlp") if gpt2 else swiglu(g, p["mlp"], x, f"{hint}/mlp")
        h = g.op("Add", [h, m], hint)
        g.nodes.append(helper.make_node("Identity", [pk], [present[i][0]], name=f"{hint}/present_key"))
        g.nodes.append(helper.make_node("Identity", [pv], [present[i][1]], name=f"{hint}/present_value"))
    h = norm(h, params["norm"], "norm")
    if c.tie_word_embeddings:
        logits = tied_head(g, h, tab, c.hidden_size)
    else:
        logits = linear(g, h, params["lm_head"]["kernel"], params["lm_head"].get("bias"), "lm_head")
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits"))
    if g.nbytes() > MAX_PROTO_BYTES:
        raise ExportError(f"the graph's weights take {g.nbytes() / 2**30:.2f} GiB; a single .onnx file holds < 2 GiB "
                          "and this exporter does not write external data")

    def cache_info(name, length):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", c.num_kv_heads, length, c.head_dim])

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])]
    inputs += [cache_info(n, "past_sequence") for pair in past for n in pair]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", c.vocab_size])]
    outs += [cache_info(n, "total_sequence") for pair in present for n in pair]
    graph = helper.make_graph(g.nodes, "llmeq_jax_decoder", inputs, outs, initializer=g.initializers)
    model = helper.make_model(graph, producer_name="llmeq_jax", ir_version=10,
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    for key, value in (metadata or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = str(key), str(value)
    onnx.checker.check_model(model)  # our own mistakes surface here, not in the user's runtime
    return model


def write_onnx(config: ModelConfig, params: Any, out: str | Path, *, kv: dict | None = None,
               metadata: dict | None = None, overwrite: bool = False) -> Path:
    """Write the decoder graph of ``params`` (float leaves and QArrays) as one ``.onnx`` file at ``out``."""
    model = build_model(config, params, kv=kv, metadata=metadata)
    out = Path(out)
    with atomic_output(out, overwrite) as tmp:
        tmp.write_bytes(model.SerializeToString())
    return out


# --------------------------------------------------------------------------- running it


def session_options():
    """onnxruntime options that compute the grid the file holds (see the module note).

    ``session.disable_quant_qdq``: no int8-activation rewrite of ``DequantizeLinear -> MatMul``; the int8
    weights are dequantized once at load (constant folding), which is exact and fast.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_quant_qdq", "1")
    return so


def empty_past(config: ModelConfig, batch: int) -> dict[str, np.ndarray]:
    """The past inputs of a first step: zero-length caches."""
    shape = (batch, config.num_kv_heads, 0, config.head_dim)
    return {n: np.zeros(shape, np.float32) for pair in io_names(config)[0] for n in pair}


def next_past(config: ModelConfig, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The present outputs of one step as the past inputs of the next."""
    past, present = io_names(config)
    return {p: outputs[q] for ps, qs in zip(past, present) for p, q in zip(ps, qs)}
