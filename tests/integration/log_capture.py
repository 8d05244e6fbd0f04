"""caplog for vLLM's loggers, which do not propagate to the root logger.

A module of its own (not conftest): a test that imports `conftest` by name
gets whichever conftest.py pytest imported first, which depends on the order
the test files are collected in.
"""

import contextlib
import logging


@contextlib.contextmanager
def capture_logger(caplog, name: str):
    """caplog gets logger `name`'s records, debug level and up, in the block."""
    logger = logging.getLogger(name)
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
    caplog.handler.setLevel(logging.DEBUG)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        logger.setLevel(old)
        logger.removeHandler(caplog.handler)
