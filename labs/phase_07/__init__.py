"""Phase 07 lab starters (generated; see each module's docstring)."""
