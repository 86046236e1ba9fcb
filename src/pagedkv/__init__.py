"""pagedkv: the KV-cache layer of an LLM inference engine.

Layers (arrows point down): cli -> engine -> ops/batch -> blocks -> plan -> models -> spec.
The core (spec, errors, models, plan, blocks) needs only the standard library.
"""

__version__ = "0.1.0"
