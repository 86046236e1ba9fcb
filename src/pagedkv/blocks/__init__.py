"""Run-time block management: pools, prefix cache, per-retention managers, the manager.

Pure Python; imports only the standard library (and ``pagedkv.kvspec`` / ``pagedkv.plan``).
"""

from pagedkv.blocks.checked import CheckedKVCacheManager
from pagedkv.blocks.events import BlockEvent, CopyOp, GroupMetrics, Metrics
from pagedkv.blocks.hashing import HASH_ALGOS, hash_extender, root_hash
from pagedkv.blocks.manager import KVCacheManager, debug_from_env
from pagedkv.blocks.pool import NULL_BLOCK, BlockPool
from pagedkv.blocks.recurrent import CheckpointPolicy
from pagedkv.blocks.spec_decode import draft_block_size, lookahead_tokens

__all__ = [
    "HASH_ALGOS", "NULL_BLOCK", "BlockEvent", "BlockPool", "CheckedKVCacheManager", "CheckpointPolicy", "GroupMetrics", "KVCacheManager",
    "CopyOp", "Metrics", "debug_from_env", "draft_block_size", "hash_extender",
    "lookahead_tokens", "root_hash",
]
