"""Cache-aware HTTP load balancer. Never imports torch."""

from .compiled import install as _install_compiled_finder

# before any hot-path module is imported: a compiled module runs only while built from its current source
_install_compiled_finder()
