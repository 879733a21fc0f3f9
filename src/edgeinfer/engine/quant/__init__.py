"""engine/quant room: weight methods (int8, int4, fp8) and KV-cache quantizers (lossy); the lossless bf16
codec is a storage format and lives with the loaders (`engine/model/loader/codec`). docs/quantization.md
describes formats and error bounds."""

from edgeinfer.engine.quant.apply import quantize_model
from edgeinfer.engine.quant.base import (
    PreparedWeight,
    QuantizationError,
    WeightMethod,
    get_weight_method,
    register_weight_method,
    weight_methods,
)
from edgeinfer.engine.quant.checkpoint import (
    QuantizationConfig,
    apply_quantized_checkpoint,
    load_quantized_linear_state,
)
from edgeinfer.engine.quant.experts import QuantizedExperts, experts_from_state, quantize_expert_weights
from edgeinfer.engine.quant.kv import KV_CACHE_DTYPES, KVQuantizer, get_kv_quantizer
from edgeinfer.engine.quant.layers import QuantEmbedding, QuantLinear

__all__ = [
    "KV_CACHE_DTYPES",
    "KVQuantizer",
    "PreparedWeight",
    "QuantEmbedding",
    "QuantLinear",
    "QuantizationConfig",
    "QuantizationError",
    "QuantizedExperts",
    "WeightMethod",
    "apply_quantized_checkpoint",
    "experts_from_state",
    "get_kv_quantizer",
    "get_weight_method",
    "load_quantized_linear_state",
    "quantize_expert_weights",
    "quantize_model",
    "register_weight_method",
    "weight_methods",
]
