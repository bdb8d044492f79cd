"""Phase 01 lab starters (generated; see each module's docstring)."""
