"""GPU utilisation and memory, exported only when torch is already loaded and sees a CUDA device."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class GpuCollector(Collector):
    """`edgeinfer:gpu_utilization_perc` and `edgeinfer:gpu_memory_used_bytes` per device.

    torch is looked up in `sys.modules` rather than imported: a node with no local engine never loads
    torch, and then it has no GPU of ours to report on either.
    """

    def collect(self) -> Iterable[Metric]:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return
        util = GaugeMetricFamily("edgeinfer:gpu_utilization_perc", "GPU busy fraction.", labels=["device"])
        mem = GaugeMetricFamily("edgeinfer:gpu_memory_used_bytes", "GPU memory reserved.", labels=["device"])
        for index in range(torch.cuda.device_count()):
            # Needs NVML (pynvml); when it is missing or the driver refuses, only memory is reported.
            with contextlib.suppress(Exception):
                util.add_metric([str(index)], torch.cuda.utilization(index) / 100.0)
            mem.add_metric([str(index)], float(torch.cuda.memory_reserved(index)))
        yield util
        yield mem
