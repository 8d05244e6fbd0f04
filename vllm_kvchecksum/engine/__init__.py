"""The engine side: what vLLM's scheduler, workers, model runner and connectors call through the
patches (patches/), with the plans, records, metrics and logs behind those hooks.

Builds on the core; never on the drills.
"""
