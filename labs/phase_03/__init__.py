"""Phase 03 lab starters (generated; see each module's docstring)."""
