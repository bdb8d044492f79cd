"""Phase 18 lab starters (generated; see each module's docstring)."""
