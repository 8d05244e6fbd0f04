"""The vLLM-free core: the checksum definition, the views and kernels that compute it, the rows and
host copies they fill, and the payload, block rule and comparison that judge a transfer.

Nothing here imports vLLM (tests/unit/test_package_layers.py), so it runs on a GPU host without
vLLM, and the engine side and the drills build on it.
"""
