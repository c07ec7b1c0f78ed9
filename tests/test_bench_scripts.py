"""scripts/profile_decode.py (GPU kernels out of a profiler trace), scripts/bench_e2e.py (--profile, the variant order) and
scripts/bench_kernels.py (its GPU steps run through in interpret mode, its XLA candidates checked)."""

import gzip
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.scripts_loader import SCRIPTS, load_script


def _bench_kernels(monkeypatch, copies: int = 1):
    """scripts/bench_kernels.py for a run through in interpret mode: ``copies`` copies of each operand and one timed
    round a variant (what is tested is what it times and writes, not the times: a Mosaic GPU kernel's run in
    interpret mode takes a tenth of a second or more)."""
    bench = load_script("bench_kernels")
    monkeypatch.setattr(bench, "copies_for", lambda nbytes: copies)
    monkeypatch.setattr(bench, "ROUNDS", 1)
    return bench


def _meta(pid, tid, kind, name):
    return {"ph": "M", "pid": pid, **({} if tid is None else {"tid": tid}), "name": kind, "args": {"name": name}}


def _kernel(name, dur, pid=2, tid=7, module="jit__decode_loop"):
    args = {} if module is None else {"hlo_module": module, "hlo_op": name}
    return {"ph": "X", "pid": pid, "tid": tid, "ts": 0.0, "dur": dur, "name": name, "args": args}


# A GPU trace as jax.profiler writes it: a host process, a device process with a compute stream and the
# derived "XLA Ops" line that repeats kernel times per HLO op.
EVENTS = [
    _meta(1, None, "process_name", "/host:CPU"), _meta(1, 5, "thread_name", "python"),
    _meta(2, None, "process_name", "/device:GPU:0"), _meta(2, 7, "thread_name", "Stream #13(Compute)"),
    _meta(2, 8, "thread_name", "XLA Ops"),
    _kernel("int4_words_matmul", 30.0), _kernel("int4_words_matmul", 34.0), _kernel("loop_add_fusion", 2.0),
    _kernel("int4_words_matmul", 64.0, tid=8),  # the XLA Ops line: the same time again
    _kernel("PjitFunction(generate)", 500.0, pid=1, tid=5, module=None),  # host
    _kernel("prefill_gemm", 99.0, module="jit__prefill"),  # another module
    _kernel("memcpy", 1.0, module=None),  # no module named: kept
]


def test_device_kernel_times_reads_the_decode_loops_gpu_kernels_once(tmp_path):
    profile = load_script("profile_decode")
    path = tmp_path / "plugins/profile/run/host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    events = profile.trace_events(tmp_path)
    times = profile.device_kernel_times(events)
    assert times == {"int4_words_matmul": (64.0, 2), "loop_add_fusion": (2.0, 1), "memcpy": (1.0, 1)}
    assert profile.device_kernel_times(events, module="jit__prefill") == {"prefill_gemm": (99.0, 1), "memcpy": (1.0, 1)}
    host_only = [e for e in EVENTS if e.get("pid") == 1]
    assert profile.device_kernel_times(host_only) == {}
    rows = profile.kernel_table(times, steps=2, top=2)
    assert [r[0] for r in rows] == ["int4_words_matmul", "loop_add_fusion"]
    assert rows[0][1:] == [32.0, 1.0, 64.0 / 67.0]


def test_bench_e2e_prints_a_profile_per_variant():
    bench = load_script("bench_e2e")
    args = bench.parse_args(["--shapes", "llama-2-7b", "--dtype", "bfloat16", "--profile", "--profile-top", "5"])
    assert args.profile and args.profile_top == 5
    profile = {"batch": 1, "steps": 31, "layers": 32, "wall_us_per_step": 2820.0, "kernel_us_per_step": 2500.0,
               "launches_per_step": 600.0, "kernels": [["int4_words_matmul__2", 640.0, 32.0, 0.256]]}
    text = bench.profile_table("rtn-w4-g128+scan", profile)
    assert "2500 µs of kernels in 600 launches per decode step; wall 2820 µs" in text
    assert "| int4_words_matmul__2 | 640.0 | 32 | 20.00 | 25.6% |" in text
    assert "32 layers" in text
    assert "no GPU kernels" in bench.profile_table("bf16", profile | {"kernels": []})
    assert bench.profile_table("bf16", {"error": "RuntimeError: no CUPTI"}) == "bf16: no profile (RuntimeError: no CUPTI)"


def test_bench_e2e_runs_the_other_frameworks_right_after_the_baseline(monkeypatch):
    """A run cut short by a time limit keeps the rows it finished: transformers' row comes right after our
    baseline, before our recipes."""
    bench = load_script("bench_e2e")
    monkeypatch.setattr(bench, "torch_variants", lambda args: ["transformers-bf16-static"])
    args = bench.parse_args(["--shapes", "llama-2-7b", "--dtype", "bfloat16", "--recipes", "rtn-w8", "rtn-w4-g128",
                             "--scan-only"])
    assert bench.variants_of(args) == ["bf16+scan", "transformers-bf16-static", "rtn-w8+scan", "rtn-w4-g128+scan"]
    args = bench.parse_args(["--recipes", "rtn-w8", "--scan-layers"])
    assert bench.variants_of(args) == ["fp32", "fp32+scan", "transformers-bf16-static", "rtn-w8", "rtn-w8+scan"]


def test_bench_e2e_reports_a_failed_variants_traceback_without_the_runtimes_log():
    """After a GPU fault the child's stderr ended in hundreds of XLA log lines (an H200 run): the row's error and
    the printed message are the Python traceback's, its exception last."""
    bench = load_script("bench_e2e")
    noise = ("E1128 20:33:10.291921    7022 cuda_event.cc:50] CUDA error: Error destroying CUDA event\n"
             "E1128 20:33:10.293399    7022 cuda_host_allocator.cc:107] [0] Failed to free host memory\n"
             "=== Source Location Trace: === \nexternal/xla+/xla/stream_executor/cuda/cuda_status.cc:50\n\n")
    stderr = ("Traceback (most recent call last):\n  File \"bench_e2e.py\", line 9, in decode\n"
              "jax.errors.JaxRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS\n" + noise * 50)
    message = bench.failure_of(stderr)
    assert message.splitlines()[0] == "Traceback (most recent call last):"
    assert message.splitlines()[-1] == "jax.errors.JaxRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS"
    assert "cuda_event" not in message and "cuda_status.cc" not in message
    assert bench.failure_of(noise) == noise.strip()  # nothing else: the log as it was


def test_bench_e2e_echoes_a_variants_progress_as_it_comes(capsys):
    """A variant's phases (phase_clock) reach the parent's stderr line by line, the runtime's log does not; the
    whole stderr and the exit code come back for the failure message (an H200 run was stopped by its limit inside
    one variant with nothing to say which phase took the time)."""
    bench = load_script("bench_e2e")
    child = (f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import bench_e2e as b; done = b.phase_clock('v');"
             "print('I1128 20:33:10.291921 7022 x.cc:1] log', file=sys.stderr, flush=True); done('quantized');"
             "print('to stdout'); sys.exit(3)")
    code, stderr = bench.run_child([sys.executable, "-c", child])
    echoed = capsys.readouterr()
    assert code == 3
    assert re.fullmatch(r"\[bench_e2e\]   v: quantized \(\d+\.\d s\)\n", echoed.err)
    assert "x.cc:1] log" in stderr and "v: quantized" in stderr and "to stdout" not in echoed.out


def test_bench_kernels_gpu_steps_run_through_in_interpret_mode(capsys, monkeypatch):
    """The kinds and sweeps scripts/gpu_session.sh's words and sweep steps time, run end to end on a tiny weight in
    interpret mode: a GPU's minutes are not spent finding a broken kind. (The times mean nothing here.)"""
    from pallas_kernels import config

    bench = _bench_kernels(monkeypatch)
    kinds = ("bf16", "w4g128", "w4_words", "w4_xla_rows", "w4_gemv", "bf16_stack", "w8_nk", "w8_nk_f16", "w4_xla_words",
             "w4_xla_groups")
    table = []
    with config.interpret(True):
        bench.gpu_bench(1, table=table, kinds_wanted=kinds, weights=((256, 128),), attention=False, rows=(1,))
        bench.gpu_bench(1, sweep=True, kinds_wanted=("bf16", "w4_words", "w8_nk_f16"), weights=((256, 128),),
                        attention=False, rows=(1,))
    out = capsys.readouterr().out
    for kind in kinds:
        assert f"256x128     1 {kind:>7}" in out, kind
    assert sorted(k.kernel for k, _ in table) == ["float", "int4_words", "int8_f16", "weight_only"]
    assert "WRONG" not in out and not any("wrong" in times for _, times in table)  # every result checked right
    assert out.count("sweep w4_words M=1") == len(bench._words_sweep(256, 128)) + 2  # + bf16 and the defaults
    assert out.count("sweep w8_nk_f16 M=1") == len(bench._int8_f16_sweep()) + 2


def _prompt_kind_bench(capsys, monkeypatch, sweep_fn: str, settings, kinds: tuple, weight=(256, 256),
                       no_settings: tuple = ()):
    """bench_kernels on one small weight at 1 and 64 rows in GPU interpret mode, --sweep at 64 rows with ``settings``
    (a list, or a function of ``sweep_fn``'s arguments) in place of ``sweep_fn``'s, and none for the sweeps
    ``no_settings`` name: (its output, the table entries it wrote)."""
    from pallas_kernels import config

    bench = _bench_kernels(monkeypatch)
    monkeypatch.setattr(bench, "PREFILL_WORDS_SWEEP_ROWS", (64,))
    monkeypatch.setattr(bench, "SWEEP_WEIGHT", weight)
    monkeypatch.setattr(bench, sweep_fn, settings if callable(settings) else lambda *_: settings)
    for other in no_settings:
        monkeypatch.setattr(bench, other, lambda *_: [])
    table = []
    with config.interpret(True):
        bench.gpu_bench(1, sweep=True, table=table, kinds_wanted=kinds, weights=(weight,), attention=False,
                        rows=(1, 64))
    return capsys.readouterr().out, table


def test_bench_kernels_prefill_sweep_tries_the_k_major_w8a8_settings(capsys, monkeypatch):
    """--sweep at prefill rows with the K-major W8A8 kind timed: its block settings run (interpret mode, a tiny
    weight); the transposing kernel's transpose_w setting means nothing for weights stored K-major."""
    from pallas_kernels import config
    from pallas_kernels.blocks import Blocks

    bench = _bench_kernels(monkeypatch)
    monkeypatch.setattr(bench, "SWEEP_WEIGHT", (256, 128))
    settings = [dict(transpose_w=False), dict(blocks=Blocks(128, 128, 128, 8, 3))]
    monkeypatch.setattr(bench, "_sweep", lambda: {1024: settings})
    with config.interpret(True):
        bench.gpu_bench(1, sweep=True, kinds_wanted=("bf16", "w8a8_nk"), weights=((256, 128),), attention=False,
                        rows=(1024,))
    out = capsys.readouterr().out
    assert out.count("sweep w8a8_nk M=1024") == 1 and "failed" not in out
    assert "Blocks(bm=128, bn=128, bk=128" in out


def test_bench_kernels_times_the_prompt_kernel_over_the_words_at_prompt_rows_only(capsys, monkeypatch):
    """w4_words_prefill (interpret mode, a tiny weight): timed at prompt rows against XLA's path of the packed
    QArray (its table entry), skipped at decode rows; --sweep runs its settings there, a setting that fails (here
    a K block it refuses) costing its own line only."""
    from pallas_kernels.blocks import Blocks

    settings = [dict(blocks=Blocks(64, 64, 128, 4, 2)), dict(blocks=Blocks(64, 64, 256, 4, 2))]
    out, table = _prompt_kind_bench(capsys, monkeypatch, "_prefill_words_sweep", settings, ("bf16", "w4_words_prefill"),
                                    weight=(256, 128))
    assert "256x128    64 w4_words_prefill" in out and "256x128     1 w4_words_prefill" not in out
    assert [(k.kernel, k.rows) for k, _ in table] == [("int4_words_prefill", 64)]
    assert out.count("sweep w4_words_prefill M=64") == 4  # bf16, the defaults, each setting (one failed)
    assert out.count("failed: ValueError: int4_words_prefill: the K block is one word block") == 1


@pytest.mark.parametrize("kind,replaced,kernel", [("w8a8_hopper", "w8a8_nk", "w8a8_hopper"),
                                                   ("fp8_hopper", "fp8_nk", "fp8_w8a8_hopper")])
def test_bench_kernels_times_the_hopper_w8a8_kernel_against_the_triton_one(capsys, monkeypatch, kind, replaced, kernel):
    """w8a8_hopper / fp8_hopper (GPU interpret mode, a tiny weight): timed at prompt rows only, its table entry
    against the Triton kernel over the same K-major weights (w8a8_nk / fp8_nk) timed in the same row; --sweep runs its
    settings there, one it refuses (N 256 is not a multiple of its 512-column tile) costing its own line."""
    from pallas_kernels.w8a8_hopper import HopperBlocks

    settings = [dict(blocks=HopperBlocks(tile_m=64, stages=2)), dict(blocks=HopperBlocks(tile_n=256))]
    out, table = _prompt_kind_bench(capsys, monkeypatch, "_hopper_sweep", settings, ("bf16", replaced, kind))
    assert f"256x256    64 {kind}" in out and f"256x256     1 {kind}" not in out
    entries = [(k.kernel, k.rows, t) for k, t in table if k.kernel == kernel]
    assert [(name, rows) for name, rows, _ in entries] == [(kernel, 64)]
    assert f"x {replaced})" in out and entries[0][2]["xla_s"] > 0  # against the Triton kernel's time
    assert out.count(f"sweep {kind} M=64") == 4  # bf16, the defaults, each setting (one failed)
    assert out.count("failed: ValueError: w8a8_hopper:") == 1


def test_bench_kernels_times_xlas_fused_int4_dequantization_at_prompt_rows_only(capsys, monkeypatch):
    """w4_xla_subchannel, w4_xla_subchannel_packed and w4_xla_subchannel_zp (interpret mode, a tiny weight): the int4
    product in the form XLA fuses into its GEMM -- from jnp.int4 codes, and the model's path (llmeq_jax.subchannel) of
    a symmetric and of a zero-point QArray -- compiled with the flag that asks for it (the CPU takes and ignores it),
    checked against the float product and timed at prompt rows only (from jnp.int4 codes at decode rows too); the
    model's two in the table (kernels
    xla_subchannel, xla_subchannel_zp) against XLA's usual path of the same QArray, traced with the path off."""
    from pallas_kernels import config

    bench = _bench_kernels(monkeypatch)
    options = []
    real = bench.timed_round_robin
    monkeypatch.setattr(bench, "timed_round_robin", lambda variants, **kw: options.extend(
        rest[0] if rest else None for _, _, *rest in variants.values()) or real(variants, **kw))
    usual = []  # whether the sub-channel path was off while XLA's path was traced
    real_usual = bench.usual_xla
    monkeypatch.setattr(bench, "usual_xla", lambda fn: real_usual(lambda *a: usual.append(config.is_disabled())
                                                                   or fn(*a)))
    table = []
    kinds = ("w4_xla_subchannel", "w4_xla_subchannel_packed", "w4_xla_subchannel_zp")
    with config.interpret(True):
        bench.gpu_bench(1, table=table, kinds_wanted=("bf16", *kinds), weights=((256, 128),), attention=False,
                        rows=(1, 64))
    out = capsys.readouterr().out
    for kind in kinds:  # the forms over packed codes at prompt rows only (each call unpacks them)
        assert f"256x128    64 {kind} " in out and (f"256x128     1 {kind} " in out) == (kind == "w4_xla_subchannel")
    assert "failed" not in out and "WRONG" not in out
    assert [(k.kernel, k.bits, k.group, k.rows) for k, _ in table] == [("xla_subchannel", 4, 128, 64),
                                                                      ("xla_subchannel_zp", 4, 128, 64)]
    assert all(times["xla_s"] > 0 and "wrong" not in times for _, times in table) and usual and all(usual)
    # at 1 row bf16 and the int4 codes' kind, at 64 bf16 and the fused kinds, each table kind followed by XLA's path of
    # its QArray
    fused = bench.SUBCHANNEL_FUSION
    assert options == [None, fused, None, fused, fused, None, fused, None]


def test_bench_kernels_times_the_hopper_weight_only_kernel_against_xlas_path(capsys, monkeypatch):
    """w8_hopper and w4_hopper (GPU interpret mode, a tiny weight): timed at prompt rows only, their table entries
    (kernel weight_only_hopper, 8 and 4 bits) against XLA's path of the same int8 codes (w8) / int4 QArray (w4g128)
    timed in the same row; --sweep runs each one's settings there, one it refuses (N 256 is not a multiple of a
    512-column tile) costing its own line."""
    from pallas_kernels.weight_only_hopper import WeightOnlyBlocks

    settings = {8: [dict(blocks=WeightOnlyBlocks(stages=2)), dict(blocks=WeightOnlyBlocks(tile_n=256))],
                4: [dict(blocks=WeightOnlyBlocks(tile_m=64, tile_n=64, tile_k=128, stages=2)),
                    dict(blocks=WeightOnlyBlocks(tile_n=256, tile_k=128))]}
    out, table = _prompt_kind_bench(capsys, monkeypatch, "_weight_only_hopper_sweep", lambda bits: settings[bits],
                                    ("bf16", "w8", "w8_hopper", "w4g128", "w4_hopper"))
    for kind in ("w8_hopper", "w4_hopper"):
        assert f"256x256    64 {kind}" in out and f"256x256     1 {kind}" not in out
        assert out.count(f"sweep {kind} M=64") == 4  # bf16, the defaults, each setting (one failed)
    entries = [(k.bits, k.group, k.rows, t) for k, t in table if k.kernel == "weight_only_hopper"]
    assert [entry[:3] for entry in entries] == [(8, None, 64), (4, 128, 64)]
    assert all(t["xla_s"] > 0 and t["pallas_s"] > 0 for *_, t in entries)
    assert out.count("failed: ValueError: weight_only_hopper:") == 2


def _decode_hopper_bench(capsys, monkeypatch, replaced_kinds, pairs):
    """Run the bench with the Mosaic decode kinds of ``pairs`` ((kind, the kind it replaces), ...) and
    ``replaced_kinds`` at rows 1 and 64 on a tiny weight, with a two-setting sweep (one refused: 3 K splits of 2
    steps); check each kind's rows, its comparison with what it replaces and its sweep; return the table."""
    from pallas_kernels.decode_hopper import DecodeBlocks

    settings = [dict(blocks=DecodeBlocks(stages=2)), dict(blocks=DecodeBlocks(splits=3))]
    kinds = ("bf16", *replaced_kinds, *(kind for kind, _ in pairs))
    out, table = _prompt_kind_bench(capsys, monkeypatch, "_decode_hopper_sweep", lambda k: settings, kinds,
                                    weight=(512, 256), no_settings=("_words_sweep",))
    for kind, replaced in pairs:
        assert f"512x256     1 {kind}" in out and f"512x256    64 {kind}" not in out
        assert f"x {replaced})" in out
        assert out.count(f"sweep {kind} M=1") == 4  # bf16, the defaults, each setting (one failed)
    assert out.count("failed: ValueError: decode_hopper: 3 K splits") == len(pairs)
    return table


def test_bench_kernels_times_the_hopper_decode_kernel_against_what_it_replaces(capsys, monkeypatch):
    """w4_decode_hopper and w8_decode_hopper (GPU interpret mode, a tiny weight): timed at decode rows only, their table
    entries (kernel decode_hopper, 4 and 8 bits) against the faster of the Triton kernel they would replace (w4_words,
    w8_nk, timed in the same row) and XLA's path; --sweep runs each one's settings at one row, one it refuses (3 K
    splits of 2 steps) costing its own line."""
    table = _decode_hopper_bench(capsys, monkeypatch, ("w4g128", "w4_words", "w8_nk"),
                                 (("w4_decode_hopper", "w4_words"), ("w8_decode_hopper", "w8_nk")))
    times = {(k.kernel, k.bits): t for k, t in table if k.rows == 1}
    assert all(times[("decode_hopper", bits)]["pallas_s"] > 0 for bits in (4, 8))
    # the faster of what it replaces (w8_nk's own time is no table entry: K-major kinds are not)
    assert times[("decode_hopper", 4)]["xla_s"] <= times[("int4_words", 4)]["pallas_s"]


def test_bench_kernels_times_the_hopper_w8a8_decode_kernel_against_what_it_replaces(capsys, monkeypatch):
    """w8a8_decode_hopper and fp8_decode_hopper (GPU interpret mode, a tiny weight): timed at decode rows only, their
    table entries (kernels w8a8_decode_hopper / fp8_w8a8_decode_hopper) against the faster of the K-major Triton W8A8
    kernel (w8a8_nk / fp8_nk, timed in the same row) and XLA's path; --sweep runs their settings at one row."""
    table = _decode_hopper_bench(capsys, monkeypatch, ("w8a8_nk", "fp8_nk"),
                                 (("w8a8_decode_hopper", "w8a8_nk"), ("fp8_decode_hopper", "fp8_nk")))
    times = {k.kernel: t for k, t in table if k.rows == 1}
    for kernel in ("w8a8_decode_hopper", "fp8_w8a8_decode_hopper"):
        assert times[kernel]["pallas_s"] > 0 and 0 < times[kernel]["xla_s"]


def test_bench_kernels_attention_step_times_the_kernel_and_xlas_dots(capsys, monkeypatch):
    """The attention step (a small cache here, interpret mode): the Pallas kernel, XLA's dots over the codes and the
    Mosaic GPU kernel for int8 and int4 against bf16 attention at each length, then both kernels over pre-RoPE keys;
    a kv_attention table entry of each width, a kv_attention_hopper one (against the faster of the other two) and a
    kv_attention_hopper_rope one (against the pre-RoPE Pallas kernel); with --sweep, the kernels' other settings at
    the longest length after every length's defaults."""
    from pallas_kernels import config

    bench = _bench_kernels(monkeypatch)
    monkeypatch.setattr(bench, "KV_SHAPE", (1, 2, 4, 256, 128))
    monkeypatch.setattr(bench, "KV_OTHER_CONTEXTS", (4096,))  # longer than KV_SHAPE's: left out (one length here)
    table = []
    with config.interpret(True):
        bench.attention_bench(1, table=table)
    out = capsys.readouterr().out
    for bits in (8, 4):
        for row in ("Pallas default:", "XLA dots over the codes:", "Mosaic GPU default:", "pre-RoPE Pallas default:",
                    "pre-RoPE Mosaic GPU default:"):
            assert out.count(f"int{bits} {row}") == 1, row
    assert "failed" not in out and out.count("decode attention B=1 T=") == 1
    assert "WRONG" not in out and not any("wrong" in times for _, times in table)  # each kernel checked right
    assert [(k.kernel, k.bits, k.k, k.n, k.rows) for k, _ in table] == [
        (kernel, bits, 128, 256, 4) for bits in (8, 4)
        for kernel in ("kv_attention", "kv_attention_hopper", "kv_attention_hopper_rope")]
    hopper = [times for k, times in table if k.kernel == "kv_attention_hopper"]
    others = [times for k, times in table if k.kernel == "kv_attention"]
    assert all(h["xla_s"] == min(o["pallas_s"], o["xla_s"]) for h, o in zip(hopper, others))
    rope = [times["xla_s"] for k, times in table if k.kernel == "kv_attention_hopper_rope"]  # the pre-RoPE kernel's
    assert len(set(rope)) == 2 and not set(rope) & {t for o in others for t in (o["pallas_s"], o["xla_s"])}
    rows_calls = []  # the sweep's order only (its rows are the same function's, run above)
    monkeypatch.setattr(bench, "attention_rows", lambda t, configs, reps, table=None, xla=False, hopper_configs=(),
                        pre_rope=False: rows_calls.append((t, len(configs), xla, len(hopper_configs), pre_rope)))
    monkeypatch.setattr(bench, "KV_OTHER_CONTEXTS", (128, 4096))
    bench.attention_bench(1, sweep=True)
    assert rows_calls[:2] == [(256, 1, True, 0, True), (128, 1, True, 0, True)]  # the Mosaic kernels at defaults
    assert rows_calls[2] == (256, 7, True, 3, False) and len(rows_calls) == 3


def test_bench_kernels_marks_a_kernel_whose_result_is_wrong(capsys, monkeypatch):
    """A kernel whose product is wrong (the word kernel's, halved here) is timed, then named WRONG, and its table
    entry is marked so that dispatch takes XLA's path there however fast it ran; the kinds beside it keep their
    entries unmarked. A broken Triton or Mosaic lowering that only a GPU shows must not win a table by being fast."""
    from llmeq_jax import dispatch_table
    from pallas_kernels import config, int4_words

    bench = _bench_kernels(monkeypatch)
    real = int4_words.int4_words_matmul
    monkeypatch.setattr(int4_words, "int4_words_matmul", lambda *a, **kw: real(*a, **kw) * 0.5)
    table = []
    with config.interpret(True):
        bench.gpu_bench(1, table=table, kinds_wanted=("bf16", "w4g128", "w4_words"), weights=((256, 128),),
                        attention=False, rows=(1,))
    out = capsys.readouterr().out
    assert out.count("WRONG") == 1 and "256x128 M=1 w4_words: WRONG: relative error 0.5" in out
    marked = {k.kernel: times.get("wrong", False) for k, times in table}
    assert marked == {"weight_only": False, "int4_words": True}
    words = next((k, times | {"pallas_s": times["xla_s"] / 10}) for k, times in table if k.kernel == "int4_words")
    read = dispatch_table.from_json(dispatch_table.to_json(words[0].device, [words]))
    assert read.choice(words[0]) == "xla"  # ten times faster, and wrong


def test_bench_kernels_xla_int4_candidates_compute_the_product():
    """The XLA formulations the words step times beside the kernels (int4 as jnp.int4 rows, K-major; per scale
    group) are the int4 weight-only product, not just something to time (the words': tests/pallas_kernels)."""
    from llmeq_jax.core.quantize import Spec, quantize
    from pallas_kernels.weight_only import weight_only_reference

    bench = load_script("bench_kernels")
    w = jax.random.normal(jax.random.key(0), (384, 96)) * 0.02
    q = quantize(w, Spec(bits=4, granularity="group", group_size=bench.GROUP))
    x = jax.random.normal(jax.random.key(1), (3, 384)).astype(jnp.bfloat16)
    want = weight_only_reference(x, q.values(), q.scale, bits=8, group=bench.GROUP).astype(jnp.float32)
    tol = 2e-2 * float(jnp.max(jnp.abs(want)))
    rows = bench.xla_int4_rows(x, q.values().T.astype(jnp.int4), q.scale.T).astype(jnp.float32)
    groups = bench.xla_int4_groups(x, q.values().astype(jnp.int4), q.scale).astype(jnp.float32)
    np.testing.assert_allclose(rows, want, atol=tol)
    np.testing.assert_allclose(groups, want, atol=tol)
    assert float(jnp.max(jnp.abs(want))) > 10 * tol


def test_bench_export_times_ours_and_the_runtime_in_turn():
    """interleaved_medians calls every timer once a round, in turn, and reports each timer's median."""
    be = load_script("bench_export")
    calls = []
    values = {"ours": iter([5.0, 1.0, 3.0]), "runtime": iter([2.0, 9.0, 4.0])}

    def timer(name):
        return lambda: calls.append(name) or next(values[name])

    med = be.interleaved_medians({"ours": timer("ours"), "runtime": timer("runtime")}, rounds=3)
    assert calls == ["ours", "runtime"] * 3
    assert med == {"ours": 3.0, "runtime": 4.0}


def test_bench_export_perplexity_is_the_mean_next_token_nll():
    be = load_script("bench_export")
    logits = np.random.default_rng(0).standard_normal((6, 11)) * 4
    ids = np.array([3, 1, 4, 1, 5, 9])
    want = -np.mean(np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)))[np.arange(5), ids[1:]])
    assert abs(be.mean_nll(logits, ids) - want) < 1e-5


def test_bench_gguf_runs_a_file_kept_and_dequantized(tmp_path):
    """bench_gguf on a real model written as Q8_0 blocks: kept quantized it is smaller, computes the dequantized
    file's logits and perplexity, and both decode timings and the time to a first token come back."""
    from llmeq_jax.core.rules import quantize_params, recipe_from_dict
    from llmeq_jax.export.gguf import write_gguf
    from llmeq_jax.models import load_model
    from tests.shared_data import shared_data_path

    stories = shared_data_path("stories260K.gguf")
    config, params, _ = load_model(stories)
    recipe = recipe_from_dict({"name": "q8", "rules": [  # stories260K's down_proj is 172 wide: no 32-value blocks
        {"pattern": ".*down_proj.*", "skip": True},
        {"pattern": ".*/kernel", "weight": {"bits": 8, "granularity": "group", "group_size": 32}}]})
    path = write_gguf(config, quantize_params(params, recipe), tmp_path / "q8.gguf", source=stories)
    row = load_script("bench_gguf").bench_file(path, rounds=1, n_tokens=16, n_windows=1)
    assert row["types"].get("Q8_0", 0) > 0
    assert row["kept_mb"] < 0.6 * row["float_mb"]
    assert row["rel_logit_diff"] < 1e-5
    assert abs(row["ppl_kept"] / row["ppl_float"] - 1) < 1e-5
    assert row["kept_decode_tok_s"] > 0 and row["float_decode_tok_s"] > 0
    assert 0 < row["kept_first_token_ms"] < 1e3 * 16 / row["kept_prefill_tok_s"] + 1e3
    assert 0 < row["kept_int8_first_token_ms"] < 1e3 * 16 / row["kept_prefill_tok_s"] + 1e3


def test_sweep_decode_times_each_setting_in_turns_and_reports_the_ones_that_fail(tmp_path, capsys, monkeypatch):
    """scripts/sweep_decode.py end to end on one layer of SmolLM2-135M shapes in interpret mode: the bf16 model,
    the recipe's defaults and each setting decode in every round, each under its own override (a setting the
    kernel refuses is reported once and skipped after); the JSON holds the rounds' rates and their medians."""
    from pallas_kernels import settings

    sweep = load_script("sweep_decode")
    seen = []
    real = sweep.decode_rate

    def recording(config, params, prompt, args):
        seen.append(settings.current())
        return real(config, params, prompt, args)

    monkeypatch.setattr(sweep, "decode_rate", recording)
    out = tmp_path / "sweep.json"
    sweep.main(["--shapes", "smollm2-135m", "--layers", "1", "--interpret", "--new-tokens", "8", "--repeats", "1",
                "--prompt-len", "8", "--settings", "int4_words:bn=64,k_splits=2", "int4_words:bk=192", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == ["bf16", "defaults", "int4_words:bn=64,k_splits=2", "int4_words:bk=192"]
    assert all(len(rows[name]["tok_s"]) == 2 and rows[name]["median"] > 0 for name in list(rows)[:3])
    assert "K block must be 128" in rows["int4_words:bk=192"]["error"] and rows["int4_words:bk=192"]["tok_s"] == []
    tried = {"int4_words": settings.Settings(bn=64, k_splits=2)}
    # per round: bf16 and the defaults with no override, then each setting under its own (the failed one once)
    assert [dict(s) for s in seen] == [{}, {}, tried, {"int4_words": settings.Settings(bk=192)}, {}, {}, tried]
    printed = capsys.readouterr().out
    assert "| int4_words:bn=64,k_splits=2 |" in printed and "failed: ValueError" in printed


def test_sweep_decode_times_the_read_ahead_as_a_setting(tmp_path, monkeypatch):
    """``prefetch:mb=N,stream=S`` settings decode under ``pallas_kernels.prefetch.ahead`` (and no kernel setting);
    a bad one fails before any weight is made."""
    from pallas_kernels import prefetch, settings

    sweep = load_script("sweep_decode")
    seen = []
    monkeypatch.setattr(sweep, "decode_rate",
                        lambda *a: seen.append((prefetch.current(), settings.current())) or (1.0, 0.1))
    sweep.main(["--shapes", "smollm2-135m", "--layers", "1", "--interpret", "--rounds", "1", "--settings",
                "prefetch:mb=2,stream=side", "--out", str(tmp_path / "sweep.json")])
    assert seen == [(None, ()), (None, ()), (prefetch.Ahead(2 << 20, "side"), ())]
    with pytest.raises(SystemExit, match="stream must be one of"):
        sweep.main(["--shapes", "smollm2-135m", "--interpret", "--settings", "prefetch:mb=2,stream=l2"])


def test_sweep_decode_times_a_too_quick_decode_again_before_giving_up(monkeypatch):
    """A decode whose steps vanished in the loop's noise (decode_timing's floor) is timed once more with five times
    the runs (a loaded machine); only when that vanishes too is it an error."""
    import types

    from llmeq_jax import generate

    sweep = load_script("sweep_decode")
    timings = iter([(1e-9, 2.0), (0.03, 2.5)])
    runs = []
    monkeypatch.setattr(generate, "decode_timing",
                        lambda config, params, prompt, n, r: runs.append(r) or next(timings))
    args = types.SimpleNamespace(new_tokens=16, repeats=3)
    rate, first = sweep.decode_rate(None, None, jnp.zeros((2, 4)), args)
    assert runs == [3, 15] and rate == 2 * 15 / 0.03 and first == 2.0
    monkeypatch.setattr(generate, "decode_timing", lambda *a: (1e-9, 1.0))
    with pytest.raises(RuntimeError, match="15 decode steps took no measurable time"):
        sweep.decode_rate(None, None, jnp.zeros((2, 4)), args)


def test_sweep_decode_default_settings_are_settings_their_kernels_take():
    from pallas_kernels import settings

    sweep = load_script("sweep_decode")
    for kernel, fields in sweep.DEFAULT_SETTINGS.items():
        for field in fields:
            assert settings.parse(f"{kernel}:{field}")[0] == kernel
    assert set(sweep.DEFAULT_SETTINGS) == {k for kernels in sweep.KERNELS_OF.values() for k in kernels}


def test_sweep_decode_refuses_a_bad_setting_before_making_weights():
    sweep = load_script("sweep_decode")
    with pytest.raises(SystemExit, match=r"unknown field\(s\) tile"):
        sweep.main(["--shapes", "smollm2-135m", "--interpret", "--settings", "int4_words:tile=3"])


def test_bench_kernels_norm_step_times_the_kernel_and_xla_and_writes_entries(tmp_path, capsys):
    """--norms in interpret mode: each feature count and decode row count timed both ways, one rms_norm table
    entry each, written as a table the dispatch reads back. (The times mean nothing here.)"""
    from llmeq_jax import dispatch_table
    from pallas_kernels import config

    bench = load_script("bench_kernels")
    table, path = [], tmp_path / "norms.json"
    with config.interpret(True):
        bench.norm_bench(1, [64, 300], (1, 16, 2048), table, str(path))
    out = capsys.readouterr().out
    assert out.count("rms_norm K=") == 4 and "K=300 M=16" in out and "WRONG" not in out
    read = dispatch_table.from_json(json.loads(path.read_text()))
    key = dispatch_table.Key(jax.devices()[0].device_kind, "rms_norm", 32, None, 300, 300, 16, "bfloat16")
    assert sorted((k.k, k.rows) for k, _ in table) == [(64, 1), (64, 16), (300, 1), (300, 16)]
    assert read.choice(key) in ("pallas", "xla")


def test_bench_kernels_float_attention_step_times_both_paths_and_writes_entries(tmp_path, capsys, monkeypatch):
    """--float-attention in interpret mode (small heads and caches): the write-and-attend kernel and XLA's update
    and attention at each shape, their steps carried in place, one 16-bit kv_attention entry each, written as a
    table the dispatch reads back. (The times mean nothing here.)"""
    from llmeq_jax import dispatch_table
    from pallas_kernels import config

    bench = _bench_kernels(monkeypatch, copies=2)
    monkeypatch.setattr(bench, "FLOAT_KV_HEADS", ((2, 1), (1, 4)))
    monkeypatch.setattr(bench, "FLOAT_KV_CONTEXTS", (32, 64))
    monkeypatch.setattr(bench, "FLOAT_KV_STEPS", 3)
    table, path = [], tmp_path / "float_kv.json"
    with config.interpret(True):
        bench.float_attention_bench(1, table, str(path))
    out = capsys.readouterr().out
    assert out.count("float decode attention") == 4 and "H_kv=1 G=4 T=64" in out
    errors = [float(e) for e in re.findall(r"max \|kernel - XLA\| (\S+)", out)]
    assert len(errors) == 4 and max(errors) < 0.05  # bf16 outputs fed back 3 times: the paths agree
    assert [(k.kernel, k.bits, k.k, k.n, k.rows) for k, _ in table] == [
        ("kv_attention", 16, 128, t, rows) for rows in (1, 4) for t in (32, 64)]
    read = dispatch_table.from_json(json.loads(path.read_text()))
    assert read.choice(table[-1][0]) in ("pallas", "xla")


def test_bench_e2e_puts_a_quantized_kv_caches_decode_beside_the_float_caches():
    """--kv-bits: each row also decodes over a quantized cache (online key ranges from the prompt, the default
    float sinks); the table gives it and its ratio to the row's own float-cache decode."""
    bench = load_script("bench_e2e")
    args = bench.parse_args(["--shapes", "llama-2-7b", "--dtype", "bfloat16", "--kv-bits", "8", "--prompt-len", "4096"])
    kv = bench.kv_quantizer(args.kv_bits, args.prompt_len)
    assert kv.key_ranges is None and kv.spec.bits == 8 and kv.spec.online_keys and kv.spec.prompt_tokens == 4096
    assert kv.spec.sink_tokens == 4 and kv.spec.pre_rope
    row = {"decode_b1": 200.0, "prefill": 1000.0, "compile_s": 1.0, "peak_rss_mib": 1.0}
    rows = {"bf16": row | {"decode_kv": 150.0}, "rtn-w4-g128": row | {"decode_b1": 400.0, "decode_kv": 300.0},
            "rtn-w8": {"error": "boom"}}
    text = bench.table(rows, "bf16", [1])
    assert "decode b1 quantized KV tok/s | vs float KV |" in text
    assert "| 150.0 | 0.75x |" in text and "| 300.0 | 0.75x |" in text
    assert "quantized KV" not in bench.table({"bf16": row}, "bf16", [1])  # no column without a measurement


def test_bench_e2e_sets_each_variants_logits_beside_its_xla_path_and_the_baselines(tmp_path):
    """A variant's probed logits (one prompt position, two decode steps) against the same weights through XLA alone
    and against the baseline's: the largest relative error and the top-1 agreements, in the row and the table; a
    kernel that returns garbage or NaN shows as a large or infinite error."""
    import numpy as np

    bench = load_script("bench_e2e")
    rng = np.random.default_rng(0)
    base = rng.normal(size=(3, 50)).astype(np.float32)
    near = base + 0.01 * rng.normal(size=base.shape).astype(np.float32)
    garbage = rng.normal(size=base.shape).astype(np.float32)
    close = bench.logits_agreement(near, base)
    assert 0 < close["rel_err"] < 0.02 and close["top1"] == 3 and close["positions"] == 3
    assert bench.logits_agreement(garbage, base)["rel_err"] > 1.0
    assert bench.logits_agreement(np.where(base > 0, np.nan, base), base)["rel_err"] == float("inf")
    np.savez(tmp_path / "bf16.logits.npz", kernels=base, xla=base)
    np.savez(tmp_path / "w4.logits.npz", kernels=garbage, xla=near)
    rows = {"bf16": {}, "w4": {}, "torch": {}}
    for name in rows:
        bench.add_logits_agreement(rows[name], bench.logits_path(tmp_path / f"{name}.json"),
                                   bench.logits_path(tmp_path / "bf16.json"))
    assert rows["bf16"]["logits"]["vs_xla"]["rel_err"] == 0 and rows["bf16"]["logits"]["vs_base"]["top1"] == 3
    assert rows["w4"]["logits"]["vs_xla"]["rel_err"] > 1.0 and "logits" not in rows["torch"]
    row = {"decode_b1": 200.0, "prefill": 1000.0, "compile_s": 1.0, "peak_rss_mib": 1.0}
    text = bench.table({name: row | r for name, r in rows.items()}, "bf16", [1])
    assert "| logits vs XLA: max rel. err, top-1 | logits vs bf16 |" in text
    assert "| 0.00 %, 3/3 | 0.00 %, 3/3 |" in text and text.splitlines()[-1].endswith("| – | – |")
    assert "logits vs XLA" not in bench.table({"bf16": row}, "bf16", [1])  # no columns without a probe
