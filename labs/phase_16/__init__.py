"""Phase 16 lab starters (generated; see each module's docstring)."""
