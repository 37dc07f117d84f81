"""A CPU memory source that remembers every reading it hands out, so a test can compare what the
monitor logged with what was measured."""
from megatron_memguard.runtime import LiveBytesSource, Reading


class RecordingSource(LiveBytesSource):
    def __init__(self):
        super().__init__()
        self.readings = []

    def read(self) -> Reading:
        r = super().read()
        self.readings.append(r.to_dict())
        return r
