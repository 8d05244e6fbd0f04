"""Installing the series on a vLLM installed by pip: in place (`vllm-kvchecksum apply|undo|status`) on
vLLM 0.32.0 or 0.34.0 (series.RELEASES picks the series by the release), or as a patched wheel
(`make wheels`, 0.32.0 only). See docs/install.md.

Imports nothing from vLLM, and nothing from this package's other layers:
it must run where vLLM is not importable (or about to be patched).
"""
