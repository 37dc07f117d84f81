"""``memguard calibrate``: learn a site's physical constants from its own runs (docs/calibrate.md)."""
from .core import MIN_RUNS, CalibrationResult, TooLittleData, calibrate
from .model import CalibrationRun, Observation

__all__ = ["calibrate", "CalibrationResult", "CalibrationRun", "Observation", "TooLittleData", "MIN_RUNS"]
