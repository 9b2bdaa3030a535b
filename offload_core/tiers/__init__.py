"""Storage tiers behind one small protocol (`base.Tier`): device, host RAM, files."""

from .base import Pending, Tier, TierContext
from .device import DeviceTier
from .file.tier import FileTier
from .file.fileio import KVFileError, KVWriteError
from .ram import RamTier

__all__ = ["DeviceTier", "FileTier", "KVFileError", "KVWriteError", "Pending", "RamTier", "Tier", "TierContext"]
