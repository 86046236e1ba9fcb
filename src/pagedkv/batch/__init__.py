"""Per-step attention metadata: one object per block-table group, one view per attention
group (causal or not for this invocation, its own decode/prefill split).

Tensor conventions (shared with ``pagedkv.ops``) are in :mod:`pagedkv.batch.metadata`.
Needs torch and numpy.
"""

from pagedkv.batch.builder import build_metadata
from pagedkv.batch.checked import checked_mode, validate_group_arrays, validate_group_metadata
from pagedkv.batch.inputs import ScheduledRequest
from pagedkv.batch.metadata import GroupMetadata, StepMetadata
from pagedkv.batch.views import AttentionGroup, AttentionView, attention_view

__all__ = [
    "AttentionGroup", "AttentionView", "GroupMetadata", "ScheduledRequest", "StepMetadata",
    "attention_view", "build_metadata", "checked_mode", "validate_group_arrays",
    "validate_group_metadata",
]
