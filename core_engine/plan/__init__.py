"""``infermux plan``: memory and roofline estimates of a model on a device.

:func:`plan_model` reads a GGUF's shapes, describes the device and answers a :class:`Plan`
with one row per weight format x KV dtype (``Plan.row("int4", "int8")``) and the
quantization policy's choice. The parts, one concept each:

* :mod:`~core_engine.plan.devices` - published figures of named GPUs and Apple chips;
* :mod:`~core_engine.plan.probe` - measurements of this CPU or the local GPU;
* :mod:`~core_engine.plan.estimate` - the arithmetic (memory, rooflines);
* :mod:`~core_engine.plan.planner` - :func:`plan_model` and the :class:`Plan` it returns;
* :mod:`~core_engine.plan.report` - the text table and the JSON.

The names below are imported on first use, so that ``core_engine.plan.devices`` (which the
CLI reads for its ``--device`` choices) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core_engine.plan.devices import DEVICE_NAMES, DeviceSpec, Figure
    from core_engine.plan.estimate import PlanRow, WeightInventory
    from core_engine.plan.planner import Plan, PlanChoice, PlanError, PlanInputs, plan_model

__all__ = [
    "DEVICE_NAMES",
    "DeviceSpec",
    "Figure",
    "Plan",
    "PlanChoice",
    "PlanError",
    "PlanInputs",
    "PlanRow",
    "WeightInventory",
    "plan_model",
]

_HOMES = {
    "DEVICE_NAMES": "devices", "DeviceSpec": "devices", "Figure": "devices",
    "PlanRow": "estimate", "WeightInventory": "estimate",
    "Plan": "planner", "PlanChoice": "planner", "PlanError": "planner", "PlanInputs": "planner",
    "plan_model": "planner",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
