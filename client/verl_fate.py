"""``tracecar.client.verl_fate``, the path the previous release and older code name: the module lives in
integrations/verl_fate.py, and this name is bound to that same module object (so an attribute set or
patched through either name is seen through both)."""

import sys

from .integrations import verl_fate as _module

sys.modules[__name__] = _module
