"""snapshot: dependency environments installed once, snapshotted, restored everywhere.

See docs/snapshot.md. The public API is re-exported here once the modules exist.
"""

FORMAT_VERSION = 1
"""Version of the snapshot format (tar stream cut into zstd chunks + manifest); part of the key."""
