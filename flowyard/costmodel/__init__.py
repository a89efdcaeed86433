"""Cost models: how long a step of a `BatchShape` takes on one serving instance.

    from flowyard.costmodel import make_cost_model, Link, kv_transfer_time
    cm = make_cost_model("llama-3-8b", "h100", tp=1)
    cm.step_time(BatchShape.of([(0, 2048)], []))      # seconds
    cm.layer_op_times(shape)                          # per operator, one layer
    kv_transfer_time(cm, 2048, Link.nvlink("h100"))   # moving that prompt's KV

Names are case-insensitive; unknown names raise `CatalogError` (a ValueError) whose message
lists the valid ones.
"""

from __future__ import annotations

from pathlib import Path

from flowyard.costmodel.base import LAYER_OPS, STEP_OPS, CostModel
from flowyard.costmodel.catalog import CatalogError
from flowyard.costmodel.hardware import (CALIBRATIONS, DEFAULT_CALIBRATION, HARDWARE,
                                         HARDWARE_NAMES, HardwareSpec, RooflineParams,
                                         calibrated, get_hardware)
from flowyard.costmodel.engines import (DEFAULT_ENGINE_PROFILE, engine_profile_names,
                                        get_engine_profile)
from flowyard.costmodel.link import Link, kv_transfer_time
from flowyard.costmodel.models import MODEL_NAMES, MODELS, ModelSpec, get_model
from flowyard.costmodel.roofline import RooflineCostModel

__all__ = [
    "CALIBRATIONS", "DEFAULT_CALIBRATION", "DEFAULT_ENGINE_PROFILE", "engine_profile_names",
    "get_engine_profile", "CatalogError", "CostModel", "HARDWARE", "HARDWARE_NAMES", "HardwareSpec", "LAYER_OPS",
    "Link", "MODELS", "MODEL_NAMES", "ModelSpec", "RooflineCostModel", "RooflineParams",
    "STEP_OPS", "calibrated", "get_hardware", "get_model", "kv_transfer_time", "make_cost_model",
]


def make_cost_model(model: str | Path | ModelSpec, hardware: str | HardwareSpec, tp: int = 1,
                    calibration: str = DEFAULT_CALIBRATION, engine_profile: str | None = None,
                    *, gpu_mem_util: float = 0.9, activation_reserve_bytes: float | None = None,
                    dtype_bytes: int | None = None, **overrides: float) -> RooflineCostModel:
    """The roofline cost model for a model (catalog name, config.json path or spec) on a TP
    group of `tp` GPUs of `hardware`; `calibration` names the factor set (CALIBRATIONS:
    'published', the default, refitted on published GPU measurements, or 'vidur');
    `engine_profile` names the serving stack's host-side costs (costmodel.engines; None: the
    default, today's vLLM; 'published' only); kwargs
    override efficiency factors (see RooflineParams) or pass gpu_mem_util /
    activation_reserve_bytes / dtype_bytes."""
    return RooflineCostModel(get_model(model), calibrated(get_hardware(hardware), calibration,
                                                               engine=engine_profile),
                             tp, gpu_mem_util=gpu_mem_util, activation_reserve_bytes=activation_reserve_bytes,
                             dtype_bytes=dtype_bytes, **overrides)
