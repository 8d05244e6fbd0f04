"""Installing the series on a vLLM v0.32.0 installed by pip: in place (`vllm-kvchecksum apply|undo|status`)
or as a patched wheel (`make wheels`). See docs/install.md.

Imports nothing from vLLM, and nothing from this package's other layers:
it must run where vLLM is not importable (or about to be patched).
"""
