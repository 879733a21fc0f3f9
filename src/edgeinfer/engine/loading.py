"""Building a ready model from a checkpoint: dtype choice, weights, KV pool sizing."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from edgeinfer.engine import kernels
from edgeinfer.engine.attention.oneshot import prefill_hidden
from edgeinfer.engine.attention.storage import kv_block_bytes, kv_bytes_per_token
from edgeinfer.engine.cache_dir import cache_root
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.kernels import ops
from edgeinfer.engine.kernels.bf16 import GemvLinear, use_bf16_gemv
from edgeinfer.engine.kernels.lossless import LosslessLinear, use_lossless
from edgeinfer.engine.kv_cache import KVGroups, plan_groups
from edgeinfer.engine.kv_cache.groups import mirror_groups
from edgeinfer.engine.model.loader import Checkpoint
from edgeinfer.engine.model.loader.base import cast_floating
from edgeinfer.engine.model.moe import FusedExperts
from edgeinfer.engine.model.moe_lm import MoeCausalLM
from edgeinfer.engine.model.registry import build_model
from edgeinfer.engine.model.skip_init import SkipInit
from edgeinfer.engine.prepared import PreparedCache, entry_key, source_digest
from edgeinfer.engine.quant.apply import quantize_model
from edgeinfer.engine.quant.base import WeightMethod, get_weight_method
from edgeinfer.engine.quant.calibrate import calibration_ids
from edgeinfer.engine.quant.checkpoint import QuantizationConfig, apply_quantized_checkpoint
from edgeinfer.engine.quant.kv import get_kv_quantizer
from edgeinfer.engine.quant.layers import PreparedModule
from edgeinfer.engine.quant.smoothing import SmoothReport, scale_for_quantization

if TYPE_CHECKING:
    from edgeinfer.engine.tokenizer import Tokenizer

    TokenizerSource = Callable[[], Tokenizer]

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
    kv_bytes_per_token: int  # one token in every layer (the draft model's too)
    weight_bytes: int  # resident weights (the draft model's too)
    dtype: torch.dtype
    kv_groups: KVGroups  # which layers share a block table (kv_cache/groups.py)
    kv_block_bytes: int  # one block: block_size tokens of the kv_groups.slots layers it holds (+ the draft's)

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_block_bytes


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16: fast on modern CPUs and GPUs (fp16 matmuls are far slower on CPUs)."""
    if name == "auto":
        return torch.bfloat16
    return _DTYPES[name]


def load_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    config: EngineConfig | None = None,
    tokenizer: TokenizerSource | None = None,
) -> nn.Module:
    """Build the model, fill its weights and apply weight quantization: a quantized checkpoint
    (compressed-tensors `quantization_config`) loads its stored states as is; `config.quantization` on a
    float checkpoint quantizes at load. On CPU the result is kept in the prepared-form cache
    (engine/prepared), and a later load with the same source and settings memory-maps it instead.
    `tokenizer` gives the checkpoint's tokenizer where calibration needs one (the engine's own, being read
    meanwhile); without it calibration reads one itself."""
    config = config or EngineConfig(model=str(ckpt.path))
    cache, key = _prepared_cache(ckpt, dtype, device, config)
    skeleton = partial(_build, ckpt, dtype, torch.device("meta"), config.mla_mode)  # what the cache fills
    model = cache.load(key, skeleton) if cache else None
    if model is not None and not _kernels_ready(model, config):
        model = None
    if model is None:
        model = _load_fresh(ckpt, dtype, device, config, tokenizer)
        # a model left on torch's kernels because ours did not build here is not what the key stands for
        if cache and (uses_cpu_gemv(model) or not _kernels_expected(model, config, device)):
            cache.save(key, model, skeleton())
    return model.eval().requires_grad_(False)


# torch's default dtype is process-wide: two engines building at once (the pool loads in worker threads)
# would each switch it under the other, so building holds this lock.
_DEFAULT_DTYPE_LOCK = threading.Lock()


def _build(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, mla_mode: str) -> nn.Module:
    with _DEFAULT_DTYPE_LOCK:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device), SkipInit() if device.type == "meta" else contextlib.nullcontext():
                return build_model(ckpt.config, mla_mode)
        finally:
            torch.set_default_dtype(previous)


def _load_fresh(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    config: EngineConfig,
    tokenizer: TokenizerSource | None,
) -> nn.Module:
    model = _build(ckpt, dtype, device, config.mla_mode)
    stored = QuantizationConfig.from_hf(ckpt.config)
    if stored is not None:
        _load_quantized(model, ckpt, stored, config, dtype, device)
    else:
        _load_float_weights(model, ckpt, dtype, config)
        if config.quantization:
            _quantize_float_model(model, ckpt, config, dtype, device, tokenizer)
        elif _wants_lossless(ckpt, config, dtype, device):
            _use_lossless(model, required=config.weights == "lossless")
    if _wants_cpu_gemv(config, device):
        _use_cpu_gemv(model, required=bool(config.cpu_gemv))
    return model


def _wants_lossless(ckpt: Checkpoint, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> bool:
    return config.lossless_weights(ckpt.format) and dtype == torch.bfloat16 and device.type == "cpu"


def _use_lossless(model: nn.Module, required: bool) -> None:
    """Put the bf16 matrices into the lossless resident form (kernels/lossless.py). Asked for (`required`),
    kernels that do not build are an error; by default (an `.eiz` checkpoint) the model stays in bf16 with a
    warning."""
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        if required:
            raise ValueError(f"weights lossless: {e}") from None
        log.warning("%s; the weights stay in bf16", e)
        return
    before = weight_bytes(model)
    swapped = use_lossless(model)
    swapped += sum(m.use_lossless() for m in model.modules() if isinstance(m, FusedExperts))
    log.info(
        "lossless weights: %d modules; weights %.1f MiB -> %.1f MiB",
        swapped,
        before / 2**20,
        weight_bytes(model) / 2**20,
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in memory, each tensor once (lossless forms are buffers)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _wants_cpu_gemv(config: EngineConfig, device: torch.device) -> bool:
    """Whether the load tries our kernels (which layers take them depends on the CPU's features)."""
    return device.type == "cpu" and config.cpu_gemv is not False


def _kernels_expected(model: nn.Module, config: EngineConfig, device: torch.device) -> bool:
    """Whether this CPU would run some layer of `model` on our kernels. Not expected (a CPU without
    AVX2 keeps every layer on torch's kernels) is as the cache key, which holds the CPU's
    features, says; expected but not in use means the build failed."""
    if not _wants_cpu_gemv(config, device):
        return False
    layers, float_layers = _kernel_targets(model, bool(config.cpu_gemv))
    return bool(config.cpu_gemv or layers or float_layers)


def _kernel_targets(model: nn.Module, required: bool) -> tuple[list[PreparedModule], int]:
    """The int8 / int4 layers our kernels take and the number of bf16 linear layers they would: asked for
    (`required`), all of them; by default (auto) all of them where the CPU has AVX2 (below that the kernels
    would run as plain loops, slower than torch's)."""
    wanted = required or kernels.cpu_has_avx2()
    layers = _gemv_layers(model) if wanted else []
    float_layers = kernels.count_bf16_linears(model) if wanted else 0
    return layers, float_layers


def _gemv_layers(model: nn.Module) -> list[PreparedModule]:
    modules = (m for m in model.modules() if isinstance(m, PreparedModule))
    return [m for m in modules if m.method.name in kernels.METHODS]


def _prepared_cache(
    ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, config: EngineConfig
) -> tuple[PreparedCache | None, str]:
    """The cache and this load's entry key; no cache off the CPU (entries are memory-mapped host
    tensors) or when `config.prepared_cache` is off."""
    if not config.prepared_cache or device.type != "cpu":
        return None, ""
    root = Path(config.cache_dir).expanduser() if config.cache_dir else cache_root()
    settings = {
        "dtype": str(dtype),
        "device": str(device),
        "quantization": config.quantization,
        "lm_head_quantization": config.lm_head_quantization,
        "lossless": _wants_lossless(ckpt, config, dtype, device),
        # what the load decides from (the layouts differ with the kernels chosen)
        "cpu_gemv": [config.cpu_gemv, kernels.cpu_has_vnni(), kernels.cpu_has_avx2()],
        "calibrate": config.calibrate_quantization,
        "gptq": config.gptq_calibration,
    }
    key = entry_key(source_digest(Path(ckpt.path), root), settings)
    return PreparedCache(root / "prepared"), key


def _kernels_ready(model: nn.Module, config: EngineConfig) -> bool:
    """A cached model in our kernels' layout needs them loaded; where they no longer build, load afresh."""
    if not uses_cpu_gemv(model):
        return True
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        if config.cpu_gemv:
            raise ValueError(f"cpu_gemv: {e}") from None
        log.warning("%s; loading afresh with torch's kernels", e)
        return False
    return True


def _use_cpu_gemv(model: nn.Module, required: bool) -> None:
    """Move the int8 / int4 layers and the bf16 linear layers onto our CPU kernels (which ones:
    `_kernel_targets`). Asked for (`required`), a model without such layers or a failed build is an error;
    by default (auto) a failed build leaves torch's kernels with a warning, and models with neither (fp32,
    fp8) never start the build."""
    layers, float_layers = _kernel_targets(model, required)
    if not layers and not float_layers and not required:
        return
    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        if not required:
            log.warning("%s; the layers keep torch's kernels", e)
            return
        raise ValueError(f"cpu_gemv: {e}") from None
    switched = sum(m.use_cpu_gemv() for m in layers)
    if float_layers:
        switched += use_bf16_gemv(model)
    if not switched and required:
        raise ValueError("cpu_gemv: no layer of this model has a form the CPU GEMV kernels read")
    log.info("CPU GEMV kernels (%s): %d layers and expert stacks", ops.isa(), switched)
    if ops.isa() == "scalar":
        log.warning("cpu_gemv: no AVX2; the kernels run as plain loops, slower than torch's")


def uses_cpu_gemv(model: nn.Module) -> bool:
    """Whether any layer of the model multiplies through our CPU kernels."""
    return any(
        isinstance(m, (GemvLinear, LosslessLinear))
        or (isinstance(m, PreparedModule) and m.kernel in kernels.KERNELS)
        for m in model.modules()
    )


def _quantize_float_model(
    model: nn.Module,
    ckpt: Checkpoint,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: TokenizerSource | None,
) -> None:
    method = parse_quantization(config.quantization or "")
    head = head_method(config.lm_head_quantization, method)
    states: dict[str, dict[str, torch.Tensor]] = {}
    if config.calibrate_quantization:
        gptq = config.gptq_calibration
        report = calibrate(model, ckpt, method, dtype, device, gptq, head=head, tokenizer=tokenizer)
        states = report.states
    quantize_model(
        model,
        method,
        quantize_lm_head=head is not None,
        quantize_embeddings=head is not None,
        head_method=head,
        states=states,
    )


def calibrate(
    model: nn.Module,
    ckpt: Checkpoint,
    method: WeightMethod,
    dtype: torch.dtype,
    device: torch.device,
    gptq: str | None,
    skip: Callable[[str], bool] = lambda name: False,
    head: WeightMethod | None = None,
    tokenizer: TokenizerSource | None = None,
) -> SmoothReport:
    """Scale the float model's layer inputs for `method` (and the lm_head's for a `head` method) on its
    activations over the calibration text, each window a one-shot prefill; with `gptq` (its text) int4
    layers are rounded by GPTQ."""
    from edgeinfer.engine.tokenizer import Tokenizer  # the tokenizer pulls in transformers

    tok = tokenizer() if tokenizer is not None else Tokenizer.from_checkpoint(ckpt)
    ids = calibration_ids(tok, gptq)
    prefill = partial(prefill_hidden, model, dtype=dtype, device=device)
    with torch.no_grad():
        return scale_for_quantization(
            model, method, ids, tok.bos_token_id, prefill, skip, head_method=head, gptq=gptq is not None
        )


def head_method(spec: str, weights: WeightMethod) -> WeightMethod | None:
    """The lm_head / embedding method for `lm_head_quantization` (see EngineConfig); None keeps float."""
    if spec == "none":
        return None
    if spec == "auto":
        return parse_quantization("int8") if weights.name == "int4" else weights
    return parse_quantization(spec)


def _load_float_weights(model: nn.Module, ckpt: Checkpoint, dtype: torch.dtype, config: EngineConfig) -> None:
    """Fill the model from a float checkpoint. To be quantized, a MoE quantizes each expert stack as soon as
    it is filled, so it never holds a float copy of every expert; calibration (which leaves the experts
    alone) then runs through the quantized experts, as the served model will."""
    tensors = ckpt.iter_tensors(_load_dtype(model, dtype))
    if config.quantization and isinstance(model, MoeCausalLM):
        model.load_weights(tensors, expert_method=parse_quantization(config.quantization))
    else:
        model.load_weights(tensors)


def _load_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype | None:
    """Models that keep some weights in fp32 whatever the serving dtype (sigmoid MoE routers, as HF does)
    receive every tensor as stored (None): copying into a parameter casts to that parameter's dtype, so the
    fp32 ones are not rounded, and no fp32 copy of each bf16 tensor is made on the way."""
    return None if getattr(model, "keeps_fp32_weights", False) else dtype


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


def plan_layout(
    config: EngineConfig, model: nn.Module, dtype: torch.dtype, draft: nn.Module | None = None
) -> EngineLayout:
    """The KV budget in blocks of one shared pool: each block holds one KV group's layers (the same count
    in every group), so blocks that long sequences give back from windowed groups serve anyone. A draft
    model (speculative decoding) keeps its KV in storage indexed by the same blocks (kv_cache/groups.py
    `mirror_groups`), so a block costs both models' bytes and the budget holds fewer of them."""
    spec, quantizer = model.kv_spec, get_kv_quantizer(config.kv_cache_dtype, dtype)
    max_len = min(config.max_model_len or model.args.max_pos, model.args.max_pos)
    groups = plan_groups(spec.layer_windows(), max_len, config.hybrid_kv_cache)
    block_bytes = kv_block_bytes(spec, quantizer, config.block_size, groups)
    per_token, weights = kv_bytes_per_token(spec, quantizer), weight_bytes(model)
    if draft is not None:
        mirrored = mirror_groups(groups, draft.kv_spec.layer_windows(), max_len, config.hybrid_kv_cache)
        block_bytes += kv_block_bytes(draft.kv_spec, quantizer, config.block_size, mirrored)
        per_token += kv_bytes_per_token(draft.kv_spec, quantizer)
        weights += weight_bytes(draft)
    blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // block_bytes)
    return EngineLayout(blocks, config.block_size, max_len, per_token, weights, dtype, groups, block_bytes)
