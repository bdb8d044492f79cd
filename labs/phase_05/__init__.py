"""Phase 05 lab starters (generated; see each module's docstring)."""
