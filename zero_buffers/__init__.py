"""zero_buffers: keep PyTorch module buffers correct across ranks (DeepSpeed ZeRO-3, FSDP2, DDP, Accelerate)."""

__version__ = "0.5.0"

from .bn.average import average_bn_stats
from .bn.recompute import recompute_bn_stats
from .broadcast import broadcast_buffers
from .doctor.repair import RepairResult, recover_checkpoint, repair_checkpoint
from .doctor.report import CheckpointReport, checkpoint_report
from .errors import (
    BuffersOutOfSyncError,
    BufferStructureError,
    CheckpointError,
    CollectiveError,
    DeepSpeedUnavailableError,
    DependencyError,
    DistributedSetupError,
    InvalidArgumentError,
    InvalidSourceRankError,
    RecomputeError,
    SyncAbortedError,
    UnsupportedDeviceError,
    ZeroBuffersError,
    ZeroBuffersWarning,
)
from .moe.gates import register_gate
from .moe.router_bias import RouterBias, router_bias
from .precision.keep import Kept, keep_precision
from .report import BufferReport, BufferRow, assert_buffers_in_sync, buffer_report
from .training.keep_in_sync import KeepInSync, keep_in_sync
from .training.rules import register_rules
from .training.save_hooks import SaveHook, sync_buffers, sync_buffers_on_save
from .zero3.frozen_replica import frozen_replica, is_frozen_replica
from .zero3.gathered import GatheredParametersAndBuffers
from .zero3.no_zero_init import no_zero_init
from .zero3.zero_init import Init, install, installed, uninstall

__all__ = [
    "BufferReport",
    "BufferRow",
    "BufferStructureError",
    "BuffersOutOfSyncError",
    "CheckpointError",
    "CheckpointReport",
    "CollectiveError",
    "DeepSpeedUnavailableError",
    "DependencyError",
    "DistributedSetupError",
    "GatheredParametersAndBuffers",
    "Init",
    "InvalidArgumentError",
    "InvalidSourceRankError",
    "KeepInSync",
    "Kept",
    "RecomputeError",
    "RepairResult",
    "RouterBias",
    "SaveHook",
    "SyncAbortedError",
    "UnsupportedDeviceError",
    "ZeroBuffersError",
    "ZeroBuffersWarning",
    "__version__",
    "assert_buffers_in_sync",
    "average_bn_stats",
    "broadcast_buffers",
    "buffer_report",
    "checkpoint_report",
    "frozen_replica",
    "install",
    "installed",
    "is_frozen_replica",
    "keep_in_sync",
    "keep_precision",
    "no_zero_init",
    "recompute_bn_stats",
    "recover_checkpoint",
    "register_gate",
    "register_rules",
    "repair_checkpoint",
    "router_bias",
    "sync_buffers",
    "sync_buffers_on_save",
    "uninstall",
]
