"""Phase 09 lab starters (generated; see each module's docstring)."""
