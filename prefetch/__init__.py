"""prefetch: see docs/ and DESIGN.md; not built yet."""
