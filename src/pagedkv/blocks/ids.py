"""Distinct id types where groups, pools and blocks meet.

A block id indexes one pool's tensors; a pool may serve several groups; a group's index
in the manager is its position in ``KVCacheManager.managers``. Mixing them up is the
classic bug of a multi-group manager, so a type checker keeps them apart (free at run time).
"""

from __future__ import annotations

from typing import NewType

GroupId = NewType("GroupId", int)  # ``Group.id`` of the plan
PoolId = NewType("PoolId", int)  # ``Pool.id`` of the plan (default: the group's id)
BlockId = NewType("BlockId", int)  # index into one pool's blocks (or state slots)
GroupIndex = NewType("GroupIndex", int)  # position of a group's manager, indexes request tables
