"""``tracecar.client.ray_collectors``, the path job configs and older code name: the module lives in
integrations/ray_collectors.py, and this name is bound to that same module object (so an attribute set or
patched through either name is seen through both)."""

import sys

from .integrations import ray_collectors as _module

sys.modules[__name__] = _module
