"""This rank's GPU (moved to ``megatron_memguard.runtime.device`` so that the Bridge / Lightning
integrations can use it without installing the Megatron hook); re-exported here for the hook."""
from ..runtime.device import device_properties, gpu_spec_for, local_device_index

__all__ = ["device_properties", "gpu_spec_for", "local_device_index"]
