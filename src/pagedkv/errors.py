"""Exception hierarchy.

Every check that a caller, a config or data can trigger raises one of these (never an
``assert``, which ``python -O`` deletes). Messages carry the offending values.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class ConfigError(PagedKVError):
    """A model config (or a layer description) is malformed or lacks a needed field."""


class UnknownModelError(ConfigError):
    """A model name is neither in the catalog nor a readable path."""


class UnsupportedArchitectureError(ConfigError):
    """The config's architecture cannot be read into layer specs (never guessed)."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument is out of range or malformed (sizes, block sizes, parallelism...)."""


class IncompatibleLayersError(PagedKVError):
    """Layers were asked to share a block table (or a pool) that they cannot share."""


class DoesNotFitError(PagedKVError):
    """The memory budget cannot hold what was asked (e.g. one request at max_model_len)."""


class OutOfBlocksError(PagedKVError):
    """A block pool has no free block left for an allocation."""


class RequestTooLargeError(PagedKVError):
    """A request can never fit in the planned cache, however long it waits."""


class CacheCorruptedError(PagedKVError):
    """A block-manager invariant is broken; the manager refuses further calls."""


class TraceError(PagedKVError):
    """A workload trace line is malformed (the message names the line)."""


class UnsupportedCapabilityError(PagedKVError):
    """An invocation needs a capability its attention group or kernel does not declare."""


class MetadataError(PagedKVError):
    """Per-step attention metadata is inconsistent (checked mode)."""


class IncompatibleDrafterError(ConfigError):
    """A drafter cannot belong to its target (layer ids, hidden size, vocabulary, latent)."""


class DeviceMemoryError(PagedKVError):
    """A device-memory call (CUDA virtual memory: reserve, create, map, unmap) failed; the
    message names the call, its arguments and the driver's error."""

class CheckpointError(PagedKVError):
    """A checkpoint folder cannot be read (no config.json, no weights, bad index file)."""


class WeightError(CheckpointError):
    """Checkpoint tensors do not match the model: missing, misshapen or unknown names."""


class RequestError(PagedKVError, ValueError):
    """One request is malformed (empty or out-of-vocabulary prompt, prompt too long)."""
