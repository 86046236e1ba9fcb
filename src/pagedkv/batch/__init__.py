"""Per-step attention metadata: one object per block-table group, one view per attention
group (causal or not for this invocation, its own decode/prefill split).

Tensor conventions (shared with ``pagedkv.ops``) are in :mod:`pagedkv.batch.metadata`.
``build_metadata`` builds a step from scratch; ``MetadataBuilder`` keeps the live requests'
block tables on the host between steps and builds the same arrays from them, faster.
Needs torch and numpy.
"""

from pagedkv.batch.builder import build_metadata
from pagedkv.batch.checked import checked_mode, validate_group_arrays, validate_group_metadata
from pagedkv.batch.incremental import MetadataBuilder
from pagedkv.batch.inputs import ScheduledRequest
from pagedkv.batch.metadata import GroupMetadata, StepMetadata
from pagedkv.batch.views import AttentionGroup, AttentionView, attention_view

__all__ = [
    "AttentionGroup", "AttentionView", "GroupMetadata", "MetadataBuilder", "ScheduledRequest",
    "StepMetadata",
    "attention_view", "build_metadata", "checked_mode", "validate_group_arrays",
    "validate_group_metadata",
]
