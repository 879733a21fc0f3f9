"""The result of `edgeinfer eval`: a JSON-ready dict and a table for people."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from edgeinfer.engine.loading import uses_cpu_gemv
from edgeinfer.eval.scoring import Comparison

if TYPE_CHECKING:
    from edgeinfer.engine.engine import LLMEngine
    from edgeinfer.eval.harness import EvalSettings


@dataclass(frozen=True)
class ModelSide:
    """One side of the comparison: how it was configured and what it costs in memory."""

    quantization: str | None
    lm_head_quantization: str
    calibrated: bool
    gptq: str | None
    kv_cache_dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    cpu_kernels: bool = False  # int8/int4 products through our CPU kernels (int4 as W4A8)

    @classmethod
    def of(cls, engine: LLMEngine, quantization: str | None) -> ModelSide:
        layout = engine.layout
        cfg = engine.config
        return cls(
            quantization,
            cfg.lm_head_quantization,
            cfg.calibrate_quantization,
            cfg.gptq_calibration,
            cfg.kv_cache_dtype,
            layout.weight_bytes,
            layout.kv_bytes_per_token,
            uses_cpu_gemv(engine.model),
        )

    @property
    def label(self) -> str:
        if not self.quantization:
            return f"weights unquantized, KV {self.kv_cache_dtype}"
        head = "" if self.lm_head_quantization == "auto" else f", lm_head {self.lm_head_quantization}"
        calibrated = "" if self.calibrated else ", uncalibrated"
        if self.gptq:
            calibrated = f", GPTQ on {self.gptq}"
        kernels = ", our CPU kernels" if self.cpu_kernels else ""
        return f"weights {self.quantization}{head}{calibrated}{kernels}, KV {self.kv_cache_dtype}"


@dataclass(frozen=True)
class EvalReport:
    settings: EvalSettings
    dtype: str  # the compute dtype both sides ran in
    text_name: str
    text_source: str
    baseline: ModelSide
    test: ModelSide
    baseline_perplexity: float
    comparison: Comparison
    greedy_lengths: list[int]
    seconds: float

    @property
    def greedy_mean(self) -> float | None:
        return sum(self.greedy_lengths) / len(self.greedy_lengths) if self.greedy_lengths else None

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "model": s.engine.model,
            "dtype": self.dtype,
            "text": {"name": self.text_name, "source": self.text_source},
            "tokens": self.comparison.tokens,
            "window": s.window,
            "stride": s.effective_stride,
            "baseline": {**asdict(self.baseline), "perplexity": self.baseline_perplexity},
            "test": {**asdict(self.test), **asdict(self.comparison)},
            "greedy": {
                "prompts": len(self.greedy_lengths),
                "prompt_tokens": s.prefix_tokens,
                "max_tokens": s.greedy_tokens,
                "match_lengths": self.greedy_lengths,
                "mean_match_length": self.greedy_mean,
            },
            "seconds": self.seconds,
        }

    def table(self) -> str:
        s, c, b, t = self.settings, self.comparison, self.baseline, self.test
        g = self.greedy_lengths
        greedy = f"{self.greedy_mean:.1f} mean, min {min(g)} (of {s.greedy_tokens})" if g else "n/a"
        rows = [
            ("weight memory (MiB)", f"{b.weight_bytes / 2**20:,.1f}", f"{t.weight_bytes / 2**20:,.1f}"),
            ("KV bytes per token", f"{b.kv_bytes_per_token:,}", f"{t.kv_bytes_per_token:,}"),
            (
                "perplexity",
                f"{self.baseline_perplexity:.3f}",
                f"{c.perplexity:.3f} ({c.ppl_change:+.2%} ± {c.ppl_change_ci95:.2%})",
            ),
            (
                "KL divergence, nats: mean / p99 / max",
                "0",
                f"{c.kl_mean:.4g} / {c.kl_p99:.4g} / {c.kl_max:.4g}",
            ),
            ("top-1 agreement", "100 %", f"{c.top1_agreement:.2%}"),
            (f"greedy match length, {len(g)} prompts", f"{s.greedy_tokens}", greedy),
        ]
        lines = [
            f"{s.engine.model} ({self.dtype}) on {self.text_name}: {c.tokens} tokens scored, "
            f"window {s.window}, stride {s.effective_stride}, {self.seconds:.0f} s",
            f"| metric | baseline: {b.label} | {t.label} |",
            "|---|---|---|",
            *(f"| {name} | {base} | {test} |" for name, base, test in rows),
        ]
        return "\n".join(lines)
