"""Let vLLM 0.32's stock MooncakeConnector start on a CPU-only torch.

``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``, which
raises on a CPU build ("Cannot access accelerator device when none is available"). Nothing
else in the connector needs an accelerator, so device 0 is substituted for the duration of that
constructor only. Loaded through ``"kv_connector_module_path": "cpu_mooncake_shim"``.
"""

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector

_StockWorker = mooncake_connector.MooncakeConnectorWorker


class CpuMooncakeConnectorWorker(_StockWorker):  # type: ignore[misc, valid-type]
    def __init__(self, *args: object, **kwargs: object) -> None:
        stock = torch.accelerator.current_device_index
        if torch.accelerator.current_accelerator() is None:
            torch.accelerator.current_device_index = lambda *a, **k: 0
        try:
            super().__init__(*args, **kwargs)
        finally:
            torch.accelerator.current_device_index = stock


mooncake_connector.MooncakeConnectorWorker = CpuMooncakeConnectorWorker
MooncakeConnector = mooncake_connector.MooncakeConnector
