"""Graph rewrites that apply a Plan (the runtime milestone fills this package)."""
