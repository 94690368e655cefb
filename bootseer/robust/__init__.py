"""Robust training, the per-node pieces: what detectors emit (:mod:`.events`), crash
classification (:mod:`.classify`), detection from heartbeats (:mod:`.detect`), stack
aggregation and the failure domain to evict (:mod:`.stacks`), the action per failure class
and the exclusion list (:mod:`.policy`), and ETTR from traces (:mod:`.ettr`).

Each module is a library fed with plain records, so the controller across nodes (not built
yet) only wires them together. See docs/robust.md.
"""
