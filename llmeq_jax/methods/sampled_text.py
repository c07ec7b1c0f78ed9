"""Text sampled from the float model, as calibration and fine-tuning data beside the calibration text.

GPTQ's Hessians and the ``finetune:`` step see only the directions the calibration text excites; a
quantized model fitted to WikiText loses more on other domains (docs/accuracy.md, tenth pass).
Sequences the float model samples itself (temperature 1 from its BOS token) cover what the model
has learned to write -- prose, code, dialogue -- without any text but the model (the data-free
distillation of LLM-QAT, Liu et al., 2023; self-generated calibration data). A recipe asks for
them with

    calibration: {sampled: 48, seed: 0}     # sampled sequences added to the calibration windows
    finetune: {..., data: mixed}            # methods/distill.py: fine-tune on both, alternating
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from llmeq_jax.methods.blockwise import option, parse_section


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """A recipe's ``calibration:`` mapping."""

    # Sequences sampled from the float model added to the calibration windows (same length).
    sampled: int = option(0, (int,), lambda v: v >= 0, "an integer >= 0")
    seed: int = option(0, (int,), lambda v: v >= 0, "an integer >= 0")


def parse_calibration(data: Any, source: str = "recipe") -> dict | None:
    """Validate a recipe's ``calibration:`` mapping -> a plain dict with every option (None stays None)."""
    return parse_section(CalibrationOptions, data, source, "calibration")


def prompt_token(config) -> int:
    """The token sampled sequences start from: BOS, else the first EOS (a document boundary)."""
    if config.bos_token_id is not None:
        return int(config.bos_token_id)
    if config.eos_token_id is not None:
        return config.eos_ids[0]
    raise ValueError("sampled text starts each sequence at the model's BOS or EOS token, and its config names "
                     "neither (bos_token_id / eos_token_id)")


def sampled_windows(config, params, count: int, seq_len: int, *, seed: int = 0, batch_size: int = 16,
                    progress: bool = False) -> np.ndarray:
    """``count`` sequences [count, seq_len] sampled from the float model at temperature 1 after one
    :func:`prompt_token`. Deterministic for a ``seed``."""
    from llmeq_jax.generate import generate

    start = prompt_token(config)
    out = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=count, desc="sample text from the float model", unit="seq")
    for i in range(0, count, batch_size):
        prompt = np.full((min(batch_size, count - i), 1), start, np.int32)
        new = generate(config, params, prompt, seq_len - 1, greedy=False, temperature=1.0, seed=seed + i)
        out.append(np.concatenate([prompt, np.asarray(new, np.int32)], axis=1))
        if bar is not None:
            bar.update(len(prompt))
    if bar is not None:
        bar.close()
    return np.concatenate(out)


def with_sampled(config, params, windows: np.ndarray, options: dict | None, progress: bool = False) -> np.ndarray:
    """The calibration ``windows`` [N, T] followed by the recipe's ``calibration.sampled`` sequences of T tokens."""
    if not options or not options["sampled"]:
        return windows
    # A seed apart from the fine-tuning's (sample_seed counts up from its own start): other sequences
    sampled = sampled_windows(config, params, options["sampled"], windows.shape[1], seed=options["seed"] + 1_000_003,
                              progress=progress)
    return np.concatenate([windows, sampled.astype(windows.dtype)])


__all__ = ["CalibrationOptions", "parse_calibration", "prompt_token", "sampled_windows", "with_sampled"]
