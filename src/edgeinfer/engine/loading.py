"""Building a ready model from a checkpoint: dtype choice, weights, KV pool sizing."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from edgeinfer.engine.attention.storage import kv_bytes_per_token
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.model.loader import Checkpoint
from edgeinfer.engine.model.loader.base import cast_floating
from edgeinfer.engine.model.registry import build_model
from edgeinfer.engine.quant import kernels
from edgeinfer.engine.quant.apply import quantize_model
from edgeinfer.engine.quant.base import WeightMethod, get_weight_method
from edgeinfer.engine.quant.calibrate import calibration_ids
from edgeinfer.engine.quant.checkpoint import QuantizationConfig, apply_quantized_checkpoint
from edgeinfer.engine.quant.kernels.bf16 import GemvLinear, use_bf16_gemv
from edgeinfer.engine.quant.kv import get_kv_quantizer
from edgeinfer.engine.quant.layers import PreparedModule
from edgeinfer.engine.quant.smoothing import scale_for_quantization

log = logging.getLogger(__name__)

# Our fused modules and the checkpoint modules they are made of, in row order.
FUSED_PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineLayout:
    """Values measured at start-up (never written back into the frozen config)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    weight_bytes: int
    dtype: torch.dtype

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16: fast on modern CPUs and GPUs (fp16 matmuls are ~500x slower on these CPUs)."""
    if name == "auto":
        return torch.bfloat16
    return _DTYPES[name]


def load_model(
    ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, config: EngineConfig | None = None
) -> nn.Module:
    """Build the model, fill its weights and apply weight quantization: a quantized checkpoint
    (compressed-tensors `quantization_config`) loads its stored states as is; `config.quantization` on a
    float checkpoint quantizes at load."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(ckpt.config)
    finally:
        torch.set_default_dtype(previous)
    config = config or EngineConfig(model=str(ckpt.path))
    stored = QuantizationConfig.from_hf(ckpt.config)
    if stored is not None:
        _load_quantized(model, ckpt, stored, config, dtype, device)
    else:
        model.load_weights(ckpt.iter_tensors(_load_dtype(model, dtype)))
        if config.quantization:
            _quantize_float_model(model, ckpt, config, dtype, device)
    if device.type == "cpu" and config.cpu_gemv is not False:
        _use_cpu_gemv(model, required=bool(config.cpu_gemv))
    return model.eval().requires_grad_(False)


def _use_cpu_gemv(model: nn.Module, required: bool) -> None:
    """Move the int8 / int4 layers and the bf16 linear layers onto our CPU kernels. Asked for
    (`required`), a model without such layers or a failed build is an error. By default (auto) the
    int8 / int4 layers switch where the CPU has AVX512-VNNI and bf16 ones where it has AVX2 (below that
    the kernels would run as plain loops, slower than torch's); a failed build leaves torch's kernels
    with a warning, and models with neither (fp32, fp8) never start the build."""
    modules = (m for m in model.modules() if isinstance(m, PreparedModule))
    layers = [m for m in modules if m.method.name in kernels.METHODS]
    if not required:
        layers = layers if kernels.cpu_has_vnni() else []
    float_layers = kernels.count_bf16_linears(model) if required or kernels.cpu_has_avx2() else 0
    if not layers and not float_layers and not required:
        return
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        if not required:
            log.warning("%s; the layers keep torch's kernels", e)
            return
        raise ValueError(f"cpu_gemv: {e}") from None
    switched = sum(m.use_cpu_gemv() for m in layers) + (use_bf16_gemv(model) if float_layers else 0)
    if not switched and required:
        raise ValueError("cpu_gemv: no layer of this model has a form the CPU GEMV kernels read")
    log.info("CPU GEMV kernels (%s): %d layers and expert stacks", torch.ops.edgeinfer_cpu.isa(), switched)
    if layers and not torch.ops.edgeinfer_cpu.has_vnni():
        log.warning("cpu_gemv: no AVX512-VNNI; the int8/int4 kernels run as plain loops, slower than torch")


def uses_cpu_gemv(model: nn.Module) -> bool:
    """Whether any layer of the model multiplies through our CPU kernels."""
    return any(
        isinstance(m, GemvLinear) or (isinstance(m, PreparedModule) and m.kernel in kernels.KERNELS)
        for m in model.modules()
    )


def _quantize_float_model(
    model: nn.Module, ckpt: Checkpoint, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> None:
    method = parse_quantization(config.quantization or "")
    head = head_method(config.lm_head_quantization, method)
    states: dict[str, dict[str, torch.Tensor]] = {}
    if config.calibrate_quantization:
        from edgeinfer.engine.tokenizer import Tokenizer  # the tokenizer pulls in transformers

        tok = Tokenizer.from_checkpoint(ckpt)
        gptq = config.gptq_calibration
        ids = calibration_ids(tok, gptq)
        with torch.no_grad():
            report = scale_for_quantization(
                model, method, ids, tok.bos_token_id, dtype, device, head_method=head, gptq=gptq is not None
            )
        states = report.states
    quantize_model(
        model,
        method,
        quantize_lm_head=head is not None,
        quantize_embeddings=head is not None,
        head_method=head,
        states=states,
    )


def head_method(spec: str, weights: WeightMethod) -> WeightMethod | None:
    """The lm_head / embedding method for `lm_head_quantization` (see EngineConfig); None keeps float."""
    if spec == "none":
        return None
    if spec == "auto":
        return parse_quantization("int8") if weights.name == "int4" else weights
    return parse_quantization(spec)


def _load_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """Models that keep some weights in fp32 whatever the serving dtype (sigmoid MoE routers, as HF does)
    receive every tensor in fp32; copying into a parameter casts to that parameter's dtype."""
    return torch.float32 if getattr(model, "keeps_fp32_weights", False) else dtype


#: what the number after `:` sets per method, and its default when the spec has none
_SPEC_OPTION = {"int4": ("group_size", None), "int8": ("hadamard", 128)}


def parse_quantization(spec: str) -> WeightMethod:
    """`int8` (Hadamard-rotated inputs, blocks of 128; `int8:B` for blocks of B, `int8:0` for none), `fp8`,
    `int4` or `int4:G` (group size G)."""
    name, _, value = spec.partition(":")
    if value and not value.isdigit():
        raise ValueError(f"bad quantization {spec!r}: the number after ':' must be an integer")
    option, default = _SPEC_OPTION.get(name, (None, None))
    if value and option is None:
        raise ValueError(f"bad quantization {spec!r}: {name} takes no ':' option")
    chosen = int(value) if value else default
    return get_weight_method(name, **({option: chosen} if option and chosen is not None else {}))


def _load_quantized(
    model: nn.Module,
    ckpt: Checkpoint,
    stored: QuantizationConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if config.quantization and parse_quantization(config.quantization).name != stored.method:
        raise ValueError(
            f"{ckpt.path} is quantized with {stored.method}; it cannot be served as "
            f"--quantization {config.quantization}"
        )
    tensors = dict(ckpt.iter_tensors(None))  # float8 payloads and fp32 scales stay as stored
    consumed = apply_quantized_checkpoint(model, tensors, stored, fused=FUSED_PARTS, device=device)
    model.load_weights((n, cast_floating(t, dtype)) for n, t in tensors.items() if n not in consumed)


def plan_layout(config: EngineConfig, model: nn.Module, dtype: torch.dtype) -> EngineLayout:
    per_token = kv_bytes_per_token(model.kv_spec, get_kv_quantizer(config.kv_cache_dtype, dtype))
    blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // (per_token * config.block_size))
    max_len = min(config.max_model_len or model.args.max_pos, model.args.max_pos)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())  # quantized states are buffers
    return EngineLayout(blocks, config.block_size, max_len, per_token, weights, dtype)
