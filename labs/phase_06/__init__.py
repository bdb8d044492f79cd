"""Phase 06 lab starters (generated; see each module's docstring)."""
