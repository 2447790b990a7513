"""How values move between replicas: in-process cross-device ops and cross-process collectives."""

from phalanx.communication.local.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "select_cross_device_ops",
]
