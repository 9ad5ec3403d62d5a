"""Dashboard panels: one module each; every panel has one `show(stats)` that formats the engine's snapshot."""
