"""The estimator: model state, activations and overheads per pipeline stage (pure Python, no torch)."""
from .core import PROFILES, estimate
from .result import Estimate, StageEstimate, Term
from .site import DEFAULT_SITE, SiteConstants

__all__ = ["estimate", "Estimate", "StageEstimate", "Term", "PROFILES", "SiteConstants", "DEFAULT_SITE"]
